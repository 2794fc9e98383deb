"""Target distributions for rejection sampling: temperature, then top-k, then top-p (nucleus), in fp32.

Contract: DESIGN.md ("sampling_probs"). Truncation rules, applied per row:
- top-k keeps the k most probable tokens (ties broken towards the lower token id); k <= 0 or k >= V disables it.
- top-p then keeps, in that order, every token whose preceding cumulative probability (renormalised over what
  top-k kept) is below top_p, so the most probable token always survives; top_p >= 1 disables it.
"""
import torch

from .expand import topk_low_index_first

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _fail(msg):
    raise ValueError(f"sampling_probs: {msg}")


def _row_param(name, value, lead, dtype, device):
    """A python scalar or a tensor whose shape is a prefix of the leading dims -> [rows] of `dtype`."""
    t = torch.as_tensor(value, dtype=dtype, device=device)
    if tuple(t.shape) != tuple(lead[: t.dim()]):
        _fail(f"{name} must be a scalar or shaped like a prefix of {tuple(lead)}, got {tuple(t.shape)}")
    t = t.reshape(t.shape + (1,) * (len(lead) - t.dim()))
    return t.expand(lead).reshape(-1)


def _check_params(temperature, top_k, top_p):
    if bool((temperature <= 0).any()):
        _fail("temperature must be > 0 (greedy rows never reach sampling_probs)")
    if bool(((top_p <= 0) | (top_p > 1)).any()):
        _fail("top_p must be in (0, 1]")


def sampling_probs(logits, temperature, top_k, top_p):
    """logits: [..., V] (fp32/bf16/fp16) -> fp32 probabilities [..., V], each row summing to 1."""
    if logits.dim() < 1 or logits.dtype not in _FLOATS:
        _fail(f"logits must be a float tensor [..., V] of {_FLOATS}, got {logits.dtype} {tuple(logits.shape)}")
    lead, v = logits.shape[:-1], logits.shape[-1]
    temp = _row_param("temperature", temperature, lead, torch.float32, logits.device)
    kk = _row_param("top_k", top_k, lead, torch.int64, logits.device)
    pp = _row_param("top_p", top_p, lead, torch.float32, logits.device)
    _check_params(temp, kk, pp)
    x = logits.reshape(-1, v).float() / temp[:, None]                          # [rows, V]
    kk = torch.where((kk <= 0) | (kk > v), v, kk)
    probs = torch.softmax(x, dim=-1)
    if bool((pp < 1).any()):
        probs = _truncate_sorted(probs, kk, pp)
    elif bool((kk < v).any()):
        probs = _truncate_topk(probs, kk)
    return probs.reshape(logits.shape)


def _truncate_topk(probs, kk):
    """Top-k only: a partial top-k (no full sort) up to the largest k, then a rank mask."""
    kmax = int(kk.max())
    vals, ids = topk_low_index_first(probs, kmax)
    keep = torch.arange(kmax, device=probs.device)[None, :] < kk[:, None]
    out = torch.zeros_like(probs).scatter_(1, ids, torch.where(keep, vals, 0.0))
    return out / out.sum(-1, keepdim=True)


def _truncate_sorted(probs, kk, pp):
    """Top-k and top-p on a stable descending sort of each row."""
    sorted_p, ids = torch.sort(probs, dim=-1, descending=True, stable=True)    # [rows, V]
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    sorted_p = torch.where(rank < kk[:, None], sorted_p, 0.0)
    total = sorted_p.sum(-1, keepdim=True)
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p                          # mass strictly above each rank
    keep = (before < pp[:, None] * total) & (rank < kk[:, None])
    keep[:, 0] = True
    kept = torch.where(keep, sorted_p, 0.0)
    out = torch.zeros_like(probs).scatter_(1, ids, kept)
    return out / out.sum(-1, keepdim=True)
