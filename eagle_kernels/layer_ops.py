"""Fused per-layer ops: RMSNorm (+ residual add), SiLU-and-mul, RoPE (+ KV-cache write).

Each is one Triton kernel on the GPU path (CUDA tensors; CPU tensors inside triton_on_cpu() under
TRITON_INTERPRET=1) and one C++ call on other CPU tensors (csrc/cpu_layer_ops.cpp); the torch versions
below serve tensors that need a gradient (draft-head training), devices without either, and the tests as
the reference. All compute in fp32 with the Hugging Face Llama's rounding points for 16-bit dtypes.
"""
import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU-only installs: C++ / torch serve every device
    triton = None

from . import _ops
from ._ops import check_rms_norm, check_rope_write_kv, check_silu_and_mul, gpu_path, has_kernel, ops
from .attention import write_kv

_CPU_OPS = has_kernel("rms_norm", torch.device("cpu"))  # looked up once: the dispatcher query is slow
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _path(*tensors) -> str:
    """"triton" (the GPU path, Triton importable), "cpu" (the C++ op) or "torch" (autograd, and the rest).
    tensors[0] decides the device; this runs once per op per layer, so it stays cheap."""
    if _needs_grad(*tensors):
        return "torch"
    x = tensors[0]
    if x.is_cuda or _ops._TRITON_ON_CPU:
        return "triton" if triton is not None and gpu_path(x) else "torch"
    return "cpu" if _CPU_OPS and x.device.type == "cpu" else "torch"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., H] -> rms_norm(x) * weight. With `residual`: residual += x in place first (in x's dtype) and
    the sum is normalised, the fused add of a pre-norm transformer block."""
    path = _path(x, weight, residual)
    if path == "triton":
        return rms_norm_triton(x.contiguous(), weight.contiguous(), eps, residual)
    if path == "cpu":
        if _ops.CHECKED:
            check_rms_norm(x, weight, residual)
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
    path = _path(x)
    if path == "triton":
        return silu_and_mul_triton(x.contiguous())
    if path == "cpu":
        if _ops.CHECKED:
            check_silu_and_mul(x)
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
    the cache slots (k_cache, v_cache: [num_blocks, block_size, Hkv, D]) -> rotated q [T, Hq, D], contiguous
    on every path (paged_attention's Triton kernel takes no strided q)."""
    path = _path(qkv, cos, sin)
    if path == "triton":
        return rope_write_kv_triton(qkv.contiguous(), cos.contiguous(), sin.contiguous(), k_cache, v_cache,
                                    slot_mapping.contiguous(), num_q_heads)
    if path == "cpu":
        if _ops.CHECKED:
            check_rope_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_q_heads)
        return ops().rope_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_q_heads)
    return rope_write_kv_torch(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_q_heads)


def rope_write_kv_torch(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_q_heads):
    T, (hkv, d) = qkv.shape[0], k_cache.shape[2:]
    heads = qkv.view(T, num_q_heads + 2 * hkv, d)
    cos, sin = cos.float(), sin.float()
    q = apply_rope(heads[:, :num_q_heads].float(), cos, sin).to(qkv.dtype)
    k = apply_rope(heads[:, num_q_heads:num_q_heads + hkv].float(), cos, sin).to(qkv.dtype)
    write_kv(k, heads[:, num_q_heads + hkv:], k_cache, v_cache, slot_mapping)
    return q.contiguous()  # apply_rope allocated q densely: no copy


# ----------------------------------------------------------------------------------------------------------
# Triton path (CUDA; CPU tensors only under TRITON_INTERPRET=1)
# ----------------------------------------------------------------------------------------------------------
# Block sizes are functions of H / I / D / head counts only, never of the token count: one compile per
# model shape. Every value goes through fp32 and is rounded where the torch reference rounds.

if triton is not None:
    @triton.jit
    def _round_to(x, DTYPE: tl.constexpr):
        """fp32 x -> DTYPE, round to nearest even. bf16 by bits: the same on GPUs and in the interpreter,
        whose fp32 -> bf16 cast truncates."""
        if DTYPE == tl.bfloat16:
            u = x.to(tl.uint32, bitcast=True)
            u = u + 0x7FFF + ((u >> 16) & 1)
            return (u >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(DTYPE)

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, res_ptr, out_ptr, eps,
                         H: tl.constexpr, BLOCK_H: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
        """One row: [residual += x;] out = w * rms_norm(sum) with the reference's rounding points."""
        DTYPE: tl.constexpr = out_ptr.dtype.element_ty
        row = tl.program_id(0).to(tl.int64) * H
        offs = tl.arange(0, BLOCK_H)
        mask = offs < H
        x = tl.load(x_ptr + row + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row + offs, mask=mask, other=0.0).to(tl.float32)
            s = _round_to(r + x, DTYPE)
            tl.store(res_ptr + row + offs, s, mask=mask)
            x = s.to(tl.float32)
        rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(x * x, axis=0), H * 1.0) + eps))
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if DTYPE == tl.float32:
            out = x * rstd * w
        else:
            out = w * _round_to(x * rstd, DTYPE).to(tl.float32)
        tl.store(out_ptr + row + offs, _round_to(out, DTYPE), mask=mask)

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, I, BLOCK: tl.constexpr, LIBDEVICE_EXP: tl.constexpr):
        """Row program_id(0), columns [program_id(1) * BLOCK, +BLOCK): round(silu(gate)) * up, rounded.
        LIBDEVICE_EXP: CUDA's expf, the one torch's CUDA silu calls (the interpreter has no libdevice)."""
        DTYPE: tl.constexpr = out_ptr.dtype.element_ty
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < I
        gate = tl.load(x_ptr + row * 2 * I + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * 2 * I + I + offs, mask=mask, other=0.0).to(tl.float32)
        if LIBDEVICE_EXP:
            e = libdevice.exp(-gate)
        else:
            e = tl.exp(-gate)
        silu = _round_to(tl.div_rn(gate, 1.0 + e), DTYPE).to(tl.float32)
        tl.store(out_ptr + row * I + offs, _round_to(silu * up, DTYPE), mask=mask)

    @triton.jit
    def _rope_write_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, slot_ptr, num_slots,
                              HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                              HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr):
        """Token program_id(0), heads [program_id(1) * BLOCK_H, +BLOCK_H) of its q | k | v heads: q and k
        rotated (half-split), q to q_ptr [T, HQ, D], k and v to the token's cache slot unless the slot is
        outside [0, num_slots)."""
        DTYPE: tl.constexpr = q_ptr.dtype.element_ty
        HALF: tl.constexpr = D // 2
        NH: tl.constexpr = HQ + 2 * HKV
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)     # [BLOCK_H] head within q | k | v
        offs = tl.arange(0, HALF_PAD)
        d_ok = offs < HALF
        tile_ok = (h < NH)[:, None] & d_ok[None, :]
        lo_ptrs = qkv_ptr + t * NH * D + h[:, None] * D + offs[None, :]
        a = tl.load(lo_ptrs, mask=tile_ok, other=0.0).to(tl.float32)          # [BLOCK_H, HALF_PAD]
        b = tl.load(lo_ptrs + HALF, mask=tile_ok, other=0.0).to(tl.float32)
        cos_lo = tl.load(cos_ptr + t * D + offs, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        cos_hi = tl.load(cos_ptr + t * D + HALF + offs, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        sin_lo = tl.load(sin_ptr + t * D + offs, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        sin_hi = tl.load(sin_ptr + t * D + HALF + offs, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        rotate = (h < HQ + HKV)[:, None]
        out_lo = _round_to(tl.where(rotate, a * cos_lo - b * sin_lo, a), DTYPE)
        out_hi = _round_to(tl.where(rotate, b * cos_hi + a * sin_hi, b), DTYPE)

        is_q = (h < HQ)[:, None]
        q_ptrs = q_ptr + t * HQ * D + h[:, None] * D + offs[None, :]
        tl.store(q_ptrs, out_lo, mask=tile_ok & is_q)
        tl.store(q_ptrs + HALF, out_hi, mask=tile_ok & is_q)

        # The slot per row: the interpreter mis-types a scalar & block mask.
        slot = tl.load(slot_ptr + t).to(tl.int64) + tl.zeros([BLOCK_H], tl.int64)
        slot_ok = (slot >= 0) & (slot < num_slots)
        kv_head = tl.maximum(tl.where(h < HQ + HKV, h - HQ, h - HQ - HKV), 0)
        kv_off = (tl.where(slot_ok, slot, 0) * HKV + kv_head)[:, None] * D + offs[None, :]
        is_k = ((h >= HQ) & (h < HQ + HKV) & slot_ok)[:, None]
        is_v = ((h >= HQ + HKV) & slot_ok)[:, None]
        tl.store(k_ptr + kv_off, out_lo, mask=tile_ok & is_k)
        tl.store(k_ptr + kv_off + HALF, out_hi, mask=tile_ok & is_k)
        tl.store(v_ptr + kv_off, out_lo, mask=tile_ok & is_v)
        tl.store(v_ptr + kv_off + HALF, out_hi, mask=tile_ok & is_v)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check_triton(fn, device, named):
    """ValueError unless Triton can run on `device` and every named tensor is contiguous on it."""
    if triton is None:
        raise ValueError(f"{fn}: Triton is not installed")
    if not (device.type == "cuda" or _interpreting()):
        raise ValueError(f"{fn}: the Triton path needs CUDA tensors (or TRITON_INTERPRET=1), got {device}")
    for name, t in named.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != device:
            raise ValueError(f"{fn}: {name} is on {t.device}, expected {device}")
        if not t.is_contiguous():
            raise ValueError(f"{fn}: {name} must be contiguous (strides {tuple(t.stride())})")


def _check_float(fn, name, t):
    if t.dtype not in _FLOATS:
        raise ValueError(f"{fn}: {name} must be float32, bfloat16 or float16, got {t.dtype}")


def _row_warps(block):
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton kernel behind rms_norm: one launch, one row per program, no host sync. x: [..., H]
    contiguous; weight: [H] of x's dtype; residual: x's shape and dtype, contiguous, updated in place.
    Against rms_norm_torch: the residual sum is bit-identical. The output is bit-identical whenever the fp32
    rstd is (the interpreter's, in the tests); the sum of squares' order can move rstd by an fp32 ulp,
    which rarely flips the rounding of the normalised value: then within 2 ulp of the dtype (fp32: a few)."""
    _check_triton("rms_norm", x.device, {"x": x, "weight": weight, "residual": residual})
    _check_float("rms_norm", "x", x)
    H = x.shape[-1] if x.dim() >= 1 else 0
    if x.dim() < 1 or H == 0:
        raise ValueError(f"rms_norm: x must be [..., H] with H >= 1, got {list(x.shape)}")
    if weight.dtype != x.dtype or tuple(weight.shape) != (H,):
        raise ValueError(f"rms_norm: weight must be [{H}] of x's dtype, got {weight.dtype} {list(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"rms_norm: residual must be a contiguous tensor of x's shape and dtype, got "
                         f"{residual.dtype} {list(residual.shape)}")
    out = torch.empty_like(x)
    rows = x.numel() // H
    if rows == 0:
        return out
    block = triton.next_power_of_2(H)
    _rms_norm_kernel[(rows,)](x, weight, residual if residual is not None else x, out, float(eps), H=H,
                              BLOCK_H=block, HAS_RESIDUAL=residual is not None, num_warps=_row_warps(block))
    return out


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """The Triton kernel behind silu_and_mul: one launch, no host sync. x: [..., 2I] contiguous ->
    [..., I]. Rounds where silu_and_mul_torch does (silu in fp32, rounded to the dtype, times up in fp32,
    rounded). On CUDA the same fp32 ops as torch's CUDA silu (expf, IEEE add and divide): bit-identical.
    Against another exp (torch on the CPU vs the interpreter's numpy) an fp32 ulp can flip the rounding of
    silu(gate) (~1e-4 of fp16 elements): then within 2 ulp of the dtype."""
    _check_triton("silu_and_mul", x.device, {"x": x})
    _check_float("silu_and_mul", "x", x)
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: the last dim must be even, got {list(x.shape)}")
    inter = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    rows = out.numel() // inter if inter else 0
    if rows == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(rows, triton.cdiv(inter, block))](x, out, inter, BLOCK=block,
                                                             LIBDEVICE_EXP=not _interpreting())
    return out


def rope_write_kv_triton(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """The Triton kernel behind rope_write_kv: one launch, no host sync -> a fresh contiguous q [T, Hq, D].
    qkv: [T, (Hq + 2 Hkv) * D]; cos, sin: [T, D] (any float dtype, read as fp32); caches: [num_blocks,
    block_size, Hkv, D] of qkv's dtype; slot_mapping: int32/int64 [T]; all contiguous on one device. Slots
    outside [0, num_blocks * block_size) (e.g. -1 for padding rows) are skipped, not written; the C++ and
    torch paths raise. The same fp32 ops as rope_write_kv_torch (no fused multiply-add), rounded once per
    element: bit-identical."""
    fn = "rope_write_kv"
    _check_triton(fn, qkv.device, {"qkv": qkv, "cos": cos, "sin": sin, "k_cache": k_cache, "v_cache": v_cache,
                                   "slot_mapping": slot_mapping})
    _check_float(fn, "qkv", qkv)
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != qkv.dtype \
            or v_cache.dtype != qkv.dtype:
        raise ValueError(f"{fn}: k_cache/v_cache must be contiguous [num_blocks, block_size, Hkv, D] of qkv's "
                         f"dtype, got {k_cache.dtype} {list(k_cache.shape)} and {v_cache.dtype} "
                         f"{list(v_cache.shape)}")
    nb, bs, hkv, d = k_cache.shape
    hq = int(num_q_heads)
    width = (hq + 2 * hkv) * d
    if hq < 1 or d % 2 or qkv.dim() != 2 or qkv.shape[1] != width:
        raise ValueError(f"{fn}: qkv must be [T, (Hq + 2 Hkv) * D] = [T, {width}] with Hq >= 1 and D even, got "
                         f"{list(qkv.shape)}")
    T = qkv.shape[0]
    if cos.shape != (T, d) or sin.shape != (T, d) or cos.dtype not in _FLOATS or sin.dtype != cos.dtype:
        raise ValueError(f"{fn}: cos and sin must be float [T, D] = [{T}, {d}] of one dtype, got "
                         f"{cos.dtype} {list(cos.shape)} and {sin.dtype} {list(sin.shape)}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != T or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{fn}: slot_mapping must be int64 or int32 [T] = [{T}], got {slot_mapping.dtype} "
                         f"{list(slot_mapping.shape)}")
    q = torch.empty(T, hq, d, dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return q
    half_pad = triton.next_power_of_2(d // 2)
    block_h = max(1, min(triton.next_power_of_2(hq + 2 * hkv), 1024 // half_pad))
    _rope_write_kv_kernel[(T, triton.cdiv(hq + 2 * hkv, block_h))](
        qkv, cos, sin, q, k_cache, v_cache, slot_mapping, nb * bs,
        HQ=hq, HKV=hkv, D=d, HALF_PAD=half_pad, BLOCK_H=block_h,
        enable_fp_fusion=False)  # torch rounds each product before the add: no FMA, same bits
    return q
