"""Target distributions for rejection sampling: temperature, then top-k, then top-p (nucleus), in fp32.

Contract: DESIGN.md ("sampling_probs"). Truncation rules, applied per row:
- top-k keeps the k most probable tokens (ties broken towards the lower token id); k <= 0 or k >= V disables it.
- top-p then keeps, in that order, every token whose preceding cumulative probability (renormalised over what
  top-k kept) is below top_p, so the most probable token always survives; top_p >= 1 disables it.

No host reads: the parameters' values are read on the host only when they are host values (numbers, lists).
"""
import math
import numbers

import torch

from ._ops import gpu_path, has_kernel, ops
from .expand import topk_low_index_first

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_ARGMAX_CPU = has_kernel("argmax_rows", torch.device("cpu"))
_KEYED_CPU = has_kernel("sample_keyed", torch.device("cpu"))
_TRUNCATE_CPU = has_kernel("truncate_probs", torch.device("cpu"))


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x [..., V] -> int64 [...]: the first index of each row's maximum, as torch's max(-1).indices (a NaN
    counts as the maximum). fp32 CPU rows take the C++ op (49k logits: ~5 us a row, against 21 us for
    max(-1) and 62 for argmax(-1)), the rest torch's max(-1)."""
    if _ARGMAX_CPU and x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() >= 1 and x.shape[-1] > 0:
        return ops().argmax_rows(x)
    return x.max(-1).indices


def sample_keyed(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                 ids: torch.Tensor | None = None) -> torch.Tensor:
    """One exact draw a row from softmax(logits / T), keyed: the noise is a fixed function of (seeds[...],
    positions[...], token id) (keyed_uniforms), so the same row, temperature, seed and position give the same
    token whichever step, method or batch draws it. logits fp32 [..., V] (-inf: a token not allowed);
    temperatures fp32 [...] (0: the row's argmax); seeds, positions int64 [...]; ids int64 [V], the token id of
    each column (a draft vocabulary's columns; None: the column index) -> the drawn columns, int64 [...].
    The Gumbel max argmax_i l_i / T - log(-log(u_i)) in float64 (the first index among equals; a NaN or +inf row
    gives its first NaN's or +inf's index); CPU: the C++ op (csrc/cpu_sample.cpp, two logs only for the few tokens
    that can win), elsewhere sample_keyed_reference."""
    lead = logits.shape[:-1]
    if logits.dtype != torch.float32 or logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"sample_keyed: logits must be fp32 [..., V] with V > 0, got {logits.dtype} {tuple(logits.shape)}")
    for name, t, dtype in (("temperatures", temperatures, torch.float32), ("seeds", seeds, torch.int64),
                           ("positions", positions, torch.int64)):
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.shape != lead or t.device != logits.device:
            raise ValueError(f"sample_keyed: {name} must be {dtype} {tuple(lead)} on {logits.device}")
    if ids is not None and (ids.dtype != torch.int64 or ids.shape != logits.shape[-1:] or ids.device != logits.device):
        raise ValueError(f"sample_keyed: ids must be int64 [{logits.shape[-1]}] on {logits.device}")
    if _KEYED_CPU and logits.device.type == "cpu" and not gpu_path(logits):
        return ops().sample_keyed(logits, temperatures, seeds, positions, ids)
    return sample_keyed_reference(logits, temperatures, seeds, positions, ids)


_M32 = 0xFFFFFFFF


def _mix(x: torch.Tensor) -> torch.Tensor:
    """csrc/cpu_sample.cpp's 32-bit hash on int64 tensors holding uint32 values (products wrap in int64; the
    low 32 bits are kept)."""
    x = x ^ (x >> 17)
    x = (x * 0xed5ad4bb) & _M32
    x = x ^ (x >> 11)
    x = (x * 0xac4c1b51) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x31848bab) & _M32
    return x ^ (x >> 14)


def keyed_uniforms(seeds: torch.Tensor, positions: torch.Tensor, ids: "int | torch.Tensor") -> torch.Tensor:
    """The draws' uniforms: seeds, positions int64 [...], token ids int64 [V] (an int V: 0 .. V - 1) -> float64
    [..., V] in (0, 1), u_i = (h_i + 0.5) 2^-32 with h_i = mix(mix(id_i ^ k0) ^ k1), (k0, k1) from (seed,
    position) (csrc/cpu_sample.cpp)."""
    s_lo, s_hi = seeds & _M32, (seeds >> 32) & _M32
    k0 = _mix((positions & _M32) ^ _mix(s_lo ^ 0x9e3779b9))
    k1 = _mix(k0 ^ s_hi ^ 0x85ebca6b)
    i = torch.arange(ids, dtype=torch.int64, device=seeds.device) if isinstance(ids, int) else ids & _M32
    h = _mix(_mix(i ^ k0[..., None]) ^ k1[..., None])
    return (h.double() + 0.5) * 2.0 ** -32


def sample_keyed_reference(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor,
                           positions: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """sample_keyed in torch ops (any device): argmax(l / T - log(-log(u))) in float64 (T = 0: argmax(l))."""
    u = keyed_uniforms(seeds, positions, logits.shape[-1] if ids is None else ids)
    t = temperatures.double()[..., None]
    x = logits.double()
    return torch.where(t > 0, x / t - (-u.log()).log(), x).max(-1).indices


def _fail(msg):
    raise ValueError(f"sampling_probs: {msg}")


def _host_rows(name, value, lead):
    """A number or (nested) lists shaped like a prefix of the leading dims -> a flat list, one value a row."""
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):
        value = value.tolist()                                         # numpy arrays and scalars

    def expand(v, dims):
        if isinstance(v, (list, tuple)):
            if not dims or len(v) != dims[0]:
                _fail(f"{name} must be a scalar or shaped like a prefix of {tuple(lead)}")
            return [x for e in v for x in expand(e, dims[1:])]
        if not isinstance(v, numbers.Real):
            _fail(f"{name} must be a number, a list of numbers or a tensor, got {type(v).__name__}")
        return [v] * math.prod(dims)

    return expand(value, tuple(lead))


def _tensor_rows(name, t, lead, dtype, device):
    """A tensor whose shape is a prefix of the leading dims -> [rows] of `dtype` (values are not read)."""
    if tuple(t.shape) != tuple(lead[: t.dim()]):
        _fail(f"{name} must be a scalar or shaped like a prefix of {tuple(lead)}, got {tuple(t.shape)}")
    t = t.to(device=device, dtype=dtype)
    return t.reshape(t.shape + (1,) * (len(lead) - t.dim())).expand(lead).reshape(-1)


def _column(values, dtype, device):
    """Host values, one a row -> a python scalar when they agree, else a [rows, 1] tensor on device."""
    if len(set(values)) <= 1:
        return values[0] if values else 0
    return _to_device(values, dtype, device)[:, None]


def sampling_probs(logits, temperature, top_k, top_p):
    """logits: [..., V] (fp32/bf16/fp16) -> fp32 probabilities [..., V], each row summing to 1. No host reads.

    temperature, top_k, top_p: a number, or per-row values shaped like a prefix of the leading dims. Host values
    (numbers, nested lists) are validated and let the host pick the cheapest exact plan. Tensors are accepted
    but not validated (that would read them; invalid values give NaN rows), and with a top_k or top_p tensor
    every row takes a full sort.
    """
    if logits.dim() < 1 or logits.dtype not in _FLOATS:
        _fail(f"logits must be a float tensor [..., V] of {_FLOATS}, got {logits.dtype} {tuple(logits.shape)}")
    lead, v = logits.shape[:-1], logits.shape[-1]
    dev = logits.device
    params = {}
    for name, value, dtype in (("temperature", temperature, torch.float32), ("top_k", top_k, torch.int64),
                               ("top_p", top_p, torch.float32)):
        params[name] = (_tensor_rows(name, value, lead, dtype, dev)[:, None] if isinstance(value, torch.Tensor)
                        else _host_rows(name, value, lead))
    temp, ks, ps = params["temperature"], params["top_k"], params["top_p"]
    if isinstance(temp, list):
        if any(not t > 0 for t in temp):
            _fail("temperature must be > 0 (greedy rows never reach sampling_probs)")
        temp = _column(temp, torch.float32, dev)
    if isinstance(ps, list) and any(not 0 < p <= 1 for p in ps):
        _fail("top_p must be in (0, 1]")
    probs = torch.softmax(logits.reshape(-1, v).float() / temp, dim=-1)          # [rows, V]
    if isinstance(ks, list) and isinstance(ps, list):
        out = _truncate_planned(probs, [int(k) if 0 < k < v else v for k in ks], [float(p) for p in ps])
    else:
        ks = _column(ks, torch.int64, dev) if isinstance(ks, list) else ks
        out = _truncate_any(probs, ks, _column(ps, torch.float32, dev) if isinstance(ps, list) else ps)
    return out.reshape(logits.shape)


def _truncate_planned(probs, ks, ps):
    """Host-known per-row k (V = disabled) and p. On the CPU every row that truncates goes through the C++ op
    truncate_probs (radix selects that sort only the tokens at each cut, and the renormalisation); elsewhere rows
    with top-k rank their c = max k most probable tokens, top-p-only rows take a full sort. The rest stay."""
    rows, v = probs.shape
    parts = []
    if _TRUNCATE_CPU and probs.device.type == "cpu":
        cut = [i for i in range(rows) if ks[i] < v or ps[i] < 1]
        if cut:
            parts.append((cut, ops().truncate_probs(_take(probs, cut), [ks[i] for i in cut],
                                                    [float(ps[i]) for i in cut])))
    else:
        with_k = [i for i in range(rows) if ks[i] < v]
        p_only = [i for i in range(rows) if ks[i] >= v and ps[i] < 1]
        if with_k:
            part = _take(probs, with_k)
            kk = _column([ks[i] for i in with_k], torch.int64, probs.device)
            pp = _column([ps[i] for i in with_k], torch.float32, probs.device)
            parts.append((with_k, _truncate(part, kk, pp, max(ks[i] for i in with_k))))
        if p_only:
            pp = _column([ps[i] for i in p_only], torch.float32, probs.device)
            parts.append((p_only, _truncate(_take(probs, p_only), v, pp, v)))
    if len(parts) == 1 and len(parts[0][0]) == rows:
        return parts[0][1]
    out = probs.clone() if parts else probs
    for idx, res in parts:
        out.index_copy_(0, _to_device(idx, torch.int64, probs.device), res)
    return out


def _to_device(values, dtype, device):
    """A list -> a 1-D tensor on device; to CUDA through pinned memory, without waiting for the device."""
    t = torch.tensor(values, dtype=dtype)
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


def _take(probs, idx):
    return probs if len(idx) == probs.shape[0] else probs.index_select(0, _to_device(idx, torch.int64, probs.device))


def _truncate_any(probs, kk, pp):
    """Per-row parameters unknown to the host (python scalars or [rows, 1] tensors): a full sort of every row."""
    v = probs.shape[-1]
    kk = torch.where((kk <= 0) | (kk > v), v, kk) if isinstance(kk, torch.Tensor) else (kk if 0 < kk < v else v)
    out = _truncate(probs, kk, pp, v)
    untouched = (kk >= v) & (pp >= 1)
    if isinstance(untouched, bool):
        return probs if untouched else out
    return torch.where(untouched, probs, out)


def _truncate(probs, kk, pp, c):
    """Top-k then top-p over the c most probable tokens of each row, ranked by (prob desc, id asc); exact when
    every row's cut lies among them (kk <= c, or c = V). kk, pp: python scalars or [rows, 1]."""
    v = probs.shape[-1]
    if c < v:
        vals, ids = topk_low_index_first(probs, c)                              # [rows, c]
    else:
        vals, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    rank = torch.arange(c, device=probs.device)[None, :]
    vals = torch.where(rank < kk, vals, 0.0)
    # Top-p is relative to the mass top-k kept; rows without top-k keep all of it.
    full, top = probs.sum(-1, keepdim=True), vals.sum(-1, keepdim=True)
    total = torch.where(kk >= v, full, top) if isinstance(kk, torch.Tensor) else (full if kk >= v else top)
    cum = torch.cumsum(vals, dim=-1)
    keep = (cum - vals < pp * total) & (rank < kk)                              # mass strictly above < top_p
    keep[:, 0] = True
    kept = torch.where(keep, vals, 0.0)
    # Normalise the [rows, c] survivors, not the [rows, V] result: full-size temporaries dominate on CPU.
    return torch.zeros_like(probs).scatter_(1, ids, kept / kept.sum(-1, keepdim=True))
