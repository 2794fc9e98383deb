"""The engine's front door: load a model, take prompts, run the generate loop with a decoding method.

A decoding method ("decoder", engine/decoding.py) turns the running batch into new tokens per sequence:
vanilla yields one token per step, speculative methods 1 + accepted drafts. The scheduler owns admission,
the KV blocks, stop conditions and freeing.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .device import CUDA_KV_SHARE, defaults, resolve_device
from .loader import DEFAULT_MODEL, default_weights, load_model, load_tokenizer
from .methods import METHODS, draft_elements_per_token
from .model_runner import ModelRunner
from .sampler import Sampler
from .scheduler import SamplingParams, Scheduler, Sequence

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


class LLM:
    """device: "auto" (cuda when a GPU is visible), "cpu" or "cuda"; dtype, kv_cache_gb and cuda_graphs
    default to the device's (engine/device.py); weights: engine.loader.WEIGHTS (None: dense for float32, else
    auto: a GGUF's blocks stay quantized on the CPU)."""

    def __init__(self, model: str = DEFAULT_MODEL, dtype: str | None = None, device: str = "auto",
                 kv_cache_gb: float | None = None, block_size: int = 16, max_batch: int = 16, seed: int = 0,
                 method: str = "vanilla", method_args: dict | None = None, threads: int | None = None,
                 cuda_graphs: bool | None = None, timing: bool = False, weights: str | None = None):
        self.device = resolve_device(device)
        preset = defaults(self.device)
        dtype = dtype or preset.dtype
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
        if threads:
            torch.set_num_threads(threads)
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
        self.sampler = Sampler(seed, self.device, self.runner)
        eos = set(self.cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.scheduler = Scheduler(num_blocks, block_size, max_batch, self.cfg.max_position, tuple(eos))
        self.timing = timing
        self.policies = {}  # adaptive policies (engine/adaptive.py) by method arguments, kept across set_method
        self.set_method(method, method_args)

    def set_method(self, method: str, method_args: dict | None = None):
        """Switch the decoding method (the scheduler must be idle). An adaptive policy's measurements carry over
        to the next decoder with the same head and tree."""
        if method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
        self.method_args = method_args or {}
        self.decoder = METHODS[method](self)
        self.scheduler.lookahead, self.scheduler.held = self.decoder.lookahead, self.decoder.held
        return self.decoder

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

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @torch.inference_mode()
    def step(self, stats: RunStats, on_tokens: Callable[[Sequence, list[int]], None] | None = None) -> list[Sequence]:
        """One round: prefill newly admitted requests, else one decoding step of the running batch.
        `on_tokens(seq, kept)` sees each sequence's new tokens before finished ones retire (it may finish a
        sequence itself, e.g. on a stop string). -> the sequences that finished."""
        admitted = self.scheduler.admit()
        t0 = time.perf_counter()
        if admitted:
            self.scheduler.prepare(admitted, prefill=True)
            new = self.decoder.prefill(admitted)
            batch = admitted
            stats.prefill_s += time.perf_counter() - t0
            stats.prompt_tokens += sum(len(s.prompt_ids) for s in admitted)
        else:
            batch = [s for s in self.scheduler.running if not s.finished]
            self.scheduler.prepare(batch, prefill=False)
            new = self.decoder.step(batch)
            stats.decode_s += time.perf_counter() - t0
            stats.steps += 1
        for seq, toks in zip(batch, new):
            kept = self.scheduler.commit(seq, toks)
            stats.new_tokens += len(kept)
            if on_tokens and kept:
                on_tokens(seq, kept)
        done = self.scheduler.retire_finished()
        self._forget([s.seq_id for s in done])
        return done

    def abort(self, seq: Sequence):
        """Cancel a request between rounds: its KV blocks and per-sequence state are released."""
        self.scheduler.abort(seq)
        self._forget([seq.seq_id])

    def abort_all(self):
        self._forget([s.seq_id for s in self.scheduler.running])
        self.scheduler.abort_all()

    def _forget(self, seq_ids: list[int]):
        self.decoder.release(seq_ids)
        self.sampler.release(seq_ids)
