"""Training-time test (TTT) for draft heads over packed rows of target features (train/features.py).

Notation for one packed row of tokens x_0..x_{S-1} with target features f_t (several conversations, `doc`
ids mark which; `pos` restarts at 0 per conversation). Draft pair t = (hidden_t, x_{t+1}) sits at
position pos_t. Step 0 reads the target's features; step i reads step i-1's outputs at the same t, with
token x_{t+1+i} at position pos_t + i, and predicts x_{t+2+i}: its soft target is the target's
distribution at u = t+1+i. Query t of step i attends to the step-0 keys s <= t of its own conversation
(the real prefix) and to its own keys of steps 1..i (its earlier predictions) -- exactly the draft cache
during a chain draft. The diagonal keys are scored elementwise, and steps >= 1 run only on the
positions some step scores (assistant replies), so a late step costs less than step 0.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from engine.heads import DraftHead, Eagle3Head


def shift(x: torch.Tensor, k: int, fill=0) -> torch.Tensor:
    """x[:, t] -> x[:, t + k] along dim 1, padded with `fill` at the end. x: [B, S, ...]"""
    if k == 0:
        return x
    return torch.cat([x[:, k:], torch.full_like(x[:, :k], fill)], dim=1)


def take(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x: [B, S, ...], idx: [B, S'] -> x[b, idx[b, j]]: [B, S', ...]"""
    return x[torch.arange(x.shape[0], device=x.device)[:, None], idx]


def select(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """keep: bool [B, S] -> (idx [B, S'] of the kept positions in order, padded with 0; ok [B, S'])."""
    n = keep.sum(1)
    width = max(int(n.max()), 1)
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :width]  # kept first, in order
    ok = torch.arange(width, device=keep.device)[None] < n[:, None]
    return torch.where(ok, order, 0), ok


def prefix_mask(doc: torch.Tensor) -> torch.Tensor:
    """doc: [B, S] -> bool [B, S, S]: query t sees key s iff s <= t in the same conversation."""
    S = doc.shape[1]
    causal = torch.ones(S, S, dtype=torch.bool, device=doc.device).tril()
    return causal & (doc[:, :, None] == doc[:, None, :])


def _rotate(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def ttt_attention(attn, x, cos, sin, mask0, past: list):
    """One TTT step of the head's attention. x: [B, S', in_dim] (the step's queries); cos, sin:
    [B, S', D]; mask0: [B, S', S] over the step-0 keys; past: [(k, v)] of earlier steps, step 0's
    [B, Hq, S, D] first, then [B, Hq, S', D] per later step. -> (out [B, S', H], (k, v) of this step)."""
    B, Sq, _ = x.shape
    nq, nkv, hd = attn.nq, attn.nkv, attn.hd
    q, k, v = attn.qkv_proj(x).split([nq * hd, nkv * hd, nkv * hd], -1)
    cos, sin = cos[:, :, None], sin[:, :, None]
    q = q.view(B, Sq, nq, hd)
    k = k.view(B, Sq, nkv, hd)
    q = (q * cos + _rotate(q) * sin).transpose(1, 2)                              # [B, Hq, S', D]
    k = (k * cos + _rotate(k) * sin).transpose(1, 2).repeat_interleave(nq // nkv, 1)
    v = v.view(B, Sq, nkv, hd).transpose(1, 2).repeat_interleave(nq // nkv, 1)
    kvs = past + [(k, v)]
    (k0, v0), S = kvs[0], kvs[0][0].shape[2]
    scale = 1.0 / math.sqrt(hd)
    s0 = (q @ k0.transpose(-1, -2) * scale).masked_fill(~mask0[:, None], float("-inf"))  # [B, Hq, S', S]
    diag = [(q * kj).sum(-1, keepdim=True) * scale for kj, _ in kvs[1:]]                # [B, Hq, S', 1]
    p = torch.softmax(torch.cat([s0, *diag], -1), -1, dtype=torch.float32).to(q.dtype)  # bf16 in, fp32 math
    o = p[..., :S] @ v0
    for j, (_, vj) in enumerate(kvs[1:]):
        o = o + p[..., S + j:S + j + 1] * vj
    return attn.o_proj(o.transpose(1, 2).reshape(B, Sq, nq * hd)), (k, v)


def ttt_step(head: DraftHead, ids, hidden, pos, mask0, past: list):
    """The head's layer (as DraftHead.forward) with TTT attention. -> (out [B, S', H], (k, v))."""
    x, residual = head._layer_input(ids, hidden)
    cos, sin = head.rotary(pos, x.dtype)
    a, kv = ttt_attention(head.layer.self_attn, x, cos, sin, mask0, past)
    return head.layer.mlp_block(residual + a), kv


def valid_at(batch: dict, i: int) -> torch.Tensor:
    """bool [B, S]: step i at t is scored iff x_{t+2+i} is an assistant token of t's conversation."""
    doc = batch["doc"]
    return shift(batch["loss_mask"], 2 + i, 0).bool() & (shift(doc, 2 + i, -1) == doc)


def ttt_unroll(head: DraftHead, batch: dict, hidden: torch.Tensor, steps: int):
    """Yields (i, out_i, idx, ok) for steps 0..steps-1: out_i [B, S_i, H] at positions idx [B, S_i]
    (ok marks real ones). Step 0 runs on all S positions (every one is a key of the real prefix); later
    steps only where some step >= 1 is scored. hidden: the step-0 input [B, S, H]."""
    ids, pos, doc = batch["input_ids"], batch["pos"], batch["doc"]
    B, S = ids.shape
    mask0 = prefix_mask(doc)
    out, kv = ttt_step(head, shift(ids, 1), hidden, pos, mask0, [])
    every = torch.arange(S, device=ids.device).expand(B, S)
    yield 0, out, every, torch.ones_like(every, dtype=torch.bool)
    if steps == 1:
        return
    keep = torch.stack([valid_at(batch, i) for i in range(1, steps)]).any(0)
    idx, ok = select(keep)
    mask, pos, out, past = take(mask0, idx), take(pos, idx), take(out, idx), [kv]
    for i in range(1, steps):
        out, kv = ttt_step(head, take(shift(ids, 1 + i), idx), out, pos + i, mask, past)
        past.append(kv)
        yield i, out, idx, ok


def head_input(head: DraftHead, batch: dict) -> torch.Tensor:
    """Step-0 hidden [B, S, H] from the target features (EAGLE-3: fc over low|mid|high; EAGLE-1: f_t)."""
    dtype = head.fc.weight.dtype
    return head.target_feature(batch["feature"].to(dtype), [batch["hidden"].to(dtype)] if "hidden" in batch else [])


def draft_lm_rows(head: Eagle3Head, lm_weight: torch.Tensor) -> torch.Tensor:
    """The target LM head's rows of the draft tokens [Vd, H]: softmax over them is the target's
    distribution renormalised over the draft vocabulary (the other rows cancel)."""
    return lm_weight[torch.arange(head.d2t.shape[0], device=lm_weight.device) + head.d2t]


def scored_counts(head: DraftHead, batch: dict, steps: int) -> torch.Tensor:
    """The positions each step's loss scores [steps] (EAGLE-1: [1]), known before any forward: ranks that
    split a batch sum them into the whole batch's denominators (`total` below)."""
    if head.kind != "eagle3":
        return valid_at(batch, 0).sum()[None]
    in_vocab = head.t2d[batch["target_top1"]]
    return torch.stack([(valid_at(batch, i) & shift(in_vocab, 1 + i, False)).sum() for i in range(steps)])


def eagle3_loss(head: Eagle3Head, lm_weight, batch: dict, steps: int, decay: float = 0.8, total=None):
    """sum_i decay^i * CE(draft_i, target distribution over the draft vocabulary), scored where the next
    token is an assistant token and the target's top-1 is in the draft vocabulary (else the renormalised
    target is not the target's choice). Step i averages over total[i] positions (default: this batch's
    count; a rank holding part of a batch passes the whole batch's, so the ranks' losses and accuracies
    add up to the batch's). -> (loss, per-step accuracy [steps], per-step counts [steps])."""
    in_vocab = head.t2d[batch["target_top1"]]                                   # [B, S]
    rows = draft_lm_rows(head, lm_weight)                                       # [Vd, H]
    loss, accs, counts = 0.0, [], []
    for i, out, idx, ok in ttt_unroll(head, batch, head_input(head, batch), steps):
        valid = take(valid_at(batch, i) & shift(in_vocab, 1 + i, False), idx) & ok  # [B, S_i]
        logits = head.logits(out[valid])                                         # [N, Vd]
        with torch.no_grad():
            feature = take(shift(batch["feature"], 1 + i), idx)[valid].to(rows.dtype)  # [N, H]
            target = torch.softmax((feature @ rows.T).float(), -1)                  # [N, Vd]
        n = valid.sum()
        mean_over = (n if total is None else total[i]).clamp(min=1)
        ce = -(target * torch.log_softmax(logits, -1)).sum(-1)
        loss = loss + decay ** i * ce.sum() / mean_over
        accs.append((logits.argmax(-1) == target.argmax(-1)).sum() / mean_over)
        counts.append(n)
    return loss, torch.stack(accs).detach(), torch.stack(counts)


def eagle1_loss(head: DraftHead, lm_weight, batch: dict, ce_weight: float = 0.1, total=None):
    """Feature regression (smooth L1 against f_{t+1}) + ce_weight * CE through the target LM head against
    the target's distribution at t+1, averaged over total[0] positions (as in eagle3_loss).
    -> (loss, accuracy [1], count [1])."""
    feature = head_input(head, batch)
    out, _ = ttt_step(head, shift(batch["input_ids"], 1), feature, batch["pos"], prefix_mask(batch["doc"]), [])
    valid = valid_at(batch, 0)
    n = valid.sum()
    pred, want = out[valid], shift(feature, 1)[valid]                            # [N, H]
    with torch.no_grad():
        target = torch.softmax((want @ lm_weight.T.to(want.dtype)).float(), -1)  # [N, V]
    logits = head.logits(pred)
    reg = F.smooth_l1_loss(pred, want, reduction="none").mean(-1)
    ce = -(target * torch.log_softmax(logits, -1)).sum(-1)
    mean_over = (n if total is None else total[0]).clamp(min=1)
    loss = (reg + ce_weight * ce).sum() / mean_over
    acc = (logits.argmax(-1) == target.argmax(-1)).sum() / mean_over
    return loss, acc.detach()[None], n[None]


@torch.no_grad()
def n_alpha(head: DraftHead, batch: dict, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Chain-draft acceptance with n self-predicted inputs (EAGLE's n-alpha), greedy, teacher-forced
    tokens: step n's draft top-1 (as a target id) equals the target's top-1. -> (hits, counts) [steps]."""
    hits, counts = [], []
    for i, out, idx, ok in ttt_unroll(head, batch, head_input(head, batch), steps):
        valid = take(valid_at(batch, i), idx) & ok
        want = take(shift(batch["target_top1"], 1 + i), idx)[valid].long()
        hits.append((head.to_target(head.logits(out[valid]).argmax(-1)) == want).sum())
        counts.append(valid.sum())
    return torch.stack(hits), torch.stack(counts)
