"""EAGLE decoding (EAGLE-1 / EAGLE-2 / EAGLE-3): a one-layer head drafts a tree from the target's features,
the target verifies the whole tree in one forward.

The head reads pairs: pair t = (hidden_t, token_{t+1}) sits at position t. Every target step (prefill,
decode, verify) writes its tokens' raw features (what `head.project` reads) to `features`, rows by cache
slot beside the target's KV, and verification moves the accepted rows with the accepted KV. The head is fed
lazily: a round that drafts first feeds each sequence's pairs fed[seq] <= t < L (L = the target's cached
tokens; the tokens are the sequence's own): one projection to the head's input width, one head forward.
After that the head's cache holds the pairs t < L (pair L - 1 is the root pair, its token the root) and
`root[seq]` keeps that pair's input hidden and the head's output there. A round that drafts nothing (an
adaptive policy's depth 0) is a plain decode step plus one row write, and a request served without drafts
to its end never runs the head. A round:
1. draft: feed the pending pairs; the root's output gives the depth-1 candidates; forward d (d = 2 .. depth)
   feeds the drafted history - the root pair again and every frontier expanded so far, with its ancestor
   mask - and expands the newest frontier (trees.py policies). Drafts are re-fed, not cached: paged
   attention lets new tokens see every cached token, so a cached draft would be visible to its cousins.
2. verify (decoding.SpeculativeDecoder.verify): root + tree in one target forward, lossless acceptance.
3. catch up: nothing to do; the accepted path's rows are in `features` and the next round feeds them.

With a policy (engine/adaptive.py) each round drafts the depth it picks for the batch, 0 .. the tree's
depth; the verified tokens shrink with it (the tree's budget, capped by what d levels hold).
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

import eagle_kernels

from .adaptive import SpeculationPolicy
from .decoding import SpeculativeDecoder, Verdict, depth_caps
from .heads import DraftHead, detect_kind, load_head, new_head, quantize_like_target
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
    little), or None for a shipped head that fits the target; quantized like the target's weights."""
    if spec == "random":
        with torch.random.fork_rng():
            torch.manual_seed(0)
            return quantize_like_target(new_head(kind, target), target)
    path = spec or shipped_head(kind, target.cfg)
    if path is None:
        raise ValueError(f"no {kind} head for this model under {HEADS_DIR}: pass --head DIR "
                         f"(or --head random to test the machinery)")
    return quantize_like_target(load_head(path, target, kind), target)


class EagleDecoder(SpeculativeDecoder):
    def __init__(self, runner, sampler, blocks, head: DraftHead, tree, timing: bool = False,
                 policy: SpeculationPolicy | None = None):
        super().__init__(runner, sampler, blocks, timing)
        self.head, self.tree, self.policy = head, tree, policy
        self.capture = head.capture
        self.kv = runner.new_cache(1, head.cfg.num_kv_heads, head.cfg.head_dim)
        self.head_layers = kv_layers(self.kv)
        self.features = runner.new_store(head.raw_width)                                # [slots, R]
        # EAGLE-3's raw feature is the captured inputs side by side: the target's forward writes them.
        self.capture_into = self.features if self.capture else None
        self.root: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # seq_id -> root pair's (hidden, output) [H]
        self.fed: dict[int, int] = {}  # seq_id -> pairs in the head's cache
        self.caps: list[int] = []  # this round's depth caps per sequence
        self.last_pairs, self.backlog_s = 0, 0.0  # tokens the last round added; feeding time not charged to a round
        self.planned = 0  # the depth this round set out to draft (the policy's choice; confidence may stop sooner)
        # A chain drafts level by level like decode steps (its drafts have no cousins: their KV stays), and
        # is verified causally with its accepted prefix already in place.
        self.causal = tree.chain
        fed = sum(tree.frontier_sizes())
        # Verification writes the tree at L ..; drafting the history at L - 1 ..
        self.lookahead = max(tree.verify_tokens, fed - 1)
        self.max_tree = tree.verify_tokens

    @staticmethod
    def verify_tokens(tree) -> list[int]:
        """Tokens verified per sequence when drafting d = 0 .. depth levels: the root and the tree's budget,
        capped by the candidates d levels hold."""
        sizes = tree.frontier_sizes()
        return [1 + min(tree.verify_tokens - 1, sum(sizes[:d]) * tree.topk) for d in range(tree.depth + 1)]

    def release(self, seq_ids):
        for sid in seq_ids:
            self.root.pop(sid, None)
            self.fed.pop(sid, None)

    def store(self, slots, feature, captured):
        if self.capture_into is None:
            self.features.index_copy_(0, slots, self.head.raw_feature(feature, captured))

    def move_slots(self, dst, src):
        super().move_slots(dst, src)
        self.features.index_copy_(0, dst, self.features.index_select(0, src))

    def prefill(self, seqs: list[Sequence]) -> list[list[int]]:
        for s in seqs:
            self.fed[s.seq_id] = 0
        return [[t] for t in self.prefill_target(seqs)]

    def step(self, seqs: list[Sequence]) -> list[list[int]]:
        if self.policy is None:
            return super().step(seqs)
        t0, graphs, self.backlog_s = time.perf_counter(), len(self.graphs), 0.0
        new = super().step(seqs)
        self.last_pairs = sum(len(t) for t in new)
        # A round that built a step shape is no sample: graph capture and compilation on a GPU, first-use
        # allocations and the head's fused weights on a CPU (~1.5x a steady round, enough to rule a depth out).
        warm_up = len(self.graphs) > graphs
        seconds = None if warm_up else time.perf_counter() - t0 - self.backlog_s
        # Observed as the depth chosen: its time and its tokens are what choosing it yields, confidence stops
        # included.
        self.policy.observe(len(seqs), self.planned, seconds,
                            [len(t) - 1 for t, cap in zip(new, self.caps) if cap >= self.planned], self.backlog_s)
        return new

    def drafted_depth(self, tree) -> int:
        return self.depth

    def draft(self, seqs: list[Sequence]):
        head, tree_policy, runner = self.head, self.tree, self.runner
        B = len(seqs)
        self.caps = depth_caps(seqs, self.model.cfg.max_position)
        want = tree_policy.depth if self.policy is None else self.policy.choose(B)
        # Each sequence's tree is cut to its own cap (select); a round that drafts at all drafts a level even
        # when every cap is 0, so a capped sequence verifies its root alone as it would beside others: the
        # same random draws, whatever its companions.
        self.depth = self.planned = min(want, max(1, max(self.caps)))
        if self.depth == 0:
            return None, None
        if tree_policy.chain and eagle_kernels.draft_chain_fit(self.features):
            weights = head.chain_weights()
            if weights is not None:
                return self._chain_in_one_call(seqs, *weights), None
        self._feed_pending(seqs)
        if tree_policy.chain:
            return self._draft_chain(seqs), None
        floor = math.log(tree_policy.min_prob) if tree_policy.min_prob else None
        tree = Tree.roots(runner.to_device([s.all_ids[-1] for s in seqs]))
        root_hidden = torch.stack([self.root[s.seq_id][0] for s in seqs])                  # [B, H]
        out = torch.stack([self.root[s.seq_id][1] for s in seqs])[:, None]                  # [B, 1, H]
        front = torch.zeros(B, 1, dtype=torch.int64, device=out.device)                     # node ids
        history = front
        starts = [cached_len(s) - 1 for s in seqs]
        for depth in range(1, self.depth + 1):
            if depth > 1:
                fed = tree.subtree(history)                                                 # [B, n]
                parent = fed.parents.long()
                hidden = torch.where((parent < 0)[..., None], root_hidden[:, None],
                                     out.gather(1, parent.clamp(min=0)[..., None].expand(-1, -1, out.shape[-1])))
                out = self._forward(seqs, starts, fed, hidden)                               # [B, n, H]
            F = front.shape[1]
            tree, front = tree_policy.expand(tree, head.logits(out[:, -F:]), front, depth, head.d2t)
            history = torch.cat([history, front], 1)
            if floor is not None and depth < self.depth and tree.scores.gather(1, front).max().item() < floor:
                self.depth = depth  # no path worth a deeper level (a host read: min_prob is for the CPU)
                break
        budget = tree_policy.verify_tokens - 1
        if floor is None:
            if tree.num_nodes - 1 <= budget and min(self.caps) >= self.depth:
                return tree, None  # select would keep every node (small trees): the tree as drafted
            return tree.select(budget, runner.to_device(self.caps)), None
        # Only candidates at least min_prob likely; a round verifies the root alone rather than decoding, so a
        # sampled sequence draws the same way whatever its companions drafted.
        tree = tree.select(budget, runner.to_device(self.caps), floor)
        return tree.prefix(int(tree.sizes.max())), None

    def _draft_chain(self, seqs) -> Tree:
        """Top-1 drafts, one head step a level over each sequence's newest node (the pair of the depth-d node
        sits at L - 1 + d, L = the target's cached tokens), causal over the head's cache, which keeps the
        chain's KV (overwritten when the next round feeds the accepted pairs). With min_prob, a sequence's
        chain ends before its first draft less likely than that; the round drafts while any goes on."""
        head, runner, policy = self.head, self.runner, self.tree
        B = len(seqs)
        Bp = runner.batch_rows(B)
        levels = min(self.depth, policy.verify_tokens - 1)
        starts = [cached_len(s) - 1 for s in seqs]
        out = torch.stack([self.root[s.seq_id][1] for s in seqs])                           # [B, H]
        tokens = [runner.to_device([s.all_ids[-1] for s in seqs])]                          # per level: [B]
        score = torch.zeros(B, device=out.device)                                            # log-prob [B]
        floor = math.log(policy.min_prob) if policy.min_prob else None
        lengths = [min(levels, c) for c in self.caps]
        for depth in range(1, levels + 1):
            if depth > 1:  # the depth - 1 node: its token, its parent's output as its hidden
                plan = self.plan(seqs, [s + depth - 1 for s in starts], [1] * B).padded(Bp)
                g = runner.graph(self.graphs, ("chain", Bp), plan, self._chain_fn, {
                    "ids": ((Bp,), torch.int64), "hidden": ((Bp, out.shape[-1]), out.dtype)})
                out = g.run(plan, ids=tokens[-1], hidden=out)[:B]
            logits = head.logits(out)                                                        # [B, Vd]
            best, top = logits.max(-1)
            tokens.append(head.to_target(top))
            if floor is not None:  # a host read: min_prob is for the CPU
                score = score + (best - torch.logsumexp(logits, -1))
                lengths = [n if n < depth or ok else depth - 1 for n, ok in zip(lengths, (score >= floor).tolist())]
            if max(lengths) <= depth:
                break
        # A chain cut to the root alone is still verified (not decoded): the same draws as beside others.
        self.depth = N = max(lengths)
        return Tree.chains(torch.stack(tokens[:N + 1], 1), runner.index([n + 1 for n in lengths]))

    def _chain_in_one_call(self, seqs, weights, formats) -> Tree:
        """_draft_chain's chain, the same bits, from one C++ call (CPU): the pending pairs fed, then the levels
        drafted (eagle_kernels.draft_chain). A sequence whose pairs are all fed feeds its root pair again (the
        same values rewritten). Pairs older than one round's tokens (left by prefill or rounds without drafts)
        are fed apart first, so that the policy does not charge them to this round."""
        self._feed_pending(seqs, keep=self.max_tree)
        head, policy = self.head, self.tree
        starts = [min(self.fed[s.seq_id], cached_len(s) - 1) for s in seqs]
        counts = [cached_len(s) - f for s, f in zip(seqs, starts)]
        tokens = [t for s, f, n in zip(seqs, starts, counts) for t in s.all_ids[f + 1:f + 1 + n]]
        meta, pos, ids = self.runner.meta(self.plan(seqs, starts, counts), ids=tokens)
        levels = min(self.depth, policy.verify_tokens - 1)
        with eagle_kernels.unchecked():
            chains, sizes = eagle_kernels.draft_chain(
                self.features, ids, pos, meta.slot_mapping, meta.block_tables, meta.cu_seqlens_q, meta.prefix_lens,
                [min(levels, c) for c in self.caps], policy.min_prob, weights, formats, head.d2t, head.cfg.rms_eps,
                head.rotary.cos, head.rotary.sin, list(self.head_layers[0]), head.cfg.num_heads)
        for s in seqs:
            self.fed[s.seq_id] = cached_len(s)
        self.depth = chains.shape[1] - 1
        return Tree.chains(chains, sizes)

    def _chain_fn(self, g):
        return self.head(g.inputs["ids"], g.inputs["hidden"], g.positions, self.head_layers[0], g.meta)

    def _feed_pending(self, seqs, keep: int = 0):
        """Feed the unfed pairs of `seqs` in one head forward, all but each sequence's newest `keep` (those
        are then this round's own: the time is the backlog's). With keep 0 each last pair becomes its root."""
        todo = [s for s in seqs if self.fed[s.seq_id] < cached_len(s) - keep]
        if not todo:
            return
        t0 = time.perf_counter()
        starts = [self.fed[s.seq_id] for s in todo]
        counts = [cached_len(s) - keep - f for s, f in zip(todo, starts)]
        tokens = [t for s, f, n in zip(todo, starts, counts) for t in s.all_ids[f + 1:f + 1 + n]]
        meta, pos, ids = self.runner.meta(self.plan(todo, starts, counts), ids=tokens)
        hidden = self.head.project(self.features.index_select(0, meta.slot_mapping))        # [T, H]
        out = self.head(ids, hidden, pos, self.head_layers[0], meta)
        end = 0
        for s, f, n in zip(todo, starts, counts):
            end += n
            self.fed[s.seq_id] = f + n
            if not keep:  # the last pair is the root
                self.root[s.seq_id] = (hidden[end - 1], out[end - 1])
        # Pairs left by earlier rounds (prefill, rounds without drafts) are not this round's cost.
        seconds = time.perf_counter() - t0
        self.backlog_s = seconds if keep else seconds * (1 - min(self.last_pairs, len(tokens)) / len(tokens))

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
        """The accepted rows are in `features` already (verify moved them); the next draft feeds them."""
