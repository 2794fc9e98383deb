"""Token sampling without host syncs: argmax for greedy rows, the exponential race for sampled rows.

argmax(p / E) with E ~ Exp(1) i.i.d. is an exact draw from p (the gpt-fast trick): no cumsum, no
multinomial, no device->host copy.
"""
from __future__ import annotations

import torch

import eagle_kernels
from .scheduler import SamplingParams


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu"):
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Target distributions after temperature / top-k / top-p; logits: [B, V] -> fp32 [B, V]."""
        dev = logits.device
        temp = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=dev)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
        return eagle_kernels.sampling_probs(logits, temp, top_k, top_p)

    def draw(self, probs: torch.Tensor) -> torch.Tensor:
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        return (probs / noise).argmax(dim=-1)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        # logits: [B, V] -> tokens int64 [B]
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            rows = torch.tensor(sampled, device=logits.device)
            tokens[rows] = self.draw(self.probs(logits[rows], [params[i] for i in sampled]))
        return tokens
