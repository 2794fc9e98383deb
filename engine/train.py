"""Draft-head trainer: `python -m engine.train --data DIR --out DIR [--head eagle3|eagle] ...`.

Reads the cached target features of engine/data.py, packs conversations into rows of `--seq-len`
tokens, and trains an EAGLE-3 head (training-time test, engine/train_ttt.py) or an EAGLE-1 head. AdamW,
warmup + cosine decay, grad clipping, optional bf16 autocast, DDP under torchrun (WORLD_SIZE > 1).

Resumable at any moment: `<out>/ckpt.pt` (head, optimizer, step, data position, RNG) is written
atomically every `--save-every` steps together with the exported head `<out>/head/` (official
config.json + model.safetensors); `--resume` continues bit-exactly.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from .data import build_draft_vocab, shard_paths, token_counts
from .device import add_device_arg, resolve_device
from .heads import DraftHead, load_head, new_head
from .train_ttt import eagle1_loss, eagle3_loss


# ------------------------------------------------------------------------------------------------ data

FIELDS = ("input_ids", "loss_mask", "hidden", "feature", "target_top1")

class PackedData:
    """Sequences of the cached shards, shuffled per epoch (seeded) and packed greedily into rows of
    `seq_len` tokens (longer ones truncated); batch b of an epoch is a pure function of (seed, epoch, b),
    which is what makes the data position resumable."""

    def __init__(self, root: str | Path, seq_len: int, rows: int, seed: int):
        self.paths = shard_paths(root)
        if not self.paths:
            raise ValueError(f"no shard_*.safetensors under {root} (build them with python -m engine.data)")
        self.seq_len, self.rows, self.seed = seq_len, rows, seed
        self.seqs = []  # (shard index, start, end)
        for si, p in enumerate(self.paths):
            with safe_open(str(p), "pt") as f:
                cu = f.get_tensor("cu_seqlens").tolist()
            self.seqs += [(si, a, min(b, a + seq_len)) for a, b in zip(cu[:-1], cu[1:])]
        self._epoch, self._batches = None, None

    def batches(self, epoch: int) -> list[list[list[int]]]:
        """Epoch -> batches -> rows -> sequence indices."""
        if self._epoch != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            rows, row, used = [], [], 0
            for k in torch.randperm(len(self.seqs), generator=g).tolist():
                n = self.seqs[k][2] - self.seqs[k][1]
                if used + n > self.seq_len and row:
                    rows.append(row)
                    row, used = [], 0
                row.append(k)
                used += n
            rows.append(row)
            self._epoch = epoch
            self._batches = [rows[i:i + self.rows] for i in range(0, len(rows), self.rows)]
        return self._batches

    def load(self, rows: list[list[int]]) -> dict[str, torch.Tensor]:
        """-> input_ids, pos, doc, loss_mask, target_top1 [B, S], hidden [B, S, 3H], feature [B, S, H]
        (right-padded; padding is its own conversation, never scored)."""
        parts = [[self._read(k) for k in row] for row in rows]
        S = max(sum(p["input_ids"].shape[0] for p in row) for row in parts)
        out = {}
        for name in FIELDS:
            out[name] = torch.stack([_pad(torch.cat([p[name] for p in row]), S) for row in parts])
        for name in ("input_ids", "loss_mask", "target_top1"):
            out[name] = out[name].long()
        doc = [torch.cat([torch.full((p["input_ids"].shape[0],), j) for j, p in enumerate(row)]) for row in parts]
        pos = [torch.cat([torch.arange(p["input_ids"].shape[0]) for p in row]) for row in parts]
        out["doc"] = torch.stack([_pad(d, S, len(row)) for d, row in zip(doc, parts)])
        out["pos"] = torch.stack([_pad(p, S) for p in pos])
        return out

    def _read(self, k: int) -> dict[str, torch.Tensor]:
        si, a, b = self.seqs[k]
        with safe_open(str(self.paths[si]), "pt") as f:
            return {n: f.get_slice(n)[a:b] for n in FIELDS}


def _pad(x: torch.Tensor, S: int, fill=0) -> torch.Tensor:
    if x.shape[0] == S:
        return x
    return torch.cat([x, torch.full((S - x.shape[0], *x.shape[1:]), fill, dtype=x.dtype)])


# ----------------------------------------------------------------------------------------------- model

class HeadLoss(nn.Module):
    """The head plus its loss in one module, so DDP sees one forward per step. The target's LM head is
    a plain attribute: frozen, not a parameter or buffer (DDP neither syncs nor broadcasts it)."""

    def __init__(self, head: DraftHead, lm_weight: torch.Tensor, steps: int):
        super().__init__()
        self.head, self.steps = head, steps
        self.lm_weight = lm_weight

    def forward(self, batch):
        if self.head.kind == "eagle3":
            return eagle3_loss(self.head, self.lm_weight, batch, self.steps)
        return eagle1_loss(self.head, self.lm_weight, batch)


def make_head(args, target) -> DraftHead:
    torch.manual_seed(args.seed)
    if args.init:  # warm start: weights and draft vocabulary of an exported head
        head = load_head(args.init, target, kind=args.head).float().train()
        if args.head == "eagle3" and head.lm_head.out_features != args.draft_vocab:
            raise ValueError(f"--init head has a {head.lm_head.out_features}-token draft vocabulary, "
                             f"--draft-vocab says {args.draft_vocab}")
        if args.rebuild_vocab:
            counts = token_counts(args.data, target.cfg.vocab_size)
            remap_draft_vocab(head, target, *build_draft_vocab(counts, args.draft_vocab, target.cfg.vocab_size))
        return head
    if args.head == "eagle":
        return new_head("eagle", target).float().train()
    head = new_head("eagle3", target, draft_vocab_size=args.draft_vocab).float().train()
    counts = token_counts(args.data, target.cfg.vocab_size)
    d2t, t2d = build_draft_vocab(counts, args.draft_vocab, target.cfg.vocab_size)
    head.d2t.copy_(d2t)
    head.t2d.copy_(t2d)
    return head


@torch.no_grad()
def remap_draft_vocab(head: DraftHead, target, d2t: torch.Tensor, t2d: torch.Tensor) -> float:
    """Moves a trained EAGLE-3 head to a new draft vocabulary of the same size (one built from more data).
    Tokens in both keep their trained LM-head rows. A new token's row is the target's LM-head row for it
    mapped into the draft's output space by A [H, H], the least-squares fit of the kept draft rows from
    the target's rows of the same tokens (W_draft ~ W_target @ A). -> the fit's R^2 over the old rows."""
    Vd = head.lm_head.out_features
    old_ids, new_ids = torch.arange(Vd) + head.d2t, torch.arange(Vd) + d2t
    w_draft, w_target = head.lm_head.weight, target.lm_head.weight.float()  # [Vd, H], [V, H]
    A = torch.linalg.lstsq(w_target[old_ids], w_draft).solution           # [H, H]
    fitted = w_target[old_ids] @ A
    r2 = 1 - (fitted - w_draft).square().sum() / (w_draft - w_draft.mean(0)).square().sum()
    row_of_old = torch.full((t2d.numel(),), -1, dtype=torch.long)
    row_of_old[old_ids] = torch.arange(Vd)
    rows = row_of_old[new_ids]                                              # [Vd]: old row or -1
    w_new = torch.where((rows >= 0)[:, None], w_draft[rows.clamp(min=0)], w_target[new_ids] @ A)
    head.lm_head.weight.copy_(w_new)
    head.d2t.copy_(d2t)
    head.t2d.copy_(t2d)
    return r2.item()


def lr_at(step: int, args) -> float:
    """Linear warmup to --lr, then cosine decay to --lr * --min-lr-ratio at --steps."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


# ----------------------------------------------------------------------------------------- checkpoints

def save_checkpoint(out: Path, head: DraftHead, opt, state: dict, target):
    """ckpt.pt (all training state, what --resume reads) replaced atomically; then head/ (the official
    export, --export-dtype) rebuilt from a complete head.tmp/, so a kill at any moment leaves a
    consistent ckpt.pt and at worst a head/ one save behind."""
    torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "state": state,
                "rng": torch.get_rng_state()}, out / "ckpt.pt.tmp")
    os.replace(out / "ckpt.pt.tmp", out / "ckpt.pt")
    shutil.rmtree(out / "head.tmp", ignore_errors=True)
    export_head(head, target, out / "head.tmp", state["export_dtype"])
    shutil.rmtree(out / "head", ignore_errors=True)
    os.replace(out / "head.tmp", out / "head")


def export_head(head: DraftHead, target, path: Path, dtype: str):
    """A copy of the head in `dtype`, saved in the official format; EAGLE-3 configs get the official
    architecture name and an untied draft LM head, which public engines read."""
    copy = new_head(head.kind, target, **({"draft_vocab_size": head.lm_head.out_features}
                                          if head.kind == "eagle3" else {}))
    copy.load_state_dict(head.state_dict())
    copy.to({"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]).save(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["torch_dtype"] = dtype
    if head.kind == "eagle3":
        cfg.update(architectures=["LlamaForCausalLMEagle3"], tie_word_embeddings=False)
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


# ------------------------------------------------------------------------------------------------ loop

def train(args, target=None) -> dict:
    """Runs (or resumes) training to `args.steps` on `args.device`; returns the last logged record.
    A `target` passed in is moved to that device."""
    from tqdm import tqdm
    if args.rebuild_vocab and not (args.init and args.head == "eagle3"):
        raise ValueError("--rebuild-vocab moves a trained EAGLE-3 head (--init) to a new draft vocabulary; "
                         "a fresh head builds its vocabulary from --data anyway")
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    device = resolve_device(args.device)
    if world > 1:
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if target is None:
        from .loader import load_model
        target = load_model(args.model, torch.float32, str(device))[0]
    target.to(device).requires_grad_(False)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    head = make_head(args, target).to(device)
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    state = {"step": 0, "epoch": 0, "batch": 0, "export_dtype": args.export_dtype, "elapsed": 0.0}
    if args.resume and (out / "ckpt.pt").exists():
        ck = torch.load(out / "ckpt.pt", weights_only=True, map_location="cpu")  # a GPU run resumes on a CPU
        head.load_state_dict(ck["head"])
        opt.load_state_dict(ck["opt"])
        state.update(ck["state"])
        torch.set_rng_state(ck["rng"])
    model = HeadLoss(head, target.lm_head.weight, args.ttt_steps)
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    data = PackedData(args.data, args.seq_len, args.rows, args.seed)
    log = open(out / "train_log.jsonl", "a") if rank == 0 else None
    bar = tqdm(total=args.steps, initial=state["step"], disable=rank != 0 or args.quiet, dynamic_ncols=True)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")
    rec, t0, start = {}, time.time() - state["elapsed"], state["step"]
    while state["step"] < args.steps:
        batches = data.batches(state["epoch"])
        if state["batch"] >= len(batches) // world * world:  # every rank gets the same number of batches
            state["epoch"], state["batch"] = state["epoch"] + 1, 0
            continue
        batch = {k: v.to(device) for k, v in data.load(batches[state["batch"] + rank]).items()}
        for g in opt.param_groups:
            g["lr"] = lr_at(state["step"], args)
        with amp:
            loss, acc, n = model(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(head.parameters(), args.clip)
        opt.step()
        state["step"] += 1
        state["batch"] += world
        state["elapsed"] = time.time() - t0
        rec = {"step": state["step"], "epoch": state["epoch"], "loss": round(loss.item(), 5),
               "acc": [round(a, 4) for a in acc.tolist()], "n": n.tolist(), "lr": g["lr"],
               "gnorm": round(gnorm.item(), 4), "elapsed": round(state["elapsed"], 1)}
        if log:
            log.write(json.dumps(rec) + "\n")
            log.flush()
        bar.update(1)
        bar.set_postfix(loss=f"{rec['loss']:.3f}", acc=" ".join(f"{a:.2f}" for a in rec["acc"]))
        stop = args.stop_after and state["step"] - start >= args.stop_after
        if rank == 0 and (state["step"] % args.save_every == 0 or state["step"] == args.steps or stop):
            save_checkpoint(out, head, opt, state, target)
        if stop:
            break
    bar.close()
    if world > 1:
        torch.distributed.destroy_process_group()
    return rec


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Train an EAGLE-3 (training-time test) or EAGLE-1 draft head.")
    p.add_argument("--data", required=True, help="cache directory of python -m engine.data")
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="smollm2-135m", help="the target (its embedding and LM head)")
    p.add_argument("--head", choices=["eagle3", "eagle"], default="eagle3")
    p.add_argument("--draft-vocab", type=int, default=16384)
    p.add_argument("--init", help="start from this exported head (e.g. to continue on new data) instead of "
                                  "a fresh one; a fresh optimizer and schedule")
    p.add_argument("--rebuild-vocab", action="store_true",
                   help="with --init: rebuild the draft vocabulary from --data's token counts, keeping the "
                        "trained LM-head rows of tokens that stay (see remap_draft_vocab)")
    p.add_argument("--ttt-steps", type=int, default=7, help="unrolled training-time-test steps (EAGLE-3)")
    p.add_argument("--steps", type=int, default=1000, help="total optimizer steps")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per packed row")
    p.add_argument("--rows", type=int, default=1, help="rows per batch (per rank)")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--clip", type=float, default=0.5)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="autocast dtype")
    p.add_argument("--export-dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--stop-after", type=int, default=0, help="stop (with a checkpoint) after this many steps "
                   "of this invocation: training in resumable pieces")
    add_device_arg(p)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv=None) -> int:
    from .loader import ModelNotFoundError
    args = parser().parse_args(argv)
    try:
        resolve_device(args.device)  # before any data or model is read
        rec = train(args)
    except (ModelNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
