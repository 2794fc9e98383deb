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


def _check_params(temperature, top_p):
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
    _check_params(temp, pp)
    x = logits.reshape(-1, v).float() / temp[:, None]                          # [rows, V]
    kk = torch.where((kk <= 0) | (kk > v), v, kk)
    probs = torch.softmax(x, dim=-1)
    untouched = (kk >= v) & (pp >= 1)
    if bool(untouched.all()):
        return probs.reshape(logits.shape)
    out = _truncate(probs, kk, pp, _window(kk, v))
    if bool(untouched.any()):
        out[untouched] = probs[untouched]
    return out.reshape(logits.shape)


# Rows without top-k look for their top-p cut among this many most probable tokens first and fall back to a
# full sort only when the cut lies beyond it (rare for LM distributions): a partial top-k is far cheaper.
_TOP_P_WINDOW = 1024


def _window(kk, v):
    """Candidates to rank: the largest top-k, or the top-p window when some row has no top-k; every row's
    top-k must fit or be disabled, else all V."""
    kmax = int(kk.max())
    if kmax < v:
        return kmax
    c = min(v, _TOP_P_WINDOW)
    return c if bool(((kk <= c) | (kk >= v)).all()) else v


def _truncate(probs, kk, pp, c):
    """Top-k then top-p over the c most probable tokens of each row, ranked by (prob desc, id asc)."""
    v = probs.shape[-1]
    if c < v:
        vals, ids = topk_low_index_first(probs, c)                              # [rows, c]
    else:
        vals, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    rank = torch.arange(c, device=probs.device)[None, :]
    vals = torch.where(rank < kk[:, None], vals, 0.0)
    # Top-p is relative to the mass top-k kept; rows without top-k keep all of it.
    total = torch.where(kk >= v, probs.sum(-1), vals.sum(-1))[:, None]
    cum = torch.cumsum(vals, dim=-1)
    keep = (cum - vals < pp[:, None] * total) & (rank < kk[:, None])            # mass strictly above < top_p
    keep[:, 0] = True
    if c < v and not bool(((kk <= c) | (pp >= 1) | (cum[:, -1:] >= pp[:, None] * total)[:, 0]).all()):
        return _truncate(probs, kk, pp, v)                                       # some cut lies past the window
    kept = torch.where(keep, vals, 0.0)
    # Normalise the [rows, c] survivors, not the [rows, V] result: full-size temporaries dominate on CPU.
    return torch.zeros_like(probs).scatter_(1, ids, kept / kept.sum(-1, keepdim=True))
