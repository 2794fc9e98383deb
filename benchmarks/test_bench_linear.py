"""CPU bf16 skinny GEMM (decode-sized) against torch's bf16 and fp32 linear; reports weight GB/s."""
import pytest
import torch
import torch.nn.functional as F

import eagle_kernels

SHAPES = [(1, 576, 3072), (8, 576, 3072), (1, 576, 49152), (32, 4096, 4096)]


@pytest.mark.parametrize("impl", ["eagle", "torch_bf16", "torch_fp32"])
@pytest.mark.parametrize("M, K, N", SHAPES)
def test_linear(bandwidth, impl, M, K, N):
    x = torch.randn(M, K)
    w = torch.randn(N, K)
    if impl != "torch_fp32":
        x, w = x.bfloat16(), w.bfloat16()
    fn = {"eagle": eagle_kernels.linear, "torch_bf16": F.linear, "torch_fp32": F.linear}[impl]
    nbytes = w.numel() * w.element_size() + x.numel() * x.element_size()
    with torch.inference_mode():
        bandwidth(lambda: fn(x, w), nbytes, x.device)
