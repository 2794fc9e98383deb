"""Decoders: vanilla decoding and the one speculative round every method shares.

A decoder turns the running batch into new tokens per sequence: `prefill(seqs, counts) -> Verdict` (a
chunk of each prompt; the first token where it completes one) and `step(seqs, depth) -> Verdict`, `depth`
being the levels this round may draft (LLM.step picks it: the method's own, or the adaptive policy's; 0 is
a plain decode step). The scheduler has reserved room for
what a step writes and applies the result (appends tokens, cuts each cache back to `cached_len`).
Speculative methods fill in `draft` and `catch_up`; the round is always:

    draft (device) -> verify (device) -> one device-to-host copy -> catch up (draft caches) -> record

On a GPU, draft and verify are each one CUDA graph replay where the method can (EAGLE's trees; greedy
verification), so a round is a few replays and the one copy.

What a decoder keeps per sequence between rounds lives on the sequence (`Sequence.draft_state`), and what
a round decided travels in its return values, never on the decoder.

A method that reads what the target computed per token (EAGLE's head inputs) writes it in the target's
steps themselves (`store`, by cache slot, like KV) and moves it with the accepted KV.

Draft and verify make no host reads: every host value they need (block tables, cached lengths, sampling
parameters) is known before the round, and device inputs arrive through one staged copy per step.
Verification appends the whole tree to the target cache, moves the accepted path's KV to consecutive
positions on the device, and leaves the truncation to the scheduler.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field

import torch

import eagle_kernels
from eagle_kernels import argmax
from .model_runner import ModelRunner, StepPlan
from .sampler import Sampler
from .scheduler import Sequence, TokenLogprob, cached_len
from .trees import Tree


class Decoder:
    """What vanilla and speculative decoders share: the runner, the sampler, the scheduler's block tables."""
    lookahead = 1  # cache positions a step may write past the cached tokens
    held = 0       # of those, the positions whose KV a decoder's own cache keeps between steps
    max_depth = 0  # the levels a round drafts unless a policy picks fewer (0: never drafts)
    adaptive = False  # an adaptive policy (engine/adaptive.py) picks each round's depth, 0 .. max_depth
    capture = ()   # target layers whose inputs a step hands to `store` ...
    capture_into = None  # ... or writes to this [slots, len(capture) * H] store, by slot, in the forward
    mixes = True   # a depth-0 round may carry a prefill chunk in its forward (step's `chunk`)

    def __init__(self, runner: ModelRunner, sampler: Sampler, blocks):
        self.runner, self.sampler, self.blocks = runner, sampler, blocks
        self.model = runner.model
        self.graphs: dict[tuple, object] = {}  # this decoder's fixed-shape steps (model_runner.StepGraph)

    def plan(self, seqs: list[Sequence], starts: list[int], counts: list[int]) -> StepPlan:
        return StepPlan([self.blocks.block_table(s.seq_id) for s in seqs], starts, counts)

    def store(self, slots: torch.Tensor, feature: torch.Tensor, captured: list[torch.Tensor]):
        """What a method keeps of every target step, per token: slots int64 [T] (padded rows: the scratch
        block), feature [T, H], the `capture` layers' inputs [T, H] each. Runs inside the step's graph."""

    def prefill_target(self, seqs: list[Sequence], counts: list[int], lead: list[Sequence] = ()) -> "Verdict":
        """The target over counts[b] more prompt tokens of each sequence (after its prefilled ones, a cached
        prefix included) -> the first token of each sequence whose prompt this completes ([] for the others),
        and the prompt logprobs of the chunk's tokens for those asking.
        With `lead` sequences (a decode step's, in the same forward: a row each at its last token, before the
        prompts' rows, and one sampler pass over theirs and the completed prompts' rows) -> the lead's decode
        Verdict, the chunk's as its `prefill`."""
        B, starts = len(lead), [s.prefilled for s in seqs]
        ids = [s.last_id for s in lead] + [t for s, a, n in zip(seqs, starts, counts) for t in s.prompt_ids[a:a + n]]
        plan = self.plan([*lead, *seqs], [cached_len(s) for s in lead] + starts, [1] * B + counts)
        meta, pos, ids = self.runner.meta(plan, ids=ids)
        feature, captured = self.model(ids, pos, self.runner.layers, meta, self.capture, self.capture_into)
        self.store(meta.slot_mapping, feature, captured)
        ends = [B]
        for n in counts:
            ends.append(ends[-1] + n)
        done = [b for b, (s, a, n) in enumerate(zip(seqs, starts, counts)) if a + n == len(s.prompt_ids)]
        verdict = Verdict([[] for _ in seqs])
        picked = [*lead, *(seqs[b] for b in done)]
        if picked:
            rows = self.runner.index(list(range(B)) + [ends[b + 1] - 1 for b in done])
            first = self.sampled(picked, self.sampler.adjust(self.model.logits(feature.index_select(0, rows)), picked))
            verdict.logprobs = None if first.logprobs is None else [None] * len(seqs)
            for i, b in enumerate(done, B):
                verdict.new_tokens[b] = first.new_tokens[i]
                if first.logprobs is not None:
                    verdict.logprobs[b] = first.logprobs[i]
        if any(s.params.prompt_logprobs is not None for s in seqs):
            verdict.prompt_logprobs = self.prompt_logprobs(seqs, feature[B:], starts, counts)
        if not lead:
            return verdict
        return Verdict(first.new_tokens[:B], logprobs=first.logprobs and first.logprobs[:B], prefill=verdict)

    def prompt_logprobs(self, seqs: list[Sequence], feature: torch.Tensor, starts: list[int], counts: list[int],
                        chunk: int = 256):
        """Per sequence asking (params.prompt_logprobs): the TokenLogprobs of the prompt tokens this prefill
        predicts (the row of position p predicts token p + 1; the prompt's first token gets None) under the
        request's temperature / top-k / top-p (no penalties: those are about the output), from the prefill's
        features [T, H] (sequence b's counts[b] rows from prompt position starts[b]); the logits go chunk
        rows at a time. None for the others."""
        out, row0 = [], 0
        for s, a, count in zip(seqs, starts, counts):
            k, n = s.params.prompt_logprobs, len(s.prompt_ids)
            rows, row0 = [], row0 + count
            if k is None:
                out.append(None)
                continue
            top = row0 - count  # sequence s's first row
            for p in range(a, min(a + count, n - 1), chunk):
                q = min(p + chunk, a + count, n - 1)
                logits = self.model.logits(feature[top + p - a:top + q - a])
                rows += self.sampler.logprobs(logits, [s.params] * (q - p), self.runner.to_device(s.prompt_ids[p + 1:q + 1]),
                                              k).tolist()
            out.append([None] * (a == 0) + [(r[0], [(int(t), v) for t, v in zip(r[1:1 + k], r[1 + k:])]) for r in rows])
        return out

    def admit(self, seqs: list[Sequence]):
        """Sequences whose prompts start prefilling (a method's own state per sequence)."""

    def decode(self, seqs: list[Sequence], chunk: "Chunk | None" = None) -> "Verdict":
        """One target forward over each sequence's last token. -> next tokens. With a prefill `chunk`, its
        prompt tokens go in the same forward (prefill_target: the chunk's verdict is the result's `prefill`)."""
        if chunk:
            self.admit(chunk.seqs)
            return self.prefill_target(chunk.seqs, chunk.counts, lead=seqs)
        B = len(seqs)
        Bp = self.runner.batch_rows(B)
        plan = self.plan(seqs, [cached_len(s) for s in seqs], [1] * B).padded(Bp)
        if self.direct(seqs):  # the step's tokens straight from the model (Llama.tokens)
            keyed = self.keyed_inputs(seqs)
            g = self.runner.graph(self.graphs, ("decode_tokens", Bp, bool(keyed)), plan, self._decode_tokens,
                                  {k: ((Bp,), t.dtype) for k, t in keyed.items()}, host_ids=True)
            return Verdict.decoded(g.run(plan, host_ids=[s.last_id for s in seqs], **keyed)[:B].tolist())
        g = self.runner.graph(self.graphs, ("decode", Bp), plan, self._decode, {}, host_ids=True)
        logits = g.run(plan, host_ids=[s.last_id for s in seqs])
        return self.sampled(seqs, self.sampler.adjust(logits if Bp == B else logits[:B], seqs))

    def direct(self, seqs: list[Sequence]) -> bool:
        """Whether a step's tokens come straight from the target's raw logits for every sequence (Llama.tokens:
        the argmax, or a keyed draw at a temperature alone): no top-k / top-p, no logprobs asked, nothing that
        adjusts the logits (then no step needs them all)."""
        return (all(s.params.logprobs is None and (s.params.greedy or not s.params.truncates) for s in seqs)
                and not self.sampler.transforms(seqs))

    def keyed_inputs(self, seqs: list[Sequence]) -> dict[str, torch.Tensor]:
        """A direct step's keyed-draw inputs (Sampler.keyed: "temperatures", "seeds", "positions" [B] for the
        sequences' next tokens), or {} when every sequence is greedy (the step takes argmaxes)."""
        if all(s.params.greedy for s in seqs):
            return {}
        return dict(zip(("temperatures", "seeds", "positions"), self.sampler.keyed(seqs)))

    def sampled(self, seqs: list[Sequence], logits: torch.Tensor) -> "Verdict":
        """A token per sequence drawn from logits [B, V] (and its logprobs, where asked), copied to the host."""
        tokens = self.sampler.draw(logits, seqs)
        if all(s.params.logprobs is None for s in seqs):
            return Verdict.decoded(tokens.tolist())
        logprobs = self.logprob_rows(seqs, logits[:, None], tokens[:, None])
        return Verdict.decoded(tokens.tolist(), read_logprobs(seqs, logprobs, [1] * len(seqs)))

    def logprob_rows(self, seqs: list[Sequence], logits: torch.Tensor, tokens: torch.Tensor):
        """Sampler.logprobs of tokens int64 [B, n] under logits [B, n, V] for the sequences that ask (params.
        logprobs), on the device: fp32 [B', n, 1 + 2k] (B' asking rows, k the most alternatives asked), or None
        when none asks."""
        asked = [b for b, s in enumerate(seqs) if s.params.logprobs is not None]
        if not asked:
            return None
        B, n = tokens.shape
        rows = self.runner.index(asked).long()
        out = self.sampler.logprobs(logits.index_select(0, rows).flatten(0, 1),
                                    [seqs[b].params for b in asked for _ in range(n)],
                                    tokens.index_select(0, rows).flatten(), max(seqs[b].params.logprobs for b in asked))
        return out.view(len(asked), n, -1)

    def _decode(self, g, tokens: bool = False):
        feature, captured = self.model(g.ids, g.positions, self.runner.layers, g.meta, self.capture,
                                       self.capture_into)
        self.store(g.meta.slot_mapping, feature, captured)
        if not tokens:
            return self.model.logits(feature)
        keyed = tuple(g.inputs[k] for k in ("temperatures", "seeds", "positions")) if g.inputs else None
        return self.model.tokens(feature, keyed)

    def _decode_tokens(self, g):
        return self._decode(g, tokens=True)

    def stats(self) -> dict:
        return {}


class VanillaDecoder(Decoder):
    """One target forward per token; the reference every speculative method must match."""

    def prefill(self, seqs: list[Sequence], counts: list[int]) -> "Verdict":
        return self.prefill_target(seqs, counts)

    def step(self, seqs: list[Sequence], depth: int = 0, chunk: "Chunk | None" = None) -> "Verdict":
        return self.decode(seqs, chunk)


@dataclass
class Draft:
    """A round's proposal: trees on the device, rooted at each sequence's last token."""
    tree: Tree
    depth: int                        # levels drafted (a confidence cut may stop short of the round's depth)
    probs: torch.Tensor | None = None  # fp32 [B, N, V]: the q that drew each node (sampled chains), else None
    backlog_s: float = 0.0            # seconds spent feeding the draft what earlier steps left it
    catch_up_s: float = 0.0           # of them, for the pairs rounds without drafts left (not the prompt's)
    looked_up: bool = False           # every chain read from the context (engine.lookup): no model drafted
    from_context: int = 0             # sequences whose chains were read from the context


@dataclass
class Chunk:
    """A step's prefill: counts[b] more prompt tokens of seqs[b]."""
    seqs: list[Sequence]
    counts: list[int]


@dataclass
class Verdict:
    """A round's outcome on the host (one copy)."""
    new_tokens: list[list[int]]    # per sequence: the accepted drafts + the bonus / corrected token
    depth: int = 0                 # levels drafted (0: a plain decode step)
    backlog_s: float = 0.0         # of the round's time, feeding the draft what earlier steps left it
    catch_up_s: float = 0.0        # of that, for the pairs rounds without drafts left (Draft.catch_up_s)
    logprobs: list[list[TokenLogprob] | None] | None = None  # per sequence asking: one per new token
    prompt_logprobs: list | None = None  # prefill: per sequence asking, its chunk's Sequence.prompt_logprobs
    prefill: "Verdict | None" = None     # a round that carried a prefill chunk: the chunk's verdict
    looked_up: bool = False              # its drafts read from the context (Draft.looked_up)
    from_context: int = 0                # Draft.from_context

    @property
    def lengths(self) -> list[int]:
        """Accepted drafts per sequence."""
        return [len(t) - 1 for t in self.new_tokens]

    @classmethod
    def decoded(cls, tokens: list[int], logprobs=None) -> "Verdict":
        """A plain decode step's as a verdict: only the root, and its next token."""
        return cls([[t] for t in tokens], logprobs=logprobs)


class SpeculativeDecoder(Decoder):
    """The draft -> verify -> catch up round; a method implements `draft` and `catch_up`.

    `draft(seqs, depth, caps) -> Draft`: trees of up to `depth` levels (depth >= 1), sequence b's no deeper
    than caps[b] (depth_caps).
    `catch_up(seqs, verdict)`: bring the draft's own state up to the accepted tokens."""
    causal = False    # drafts are chains: causal masking is the ancestor mask
    max_tree = 0      # the most tokens a round verifies per sequence (the random draws a round takes)
    fused = True      # draft and verify each as one step where they can; False: the step-by-step references

    def __init__(self, runner: ModelRunner, sampler: Sampler, blocks, timing: bool = False):
        super().__init__(runner, sampler, blocks)
        self._stats = SpecStats()
        self.timing = timing

    def step(self, seqs: list[Sequence], depth: int = 0, chunk: Chunk | None = None) -> Verdict:
        caps = depth_caps(seqs, self.model.cfg.max_position)
        depth = round_depth(depth, caps)
        if chunk and depth:
            raise ValueError("a prefill chunk rides only on a round that drafts nothing")
        with self.timer("draft_s"):
            draft = None if chunk else self.look_up(seqs, depth, caps)
            if draft is None and depth:
                draft = self.draft(seqs, depth, caps)
        with self.timer("verify_s"):
            if draft is None:
                verdict = self.decode(seqs, chunk)
            else:
                verdict = self.read(seqs, *self.verify(seqs, draft.tree, draft.probs), draft)
        with self.timer("draft_s"):
            self.catch_up(seqs, verdict)
        self._stats.record(verdict.lengths, verdict.depth, verdict.looked_up, verdict.from_context)
        return verdict

    def draft(self, seqs: list[Sequence], depth: int, caps: list[int]) -> Draft:
        raise NotImplementedError

    def look_up(self, seqs: list[Sequence], depth: int, caps: list[int]) -> Draft | None:
        """The round's draft where the context supplies chains (depth 0 included; a decoder may draft the
        sequences it finds none for), or None: the round drafts as `depth` says."""
        return None

    def verify_widths(self) -> list[int]:
        """Tokens verified per sequence when a round drafts d = 0 .. max_depth levels (an adaptive policy's
        cost model)."""
        raise NotImplementedError

    def catch_up(self, seqs: list[Sequence], verdict: Verdict):
        raise NotImplementedError

    def behind(self, seqs: list[Sequence]) -> int:
        """Pairs past the prompts the draft would catch up on before drafting (Draft.catch_up_s's): none where
        it keeps up every round."""
        return 0

    def unfed(self, seqs: list[Sequence]) -> int:
        """Prompt pairs a drafting round would feed the draft first (a request's first drafting round): none
        for a draft that reads no prompt."""
        return 0

    def verify(self, seqs: list[Sequence], tree: Tree, draft_probs=None) -> torch.Tensor:
        """Run the target once over every tree (root + drafts), accept the longest lossless path and move
        its KV (and what `store` keeps) to consecutive positions. Device only. -> summary int64 [B, 2N + 2]
        (accepted length, next token, path, tokens on it), and the new tokens' logprob_rows (or None).

        A batch whose tokens come straight from the model (Decoder.direct: greedy rows, rows sampled at a
        temperature alone) is verified in one fixed-shape step (_verify_direct: a graph replay on a GPU). Otherwise the target forward is a step of its own and the
        rest runs eagerly after it: the transforms and sampled rows plan on the host (their parameters, the
        rows that ask), and logprobs need the logits out of the step."""
        if self.fused and self.direct(seqs):
            return self._verify_direct(seqs, tree), None
        B, N = tree.tokens.shape
        plan = self.plan(seqs, [cached_len(s) for s in seqs], [N] * B)
        Bp = self.runner.batch_rows(B)
        W = (N + 31) // 32
        inputs = {"ids": ((Bp, N), torch.int64), "depths": ((Bp, N), torch.int32)}
        if not self.causal:
            inputs["tree_mask"] = ((Bp * N, W), torch.int32)
        g = self.runner.graph(self.graphs, ("verify", Bp, N), plan.padded(Bp), self._verify_fn, inputs)
        given = {"ids": tree.tokens, "depths": tree.depths}
        if not self.causal:
            given["tree_mask"] = tree.mask()
        logits = g.run(plan.padded(Bp), **given)
        logits = self.sampler.adjust(logits.view(Bp, N, -1)[:B], seqs, tree)             # [B, N, V]
        path, length, nxt = self.accept(seqs, tree, logits, draft_probs)
        if not self.causal:  # a chain's accepted path is its prefix, already in place
            self.keep_path(g.meta.slot_mapping.view(Bp, N)[:B], path)
        summary = eagle_kernels.verdict_summary(tree.tokens, path, length, nxt)
        logprobs = None
        if any(s.params.logprobs is not None for s in seqs):
            # new token j is predicted at path node j: the next accepted draft, or at j = length the bonus
            on_path = summary[:, N + 2:]
            new = torch.cat([on_path[:, 1:], on_path[:, :1]], 1).scatter(1, length[:, None].long(), nxt[:, None])
            at = path.clamp(min=0).long()[..., None].expand(-1, -1, logits.shape[-1])
            logprobs = self.logprob_rows(seqs, logits.gather(1, at), new)
        return summary, logprobs

    def _verify_direct(self, seqs: list[Sequence], tree: Tree) -> torch.Tensor:
        """verify's direct case as one step, the StepGraph ("verify_direct", Bp, N, keyed): target forward,
        tree mask, the target's token at every node (its argmax, or its keyed draw at the node's position),
        acceptance, KV move and summary over the static trees (rows no tree fills: one-node trees).
        -> summary int64 [B, 2N + 2]."""
        B, N = tree.tokens.shape
        Bp = self.runner.batch_rows(B)
        plan = self.plan(seqs, [cached_len(s) for s in seqs], [N] * B).padded(Bp)
        keyed = self.keyed_inputs(seqs)  # positions: the roots' next tokens', num_tokens
        g = self.runner.graph(self.graphs, ("verify_direct", Bp, N, bool(keyed)), plan, self._verify_direct_fn, {
            "ids": ((Bp, N), torch.int64), "depths": ((Bp, N), torch.int32),
            "parents": ((Bp, N), torch.int32, -1), "sizes": ((Bp,), torch.int32, 1),
            **{k: ((Bp,), t.dtype) for k, t in keyed.items()}})
        summary = g.run(plan, ids=tree.tokens, depths=tree.depths, parents=tree.parents, sizes=tree.sizes, **keyed)
        return summary if Bp == B else summary[:B]

    def _verify_direct_fn(self, g):
        ids, parents, sizes = g.inputs["ids"], g.inputs["parents"], g.inputs["sizes"]
        Bp, N = ids.shape
        tree = Tree(ids, parents, g.inputs["depths"], None, sizes)
        meta = g.meta if self.causal else dataclasses.replace(g.meta, tree_mask=tree.mask())
        keyed = None
        if "seeds" in g.inputs:  # node j of row b draws the token at num_tokens + depth
            temps, seeds, firsts = (g.inputs[k] for k in ("temperatures", "seeds", "positions"))
            keyed = (temps[:, None].expand(Bp, N).reshape(-1), seeds[:, None].expand(Bp, N).reshape(-1),
                     (firsts[:, None] + tree.depths).reshape(-1))
        target = self._target_over(ids, tree.depths, meta, tokens=True, keyed=keyed).view(Bp, N)     # [Bp, N]
        summary = eagle_kernels.greedy_verdict(parents, ids, sizes, target)                 # [Bp, 2N + 2]
        if not self.causal:
            self.keep_path(meta.slot_mapping.view(Bp, N), summary[:, 2:N + 2])
        return summary

    def _verify_fn(self, g):
        return self._target_over(g.inputs["ids"], g.inputs["depths"], g.meta)

    def _target_over(self, ids, depths, meta, tokens: bool = False, keyed=None):
        """The target over the trees ids, depths [B, N] (what `store` keeps written) -> logits [B * N, V] (tokens:
        Llama.tokens of them, [B * N], with `keyed`)."""
        rope = meta.prefix_lens[:, None] + depths                                           # [B, N]
        feature, captured = self.model(ids.flatten(), rope.flatten(), self.runner.layers, meta,
                                       self.capture, self.capture_into)
        self.store(meta.slot_mapping, feature, captured)
        return self.model.tokens(feature, keyed) if tokens else self.model.logits(feature)

    def accept(self, seqs, tree: Tree, logits, draft_probs):
        """Greedy rows accept while the draft equals the target's argmax. Sampled rows whose drafts are the
        draft's choices (draft_probs None) accept while the draft equals the target's own keyed draw at each
        node (Sampler.draw: the token vanilla sampling draws there), so they output what vanilla outputs; drafts
        drawn from draft distributions (draft_probs) go through tree rejection sampling.
        -> accept_path int32 [B, N], accept_len int32 [B], next_token int64 [B]."""
        args = (tree.parents, tree.tokens, tree.sizes)
        sampled = [b for b, s in enumerate(seqs) if not s.params.greedy]
        if draft_probs is None or not sampled:  # the target's token at every node: greedy or keyed, as vanilla's
            return eagle_kernels.tree_accept_greedy(*args, self.sampler.draw(logits, seqs, tree.depths.long()))
        rows = self.runner.index(sampled)
        N = tree.tokens.shape[1]
        probs = self.sampler.probs(logits.index_select(0, rows), [seqs[b].params for b in sampled])
        picked = [seqs[b] for b in sampled]
        path, length, nxt = eagle_kernels.tree_accept_greedy(*args, argmax(logits))
        # A fixed count a round (the widest tree's), whatever this round's width: a request's stream of
        # draws does not depend on the trees its companions made the round build.
        uniforms = self.sampler.uniforms(picked, (max(N, self.max_tree) + 1,))[:, :N + 1]
        q = draft_probs.index_select(0, rows)
        out = eagle_kernels.tree_accept_sample(*(a.index_select(0, rows) for a in args), probs, uniforms, q)
        return tuple(t.index_copy(0, rows.long(), o) for t, o in zip((path, length, nxt), out))

    def keep_path(self, slots: torch.Tensor, path: torch.Tensor):
        """Copy the KV of accepted node path[b, j] (at slots[b, path[b, j]]) to slots[b, j], every layer at
        once; rejected positions copy onto themselves. slots: int64 [B, N]; path: int32 or int64 [B, N], -1 padded."""
        src = torch.where(path >= 0, slots.gather(1, path.clamp(min=0).long()), slots).flatten()
        self.move_slots(slots.flatten(), src)

    def move_slots(self, dst: torch.Tensor, src: torch.Tensor):
        """Per-slot state: the target's KV at slots src -> slots dst (int64 [n] each)."""
        kv = self.runner.kv.flatten(0, 1).flatten(1, 2)                     # [layers * 2, slots, Hkv, D]
        kv.index_copy_(1, dst, kv.index_select(1, src))

    def read(self, seqs: list[Sequence], summary: torch.Tensor, logprobs, draft: Draft) -> Verdict:
        """The round's device-to-host copy: verify's summary -> each sequence's accepted tokens (and the
        logprobs of those asking)."""
        host = summary.tolist()
        N = (summary.shape[1] - 2) // 2
        new = [row[3 + N:3 + N + row[0]] + [row[1]] for row in host]
        return Verdict(new, draft.depth, draft.backlog_s, draft.catch_up_s,
                       read_logprobs(seqs, logprobs, [len(t) for t in new]), looked_up=draft.looked_up,
                       from_context=draft.from_context)

    def timer(self, attr: str):
        return Timer(self._stats, attr, self.runner.device) if self.timing else _UNTIMED

    def stats(self) -> dict:
        """Counters since the last call (LLM.generate calls this once per run)."""
        out, self._stats = self._stats.as_dict(), SpecStats()
        return out


@dataclass
class SpecStats:
    """Per-run counters: rounds are (sequence, verify) pairs; depth d is reached when >= d drafts pass;
    depth_hist[d] counts the rounds that drafted d levels (0: plain decode steps), looked_up the rounds whose
    drafts were all read from the context instead (engine.lookup), from_context the sequence-rounds whose
    chain was (in those rounds, and beside the head's chains in a drafting round)."""
    rounds: int = 0
    reached: list[int] = field(default_factory=list)
    depth_hist: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    looked_up: int = 0
    from_context: int = 0
    events: list = field(default_factory=list)  # (attr, start, end) CUDA events, resolved in as_dict

    def record(self, lengths: list[int], depth: int, looked_up: bool = False, from_context: int = 0):
        self.from_context += from_context
        if looked_up:
            self.looked_up += 1
        else:
            self.depth_hist += [0] * (depth + 1 - len(self.depth_hist))
            self.depth_hist[depth] += 1
        self.rounds += len(lengths)
        for n in lengths:
            if n > len(self.reached):
                self.reached += [0] * (n - len(self.reached))
            for d in range(n):
                self.reached[d] += 1

    def as_dict(self) -> dict:
        for attr, start, end in self.events:
            end.synchronize()
            setattr(self, attr, getattr(self, attr) + start.elapsed_time(end) / 1000)
        n = max(self.rounds, 1)
        return {"tau": round(1 + sum(self.reached) / n, 3), "rounds": self.rounds,
                "accept_by_depth": [round(r / n, 3) for r in self.reached], "depth_hist": self.depth_hist,
                "looked_up": self.looked_up, "from_context": self.from_context,
                "draft_s": round(self.draft_s, 4), "verify_s": round(self.verify_s, 4)}


class Timer:
    """Adds a `with` block's time to stats.<attr>: wall time on the CPU, CUDA events (read after the run,
    never synchronising a round) on a GPU."""

    def __init__(self, stats: SpecStats, attr: str, device: torch.device):
        self.stats, self.attr = stats, attr
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.stats.events.append((self.attr, self.start, end))
        else:
            setattr(self.stats, self.attr, getattr(self.stats, self.attr) + time.perf_counter() - self.t0)


_UNTIMED = contextlib.nullcontext()


def read_logprobs(seqs: list[Sequence], rows: torch.Tensor | None, counts: list[int]):
    """Decoder.logprob_rows on the host: per sequence, None or its first counts[b] tokens' TokenLogprobs,
    with the alternatives it asked for."""
    if rows is None:
        return None
    host, out = iter(rows.tolist()), []
    K = (rows.shape[-1] - 1) // 2
    for s, n in zip(seqs, counts):
        k = s.params.logprobs
        out.append(None if k is None else
                   [(r[0], [(int(t), v) for t, v in zip(r[1:1 + k], r[1 + K:1 + K + k])]) for r in next(host)[:n]])
    return out


def round_depth(depth: int, caps: list[int]) -> int:
    """The levels a round drafts: `depth`, but none that no sequence may use. A round that drafts at all
    drafts a level even when every cap is 0: a capped sequence verifies its root alone, as it would beside
    others (the same random draws, whatever its companions)."""
    return min(depth, max(1, max(caps))) if depth else 0


def depth_caps(seqs: list[Sequence], max_position: int) -> list[int]:
    """The deepest draft worth verifying per sequence: a round yields at most depth + 1 tokens, and tree
    positions (the root's + depth) must stay inside the model's context."""
    return [max(0, min(s.params.max_new_tokens - len(s.output_ids) - 1, max_position - s.num_tokens))
            for s in seqs]

