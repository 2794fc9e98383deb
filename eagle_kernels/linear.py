"""Dense (bf16 / fp32 / fp16 weight) linear layers on the CPU: `eagle::linear_dense` (csrc/cpu_linear.cpp).

Every dense CPU linear, whatever its number of rows, runs one kernel whose output element is one fixed chain
of fp32 FMAs over k, so each output row is bit-identical whatever the batch around it and whatever the thread
count: a token's features are the same decoded alone, verified inside a tree, or prefilled with other
prompts, in one chunk or several. torch's GEMMs (MKL / oneDNN) are not: their reduction order changes with
the number of rows. For bf16 weights the kernel also replaces torch's slow bf16 GEMM on CPUs without native
bf16: it streams the weights at the fp32 GEMV's speed for decode / verification sized batches, and on
prefills keeps up with MKL's fp32 GEMM (with AVX-512; with both restricted to AVX2 it is 1.2-1.3x slower).
Without the compiled extension, weights run through torch (not row-invariant). GPUs, a bias, and anything
that needs a gradient go straight to torch.
"""
import torch
import torch.nn.functional as F

from ._ops import has_kernel, ops

_CPU_OP = has_kernel("linear_dense", torch.device("cpu"))  # looked up once: the dispatcher query is slow
_DENSE = (torch.bfloat16, torch.float32, torch.float16)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., K], weight: [N, K] -> [..., N] in x's dtype; F.linear's contract."""
    if not _dense_cpu_args(x, weight, bias):
        return F.linear(x, weight, bias)
    if _CPU_OP:
        rows = x.reshape(-1, x.shape[-1])
        return ops().linear_dense(rows, weight.contiguous()).reshape(*x.shape[:-1], weight.shape[0])
    if weight.dtype == torch.bfloat16:  # fp32 GEMM is ~8x faster than torch's bf16 GEMM on AVX2 CPUs
        return F.linear(x.float(), weight.float()).to(x.dtype)
    return F.linear(x, weight.to(x.dtype))


def _dense_cpu_args(x, weight, bias) -> bool:
    """Whether x, weight fit eagle::linear_dense: a bf16 / fp32 / fp16 [N, K] weight and x [..., K] of one of
    those dtypes, both CPU tensors, no bias or gradient. Anything else goes to F.linear, whose own checks raise
    on bad arguments. (Once per linear layer per step: ordered to fail fast, cheap tests first.)"""
    if bias is not None or not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        return False
    if weight.dtype not in _DENSE or x.dtype not in _DENSE or x.is_cuda or weight.is_cuda:
        return False
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        return False
    if x.device.type != "cpu" or weight.device.type != "cpu":
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
