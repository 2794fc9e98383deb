"""Draft-tree construction for a batch of requests: candidate pools, the EAGLE-2 dynamic policy and static
top-k index trees (EAGLE-1), and the batched `Tree` that verification consumes (DESIGN.md's representation).

Drafting grows one pool of candidates per request, depth by depth. A policy turns the draft logits of the
current frontier into new candidates (all added to the pool) and picks the next frontier (the candidates
the draft expands next). Pool ids follow generation order, so a parent's id is always below its
children's and ids are depth-major.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import eagle_kernels

# EAGLE-1's default tree ("mc_sim_7b_63" in the official code): each node is the path of sibling ranks from
# the root, e.g. (0, 1) = the second most likely child of the most likely child.
EAGLE1_TREE = ((0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0),
               (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 2, 1), (1, 0, 0),
               (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 2), (0, 0, 0, 0, 0), (0, 0, 0, 0, 1))


@dataclass
class Tree:
    """A batch of draft trees in DESIGN.md's representation (node 0 = root = the last accepted token)."""
    tokens: torch.Tensor   # int64 [B, N]
    parents: torch.Tensor  # int32 [B, N], BFS order, -1 for the root and padding
    depths: torch.Tensor   # int32 [B, N]
    sizes: torch.Tensor    # int32 [B]
    chain: bool = False    # parents[i] = i - 1: plain causal masking is the ancestor mask

    @classmethod
    def chains(cls, tokens: list[list[int]], device) -> "Tree":
        """Chains root -> d1 -> ... (SpS), one list per request (root first), padded to the longest."""
        N = max(len(t) for t in tokens)
        idx = torch.arange(N, dtype=torch.int32)
        sizes = torch.tensor([len(t) for t in tokens], dtype=torch.int32)
        valid = idx[None] < sizes[:, None]
        return cls(torch.tensor([t + [0] * (N - len(t)) for t in tokens], device=device),
                   torch.where(valid & (idx > 0), idx - 1, -1), torch.where(valid, idx, 0), sizes, chain=True)


@dataclass
class Frontier:
    """The candidates the draft expands next: [B, F] each."""
    ids: torch.Tensor      # int64 pool ids
    tokens: torch.Tensor   # int64 target-vocabulary tokens
    scores: torch.Tensor   # fp32 cumulative draft log-probs
    rows: torch.Tensor     # int64 index of each node's parent in the previous frontier (0 under the root)


class Pool:
    """All candidates of a batch of trees: [B, P] tensors grown depth by depth (no host sync)."""

    def __init__(self):
        self._tokens, self._scores, self._parents, self._depths = [], [], [], []
        self.size = 0

    def add(self, tokens, scores, parents, depth: int) -> torch.Tensor:
        """tokens, scores, parents (pool ids, -1 = root): [B, n] -> their pool ids [B, n]."""
        B, n = tokens.shape
        self._tokens.append(tokens)
        self._scores.append(scores)
        self._parents.append(parents)
        self._depths.append(torch.full((B, n), depth, dtype=torch.int32, device=tokens.device))
        ids = torch.arange(self.size, self.size + n, device=tokens.device).expand(B, n)
        self.size += n
        return ids

    def select(self, roots: torch.Tensor, budget: int, max_depth: torch.Tensor) -> Tree:
        """Keep the `budget` best candidates by cumulative score whose depth <= max_depth[b] ([B] int), plus
        the root tokens [B]. Scores never rise along a path and ties go to the lower (older) id, so the
        kept set is closed under ancestors; sorting it by id gives BFS order with siblings best first."""
        tokens, scores = torch.cat(self._tokens, 1), torch.cat(self._scores, 1)            # [B, P]
        parents, depths = torch.cat(self._parents, 1), torch.cat(self._depths, 1)
        B, P = scores.shape
        budget = min(budget, P)
        allowed = depths <= max_depth[:, None]
        best = torch.sort(torch.where(allowed, scores, -torch.inf), dim=1, descending=True, stable=True).indices
        best = best[:, :budget]                                                              # [B, budget]
        chosen = torch.where(allowed.gather(1, best), best, P).sort(dim=1).values           # dropped (= P) last
        keep = chosen < P
        safe = chosen.clamp(max=P - 1)
        # Tree index of each kept pool id (column P collects the dropped ones), to renumber parents.
        index = torch.zeros(B, P + 1, dtype=torch.int64, device=scores.device)
        index.scatter_(1, chosen, torch.arange(1, budget + 1, device=scores.device).expand(B, budget))
        pool_parent = parents.gather(1, safe)
        par = torch.where(pool_parent < 0, 0, index.gather(1, pool_parent.clamp(min=0)))  # -1: the root's child
        root_col = torch.full((B, 1), -1, dtype=torch.int32, device=scores.device)
        return Tree(tokens=torch.cat([roots[:, None], torch.where(keep, tokens.gather(1, safe), 0)], 1),
                    parents=torch.cat([root_col, torch.where(keep, par, -1).int()], 1),
                    depths=torch.cat([torch.zeros_like(root_col), torch.where(keep, depths.gather(1, safe), 0)], 1),
                    sizes=(1 + keep.sum(1)).int())


class DynamicTree:
    """EAGLE-2: expand the `topk` frontier nodes of highest cumulative draft log-prob, `depth` levels deep;
    verify the best `tree_tokens - 1` of all candidates plus the root."""

    def __init__(self, depth: int, topk: int, tree_tokens: int):
        if depth < 1 or topk < 1 or tree_tokens < 2:
            raise ValueError(f"dynamic tree needs depth >= 1, topk >= 1, tree_tokens >= 2; got "
                             f"{depth}, {topk}, {tree_tokens}")
        self.depth, self.topk, self.verify_tokens = depth, topk, tree_tokens

    @property
    def max_draft_tokens(self) -> int:
        """Frontier nodes re-fed to the draft in its last forward."""
        return (self.depth - 1) * self.topk

    def expand(self, pool: Pool, logits, front_ids, front_scores, depth: int, d2t=None) -> Frontier:
        """logits: [B, R, Vd] of the R frontier nodes at `depth` - 1 -> their children (depth `depth`)."""
        B, R, _ = logits.shape
        k = min(self.topk, logits.shape[-1])
        ex = eagle_kernels.topk_expand(logits, front_scores, k, d2t)
        ids = pool.add(ex.row_tokens.flatten(1), ex.row_scores.flatten(1),
                       front_ids.repeat_interleave(k, dim=1), depth)                     # [B, R * k]
        # Rank of each chosen candidate within its parent's row: tokens are distinct within a row.
        row_tokens = ex.row_tokens.gather(1, ex.parents[..., None].expand(B, k, k))         # [B, k, k]
        rank = (row_tokens == ex.tokens[..., None]).int().argmax(-1)
        return Frontier(ids.gather(1, ex.parents * k + rank), ex.tokens, ex.scores, ex.parents)



class StaticTree:
    """A fixed tree of sibling-rank paths (EAGLE-1): the node (r1, .., rd) is the rd-th most likely draft
    token after its parent. Only nodes with children are fed to the draft."""

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

    @property
    def max_draft_tokens(self) -> int:
        return sum(sum(has for _, _, has in level) for level in self.levels)

    def expand(self, pool: Pool, logits, front_ids, front_scores, depth: int, d2t=None) -> Frontier:
        level = self.levels[depth - 1]
        dev = logits.device
        rows = torch.tensor([r for r, _, _ in level], device=dev)
        ranks = torch.tensor([k for _, k, _ in level], device=dev)
        k = min(int(ranks.max()) + 1, logits.shape[-1])
        top = torch.topk(torch.log_softmax(logits.float(), -1), k, dim=-1)                  # [B, R, k]
        draft_ids = top.indices[:, rows, ranks.clamp(max=k - 1)]                             # [B, n]
        tokens = draft_ids if d2t is None else draft_ids + d2t[draft_ids]
        scores = front_scores[:, rows] + top.values[:, rows, ranks.clamp(max=k - 1)]
        ids = pool.add(tokens, scores, front_ids[:, rows], depth)
        nxt = torch.tensor([i for i, (_, _, has) in enumerate(level) if has], dtype=torch.int64, device=dev)
        return Frontier(ids[:, nxt], tokens[:, nxt], scores[:, nxt], rows[nxt].expand(len(ids), -1))



def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """bool [..., n] -> int32 [..., ceil(n / 32)]: bit j % 32 of word j // 32 (DESIGN.md's mask words)."""
    n = mask.shape[-1]
    W = (n + 31) // 32
    padded = torch.nn.functional.pad(mask, (0, W * 32 - n)).view(*mask.shape[:-1], W, 32).long()
    words = (padded << torch.arange(32, device=mask.device)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).int()
