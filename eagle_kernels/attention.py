"""Tree-masked paged attention over a block-paged KV cache, and the cache writes it relies on.

Contracts: DESIGN.md ("paged_attention", "write_kv", "move_kv"). `paged_attention` runs the C++ kernel on the
CPU (csrc/cpu_attention.cpp), the Triton kernel for CUDA tensors when Triton is importable, and the torch path
(one SDPA call per sequence) otherwise; the torch path is also what the others are tested against.
"""
import functools
import math
import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path serves every device
    triton = None

from . import _ops
from ._ops import check_paged_attention_cpu, gpu_path, has_kernel, ops

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_CPU_KERNEL = has_kernel("paged_attention", torch.device("cpu"))


def _fail(msg):
    raise ValueError(f"paged_attention: {msg}")


def _check_paged_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens, tree_mask):
    """Shape/dtype/device checks that need no host sync; returns the batch size B."""
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
    if tree_mask is not None and (tree_mask.dtype != torch.int32 or tree_mask.dim() != 2
                                  or tree_mask.shape[0] != q.shape[0]):
        _fail(f"tree_mask must be int32 [T={q.shape[0]}, W], got {tree_mask.dtype} {tuple(tree_mask.shape)}")
    tensors = [k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens] + ([tree_mask] if tree_mask is not None else [])
    if any(t.device != q.device for t in tensors):
        _fail(f"all tensors must be on {q.device}, got {[str(t.device) for t in tensors]}")
    return b


def paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens, tree_mask=None, scale=None):
    """q: [T, Hq, D] packed new tokens -> [T, Hq, D]; see DESIGN.md for the masking rule.

    CPU tensors take the C++ kernel whatever the step (prefill, decode, chains, trees): a token's output is
    one fixed chain of operations over the keys it sees, so it does not depend on what else is in the call,
    on how its prompt was cut into chunks, or on the thread count. Triton (CUDA tensors, CPU ones inside
    triton_on_cpu()) and the C++ kernel make no host reads; the torch path (no extension) reads the lengths."""
    if gpu_path(q) and triton is not None:
        return paged_attention_triton(q, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens, tree_mask, scale)
    if q.device.type == "cpu" and _CPU_KERNEL:
        if _ops.CHECKED:
            check_paged_attention_cpu(q, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens, tree_mask)
        return ops().paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens, tree_mask, scale)
    return paged_attention_torch(q, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens, tree_mask, scale)


def paged_attention_torch(q, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens, tree_mask=None,
                          scale=None):
    """The torch path behind paged_attention (CPU; any device); same contract. Syncs to read the lengths."""
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
    one_token_each = cu == list(range(len(prefixes) + 1))
    if tree_mask is None and one_token_each and len(prefixes) > 1 and max(prefixes) < _BATCHED_DECODE_MAX_LEN:
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
# Triton path (CUDA; CPU tensors only under TRITON_INTERPRET=1)
# ----------------------------------------------------------------------------------------------------------
# One program owns one sequence, one tile of BLOCK_M new tokens and one kv head. Its query rows are the
# BLOCK_M tokens x the G_PAD q heads sharing that kv head (row r = token r // G_PAD, head r % G_PAD), so every
# K/V tile is loaded once per group. Keys are visited in two loops: the cached prefix (no mask) and the new
# tokens (causal or ancestor bits). Ancestors precede their descendants in BFS order, so both rules only ever
# admit new keys j <= i and the second loop stops at the tile's last query: mask work is O(n^2), independent
# of the context length.
# When those programs cannot fill the GPU (small-batch decode, one tree), each sequence's prefix is split into
# NUM_SPLITS key ranges (flash-decoding): each split writes an unnormalised partial (m, l, acc) and a
# second kernel merges the partials; the last split also owns the new-token keys.

if triton is not None:
    @triton.jit
    def _online_softmax_step(qk, v, m_i, l_i, acc, P_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr):
        """qk: fp32 [ROWS, BLOCK_N] in log2 units, -inf where masked; v: [BLOCK_N, BLOCK_D]."""
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        # Rows with nothing visible yet keep m = -inf; subtract 0 instead so exp2 gives 0, not NaN.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(P_DTYPE), v, input_precision=DOT_PREC)
        return m_new, l_i, acc

    @triton.jit
    def _load_kv_tile(cache_ptr, bt_row_ptr, pos, valid, kv_head, offs_d, d_valid,
                      s_blk, s_off, s_head, BS: tl.constexpr):
        """Rows pos [BLOCK_N] of the sequence's logical cache (through its block table) -> [BLOCK_N, BLOCK_D]."""
        blk = tl.load(bt_row_ptr + pos // BS, mask=valid, other=0).to(tl.int64)
        ptrs = cache_ptr + blk[:, None] * s_blk + (pos % BS)[:, None] * s_off + kv_head * s_head + offs_d[None, :]
        return tl.load(ptrs, mask=valid[:, None] & d_valid[None, :], other=0.0)

    @triton.jit
    def _paged_attention_kernel(
            q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, cu_ptr, prefix_ptr, mask_ptr, part_ptr, ml_ptr,
            s_qt, s_qh, s_blk, s_off, s_head, s_bt, s_mask, qk_scale, min_split_len, num_q_heads,
            G: tl.constexpr, G_PAD: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
            TREE: tl.constexpr, DOT_PREC: tl.constexpr, NUM_SPLITS: tl.constexpr):
        b = tl.program_id(0)
        m_start = tl.program_id(1) * BLOCK_M
        kv_head = tl.program_id(2) // NUM_SPLITS
        split = tl.program_id(2) % NUM_SPLITS
        t0 = tl.load(cu_ptr + b)
        n = tl.load(cu_ptr + b + 1) - t0
        if m_start >= n:
            return
        prefix = tl.load(prefix_ptr + b)
        bt_row = bt_ptr + b * s_bt

        ROWS: tl.constexpr = BLOCK_M * G_PAD
        offs_r = tl.arange(0, ROWS)
        qi = m_start + offs_r // G_PAD                      # new-token index of each row within the sequence
        head = kv_head * G + offs_r % G_PAD
        row_valid = (qi < n) & (offs_r % G_PAD < G)
        offs_d = tl.arange(0, BLOCK_D)
        d_valid = offs_d < D
        q_ptrs = q_ptr + (t0 + qi)[:, None] * s_qt + head[:, None] * s_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=row_valid[:, None] & d_valid[None, :], other=0.0)   # [ROWS, BLOCK_D]

        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
        offs_n = tl.arange(0, BLOCK_N)

        # Cached prefix keys [lo, hi) of this split (the prefix cut into NUM_SPLITS even, BLOCK_N-aligned
        # ranges of at least min_split_len keys): every query sees every prefix key.
        split_len = tl.maximum(tl.cdiv(tl.cdiv(prefix, NUM_SPLITS), BLOCK_N) * BLOCK_N, min_split_len)
        lo = split * split_len
        hi = tl.minimum(prefix, lo + split_len)
        for start in range(lo, hi, BLOCK_N):
            pos = start + offs_n
            valid = pos < hi
            k = _load_kv_tile(k_ptr, bt_row, pos, valid, kv_head, offs_d, d_valid, s_blk, s_off, s_head, BS)
            v = _load_kv_tile(v_ptr, bt_row, pos, valid, kv_head, offs_d, d_valid, s_blk, s_off, s_head, BS)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
            qk = tl.where(valid[None, :], qk, float("-inf"))
            m_i, l_i, acc = _online_softmax_step(qk, v, m_i, l_i, acc, v.dtype, DOT_PREC)

        # New tokens j < min(n, tile end): causal (j <= i) or bit j of the row's ancestor mask.
        n_hi = tl.where(split == NUM_SPLITS - 1, tl.minimum(n, m_start + BLOCK_M), 0)
        for start in range(0, n_hi, BLOCK_N):
            j = start + offs_n
            valid = j < n_hi
            pos = prefix + j
            k = _load_kv_tile(k_ptr, bt_row, pos, valid, kv_head, offs_d, d_valid, s_blk, s_off, s_head, BS)
            v = _load_kv_tile(v_ptr, bt_row, pos, valid, kv_head, offs_d, d_valid, s_blk, s_off, s_head, BS)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
            if TREE:
                word_ptrs = mask_ptr + (t0 + qi)[:, None] * s_mask + (j // 32)[None, :]
                words = tl.load(word_ptrs, mask=row_valid[:, None] & valid[None, :], other=0)
                seen = ((words >> (j % 32)[None, :]) & 1) != 0
            else:
                seen = j[None, :] <= qi[:, None]
            qk = tl.where(seen & valid[None, :], qk, float("-inf"))
            m_i, l_i, acc = _online_softmax_step(qk, v, m_i, l_i, acc, v.dtype, DOT_PREC)

        io_mask = row_valid[:, None] & d_valid[None, :]
        if NUM_SPLITS == 1:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            o_ptrs = out_ptr + (t0 + qi)[:, None] * s_qt + head[:, None] * s_qh + offs_d[None, :]
            tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=io_mask)
        else:
            # Partials: part [T, Hq, NUM_SPLITS, D] (unnormalised acc), ml [T, Hq, NUM_SPLITS, 2] (m, l).
            slot = ((t0 + qi) * num_q_heads + head) * NUM_SPLITS + split
            tl.store(part_ptr + slot[:, None] * D + offs_d[None, :], acc, mask=io_mask)
            tl.store(ml_ptr + slot * 2, m_i, mask=row_valid)
            tl.store(ml_ptr + slot * 2 + 1, l_i, mask=row_valid)

    @triton.jit
    def _merge_splits_kernel(part_ptr, ml_ptr, out_ptr, s_qt, s_qh, num_q_heads,
                             D: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                             S_PAD: tl.constexpr):
        """One (token, q head): out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s."""
        t = tl.program_id(0)
        h = tl.program_id(1)
        offs_s = tl.arange(0, S_PAD)
        offs_d = tl.arange(0, BLOCK_D)
        s_valid = offs_s < NUM_SPLITS
        slot = (t * num_q_heads + h) * NUM_SPLITS + offs_s
        m = tl.load(ml_ptr + slot * 2, mask=s_valid, other=float("-inf"))
        l = tl.load(ml_ptr + slot * 2 + 1, mask=s_valid, other=0.0)
        acc = tl.load(part_ptr + slot[:, None] * D + offs_d[None, :], mask=s_valid[:, None] & (offs_d < D)[None, :],
                      other=0.0)
        m_max = tl.max(m, axis=0)
        w = tl.math.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))   # 0 for empty splits (m = -inf)
        denom = tl.sum(w * l, axis=0)
        out = tl.sum(w[:, None] * acc, axis=0) / tl.where(denom == 0.0, 1.0, denom)
        tl.store(out_ptr + t * s_qt + h * s_qh + offs_d, out.to(out_ptr.dtype.element_ty), mask=offs_d < D)


def _interpreting():
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check_triton_args(tensors, names):
    if triton is None:
        _fail("Triton is not installed")
    for t, name in zip(tensors, names):
        if t is None:
            continue
        if not (t.is_cuda or _interpreting()):
            _fail(f"the Triton path needs CUDA tensors (or TRITON_INTERPRET=1), {name} is on {t.device}")
        if not t.is_contiguous():
            _fail(f"{name} must be contiguous (strides {tuple(t.stride())})")


# Split-KV heuristics: aim for ~2 programs per SM, never split below this many keys or beyond 16 ways.
_MIN_SPLIT_KEYS = 256
_MAX_SPLITS = 16


@functools.lru_cache(maxsize=None)
def _sm_count(device_index):
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _split_plan(sm_count, programs, max_ctx, block_n, num_splits):
    """(NUM_SPLITS, min keys per split). The kernel cuts each sequence's own prefix into NUM_SPLITS even
    ranges, so the host only picks the count, without reading prefix_lens: by occupancy and by max_ctx (what
    the block table can address) rounded up to a power of two, then rounded down to a power of two itself. It
    takes at most log2(_MAX_SPLITS) + 1 values over any run, so the kernel compiles a handful of times however
    the block tables grow. sm_count: None off CUDA (no split). num_splits: forced (ranges of >= block_n keys)."""
    if num_splits is not None:
        return max(1, num_splits), block_n
    if not sm_count:
        return 1, _MIN_SPLIT_KEYS
    bound = triton.next_power_of_2(max(max_ctx, 1))
    n = min(_MAX_SPLITS, triton.cdiv(2 * sm_count, programs), max(1, bound // _MIN_SPLIT_KEYS))
    return 1 << (n.bit_length() - 1), _MIN_SPLIT_KEYS


def paged_attention_triton(q, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens, tree_mask=None,
                           scale=None, *, num_splits=None):
    """The Triton kernel behind paged_attention for CUDA tensors; same contract, no host reads. One launch, or
    two when the prefix is split across programs (num_splits: None = by occupancy, 1 = never; see
    _split_plan)."""
    b = _check_paged_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens, tree_mask)
    _check_triton_args((q, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens, tree_mask),
                       ("q", "k_cache", "v_cache", "block_tables", "cu_seqlens_q", "prefix_lens", "tree_mask"))
    t, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    if d > 256:
        _fail(f"head_dim {d} > 256 is not supported by the Triton kernel")
    out = torch.empty_like(q)
    if t == 0 or b == 0:
        return out
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    g = hq // hkv
    g_pad = triton.next_power_of_2(g)
    # tl.dot needs >= 16 rows. All-decode batches (T == B: one token each) fill them with q heads and
    # few tokens; multi-token batches take 64-row tiles.
    block_m = max(1, (16 if t == b else 64) // g_pad)
    block_d = max(16, triton.next_power_of_2(d))
    block_n = 64 if block_d <= 64 else 32
    programs = b * hkv * triton.cdiv(triton.cdiv(t, b), block_m)
    sm_count = _sm_count(q.device.index or 0) if q.is_cuda else None
    splits, min_split_len = _split_plan(sm_count, programs, block_tables.shape[1] * bs, block_n, num_splits)
    part = ml = out  # unused placeholders when not splitting
    if splits > 1:
        part = torch.empty(t, hq, splits, d, dtype=torch.float32, device=q.device)
        ml = torch.empty(t, hq, splits, 2, dtype=torch.float32, device=q.device)
    _paged_attention_kernel[(b, triton.cdiv(t, block_m), hkv * splits)](
        q, k_cache, v_cache, out, block_tables, cu_seqlens_q, prefix_lens,
        tree_mask if tree_mask is not None else cu_seqlens_q, part, ml,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        tree_mask.stride(0) if tree_mask is not None else 0, scale * 1.4426950408889634, min_split_len, hq,
        G=g, G_PAD=g_pad, BS=bs, D=d, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        # fp32 must not be rounded to tf32 (the 1e-5 contract); the setting is inert for 16-bit inputs.
        TREE=tree_mask is not None, DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32", NUM_SPLITS=splits,
    )
    if splits > 1:
        _merge_splits_kernel[(t, hq)](part, ml, out, out.stride(0), out.stride(1), hq, D=d, BLOCK_D=block_d,
                                      NUM_SPLITS=splits, S_PAD=triton.next_power_of_2(splits))
    return out


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
