"""Target features computed online by the engine's own forward (`Llama.forward(..., capture=...)` over
the paged cache, through `LLM.borrow`): no second copy of the target layer, no feature files.

A batch is rows of packed sequences; all its sequences go through the target in one forward (each its own
borrowed sequence of the cache, freed afterwards), so row r is a contiguous slice of the packed output.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.model import Linear, dense_weight


class TargetView(nn.Module):
    """What a head borrows from its target, as fp32 copies (the head trains in fp32 whatever the target's
    dtype): the config, the embedding and the LM head (tied when the target's are)."""

    def __init__(self, target):
        super().__init__()
        self.cfg = target.cfg
        w = dense_weight(target.embed_tokens)                     # dequantized when the target keeps blocks
        self.embed_tokens = nn.Embedding(*w.shape, device=w.device, dtype=torch.float32)
        self.embed_tokens.weight.data.copy_(w)
        self.lm_head = Linear(w.shape[1], target.cfg.vocab_size, bias=False, device=w.device, dtype=torch.float32)
        if target.cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        else:
            self.lm_head.weight.data.copy_(dense_weight(target.lm_head))
        self.requires_grad_(False)


class TargetFeatures:
    """Packed rows of (ids, prompt length) sequences -> a training batch (float32, on the runner's device):
    input_ids, pos, doc, loss_mask, target_top1 [B, S]; feature [B, S, H] (the final normed hidden state);
    hidden [B, S, 3H] (inputs of the `capture` layers, EAGLE-3's low | mid | high) when capture is set.
    Padding is its own conversation (doc = row length), never scored."""

    def __init__(self, llm, capture: tuple[int, ...] = ()):
        self.llm, self.capture = llm, tuple(capture)  # llm: the target, an engine.llm.LLM

    def __call__(self, rows: list[list[tuple[list[int], int]]]) -> dict[str, torch.Tensor]:
        seqs = [s for row in rows for s in row]
        model, runner = self.llm.model, self.llm.runner
        with torch.inference_mode(), self.llm.borrow(len(seqs)) as borrowed:
            feature, captured, cu = borrowed.forward([s for s, _ in seqs], self.capture)
            # the target's next token is read only where that token is a reply token (0 elsewhere)
            need = runner.to_device([i for (s, n), a in zip(seqs, cu) for i in range(a + n - 1, a + len(s))])
            top1 = torch.zeros(feature.shape[0], dtype=torch.long, device=feature.device)              # [T]
            top1[need] = torch.cat([model.logits(f).argmax(-1) for f in feature[need].split(1024)])
        dense = {"feature": feature.float(), "target_top1": top1}                                   # [T, ...]
        if captured:
            dense["hidden"] = torch.cat(captured, -1).float()                                        # [T, 3H]
        lens = [sum(len(s) for s, _ in row) for row in rows]
        S, dev = max(lens), feature.device
        out = {k: torch.stack([_pad(x, S) for x in v.split(lens)]) for k, v in dense.items()}
        parts = [[(torch.tensor(s), torch.arange(len(s)), torch.full((len(s),), j), torch.arange(len(s)) >= n)
                  for j, (s, n) in enumerate(row)] for row in rows]
        for name, k, fill in (("input_ids", 0, 0), ("pos", 1, 0), ("doc", 2, None), ("loss_mask", 3, 0)):
            out[name] = torch.stack([_pad(torch.cat([p[k] for p in row]), S, len(row) if fill is None else fill)
                                     for row in parts]).long().to(dev)
        return out


def _pad(x: torch.Tensor, S: int, fill=0) -> torch.Tensor:
    if x.shape[0] == S:
        return x
    return torch.cat([x, torch.full((S - x.shape[0], *x.shape[1:]), fill, dtype=x.dtype, device=x.device)])
