"""Token sampling without host syncs: argmax for greedy rows, keyed draws for sampled rows.

A sampled token is argmax(l / T + g) over the tokens top-k / top-p keep, with g ~ Gumbel i.i.d. (the Gumbel max,
an exact draw from the tempered softmax: no cumsum, no multinomial, no device->host copy), and g a fixed function
of (the request's key, the token's position, token id) (eagle_kernels.sample_keyed). So a request draws the same
token at a position whichever step draws it, alone or in any batch, from all the logits or from a quantized LM
head's bounds (Llama.tokens): a speculative round that draws the target's token at every tree node (the position
each node predicts) and walks the tree as greedy verification does outputs exactly what vanilla sampling
outputs for the same key. The key is the request's seed, or for a request without one a number drawn at its
first draw from the engine's stream (LLM.reseed restarts it). Rejection sampling's uniforms (drafts that are
draws from a draft distribution, SpS) come from per-request generators.
"""
from __future__ import annotations

import random

import numpy as np
import torch

import eagle_kernels
from eagle_kernels import argmax
from .scheduler import SamplingParams, Sequence


class Sampler:
    def __init__(self, seed: int, device: torch.device, runner, eos_ids: tuple[int, ...] = ()):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.keys = random.Random(seed)  # keys of requests without a seed
        self.runner, self.eos_ids = runner, eos_ids

    def reseed(self, seed: int):
        self.generator.manual_seed(seed)
        self.keys.seed(seed)

    def key(self, seq: Sequence) -> int:
        """The seed of a sequence's keyed draws: its params.seed, else one drawn from the engine's stream (kept on
        the sequence)."""
        if seq.sample_key is None:
            seed = seq.params.seed if seq.params.seed is not None else self.keys.getrandbits(62)
            seq.sample_key = seed & ((1 << 63) - 1)
        return seq.sample_key

    def _generator(self, seq: Sequence) -> torch.Generator:
        if seq.params.seed is None:
            return self.generator
        if seq.generator is None:  # its own stream, kept on the sequence while it runs
            seq.generator = torch.Generator(device=self.device).manual_seed(seq.params.seed)
        return seq.generator

    def uniforms(self, seqs: list[Sequence], shape: tuple[int, ...]) -> torch.Tensor:
        """[len(seqs), *shape] fp32 U[0, 1) draws, each row from its sequence's generator."""
        gens = [self._generator(s) for s in seqs]
        if all(g is self.generator for g in gens):
            return torch.empty(len(seqs), *shape, device=self.device).uniform_(generator=self.generator)
        return torch.stack([torch.empty(shape, device=self.device).uniform_(generator=g) for g in gens])

    def probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Target distributions after temperature / top-k / top-p; logits: [B, ..., V] -> fp32, same shape.
        Host-valued parameters let sampling_probs plan the truncation without reading the device."""
        return eagle_kernels.sampling_probs(logits, [p.temperature for p in params], [p.top_k for p in params],
                                            [p.top_p for p in params])

    def transforms(self, seqs: list[Sequence]) -> bool:
        """Whether `adjust` changes any row's logits: a transform or a grammar (where it does not, a verify
        step may skip it)."""
        return any(s.params.transforms or s.grammar is not None for s in seqs)

    def adjust(self, logits: torch.Tensor, seqs: list[Sequence], tree=None) -> torch.Tensor:
        """The requests' logit transforms (SamplingParams: presence / frequency / repetition penalties,
        logit_bias, min_tokens), applied before sampling, greedy argmax and logprobs alike, as vanilla and
        verification both see them. logits [B, V] predict the token after each sequence's tokens; with
        `tree` (engine.trees.Tree), logits [B, N, V] predict the token after each node, whose drafted
        ancestors (the node itself included, the root excluded: it is already an output token) count as
        output tokens and add their depth to the output's length. Then the grammars (`constrain`). -> logits
        (the same tensor when no request has a transform or a grammar)."""
        asked = [b for b, s in enumerate(seqs) if s.params.transforms]
        if not asked:
            return self.constrain(logits, seqs, tree)
        dev, V = logits.device, logits.shape[-1]
        rows = self.runner.index(asked).long()
        params = [seqs[b].params for b in asked]
        x = logits.index_select(0, rows).float()
        x = x if tree is not None else x[:, None]                                      # [R, N, V]
        R, N = x.shape[:2]
        counts = self._counts([seqs[b].output_ids for b in asked], V)[:, None]         # [R, 1, V]
        depth = torch.zeros(R, N, device=dev)
        if tree is not None:
            bits = tree.mask().view(len(seqs), N, -1).index_select(0, rows)           # [R, N, W]
            shift = torch.arange(32, dtype=torch.int32, device=dev)
            anc = ((bits[..., None] >> shift) & 1).flatten(2)[..., :N].float()       # [R, N, N]
            anc[..., 0] = 0                                                            # the root: counted
            tokens = tree.tokens.index_select(0, rows)
            counts = counts + anc @ torch.nn.functional.one_hot(tokens, V).float()     # [R, N, V]
            depth = tree.depths.index_select(0, rows).float()
        col = lambda name: torch.tensor([getattr(p, name) for p in params], device=dev)[:, None, None]
        if any(p.repetition_penalty != 1 for p in params):  # first, on the raw logits (vLLM's order)
            rep = col("repetition_penalty")
            seen = (counts > 0) | (self._counts([seqs[b].prompt_ids for b in asked], V)[:, None] > 0)
            x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        x = x - col("frequency_penalty") * counts - col("presence_penalty") * (counts > 0).float()
        bias = torch.zeros(R, V, device=dev)
        for i, p in enumerate(params):
            if p.logit_bias:
                bias[i, list(p.logit_bias)] = torch.tensor(list(p.logit_bias.values()), device=dev)
        x = x + bias[:, None]
        left = torch.tensor([p.min_tokens - len(seqs[b].output_ids) for b, p in zip(asked, params)], device=dev)
        if self.eos_ids and any(p.min_tokens for p in params):
            early = (depth < left[:, None])[..., None]                                 # [R, N, 1]
            eos = torch.zeros(V, dtype=torch.bool, device=dev)
            eos[list(self.eos_ids)] = True
            x = x.masked_fill(early & eos, float("-inf"))
        x = (x if tree is not None else x[:, 0]).to(logits.dtype)
        return self.constrain(logits.index_copy(0, rows, x), seqs, tree)

    def constrain(self, logits: torch.Tensor, seqs: list[Sequence], tree=None) -> torch.Tensor:
        """Structured output: -inf for the tokens a sequence's grammar (Sequence.grammar) does not allow next;
        logits and `tree` as in adjust, a tree node's grammar state being the one after its drafted ancestors
        and itself. The masks are computed on the host: a tree is read back for its grammars' walks (a round's
        only host read besides the verdict, made for requests with a grammar alone)."""
        asked = [b for b, s in enumerate(seqs) if s.grammar is not None]
        if not asked:
            return logits
        V, rows = logits.shape[-1], self.runner.index(asked).long()
        N = 1 if tree is None else tree.num_nodes
        bits = torch.full((len(asked), N, (V + 31) // 32), -1, dtype=torch.int32)     # [R, N, W], host
        if tree is None:
            for i, b in enumerate(asked):
                seqs[b].grammar.fill(bits[i])
        else:
            host = torch.cat([tree.tokens, tree.parents.long()], 1).index_select(0, rows).tolist()  # [R, 2N]
            for i, b in enumerate(asked):
                seqs[b].grammar.fill_tree(host[i][:N], host[i][N:], bits[i])
        banned = unpack_banned(bits, V, logits.device)                                       # [R, N, V]
        banned = banned if tree is not None else banned[:, 0]
        if len(asked) == len(seqs):  # every row: no gather and scatter over the vocabulary
            return logits.masked_fill(banned, float("-inf"))
        return logits.index_copy(0, rows, logits.index_select(0, rows).masked_fill(banned, float("-inf")))

    def _counts(self, token_lists: list[list[int]], V: int) -> torch.Tensor:
        """Occurrences of each token id per list -> fp32 [len(token_lists), V]."""
        counts = torch.zeros(len(token_lists), V, device=self.device)
        flat = [t for ts in token_lists for t in ts]
        if flat:
            owner = self.runner.to_device([i for i, ts in enumerate(token_lists) for _ in ts])
            counts.index_put_((owner, self.runner.to_device(flat)), torch.ones(len(flat), device=self.device),
                              accumulate=True)
        return counts

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

    def keyed(self, seqs: list[Sequence], depth: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The keyed draws' arguments for tokens num_tokens + depth of seqs: temperatures fp32 [B] (greedy rows:
        0), seeds and positions int64 [B], on the device from one copy."""
        B = len(seqs)
        wide = [0 if s.params.greedy else self.key(s) for s in seqs] + [s.num_tokens + depth for s in seqs]
        halves = np.array(wide, dtype=np.int64).view(np.int32).tolist()  # each int64 as its two int32 words
        temps = np.array([s.params.temperature for s in seqs], dtype=np.float32).view(np.int32).tolist()
        ints = self.runner.index(halves + temps)                                              # int32 [5B]
        return ints[4 * B:].view(torch.float32), ints[:2 * B].view(torch.int64), ints[2 * B:4 * B].view(torch.int64)

    def truncate(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """logits [B, ..., V] with -inf outside the tokens each sampled sequence's top-k / top-p keep (the same
        tensor where no sequence truncates)."""
        asked = [b for b, s in enumerate(seqs) if not s.params.greedy and s.params.truncates]
        if not asked:
            return logits
        rows = self.runner.index(asked)
        x = logits.index_select(0, rows)
        kept = self.probs(x, [seqs[b].params for b in asked]) > 0
        return logits.index_copy(0, rows.long(), x.masked_fill(~kept, float("-inf")))

    def draw(self, logits: torch.Tensor, seqs: list[Sequence], depths: torch.Tensor | int = 0) -> torch.Tensor:
        """Each sequence's tokens from logits [B, V] or [B, N, V] (after adjust), its rows predicting the tokens
        at num_tokens + depths (an int, or int64 [B, N] for [B, N, V]) -> int64 [B] or [B, N]: a greedy
        sequence's argmax; a sampled one's keyed draw at its temperature over what its top-k / top-p keep."""
        if all(s.params.greedy for s in seqs):
            return argmax(logits)
        temps, seeds, positions = self.keyed(seqs, depths if isinstance(depths, int) else 0)
        if logits.dim() == 3:
            positions = positions[:, None] + depths
            temps, seeds = (t[:, None].expand_as(positions).contiguous() for t in (temps, seeds))
        return eagle_kernels.sample_keyed(self.truncate(logits, seqs).float(), temps, seeds, positions.contiguous())


def unpack_banned(bits: torch.Tensor, V: int, device: torch.device) -> torch.Tensor:
    """Allowed-token bitmasks (int32 [..., W] on the host, bit t = token t) -> bool [..., V], True where a
    token is not allowed: unpacked by numpy for a CPU, on the device for a GPU (an eighth of the copy)."""
    if device.type == "cpu":
        return torch.from_numpy(np.unpackbits((~bits.numpy()).view(np.uint8), axis=-1, bitorder="little")[..., :V]
                                ).view(torch.bool)
    shift = torch.arange(32, dtype=torch.int32, device=device)
    return ((bits.to(device)[..., None] >> shift) & 1).flatten(-2)[..., :V] == 0
