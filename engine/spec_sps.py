"""SpS (speculative sampling): a small draft LM with the target's tokenizer proposes a chain of k tokens with
distributions q; the target verifies the chain in one forward (greedy: equal argmax; sampling:
min(1, p/q), residual norm(max(0, p - q))).

Drafts: another checkpoint (`--draft NAME_OR_PATH`) or the target's early exit (`--draft early-exit:N`:
its first N layers + final norm + LM head, weights shared, KV in the draft's own cache).

Draft cache invariant between rounds: it holds every token of the sequence, root included (one more than
the target's cache), and its `draft_state` is the draft's logits for the token after the root. Every
sequence drafts k tokens (fixed shapes); the tree keeps those a sequence may still use.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn


from .config import LlamaConfig
from .loader import load_model
from .model import Llama
from .decoding import Draft, SpeculativeDecoder, Verdict
from .model_runner import kv_layers
from .scheduler import Sequence, cached_len
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
    causal = True
    mixes = False  # its prefill runs the draft model over the prompt too

    def __init__(self, runner, sampler, blocks, draft: Llama, draft_cfg: LlamaConfig, k: int, timing=False):
        if k < 1:
            raise ValueError(f"--draft-len must be >= 1, got {k}")
        super().__init__(runner, sampler, blocks, timing)
        self.draft_model, self.k = draft, k
        self.kv = runner.new_cache(draft_cfg.num_layers, draft_cfg.num_kv_heads, draft_cfg.head_dim)
        self.draft_layers = kv_layers(self.kv)
        # Verification writes L .. L + k; catch-up feeds up to two tokens after the accepted ones.
        self.lookahead = k + 2
        self.held = 1  # the draft cache holds the root too
        self.max_tree = k + 1
        self.max_depth = k

    def prefill(self, seqs: list[Sequence], counts: list[int]) -> Verdict:
        """The target's chunk, then the draft's over the same tokens (the whole cached prefix with the first
        chunk: the draft has its own cache) and the first token where the prompt is complete."""
        starts = [0 if s.prefilled == s.cached_tokens else s.prefilled for s in seqs]
        ends = [s.prefilled + n for s, n in zip(seqs, counts)]
        first = self.prefill_target(seqs, counts)
        self._feed(seqs, starts, [s.prompt_ids[a:e] + t for s, a, e, t in zip(seqs, starts, ends, first.new_tokens)])
        return first

    def draft(self, seqs: list[Sequence], depth: int, caps: list[int]) -> Draft:
        """-> chains (root + k drafts: always k levels, which catch_up relies on; caps cut what is verified)
        with probs fp32 [B, k + 1, V] (row i = the q that drew node i) when a sequence samples, else None."""
        k = self.k
        caps = [min(k, c) for c in caps]
        params = [s.params for s in seqs]
        sampled = [b for b, p in enumerate(params) if not p.greedy]
        logits = torch.stack([s.draft_state for s in seqs])                                  # [B, V]
        tokens = [self.runner.to_device([s.last_id for s in seqs])]
        probs = [torch.zeros_like(logits)] if sampled else None
        starts = [cached_len(s) + 1 for s in seqs]
        for i in range(k):
            if i > 0:
                logits = self._step(seqs, [p + i - 1 for p in starts], tokens[-1])
            tok, q = self._propose(logits, seqs, sampled, i)
            tokens.append(tok)
            if sampled:
                probs.append(q)
        chains = Tree.chains(torch.stack(tokens, 1), self.runner.index([1 + c for c in caps]))
        return Draft(chains, k, torch.stack(probs, 1) if sampled else None)

    def _propose(self, logits, seqs, sampled, depth: int):
        """Greedy rows take the argmax; sampled rows draw from q, their sampling distribution (Sampler.draw: the
        draft token at num_tokens + depth). -> tokens [B]
        and q fp32 [B, V] (zero on greedy rows, which the greedy verifier never reads; None if all greedy)."""
        tokens = self.sampler.draw(logits, seqs, depth)
        if not sampled:
            return tokens, None
        rows = self.runner.index(sampled)
        q = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        q.index_copy_(0, rows.long(), self.sampler.probs(logits.index_select(0, rows), [seqs[b].params for b in sampled]))
        return tokens, q

    def _step(self, seqs, starts, tokens) -> torch.Tensor:
        """One draft token per sequence at cache position starts[b] -> the draft's next logits [B, V]."""
        B = len(seqs)
        Bp = self.runner.batch_rows(B)
        plan = self.plan(seqs, starts, [1] * B).padded(Bp)
        g = self.runner.graph(self.graphs, ("sps", Bp), plan, self._step_fn, {"ids": ((Bp,), torch.int64)})
        return g.run(plan, ids=tokens)[:B]

    def _step_fn(self, g):
        rope = g.positions.clamp(max=self.model.cfg.max_position - 1)  # drafts past a cap are never verified
        feature, _ = self.draft_model(g.inputs["ids"], rope, self.draft_layers, g.meta)
        return self.draft_model.logits(feature)

    def catch_up(self, seqs: list[Sequence], v: Verdict):
        """The draft cache keeps its accepted drafts; feed what it has not seen: the bonus token, and the
        last draft when all k were accepted."""
        starts, feeds = [], []
        for s, new in zip(seqs, v.new_tokens):
            seen = min(len(new) - 1, self.k - 1)       # accepted drafts the draft cache already holds
            starts.append(cached_len(s) + 1 + seen)
            feeds.append(new[seen:])
        self._feed(seqs, starts, feeds)

    def _feed(self, seqs, starts, tokens: list[list[int]]):
        """Append tokens[b] to the draft cache from position starts[b]; keep the logits after the last."""
        counts = [len(t) for t in tokens]
        meta, pos, ids = self.runner.meta(self.plan(seqs, starts, counts), ids=[t for ts in tokens for t in ts])
        feature, _ = self.draft_model(ids, pos, self.draft_layers, meta)
        ends = []
        for n in counts:
            ends.append((ends[-1] if ends else 0) + n)
        logits = self.draft_model.logits(feature.index_select(0, self.runner.index([e - 1 for e in ends])))
        for s, row in zip(seqs, logits):
            s.draft_state = row  # the draft's logits after its last token: the next round's first draft
