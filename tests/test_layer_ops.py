"""Fused layer ops (C++ on the CPU) against their torch versions, which follow the Hugging Face Llama."""
import pytest
import torch

import eagle_kernels
from eagle_kernels import layer_ops
from eagle_kernels._ops import ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# fp32: summation order only. 16-bit: the C++ op rounds once where torch may round twice (RoPE), and
# a sum-of-squares difference can flip one rounding of a normalised value.
TOL = {torch.float32: (2e-6, 1e-5), torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (2e-3, 2e-3)}


def close(a, b, dtype):
    assert a.dtype == b.dtype == dtype and a.shape == b.shape
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=rtol)


def rand(*shape, dtype, seed):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 1.5 + 0.3).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (3, 64), (37, 200), (5, 4096)])
def test_rms_norm_matches_torch(rows, hidden, dtype):
    x, w = rand(rows, hidden, dtype=dtype, seed=1), rand(hidden, dtype=dtype, seed=2)
    close(ops().rms_norm(x, w, 1e-5, None), layer_ops.rms_norm_torch(x, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (19, 96), (40, 128)])
def test_rms_norm_adds_the_residual_in_place(rows, hidden, dtype):
    x, w = rand(rows, hidden, dtype=dtype, seed=3), rand(hidden, dtype=dtype, seed=4)
    res_cpp, res_ref = rand(rows, hidden, dtype=dtype, seed=5), rand(rows, hidden, dtype=dtype, seed=5)
    out = ops().rms_norm(x, w, 1e-6, res_cpp)
    ref = layer_ops.rms_norm_torch(x, w, 1e-6, res_ref)
    assert torch.equal(res_cpp, res_ref)  # one fp32 add, rounded once: bit-identical
    close(out, ref, dtype)


def test_rms_norm_three_dims_and_views():
    x = rand(2, 7, 64, dtype=torch.float32, seed=6)[:, ::2]  # non-contiguous [2, 4, 64]
    w = rand(64, dtype=torch.float32, seed=7)
    close(eagle_kernels.rms_norm(x, w, 1e-5), layer_ops.rms_norm_torch(x, w, 1e-5), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,inter", [(1, 1536), (9, 100), (33, 64)])
def test_silu_and_mul_matches_torch(rows, inter, dtype):
    x = rand(rows, 2 * inter, dtype=dtype, seed=8) * 3
    close(ops().silu_and_mul(x), layer_ops.silu_and_mul_torch(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_over_the_whole_range(dtype):
    """The vectorised exp saturates at the fp32 range's ends instead of overflowing."""
    gate = torch.linspace(-120, 120, 1003).to(dtype)
    x = torch.cat([gate, rand(1003, dtype=dtype, seed=9)])[None]
    close(ops().silu_and_mul(x), layer_ops.silu_and_mul_torch(x), dtype)


def rope_case(T, hq, hkv, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    qkv = rand(T, (hq + 2 * hkv) * d, dtype=dtype, seed=seed)
    angles = torch.rand(T, d // 2, generator=gen) * 50
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    caches = rand(2, 6, 4, hkv, d, dtype=dtype, seed=seed + 1)
    slots = torch.randperm(24, generator=gen)[:T]
    return qkv, cos, sin, caches, slots


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,hq,hkv,d", [(1, 9, 3, 64), (5, 4, 4, 32), (17, 8, 2, 128)])
def test_rope_write_kv_matches_torch(T, hq, hkv, d, dtype):
    qkv, cos, sin, caches, slots = rope_case(T, hq, hkv, d, dtype, seed=T + d)
    got_k, got_v = caches.clone()
    want_k, want_v = caches.clone()
    q = ops().rope_write_kv(qkv, cos, sin, got_k, got_v, slots, hq)
    ref = layer_ops.rope_write_kv_torch(qkv, cos, sin, want_k, want_v, slots, hq)
    close(q, ref, dtype)
    close(got_k, want_k, dtype)
    assert torch.equal(got_v, want_v)  # v is copied, not rotated
    untouched = torch.ones(24, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(got_k.flatten(0, 1)[untouched], caches[0].flatten(0, 1)[untouched])


def test_rope_preserves_norms_and_relative_angles():
    """A property independent of either implementation: rotation keeps each 2-D pair's length."""
    qkv, cos, sin, caches, slots = rope_case(6, 2, 1, 64, torch.float32, seed=11)
    k, v = caches.clone()
    q = ops().rope_write_kv(qkv, cos, sin, k, v, slots, 2)
    x = qkv.view(6, 4, 64)[:, :2]
    pair = lambda t: t[..., :32] ** 2 + t[..., 32:] ** 2  # noqa: E731
    torch.testing.assert_close(pair(q), pair(x), atol=1e-4, rtol=1e-5)


def test_fused_ops_fall_back_to_torch_for_autograd():
    x = rand(4, 64, dtype=torch.float32, seed=12).requires_grad_()
    w = rand(64, dtype=torch.float32, seed=13)
    eagle_kernels.silu_and_mul(eagle_kernels.rms_norm(x, w, 1e-5)).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_bad_inputs_raise_value_errors():
    x = rand(2, 64, dtype=torch.float32, seed=14)
    with pytest.raises(ValueError, match="weight must be"):
        ops().rms_norm(x, rand(32, dtype=torch.float32, seed=1), 1e-5, None)
    with pytest.raises(ValueError, match="residual"):
        ops().rms_norm(x, rand(64, dtype=torch.float32, seed=1), 1e-5, x[:1].clone())
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        ops().silu_and_mul(x.double())
    with pytest.raises(ValueError, match="even"):
        ops().silu_and_mul(x[:, :63])
    qkv, cos, sin, caches, slots = rope_case(3, 2, 1, 64, torch.float32, seed=15)
    k, v = caches.clone()
    with pytest.raises(ValueError, match="outside the cache"):
        ops().rope_write_kv(qkv, cos, sin, k, v, torch.tensor([0, 1, 24]), 2)
    with pytest.raises(ValueError, match="qkv must be"):
        ops().rope_write_kv(qkv, cos, sin, k, v, slots, 3)
    with pytest.raises(ValueError, match="cos and sin"):
        ops().rope_write_kv(qkv, cos[:2], sin, k, v, slots, 2)
