"""Requests and the scheduler, in plain Python (no torch): admission, batching, KV blocks, stop conditions.

The scheduler owns the BlockManager. Admission reserves the worst case (prompt + max_new_tokens + the
speculative lookahead) so a running sequence can never hit an exhausted pool mid-generation; blocks are
allocated lazily: before a step, room for what the step writes (`prepare`); after it, the verdict is
applied (`commit`): tokens appended, stop conditions checked, the cache cut back to what was accepted.

Chunked prefill: an admitted request's prompt enters the cache in chunks, a step's token budget over all
requests (first come, first served; engine/adaptive.py's PrefillPacer sets it), so a burst of long prompts
shares each step with the running streams' decoding instead of stalling them (`chunks`, `advance`). A
request decodes once its whole prompt is in.

Cache invariant between steps: a sequence's cache holds every token but the last (`cached_len`); the last
token is the next step's input (vanilla) or the root of the next draft tree (speculative methods).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from .block_manager import BlockManager, prefix_keys


MAX_LOGPROBS = 20  # alternatives a token's logprobs may list (OpenAI's top_logprobs limit)

# A token's log-probability under the distribution it was drawn from, and the most likely alternatives:
# (logprob, [(token, logprob), ...]).
TokenLogprob = tuple[float, list[tuple[int, float]]]


@dataclass
class SamplingParams:
    temperature: float = 0.0      # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                # 0 = off
    max_new_tokens: int = 128
    ignore_eos: bool = False
    seed: int | None = None       # a request's own random stream (None: the engine's shared one)
    logprobs: int | None = None   # each output token's log-probability and this many alternatives (None: off)
    prompt_logprobs: int | None = None  # the same for the prompt's tokens after its first (None: off)
    # Logit transforms before sampling (as vLLM's): presence / frequency penalties over the output tokens,
    # repetition penalty over prompt and output, a bias per token id, EOS masked before min_tokens.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    # Structured output (engine/grammar.py): (kind, spec), e.g. ("json", schema text) or ("regex", pattern);
    # only tokens the grammar allows are decided, and the request stops when its grammar is complete.
    structured: tuple[str, str] | None = None

    def validate(self):
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {k}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 10:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        if any(not -100 <= b <= 100 for b in (self.logit_bias or {}).values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"min_tokens must be in [0, max_new_tokens], got {self.min_tokens}")
        if self.min_tokens and self.structured:  # the grammar decides where the output ends
            raise ValueError("min_tokens cannot be combined with structured output")
        return self

    @property
    def transforms(self) -> bool:
        """Whether any logit transform applies (Sampler.adjust)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1 or
                    self.logit_bias or self.min_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def truncates(self) -> bool:
        """Whether top-k or top-p cut a sampled token's distribution."""
        return self.top_k > 0 or self.top_p < 1


_ids = itertools.count()


def new_seq_id() -> int:
    """A sequence id no other sequence (request or borrowed, engine.llm.Borrowed) has."""
    return next(_ids)


@dataclass
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    seq_id: int = field(default_factory=new_seq_id)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token, with params.logprobs
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)  # per prompt token (the first: None)
    finish_reason: str | None = None   # "stop" (EOS, or a stop string seen by the caller), "length", "abort"
    cached_tokens: int = 0             # prompt tokens whose KV came from the prefix cache (not prefilled)
    prefilled: int = 0                 # prompt tokens in the cache (cached or computed) while prefilling
    prompt_keys: list[bytes] = field(default_factory=list)  # prefix keys of the prompt's blocks (caching)
    block_keys: list[bytes] = field(default_factory=list)  # prefix keys of its blocks registered so far
    sample_key: int | None = None      # the seed of its keyed draws (Sampler.key): params.seed, or one drawn
    # What a running sequence carries for the engine, dropped when it retires: the decoding method's draft
    # state (EAGLE's head cursor, SpS's next draft logits), with params.seed its random generator, with
    # params.structured its grammar state (engine.grammar.GrammarState, at the output tokens so far).
    draft_state: object = None
    generator: object = None
    grammar: object = None

    @property
    def all_ids(self) -> list[int]:
        """A new list of every token (O(length): per-step code reads last_id, num_tokens or span)."""
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_id(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def span(self, a: int, b: int) -> list[int]:
        """The tokens at positions [a, b) (0 <= a <= b), without copying the rest."""
        P = len(self.prompt_ids)
        if b <= P:
            return self.prompt_ids[a:b]
        if a >= P:
            return self.output_ids[a - P:b - P]
        return self.prompt_ids[a:] + self.output_ids[:b - P]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefilling(self) -> bool:
        """It has no output token yet: its prompt is (partly) not in the cache, or its first token is not
        decided yet."""
        return not self.output_ids


def cached_len(seq: Sequence) -> int:
    """Tokens of `seq` in the KV cache between steps (all but the last)."""
    return len(seq.prompt_ids) + len(seq.output_ids) - 1


def final_len(seq: Sequence) -> int:
    """Tokens whose KV is final: cached_len once decoding, the prefilled prompt before."""
    return cached_len(seq) if seq.output_ids else seq.prefilled


class Scheduler:
    def __init__(self, num_blocks: int, block_size: int, max_batch: int, max_model_len: int,
                 eos_ids: tuple[int, ...], lookahead: int = 1, vocab_size: int | None = None,
                 prefix_cache: bool = True, grammars=None):
        self.blocks = BlockManager(num_blocks, block_size)
        self.prefix_cache = prefix_cache
        self.max_batch, self.max_model_len = max_batch, max_model_len
        self.eos_ids, self.lookahead, self.vocab_size = set(eos_ids), lookahead, vocab_size
        self.grammars = grammars  # engine.grammar.Grammars (None: no tokenizer, no structured output)
        self.held = 0  # cache positions past the cached tokens the decoder keeps between steps
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._reserved: dict[int, int] = {}

    def _worst_case_blocks(self, seq: Sequence) -> int:
        tokens = min(len(seq.prompt_ids) + seq.params.max_new_tokens, self.max_model_len) + self.lookahead
        return self.blocks.blocks_for(tokens)

    def add(self, seq: Sequence):
        self.check(seq)
        self.waiting.append(seq)

    def check(self, seq: Sequence):
        """Raise ValueError (a one-line reason) if `seq` can never run here; reads only fixed settings."""
        seq.params.validate()
        if self.vocab_size and any(not 0 <= t < self.vocab_size for t in seq.params.logit_bias or {}):
            raise ValueError(f"logit_bias: token ids must be in [0, {self.vocab_size})")
        if not seq.prompt_ids:
            raise ValueError("empty prompt")
        if seq.params.structured is not None:
            if self.grammars is None:
                raise ValueError("structured output needs the model's tokenizer")
            self.grammars.check(seq.params.structured)
        if len(seq.prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(seq.prompt_ids)} tokens; the model's context is "
                             f"{self.max_model_len} tokens")
        if self._worst_case_blocks(seq) > self.blocks.num_blocks:
            raise ValueError(f"request needs {self._worst_case_blocks(seq)} KV blocks, the pool has "
                             f"{self.blocks.num_blocks} (raise --kv-cache-gb or lower --max-new-tokens)")

    def admit(self) -> list[Sequence]:
        """Move waiting requests into the running batch while their worst case fits; returns them. A
        request whose next uncached prefix block a running prefill will compute (the n choices of a request,
        repeated prompts) waits, to share it once computed."""
        admitted = []
        computing = {k for s in self.running if s.prefilling for k in s.prompt_keys[len(s.block_keys):]}
        for seq in list(self.waiting):
            if len(self.running) >= self.max_batch:
                break
            need = self._worst_case_blocks(seq)
            if sum(self._reserved.values()) + need > self.blocks.num_blocks:
                break  # first come, first served: no later request takes the room it waits for
            keys = seq.prompt_keys
            if not keys and self.prefix_cache and seq.params.prompt_logprobs is None:  # those need every row
                keys = seq.prompt_keys = prefix_keys(seq.prompt_ids, self.blocks.block_size)
            hit = next((i for i, k in enumerate(keys) if k not in self.blocks.by_key), len(keys))
            if hit < len(keys) and keys[hit] in computing:
                continue
            self.waiting.remove(seq)
            self._reserved[seq.seq_id] = need
            self.running.append(seq)
            if seq.params.structured is not None:
                seq.grammar = self.grammars.state(seq.params.structured)
            admitted.append(seq)
            if keys:
                seq.cached_tokens = self.blocks.share(seq.seq_id, keys)
                seq.block_keys = keys[:seq.cached_tokens // self.blocks.block_size]
                computing.update(keys[hit:])
            seq.prefilled = seq.cached_tokens
        return admitted

    def chunks(self, budget: int | None = None) -> list[tuple[Sequence, int]]:
        """This step's prefill: (sequence, prompt tokens) for the running sequences still prefilling, first
        come first served, at most `budget` tokens in all (None: every prompt whole)."""
        out = []
        for seq in self.running:
            if seq.prefilling and seq.prefilled < len(seq.prompt_ids) and not seq.finished:
                n = len(seq.prompt_ids) - seq.prefilled
                if budget is not None:
                    n = min(n, budget)
                    budget -= n
                out.append((seq, n))
                if budget == 0:
                    break
        return out

    def prefilling(self) -> int:
        """How many running sequences still wait for part of their prompt."""
        return sum(s.prefilling and s.prefilled < len(s.prompt_ids) and not s.finished for s in self.running)

    def decoding(self) -> list[Sequence]:
        """The running sequences a decoding round advances (prompt wholly in the cache, not finished)."""
        return [s for s in self.running if not s.finished and not s.prefilling]

    def prepare(self, seqs: list[Sequence], counts: list[int] | None = None):
        """Room in each table for what the step writes: `counts` prompt tokens after the prefilled ones
        (prefill), or the cached tokens; plus the decoder's lookahead (positions a step may write past them: 1
        for vanilla) where the step then samples."""
        for b, seq in enumerate(seqs):
            if counts is None:
                self.blocks.reserve(seq.seq_id, cached_len(seq) + self.lookahead)
            else:
                end = seq.prefilled + counts[b]
                self.blocks.reserve(seq.seq_id, end + (self.lookahead if end == len(seq.prompt_ids) else 0))

    def advance(self, seq: Sequence, n: int):
        """n more prompt tokens of a prefilling sequence are in the cache (its prefill's first token comes
        through `commit`)."""
        seq.prefilled += n
        if self.prefix_cache:
            self._register(seq)

    def commit(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> list[int]:
        """Apply a step's verdict: append its tokens (up to a stop) and their logprobs, if asked for, and cut
        the cache back to the accepted ones. -> the tokens kept."""
        kept = self.append_tokens(seq, tokens)
        if logprobs is not None:
            seq.logprobs += logprobs[:len(kept)]
        if self.prefix_cache:
            self._register(seq)
        if not seq.finished:
            # blocks past the kept positions go back to the pool; a block a decoder's cache still uses
            # (SpS's draft holds the root) must not, or a companion could take it and overwrite that KV
            self.blocks.truncate(seq.seq_id, cached_len(seq) + self.held)
        return kept

    def _register(self, seq: Sequence):
        """Offer the sequence's newly full blocks to the prefix cache: those wholly below its final tokens,
        each keyed with the token after it."""
        bs, have = self.blocks.block_size, len(seq.block_keys)
        full = min(final_len(seq), seq.num_tokens - 1) // bs
        if full > have:
            new = seq.prompt_keys[have:full]
            if len(new) < full - have:
                new = prefix_keys(seq.all_ids, bs, seq.block_keys[-1] if have else b"", have, full - have)
            self.blocks.register(seq.seq_id, have, new)
            seq.block_keys += new

    def append_tokens(self, seq: Sequence, tokens: list[int]) -> list[int]:
        """Append generated tokens, stopping at EOS / a complete grammar / max_new_tokens / context; returns
        those kept."""
        kept = []
        for tok in tokens:
            if seq.grammar is not None and not seq.grammar.accept(tok):  # never with the sampler's masks
                seq.finish_reason = "stop"
                break
            seq.output_ids.append(tok)
            kept.append(tok)
            complete = seq.grammar is not None and seq.grammar.finished
            if tok in self.eos_ids and not seq.params.ignore_eos or complete:
                seq.finish_reason = "stop"
            elif len(seq.output_ids) >= seq.params.max_new_tokens or \
                    seq.num_tokens >= self.max_model_len:
                seq.finish_reason = "length"
            if seq.finished:
                break
        return kept

    def retire_finished(self) -> list[Sequence]:
        done = [s for s in self.running if s.finished]
        for seq in done:
            self.running.remove(seq)
            self._release(seq)
        return done

    def abort(self, seq: Sequence):
        """Drop a waiting or running request now (a client went away); its blocks return to the pool."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
            self._release(seq)
        seq.finish_reason = seq.finish_reason or "abort"

    def abort_all(self):
        """Free everything (an error mid-batch must not leak blocks)."""
        for seq in self.running:
            self._release(seq)
        self.running.clear()
        self.waiting.clear()

    def _release(self, seq: Sequence):
        """A running sequence leaves: its blocks go back to the pool, its per-sequence state goes."""
        self.blocks.free(seq.seq_id)
        self._reserved.pop(seq.seq_id, None)
        seq.draft_state = seq.generator = seq.grammar = None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
