"""paged_attention: C++ kernel (CPU), torch path (every device) and Triton kernel (CUDA) against the dense reference.

Bytes moved = the K/V each sequence reads once (prefix + new tokens, all kv heads) + q in + out, which is
what a GQA-grouped kernel must stream; run with `pytest benchmarks/ --benchmark-only`.
"""
import pytest
import torch
from kernel_refs_attention import ancestor_mask_bits, random_bfs_parents, ref_paged_attention_dense

from eagle_kernels import attention

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK_SIZE = 16
# name: (prefix_lens, new tokens per sequence, Hq, Hkv, D, tree). The first four are the 135M target
# (9 q / 3 kv heads, D = 64) at the engine's batch sizes; the GPU adds an 8B-class head layout.
SHAPES = {
    "decode-b1-2k": ([2048], [1], 9, 3, 64, False),
    "decode-b8-1k": ([1024 - 64 * i for i in range(8)], [1] * 8, 9, 3, 64, False),
    "tree64-b1-1k": ([1024], [64], 9, 3, 64, True),
    "prefill-128": ([0], [128], 9, 3, 64, False),
    "prefill-512": ([0], [512], 9, 3, 64, False),
    "prefill-1k": ([0], [1024], 9, 3, 64, False),
    "chunk-512-after-512": ([512], [512], 9, 3, 64, False),
}
if DEVICE.type == "cuda":
    SHAPES |= {
        "decode-b32-4k-d128": ([4096] * 32, [1] * 32, 32, 8, 128, False),
        "tree64-b8-2k-d128": ([2048] * 8, [64] * 8, 32, 8, 128, True),
    }
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
IMPLS = {"torch": attention.paged_attention_torch, "reference": ref_paged_attention_dense}
if DEVICE.type == "cuda" and attention.triton is not None:
    IMPLS["triton"] = attention.paged_attention_triton
if DEVICE.type == "cpu":
    IMPLS["cpp"] = attention.paged_attention  # eagle::paged_attention on CPU tensors


def make_inputs(prefixes, ns, hq, hkv, d, tree):
    gen = torch.Generator().manual_seed(0)
    nblk = [-(-(p + n) // BLOCK_SIZE) for p, n in zip(prefixes, ns)]
    k_cache = torch.randn(sum(nblk), BLOCK_SIZE, hkv, d, generator=gen).to(DTYPE)
    v_cache = torch.randn_like(k_cache)
    # Blocks of different sequences interleave, as they do once sequences grow step by step.
    ids = torch.arange(sum(nblk))
    tables = torch.zeros(len(prefixes), max(nblk), dtype=torch.int32)
    owner = torch.cat([torch.full((c,), b) for b, c in enumerate(nblk)])
    order = owner[torch.randperm(len(owner), generator=gen)]
    for b in range(len(prefixes)):
        tables[b, :nblk[b]] = ids[order == b].int()
    cu = torch.tensor([0] + torch.tensor(ns).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), hq, d, generator=gen).to(DTYPE)
    mask = torch.cat([ancestor_mask_bits(random_bfs_parents(n, gen)) for n in ns]) if tree else None
    args = (q, k_cache, v_cache, tables, cu, torch.tensor(prefixes, dtype=torch.int32), mask)
    return [a.to(DEVICE) if a is not None else None for a in args]


def bytes_moved(prefixes, ns, hq, hkv, d):
    elem = torch.finfo(DTYPE).bits // 8
    kv = 2 * sum(p + n for p, n in zip(prefixes, ns)) * hkv * d
    return (kv + 2 * sum(ns) * hq * d) * elem


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_paged_attention(bandwidth, shape, impl):
    spec = SHAPES[shape]
    args = make_inputs(*spec)
    bandwidth(lambda: IMPLS[impl](*args), bytes_moved(*spec[:5]), DEVICE)
