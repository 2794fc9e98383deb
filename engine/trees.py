"""Draft trees: the one batched `Tree` (DESIGN.md's representation) that drafting grows and verification
reads, and the policies that grow it: the EAGLE-2 dynamic tree and static top-k index trees (EAGLE-1).

Drafting starts from the roots (the last accepted tokens) and adds candidates depth by depth; node ids
follow generation order, so a parent's id is always below its children's. A policy turns the draft logits
of the current frontier (the nodes expanded next, as node ids) into new candidates and the next frontier.
`select` then keeps the best candidates as the tree to verify; `subtree` re-indexes any ancestor-closed
node list (the drafted history, the selection) as a tree of its own. Everything stays on the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import eagle_kernels


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 host values on `device` without a synchronizing copy (pinned memory, non-blocking on CUDA):
    these are made inside the first run of a step that is then graph-captured."""
    host = torch.tensor(values, dtype=torch.int64)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)


# EAGLE-1's default tree ("mc_sim_7b_63" in the official code): each node is the path of sibling ranks from
# the root, e.g. (0, 1) = the second most likely child of the most likely child.
EAGLE1_TREE = ((0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0),
               (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 2, 1), (1, 0, 0),
               (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 2), (0, 0, 0, 0, 0), (0, 0, 0, 0, 1))


@dataclass
class Tree:
    """A batch of B trees of N nodes (node 0 = root); nodes past sizes[b] are padding (parent -1)."""
    tokens: torch.Tensor   # int64 [B, N], target vocabulary
    parents: torch.Tensor  # int32 [B, N]: parents[b, i] < i, -1 for the root and padding
    depths: torch.Tensor   # int32 [B, N]: root 0
    scores: torch.Tensor   # fp32 [B, N]: cumulative draft log-prob of the path (root 0)
    sizes: torch.Tensor    # int32 [B]: valid nodes

    @classmethod
    def roots(cls, tokens: torch.Tensor) -> "Tree":
        """tokens: int64 [B] -> B one-node trees."""
        B, dev = tokens.shape[0], tokens.device
        col = torch.zeros(B, 1, dtype=torch.int32, device=dev)
        return cls(tokens[:, None], col - 1, col, col.float(), col[:, 0] + 1)

    @classmethod
    def chains(cls, tokens: torch.Tensor, sizes: torch.Tensor) -> "Tree":
        """tokens: int64 [B, N] root -> d1 -> ... (SpS); sizes int32 [B]."""
        B, N = tokens.shape
        idx = torch.arange(N, dtype=torch.int32, device=tokens.device).expand(B, N)
        depths = idx * (idx < sizes[:, None])  # padding: depth 0, parent -1 (few ops: a CPU round runs this cold)
        return cls(tokens, depths - 1, depths, torch.zeros(B, N, device=tokens.device), sizes)

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    def grow(self, tokens, scores, parents, depth: int) -> tuple["Tree", torch.Tensor]:
        """Append n candidates per tree (all valid; trees must be unpadded). tokens, scores, parents (node
        ids): [B, n] -> (the grown tree, the new nodes' ids [B, n])."""
        B, n = tokens.shape
        N = self.num_nodes
        ids = torch.arange(N, N + n, device=tokens.device).expand(B, n)
        grown = Tree(torch.cat([self.tokens, tokens], 1), torch.cat([self.parents, parents.int()], 1),
                     torch.cat([self.depths, torch.full_like(self.depths[:, :1], depth).expand(B, n)], 1),
                     torch.cat([self.scores, scores.float()], 1), self.sizes + n)
        return grown, ids

    def subtree(self, ids: torch.Tensor, keep: torch.Tensor | None = None) -> "Tree":
        """The nodes `ids` [B, n] (ids[:, 0] = 0, each node's parent listed before it) as a tree of their own;
        `keep` bool [B, n] marks the valid ones (the rest become padding; valid ones come first)."""
        B, n = ids.shape
        dev = ids.device
        index = torch.zeros(B, self.num_nodes, dtype=torch.int64, device=dev)
        index.scatter_(1, ids, torch.arange(n, device=dev).expand(B, n))
        par = self.parents.gather(1, ids)
        par = torch.where(par < 0, -1, index.gather(1, par.clamp(min=0).long()))
        keep = torch.ones_like(ids, dtype=torch.bool) if keep is None else keep
        return Tree(torch.where(keep, self.tokens.gather(1, ids), 0),
                    torch.where(keep, par, -1).int(),
                    torch.where(keep, self.depths.gather(1, ids), 0),
                    torch.where(keep, self.scores.gather(1, ids), 0.0),
                    keep.sum(1).int())

    def select(self, budget: int, max_depth: torch.Tensor, floor: float | None = None) -> "Tree":
        """The root and the `budget` best candidates by score whose depth <= max_depth[b] (int [B]) and, with
        `floor`, whose score >= floor. Scores never rise along a path and ties go to the lower (older) id, so
        the kept set is closed under ancestors; sorted by id it is in BFS order with siblings best first."""
        B, P = self.tokens.shape
        budget = min(budget, P - 1)
        allowed = self.depths[:, 1:] <= max_depth[:, None]
        if floor is not None:
            allowed &= self.scores[:, 1:] >= floor
        score = torch.where(allowed, self.scores[:, 1:], -torch.inf)
        best = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :budget] + 1
        ok = allowed.gather(1, best - 1)
        chosen = torch.where(ok, best, P).sort(dim=1).values                       # dropped (= P) last
        root = torch.zeros(B, 1, dtype=torch.int64, device=chosen.device)
        keep = torch.cat([root == 0, chosen < P], 1)
        return self.subtree(torch.cat([root, chosen.clamp(max=P - 1)], 1), keep)

    def rows(self, n: int) -> "Tree":
        """The first n trees."""
        return Tree(self.tokens[:n], self.parents[:n], self.depths[:n], self.scores[:n], self.sizes[:n])

    def prefix(self, n: int) -> "Tree":
        """The first n node columns (every tree's valid nodes must lie among them)."""
        return Tree(self.tokens[:, :n], self.parents[:, :n], self.depths[:, :n], self.scores[:, :n], self.sizes)

    def mask(self) -> torch.Tensor:
        """Ancestor-or-self bits int32 [B * N, W] (DESIGN.md's mask words), the tree attention mask."""
        return eagle_kernels.build_tree(self.parents, self.sizes).mask.flatten(0, 1)


class DynamicTree:
    """EAGLE-2: expand the `topk` frontier nodes of highest cumulative draft log-prob, `depth` levels deep;
    verify the best `tree_tokens - 1` of all candidates plus the root.

    min_prob > 0 also lets the draft's confidence decide how much to draft, per round: drafting stops once no
    frontier path is at least that likely (its cumulative draft probability), and no candidate less likely is
    verified. The head's probabilities track acceptance closely (benchmarks/RESULTS.md, session 12), so a
    round stops paying for levels and verified rows that would mostly be rejected. It reads the scores on the
    host, so it is for devices where that costs nothing (the CPU default); 0 drafts the whole shape."""

    def __init__(self, depth: int, topk: int, tree_tokens: int, min_prob: float = 0.0):
        if depth < 1 or topk < 1 or tree_tokens < 2:
            raise ValueError(f"dynamic tree needs depth >= 1, topk >= 1, tree_tokens >= 2; got "
                             f"{depth}, {topk}, {tree_tokens}")
        if not 0.0 <= min_prob < 1.0:
            raise ValueError(f"min_prob must be in [0, 1), got {min_prob}")
        self.depth, self.topk, self.verify_tokens, self.min_prob = depth, topk, tree_tokens, min_prob

    @property
    def chain(self) -> bool:
        """Top-1 at every level: a chain, drafted without tree bookkeeping (spec_eagle)."""
        return self.topk == 1

    def frontier_sizes(self) -> list[int]:
        """Nodes expanded at each depth 0 .. depth - 1 (the root, then top-k frontiers)."""
        return [1] + [self.topk] * (self.depth - 1)

    def expand(self, tree: Tree, logits, front: torch.Tensor, depth: int, d2t=None):
        """logits: [B, F, Vd] of the frontier `front` (node ids [B, F]) -> (tree with their children at
        `depth`, the next frontier's node ids [B, k])."""
        B, F, _ = logits.shape
        k = min(self.topk, logits.shape[-1])
        ex = eagle_kernels.topk_expand(logits, tree.scores.gather(1, front), k, d2t)
        tree, ids = tree.grow(ex.row_tokens.flatten(1), ex.row_scores.flatten(1),
                              front.repeat_interleave(k, dim=1), depth)                 # [B, F * k]
        # Rank of each chosen candidate within its parent's row: tokens are distinct within a row.
        row_tokens = ex.row_tokens.gather(1, ex.parents[..., None].expand(B, k, k))       # [B, k, k]
        rank = (row_tokens == ex.tokens[..., None]).int().argmax(-1)
        return tree, ids.gather(1, ex.parents * k + rank)


class StaticTree:
    """A fixed tree of sibling-rank paths (EAGLE-1): the node (r1, .., rd) is the rd-th most likely draft
    token after its parent. Only nodes with children are fed to the draft."""
    chain, min_prob = False, 0.0

    def __init__(self, paths=EAGLE1_TREE):
        paths = sorted(set(map(tuple, paths)), key=lambda p: (len(p), p))  # BFS, siblings by rank
        if not paths or any(p[:-1] and p[:-1] not in paths for p in paths) or min(min(p) for p in paths) < 0:
            raise ValueError("static tree: every path's prefix must be in the tree, ranks >= 0")
        self.depth = max(len(p) for p in paths)
        parents_of = {p[:-1] for p in paths}
        # levels[d]: (parent row in the depth-d frontier, rank, has children) of the nodes at depth d + 1.
        self.levels = []
        for d in range(self.depth):
            front = [()] if d == 0 else [p for p in paths if len(p) == d and p in parents_of]
            self.levels.append([(front.index(p[:-1]), p[-1], p in parents_of)
                                for p in paths if len(p) == d + 1])
        self.verify_tokens = len(paths) + 1
        self._index = {}  # (depth, device) -> the level's index tensors, made once (a graph copies none in)

    def frontier_sizes(self) -> list[int]:
        return [1] + [sum(has for _, _, has in level) for level in self.levels[:-1]]

    def _level_index(self, depth: int, device: torch.device):
        """-> (parent rows [n], ranks [n], children's positions among them with children [n']), int64."""
        key = (depth, device)
        if key not in self._index:
            level = self.levels[depth - 1]
            self._index[key] = tuple(to_device(v, device) for v in (
                [r for r, _, _ in level], [k for _, k, _ in level], [i for i, (_, _, has) in enumerate(level) if has]))
        return self._index[key]

    def expand(self, tree: Tree, logits, front: torch.Tensor, depth: int, d2t=None):
        rows, ranks, nxt = self._level_index(depth, logits.device)
        k = min(max(k for _, k, _ in self.levels[depth - 1]) + 1, logits.shape[-1])
        ranks = ranks.clamp(max=k - 1)
        top = torch.topk(torch.log_softmax(logits.float(), -1), k, dim=-1)                  # [B, F, k]
        draft_ids = top.indices[:, rows, ranks]                                              # [B, n]
        tokens = draft_ids if d2t is None else draft_ids + d2t[draft_ids]
        scores = tree.scores.gather(1, front)[:, rows] + top.values[:, rows, ranks]
        tree, ids = tree.grow(tokens, scores, front[:, rows], depth)
        return tree, ids[:, nxt]
