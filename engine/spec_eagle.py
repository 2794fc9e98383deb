"""EAGLE decoding (EAGLE-1 / EAGLE-2 / EAGLE-3): a one-layer head drafts a tree from the target's features,
the target verifies the whole tree in one forward.

A round, for a batch of sequences:
1. draft: from each root's head output, expand the tree depth by depth (trees.py policies). Each draft
   forward re-feeds all frontier nodes drafted so far with their ancestor mask: paged attention lets new
   tokens see every cached token, so drafted nodes cannot be cached without becoming visible to their
   cousins. Nothing drafted stays in the head's cache.
2. verify (speculative.verify): root + tree in one target forward, lossless acceptance, accepted KV kept.
3. catch up: the head consumes (target feature at t, token t + 1) for the accepted path and the bonus
   token, which leaves the next root's head output.

Head cache invariant between rounds: it holds pair t = (feature_t, token_{t+1}) at position t for every
t below the target cache's length, so both caches have the same length.
"""
from __future__ import annotations

import json

import torch

from .heads import DraftHead, detect_kind, load_head, new_head
from .model import Llama
from .model_runner import ModelRunner
from .sampler import Sampler
from .scheduler import Sequence
from .speculative import HEADS_DIR, SpeculativeDecoder, depth_caps, verify
from .trees import Frontier, Pool, Tree, pack_bits


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


class History:
    """The frontier nodes drafted so far in a round, depth-major: what each draft forward re-feeds."""

    def __init__(self):
        self.tokens, self.hidden, self.depths = [], [], []
        self.anc: torch.Tensor | None = None  # bool [B, n, n]: ancestor-or-self among the nodes
        self.last = 0                          # column of the newest frontier's first node

    def append(self, front: Frontier, hidden: torch.Tensor, depth: int):
        # front: [B, F]; hidden: [B, F, H], each node's input (its parent's head output)
        B, F = front.tokens.shape
        own = torch.eye(F, dtype=torch.bool, device=hidden.device).expand(B, F, F)
        if self.anc is None:
            self.anc = own
        else:
            n = self.anc.shape[1]
            parent_rows = self.anc.gather(1, (self.last + front.rows)[..., None].expand(B, F, n))
            self.anc = torch.cat([torch.nn.functional.pad(self.anc, (0, F)),
                                  torch.cat([parent_rows, own], 2)], 1)
            self.last = n
        self.tokens.append(front.tokens)
        self.hidden.append(hidden)
        self.depths += [depth] * F


class EagleDecoder(SpeculativeDecoder):
    """state[seq]: the head's output at the root's pair [H], where the next tree grows from."""

    def __init__(self, runner: ModelRunner, sampler: Sampler, head: DraftHead, tree):
        super().__init__(runner, sampler, head, head.cfg)
        self.head, self.tree = head, tree
        # Verification appends the whole tree to the target cache; drafting the frontier history to the head's.
        self.lookahead = max(tree.verify_tokens, tree.max_draft_tokens)

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence]) -> list[list[int]]:
        first, feature, captured, _ = self.prefill_target(seqs, self.head.capture)
        hidden = self.head.target_feature(feature, captured)
        self._catch_up(seqs, hidden, [s.prompt_ids[1:] + [t] for s, t in zip(seqs, first)])
        return [[t] for t in first]

    @torch.inference_mode()
    def step(self, seqs: list[Sequence]) -> list[list[int]]:
        self.release_retired()
        with self.timer("draft_s"):
            tree = self._draft(seqs)
        with self.timer("verify_s"):
            v = verify(self.runner, self.sampler, seqs, tree, self.head.capture)
        with self.timer("draft_s"):
            hidden = self.head.target_feature(v.feature[v.rows], [c[v.rows] for c in v.captured])
            self._catch_up(seqs, hidden, v.new_tokens)
        self._stats.record(v.paths)
        return v.new_tokens

    def _catch_up(self, seqs, hidden, tokens: list[list[int]]):
        """Feed pairs (hidden row, token) per sequence (hidden: [T, H] packed in `tokens` order)."""
        runner = self.cache.runner
        meta, prefix, cu = runner.build_meta([s.seq_id for s in seqs], [len(t) for t in tokens])
        ids = torch.tensor([t for ts in tokens for t in ts], device=runner.device)
        pos = torch.tensor([p + i for p, ts in zip(prefix, tokens) for i in range(len(ts))], device=runner.device)
        out = self.head(ids, hidden, pos, runner.kv_layers[0], meta)
        for s, last in zip(seqs, runner.last_positions(cu)):
            self.state[s.seq_id] = out[last]

    def _draft(self, seqs) -> Tree:
        head, policy = self.head, self.tree
        ids = [s.seq_id for s in seqs]
        lengths = [self.cache.blocks.length(i) for i in ids]
        B = len(seqs)
        root = torch.stack([self.state[i] for i in ids])                                  # [B, H]
        pool, hist = Pool(), History()
        front = policy.expand(pool, head.logits(root)[:, None], torch.full((B, 1), -1, device=root.device),
                              torch.zeros(B, 1, device=root.device), 1, head.d2t)
        out = root[:, None]                                                               # [B, 1, H]
        caps = depth_caps(seqs, self.runner.cfg.max_position)
        for depth in range(1, min(policy.depth, max(caps))):  # nothing deeper can be verified
            if front.ids.shape[1] == 0:
                break
            hist.append(front, out.gather(1, front.rows[..., None].expand(-1, -1, out.shape[-1])), depth)
            out = self._forward_history(ids, lengths, hist)[:, hist.last:]               # [B, F, H]
            front = policy.expand(pool, head.logits(out), front.ids, front.scores, depth + 1, head.d2t)
        self.cache.truncate(ids, lengths)
        roots = torch.tensor([s.all_ids[-1] for s in seqs], device=root.device)
        return pool.select(roots, policy.verify_tokens - 1, torch.tensor(caps, device=root.device))

    def _forward_history(self, ids, lengths, hist: History) -> torch.Tensor:
        """Re-feed every drafted frontier node after the cached pairs -> head outputs [B, n, H]."""
        runner = self.cache.runner
        self.cache.truncate(ids, lengths)
        tokens, hidden = torch.cat(hist.tokens, 1), torch.cat(hist.hidden, 1)             # [B, n], [B, n, H]
        B, n = tokens.shape
        meta, _, _ = runner.build_meta(ids, [n] * B, pack_bits(hist.anc).view(B * n, -1))
        # The depth-d node's pair sits right after the cached ones: position length + d - 1.
        depth = torch.tensor(hist.depths, device=tokens.device)
        pos = torch.tensor(lengths, device=tokens.device)[:, None] + depth[None] - 1
        out = self.head(tokens.flatten(), hidden.flatten(0, 1), pos.flatten(), runner.kv_layers[0], meta)
        return out.view(B, n, -1)
