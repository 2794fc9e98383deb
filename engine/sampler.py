"""Token sampling without host syncs: argmax for greedy rows, the exponential race for sampled rows.

argmax(p / E) with E ~ Exp(1) i.i.d. is an exact draw from p (the gpt-fast trick): no cumsum, no
multinomial, no device->host copy. A request with a seed draws its noise from its own generator, so its
draws do not depend on what else is in the batch; the others share the engine's generator.
"""
from __future__ import annotations

import torch

import eagle_kernels
from eagle_kernels import argmax
from .scheduler import SamplingParams, Sequence


class Sampler:
    def __init__(self, seed: int, device: torch.device, runner):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.runner = runner

    def _generator(self, seq: Sequence) -> torch.Generator:
        if seq.params.seed is None:
            return self.generator
        if seq.generator is None:  # its own stream, kept on the sequence while it runs
            seq.generator = torch.Generator(device=self.device).manual_seed(seq.params.seed)
        return seq.generator

    def noise(self, seqs: list[Sequence], shape: tuple[int, ...], exponential: bool) -> torch.Tensor:
        """[len(seqs), *shape] fp32: Exp(1) or U[0, 1) draws, each row from its sequence's generator."""
        fill = (lambda t, g: t.exponential_(generator=g)) if exponential else (lambda t, g: t.uniform_(generator=g))
        gens = [self._generator(s) for s in seqs]
        if all(g is self.generator for g in gens):
            return fill(torch.empty(len(seqs), *shape, device=self.device), self.generator)
        return torch.stack([fill(torch.empty(shape, device=self.device), g) for g in gens])

    def probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Target distributions after temperature / top-k / top-p; logits: [B, ..., V] -> fp32, same shape.
        Host-valued parameters let sampling_probs plan the truncation without reading the device."""
        return eagle_kernels.sampling_probs(logits, [p.temperature for p in params], [p.top_k for p in params],
                                            [p.top_p for p in params])

    def logprobs(self, logits: torch.Tensor, params: list[SamplingParams], tokens: torch.Tensor,
                 k: int) -> torch.Tensor:
        """Log-probabilities under the distribution each row is drawn from (after temperature / top-k /
        top-p; the model's softmax for greedy rows): of `tokens`, and the k most likely tokens'. A function
        of the logits row and its parameters alone, so every method reports the same numbers for the same
        token. logits [R, V], tokens int64 [R] -> fp32 [R, 1 + 2k]: logprob, k token ids, k logprobs."""
        lp = torch.log_softmax(logits.float(), -1)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            rows = self.runner.index(sampled).long()
            lp = lp.index_copy(0, rows, self.probs(logits.index_select(0, rows), [params[i] for i in sampled]).log())
        top = lp.topk(k, -1)
        return torch.cat([lp.gather(1, tokens[:, None]), top.indices.float(), top.values], 1)

    def draw(self, probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        # probs: [B, V], one row per sequence -> tokens int64 [B]
        return argmax(probs / self.noise(seqs, probs.shape[1:], exponential=True))

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        # logits: [B, V] -> tokens int64 [B]
        tokens = argmax(logits)
        sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if sampled:
            rows = self.runner.index(sampled)
            drawn = self.draw(self.probs(logits.index_select(0, rows), [seqs[i].params for i in sampled]),
                              [seqs[i] for i in sampled])
            tokens = tokens.index_copy(0, rows.long(), drawn)
        return tokens
