"""bf16 linear layers on the CPU, where torch's own bf16 GEMM is slow.

Every bf16-weight CPU linear, whatever its number of rows, runs `eagle::linear_bf16`
(csrc/cpu_linear.cpp): it streams the weights at the fp32 GEMV's speed for decode / verification sized
batches, and on prefills it keeps up with MKL's fp32 GEMM on widened weights (with AVX-512; with both
restricted to AVX2 it is 1.2-1.3x slower). Each output row is bit-identical whatever the batch around
it, which keeps bf16 speculative decoding token-identical to vanilla, and a prompt's features the same
whether it is prefilled alone or packed with others. Without the compiled extension, bf16 weights run as
an fp32 GEMM (not row-invariant). GPUs, fp32/fp16 weights and anything that needs a gradient go straight
to torch.
"""
import torch
import torch.nn.functional as F

from ._ops import has_kernel, ops

_CPU_OP = has_kernel("linear_bf16", torch.device("cpu"))  # looked up once: the dispatcher query is slow


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., K], weight: [N, K] -> [..., N]; F.linear's contract."""
    if not _bf16_cpu_args(x, weight, bias):
        return F.linear(x, weight, bias)
    if _CPU_OP:
        rows = x.reshape(-1, x.shape[-1])
        return ops().linear_bf16(rows, weight.contiguous()).reshape(*x.shape[:-1], weight.shape[0])
    # No extension: fp32 GEMM is ~8x faster than torch's bf16 GEMM on AVX2 CPUs (fp32 accumulation either way).
    return F.linear(x.float(), weight.float()).to(x.dtype)


_BF16, _FP32 = torch.bfloat16, torch.float32


def _bf16_cpu_args(x, weight, bias) -> bool:
    """Whether x, weight fit eagle::linear_bf16 (or the fp32 fallback): a bf16 [N, K] weight and a bf16 or
    fp32 x [..., K], both CPU tensors, no bias or gradient. Anything else goes to F.linear, whose own
    checks raise on bad arguments. (Once per linear layer per step: ordered to fail fast, cheap tests first.)"""
    if bias is not None or not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        return False
    if weight.dtype is not _BF16 or (x.dtype is not _BF16 and x.dtype is not _FP32) or x.is_cuda:
        return False
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1] or weight.is_cuda:
        return False
    if x.device.type != "cpu" or weight.device.type != "cpu":
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
