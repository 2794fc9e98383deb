"""bf16 linear layers on the CPU, where torch's own bf16 GEMM is slow.

On AVX2-only CPUs torch widens bf16 weights at ~10 GB/s; `eagle::linear_bf16` streams them at the fp32
GEMV's speed for decode / verification sized batches (<= 256 rows; its results do not depend on the
batch, which keeps bf16 speculative decoding token-identical to vanilla), and larger batches (prefills)
run as an fp32 GEMM. GPUs, fp32/fp16 and anything that needs a gradient go straight to torch.
"""
import torch
import torch.nn.functional as F

from ._ops import has_kernel, ops

MAX_ROWS = 256  # decode batches and verified trees; past this an fp32 GEMM on a widened weight wins
_CPU_OP = has_kernel("linear_bf16", torch.device("cpu"))  # looked up once: the dispatcher query is slow


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., K], weight: [N, K] -> [..., N]; F.linear's contract."""
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if weight.dtype != torch.bfloat16 or x.is_cuda or bias is not None or needs_grad:
        return F.linear(x, weight, bias)
    if x.numel() <= MAX_ROWS * x.shape[-1] and _CPU_OP and weight.is_contiguous():
        rows = x.reshape(-1, x.shape[-1])
        return ops().linear_bf16(rows, weight).reshape(*x.shape[:-1], weight.shape[0])
    # Prefill-sized batches: widening the weight once is cheap next to the GEMM, and fp32 GEMM is
    # ~8x faster than torch's bf16 GEMM on these CPUs (fp32 accumulation either way).
    return F.linear(x.float(), weight.float()).to(x.dtype)
