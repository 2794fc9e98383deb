"""Batched tree rejection sampling (greedy and sampling modes), contracts in DESIGN.md."""
import numpy as np
import torch

CDF_SEGMENT = 256  # vocabulary segment length of the canonical fp32 summation order


def _children(par, n, cur):
    return [c for c in range(cur + 1, n) if par[c] == cur]


def tree_accept_greedy(parents, tokens, sizes, target_argmax):
    B, N = parents.shape
    path = torch.full((B, N), -1, dtype=torch.int32)
    length = torch.zeros(B, dtype=torch.int32)
    nxt = torch.zeros(B, dtype=torch.int64)
    par, tok, sz, am = parents.tolist(), tokens.tolist(), sizes.tolist(), target_argmax.tolist()
    for b in range(B):
        cur, depth = 0, 0
        path[b, 0] = 0
        while True:
            child = next((c for c in _children(par[b], sz[b], cur) if tok[b][c] == am[b][cur]), None)
            if child is None:
                break
            cur, depth = child, depth + 1
            path[b, depth] = cur
        length[b], nxt[b] = depth, am[b][cur]
    return path, length, nxt


def _seq_sum(x):
    acc = np.float32(0)
    for v in x:
        acc = np.float32(acc + v)
    return acc


def _draw(p, u):
    """Inverse CDF over p (fp32 [V]) in the canonical two-level order; -1 if p has no mass."""
    seg = [_seq_sum(p[s:s + CDF_SEGMENT]) for s in range(0, len(p), CDF_SEGMENT)]
    thr = np.float32(np.float32(u) * _seq_sum(seg))
    before = np.float32(0)
    for s, seg_sum in enumerate(seg):
        if np.float32(before + seg_sum) > thr:
            inner = np.float32(0)
            for i in range(s * CDF_SEGMENT, min(len(p), (s + 1) * CDF_SEGMENT)):
                inner = np.float32(inner + p[i])
                if np.float32(before + inner) > thr:
                    return i
        before = np.float32(before + seg_sum)
    nz = np.nonzero(p > 0)[0]
    return int(nz[-1]) if len(nz) else -1


def tree_accept_sample(parents, tokens, sizes, target_probs, uniforms, draft_probs=None):
    B, N = parents.shape
    path = torch.full((B, N), -1, dtype=torch.int32)
    length = torch.zeros(B, dtype=torch.int32)
    nxt = torch.zeros(B, dtype=torch.int64)
    par, tok, sz = parents.tolist(), tokens.tolist(), sizes.tolist()
    probs = target_probs.float().numpy()
    q_all = None if draft_probs is None else draft_probs.float().numpy()
    u = uniforms.float().numpy()
    with np.errstate(divide="ignore", invalid="ignore"):
        for b in range(B):
            cur, depth, final = 0, 0, None
            path[b, 0] = 0
            while final is None:
                p = probs[b, cur].copy()
                kids = _children(par[b], sz[b], cur)
                if q_all is not None:
                    kids = kids[:1]
                child = None
                for c in kids:
                    x = tok[b][c]
                    denom = q_all[b, c, x] if q_all is not None else _seq_sum_segments(p)
                    if u[b, c] < np.float32(p[x] / denom):
                        child = c
                        break
                    if q_all is not None:
                        r = np.maximum(np.float32(0), p - q_all[b, c])
                        if _seq_sum_segments(r) > 0:
                            p = r
                    else:
                        p[x] = 0
                if child is None:
                    final = _draw(p, u[b, 0])
                else:
                    cur, depth = child, depth + 1
                    path[b, depth] = cur
            length[b], nxt[b] = depth, final
    return path, length, nxt


def _seq_sum_segments(p):
    return _seq_sum([_seq_sum(p[s:s + CDF_SEGMENT]) for s in range(0, len(p), CDF_SEGMENT)])
