"""eagle_kernels.linear: the CPU dense linear op (bf16, fp32 and fp16 weights) against an fp32 reference,
against an exact emulation of its per-element operation order, and for row invariance (each output row the
same bits whatever the batch)."""
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import eagle_kernels
from eagle_kernels._ops import ops

WEIGHT_DTYPES = [torch.bfloat16, torch.float32, torch.float16]
SIMD = platform.machine() in ("x86_64", "AMD64") and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 6, 17, 32, 77])
@pytest.mark.parametrize("K, N", [(64, 96), (576, 1536), (1728, 20), (40, 7), (64, 99), (13, 33)])  # K % 16 != 0: scalar path
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("w_dtype", WEIGHT_DTYPES)
def test_linear_dense_matches_fp32_reference(M, K, N, x_dtype, w_dtype):
    g = torch.Generator().manual_seed(M * 1000 + K + N)
    x = torch.randn(M, K, generator=g).to(x_dtype)
    w = torch.randn(N, K, generator=g).to(w_dtype)
    ref = x.float() @ w.float().t()
    out = ops().linear_dense(x, w)
    assert out.dtype == x_dtype and out.shape == (M, N)
    # fp32 accumulation in a different order; bf16 outputs are rounded once
    tol = 1e-4 * K if x_dtype == torch.float32 else 1e-2 * ref.abs().max().item()
    assert (out.float() - ref).abs().max().item() <= tol


def chain_reference(x: torch.Tensor, w: torch.Tensor, fma: bool) -> torch.Tensor:
    """The kernel's operation order, emulated: lane l of 8 accumulates k = 16c + 2l, then 16c + 2l + 1, for
    c ascending, each step one fp32 FMA (fma=True: exact product plus acc, rounded once; fp64 holds the
    exact sum here) or a rounded product then a rounded add; then ((l0 + l4) + (l2 + l6)) + ((l1 + l5) +
    (l3 + l7)). Returns fp32 [M, N]."""
    M, K = x.shape
    C = (K + 15) // 16
    pad = C * 16 - K
    xs = torch.nn.functional.pad(x.double(), (0, pad)).view(M, C, 8, 2)
    ws = torch.nn.functional.pad(w.double(), (0, pad)).view(-1, C, 8, 2)
    valid = (torch.arange(C * 16) < K).view(C, 8, 2)
    acc = torch.zeros(M, w.shape[0], 8, dtype=torch.float32)
    for c in range(C):
        for p in range(2):
            prod = xs[:, None, c, :, p] * ws[None, :, c, :, p]  # exact: 24 x 8 significant bits
            if not fma:
                prod = prod.float().double()
            acc = torch.where(valid[c, :, p], (acc.double() + prod).float(), acc)
    l = acc
    return ((l[..., 0] + l[..., 4]) + (l[..., 2] + l[..., 6])) + ((l[..., 1] + l[..., 5]) + (l[..., 3] + l[..., 7]))


@pytest.mark.parametrize("M, K, N", [(1, 576, 70), (5, 576, 33), (8, 64, 40), (31, 1536, 13), (32, 576, 61),
                                     (300, 1536, 7), (2048, 576, 12), (2048, 160, 31),
                                     (9, 40, 11), (2048, 13, 5)])  # K % 16 != 0: scalar path
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("w_dtype", WEIGHT_DTYPES)
def test_linear_dense_is_the_fixed_chain(M, K, N, x_dtype, w_dtype):
    """Bit-exact against the emulated order: the SIMD kernels (decode, blocked, AVX2 or AVX-512) all run it."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the scalar path's product/add rounding is compiler-dependent off x86-64")
    g = torch.Generator().manual_seed(M + 7 * K + 13 * N)
    x = (torch.randn(M, K, generator=g) * 4).to(x_dtype)
    w = torch.randn(N, K, generator=g).to(w_dtype)
    ref = chain_reference(x, w, fma=SIMD and K % 16 == 0).to(x_dtype)
    assert torch.equal(ops().linear_dense(x, w), ref)


def _batched(x, w, size, offset):
    """x's rows through the op in consecutive batches of `size`, the first one starting at `offset`."""
    cuts = [0] + list(range(offset, x.shape[0], size)) + [x.shape[0]]
    return torch.cat([ops().linear_dense(x[a:b], w) for a, b in zip(cuts, cuts[1:]) if b > a])


@pytest.mark.parametrize("K, N", [(576, 96), (1536, 20), (40, 9)])  # 1536: a split K; 40: scalar path
@pytest.mark.parametrize("x_dtype, w_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                              (torch.float32, torch.float32), (torch.float16, torch.float16)])
def test_linear_dense_is_row_invariant(K, N, x_dtype, w_dtype):
    """Each output row is bit-identical to the row computed alone, whatever the batch around it: decoding,
    verifying a tree and prefilling (alone or packed with other prompts) compute the same features."""
    g = torch.Generator().manual_seed(K + N)
    x = torch.randn(2048, K, generator=g).to(x_dtype)
    w = torch.randn(N, K, generator=g).to(w_dtype)
    alone = torch.cat([ops().linear_dense(x[i:i + 1], w) for i in range(x.shape[0])])
    for size, offset in [(1, 0), (3, 1), (7, 5), (8, 3), (31, 0), (32, 17), (64, 0), (64, 40), (300, 0),
                         (300, 123), (2048, 0), (2048, 1000)]:
        assert torch.equal(_batched(x, w, size, offset), alone), (size, offset)


@pytest.mark.parametrize("K, N", [(576, 99), (1728, 9), (40, 10), (13, 10)])
def test_linear_dense_is_batch_invariant(K, N):
    """Each output row is bit-identical whatever the batch around it: verification == decoding."""
    g = torch.Generator().manual_seed(K + N)
    x = torch.randn(40, K, generator=g).bfloat16()
    w = torch.randn(N, K, generator=g).bfloat16()
    full = ops().linear_dense(x, w)
    for start, size in [(0, 1), (7, 1), (3, 2), (10, 3), (20, 5), (1, 33)]:
        assert torch.equal(ops().linear_dense(x[start:start + size], w), full[start:start + size])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_dense_same_with_any_thread_count(dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(200, 576, generator=g).to(dtype)
    w = torch.randn(1000, 576, generator=g).to(dtype)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(ops().linear_dense(x, w))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


_AVX2_SCRIPT = """
import sys, torch
from eagle_kernels._ops import ops
g = torch.Generator().manual_seed(5)
for M, K, N, dt, wt in [(300, 576, 50, torch.bfloat16, torch.bfloat16), (40, 1536, 13, torch.float32, torch.bfloat16),
                       (3, 576, 9, torch.bfloat16, torch.bfloat16), (64, 576, 30, torch.float32, torch.float32),
                       (2, 576, 40, torch.float32, torch.float16)]:
    x = torch.randn(M, K, generator=g).to(dt)
    w = torch.randn(N, K, generator=g).to(wt)
    torch.save(ops().linear_dense(x, w), f"{sys.argv[1]}/{M}.pt")
"""


def test_linear_dense_avx2_kernels_give_the_same_bits(tmp_path):
    """EAGLE_CPU_AVX512=0 (the AVX2 kernels, as on AVX2-only CPUs) computes what the default path does."""
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("EAGLE_CPU_AVX512", None)
    outs = {}
    for name, flag in [("default", None), ("avx2", "0")]:
        (tmp_path / name).mkdir()
        if flag is not None:
            env["EAGLE_CPU_AVX512"] = flag
        subprocess.run([sys.executable, "-c", _AVX2_SCRIPT, str(tmp_path / name)], env=env, check=True, cwd=root)
        outs[name] = {m: torch.load(tmp_path / name / f"{m}.pt") for m in (300, 40, 3, 64, 2)}
    for m in (300, 40, 3, 64, 2):
        assert torch.equal(outs["default"][m], outs["avx2"][m]), m


def test_public_linear_routes_and_falls_back():
    x = torch.randn(2, 3, 64).bfloat16()
    w = torch.randn(48, 64).bfloat16()
    with torch.inference_mode():
        y = eagle_kernels.linear(x, w)
        big_x = torch.randn(300, 64).bfloat16()
        big = eagle_kernels.linear(big_x, w)  # prefill-sized: the same kernel, rows unchanged by the batch
        strided = eagle_kernels.linear(big_x, w.t().contiguous().t())  # a non-contiguous weight too
    assert y.shape == (2, 3, 48) and big.shape == (300, 48)
    assert torch.allclose(y.float(), (x.float() @ w.float().t()), atol=0.1, rtol=0.02)
    assert torch.equal(big[7], ops().linear_dense(big_x[7:8], w)[0]) and torch.equal(strided, big)
    assert torch.equal(y[1], eagle_kernels.linear(x[1], w))
    x32, w32 = big_x.float(), w.float()    # fp32 weights: the same kernel, not torch's row-variant GEMM
    assert torch.equal(eagle_kernels.linear(x32, w32)[:5], eagle_kernels.linear(x32[:5], w32))
    b = torch.randn(48)
    assert torch.allclose(eagle_kernels.linear(x.float(), w.float(), b), torch.nn.functional.linear(x.float(), w.float(), b))


def test_edge_sizes():
    w = torch.randn(5, 32).bfloat16()
    assert ops().linear_dense(torch.randn(0, 32).bfloat16(), w).shape == (0, 5)
    assert torch.equal(ops().linear_dense(torch.randn(9, 0), torch.randn(4, 0).bfloat16()), torch.zeros(9, 4))


def test_bad_inputs():
    with pytest.raises(ValueError, match="w must be a contiguous bf16 / fp32 / fp16"):
        ops().linear_dense(torch.randn(1, 8), torch.randn(4, 8).double())
    with pytest.raises(ValueError, match="K = w.size"):
        ops().linear_dense(torch.randn(1, 9), torch.randn(4, 8).bfloat16())
    with pytest.raises(ValueError, match="x must be bf16, fp32 or fp16"):
        ops().linear_dense(torch.randn(1, 8).int(), torch.randn(4, 8))
