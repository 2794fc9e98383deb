"""SpS (speculative sampling): a small draft LM with the target's tokenizer proposes a chain of k tokens with
distributions q; the target verifies the chain in one forward (greedy: equal argmax; sampling:
min(1, p/q), residual norm(max(0, p - q))).

Drafts: another checkpoint (`--draft NAME_OR_PATH`) or the target's early exit (`--draft early-exit:N`:
its first N layers + final norm + LM head, weights shared, KV in the draft's own cache).

Draft cache invariant between rounds: it holds every token of the sequence, root included (one more than
the target's cache), and `state[seq]` is the draft's logits for the token after the root.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from .config import LlamaConfig
from .loader import load_model
from .model import Llama
from .model_runner import ModelRunner
from .sampler import Sampler
from .scheduler import Sequence
from .speculative import SpeculativeDecoder, depth_caps, verify
from .trees import Tree


def early_exit(target: Llama, n: int) -> tuple[Llama, LlamaConfig]:
    """A draft made of the target's first n layers, final norm and LM head (shared modules, no copies)."""
    cfg = replace(target.cfg, num_layers=n)
    with torch.device("meta"):
        draft = Llama(cfg)
    draft.embed_tokens, draft.norm, draft.lm_head = target.embed_tokens, target.norm, target.lm_head
    draft.layers, draft.rotary = nn.ModuleList(target.layers[:n]), target.rotary
    return draft, cfg


def load_draft(spec: str, target: Llama, dtype, device) -> tuple[Llama, LlamaConfig]:
    """`early-exit:N` or a model name/path (same tokenizer as the target) -> (draft model, its config)."""
    name, _, n = spec.partition(":")
    if name == "early-exit":
        n, L = n or "10", target.cfg.num_layers
        if not n.isdigit() or not 1 <= int(n) < L:
            raise ValueError(f"bad --draft {spec!r}: expected early-exit:N with 1 <= N < {L}")
        return early_exit(target, int(n))
    model, cfg, _ = load_model(spec, dtype, device)
    if cfg.vocab_size != target.cfg.vocab_size:
        raise ValueError(f"draft {spec!r} has a vocabulary of {cfg.vocab_size}, the target {target.cfg.vocab_size}: "
                         f"SpS needs the target's tokenizer")
    return model, cfg


class SpSDecoder(SpeculativeDecoder):
    """state[seq]: the draft's logits [V] for the token after the root."""

    def __init__(self, runner: ModelRunner, sampler: Sampler, draft: Llama, draft_cfg: LlamaConfig, k: int):
        if k < 1:
            raise ValueError(f"--draft-len must be >= 1, got {k}")
        super().__init__(runner, sampler, draft, draft_cfg)
        self.draft, self.k = draft, k
        self.lookahead = k + 1

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence]) -> list[list[int]]:
        first, _, _, _ = self.prefill_target(seqs)
        self._feed(seqs, [s.prompt_ids + [t] for s, t in zip(seqs, first)])
        return [[t] for t in first]

    @torch.inference_mode()
    def step(self, seqs: list[Sequence]) -> list[list[int]]:
        self.release_retired()
        with self.timer("draft_s"):
            chains, probs = self._draft_chains(seqs)
        with self.timer("verify_s"):
            verdict = verify(self.runner, self.sampler, seqs, Tree.chains(chains, self.runner.device),
                             draft_probs=probs)
        with self.timer("draft_s"):
            self._catch_up(seqs, verdict.new_tokens)
        self._stats.record(verdict.paths)
        return verdict.new_tokens

    def _draft_chains(self, seqs):
        """-> chains (root + drafts per sequence) and draft_probs fp32 [B, N, V] (row i = the q that drew
        node i) when any sequence samples, else None."""
        B = len(seqs)
        caps = [max(0, min(self.k, c)) for c in depth_caps(seqs, self.runner.cfg.max_position)]
        chains = [[s.all_ids[-1]] for s in seqs]
        logits = torch.stack([self.state[s.seq_id] for s in seqs])                            # [B, V]
        sampling = any(not s.params.greedy for s in seqs)
        probs = torch.zeros(B, max(caps) + 1, logits.shape[-1]) if sampling else None
        for i in range(max(caps)):
            active = [b for b in range(B) if caps[b] > i]
            if i > 0:
                logits[active] = self._forward([seqs[b] for b in active], [[chains[b][-1]] for b in active])
            tokens, q = self._propose(logits[active], [seqs[b].params for b in active])
            for b, t in zip(active, tokens.tolist()):
                chains[b].append(t)
            if q is not None:
                probs[active, i + 1] = q
        return chains, probs

    def _propose(self, logits, params):
        """Greedy rows take the argmax; sampled rows draw from q, their sampling distribution. -> tokens [A]
        and q fp32 [A, V] (zero on greedy rows, which the greedy verifier never reads; None if all greedy)."""
        tokens = logits.argmax(-1)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if not sampled:
            return tokens, None
        q = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        q[sampled] = self.sampler.probs(logits[sampled], [params[i] for i in sampled])
        tokens[sampled] = self.sampler.draw(q[sampled])
        return tokens, q

    def _catch_up(self, seqs, new_tokens):
        """Keep the draft cache's accepted tokens, feed the ones it has not seen (the bonus token, and the
        last draft when all were accepted)."""
        feeds = []
        for s, new in zip(seqs, new_tokens):
            n = len(s.all_ids)
            keep = n + min(len(new) - 1, self.cache.blocks.length(s.seq_id) - n)
            self.cache.blocks.truncate(s.seq_id, keep)
            feeds.append((s.all_ids + new)[keep:])
        self._feed(seqs, feeds)

    def _feed(self, seqs, tokens):
        for s, q in zip(seqs, self._forward(seqs, tokens)):
            self.state[s.seq_id] = q

    def _forward(self, seqs, tokens) -> torch.Tensor:
        """Append tokens to the draft cache -> draft logits after each sequence's last token [B, V]."""
        runner = self.cache.runner
        feature, _, cu = runner.forward([s.seq_id for s in seqs], tokens)
        return self.draft.logits(feature[runner.last_positions(cu)])
