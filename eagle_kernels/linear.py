"""Linear layers for decode: a CPU bf16 skinny-GEMM op where torch's own bf16 GEMV is slow.

On AVX2-only CPUs torch widens bf16 weights at ~10 GB/s; `eagle::linear_bf16` streams them at the fp32
GEMV's speed. Everything else (GPUs, fp32/fp16, prefill-sized batches) goes to torch.
"""
import torch
import torch.nn.functional as F

from ._ops import has_kernel, ops

MAX_ROWS = 32  # the op's register blocking targets decode / verify sized batches
_CPU_OP = has_kernel("linear_bf16", torch.device("cpu"))  # looked up once: the dispatcher query is slow


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., K], weight: [N, K] -> [..., N]; F.linear's contract."""
    if (weight.dtype == torch.bfloat16 and not x.is_cuda and bias is None and weight.is_contiguous()
            and x.numel() <= MAX_ROWS * x.shape[-1] and _CPU_OP and not torch.is_grad_enabled()):
        rows = x.reshape(-1, x.shape[-1])
        return ops().linear_bf16(rows, weight).reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)
