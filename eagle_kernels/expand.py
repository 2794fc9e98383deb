"""EAGLE-2 frontier expansion: log-softmax, per-row top-k, cumulative scores, global top-k.

Contract: DESIGN.md ("topk_expand"). Ties are broken towards the lower draft-vocabulary index within a row and
towards the lower (row, rank) position across rows, so every implementation picks the same candidates.
"""
import torch

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


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
    out = _topk_expand_torch(logits, parent_scores, k, d2t)
    if not batched:
        out = [t[0] for t in out]
    return Expansion(*out)


def _map_tokens(draft_ids, d2t):
    return draft_ids if d2t is None else draft_ids + d2t.long()[draft_ids]


def _topk_expand_torch(logits, parent_scores, k, d2t):
    """logits: [B, R, V] -> tokens, scores, parents [B, k]; row_tokens, row_scores [B, R, k]."""
    b, r, _ = logits.shape
    x = logits.float()
    row_logit, row_ids = topk_low_index_first(x, k)                          # [B, R, k]
    lse = torch.logsumexp(x, dim=-1, keepdim=True)                            # [B, R, 1]
    row_scores = parent_scores[..., None] + (row_logit - lse)                 # [B, R, k]
    flat = row_scores.reshape(b, r * k)
    # A stable descending sort keeps the lower (row, rank) position first among equal scores.
    order = torch.sort(flat, dim=-1, descending=True, stable=True).indices[:, :k]
    scores = flat.gather(1, order)
    parents = order // k
    draft_ids = row_ids.reshape(b, r * k).gather(1, order)
    return _map_tokens(draft_ids, d2t), scores, parents, _map_tokens(row_ids, d2t), row_scores


def topk_low_index_first(x, k):
    """Top-k along the last dim ordered by (value desc, index asc); of values tied at the cut the lowest
    indices are kept."""
    vals, ids = torch.topk(x, k, dim=-1)
    if bool(((x >= vals[..., -1:]).sum(-1) > k).any()):
        # Ties straddle the cut: only a stable full sort decides which indices are kept.
        s = torch.sort(x, dim=-1, descending=True, stable=True)
        return s.values[..., :k], s.indices[..., :k]
    ids, perm = ids.sort(dim=-1)
    vals, perm = vals.gather(-1, perm).sort(dim=-1, descending=True, stable=True)
    return vals, ids.gather(-1, perm)
