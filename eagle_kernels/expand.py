"""EAGLE-2 frontier expansion: log-softmax, per-row top-k, cumulative scores, global top-k.

Contract: DESIGN.md ("topk_expand"). Ties are broken towards the lower draft-vocabulary index within a row and
towards the lower (row, rank) position across rows, so every implementation picks the same candidates.
"""
import os

import torch

from ._ops import gpu_path, has_kernel, ops

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path serves every device
    triton = None

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_CPU_OP = has_kernel("topk_expand", torch.device("cpu"))


class Expansion(tuple):
    """(tokens, scores, parents) -- unpacks as the three global results; the per-row top-k rides along.

    tokens int64 [..., k] (target ids), scores fp32 [..., k], parents int64 [..., k] (frontier row);
    row_tokens int64 [..., R, k] and row_scores fp32 [..., R, k] (cumulative, descending within each row).
    """

    def __new__(cls, tokens, scores, parents, row_tokens, row_scores):
        self = super().__new__(cls, (tokens, scores, parents))
        self.tokens, self.scores, self.parents = tokens, scores, parents
        self.row_tokens, self.row_scores = row_tokens, row_scores
        return self


def _fail(msg):
    raise ValueError(f"topk_expand: {msg}")


def _check_expand_args(logits, parent_scores, k, d2t):
    if logits.dim() not in (2, 3):
        _fail(f"logits must be [R, V] or [B, R, V], got shape {tuple(logits.shape)}")
    if logits.dtype not in _FLOATS:
        _fail(f"logits dtype must be one of {_FLOATS}, got {logits.dtype}")
    if parent_scores.dtype != torch.float32 or tuple(parent_scores.shape) != tuple(logits.shape[:-1]):
        _fail(f"parent_scores must be fp32 {tuple(logits.shape[:-1])}, got {parent_scores.dtype} "
              f"{tuple(parent_scores.shape)}")
    if not 1 <= k <= logits.shape[-1]:
        _fail(f"k must be in [1, V={logits.shape[-1]}], got {k}")
    if d2t is not None and (d2t.dim() != 1 or d2t.shape[0] != logits.shape[-1]
                            or d2t.dtype not in (torch.int32, torch.int64)):
        _fail(f"d2t must be int32/int64 [V={logits.shape[-1]}], got {d2t.dtype} {tuple(d2t.shape)}")
    if parent_scores.device != logits.device or (d2t is not None and d2t.device != logits.device):
        _fail("logits, parent_scores and d2t must be on one device")


def topk_expand(logits, parent_scores, k, d2t=None):
    """logits: [R, V] or [B, R, V]; parent_scores: fp32 [R] / [B, R] -> Expansion (see class docstring)."""
    _check_expand_args(logits, parent_scores, k, d2t)
    batched = logits.dim() == 3
    if not batched:
        logits, parent_scores = logits[None], parent_scores[None]
    if gpu_path(logits):
        run = _topk_expand_triton if triton is not None and k <= _MAX_K else _topk_expand_torch
    else:
        run = _topk_expand_cpu if _CPU_OP and logits.device.type == "cpu" else _topk_expand_torch
    out = run(logits, parent_scores, k, d2t)
    if not batched:
        out = [t[0] for t in out]
    return Expansion(*out)


def _topk_expand_cpu(logits, parent_scores, k, d2t):
    """csrc/cpu_expand.cpp: one pass per row, the same picks as the torch path."""
    return ops().topk_expand(logits, parent_scores, k, d2t)


def _map_tokens(draft_ids, d2t):
    return draft_ids if d2t is None else draft_ids + d2t.long()[draft_ids]


def _topk_expand_torch(logits, parent_scores, k, d2t):
    """logits: [B, R, V] -> tokens, scores, parents [B, k]; row_tokens, row_scores [B, R, k]."""
    b, r, _ = logits.shape
    x = logits.float()
    _, row_ids = topk_low_index_first(x, k)                                   # [B, R, k]
    # log_softmax + gather rather than logsumexp: same math, and it parallelises over rows, not within one
    # row (a within-row OpenMP reduction stalls badly on an oversubscribed 2-core host).
    row_scores = parent_scores[..., None] + torch.log_softmax(x, dim=-1).gather(-1, row_ids)   # [B, R, k]
    flat = row_scores.reshape(b, r * k)
    # A stable descending sort keeps the lower (row, rank) position first among equal scores.
    order = torch.sort(flat, dim=-1, descending=True, stable=True).indices[:, :k]
    scores = flat.gather(1, order)
    parents = order // k
    draft_ids = row_ids.reshape(b, r * k).gather(1, order)
    return _map_tokens(draft_ids, d2t), scores, parents, _map_tokens(row_ids, d2t), row_scores


def topk_low_index_first(x, k):
    """Top-k along the last dim ordered by (value desc, index asc); of values tied at the cut the lowest
    indices are kept. No host reads and no branch: the k picked by torch.topk are put in order, and the slots
    holding the cut value are refilled with the lowest indices holding it in the row."""
    vals, ids = torch.topk(x, k, dim=-1)
    ids, perm = ids.sort(dim=-1)
    vals, perm = vals.gather(-1, perm).sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(-1, perm)                                                  # [..., k]
    cut = vals[..., k - 1:]
    above = (vals > cut).sum(-1, keepdim=True, dtype=torch.int32)            # every value above the cut
    tie_rank = (x == cut).cumsum(-1, dtype=torch.int32)                       # [..., V]
    slot = torch.arange(k, device=x.device, dtype=torch.int32)
    ties = torch.searchsorted(tie_rank, slot + 1 - above)                     # the (slot - above)-th tie
    ids = torch.where(slot < above, ids, ties)
    return x.gather(-1, ids), ids


# ----------------------------------------------------------------------------------------------------------
# Triton path: two launches, no host sync.
#   1. grid (B*R, NC): each program reads one BLOCK_V chunk of a row once and emits its max, its sum of
#      exp(x - max) and its local top-k (value, draft id).
#   2. grid (B,): each program folds its R rows' chunk results into the row log-sum-exp and row top-k, writes
#      the per-row outputs and keeps a running global top-k over the rows seen so far.
# Selection is k rounds of "take the maximum, lowest key among equals, retire it"; the key is the draft id
# within a row and row * k + rank across rows, which reproduces the torch tie rule exactly.
# ----------------------------------------------------------------------------------------------------------

_MAX_K = 16

if triton is not None:
    _NO_ID = tl.constexpr(2**31 - 1)  # key of an empty / exhausted candidate slot

    @triton.jit
    def _select(vals, keys, alive):
        """Maximum of vals over alive slots and the lowest key holding it (_NO_ID when none is alive)."""
        best = tl.max(tl.where(alive, vals, float("-inf")), axis=0)
        key = tl.min(tl.where(alive & (vals == best), keys, _NO_ID), axis=0)
        return best, key

    @triton.jit
    def _expand_chunk_kernel(logits_ptr, cmax_ptr, csum_ptr, cval_ptr, cid_ptr, V, NC,
                             K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_V: tl.constexpr):
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        offs = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
        alive = offs < V
        x = tl.load(logits_ptr + row.to(tl.int64) * V + offs, mask=alive, other=float("-inf")).to(tl.float32)
        cmax = tl.max(x, axis=0)
        # An all -inf chunk has sum 0; subtracting 0 instead of -inf keeps it from turning into NaN.
        cmax_sub = tl.where(cmax == float("-inf"), 0.0, cmax)
        tl.store(cmax_ptr + row * NC + chunk, cmax)
        tl.store(csum_ptr + row * NC + chunk, tl.sum(tl.exp(x - cmax_sub), axis=0))
        offs_k = tl.arange(0, K_PAD)
        top_v = tl.full([K_PAD], float("-inf"), tl.float32)
        top_id = tl.full([K_PAD], _NO_ID, tl.int32)
        for it in tl.static_range(K):
            best, key = _select(x, offs, alive)
            top_v = tl.where(offs_k == it, best, top_v)
            top_id = tl.where(offs_k == it, key, top_id)
            alive = alive & (offs != key)
        base = (row * NC + chunk) * K_PAD
        tl.store(cval_ptr + base + offs_k, top_v)
        tl.store(cid_ptr + base + offs_k, top_id)

    @triton.jit
    def _expand_merge_kernel(cmax_ptr, csum_ptr, cval_ptr, cid_ptr, parent_ptr, d2t_ptr,
                             tok_ptr, score_ptr, par_ptr, row_tok_ptr, row_score_ptr, R, NC,
                             K: tl.constexpr, K_PAD: tl.constexpr, NC_PAD: tl.constexpr, CAND: tl.constexpr,
                             HAS_D2T: tl.constexpr):
        b = tl.program_id(0)
        offs_k = tl.arange(0, K_PAD)
        offs_c = tl.arange(0, NC_PAD)
        offs_cand = tl.arange(0, CAND)
        g_val = tl.full([K_PAD], float("-inf"), tl.float32)      # running global top-k: score,
        g_key = tl.full([K_PAD], _NO_ID, tl.int32)          # row * K + rank,
        g_id = tl.zeros([K_PAD], tl.int32)                      # draft id
        for r in range(R):
            row = b * R + r
            cmax = tl.load(cmax_ptr + row * NC + offs_c, mask=offs_c < NC, other=float("-inf"))
            csum = tl.load(csum_ptr + row * NC + offs_c, mask=offs_c < NC, other=0.0)
            m = tl.max(cmax, axis=0)
            m_sub = tl.where(m == float("-inf"), 0.0, m)
            lse = m_sub + tl.log(tl.sum(csum * tl.exp(cmax - m_sub), axis=0))
            parent = tl.load(parent_ptr + row)
            cval = tl.load(cval_ptr + row * NC * K_PAD + offs_cand, mask=offs_cand < NC * K_PAD,
                           other=float("-inf"))
            cid = tl.load(cid_ptr + row * NC * K_PAD + offs_cand, mask=offs_cand < NC * K_PAD, other=_NO_ID)
            alive = cid != _NO_ID
            r_val = tl.full([K_PAD], float("-inf"), tl.float32)
            r_id = tl.zeros([K_PAD], tl.int32)
            for it in tl.static_range(K):
                best, key = _select(cval, cid, alive)
                r_val = tl.where(offs_k == it, (best - lse) + parent, r_val)   # cumulative score
                r_id = tl.where(offs_k == it, key, r_id)
                alive = alive & (cid != key)
            r_tok = r_id.to(tl.int64)
            if HAS_D2T:
                r_tok += tl.load(d2t_ptr + r_id, mask=offs_k < K, other=0).to(tl.int64)
            tl.store(row_tok_ptr + row * K + offs_k, r_tok, mask=offs_k < K)
            tl.store(row_score_ptr + row * K + offs_k, r_val, mask=offs_k < K)
            # Merge: K rounds over the union of the running global top-k and this row's top-k.
            r_key = r * K + offs_k
            g_alive = offs_k < K
            r_alive = offs_k < K
            n_val = tl.full([K_PAD], float("-inf"), tl.float32)
            n_key = tl.full([K_PAD], _NO_ID, tl.int32)
            n_id = tl.zeros([K_PAD], tl.int32)
            for it in tl.static_range(K):
                gb, gk = _select(g_val, g_key, g_alive)
                rb, rk = _select(r_val, r_key, r_alive)
                take_row = (rb > gb) | ((rb == gb) & (rk < gk))
                key = tl.where(take_row, rk, gk)
                # Keys are unique across the union (earlier rows < r * K <= this row's), so retire by key.
                pick = tl.sum(tl.where(r_key == key, r_id, 0), axis=0) + tl.sum(tl.where(g_key == key, g_id, 0), axis=0)
                n_val = tl.where(offs_k == it, tl.where(take_row, rb, gb), n_val)
                n_key = tl.where(offs_k == it, key, n_key)
                n_id = tl.where(offs_k == it, pick, n_id)
                g_alive = g_alive & (g_key != key)
                r_alive = r_alive & (r_key != key)
            g_val, g_key, g_id = n_val, n_key, n_id
        tok = g_id.to(tl.int64)
        if HAS_D2T:
            tok += tl.load(d2t_ptr + g_id, mask=offs_k < K, other=0).to(tl.int64)
        tl.store(tok_ptr + b * K + offs_k, tok, mask=offs_k < K)
        tl.store(score_ptr + b * K + offs_k, g_val, mask=offs_k < K)
        tl.store(par_ptr + b * K + offs_k, (g_key // K).to(tl.int64), mask=offs_k < K)


def _interpreting():
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _topk_expand_triton(logits, parent_scores, k, d2t):
    """logits: [B, R, V] -> same outputs as _topk_expand_torch, in two launches."""
    if triton is None:
        _fail("Triton is not installed")
    if k > _MAX_K:
        _fail(f"the Triton kernel supports k <= {_MAX_K}, got {k}")
    for t, name in ((logits, "logits"), (parent_scores, "parent_scores"), (d2t, "d2t")):
        if t is not None and not (t.is_cuda or _interpreting()):
            _fail(f"the Triton path needs CUDA tensors (or TRITON_INTERPRET=1), {name} is on {t.device}")
    logits, parent_scores = logits.contiguous(), parent_scores.contiguous()
    b, r, v = logits.shape
    dev = logits.device
    k_pad = triton.next_power_of_2(k)
    # <= 64 chunks per row keep the merge's candidate vector (NC * K_PAD <= 1024) in registers.
    block_v = max(256, triton.next_power_of_2(triton.cdiv(v, 64)))
    nc = triton.cdiv(v, block_v)
    cmax = torch.empty(b * r, nc, dtype=torch.float32, device=dev)
    csum = torch.empty_like(cmax)
    cval = torch.empty(b * r, nc, k_pad, dtype=torch.float32, device=dev)
    cid = torch.empty(b * r, nc, k_pad, dtype=torch.int32, device=dev)
    _expand_chunk_kernel[(b * r, nc)](logits, cmax, csum, cval, cid, v, nc, K=k, K_PAD=k_pad, BLOCK_V=block_v)
    tokens = torch.empty(b, k, dtype=torch.int64, device=dev)
    scores = torch.empty(b, k, dtype=torch.float32, device=dev)
    parents = torch.empty(b, k, dtype=torch.int64, device=dev)
    row_tokens = torch.empty(b, r, k, dtype=torch.int64, device=dev)
    row_scores = torch.empty(b, r, k, dtype=torch.float32, device=dev)
    _expand_merge_kernel[(b,)](
        cmax, csum, cval, cid, parent_scores, d2t.contiguous() if d2t is not None else cmax,
        tokens, scores, parents, row_tokens, row_scores, r, nc,
        K=k, K_PAD=k_pad, NC_PAD=triton.next_power_of_2(nc), CAND=triton.next_power_of_2(nc * k_pad),
        HAS_D2T=d2t is not None)
    return tokens, scores, parents, row_tokens, row_scores
