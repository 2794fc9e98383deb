"""Token sampling without host syncs: argmax for greedy rows, the exponential race for sampled rows.

argmax(p / E) with E ~ Exp(1) i.i.d. is an exact draw from p (the gpt-fast trick): no cumsum, no
multinomial, no device->host copy. Per-row parameters reach the device through the runner's staged copy.
"""
from __future__ import annotations

from array import array

import torch

import eagle_kernels
from .scheduler import SamplingParams


def float_bits(values: list[float]) -> list[int]:
    """fp32 values as int32 bit patterns (they travel in the int32 staging copy)."""
    return list(array("i", array("f", values).tobytes()))


class Sampler:
    def __init__(self, seed: int, device: torch.device, runner):
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.runner = runner

    def probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Target distributions after temperature / top-k / top-p; logits: [B, ..., V] -> fp32, same shape."""
        n = len(params)
        packed = self.runner.index(float_bits([p.temperature for p in params]) + [p.top_k for p in params]
                                   + float_bits([p.top_p for p in params]))
        temp, top_k, top_p = packed[:n].view(torch.float32), packed[n:2 * n].long(), packed[2 * n:].view(torch.float32)
        return eagle_kernels.sampling_probs(logits, temp, top_k, top_p)

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
