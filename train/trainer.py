"""Draft-head trainer over target replies with online target features: an EAGLE-3 head (training-time test
with soft targets, train/ttt.py) or an EAGLE-1 head. AdamW, warmup + cosine decay, grad clipping, optional
bf16 autocast.

The number of steps is --steps, or what the stage's time budget allows: measured over the first steps of a
run, then fixed (and saved), so the schedule ends when the budget does. Resumable at any moment:
`<out>/ckpt.pt` (head, optimizer, step, data position, RNG) is written atomically every --save-every steps
together with the exported head `<out>/head/` (official config.json + model.safetensors); a resumed run
continues bit-exactly.

Under torchrun (train/distributed.py) each rank computes features and loss for its share of every batch's
rows, DistributedDataParallel averages the gradients, and the step's time is the slowest rank's, so every
rank takes the same steps and stops together; rank 0 writes the log and the checkpoints.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path

import torch

from engine.heads import DraftHead, load_head, new_head
from engine.model import MLP, Linear
from . import distributed
from .data import Packer, Seq, build_draft_vocab, reply_counts, reply_dirs_error
from .features import TargetFeatures, TargetView
from .ttt import eagle1_loss, eagle3_loss, scored_counts

PACE_STEPS = 3  # steps of a run timed (after its first) to turn a time budget into a step count


def check_args(args):
    """The training flags' consistency, before anything is loaded (ValueError)."""
    if args.rebuild_vocab and not (args.init and args.head == "eagle3"):
        raise ValueError("--rebuild-vocab moves a trained EAGLE-3 head (--init) to a new draft vocabulary; "
                         "a fresh head builds its vocabulary from the replies anyway")
    if getattr(args, "grow_mlp", 0) and not args.init:
        raise ValueError("--grow-mlp widens a trained head's MLP (--init); a fresh head takes its width from the "
                         "target")
    if getattr(args, "grow_mlp", 0) and args.weight_decay:
        raise ValueError("--grow-mlp keeps the trained weights as they are: give --weight-decay 0 (decay would move "
                         "them)")
    if args.init and not (Path(args.init) / "config.json").exists():
        raise ValueError(f"--init {args.init}: no config.json there (expected an exported head directory)")
    err = reply_dirs_error(getattr(args, "replies_from", []))
    if err:
        raise ValueError(err)
    if args.rows < distributed.world():
        raise ValueError(f"--rows {args.rows} cannot be split across {distributed.world()} ranks: a batch needs "
                         f"at least a row per rank")


def train_dtype(name: str, device: torch.device) -> str:
    """--train-dtype: "auto" is bfloat16 autocast on a GPU (fp32 master weights and optimizer; in fp32 an H200 ran
    its matmuls on the CUDA cores, ~110 ms a step of 4 x 2048 tokens), float32 on a CPU (an AVX2 CPU has no
    native bf16; on the AVX-512 box the losses of 30 steps matched fp32's within 0.2%, benchmarks/RESULTS.md)."""
    if name == "auto":
        return "bfloat16" if device.type == "cuda" else "float32"
    return name


def head_loss(head: DraftHead, lm_weight: torch.Tensor, batch: dict, ttt_steps: int, total=None):
    """-> (loss, per-step accuracy, per-step counts). total: see eagle3_loss."""
    if head.kind == "eagle3":
        return eagle3_loss(head, lm_weight, batch, ttt_steps, total=total)
    return eagle1_loss(head, lm_weight, batch, total=total)


class HeadLoss(torch.nn.Module):
    """head_loss as a module's forward: what DistributedDataParallel wraps (it hooks the gradients of the
    module it runs). batch None: a rank without rows in an epoch's short last batch, which still joins the
    gradient all-reduce, with zeros."""

    def __init__(self, head: DraftHead):
        super().__init__()
        self.head = head

    def forward(self, lm_weight, batch, ttt_steps, total):
        if batch is None:
            zero = sum(p.sum() for p in self.head.parameters()) * 0.0
            return zero, torch.zeros_like(total, dtype=torch.float32), torch.zeros_like(total)
        return head_loss(self.head, lm_weight, batch, ttt_steps, total)


def sharded_backward(ddp, features: TargetFeatures, rows: list, lm_weight: torch.Tensor, ttt_steps: int, amp):
    """This rank's share of a batch's rows (every world-th) forward and backward through DDP. Its loss is
    averaged over the whole batch's counts and scaled by the world size (DDP averages gradients), so the
    gradient is the whole batch's, whatever share of the rows and tokens each rank holds.
    -> the whole batch's (loss, per-step accuracy, per-step counts)."""
    world, head = distributed.world(), ddp.module.head
    share = rows[distributed.rank()::world]
    if share:
        batch = features(share)
        n = scored_counts(head, batch, ttt_steps)
    else:
        batch, n = None, torch.zeros(ttt_steps if head.kind == "eagle3" else 1, dtype=torch.long,
                                     device=lm_weight.device)
    total = distributed.all_reduce(n)
    with amp:
        loss, acc, _ = ddp(lm_weight, batch, ttt_steps, total)
    (loss * world).backward()
    summed = distributed.all_reduce(torch.cat([loss.detach().float()[None], acc.float()]))
    return summed[0], summed[1:], total


def make_head(args, view: TargetView, counts: torch.Tensor) -> DraftHead:
    """A fresh head (EAGLE-3: draft vocabulary = the most frequent reply tokens) or --init's weights."""
    torch.manual_seed(args.seed)
    V = view.cfg.vocab_size
    if args.init:  # warm start: weights and draft vocabulary of an exported head
        head = load_head(args.init, view, kind=args.head).float().train()
        if args.head == "eagle3" and head.lm_head.out_features != min(args.draft_vocab, V):
            raise ValueError(f"--init head has a {head.lm_head.out_features}-token draft vocabulary, "
                             f"--draft-vocab says {args.draft_vocab}")
        if args.rebuild_vocab:
            remap_draft_vocab(head, view, *build_draft_vocab(counts, head.lm_head.out_features, V))
        if getattr(args, "grow_mlp", 0):
            grow_mlp(head, args.grow_mlp)
        return head
    if args.head == "eagle":
        return new_head("eagle", view).float().train()
    head = new_head("eagle3", view, draft_vocab_size=min(args.draft_vocab, V)).float().train()
    d2t, t2d = build_draft_vocab(counts, head.lm_head.out_features, V)
    head.d2t.copy_(d2t)
    head.t2d.copy_(t2d)
    return head


@torch.no_grad()
def grow_mlp(head: DraftHead, width: int):
    """Widen the head's MLP to `width` units and train only the new ones: their gate and up rows start as a
    fresh linear's, their down columns at zero, so the widened head computes what the trained one did (the MLP
    is a sum over its units); every other weight, the trained units' included, keeps its value (gradients off,
    or masked to the new slices: with weight decay 0 AdamW then leaves those slices as they are)."""
    mlp, old = head.layer.mlp, head.cfg.intermediate_size
    if width <= old:
        raise ValueError(f"--grow-mlp {width}: the head's MLP already has {old} units")
    H, dev = head.cfg.hidden_size, mlp.down_proj.weight.device
    fresh = Linear(H, 2 * width, bias=False).to(dev)  # [gate; up] rows, as MLP lays them out
    gate_up, down = fresh.weight.data, torch.zeros(H, width, device=dev)
    gate_up[:old], gate_up[width:width + old] = mlp.gate_up_proj.weight[:old], mlp.gate_up_proj.weight[old:]
    down[:, :old] = mlp.down_proj.weight
    head.cfg = replace(head.cfg, intermediate_size=width)
    head.layer.mlp = MLP(head.cfg).to(dev)
    head.layer.mlp.gate_up_proj.weight.data.copy_(gate_up)
    head.layer.mlp.down_proj.weight.data.copy_(down)
    for p in head.parameters():
        p.requires_grad_(False)
    keep_rows = torch.ones(2 * width, 1, device=dev)
    keep_rows[:old], keep_rows[width:width + old] = 0, 0
    keep_cols = torch.ones(1, width, device=dev)
    keep_cols[:, :old] = 0
    for lin, keep in ((head.layer.mlp.gate_up_proj, keep_rows), (head.layer.mlp.down_proj, keep_cols)):
        lin.weight.requires_grad_(True)
        lin.weight.register_hook(lambda g, keep=keep: g * keep)


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


def lr_at(step: int, total: int, args) -> float:
    """Linear warmup to --lr (at most a tenth of the run), then cosine decay to --lr * --min-lr-ratio at
    `total` (0: not known yet, warmup only)."""
    warmup = max(1, min(args.warmup, total // 10)) if total else args.warmup
    if step < warmup or not total:
        return args.lr * min(1.0, (step + 1) / warmup)
    t = min(1.0, (step - warmup) / max(1, total - warmup))
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
    copy = new_head(head.kind, target, head.cfg.intermediate_size,
                    **({"draft_vocab_size": head.lm_head.out_features} if head.kind == "eagle3" else {}))
    copy.load_state_dict(head.state_dict())
    copy.to({"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]).save(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["torch_dtype"] = dtype
    if head.kind == "eagle3":
        cfg.update(architectures=["LlamaForCausalLMEagle3"], tie_word_embeddings=False)
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


# ------------------------------------------------------------------------------------------------ loop

class StepSplit:
    """Where a run's training steps spend their time: seconds per phase (the target's features, the head's
    forward and backward, the optimizer), summed over this run's steps; a sharded step (several ranks) has its
    features and head as one phase. On a GPU each mark synchronizes (two more syncs a step than the
    loss read already takes), so the phases hold their device time."""

    def __init__(self, device: torch.device):
        self.cuda, self.device = device.type == "cuda", device
        self.total: dict[str, float] = {}
        self.last = 0.0

    def start(self, t: float):
        self.last = t

    def mark(self, phase: str):
        if self.cuda:
            torch.cuda.synchronize(self.device)
        now = time.monotonic()
        self.total[phase] = self.total.get(phase, 0.0) + now - self.last
        self.last = now

    def seconds(self) -> dict[str, float]:
        return {k: round(v, 2) for k, v in self.total.items()}


def train(args, target, features: TargetFeatures, seqs: list[Seq], out: str | Path,
          budget_s: float | None = None) -> dict:
    """Trains (or with args.resume continues) a head on `seqs` (prompt + reply ids) with features from
    `features` (the target's own forward), for args.steps steps or, with steps 0, until `budget_s` seconds
    of training are spent. target: the engine's Llama. -> the last logged record."""
    from tqdm import tqdm
    check_args(args)
    if not args.steps and budget_s is None:
        raise ValueError("give a number of steps or a time budget")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    main = distributed.rank() == 0
    view = TargetView(target)
    device = view.embed_tokens.weight.device
    head = make_head(args, view, reply_counts(seqs, view.cfg.vocab_size)).to(device)
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    state = {"step": 0, "epoch": 0, "batch": 0, "total": args.steps, "elapsed": 0.0,
             "export_dtype": args.export_dtype}
    if args.resume and (out / "ckpt.pt").exists():
        ck = torch.load(out / "ckpt.pt", weights_only=True, map_location="cpu")  # a GPU run resumes on a CPU
        head.load_state_dict(ck["head"])
        opt.load_state_dict(ck["opt"])
        state.update(ck["state"], **({"total": args.steps} if args.steps else {}))
        torch.set_rng_state(ck["rng"])
    if distributed.world() > 1:  # the buffers (rope tables, draft vocabulary) never change: synced once, at init
        ddp = torch.nn.parallel.DistributedDataParallel(HeadLoss(head), forward_sync_buffers=False,
                                                        device_ids=[device.index] if device.type == "cuda" else None)
    data = Packer(seqs, args.seq_len, args.rows, args.seed)
    log = open(out / "train_log.jsonl" if main else os.devnull, "a")
    bar = tqdm(total=state["total"] or None, initial=state["step"], disable=args.quiet or not main,
               dynamic_ncols=True, desc=f"train {head.kind}")
    state["train_dtype"] = train_dtype(args.train_dtype, device)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=state["train_dtype"] == "bfloat16")
    rec, start = {}, state["step"]
    # With a time budget the step count (and so the cosine's end) follows the measured pace: first after
    # PACE_STEPS steps, then again over windows that double, and whenever the count is reached, so that slow
    # first steps (a cold page cache under the replies, the GPU's warm-up) do not end the run early.
    paced = budget_s is not None and not state["total"]
    window, next_pace = None, start + 1 + PACE_STEPS  # window: (step, elapsed) where the pace's window began
    split = StepSplit(device)
    while not (state["total"] and state["step"] >= state["total"]):
        if budget_s is not None and state["elapsed"] >= budget_s:
            if main:
                save_checkpoint(out, head, opt, state, view)
            break
        batches = data.batches(state["epoch"])
        if state["batch"] >= len(batches):
            state["epoch"], state["batch"] = state["epoch"] + 1, 0
            continue
        t0 = time.monotonic()
        split.start(t0)
        rows = data.rows_of(batches[state["batch"]])
        for g in opt.param_groups:
            g["lr"] = lr_at(state["step"], state["total"], args)
        opt.zero_grad(set_to_none=True)
        if distributed.world() > 1:
            loss, acc, n = sharded_backward(ddp, features, rows, view.lm_head.weight, args.ttt_steps, amp)
            split.mark("features and head")
        else:
            batch = features(rows)
            split.mark("features")
            with amp:
                loss, acc, n = head_loss(head, view.lm_head.weight, batch, args.ttt_steps)
            loss.backward()
            split.mark("head")
        gnorm = torch.nn.utils.clip_grad_norm_(head.parameters(), args.clip)
        opt.step()
        loss, gnorm = loss.item(), gnorm.item()  # a sync: the step's device time is in `elapsed`
        split.mark("optimizer")
        state["step"] += 1
        state["batch"] += 1
        # the slowest rank's time: every rank fixes the same step count and stops at the same step
        state["elapsed"] += distributed.reduce([time.monotonic() - t0], "max")[0]
        if paced and state["step"] - start == 1:
            window = (state["step"], state["elapsed"])
        elif paced and state["step"] in (next_pace, state["total"]):
            pace = (state["elapsed"] - window[1]) / (state["step"] - window[0])
            state["total"] = state["step"] + max(0, int((budget_s - state["elapsed"]) / pace))
            bar.total = state["total"]
            window, next_pace = (state["step"], state["elapsed"]), 2 * state["step"] - start - 1
        rec = {"step": state["step"], "epoch": state["epoch"], "loss": round(loss, 5),
               "acc": [round(a, 4) for a in acc.tolist()], "n": n.tolist(), "lr": g["lr"],
               "gnorm": round(gnorm, 4), "elapsed": round(state["elapsed"], 2), "split": split.seconds()}
        log.write(json.dumps(rec) + "\n")
        log.flush()
        bar.update(1)
        bar.set_postfix(loss=f"{rec['loss']:.3f}", acc=" ".join(f"{a:.2f}" for a in rec["acc"]))
        stop = args.stop_after and state["step"] - start >= args.stop_after
        if main and (state["step"] % args.save_every == 0 or state["step"] == state["total"] or stop):
            save_checkpoint(out, head, opt, state, view)
        if stop:
            break
    bar.close()
    log.close()
    if main and not (out / "head").exists():  # resumed after the last save: nothing left to train
        save_checkpoint(out, head, opt, state, view)
    distributed.barrier()  # the other ranks read the final checkpoint next
    return rec
