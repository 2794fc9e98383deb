"""The engine's front door: load a model, take prompts, run the generate loop with a decoding method.

A decoding method ("decoder") turns the running batch into new tokens per sequence: `prefill(seqs)` and
`step(seqs)`, each returning `list[list[int]]`. Vanilla yields one token per step; speculative methods
yield 1 + accepted drafts. The scheduler owns admission, stop conditions and freeing.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from . import speculative
from .loader import DEFAULT_MODEL, load_model, load_tokenizer
from .model_runner import ModelRunner
from .sampler import Sampler
from .scheduler import SamplingParams, Scheduler, Sequence

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class VanillaDecoder:
    """One target forward per token; the reference every speculative method must match."""
    lookahead = 0

    def __init__(self, runner: ModelRunner, sampler: Sampler):
        self.runner, self.sampler = runner, sampler

    def _sample_last(self, seqs, feature, cu) -> list[list[int]]:
        logits = self.runner.model.logits(feature[self.runner.last_positions(cu)])
        return [[t] for t in self.sampler(logits, [s.params for s in seqs]).tolist()]

    def prefill(self, seqs: list[Sequence]) -> list[list[int]]:
        feature, _, cu = self.runner.forward([s.seq_id for s in seqs], [s.prompt_ids for s in seqs])
        return self._sample_last(seqs, feature, cu)

    def step(self, seqs: list[Sequence]) -> list[list[int]]:
        feature, _, cu = self.runner.forward([s.seq_id for s in seqs], [[s.output_ids[-1]] for s in seqs])
        return self._sample_last(seqs, feature, cu)


@dataclass
class RunStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    steps: int = 0
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
                "prefill_s": round(self.prefill_s, 4), "decode_s": round(self.decode_s, 4),
                "prefill_tok_s": round(self.prompt_tokens / max(self.prefill_s, 1e-9), 1),
                "decode_tok_s": round(self.new_tokens / max(self.decode_s, 1e-9), 1),
                "steps": self.steps, **self.extra}


DecoderFactory = Callable[["LLM"], object]
METHODS: dict[str, DecoderFactory] = {
    "vanilla": lambda llm: VanillaDecoder(llm.runner, llm.sampler),
    "sps": lambda llm: speculative.make_sps(llm),
    "eagle": lambda llm: speculative.make_eagle(llm, "eagle"),
    "eagle3": lambda llm: speculative.make_eagle(llm, "eagle3"),
    "auto": lambda llm: speculative.make_auto(llm) or METHODS["vanilla"](llm),  # EAGLE-3 if a head ships
}


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, dtype: str = "float32", device: str = "cpu",
                 kv_cache_gb: float = 0.5, block_size: int = 16, max_batch: int = 16, seed: int = 0,
                 method: str = "vanilla", method_args: dict | None = None, threads: int | None = None):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
        if threads:
            torch.set_num_threads(threads)
        self.model, self.cfg, self.source = load_model(model, DTYPES[dtype], device)
        self.tokenizer = load_tokenizer(self.source)
        self.runner = ModelRunner(self.model, self.cfg, kv_cache_gb, block_size)
        self.sampler = Sampler(seed, device)
        self.method_args = method_args or {}
        self.decoder = METHODS[method](self)
        eos = set(self.cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.scheduler = Scheduler(self.runner.blocks, max_batch, self.cfg.max_position, tuple(eos),
                                   lookahead=self.decoder.lookahead)

    def chat_ids(self, prompt: str, raw: bool = False) -> list[int]:
        """A user message through the model's chat template (or the raw text with `raw`)."""
        if raw:
            return self.tokenizer.encode(prompt)
        ids = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                 add_generation_prompt=True, tokenize=True)
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
            while self.scheduler.has_work:
                self._round(stats, on_tokens)
        except BaseException:
            self.scheduler.abort_all()
            raise
        finally:
            # The scheduler retires sequences after the decoder's last call: free their draft-cache blocks
            # now rather than at the next run's first call.
            getattr(self.decoder, "release_retired", lambda: None)()
        stats.extra.update(getattr(self.decoder, "stats", lambda: {})())
        return seqs, stats

    def _round(self, stats: RunStats, on_tokens):
        admitted = self.scheduler.admit()
        t0 = time.perf_counter()
        if admitted:
            new = self.decoder.prefill(admitted)
            batch = admitted
            stats.prefill_s += time.perf_counter() - t0
            stats.prompt_tokens += sum(len(s.prompt_ids) for s in admitted)
        else:
            batch = [s for s in self.scheduler.running if not s.finished]
            new = self.decoder.step(batch)
            stats.decode_s += time.perf_counter() - t0
            stats.steps += 1
        for seq, toks in zip(batch, new):
            kept = self.scheduler.append_tokens(seq, toks)
            stats.new_tokens += len(kept)
            if on_tokens and kept:
                on_tokens(seq, kept)
        self.scheduler.retire_finished()
