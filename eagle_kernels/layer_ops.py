"""Fused per-layer ops: RMSNorm (+ residual add), SiLU-and-mul, RoPE (+ KV-cache write).

On the CPU each is one C++ call (csrc/cpu_layer_ops.cpp); the torch versions below serve other devices,
tensors that need a gradient (draft-head training), and the tests as the reference. Both compute in fp32
with the Hugging Face Llama's rounding points for 16-bit dtypes.
"""
import torch
import torch.nn.functional as F

from ._ops import has_kernel, ops
from .attention import write_kv

_CPU_OPS = has_kernel("rms_norm", torch.device("cpu"))  # looked up once: the dispatcher query is slow


def _cpu_kernel(*tensors) -> bool:
    """Whether the C++ op may run: CPU tensors and no autograd graph to record."""
    if not _CPU_OPS or tensors[0].device.type != "cpu":
        return False
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., H] -> rms_norm(x) * weight. With `residual`: residual += x in place first (in x's dtype) and
    the sum is normalised, the fused add of a pre-norm transformer block."""
    if _cpu_kernel(x, weight, residual):
        return ops().rms_norm(x, weight, eps, residual)
    return rms_norm_torch(x, weight, eps, residual)


def rms_norm_torch(x, weight, eps, residual=None):
    if residual is not None:
        x = residual.add_(x)
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2I] = [gate | up] -> silu(gate) * up: [..., I]."""
    if _cpu_kernel(x):
        return ops().silu_and_mul(x)
    return silu_and_mul_torch(x)


def silu_and_mul_torch(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, sin: [T, D] (half-split layout: the two halves hold the same angles)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """qkv: [T, (Hq + 2 Hkv) * D] (q, k, v heads); cos, sin: [T, D]. Rotates q and k, writes k and v to
    the cache slots (k_cache, v_cache: [num_blocks, block_size, Hkv, D]) -> rotated q [T, Hq, D]."""
    if _cpu_kernel(qkv, cos, sin):
        return ops().rope_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_q_heads)
    return rope_write_kv_torch(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_q_heads)


def rope_write_kv_torch(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_q_heads):
    T, (hkv, d) = qkv.shape[0], k_cache.shape[2:]
    heads = qkv.view(T, num_q_heads + 2 * hkv, d)
    qk = apply_rope(heads[:, :num_q_heads + hkv].float(), cos.float(), sin.float()).to(qkv.dtype)
    write_kv(qk[:, num_q_heads:], heads[:, num_q_heads + hkv:], k_cache, v_cache, slot_mapping)
    return qk[:, :num_q_heads]
