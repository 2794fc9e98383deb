"""EAGLE decoding (EAGLE-1 / EAGLE-2 / EAGLE-3): a one-layer head drafts a tree from the target's features,
the target verifies the whole tree in one forward.

The head reads pairs: pair t = (hidden_t, token_{t+1}) sits at position t. Every target step (prefill,
decode, verify) writes its tokens' raw features (what `head.project` reads) to `features`, rows by cache
slot beside the target's KV, and verification moves the accepted rows with the accepted KV. The head is fed
lazily: a round that drafts first feeds each sequence's pairs fed <= t < L (L = the target's cached
tokens; the tokens are the sequence's own; `fed` is its HeadCursor's): one projection to the head's input
width, one head forward. After that the head's cache holds the pairs t < L (pair L - 1 is the root pair,
its token the root) and the cursor keeps that pair's input hidden and the head's output there. A round that drafts nothing (an
adaptive policy's depth 0) is a plain decode step plus one row write, and a request served without drafts
to its end never runs the head. A round:
1. draft: feed the pending pairs; the root's output gives the depth-1 candidates; forward d (d = 2 .. depth)
   feeds the drafted history - the root pair again and every frontier expanded so far, with its ancestor
   mask - and expands the newest frontier (trees.py policies). Drafts are re-fed, not cached: paged
   attention lets new tokens see every cached token, so a cached draft would be visible to its cousins.
   The policy fixes each level's frontier, so every shape is known from (batch, depth): after the feed, the
   levels and the selection run as one fixed-shape step (_draft_tree, a graph replay on a GPU); min_prob,
   which reads the scores between levels, drafts one step a level (_draft_levels).
2. verify (decoding.SpeculativeDecoder.verify): root + tree in one target forward, lossless acceptance.
3. catch up: nothing to do; the accepted path's rows are in `features` and the next round feeds them.

With an adaptive policy (engine/adaptive.py, run by LLM.step) each round drafts the depth it picks for the
batch, 0 .. the tree's depth; the verified tokens shrink with it (the tree's budget, capped by what d levels
hold: `verify_tokens`).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import eagle_kernels

from .decoding import Draft, SpeculativeDecoder, Verdict
from .heads import DraftHead, detect_kind, load_head, new_head, quantize_like_target
from .lookup import MOST, ContextIndex
from .model import AttnMeta, Llama
from .model_runner import kv_layers
from .scheduler import Sequence, cached_len
from .trees import Tree

HEADS_DIR = Path(__file__).parent / "heads"  # shipped trained heads: engine/heads/<name>/
# A sampled sequence's drafts are keyed draws from the draft at this fraction of the request's temperature: the
# head's distribution is flatter than the target's, and a sharper one picks the target's keyed draw more often
# (benchmarks/RESULTS.md, session 38). Drafts are proposals: the output does not depend on it.
DRAFT_COOLING = 0.75


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


def verify_tokens(tree) -> list[int]:
    """Tokens verified per sequence when drafting d = 0 .. depth levels: the root and the tree's budget,
    capped by the candidates d levels hold."""
    sizes = tree.frontier_sizes()
    return [1 + min(tree.verify_tokens - 1, sum(sizes[:d]) * tree.topk) for d in range(tree.depth + 1)]


def grammar_prune(seqs: list[Sequence], tree: Tree) -> Tree:
    """Each grammar request's drafts without those its grammar rejects and everything under them (they could
    never be accepted: their parents' rows are masked in verification), and the columns no tree reaches
    dropped, so a round verifies fewer tokens. Kept nodes keep their order (BFS; a chain's ids stay its
    depths). A host read, for requests with a grammar alone."""
    asked = [b for b, s in enumerate(seqs) if s.grammar is not None]
    if not asked:
        return tree
    rows = tree.sizes.new_tensor(asked)
    tokens, parents = tree.tokens.index_select(0, rows).tolist(), tree.parents.index_select(0, rows).tolist()
    kept = [list(range(n)) for n in tree.sizes.tolist()]
    for i, b in enumerate(asked):
        n = len(kept[b])
        kept[b] = sorted(seqs[b].grammar.walk(tokens[i][:n], parents[i][:n]))
    n = max(map(len, kept))
    last = tree.num_nodes - 1  # the padding's id: in BFS order the last node is nobody's parent
    ids = tree.tokens.new_tensor([k + [last] * (n - len(k)) for k in kept])
    keep = torch.arange(n, device=ids.device) < ids.new_tensor([len(k) for k in kept])[:, None]
    return tree.subtree(ids, keep)


@dataclass
class HeadCursor:
    """A sequence's place in the head's cache (its Sequence.draft_state)."""
    fed: int = 0                  # pairs in the head's cache
    root: tuple | None = None     # the root pair's (input hidden, head output), [H] each, once fed
    context: ContextIndex | None = None  # its n-grams, where drafts are also looked up in the context


class EagleDecoder(SpeculativeDecoder):
    def __init__(self, runner, sampler, blocks, head: DraftHead, tree, timing: bool = False,
                 adaptive: bool = False, lookup: int = 0):
        super().__init__(runner, sampler, blocks, timing)
        if lookup < 0:
            raise ValueError(f"--lookup must be >= 0 (tokens a lookup matches; 0: off), got {lookup}")
        if lookup and not tree.chain:
            raise ValueError(f"lookup drafts (n-grams of {lookup}) need a chain (--topk 1), not a {tree.topk}-wide tree")
        self.head, self.tree, self.adaptive, self.lookup = head, tree, adaptive, lookup
        self.max_depth = tree.depth
        self.capture = head.capture
        self.kv = runner.new_cache(1, head.cfg.num_kv_heads, head.cfg.head_dim)
        self.head_layers = kv_layers(self.kv)
        self.features = runner.new_store(head.raw_width)                                # [slots, R]
        # EAGLE-3's raw feature is the captured inputs side by side: the target's forward writes them.
        self.capture_into = self.features if self.capture else None
        # A chain drafts level by level like decode steps (its drafts have no cousins: their KV stays), and
        # is verified causally with its accepted prefix already in place.
        self.causal = tree.chain
        fed = sum(tree.frontier_sizes())
        # Verification writes the tree at L ..; drafting the history at L - 1 ..
        self.max_tree = max(tree.verify_tokens, MOST + 1 if lookup else 0)  # a looked-up chain: up to MOST
        self.lookahead = max(self.max_tree, fed - 1)

    @functools.cached_property
    def chain_weights(self):
        """eagle_kernels.draft_chain's weights and formats, gathered once (None: the op does not fit, and a chain
        is drafted op by op)."""
        return self.head.chain_weights() if eagle_kernels.draft_chain_fit(self.features) else None

    def store(self, slots, feature, captured):
        if self.capture_into is None:
            self.features.index_copy_(0, slots, self.head.raw_feature(feature, captured))

    def move_slots(self, dst, src):
        super().move_slots(dst, src)
        self.features.index_copy_(0, dst, self.features.index_select(0, src))

    def verify_widths(self) -> list[int]:
        return verify_tokens(self.tree)

    def admit(self, seqs: list[Sequence]):
        for s in seqs:  # the head's KV over a shared prefix is there where the head had fed its blocks
            s.draft_state = s.draft_state or HeadCursor(self.blocks.side_prefix(s.seq_id, s.cached_tokens),
                                                        context=ContextIndex(self.lookup) if self.lookup else None)

    def prefill(self, seqs: list[Sequence], counts: list[int]) -> Verdict:
        self.admit(seqs)
        return self.prefill_target(seqs, counts)

    def draft(self, seqs: list[Sequence], depth: int, caps: list[int]) -> Draft:
        tree_policy, runner = self.tree, self.runner
        # Pairs older than one round's tokens (left by prefill or rounds without drafts) are fed apart first:
        # their time is the backlog's, which an adaptive policy does not charge to this round.
        backlog_s, catch_up_s = self._feed_pending(seqs, keep=self.max_tree)
        spent = dict(backlog_s=backlog_s, catch_up_s=catch_up_s)
        if tree_policy.chain:
            if self.chain_weights is not None:
                tree = self._chain_in_one_call(seqs, depth, caps, *self.chain_weights)
            else:
                self._feed_pending(seqs)
                tree = self._draft_chain(seqs, depth, caps)
            tree = grammar_prune(seqs, tree)
            return Draft(tree, tree.num_nodes - 1, **spent)
        roots = self._feed_round(seqs) if runner.bucketed else None
        if roots is None:
            self._feed_pending(seqs)
            cursors = [s.draft_state for s in seqs]
            roots = (torch.stack([c.root[0] for c in cursors]), torch.stack([c.root[1] for c in cursors]))
        root_hidden, root_out = roots                                                        # [B, H] each
        if not tree_policy.min_prob and self.fused:
            draft = Draft(self._draft_tree(seqs, depth, caps, root_hidden, root_out), depth, **spent)
        else:
            draft = self._draft_levels(seqs, depth, caps, root_hidden, root_out, spent)
        return dataclasses.replace(draft, tree=grammar_prune(seqs, draft.tree))

    def _draft_levels(self, seqs, depth: int, caps: list[int], root_hidden, root_out, spent: dict) -> Draft:
        """The tree drafted one step a level (each level's head forward its own StepGraph, the bookkeeping
        between them eager): the reference _draft_tree matches bit for bit, and the path of min_prob, whose
        confidence cut reads the scores on the host between levels."""
        tree_policy, runner = self.tree, self.runner
        floor = math.log(tree_policy.min_prob) if tree_policy.min_prob else None
        starts = [cached_len(s) - 1 for s in seqs]
        tokens = runner.to_device([s.last_id for s in seqs])
        levels = depth
        forward = lambda fed, hidden: self._forward(seqs, starts, fed, hidden)  # noqa: E731
        for d, (tree, front) in enumerate(self._levels(tokens, root_hidden, root_out, depth, forward), 1):
            if floor is not None and d < depth and tree.scores.gather(1, front).max().item() < floor:
                levels = d  # no path worth a deeper level (a host read: min_prob is for the CPU)
                break
        budget = tree_policy.verify_tokens - 1
        if floor is None:
            if tree.num_nodes - 1 <= budget and min(caps) >= levels:
                return Draft(tree, levels, **spent)  # select would keep every node: as drafted
            return Draft(tree.select(budget, runner.to_device(caps)), levels, **spent)
        # Only candidates at least min_prob likely; a round verifies the root alone rather than decoding, so a
        # sampled sequence draws the same way whatever its companions drafted.
        tree = tree.select(budget, runner.to_device(caps), floor)
        return Draft(tree.prefix(int(tree.sizes.max())), levels, **spent)

    def _levels(self, tokens, root_hidden, root_out, depth: int, forward):
        """The tree draft, level by level: yields (tree, its newest frontier's node ids [B, F]) after each
        level d = 1 .. depth. tokens int64 [B] (the roots), root_hidden / root_out [B, H] (the root pair's input
        hidden and head output); forward(fed, hidden) runs the head over the drafted history (fed: a Tree
        [B, n], the root pair and every frontier expanded so far; hidden [B, n, H]) -> outputs [B, n, H].
        Level d's history is sum(frontier_sizes()[:d]) nodes: every shape is fixed by (B, d)."""
        head, policy = self.head, self.tree
        tree = Tree.roots(tokens)
        out = root_out[:, None]                                                              # [B, 1, H]
        front = torch.zeros(tokens.shape[0], 1, dtype=torch.int64, device=out.device)         # node ids
        history = front
        for d in range(1, depth + 1):
            if d > 1:
                fed = tree.subtree(history)                                                 # [B, n]
                parent = fed.parents.long()
                hidden = torch.where((parent < 0)[..., None], root_hidden[:, None],
                                     out.gather(1, parent.clamp(min=0)[..., None].expand(-1, -1, out.shape[-1])))
                out = forward(fed, hidden)                                                   # [B, n, H]
            F = front.shape[1]
            tree, front = policy.expand(tree, head.logits(out[:, -F:]), front, d, head.d2t)
            history = torch.cat([history, front], 1)
            yield tree, front

    def _draft_tree(self, seqs, depth: int, caps: list[int], root_hidden, root_out) -> Tree:
        """The whole tree draft of `depth` levels (every head forward, expansion, mask and the final
        selection) as one fixed-shape step: the StepGraph ("draft_tree", Bp, depth), a CUDA graph replay on
        a GPU. Its metadata is the plan of the deepest level's history (n = sum(frontier_sizes()[:depth])
        nodes at L - 1 .., L the target's cached tokens); level d feeds the first n_d of them per sequence
        (_draft_tree_fn). -> the selected trees [B, N]."""
        runner = self.runner
        B, H = root_hidden.shape
        Bp = runner.batch_rows(B)
        n = sum(self.tree.frontier_sizes()[:depth])
        plan = self.plan(seqs, [cached_len(s) - 1 for s in seqs], [n] * B).padded(Bp)
        fn = functools.partial(self._draft_tree_fn, depth)
        g = runner.graph(self.graphs, ("draft_tree", Bp, depth), plan, fn, {
            "tokens": ((Bp,), torch.int64), "caps": ((Bp,), torch.int64),
            "hidden": ((Bp, H), root_hidden.dtype), "out": ((Bp, H), root_out.dtype)})
        ints = runner.to_device([s.last_id for s in seqs] + caps)                       # [2B]
        return g.run(plan, tokens=ints[:B], caps=ints[B:], hidden=root_hidden, out=root_out).rows(B)

    def _draft_tree_fn(self, depth: int, g) -> Tree:
        Bp = g.inputs["tokens"].shape[0]
        slots = g.meta.slot_mapping.view(Bp, -1)                                            # [Bp, n]

        def forward(fed, hidden):  # level d's history: the first m of each sequence's n planned slots
            m = fed.tokens.shape[1]
            cu = torch.arange(0, (Bp + 1) * m, m, dtype=torch.int32, device=slots.device)   # [Bp + 1]
            meta = AttnMeta(slots[:, :m].flatten(), g.meta.block_tables, cu, g.meta.prefix_lens, fed.mask())
            return self._head_over(fed.tokens, hidden, fed.depths, meta).view(Bp, m, -1)

        *_, (tree, _) = self._levels(g.inputs["tokens"], g.inputs["hidden"], g.inputs["out"], depth, forward)
        # Always selected (shapes fixed): where _draft_levels skips it, select keeps every node as it was.
        return tree.select(self.tree.verify_tokens - 1, g.inputs["caps"])

    def _draft_chain(self, seqs, depth: int, caps: list[int]) -> Tree:
        """Top-1 drafts (a sampled sequence's: keyed draws from the draft at its temperature, under the noise
        its target's draw at that position takes, so the two agree as often as the distributions let them), one
        head step a level over each sequence's newest node (the pair of the depth-d node sits at L - 1 + d, L =
        the target's cached tokens), causal over the head's cache, which keeps the chain's KV (overwritten when
        the next round feeds the accepted pairs). With min_prob, a sequence's
        chain ends before its first draft less likely than that; the round drafts while any goes on."""
        head, runner, policy = self.head, self.runner, self.tree
        B = len(seqs)
        Bp = runner.batch_rows(B)
        levels = min(depth, policy.verify_tokens - 1)
        starts = [cached_len(s) - 1 for s in seqs]
        out = torch.stack([s.draft_state.root[1] for s in seqs])                            # [B, H]
        tokens = [runner.to_device([s.last_id for s in seqs])]                          # per level: [B]
        score = torch.zeros(B, device=out.device)                                            # log-prob [B]
        keyed = self._keyed(seqs)
        floor = math.log(policy.min_prob) if policy.min_prob else None
        lengths = [min(levels, c) for c in caps]
        for d in range(1, levels + 1):
            if d > 1:  # the depth d - 1 node: its token, its parent's output as its hidden
                plan = self.plan(seqs, [s + d - 1 for s in starts], [1] * B).padded(Bp)
                g = runner.graph(self.graphs, ("chain", Bp), plan, self._chain_fn, {
                    "ids": ((Bp,), torch.int64), "hidden": ((Bp, out.shape[-1]), out.dtype)})
                out = g.run(plan, ids=tokens[-1], hidden=out)[:B]
            logits = head.logits(out)                                                        # [B, Vd]
            best, top = logits.max(-1)
            if keyed is not None:  # sampled rows draw their drafts keyed, as draft_chain does
                rows = [b for b, t in enumerate(keyed[2]) if t > 0]
                at = runner.index(rows).long()
                _, seeds, positions = self.sampler.keyed([seqs[b] for b in rows], d - 1)
                temps = torch.tensor([keyed[2][b] for b in rows], dtype=torch.float32, device=logits.device)
                pick = eagle_kernels.sample_keyed(logits.index_select(0, at).float(), temps, seeds, positions,
                                                  self.draft_ids)                            # [R]
                top = top.index_copy(0, at, pick)
                best = best.index_copy(0, at, logits.index_select(0, at).gather(1, pick[:, None])[:, 0].float())
            tokens.append(head.to_target(top))
            if floor is not None:  # a host read: min_prob is for the CPU
                score = score + (best - torch.logsumexp(logits, -1))
                lengths = [n if n < d or ok else d - 1 for n, ok in zip(lengths, (score >= floor).tolist())]
            if max(lengths) <= d:
                break
        # A chain cut to the root alone is still verified (not decoded): the same draws as beside others.
        N = max(lengths)
        return Tree.chains(torch.stack(tokens[:N + 1], 1), runner.index([n + 1 for n in lengths]))

    def look_up(self, seqs, depth: int, caps: list[int]) -> Draft | None:
        """The round's chains read from the context (engine.lookup) where a sequence's last n tokens recur: as
        many tokens as the head would draft (the round's shape, which the policy chose by its cost), up to MOST
        while a sequence copies. Where every sequence that may draft has a match, no head runs; in a round that
        drafts, the head drafts the sequences without one (the matched ones' caps 0). A round the policy keeps
        plain looks up only where every sequence matches (its rows are what the policy judged not worth
        drafting): one token each, growing while copied only as far as the batch's extra rows stay within
        MOST. None where nothing is looked up. The head reads the accepted pairs in its next drafting round."""
        if not self.lookup:
            return None
        most = MOST if depth else MOST // len(seqs)
        chains = [s.draft_state.context.propose(s, min(max(depth, 1), cap), min(most, cap)) for s, cap in zip(seqs, caps)]
        found = sum(map(bool, chains))
        partial = any(cap and not c for c, cap in zip(chains, caps))
        if not found or partial and not depth:
            return None
        drafted = self.draft(seqs, depth, [0 if c else cap for c, cap in zip(chains, caps)]) if partial else None
        N = max(max(map(len, chains)), 0 if drafted is None else drafted.tree.num_nodes - 1)
        rows = [b for b, c in enumerate(chains) if c or drafted is None]  # a root alone where nothing is drafted
        tokens = self.runner.to_device([t for b in rows for t in [seqs[b].last_id] + chains[b]
                                        + [0] * (N - len(chains[b]))]).view(len(rows), N + 1)
        sizes = self.runner.index([len(chains[b]) + 1 for b in rows])
        if drafted is None:
            return Draft(grammar_prune(seqs, Tree.chains(tokens, sizes)), N, looked_up=True, from_context=found)
        head, at = drafted.tree, self.runner.index(rows).long()  # the head's chains, the looked-up rows replaced
        tokens = torch.nn.functional.pad(head.tokens, (0, N + 1 - head.num_nodes)).index_copy(0, at, tokens)
        merged = Tree.chains(tokens, head.sizes.index_copy(0, at, sizes))
        return dataclasses.replace(drafted, tree=grammar_prune(seqs, merged), from_context=found)

    @functools.cached_property
    def draft_ids(self) -> torch.Tensor | None:
        """The target id of each draft-vocabulary column (sample_keyed's ids; None: the vocabularies are one)."""
        d2t = self.head.d2t
        return None if d2t is None else torch.arange(d2t.shape[0], device=d2t.device) + d2t

    def _keyed(self, seqs) -> tuple[list[int], list[int], list[float]] | None:
        """draft_chain's `keyed`: per sequence its sampling key, the index of its depth-1 draft's token and the
        draft's temperature (DRAFT_COOLING times the request's; 0: greedy); None when every sequence is greedy."""
        if all(s.params.greedy for s in seqs):
            return None
        return ([0 if s.params.greedy else self.sampler.key(s) for s in seqs], [s.num_tokens for s in seqs],
                [s.params.temperature * DRAFT_COOLING for s in seqs])

    def _chain_in_one_call(self, seqs, depth: int, caps: list[int], weights, formats) -> Tree:
        """_draft_chain's chain, the same bits, from one C++ call (CPU): the pending pairs fed, then the levels
        drafted (eagle_kernels.draft_chain; sampled sequences' drafts keyed draws). A sequence whose pairs are all fed feeds its root pair again (the
        same values rewritten)."""
        head, policy = self.head, self.tree
        starts = [min(s.draft_state.fed, cached_len(s) - 1) for s in seqs]
        counts = [cached_len(s) - f for s, f in zip(seqs, starts)]
        tokens = [t for s, f, n in zip(seqs, starts, counts) for t in s.span(f + 1, f + 1 + n)]
        meta, pos, ids = self.runner.meta(self.plan(seqs, starts, counts), ids=tokens)
        levels = min(depth, policy.verify_tokens - 1)
        with eagle_kernels.unchecked():
            tree = Tree(*eagle_kernels.draft_chain(
                self.features, ids, pos, meta.slot_mapping, meta.block_tables, meta.cu_seqlens_q, meta.prefix_lens,
                [min(levels, c) for c in caps], policy.min_prob, weights, formats, head.d2t, head.cfg.rms_eps,
                head.rotary.cos, head.rotary.sin, list(self.head_layers[0]), head.cfg.num_heads, self._keyed(seqs)))
        for s, start in zip(seqs, starts):
            s.draft_state.fed = cached_len(s)
            self.blocks.mark_side(s.seq_id, start, s.draft_state.fed)
        return tree

    def _chain_fn(self, g):
        return self.head(g.inputs["ids"], g.inputs["hidden"], g.positions, self.head_layers[0], g.meta)

    def _feed_pending(self, seqs, keep: int = 0) -> tuple[float, float]:
        """Feed the unfed pairs of `seqs` in one head forward, all but each sequence's newest `keep`. With
        keep 0 each last pair becomes its root. -> (the seconds it took, their share for the pairs past the
        prompts: what rounds without drafts left, the catch-up an adaptive policy's re-probe brings; a
        prompt's pairs are fed once whatever the policy plays)."""
        todo = [s for s in seqs if s.draft_state.fed < cached_len(s) - keep]
        if not todo:
            return 0.0, 0.0
        t0 = time.perf_counter()
        starts = [s.draft_state.fed for s in todo]
        counts = [cached_len(s) - keep - f for s, f in zip(todo, starts)]
        tokens = [t for s, f, n in zip(todo, starts, counts) for t in s.span(f + 1, f + 1 + n)]
        meta, pos, ids = self.runner.meta(self.plan(todo, starts, counts), ids=tokens)
        hidden = self.head.project(self.features.index_select(0, meta.slot_mapping))        # [T, H]
        out = self.head(ids, hidden, pos, self.head_layers[0], meta)
        end = 0
        for s, n in zip(todo, counts):
            end += n
            s.draft_state.fed += n
            self.blocks.mark_side(s.seq_id, s.draft_state.fed - n, s.draft_state.fed)
            if not keep:  # the last pair is the root
                s.draft_state.root = (hidden[end - 1], out[end - 1])
        seconds = time.perf_counter() - t0
        # pair t = (hidden_t, token_t+1): from t = P - 1 on (P prompt tokens) its token was generated
        past = sum(f + n - max(f, min(f + n, len(s.prompt_ids) - 1)) for s, f, n in zip(todo, starts, counts))
        return seconds, seconds * past / sum(counts)

    def _feed_round(self, seqs) -> tuple[torch.Tensor, torch.Tensor] | None:
        """_feed_pending's feed of the last round's pairs as one fixed-shape step, the StepGraph ("feed", Bp)
        (a CUDA graph replay on a GPU, where the eager feed is a launch-bound head forward): every sequence
        gets K = max_depth + 1 rows (the most one round accepts), its pending pairs first and padding after,
        whose KV lands past its cached tokens where this round's draft writes next. -> the new roots' (input
        hidden, head output) [B, H] each; None (nothing fed) unless every sequence has 1..K pairs pending."""
        K = self.max_depth + 1
        self._feed_pending(seqs, keep=K)  # a backlog longer than a round's (after a prefill): fed eagerly first
        starts = [s.draft_state.fed for s in seqs]
        counts = [cached_len(s) - f for s, f in zip(seqs, starts)]
        if not all(1 <= n <= K for n in counts):
            return None
        B, runner = len(seqs), self.runner
        Bp = runner.batch_rows(B)
        plan = self.plan(seqs, starts, [K] * B).padded(Bp)
        ids = [t for s, f, n in zip(seqs, starts, counts) for t in s.span(f + 1, f + 1 + n) + [0] * (K - n)]
        g = runner.graph(self.graphs, ("feed", Bp), plan, self._feed_fn, {"last": ((Bp,), torch.int64)},
                         host_ids=True)
        hidden, out = g.run(plan, host_ids=ids, last=runner.to_device([b * K + n - 1 for b, n in enumerate(counts)]))
        roots = hidden[:B].clone(), out[:B].clone()                      # the graph's outputs are rewritten
        for b, (s, f, n) in enumerate(zip(seqs, starts, counts)):
            s.draft_state.fed = f + n
            self.blocks.mark_side(s.seq_id, f, f + n)
            s.draft_state.root = (roots[0][b], roots[1][b])
        return roots

    def _feed_fn(self, g):
        hidden = self.head.project(self.features.index_select(0, g.meta.slot_mapping))      # [Bp * K, H]
        out = self.head(g.ids, hidden, g.positions, self.head_layers[0], g.meta)            # [Bp * K, H]
        last = g.inputs["last"]                                                              # [Bp]
        return hidden.index_select(0, last), out.index_select(0, last)

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
        return self._head_over(g.inputs["ids"], g.inputs["hidden"], g.inputs["depths"], g.meta)

    def _head_over(self, ids, hidden, depths, meta):
        """The head over drafted nodes: ids, depths [B, n], hidden [B, n, H] -> out [B * n, H]. The pair of a
        depth-d node sits d positions after the root pair (at L - 1, the plan's start)."""
        rope = meta.prefix_lens[:, None] + depths
        return self.head(ids.flatten(), hidden.flatten(0, 1), rope.flatten(), self.head_layers[0], meta)

    def behind(self, seqs: list[Sequence]) -> int:
        """The pairs _feed_pending's backlog would feed past the prompts (a round feeds its newest max_tree)."""
        return sum(max(0, cached_len(s) - self.max_tree - max(s.draft_state.fed, len(s.prompt_ids) - 1))
                   for s in seqs if s.draft_state is not None)

    def unfed(self, seqs: list[Sequence]) -> int:
        """The prompt pairs (t < P - 1 of a P-token prompt) the head has not read yet."""
        return sum(max(0, len(s.prompt_ids) - 1 - s.draft_state.fed) for s in seqs if s.draft_state is not None)

    def catch_up(self, seqs: list[Sequence], v: Verdict):
        """The accepted rows are in `features` already (verify moved them); the next draft feeds them."""
