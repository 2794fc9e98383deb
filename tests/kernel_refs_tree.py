"""Naive references for build_tree and tree acceptance, plus random tree generators for the tests.

The references follow DESIGN.md literally, one node and one token at a time. The fp32 steps of the
sampling reference use numpy float32 scalars so every addition, product and quotient is rounded to fp32
exactly as the canonical order of csrc/cdf_order.h prescribes.
"""
import numpy as np
import torch

CDF_SEGMENT = 256  # csrc/cdf_order.h: kCdfSegment


# ---------------------------------------------------------------------------------------------- trees
def random_bfs_parents(n: int, gen: torch.Generator, max_children: int = 4) -> list[int]:
    """A random BFS-ordered tree of n nodes: each new node hangs under the oldest node with room."""
    parents, kids, frontier = [-1], [0], 0
    for i in range(1, n):
        while kids[frontier] >= max_children or (
                kids[frontier] > 0 and torch.rand((), generator=gen).item() < 0.4 and frontier + 1 < i):
            frontier += 1
        parents.append(frontier)
        kids[frontier] += 1
        kids.append(0)
    return parents


def chain_parents(n: int) -> list[int]:
    return [-1] + list(range(n - 1))


def batch_trees(trees: list[list[int]], N: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pads BFS parent lists to -> parents int32 [B, N] (padding -1), sizes int32 [B]."""
    parents = torch.full((len(trees), N), -1, dtype=torch.int32)
    for b, tree in enumerate(trees):
        parents[b, :len(tree)] = torch.tensor(tree, dtype=torch.int32)
    return parents, torch.tensor([len(t) for t in trees], dtype=torch.int32)


def children(parents: list[int], n: int, node: int) -> list[int]:
    return [c for c in range(node + 1, n) if parents[c] == node]


# ----------------------------------------------------------------------------------------- build_tree
def ref_build_tree(parents: torch.Tensor, sizes: torch.Tensor):
    """-> (mask, depths) as DESIGN.md defines them."""
    B, N = parents.shape
    W = (N + 31) // 32
    mask = torch.zeros(B, N, W, dtype=torch.int64)
    depths = torch.zeros(B, N, dtype=torch.int32)
    for b in range(B):
        par, n = parents[b].tolist(), int(sizes[b])
        for i in range(n):
            path = ancestors_and_self(par, i)
            for j in path:
                mask[b, i, j // 32] |= 1 << (j % 32)
            depths[b, i] = len(path) - 1
    mask = torch.where(mask >= 2 ** 31, mask - 2 ** 32, mask).to(torch.int32)  # two's complement words
    return mask, depths


def ancestors_and_self(parents: list[int], node: int) -> list[int]:
    """node, its parent, ..., the root."""
    path = [node]
    while path[-1] > 0:
        path.append(parents[path[-1]])
    return path


# ------------------------------------------------------------------------------------------ acceptance
def ref_tree_accept_greedy(parents, tokens, sizes, target_argmax):
    """Walk from the root to the first child whose token is the target argmax, until none is."""
    B, N = parents.shape
    path = torch.full((B, N), -1, dtype=torch.int32)
    length = torch.zeros(B, dtype=torch.int32)
    nxt = torch.zeros(B, dtype=torch.int64)
    for b in range(B):
        par, tok, am, n = parents[b].tolist(), tokens[b].tolist(), target_argmax[b].tolist(), int(sizes[b])
        walk = [0]
        while True:
            match = [c for c in children(par, n, walk[-1]) if tok[c] == am[walk[-1]]]
            if not match:
                break
            walk.append(match[0])
        path[b, :len(walk)] = torch.tensor(walk, dtype=torch.int32)
        length[b], nxt[b] = len(walk) - 1, am[walk[-1]]
    return path, length, nxt


def seq_sum(values) -> np.float32:
    acc = np.float32(0)
    for v in values:
        acc = np.float32(acc + v)
    return acc


def segment_sums(p: np.ndarray) -> list[np.float32]:
    return [seq_sum(p[s:s + CDF_SEGMENT]) for s in range(0, len(p), CDF_SEGMENT)]


def total(p: np.ndarray) -> np.float32:
    return seq_sum(segment_sums(p))


def inverse_cdf(p: np.ndarray, u: np.float32) -> int:
    """First token whose running sum (canonical order) exceeds u * total; else the last positive token."""
    threshold = np.float32(u * total(p))
    before = np.float32(0)
    for s, seg in enumerate(segment_sums(p)):
        inner = np.float32(0)
        for i in range(s * CDF_SEGMENT, min(len(p), (s + 1) * CDF_SEGMENT)):
            inner = np.float32(inner + p[i])
            if np.float32(before + inner) > threshold:
                return i
        before = np.float32(before + seg)
    positive = np.nonzero(p > 0)[0]
    return int(positive[-1]) if len(positive) else -1


def ref_tree_accept_sample(parents, tokens, sizes, target_probs, uniforms, draft_probs=None):
    """Sibling-by-sibling rejection (deterministic drafts) or chain rejection with draft probs q."""
    B, N = parents.shape
    path = torch.full((B, N), -1, dtype=torch.int32)
    length = torch.zeros(B, dtype=torch.int32)
    nxt = torch.zeros(B, dtype=torch.int64)
    probs = target_probs.numpy()
    q = None if draft_probs is None else draft_probs.numpy()
    u = uniforms.numpy()
    for b in range(B):
        par, tok, n = parents[b].tolist(), tokens[b].tolist(), int(sizes[b])
        walk, dist = [0], None
        while dist is None:
            kids = children(par, n, walk[-1])
            p = probs[b, walk[-1]]
            if q is None:
                child, dist = _try_siblings(p, kids, tok, u[b])
            else:
                child, dist = _try_chain(p, kids[:1], tok, u[b], q[b])
            if child is not None:
                walk.append(child)
        path[b, :len(walk)] = torch.tensor(walk, dtype=torch.int32)
        length[b], nxt[b] = len(walk) - 1, inverse_cdf(dist, u[b, 0])
    return path, length, nxt


def _try_siblings(p, kids, tok, u):
    """-> (accepted child, None) or (None, the remaining distribution)."""
    remaining = p.copy()
    with np.errstate(divide="ignore", invalid="ignore"):
        for c in kids:
            x = tok[c]
            if u[c] < np.float32(remaining[x] / total(remaining)):
                return c, None
            remaining[x] = 0
    return None, remaining


def _try_chain(p, kids, tok, u, q):
    for c in kids:
        x = tok[c]
        with np.errstate(divide="ignore", invalid="ignore"):
            if u[c] < np.float32(p[x] / q[c, x]):
                return c, None
        residual = np.maximum(np.float32(0), p - q[c])
        if total(residual) > 0:
            return None, residual
    return None, p
