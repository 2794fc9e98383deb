"""Naive torch references for the attention / cache ops: explicit per-query loops over the logical K/V list.

Deliberately simple (no batching tricks) so that they are obviously right; only for small test shapes.
"""
import math

import torch


def random_bfs_parents(n, gen):
    """parents[0] = -1, parents[i] uniform in [0, i): a random tree in BFS-compatible order."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


def ancestor_mask_bits(parents):
    """parents: list of n ints -> int32 [n, W] with bit j of row i set iff j is i or an ancestor of i."""
    n = len(parents)
    w = (n + 31) // 32
    words = [[0] * w for _ in range(n)]
    for i in range(n):
        j = i
        while j != -1:
            words[i][j // 32] |= 1 << (j % 32)
            j = parents[j]
    # Store the uint32 bit patterns in int32 (bit 31 becomes the sign bit).
    signed = [[x - (1 << 32) if x >= 1 << 31 else x for x in row] for row in words]
    return torch.tensor(signed, dtype=torch.int32).reshape(n, w)


def mask_bit(tree_mask_row, j):
    return (int(tree_mask_row[j // 32]) >> (j % 32)) & 1 == 1


def logical_kv(cache, block_table, length):
    """cache: [num_blocks, bs, Hkv, D] -> [length, Hkv, D] read token by token through the block table."""
    bs = cache.shape[1]
    return torch.stack([cache[int(block_table[p // bs]), p % bs] for p in range(length)]) if length else \
        cache.new_zeros(0, *cache.shape[2:])


def ref_paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens, tree_mask=None, scale=None):
    """Same contract as eagle_kernels.paged_attention, computed in fp64 one query row at a time."""
    t_total, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(t_total, hq, d, dtype=torch.float64)
    for b in range(block_tables.shape[0]):
        t0, t1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        prefix = int(prefix_lens[b])
        keys = logical_kv(k_cache, block_tables[b], prefix + t1 - t0).double()
        vals = logical_kv(v_cache, block_tables[b], prefix + t1 - t0).double()
        for i in range(t1 - t0):
            visible = list(range(prefix))
            for j in range(t1 - t0):
                seen = j <= i if tree_mask is None else mask_bit(tree_mask[t0 + i], j)
                if seen:
                    visible.append(prefix + j)
            for h in range(hq):
                kv_h = h // group
                s = torch.stack([keys[p, kv_h] @ q[t0 + i, h].double() for p in visible]) * scale
                w = torch.softmax(s, dim=0)
                out[t0 + i, h] = sum(w[c] * vals[p, kv_h] for c, p in enumerate(visible))
    return out


def ref_write_kv(k, v, k_cache, v_cache, slot_mapping):
    bs = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        k_cache[slot // bs, slot % bs] = k[t]
        v_cache[slot // bs, slot % bs] = v[t]


def ref_move_kv(k_cache, v_cache, src_slots, dst_slots):
    bs = k_cache.shape[1]
    saved = [(k_cache[s // bs, s % bs].clone(), v_cache[s // bs, s % bs].clone()) for s in src_slots.tolist()]
    for (k, v), dst in zip(saved, dst_slots.tolist()):
        k_cache[dst // bs, dst % bs] = k
        v_cache[dst // bs, dst % bs] = v


def ref_paged_attention_dense(q, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens, tree_mask=None,
                              scale=None):
    """Vectorised but unoptimised reference (fp32 math per sequence: token-level gather, repeated kv heads,
    explicit [n, L] mask): the baseline the benchmarks time the fast paths against."""
    hq, d = q.shape[1], q.shape[2]
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.empty_like(q)
    for b in range(block_tables.shape[0]):
        t0, t1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        prefix, n = int(prefix_lens[b]), t1 - t0
        pos = torch.arange(prefix + n, device=q.device)
        blocks = block_tables[b, pos // bs].long()
        k = k_cache[blocks, pos % bs].float().repeat_interleave(hq // hkv, dim=1)   # [L, Hq, D]
        v = v_cache[blocks, pos % bs].float().repeat_interleave(hq // hkv, dim=1)
        allowed = torch.ones(n, prefix + n, dtype=torch.bool, device=q.device)
        j = torch.arange(n, device=q.device)
        if tree_mask is None:
            allowed[:, prefix:] = j[None, :] <= j[:, None]
        else:
            allowed[:, prefix:] = (tree_mask[t0:t1, j // 32] >> (j % 32).int()) & 1 == 1
        scores = torch.einsum("ihd,lhd->hil", q[t0:t1].float(), k) * scale
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        out[t0:t1] = torch.einsum("hil,lhd->ihd", probs, v).to(q.dtype)
    return out
