"""paged_attention (torch path and Triton kernel), write_kv and move_kv against naive references.

Without CUDA the Triton kernel runs under TRITON_INTERPRET=1, which only takes effect if it is set before
triton is first imported in the process (this module is collected before the engine tests import it; when it
is not, the Triton cases are skipped with a warning). The interpreter's tl.dot is wrong on bf16 operands, so
the Triton bf16 case runs on CUDA only (the torch path covers bf16 everywhere).
"""
import os
import warnings

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import eagle_kernels.attention as attention  # noqa: E402
from kernel_refs_attention import (ancestor_mask_bits, random_bfs_parents, ref_move_kv,  # noqa: E402
                                   ref_paged_attention, ref_paged_attention_dense, ref_write_kv)

# Triton decides "interpret or compile" when it decorates a kernel, its own jit'd library (tl.max, ...) included,
# at its first import: if that happened before TRITON_INTERPRET was set, kernels cannot be interpreted here.
TRITON_USABLE = attention.triton is not None and (
    torch.cuda.is_available() or "Interpret" in type(attention.triton.language.max).__name__)
if attention.triton is not None and not TRITON_USABLE:
    warnings.warn("Triton was imported before TRITON_INTERPRET=1 was set: Triton tests skipped "
                  "(set it in tests/conftest.py or run this file on its own)")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
HAS_TRITON = TRITON_USABLE
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
BLOCK_SIZE = 16

# (prefix_lens, new-token counts): ragged prefixes incl. 0 and block-boundary crossings; decode, small
# trees/chains, and > 32 new tokens (two mask words).
SCENARIOS = [
    ([0, 16, 37], [1, 5, 17]),
    ([15, 70], [1, 1]),
    ([31], [40]),
    ([0], [33]),
]
# (Hq, Hkv, D): GQA ratios 1, 3 (the 135M model's 9/3 heads) and 4; head dims 64 and 128.
HEADS = [(2, 2, 64), (9, 3, 64), (8, 2, 64), (8, 2, 128)]


def make_batch(prefixes, ns, hq, hkv, d, dtype, tree, seed=0):
    """Random q / paged cache with shuffled, non-consecutive block tables; tree masks from random BFS trees."""
    gen = torch.Generator().manual_seed(seed)
    b = len(prefixes)
    blocks_per_seq = [-(-(p + n) // BLOCK_SIZE) for p, n in zip(prefixes, ns)]
    max_blocks = max(blocks_per_seq) + 1            # one spare column: stale entries must be ignored
    num_blocks = sum(blocks_per_seq) + 3
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, hkv, d, generator=gen).to(dtype)
    ids = torch.randperm(num_blocks, generator=gen).int()
    block_tables = torch.full((b, max_blocks), num_blocks - 1, dtype=torch.int32)
    used = 0
    for i, nb in enumerate(blocks_per_seq):
        block_tables[i, :nb] = ids[used:used + nb]
        used += nb
    cu = torch.tensor([0] + torch.tensor(ns).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), hq, d, generator=gen).to(dtype)
    tree_mask = None
    if tree:
        words = (max(ns) + 31) // 32
        rows = [ancestor_mask_bits(random_bfs_parents(n, gen)) for n in ns]
        tree_mask = torch.cat([torch.nn.functional.pad(r, (0, words - r.shape[1])) for r in rows])
    return q, k_cache, v_cache, block_tables, cu, torch.tensor(prefixes, dtype=torch.int32), tree_mask


def to_dev(args):
    return [a.to(DEV) if a is not None else None for a in args]


def check_close(out, ref, dtype):
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out.double().cpu(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hq{h[0]}-hkv{h[1]}-d{h[2]}")
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: f"p{s[0]}-n{s[1]}")
def test_paged_attention_fp32_fp16(scenario, heads, tree):
    for dtype in (torch.float32, torch.float16):
        args = make_batch(*scenario, *heads, dtype, tree)
        ref = ref_paged_attention(*args)
        check_close(attention.paged_attention(*args), ref, dtype)
        if HAS_TRITON:
            check_close(attention.paged_attention_triton(*to_dev(args)), ref, dtype)


@pytest.mark.skipif(not HAS_TRITON, reason="Triton not installed or not interpretable")
@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
@pytest.mark.parametrize("scenario", SCENARIOS + [([150, 200], [1, 3])], ids=lambda s: f"p{s[0]}-n{s[1]}")
def test_triton_split_kv(scenario, tree):
    # Forced splits of each prefix (even 64-key-aligned ranges here): empty splits, splits ending mid-block,
    # prefix 0.
    for dtype in (torch.float32, torch.float16):
        args = make_batch(*scenario, 9, 3, 64, dtype, tree)
        out = attention.paged_attention_triton(*to_dev(args), num_splits=4)
        check_close(out, ref_paged_attention(*args), dtype)


@pytest.mark.skipif(not HAS_TRITON, reason="Triton not installed or not interpretable")
def test_triton_split_kv_uneven_count():
    # 3 ranges per prefix: 150 and 200 keys cut at 64-key boundaries, ranges ending mid-block, one empty range.
    args = make_batch([150, 200, 0], [2, 1, 3], 9, 3, 64, torch.float32, True, seed=2)
    out = attention.paged_attention_triton(*to_dev(args), num_splits=3)
    check_close(out, ref_paged_attention(*args), torch.float32)


@pytest.mark.skipif(attention.triton is None, reason="Triton not installed")
def test_split_plan_is_stable_as_tables_grow():
    # A generation whose block tables grow one block at a time (eager mode) and batches of 1..64 sequences:
    # NUM_SPLITS stays a power of two <= 16, so the kernel compiles at most five variants; a fixed-width
    # table (the CUDA-graph path) gives one count per batch shape.
    counts = set()
    for programs in (3, 6, 24, 96, 192):
        per_shape = {attention._split_plan(132, programs, blocks * 16, 64, None) for blocks in range(1, 513)}
        counts |= {n for n, _ in per_shape}
        assert len(per_shape) <= 5 and {m for _, m in per_shape} == {attention._MIN_SPLIT_KEYS}
    assert counts <= {1, 2, 4, 8, 16} and 16 in counts and 1 in counts
    assert attention._split_plan(None, 3, 8192, 64, None) == (1, attention._MIN_SPLIT_KEYS)
    assert attention._split_plan(132, 3, 8192, 64, 3) == (3, 64)


@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
def test_paged_attention_bf16_torch_path(tree):
    args = make_batch([0, 16, 37], [1, 5, 17], 9, 3, 64, torch.bfloat16, tree)
    check_close(attention.paged_attention(*args), ref_paged_attention(*args), torch.bfloat16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="interpreter tl.dot is wrong on bf16; GPU only")
@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
def test_paged_attention_bf16_triton(tree):
    args = make_batch([0, 16, 37], [1, 5, 17], 8, 2, 128, torch.bfloat16, tree)
    check_close(attention.paged_attention_triton(*to_dev(args)), ref_paged_attention(*args), torch.bfloat16)


@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
def test_dense_benchmark_reference_matches_naive(tree):
    args = make_batch([0, 16, 37], [1, 5, 17], 9, 3, 64, torch.float32, tree)
    check_close(ref_paged_attention_dense(*args), ref_paged_attention(*args), torch.float32)


def test_custom_scale_and_decode_batch_paths():
    # Decode batch (T == B) takes the padded batched torch path and the 1-token Triton tiling.
    args = make_batch([3, 0, 50], [1, 1, 1], 9, 3, 64, torch.float32, False, seed=3)
    ref = ref_paged_attention(*args, scale=0.3)
    check_close(attention.paged_attention(*args, scale=0.3), ref, torch.float32)
    if HAS_TRITON:
        check_close(attention.paged_attention_triton(*to_dev(args), scale=0.3), ref, torch.float32)


def test_empty_sequence_in_batch():
    # T == B without every sequence decoding one token (n = 0 and n = 2): must not take the decode paths' shortcut.
    args = make_batch([5, 20], [0, 2], 9, 3, 64, torch.float32, False, seed=4)
    ref = ref_paged_attention(*args)
    check_close(attention.paged_attention(*args), ref, torch.float32)
    if HAS_TRITON:
        check_close(attention.paged_attention_triton(*to_dev(args)), ref, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 2, 128)], ids=lambda h: f"hq{h[0]}-hkv{h[1]}-d{h[2]}")
@pytest.mark.parametrize("scenario", SCENARIOS + [([300, 5], [40, 2])], ids=lambda s: f"p{s[0]}-n{s[1]}")
def test_cpp_kernel_matches_reference(scenario, heads, tree, dtype):
    """eagle::paged_attention itself; 40 new tokens x 3 (or 4) q heads: rows cut into several tasks."""
    if not attention._CPU_KERNEL:
        pytest.skip("eagle_kernels._C not built")
    args = make_batch(*scenario, *heads, dtype, tree, seed=7)
    check_close(attention.ops().paged_attention(*args), ref_paged_attention(*args), dtype)


def test_write_then_attend_matches_dense_causal_attention():
    """Engine-style use: write K/V through slot_mapping, then prefill attention == dense causal SDPA."""
    gen = torch.Generator().manual_seed(5)
    n, hq, hkv, d = 37, 6, 2, 64
    k_cache = torch.zeros(8, BLOCK_SIZE, hkv, d)
    v_cache = torch.zeros_like(k_cache)
    table = torch.tensor([[5, 2, 7]], dtype=torch.int32)
    pos = torch.arange(n)
    slots = table[0, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
    q, k, v = (torch.randn(n, h, d, generator=gen) for h in (hq, hkv, hkv))
    attention.write_kv(k, v, k_cache, v_cache, slots)
    out = attention.paged_attention(q, k_cache, v_cache, table, torch.tensor([0, n], dtype=torch.int32),
                                    torch.tensor([0], dtype=torch.int32))
    dense = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(3, 1).transpose(0, 1), v.repeat_interleave(3, 1).transpose(0, 1),
        is_causal=True).transpose(0, 1)
    torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5)


def test_write_kv_matches_reference():
    gen = torch.Generator().manual_seed(1)
    k_cache = torch.randn(6, BLOCK_SIZE, 2, 64, generator=gen)
    v_cache = torch.randn_like(k_cache)
    k, v = torch.randn(2, 9, 2, 64, generator=gen)
    slots = torch.randperm(6 * BLOCK_SIZE, generator=gen)[:9]
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    ref_write_kv(k, v, expect_k, expect_v, slots)
    attention.write_kv(k, v, k_cache, v_cache, slots.int())
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)


def test_move_kv_reads_sources_before_writing():
    gen = torch.Generator().manual_seed(2)
    k_cache = torch.randn(4, BLOCK_SIZE, 2, 64, generator=gen)
    v_cache = torch.randn_like(k_cache)
    # A chain (a -> b while b -> c) and a swap: wrong if any destination is written before all reads.
    src = torch.tensor([3, 9, 20, 40, 41])
    dst = torch.tensor([9, 20, 21, 41, 40])
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    ref_move_kv(expect_k, expect_v, src, dst)
    attention.move_kv(k_cache, v_cache, src, dst)
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)


def bad_inputs():
    good = make_batch([4], [3], 4, 2, 64, torch.float32, True)
    q, kc, vc, bt, cu, pl, tm = good
    return [
        ("q must be", (q[0], kc, vc, bt, cu, pl, tm)),
        ("share one of", (q.double(), kc, vc, bt, cu, pl, tm)),
        ("head_dim mismatch", (q[..., :32], kc, vc, bt, cu, pl, tm)),
        ("multiple of Hkv", (q[:, :3], kc, vc, bt, cu, pl, tm)),
        ("block_tables must be int32", (q, kc, vc, bt.long(), cu, pl, tm)),
        ("cu_seqlens_q must be", (q, kc, vc, bt, cu[:1], pl, tm)),
        ("prefix_lens must be", (q, kc, vc, bt, cu, pl.long(), tm)),
        ("tree_mask must be", (q, kc, vc, bt, cu, pl, tm[:1])),
        ("k_cache/v_cache", (q, kc, vc[:, :8], bt, cu, pl, tm)),
    ]


@pytest.mark.parametrize("fn", ["paged_attention", "paged_attention_torch", "paged_attention_triton"])
def test_bad_inputs_raise(fn):
    if fn == "paged_attention_triton" and not HAS_TRITON:
        pytest.skip("Triton not installed or not interpretable")
    for message, args in bad_inputs():
        with pytest.raises(ValueError, match=message):
            getattr(attention, fn)(*args)


@pytest.mark.skipif(not HAS_TRITON, reason="Triton not installed or not interpretable")
def test_triton_launcher_rejects_non_contiguous():
    q, kc, vc, bt, cu, pl, tm = to_dev(make_batch([4], [3], 4, 2, 64, torch.float32, False))
    k_strided = kc.transpose(0, 1).contiguous().transpose(0, 1)
    with pytest.raises(ValueError, match="contiguous"):
        attention.paged_attention_triton(q, k_strided, vc, bt, cu, pl)


def test_cache_ops_reject_bad_shapes():
    kc = torch.zeros(2, BLOCK_SIZE, 2, 8)
    with pytest.raises(ValueError, match="write_kv"):
        attention.write_kv(torch.zeros(3, 2, 4), torch.zeros(3, 2, 4), kc, kc.clone(), torch.arange(3))
    with pytest.raises(ValueError, match="slot_mapping"):
        attention.write_kv(torch.zeros(3, 2, 8), torch.zeros(3, 2, 8), kc, kc.clone(), torch.arange(4))
    with pytest.raises(ValueError, match="dst_slots"):
        attention.move_kv(kc, kc.clone(), torch.arange(3), torch.arange(2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 2, 128)], ids=lambda h: f"hq{h[0]}-hkv{h[1]}-d{h[2]}")
@pytest.mark.parametrize("tree", [False, True], ids=["causal", "causal-as-tree-mask"])
def test_cpp_kernel_chain_rows_equal_decode_bitwise(heads, tree, dtype):
    """Verifying a chain of n tokens must give each token, bit for bit, what decoding it alone gives (the
    lossless bf16 invariant), whatever the rows that share its task: every decode below runs alone."""
    if not attention._CPU_KERNEL:
        pytest.skip("eagle_kernels._C not built")
    prefix, n = 45, 7
    q, k_cache, v_cache, tables, cu, prefix_lens, _ = make_batch([prefix], [n], *heads, dtype, False, seed=3)
    mask = ancestor_mask_bits(list(range(-1, n - 1))) if tree else None  # the chain as an explicit tree
    chain = attention.ops().paged_attention(q, k_cache, v_cache, tables, cu, prefix_lens, mask)
    one = torch.tensor([0, 1], dtype=torch.int32)
    for i in range(n):
        alone = attention.ops().paged_attention(q[i:i + 1], k_cache, v_cache, tables, one,
                                                torch.tensor([prefix + i], dtype=torch.int32))
        assert torch.equal(alone, chain[i:i + 1]), f"token {i}"


_AVX2_SCRIPT = """
import sys, torch
sys.path.insert(0, "tests")
from test_attention_kernel import make_batch
from eagle_kernels._ops import ops
torch.set_num_threads(int(sys.argv[2]))
outs = []
for i, (scenario, heads, dtype) in enumerate([(([37, 301], [1, 4]), (9, 3, 64), torch.bfloat16),
                                              (([0, 16, 77], [1, 5, 17]), (8, 2, 128), torch.bfloat16),
                                              (([129], [7]), (9, 3, 64), torch.float32),
                                              (([15, 70, 3], [1, 1, 1]), (6, 3, 64), torch.float16)]):
    for tree in (False, True):
        outs.append(ops().paged_attention(*make_batch(*scenario, *heads, dtype, tree, seed=i)))
torch.save(outs, sys.argv[1])
"""


@pytest.mark.parametrize("threads", [1, 2])
def test_cpp_kernel_avx2_and_avx512_give_the_same_bits(tmp_path, threads):
    """EAGLE_CPU_AVX512=0 (AVX2 only, as on older CPUs) computes what the default path does, bit for bit, with
    odd key and row counts (the AVX-512 code pairs keys and rows)."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(root))
    outs = []
    for flag in ("1", "0"):
        subprocess.run([sys.executable, "-c", _AVX2_SCRIPT, str(tmp_path / flag), str(threads)], check=True, cwd=root,
                       env={**env, "EAGLE_CPU_AVX512": flag})
        outs.append(torch.load(tmp_path / flag))
    assert len(outs[0]) == 8 and all(torch.equal(a, b) for a, b in zip(*outs))
