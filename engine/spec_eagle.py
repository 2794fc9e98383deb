"""EAGLE decoding (EAGLE-1 / EAGLE-2 / EAGLE-3): a one-layer head drafts a tree from the target's features,
the target verifies the whole tree in one forward.

The head reads pairs: pair t = (hidden_t, token_{t+1}) sits at position t. Between rounds the head's cache
holds the pairs t < L (L = the target's cached tokens; pair L - 1 is the root pair, its token the root) and
`root[seq]` keeps that pair's input hidden and the head's output there. A round:
1. draft: the root's output gives the depth-1 candidates; forward d (d = 2 .. depth) feeds the drafted
   history - the root pair again and every frontier expanded so far, with its ancestor mask - and expands
   the newest frontier (trees.py policies). Drafts are re-fed, not cached: paged attention lets new tokens
   see every cached token, so a cached draft would be visible to its cousins.
2. verify (decoding.SpeculativeDecoder.verify): root + tree in one target forward, lossless acceptance.
3. catch up: the head consumes (target feature at t, token t + 1) for the accepted path and the bonus
   token; the last of these pairs is the next root pair.
"""
from __future__ import annotations

import json

import torch

from pathlib import Path

from .decoding import SpeculativeDecoder, Verdict, depth_caps
from .heads import DraftHead, detect_kind, load_head, new_head
from .model import Llama
from .model_runner import kv_layers
from .scheduler import Sequence, cached_len
from .trees import Tree

HEADS_DIR = Path(__file__).parent / "heads"  # shipped trained heads: engine/heads/<name>/


def shipped_head(kind: str, target_cfg) -> str | None:
    """The first head of `kind` under engine/heads/ that fits the target (hidden size, vocabulary)."""
    from safetensors import safe_open
    for cfg_path in sorted(HEADS_DIR.glob("*/config.json")):
        cfg = json.loads(cfg_path.read_text())
        weights = cfg_path.parent / "model.safetensors"
        if not weights.exists() or (cfg.get("hidden_size"), cfg.get("vocab_size")) != \
                (target_cfg.hidden_size, target_cfg.vocab_size):
            continue
        with safe_open(str(weights), framework="pt") as f:
            if detect_kind(f.keys()) == kind:
                return str(cfg_path.parent)
    return None


def eagle_head(spec: str | None, kind: str, target: Llama) -> DraftHead:
    """--head: a checkpoint directory, "random" (a seeded untrained head: exercises the machinery, accepts
    little), or None for a shipped head that fits the target."""
    if spec == "random":
        with torch.random.fork_rng():
            torch.manual_seed(0)
            return new_head(kind, target)
    path = spec or shipped_head(kind, target.cfg)
    if path is None:
        raise ValueError(f"no {kind} head for this model under {HEADS_DIR}: pass --head DIR "
                         f"(or --head random to test the machinery)")
    return load_head(path, target, kind)


class EagleDecoder(SpeculativeDecoder):
    def __init__(self, runner, sampler, blocks, head: DraftHead, tree, timing: bool = False):
        super().__init__(runner, sampler, blocks, timing)
        self.head, self.tree = head, tree
        self.capture = head.capture
        self.kv = runner.new_cache(1, head.cfg.num_kv_heads, head.cfg.head_dim)
        self.head_layers = kv_layers(self.kv)
        self.root: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # seq_id -> root pair's (hidden, output) [H]
        fed = sum(tree.frontier_sizes())
        # Verification writes the tree at L ..; drafting the history at L - 1 ..
        self.lookahead = max(tree.verify_tokens, fed - 1)

    def release(self, seq_ids):
        for sid in seq_ids:
            self.root.pop(sid, None)

    def prefill(self, seqs: list[Sequence]) -> list[list[int]]:
        first, feature, captured, cu = self.prefill_target(seqs, self.capture)
        hidden = self.head.target_feature(feature, captured)                               # [T, H]
        rows = list(range(cu[-1]))
        tokens = [t for s, f in zip(seqs, first) for t in s.prompt_ids[1:] + [f]]
        self._feed(seqs, [0] * len(seqs), [len(s.prompt_ids) for s in seqs], tokens, hidden, rows)
        return [[t] for t in first]

    def _feed(self, seqs, starts, counts, tokens, source, rows):
        """Cache the pairs (source[rows[i]], tokens[i]), counts[b] of them from position starts[b]; each
        sequence's last pair becomes its root pair."""
        meta, pos, ids = self.runner.meta(self.plan(seqs, starts, counts), ids=tokens)
        hidden = source.index_select(0, self.runner.index(rows))
        out = self.head(ids, hidden, pos, self.head_layers[0], meta)
        end = 0
        for s, n in zip(seqs, counts):
            end += n
            self.root[s.seq_id] = (hidden[end - 1], out[end - 1])

    def draft(self, seqs: list[Sequence]):
        head, policy, runner = self.head, self.tree, self.runner
        B = len(seqs)
        caps = depth_caps(seqs, self.model.cfg.max_position)
        tree = Tree.roots(runner.to_device([s.all_ids[-1] for s in seqs]))
        root_hidden = torch.stack([self.root[s.seq_id][0] for s in seqs])                  # [B, H]
        out = torch.stack([self.root[s.seq_id][1] for s in seqs])[:, None]                  # [B, 1, H]
        front = torch.zeros(B, 1, dtype=torch.int64, device=out.device)                     # node ids
        history = front
        starts = [cached_len(s) - 1 for s in seqs]
        for depth in range(1, min(policy.depth, max(caps)) + 1):
            if depth > 1:
                fed = tree.subtree(history)                                                 # [B, n]
                parent = fed.parents.long()
                hidden = torch.where((parent < 0)[..., None], root_hidden[:, None],
                                     out.gather(1, parent.clamp(min=0)[..., None].expand(-1, -1, out.shape[-1])))
                out = self._forward(seqs, starts, fed, hidden)                               # [B, n, H]
            F = front.shape[1]
            tree, front = policy.expand(tree, head.logits(out[:, -F:]), front, depth, head.d2t)
            history = torch.cat([history, front], 1)
        return tree.select(policy.verify_tokens - 1, runner.to_device(caps)), None

    def _forward(self, seqs, starts, fed: Tree, hidden) -> torch.Tensor:
        """The head over the drafted history (fed.tokens [B, n], hidden [B, n, H]) -> outputs [B, n, H]."""
        B, n = fed.tokens.shape
        Bp = self.runner.batch_rows(B)
        plan = self.plan(seqs, starts, [n] * B).padded(Bp)
        H = hidden.shape[-1]
        g = self.runner.graph(self.graphs, ("draft", Bp, n), plan, self._draft_fn, {
            "ids": ((Bp, n), torch.int64), "hidden": ((Bp, n, H), hidden.dtype),
            "depths": ((Bp, n), torch.int32), "tree_mask": ((Bp * n, (n + 31) // 32), torch.int32)})
        out = g.run(plan, ids=fed.tokens, hidden=hidden, depths=fed.depths, tree_mask=fed.mask())
        return out.view(Bp, n, -1)[:B]

    def _draft_fn(self, g):
        # The pair of a depth-d node sits d positions after the root pair (at L - 1).
        rope = g.meta.prefix_lens[:, None] + g.inputs["depths"]
        return self.head(g.inputs["ids"].flatten(), g.inputs["hidden"].flatten(0, 1), rope.flatten(),
                         self.head_layers[0], g.meta)

    def catch_up(self, seqs: list[Sequence], v: Verdict):
        B, N, H = v.feature.shape
        hidden = self.head.target_feature(v.feature.flatten(0, 1), [c.flatten(0, 1) for c in v.captured])
        rows = [b * N + i for b, path in enumerate(v.paths) for i in path]
        tokens = [t for new in v.new_tokens for t in new]
        self._feed(seqs, [cached_len(s) for s in seqs], [len(p) for p in v.paths], tokens, hidden, rows)
