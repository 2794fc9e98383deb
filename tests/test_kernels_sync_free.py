"""The kernels a speculative round calls make no host reads: each runs inside no_host_reads() on CPU tensors and
gives what it gives outside. The Triton paths run under triton_on_cpu() (the interpreter: small shapes, fp32).
"""
import contextlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import eagle_kernels  # noqa: E402
import eagle_kernels.attention as attention  # noqa: E402
from eagle_kernels.expand import topk_expand, topk_low_index_first  # noqa: E402
from eagle_kernels.sampling import sampling_probs  # noqa: E402
from host_reads import HostRead, no_host_reads  # noqa: E402
from kernel_refs_attention import ancestor_mask_bits, random_bfs_parents, ref_paged_attention  # noqa: E402

TRITON_USABLE = attention.triton is not None and (
    torch.cuda.is_available() or "Interpret" in type(attention.triton.language.max).__name__)
needs_triton = pytest.mark.skipif(not TRITON_USABLE, reason="Triton not installed or not interpretable")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where the Triton paths run


def triton_path():
    """The context in which DEV tensors take the Triton kernels (natively on a GPU, else the interpreter)."""
    return contextlib.nullcontext() if DEV.type == "cuda" else eagle_kernels.triton_on_cpu()


def same_inside(fn):
    """fn() outside and inside no_host_reads(): the results must be identical."""
    outside = fn()
    with no_host_reads():
        inside = fn()
    for a, b in zip(outside if isinstance(outside, tuple) else (outside,),
                    inside if isinstance(inside, tuple) else (inside,)):
        assert torch.equal(a, b)
    return outside


def test_no_host_reads_catches_reads():
    x = torch.ones(3)
    with no_host_reads(), pytest.raises(HostRead):
        bool(x.any())


def test_sampling_probs_mixed_rows():
    # Untouched, top-k only, top-k + top-p, top-p only with its cut inside and far past the first 1024 tokens.
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 3000, generator=gen) * torch.tensor([1.0, 2.0, 2.0, 6.0, 0.01, 1.0])[:, None]
    temperature = [1.0, 0.7, 1.2, 1.0, 1.0, 0.5]
    top_k = [0, 20, 50, 0, 0, 3000]
    top_p = [1.0, 1.0, 0.8, 0.9, 0.9, 0.95]
    out = same_inside(lambda: sampling_probs(logits, temperature, top_k, top_p))
    assert (out[4] > 0).sum() > 1024 and torch.equal(out[0], torch.softmax(logits[0], -1))
    # Tensor parameters (a full sort of every row) are sync-free too, and keep the same tokens.
    as_tensors = same_inside(lambda: sampling_probs(logits, torch.tensor(temperature), torch.tensor(top_k),
                                                    torch.tensor(top_p)))
    assert torch.equal(as_tensors > 0, out > 0)


def test_sampling_probs_one_kind_of_row():
    logits = torch.randn(2, 3, 500)
    same_inside(lambda: sampling_probs(logits, 0.8, 0, 0.7))
    same_inside(lambda: sampling_probs(logits, [0.8, 1.1], [10, 0], 1.0))


def test_topk_low_index_first_many_ties_at_the_cut():
    x = torch.randint(-2, 3, (4, 2, 300), generator=torch.Generator().manual_seed(1)).float()
    for k in (1, 7, 100, 300):
        vals, ids = same_inside(lambda: topk_low_index_first(x, k))
        ref = torch.sort(x, dim=-1, descending=True, stable=True)
        assert torch.equal(ids, ref.indices[..., :k]) and torch.equal(vals, ref.values[..., :k])


def test_topk_expand_torch_path():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randint(-3, 4, (2, 4, 64), generator=gen).float()
    d2t = torch.randint(0, 50, (64,), generator=gen)
    same_inside(lambda: tuple(topk_expand(logits, torch.zeros(2, 4), 6, d2t)))


@needs_triton
def test_topk_expand_triton_path():
    gen = torch.Generator().manual_seed(3)
    logits, scores = torch.randn(1, 3, 100, generator=gen), -torch.rand(1, 3, generator=gen)
    torch_out = topk_expand(logits, scores, 4)
    with triton_path():
        out = same_inside(lambda: tuple(topk_expand(logits.to(DEV), scores.to(DEV), 4)))
    assert torch.equal(out[0].cpu(), torch_out[0]) and torch.equal(out[2].cpu(), torch_out[2])


def paged_batch(prefixes, ns, dtype, tree, hq=4, hkv=2, d=32, bs=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    nblk = [-(-(p + n) // bs) for p, n in zip(prefixes, ns)]
    num_blocks = sum(nblk) + 1
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=gen).to(dtype)
    ids = torch.randperm(num_blocks, generator=gen).int()
    tables = torch.zeros(len(ns), max(nblk) + 2, dtype=torch.int32)   # spare columns: a fixed-width table
    starts = [sum(nblk[:i]) for i in range(len(ns))]
    for i, (s, nb) in enumerate(zip(starts, nblk)):
        tables[i, :nb] = ids[s:s + nb]
    cu = torch.tensor([sum(ns[:i]) for i in range(len(ns) + 1)], dtype=torch.int32)
    q = torch.randn(sum(ns), hq, d, generator=gen).to(dtype)
    mask = None
    if tree:
        words = (max(ns) + 31) // 32
        rows = [ancestor_mask_bits(random_bfs_parents(n, gen)) for n in ns]
        mask = torch.cat([torch.nn.functional.pad(r, (0, words - r.shape[1])) for r in rows])
    return q, k_cache, v_cache, tables, cu, torch.tensor(prefixes, dtype=torch.int32), mask


@pytest.mark.skipif(not attention._CPU_KERNEL, reason="eagle_kernels._C not built")
@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
def test_paged_attention_cpu_makes_no_host_reads(tree):
    """Every CPU step (decode, trees, prefills of any length) takes the C++ kernel without reading lengths."""
    args = paged_batch([40, 0, 17], [5, 3, 60], torch.float32, tree)
    out = same_inside(lambda: attention.paged_attention(*args))
    assert torch.equal(out, attention.ops().paged_attention(*args))


@needs_triton
@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
def test_paged_attention_triton_path(tree):
    args = paged_batch([70, 0, 33], [3, 2, 1], torch.float32, tree, seed=1)
    on_dev = [a if a is None else a.to(DEV) for a in args]
    with triton_path():
        out = same_inside(lambda: attention.paged_attention(*on_dev))
    split = same_inside(lambda: attention.paged_attention_triton(*on_dev, num_splits=2))
    ref = ref_paged_attention(*args)
    torch.testing.assert_close(out.double().cpu(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(split.double().cpu(), ref, atol=1e-5, rtol=1e-5)
