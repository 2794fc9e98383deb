"""The engine's front door: load a model, take prompts, run the generate loop with a decoding method.

A decoding method ("decoder", engine/decoding.py) turns the running batch into new tokens per sequence:
vanilla yields one token per step, speculative methods 1 + accepted drafts. The scheduler owns admission,
the KV blocks, stop conditions and freeing. `step` runs one round: it picks the round's draft depth (the
method's, or an adaptive policy's from the rounds it has timed), has the decoder run it, and applies the
verdict.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .adaptive import PrefillPacer, SpeculationPolicy
from .decoding import Chunk, Verdict, depth_caps, round_depth
from .device import CUDA_KV_SHARE, defaults, resolve_device
from .grammar import Grammars
from .loader import DEFAULT_MODEL, default_weights, load_model, load_tokenizer
from .methods import METHODS, draft_elements_per_token
from .model import Llama
from .model_runner import ModelRunner, StepPlan
from .sampler import Sampler
from .scheduler import SamplingParams, Scheduler, Sequence, new_seq_id

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class RunStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0   # of the prompt tokens, those the prefix cache held
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    steps: int = 0
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "new_tokens": self.new_tokens,
                "prefill_s": round(self.prefill_s, 4), "decode_s": round(self.decode_s, 4),
                "prefill_tok_s": round(self.prompt_tokens / max(self.prefill_s, 1e-9), 1),
                "decode_tok_s": round(self.new_tokens / max(self.decode_s, 1e-9), 1),
                "steps": self.steps, **self.extra}


@dataclass
class Round:
    """What one LLM.step did."""
    finished: list[Sequence]   # sequences that finished in it (retired)
    depth: int = 0             # levels its decoding round drafted (0: a plain decode step, or none)
    from_context: int = 0      # of its sequences, those whose drafts were read from the context (lookup)
    lengths: list[int] = field(default_factory=list)  # tokens each decoded sequence kept (none: no decoding)
    decode_s: float = 0.0      # the decoding round's seconds
    prefilled: int = 0         # prompt tokens it prefilled


class LLM:
    """model: a name or path (engine.loader), or an engine Llama already on the device in `dtype` (random
    weights for benchmarks, tests; no tokenizer then); device: "auto" (cuda when a GPU is visible), "cpu" or
    "cuda"; dtype, kv_cache_gb and cuda_graphs default to the device's (engine/device.py); weights:
    engine.loader.WEIGHTS (None: dense for float32, else auto: a GGUF's blocks stay quantized on the CPU);
    prefix_cache: reuse the KV of prompt prefixes earlier requests computed (engine/block_manager.py);
    prefill_chunk: the most prompt tokens a step prefills (None: the device's default; 0: every admitted prompt
    whole in one step, unpaced); on a CPU, while streams decode, fewer: as many as take about the decoding
    round's time (adaptive.PrefillPacer)."""

    def __init__(self, model: str | Llama = DEFAULT_MODEL, dtype: str | None = None, device: str = "auto",
                 kv_cache_gb: float | None = None, block_size: int = 16, max_batch: int = 16, seed: int = 0,
                 method: str = "vanilla", method_args: dict | None = None, threads: int | None = None,
                 cuda_graphs: bool | None = None, timing: bool = False, weights: str | None = None,
                 prefix_cache: bool = True, prefill_chunk: int | None = None):
        self.device = resolve_device(device)
        preset = defaults(self.device)
        dtype = dtype or preset.dtype
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
        if prefill_chunk is not None and prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0, got {prefill_chunk}")
        if threads:
            torch.set_num_threads(threads)
        if isinstance(model, Llama):
            self.model, self.cfg, self.source, self.tokenizer = model, model.cfg, None, None
        else:
            weights = weights or default_weights(dtype)
            self.model, self.cfg, self.source = load_model(model, DTYPES[dtype], str(self.device), weights)
            self.tokenizer = load_tokenizer(self.source)
        gb = kv_cache_gb if kv_cache_gb is not None else preset.kv_cache_gb
        if gb is None:  # a share of what the weights left free
            gb = CUDA_KV_SHARE * torch.cuda.mem_get_info(self.device)[0] / 2**30
        num_blocks = ModelRunner.blocks_for_budget(self.cfg, DTYPES[dtype], block_size, gb,
                                                   draft_elements_per_token(method, self.cfg))
        self.runner = ModelRunner(self.model, self.cfg, DTYPES[dtype], self.device, num_blocks, block_size,
                                  self.cfg.max_position,
                                  preset.cuda_graphs if cuda_graphs is None else cuda_graphs)
        eos = set(self.cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.sampler = Sampler(seed, self.device, self.runner, tuple(sorted(eos)))
        self.grammars = None if self.tokenizer is None else \
            Grammars(self.tokenizer, self.cfg.vocab_size, tuple(sorted(eos)))
        self.scheduler = Scheduler(num_blocks, block_size, max_batch, self.cfg.max_position, tuple(eos),
                                   vocab_size=self.cfg.vocab_size, prefix_cache=prefix_cache,
                                   grammars=self.grammars)
        prefill_chunk = preset.prefill_chunk if prefill_chunk is None else prefill_chunk
        self.pacer = PrefillPacer(prefill_chunk or None, preset.prefill_share if prefill_chunk else None)
        self.timing = timing
        self.policies = {}  # adaptive policies (engine/adaptive.py) by method arguments, kept across set_method
        self.policy: SpeculationPolicy | None = None  # the current decoder's, when it is adaptive
        self.set_method(method, method_args)

    def set_method(self, method: str, method_args: dict | None = None):
        """Switch the decoding method (the scheduler must be idle). An adaptive policy's measurements carry over
        to the next decoder with the same head and tree."""
        if method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
        self.method_args = method_args or {}
        decoder, policy = METHODS[method](self), None
        if decoder.adaptive:  # one per head and tree (whatever asked for adaptivity)
            args = sorted((k, v) for k, v in self.method_args.items() if k != "adaptive")
            policy = self.policies.setdefault((decoder.head.kind, repr(args)),
                                              SpeculationPolicy(decoder.verify_widths()))
        return self.use(decoder, policy)

    def use(self, decoder, policy: SpeculationPolicy | None = None):
        """Make a decoder set_method built (with its policy, if adaptive) the current one; the scheduler must
        be idle. Benchmarks alternate methods on one loaded target this way."""
        self.decoder, self.policy = decoder, policy
        self.scheduler.lookahead, self.scheduler.held = decoder.lookahead, decoder.held
        # A cached block holds the target's KV and what the decoder that computed it keeps per slot beside
        # it (EAGLE's head inputs): another decoder has not written those.
        self.scheduler.blocks.drop_cache()
        return decoder

    def chat_ids(self, prompt: str | list[dict], raw: bool = False) -> list[int]:
        """A user message, or a list of {"role", "content"} messages, through the model's chat template
        (or the raw text with `raw`)."""
        if raw:
            return self.tokenizer.encode(prompt)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 on_tokens: Callable[[Sequence, list[int]], None] | None = None) -> tuple[list[Sequence], RunStats]:
        """Token-id prompts -> finished sequences (in prompt order) and aggregate stats."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [Sequence(list(p), sp) for p, sp in zip(prompts, params)]
        stats = RunStats()
        try:
            for seq in seqs:
                self.scheduler.add(seq)
            while self.has_work:
                self.step(stats, on_tokens)
        except BaseException:
            self.abort_all()
            raise
        stats.extra.update(self.decoder.stats())
        return seqs, stats

    def reseed(self, seed: int):
        """Restart the engine's random stream, which keys the draws of requests without a seed of their own:
        the same requests, admitted in the same order, then draw the same tokens again."""
        self.sampler.reseed(seed)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @torch.inference_mode()
    def step(self, stats: RunStats, on_tokens: Callable[[Sequence, list[int]], None] | None = None) -> Round:
        """One round: a decoding round of the sequences whose prompts are in, and the next chunk of the prompts
        still prefilling (admitted ones first join them). A round that drafts nothing carries the chunk in its
        own forward (a mixed step; not with CUDA graphs, whose decode steps are fixed), but for one step in
        PrefillPacer.REFRESH, whose chunk runs apart just before it (both timed alone, and the streams still
        get their tokens at the step's end); otherwise the chunk runs in a forward of its own after the round.
        `on_tokens(seq, kept)` sees each sequence's new tokens before finished ones retire (it may finish a
        sequence itself, e.g. on a stop string)."""
        done = Round([])
        batch = self.scheduler.decoding()
        mixing = False
        if batch:
            self.scheduler.prepare(batch)
            planned, facts = self.decoder.max_depth, None
            if self.policy:
                facts = (self.decoder.behind(batch), sum(len(s.output_ids) == 1 for s in batch),  # their first round
                         self.decoder.unfed(batch),
                         sum(s.params.max_new_tokens - len(s.output_ids) for s in batch) / len(batch))
                planned = self.policy.choose(len(batch), *facts)
            mixing = not planned and self.decoder.mixes and not self.runner.cuda_graphs
            chunk = self._chunk(stats, self.pacer.round_s, len(batch)) if mixing else None
            if chunk and not self.pacer.mix():
                done.prefilled = self._prefill(chunk, stats, on_tokens)
                chunk = None
            t0 = time.perf_counter()
            built = len(self.decoder.graphs)
            verdict = self.decoder.step(batch, planned, chunk)
            seconds = time.perf_counter() - t0
            done.decode_s = self.pacer.observe_round(seconds, sum(chunk.counts) if chunk else 0)
            if self.policy:
                # A round that built a step shape is no sample: graph capture and compilation on a GPU,
                # first-use allocations and the head's fused weights on a CPU (~1.5x a steady round, enough
                # to rule a depth out); nor is one that carried a prefill chunk.
                sample = None if chunk or len(self.decoder.graphs) > built else seconds
                self._observe(batch, planned, verdict, sample, facts[0], facts[2])
            stats.decode_s += done.decode_s
            stats.prefill_s += seconds - done.decode_s
            stats.steps += 1
            done.depth, done.from_context = verdict.depth, verdict.from_context
            done.lengths = self._commit(batch, verdict, stats, on_tokens)
            if chunk:
                self._prefilled(chunk, verdict.prefill, stats, on_tokens)
                done.prefilled = sum(chunk.counts)
            done.finished = self.scheduler.retire_finished()  # their room goes to the admission below
        if not mixing:
            chunk = self._chunk(stats, done.decode_s, len(batch))
            if chunk:
                done.prefilled = self._prefill(chunk, stats, on_tokens)
        done.finished += self.scheduler.retire_finished()
        return done

    def _prefill(self, chunk: Chunk, stats: RunStats, on_tokens: Callable[[Sequence, list[int]], None] | None) -> int:
        """Run a prefill chunk in a forward of its own (the pacer times it). -> its prompt tokens."""
        t0 = time.perf_counter()
        verdict = self.decoder.prefill(chunk.seqs, chunk.counts)
        seconds = time.perf_counter() - t0
        self.pacer.observe(sum(chunk.counts), seconds)
        stats.prefill_s += seconds
        self._prefilled(chunk, verdict, stats, on_tokens)
        return sum(chunk.counts)

    def _chunk(self, stats: RunStats, decode_s: float, decoding: int) -> Chunk | None:
        """Admit what fits, then this step's prefill chunk, paced by a decoding round of decode_s seconds
        of `decoding` sequences (0: none), with room reserved for it."""
        admitted = self.scheduler.admit()
        stats.prompt_tokens += sum(len(s.prompt_ids) for s in admitted)
        stats.cached_tokens += sum(s.cached_tokens for s in admitted)
        chunks = self.scheduler.chunks(self.pacer.budget(decode_s, self.scheduler.prefilling(), decoding))
        if not chunks:
            return None
        chunk = Chunk([s for s, _ in chunks], [n for _, n in chunks])
        self.scheduler.prepare(chunk.seqs, chunk.counts)
        return chunk

    def _prefilled(self, chunk: Chunk, verdict: Verdict, stats: RunStats,
                   on_tokens: Callable[[Sequence, list[int]], None] | None):
        """Apply a prefill chunk's verdict: prompt logprobs, the prefilled counts, completed prompts' first tokens."""
        for seq, n, prompt in zip(chunk.seqs, chunk.counts, verdict.prompt_logprobs or [None] * len(chunk.seqs)):
            if prompt is not None:
                seq.prompt_logprobs += prompt
            self.scheduler.advance(seq, n)
        first = [b for b, t in enumerate(verdict.new_tokens) if t]
        self._commit([chunk.seqs[b] for b in first], Verdict([verdict.new_tokens[b] for b in first],
                     logprobs=verdict.logprobs and [verdict.logprobs[b] for b in first]), stats, on_tokens)

    def _commit(self, batch: list[Sequence], verdict: Verdict, stats: RunStats,
                on_tokens: Callable[[Sequence, list[int]], None] | None) -> list[int]:
        """Apply a verdict's tokens (and logprobs) to its sequences. -> the tokens each kept."""
        lengths = []
        logprobs = verdict.logprobs or [None] * len(batch)
        for seq, toks, lps in zip(batch, verdict.new_tokens, logprobs):
            kept = self.scheduler.commit(seq, toks, lps)
            stats.new_tokens += len(kept)
            lengths.append(len(kept))
            if on_tokens and kept:
                on_tokens(seq, kept)
        return lengths

    def _observe(self, batch: list[Sequence], planned: int, verdict, seconds: float | None, behind: int,
                 unfed: int):
        """The policy learns from a round as the depth it chose (confidence cuts included: its time and
        tokens are what choosing it yields), over the sequences that could reach it; feeding the draft what
        earlier rounds left is not this round's cost. A drafting round fed the `unfed` prompt pairs first."""
        caps = depth_caps(batch, self.cfg.max_position)
        planned = round_depth(planned, caps)
        accepted = [n for n, cap in zip(verdict.lengths, caps) if cap >= planned]
        if verdict.looked_up:  # no draft ran: the round's time is not the depth's, its tokens are (playing the
            seconds = None     # depth is looking up where a lookup matches and drafting elsewhere)
        self.policy.observe(len(batch), planned, None if seconds is None else seconds - verdict.backlog_s,
                            accepted, verdict.catch_up_s, behind, (verdict.backlog_s - verdict.catch_up_s, unfed))

    def borrow(self, n: int = 1) -> "Borrowed":
        """n empty sequences in the target's cache beside the requests, for work outside decoding: `with
        llm.borrow(n) as b: b.forward(tokens)`. Their blocks come from the pool and are back when the block
        ends; borrow while no request runs (admission does not count them)."""
        return Borrowed(self.runner, self.scheduler.blocks, n)

    def abort(self, seq: Sequence):
        """Cancel a request between rounds: its KV blocks and per-sequence state are released."""
        self.scheduler.abort(seq)

    def abort_all(self):
        self.scheduler.abort_all()


class Borrowed:
    """Sequences of the target's cache outside the scheduler's requests (LLM.borrow): benchmarks' timed
    forwards, the trainer's target features."""

    def __init__(self, runner: ModelRunner, blocks, n: int):
        self.runner, self.blocks = runner, blocks
        self.ids = [new_seq_id() for _ in range(n)]

    def forward(self, tokens: list[list[int]], capture: tuple[int, ...] = ()):
        """Append tokens[i] to sequence i and run the target over them, causally.
        -> (feature [T, H], the `capture` layers' inputs, cu_seqlens list)."""
        return self.runner.forward(self.blocks, self.ids, tokens, capture)

    def plan(self, counts: list[int]) -> StepPlan:
        """Room for counts[i] tokens after sequence i's cached ones, as a step's plan (for a caller's own
        fixed-shape step, model_runner.StepGraph)."""
        starts = [self.blocks.length(i) for i in self.ids]
        for i, start, n in zip(self.ids, starts, counts):
            self.blocks.reserve(i, start + n)
        return StepPlan([self.blocks.block_table(i) for i in self.ids], starts, counts)

    def truncate(self, lengths: list[int]):
        """Roll sequence i back to lengths[i] cached tokens."""
        for i, n in zip(self.ids, lengths):
            self.blocks.truncate(i, n)

    def __enter__(self) -> "Borrowed":
        return self

    def __exit__(self, *exc):
        for i in self.ids:
            self.blocks.free(i)
