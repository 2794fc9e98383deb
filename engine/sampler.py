"""Token sampling without host syncs: argmax for greedy rows, the exponential race for sampled rows.

argmax(p / E) with E ~ Exp(1) i.i.d. is an exact draw from p (the gpt-fast trick): no cumsum, no
multinomial, no device->host copy.
"""
from __future__ import annotations

import torch

import eagle_kernels
from .scheduler import SamplingParams


class Sampler:
    def __init__(self, seed: int, device: torch.device, runner):
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.runner = runner

    def probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Target distributions after temperature / top-k / top-p; logits: [B, ..., V] -> fp32, same shape.
        Host-valued parameters let sampling_probs plan the truncation without reading the device."""
        return eagle_kernels.sampling_probs(logits, [p.temperature for p in params], [p.top_k for p in params],
                                            [p.top_p for p in params])

    def draw(self, probs: torch.Tensor) -> torch.Tensor:
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        return (probs / noise).argmax(dim=-1)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        # logits: [B, V] -> tokens int64 [B]
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            rows = self.runner.index(sampled)
            drawn = self.draw(self.probs(logits.index_select(0, rows), [params[i] for i in sampled]))
            tokens = tokens.index_copy(0, rows.long(), drawn)
        return tokens
