"""Tree index construction for a batch of BFS-ordered draft trees (see DESIGN.md)."""
from typing import NamedTuple

import torch


class TreeIndex(NamedTuple):
    mask: torch.Tensor          # int32 [B, N, W]: ancestor-or-self bitmask, W = ceil(N / 32)
    depths: torch.Tensor        # int32 [B, N]: root 0; padding nodes 0
    retrieve: torch.Tensor      # int32 [B, N, N]: root-to-leaf node paths, leaves in index order, -1 padded
    num_leaves: torch.Tensor    # int32 [B]
    first_child: torch.Tensor   # int32 [B, N], -1 where none
    next_sibling: torch.Tensor  # int32 [B, N], -1 where none


def build_tree(parents: torch.Tensor, sizes: torch.Tensor) -> TreeIndex:
    """parents: int32 [B, N] (BFS order, parents[:, 0] = -1), sizes: int32 [B] -> TreeIndex."""
    B, N = parents.shape
    W = (N + 31) // 32
    out = TreeIndex(
        torch.zeros(B, N, W, dtype=torch.int64), torch.zeros(B, N, dtype=torch.int32),
        torch.full((B, N, N), -1, dtype=torch.int32), torch.zeros(B, dtype=torch.int32),
        torch.full((B, N), -1, dtype=torch.int32), torch.full((B, N), -1, dtype=torch.int32))
    par, sz = parents.cpu().tolist(), sizes.cpu().tolist()
    for b in range(B):
        _build_one(par[b], sz[b], out, b)
    words = torch.where(out.mask >= 2**31, out.mask - 2**32, out.mask).to(torch.int32)
    return TreeIndex(*(t.to(parents.device) for t in out._replace(mask=words)))


def _build_one(par, n, out, b):
    last_child = [-1] * n
    has_child = [False] * n
    for i in range(n):
        p = par[i] if i > 0 else -1
        node = i
        while node >= 0:
            out.mask[b, i, node // 32] |= 1 << (node % 32)
            node = par[node] if node > 0 else -1
        if p >= 0:
            out.depths[b, i] = out.depths[b, p] + 1
            has_child[p] = True
            if last_child[p] < 0:
                out.first_child[b, p] = i
            else:
                out.next_sibling[b, last_child[p]] = i
            last_child[p] = i
    leaves = [i for i in range(n) if not has_child[i]]
    out.num_leaves[b] = len(leaves)
    for k, leaf in enumerate(leaves):
        path, node = [], leaf
        while node >= 0:
            path.append(node)
            node = par[node] if node > 0 else -1
        out.retrieve[b, k, :len(path)] = torch.tensor(path[::-1], dtype=torch.int32)
