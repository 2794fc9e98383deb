"""eagle_kernels.linear: the CPU bf16 skinny-GEMM op against an fp32 reference."""
import pytest
import torch

import eagle_kernels
from eagle_kernels._ops import ops


@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 6, 17, 32, 77])
@pytest.mark.parametrize("K, N", [(64, 96), (576, 1536), (1728, 20), (40, 7), (64, 99), (13, 33)])  # K % 16 != 0: scalar path
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_linear_bf16_matches_fp32_reference(M, K, N, x_dtype):
    g = torch.Generator().manual_seed(M * 1000 + K + N)
    x = torch.randn(M, K, generator=g).to(x_dtype)
    w = torch.randn(N, K, generator=g).bfloat16()
    ref = x.float() @ w.float().t()
    out = ops().linear_bf16(x, w)
    assert out.dtype == x_dtype and out.shape == (M, N)
    # fp32 accumulation in a different order; bf16 outputs are rounded once
    tol = 1e-4 * K if x_dtype == torch.float32 else 1e-2 * ref.abs().max().item()
    assert (out.float() - ref).abs().max().item() <= tol


@pytest.mark.parametrize("K, N", [(576, 99), (1728, 9), (40, 10), (13, 10)])
def test_linear_bf16_is_batch_invariant(K, N):
    """Each output row is bit-identical whatever the batch around it: verification == decoding."""
    g = torch.Generator().manual_seed(K + N)
    x = torch.randn(40, K, generator=g).bfloat16()
    w = torch.randn(N, K, generator=g).bfloat16()
    full = ops().linear_bf16(x, w)
    for start, size in [(0, 1), (7, 1), (3, 2), (10, 3), (20, 5), (1, 33)]:
        assert torch.equal(ops().linear_bf16(x[start:start + size], w), full[start:start + size])


def test_public_linear_routes_and_falls_back():
    x = torch.randn(2, 3, 64).bfloat16()
    w = torch.randn(48, 64).bfloat16()
    with torch.inference_mode():
        y = eagle_kernels.linear(x, w)
        big = eagle_kernels.linear(torch.randn(300, 64).bfloat16(), w)  # > 256 rows: torch's matmul
    assert y.shape == (2, 3, 48) and big.shape == (300, 48)
    assert torch.allclose(y.float(), (x.float() @ w.float().t()), atol=0.1, rtol=0.02)
    b = torch.randn(48)
    assert torch.allclose(eagle_kernels.linear(x.float(), w.float(), b), torch.nn.functional.linear(x.float(), w.float(), b))


def test_bad_inputs():
    with pytest.raises(RuntimeError, match="bf16"):
        ops().linear_bf16(torch.randn(1, 8), torch.randn(4, 8))
    with pytest.raises(RuntimeError, match="K"):
        ops().linear_bf16(torch.randn(1, 9), torch.randn(4, 8).bfloat16())
