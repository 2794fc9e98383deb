"""Tree-masked paged attention over a block-paged KV cache, and the cache writes it relies on.

Contracts: DESIGN.md ("paged_attention", "write_kv", "move_kv"). `paged_attention` runs the Triton kernel for
CUDA tensors when Triton is importable and the torch path otherwise (CPU: one fused SDPA call per sequence).
"""
import math

import torch
import torch.nn.functional as F

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _fail(msg):
    raise ValueError(f"paged_attention: {msg}")


def _check_paged_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens, tree_mask):
    """Shape/dtype/device checks that need no host sync; returns (B, W) with W = words per mask row."""
    if q.dim() != 3:
        _fail(f"q must be [T, Hq, D], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        _fail(f"k_cache/v_cache must both be [num_blocks, block_size, Hkv, D], got "
              f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if q.dtype not in _FLOATS or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        _fail(f"q, k_cache, v_cache must share one of {_FLOATS}, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    if k_cache.shape[3] != d:
        _fail(f"head_dim mismatch: q has {d}, cache has {k_cache.shape[3]}")
    if hq % hkv != 0:
        _fail(f"Hq={hq} must be a multiple of Hkv={hkv}")
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32:
        _fail(f"block_tables must be int32 [B, max_blocks], got {block_tables.dtype} {tuple(block_tables.shape)}")
    b = block_tables.shape[0]
    if cu_seqlens_q.dtype != torch.int32 or tuple(cu_seqlens_q.shape) != (b + 1,):
        _fail(f"cu_seqlens_q must be int32 [B + 1] = [{b + 1}], got {cu_seqlens_q.dtype} {tuple(cu_seqlens_q.shape)}")
    if prefix_lens.dtype != torch.int32 or tuple(prefix_lens.shape) != (b,):
        _fail(f"prefix_lens must be int32 [B] = [{b}], got {prefix_lens.dtype} {tuple(prefix_lens.shape)}")
    w = 0
    if tree_mask is not None:
        if tree_mask.dtype != torch.int32 or tree_mask.dim() != 2 or tree_mask.shape[0] != q.shape[0]:
            _fail(f"tree_mask must be int32 [T={q.shape[0]}, W], got {tree_mask.dtype} {tuple(tree_mask.shape)}")
        w = tree_mask.shape[1]
    tensors = [k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens] + ([tree_mask] if tree_mask is not None else [])
    if any(t.device != q.device for t in tensors):
        _fail(f"all tensors must be on {q.device}, got {[str(t.device) for t in tensors]}")
    return b, w


def paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens, tree_mask=None, scale=None):
    """q: [T, Hq, D] packed new tokens -> [T, Hq, D]; see DESIGN.md for the masking rule."""
    _check_paged_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens, tree_mask)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _paged_attention_torch(q, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens, tree_mask, scale)


# ----------------------------------------------------------------------------------------------------------
# torch path (CPU, and CUDA without Triton)
# ----------------------------------------------------------------------------------------------------------

def _gather_kv(cache, table_row, blocks, length):
    """cache: [num_blocks, bs, Hkv, D] -> [Hkv, length, D]; a view when the blocks are consecutive.

    table_row: the sequence's block ids as a python list, blocks: the same ids as a tensor.
    """
    first = table_row[0]
    if table_row == list(range(first, first + len(table_row))):
        kv = cache[first:first + len(table_row)]
    else:
        kv = cache.index_select(0, blocks)
    return kv.flatten(0, 1)[:length].transpose(0, 1)


def _new_token_mask(tree_mask, n):
    """tree_mask: int32 [n, W] rows of this sequence -> bool [n, n]: bit j of row i (word j // 32)."""
    j = torch.arange(n, device=tree_mask.device)
    words = tree_mask[:, j // 32]
    return ((words >> (j % 32).to(torch.int32)) & 1).bool()


def _sequence_mask(prefix, n, tree_rows, device):
    """Boolean [n, prefix + n] mask (True = attend), or None when plain SDPA masking suffices."""
    if tree_rows is None and n == 1:
        return None
    mask = torch.ones(n, prefix + n, dtype=torch.bool, device=device)
    if tree_rows is None:
        mask[:, prefix:] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    else:
        mask[:, prefix:] = _new_token_mask(tree_rows, n)
    return mask


# Padded batched decode copies every sequence's K/V once; past this length (measured on 2 CPU cores,
# 9 q / 3 kv heads, D = 64) per-sequence SDPA over cache views is faster.
_BATCHED_DECODE_MAX_LEN = 1024


def _paged_attention_torch(q, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens, tree_mask, scale):
    bs = k_cache.shape[1]
    cu = cu_seqlens_q.tolist()
    prefixes = prefix_lens.tolist()
    if tree_mask is None and q.shape[0] == len(prefixes) > 1 and max(prefixes) < _BATCHED_DECODE_MAX_LEN:
        return _decode_batched(q, k_cache, v_cache, block_tables, prefixes, scale)
    out = torch.empty_like(q)
    gqa = q.shape[1] != k_cache.shape[2]
    for b, prefix in enumerate(prefixes):
        t0, t1 = cu[b], cu[b + 1]
        n = t1 - t0
        if n == 0:
            continue
        length = prefix + n
        nblk = -(-length // bs)
        row, blocks = block_tables[b, :nblk].tolist(), block_tables[b, :nblk]
        k = _gather_kv(k_cache, row, blocks, length)
        v = _gather_kv(v_cache, row, blocks, length)
        rows = None if tree_mask is None else tree_mask[t0:t1]
        mask = _sequence_mask(prefix, n, rows, q.device)
        # q_b: [1, Hq, n, D] against k, v: [1, Hkv, L, D]; SDPA shares each kv head with its q-head group.
        # (The 4-D form matters: 3-D inputs take a slower CPU path.)
        o = F.scaled_dot_product_attention(q[None, t0:t1].transpose(1, 2), k[None], v[None], attn_mask=mask,
                                           scale=scale, enable_gqa=gqa)
        out[t0:t1] = o[0].transpose(0, 1)
    return out


def _decode_batched(q, k_cache, v_cache, block_tables, prefixes, scale):
    """One query per sequence: pad every sequence to the longest and run a single SDPA call."""
    bs = k_cache.shape[1]
    lengths = torch.tensor(prefixes, device=q.device) + 1
    max_len = max(prefixes) + 1
    nblk = -(-max_len // bs)
    cols = torch.arange(nblk, device=q.device)
    # Table entries past a sequence's own blocks may be stale; point them at its first block (masked anyway).
    blocks = torch.where(cols * bs < lengths[:, None], block_tables[:, :nblk], block_tables[:, :1])
    k = k_cache[blocks].flatten(1, 2)[:, :max_len].transpose(1, 2)  # [B, Hkv, Lmax, D]
    v = v_cache[blocks].flatten(1, 2)[:, :max_len].transpose(1, 2)
    mask = (torch.arange(max_len, device=q.device) < lengths[:, None])[:, None, None, :]  # [B, 1, 1, Lmax]
    o = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=mask, scale=scale,
                                       enable_gqa=q.shape[1] != k_cache.shape[2])
    return o[:, :, 0, :]


# ----------------------------------------------------------------------------------------------------------
# KV cache writes (torch index ops on every device: one scatter per tensor, no host sync)
# ----------------------------------------------------------------------------------------------------------

def _check_cache_pair(fn, k_cache, v_cache):
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"{fn}: k_cache/v_cache must be matching [num_blocks, block_size, Hkv, D], got "
                         f"{tuple(k_cache.shape)} {k_cache.dtype} and {tuple(v_cache.shape)} {v_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"{fn}: k_cache/v_cache must be contiguous (slots are flattened views)")


def _check_slots(fn, name, slots, n, device):
    if slots.dim() != 1 or slots.shape[0] != n or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{fn}: {name} must be int32/int64 [{n}], got {slots.dtype} {tuple(slots.shape)}")
    if slots.device != device:
        raise ValueError(f"{fn}: {name} is on {slots.device}, cache on {device}")


def write_kv(k, v, k_cache, v_cache, slot_mapping):
    """k, v: [T, Hkv, D] -> cache slots slot_mapping[t] = block * block_size + offset."""
    _check_cache_pair("write_kv", k_cache, v_cache)
    if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"write_kv: k, v must be [T, {k_cache.shape[2]}, {k_cache.shape[3]}], got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if k.device != k_cache.device or v.device != k_cache.device:
        raise ValueError(f"write_kv: k/v on {k.device}/{v.device}, cache on {k_cache.device}")
    _check_slots("write_kv", "slot_mapping", slot_mapping, k.shape[0], k_cache.device)
    idx = slot_mapping.long()
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, idx, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, idx, v.to(v_cache.dtype))


def move_kv(k_cache, v_cache, src_slots, dst_slots):
    """Copy cache slots src_slots[i] -> dst_slots[i]; all sources are read before any destination is written."""
    _check_cache_pair("move_kv", k_cache, v_cache)
    _check_slots("move_kv", "src_slots", src_slots, src_slots.shape[0] if src_slots.dim() == 1 else -1,
                 k_cache.device)
    _check_slots("move_kv", "dst_slots", dst_slots, src_slots.shape[0], k_cache.device)
    for cache in (k_cache, v_cache):
        flat = cache.view(-1, *cache.shape[2:])
        flat.index_copy_(0, dst_slots.long(), flat.index_select(0, src_slots.long()))
