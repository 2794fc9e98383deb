"""Fused layer ops (C++ on the CPU, Triton on the GPU path) against their torch versions, which follow the
Hugging Face Llama. The Triton kernels run on CUDA when there is one, else on CPU tensors in the interpreter."""
import contextlib

import pytest
import torch

import eagle_kernels
from eagle_kernels import layer_ops
from eagle_kernels._ops import ops
from host_reads import no_host_reads

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# fp32: summation order only. 16-bit: a sum-of-squares difference can flip one rounding of a normalised value.
TOL = {torch.float32: (2e-6, 1e-5), torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (2e-3, 2e-3)}


def close(a, b, dtype):
    assert a.dtype == b.dtype == dtype and a.shape == b.shape
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=rtol)


def rand(*shape, dtype, seed):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 1.5 + 0.3).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (3, 64), (37, 200), (4, 203), (5, 4096)])
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


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [576, 203])
def test_rms_norm_rows_do_not_depend_on_their_neighbours(hidden, dtype):
    """A token normalised alone (decode) and among 37 (prefill, verification) gets the same bits."""
    x, w = rand(37, hidden, dtype=dtype, seed=12), rand(hidden, dtype=dtype, seed=13)
    res = rand(37, hidden, dtype=dtype, seed=14)
    together_res = res.clone()
    together = ops().rms_norm(x, w, 1e-6, together_res)
    for r in (0, 17, 36):
        alone_res = res[r:r + 1].clone()
        assert torch.equal(ops().rms_norm(x[r:r + 1], w, 1e-6, alone_res), together[r:r + 1])
        assert torch.equal(alone_res, together_res[r:r + 1])


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
@pytest.mark.parametrize("T,hq,hkv,d", [(1, 9, 3, 64), (5, 4, 4, 32), (17, 8, 2, 128), (3, 2, 1, 20)])
def test_rope_write_kv_matches_torch(T, hq, hkv, d, dtype):
    qkv, cos, sin, caches, slots = rope_case(T, hq, hkv, d, dtype, seed=T + d)
    got_k, got_v = caches.clone()
    want_k, want_v = caches.clone()
    q = ops().rope_write_kv(qkv, cos, sin, got_k, got_v, slots, hq)
    ref = layer_ops.rope_write_kv_torch(qkv, cos, sin, want_k, want_v, slots, hq)
    assert torch.equal(q, ref) and torch.equal(got_k, want_k)  # torch's fp32 ops, unfused, rounded once
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


# ----------------------------------------------------------------------------------------------------------
# Triton kernels (CUDA, or the interpreter on CPU tensors)
# ----------------------------------------------------------------------------------------------------------

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SIZES = [1, 3, 17, 64]


def triton_path():
    """The context in which DEV tensors take the Triton kernels."""
    return contextlib.nullcontext() if DEV.type == "cuda" else eagle_kernels.triton_on_cpu()


def ulps(a, b):
    """Largest distance between a and b in units in the last place of their (same) dtype."""
    assert a.dtype == b.dtype and a.shape == b.shape
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]

    def ordered(t):  # sign-magnitude bits -> integers in the floats' order (+0 and -0 both 0)
        i = t.contiguous().view(bits).long()
        return torch.where(i < 0, -(i & (torch.iinfo(bits).max)), i)
    return (ordered(a.cpu()) - ordered(b.cpu())).abs().max().item() if a.numel() else 0


def matches(got, want, dtype, max_ulps=2):
    """16-bit: bit-exact but for a few roundings an fp32 ulp can flip (summation order, exp), each within
    max_ulps of the dtype; fp32: the usual tolerance."""
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32:
        close(got.cpu(), want.cpu(), dtype)
    else:
        assert ulps(got, want) <= max_ulps
        assert (got != want).sum().item() <= max(2, got.numel() // 1000)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [64, 200, 576])
@pytest.mark.parametrize("T", SIZES)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_triton_rms_norm_matches_torch(T, hidden, dtype, with_residual):
    x, w = rand(T, hidden, dtype=dtype, seed=T), rand(hidden, dtype=dtype, seed=hidden) * 0.5 + 1
    x, w = x.to(DEV), w.to(DEV)
    res = rand(T, hidden, dtype=dtype, seed=T + 1).to(DEV) if with_residual else None
    res_ref = res.clone() if with_residual else None
    with triton_path():
        out = eagle_kernels.rms_norm(x, w, 1e-5, res)
    matches(out, layer_ops.rms_norm_torch(x, w, 1e-5, res_ref), dtype)
    if with_residual:
        assert torch.equal(res, res_ref)  # one fp32 add, rounded once


def test_triton_rms_norm_three_dims_and_views():
    x = rand(2, 7, 96, dtype=torch.bfloat16, seed=20).to(DEV)[:, ::2]  # non-contiguous [2, 4, 96]
    w = rand(96, dtype=torch.bfloat16, seed=21).to(DEV)
    with triton_path():
        out = eagle_kernels.rms_norm(x, w, 1e-6)
    assert out.shape == (2, 4, 96)
    matches(out, layer_ops.rms_norm_torch(x, w, 1e-6), torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inter", [64, 100, 1536])
@pytest.mark.parametrize("T", SIZES)
def test_triton_silu_and_mul_matches_torch(T, inter, dtype):
    x = (rand(T, 2 * inter, dtype=dtype, seed=T + inter) * 3).to(DEV)
    with triton_path():
        out = eagle_kernels.silu_and_mul(x)
    matches(out, layer_ops.silu_and_mul_torch(x), dtype)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's exp(120) = inf
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_silu_and_mul_whole_range_and_batch_dims(dtype):
    gate = torch.linspace(-120, 120, 1003).to(dtype)
    x = torch.cat([gate, rand(1003, dtype=dtype, seed=22)])[None].to(DEV)
    with triton_path():
        matches(eagle_kernels.silu_and_mul(x), layer_ops.silu_and_mul_torch(x), dtype)
        x3 = rand(2, 3, 2 * 48, dtype=dtype, seed=23).to(DEV)
        out3 = eagle_kernels.silu_and_mul(x3)
    assert out3.shape == (2, 3, 48)
    matches(out3, layer_ops.silu_and_mul_torch(x3), dtype)


def kv_case(T, hq, hkv, d, dtype, seed, block_size=4):
    """rope_case with room for T tokens: 2T + 8 slots, T of them (distinct, shuffled) written."""
    gen = torch.Generator().manual_seed(seed)
    qkv = rand(T, (hq + 2 * hkv) * d, dtype=dtype, seed=seed)
    angles = torch.rand(T, d // 2, generator=gen) * 50
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    blocks = -(-(2 * T + 8) // block_size)
    caches = rand(2, blocks, block_size, hkv, d, dtype=dtype, seed=seed + 1)
    slots = torch.randperm(blocks * block_size, generator=gen)[:T]
    return [t.to(DEV) for t in (qkv, cos, sin, caches, slots)]


def run_rope(qkv, cos, sin, caches, slots, hq):
    """-> (q, k_cache, v_cache) of the Triton kernel and of the torch reference, on copies of caches."""
    got_k, got_v = caches.clone()
    want_k, want_v = caches.clone()
    with triton_path():
        q = eagle_kernels.rope_write_kv(qkv, cos, sin, got_k, got_v, slots, hq)
    ref = layer_ops.rope_write_kv_torch(qkv, cos, sin, want_k, want_v, slots.long(), hq)
    return (q, got_k, got_v), (ref, want_k, want_v)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 32), (8, 2, 128), (6, 1, 16)])
@pytest.mark.parametrize("T", SIZES)
def test_triton_rope_write_kv_matches_torch(T, hq, hkv, d, dtype):
    qkv, cos, sin, caches, slots = kv_case(T, hq, hkv, d, dtype, seed=T + hq + d)
    if T == 17:
        slots = slots.int()
    if T == 3:
        cos, sin = cos.to(dtype), sin.to(dtype)  # the engine passes the model dtype
    (q, got_k, got_v), (ref, want_k, want_v) = run_rope(qkv, cos, sin, caches, slots, hq)
    assert q.is_contiguous() and q.shape == (T, hq, d)
    assert torch.equal(q, ref) and torch.equal(got_k, want_k)  # the same fp32 ops, rounded once: same bits
    assert torch.equal(got_v, want_v)  # v is copied, not rotated
    untouched = torch.ones(caches.shape[1] * caches.shape[2], dtype=torch.bool, device=DEV)
    untouched[slots.long()] = False
    for got, orig in ((got_k, caches[0]), (got_v, caches[1])):
        assert torch.equal(got.flatten(0, 1)[untouched], orig.flatten(0, 1)[untouched])


def test_triton_rope_write_kv_skips_slots_outside_the_cache():
    """Negative (and past-the-end) slots are not written; the rest of the call is unaffected."""
    qkv, cos, sin, caches, slots = kv_case(6, 4, 2, 32, torch.bfloat16, seed=30)
    num_slots = caches.shape[1] * caches.shape[2]
    keep = torch.tensor([True, False, True, True, False, True], device=DEV)
    slots = torch.where(keep, slots, torch.tensor([-1, -1, -1, -1, num_slots, -1], device=DEV))
    got_k, got_v = caches.clone()
    with triton_path():
        q = eagle_kernels.rope_write_kv(qkv, cos, sin, got_k, got_v, slots, 4)
    want_k, want_v = caches.clone()
    ref = layer_ops.rope_write_kv_torch(qkv[keep], cos[keep], sin[keep], want_k, want_v, slots[keep], 4)
    assert torch.equal(q[keep], ref) and torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_rope_write_kv_returns_a_contiguous_q_on_every_path():
    """paged_attention's Triton kernel rejects a strided q: a [T, Hq, D] view of qkv crashed every forward."""
    hq, hkv, d = 9, 3, 16
    qkv, cos, sin, caches, slots = kv_case(5, hq, hkv, d, torch.float32, seed=31)
    k, v = caches.clone()
    paths = {"torch": lambda: layer_ops.rope_write_kv_torch(qkv, cos, sin, k, v, slots, hq)}
    if DEV.type == "cpu":
        paths["cpu"] = lambda: eagle_kernels.rope_write_kv(qkv, cos, sin, k, v, slots, hq)
        paths["autograd"] = lambda: eagle_kernels.rope_write_kv(qkv.detach().requires_grad_(), cos, sin,
                                                                k.clone(), v.clone(), slots, hq)
    with triton_path():
        paths["triton"] = eagle_kernels.rope_write_kv(qkv, cos, sin, k, v, slots, hq)
    for name, fn in paths.items():
        q = fn() if callable(fn) else fn
        assert q.shape == (5, hq, d) and q.is_contiguous() and q.stride() == (hq * d, d, 1), name


def test_triton_launchers_make_no_host_reads():
    """One launch each, nothing read back on the host (the GPU path must not sync)."""
    qkv, cos, sin, caches, slots = kv_case(3, 4, 2, 32, torch.bfloat16, seed=32)
    k, v = caches.clone()
    x = rand(3, 64, dtype=torch.bfloat16, seed=33).to(DEV)
    w, res = torch.ones(64, dtype=torch.bfloat16, device=DEV), x.clone()
    with triton_path(), no_host_reads():
        layer_ops.rms_norm_triton(x, w, 1e-5, res)
        layer_ops.silu_and_mul_triton(x)
        layer_ops.rope_write_kv_triton(qkv, cos, sin, k, v, slots, 4)


def test_triton_fused_ops_keep_autograd_on_torch():
    x = rand(4, 64, dtype=torch.float32, seed=34).to(DEV).requires_grad_()
    w = rand(64, dtype=torch.float32, seed=35).to(DEV)
    with triton_path():
        eagle_kernels.silu_and_mul(eagle_kernels.rms_norm(x, w, 1e-5)).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_triton_bad_inputs_raise_value_errors():
    x = rand(2, 64, dtype=torch.float32, seed=36).to(DEV)
    w = rand(64, dtype=torch.float32, seed=37).to(DEV)
    rms, silu, rope = layer_ops.rms_norm_triton, layer_ops.silu_and_mul_triton, layer_ops.rope_write_kv_triton
    qkv, cos, sin, caches, slots = kv_case(3, 2, 1, 64, torch.float32, seed=38)
    k, v = caches.clone()
    bad = [
        ("weight must be", lambda: rms(x, w[:32], 1e-5)),
        ("weight must be", lambda: rms(x, w.half(), 1e-5)),
        ("residual must be", lambda: rms(x, w, 1e-5, x[:1].clone())),
        ("residual must be contiguous", lambda: rms(x, w, 1e-5, x.t().contiguous().t())),
        ("x must be float32, bfloat16 or float16", lambda: rms(x.double(), w.double(), 1e-5)),
        ("residual is on meta", lambda: rms(x, w, 1e-5, x.to("meta"))),
        ("x must be float32, bfloat16 or float16", lambda: silu(x.double())),
        ("even", lambda: silu(x[:, :63].contiguous())),
        ("x must be contiguous", lambda: silu(x[:, :32])),
        ("qkv must be", lambda: rope(qkv, cos, sin, k, v, slots, 3)),
        ("cos and sin", lambda: rope(qkv, cos[:2], sin, k, v, slots, 2)),
        ("cos and sin", lambda: rope(qkv, cos, sin.half(), k, v, slots, 2)),
        ("slot_mapping must be", lambda: rope(qkv, cos, sin, k, v, slots.float(), 2)),
        ("slot_mapping must be", lambda: rope(qkv, cos, sin, k, v, slots[:2], 2)),
        ("k_cache/v_cache must be", lambda: rope(qkv, cos, sin, k.half(), v.half(), slots, 2)),
        ("k_cache/v_cache must be", lambda: rope(qkv, cos, sin, k, v[:1], slots, 2)),
        ("k_cache must be contiguous", lambda: rope(qkv, cos, sin, k.transpose(0, 1), v, slots, 2)),
        ("slot_mapping is on meta", lambda: rope(qkv, cos, sin, k, v, slots.to("meta"), 2)),
    ]
    with triton_path():
        for message, call in bad:
            with pytest.raises(ValueError, match=message):
                call()
                pytest.fail(message)
