"""Train a draft head in one resumable command, under a wall-clock budget:

    python -m train.pipeline --out runs/e3 --device cuda --minutes 20                 # EAGLE-3
    python -m train.pipeline --out runs/e1 --device cuda --minutes 20 --head eagle    # EAGLE-1, same recipe
    python -m train.evaluate --compare runs/e1 runs/e3 --png runs/e1_vs_e3.png

1. replies: `--num-prompts` prompts (ShareGPT train split, or HumanEval), each with a greedy and
   `--samples-per-prompt` sampled replies from the target through the engine (`LLM.generate`, batched),
   stored as token ids in <out>/replies/ (train/data.py).
2. train: the head on those sequences, target features computed online by the engine's forward
   (train/features.py); EAGLE-3 with the training-time test and soft targets, its draft vocabulary the
   most frequent reply tokens (train/trainer.py, train/ttt.py); checkpoints in <out>/train/.
3. export: <out>/train/head/, the official format (config.json + model.safetensors), with each checkpoint.
4. evaluate: held-out ShareGPT prompts, greedy: n-alpha by step, chain and tree acceptance length and
   speed with the engine's speculative decoding -> <out>/eval.json and <out>/eval.png (train/evaluate.py).

Budget: --minutes of stage work (loading the target aside): replies up to 30% (no new chunk of prompts
starts after it), training up to 85% less what replies used (steps = --steps, or what fits, measured on the
first steps), evaluation the rest; evaluation is not cut short, its size is --eval-prompts x --eval-tokens.
`--resume` continues a killed run: whole reply parts, the training checkpoint and finished stages are kept
(<out>/state.json); time spent in a killed replies stage is not counted again.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from engine.device import add_device_arg, defaults, resolve_device

REPLIES_SHARE, TRAIN_END = 0.30, 0.85  # of the budget: replies' cap, and where training must stop
KEPT_ON_RESUME = ("model", "head", "source", "draft_vocab", "seed")
CUDA_KV_GB = 8.0  # default KV cache on a GPU: 250k+ tokens of a 135M target, 60k of an 8B


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def number(kind, low=0, strict=True):
    """An argparse type: a `kind` > low (>= low when not strict)."""
    def parse(text):
        try:
            x = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if x < low or (strict and x == low):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low}, got {text}")
        return x
    return parse


positive_int, positive_float, count = number(int), number(float), number(int, strict=False)


def tree_shape(text):
    try:
        d, k, m = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected DEPTH,TOPK,TOKENS, got {text!r}") from None
    if d < 1 or k < 1 or m < 2:
        raise argparse.ArgumentTypeError(f"need depth >= 1, topk >= 1, tokens >= 2, got {text}")
    return d, k, m


def parser() -> Parser:
    p = Parser(description="Train an EAGLE-3 or EAGLE-1 draft head: target replies, online features, "
                           "training, export, held-out evaluation.")
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="smollm2-135m", help="the target")
    add_device_arg(p)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="the target's (default: the "
                   "device's); the head trains in fp32")
    p.add_argument("--head", choices=["eagle3", "eagle"], default="eagle3")
    p.add_argument("--minutes", type=positive_float, default=20.0, help="wall-clock budget of the stages")
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    g = p.add_argument_group("replies")
    g.add_argument("--source", choices=["sharegpt", "humaneval"], default="sharegpt")
    g.add_argument("--num-prompts", type=positive_int, default=100_000, help="prompts (the budget may stop earlier)")
    g.add_argument("--samples-per-prompt", type=count, default=2, help="sampled replies besides the greedy one")
    g.add_argument("--max-new-tokens", type=positive_int, default=256)
    g.add_argument("--temperature", type=positive_float, default=1.0, help="of the sampled replies")
    g.add_argument("--max-prompt", type=positive_int, default=1024, help="longer prompts are skipped")
    g.add_argument("--gen-batch", type=positive_int, default=64, help="prompts per generate call and per part")
    g.add_argument("--kv-cache-gb", type=positive_float, help=f"target KV cache (default: {CUDA_KV_GB} on a GPU, "
                   "the engine's on a CPU)")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=count, default=0, help="optimizer steps (0: what the budget allows)")
    g.add_argument("--seq-len", type=positive_int, default=2048, help="tokens per packed row")
    g.add_argument("--rows", type=positive_int, default=4, help="rows per batch")
    g.add_argument("--draft-vocab", type=positive_int, default=16384, help="EAGLE-3 draft vocabulary")
    g.add_argument("--ttt-steps", type=positive_int, default=7, help="unrolled training-time-test steps (EAGLE-3)")
    g.add_argument("--lr", type=positive_float, default=5e-4)
    g.add_argument("--min-lr-ratio", type=float, default=0.1)
    g.add_argument("--warmup", type=positive_int, default=50)
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--clip", type=positive_float, default=0.5)
    g.add_argument("--train-dtype", choices=["float32", "bfloat16"], default="float32", help="autocast dtype")
    g.add_argument("--export-dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    g.add_argument("--save-every", type=positive_int, default=50)
    g.add_argument("--stop-after", type=count, default=0, help="stop (with a checkpoint) after this many "
                   "steps of this invocation: training in pieces")
    g.add_argument("--init", help="start from this exported head instead of a fresh one")
    g.add_argument("--rebuild-vocab", action="store_true", help="with --init: re-pick its draft vocabulary "
                   "from the replies, keeping the trained rows of tokens that stay")
    g = p.add_argument_group("evaluation")
    g.add_argument("--eval-prompts", type=positive_int, default=20, help="held-out ShareGPT prompts")
    g.add_argument("--eval-tokens", type=positive_int, default=128, help="greedy tokens per prompt")
    g.add_argument("--chain-depth", type=positive_int, default=5)
    g.add_argument("--alpha-steps", type=positive_int, default=7, help="n-alpha for n = 0 .. this - 1")
    g.add_argument("--tree", type=tree_shape, help="DEPTH,TOPK,TOKENS of the EAGLE-2 tree (default: the device's)")
    p.add_argument("--threads", type=count, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def load_state(out: Path) -> dict:
    path = out / "state.json"
    return json.loads(path.read_text()) if path.exists() else {"done": [], "replies_s": 0.0}


def save_state(out: Path, state: dict):
    tmp = out / "state.json.tmp"
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, out / "state.json")


def build_llm(args, device: torch.device):
    from engine.llm import LLM
    # On a GPU the engine's default cache takes most of the memory; training needs its share.
    gb = args.kv_cache_gb or (CUDA_KV_GB if device.type == "cuda" else None)
    return LLM(args.model, args.dtype, device=str(device), kv_cache_gb=gb,
               max_batch=min(256, args.gen_batch * (args.samples_per_prompt + 1)), seed=args.seed)


def heldout_ids(llm, n: int, max_prompt: int) -> list[list[int]]:
    """The first `n` held-out ShareGPT prompts of at most `max_prompt` tokens, through the chat template."""
    from .data import sharegpt_conversations
    out = []
    for _, msgs in sharegpt_conversations("heldout"):
        ids = llm.chat_ids(msgs[0]["content"])
        if len(ids) <= max_prompt:
            out.append(ids)
            if len(out) == n:
                break
    return out


def run(args, llm=None) -> dict:
    """All stages (those not finished yet with --resume). llm: an already loaded target (tests).
    -> eval.json's content."""
    from tqdm import tqdm
    from . import data, evaluate, trainer
    from .features import TargetFeatures
    device = resolve_device(args.device)
    trainer.check_args(args)
    out = Path(args.out)
    if (out / "state.json").exists() and not args.resume:
        raise ValueError(f"{out} holds a run: pass --resume to continue it, or choose another --out")
    state = load_state(out)
    for name in KEPT_ON_RESUME:
        was = state.get("args", {}).get(name, getattr(args, name))
        if was != getattr(args, name):
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)} differs from the run's ({was})")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    llm = llm or build_llm(args, device)
    room = llm.scheduler.blocks.num_blocks * llm.scheduler.blocks.block_size
    if room < 2 * args.rows * args.seq_len:  # a batch's sequences, each rounded up to whole blocks
        raise ValueError(f"the KV cache holds {room} tokens, a training batch needs up to 2 x {args.rows} x "
                         f"{args.seq_len}: raise --kv-cache-gb or lower --rows / --seq-len")
    out.mkdir(parents=True, exist_ok=True)
    state["args"] = {k: v for k, v in vars(args).items() if k not in ("resume", "quiet")}
    save_state(out, state)
    budget = args.minutes * 60

    if "replies" not in state["done"]:
        prompts = data.source_prompts(args.source, "train", args.num_prompts)
        bar = tqdm(total=len(prompts), desc="replies (prompts)", disable=args.quiet, dynamic_ncols=True)
        t0 = time.monotonic()
        deadline = t0 + REPLIES_SHARE * budget - state["replies_s"]
        try:
            covered = data.generate_replies(llm, prompts, out / "replies", args.samples_per_prompt, args.max_new_tokens,
                                            args.temperature, max_prompt=args.max_prompt, chunk=args.gen_batch,
                                            seed=args.seed, deadline=deadline, bar=bar)
        finally:
            bar.close()
            state["replies_s"] += time.monotonic() - t0
            save_state(out, state)
        state.update(prompts=covered, done=state["done"] + ["replies"])
        save_state(out, state)
    seqs = data.read_replies(out / "replies")
    state["sequences"], state["reply_tokens"] = len(seqs), sum(len(s) - n for s, n in seqs)

    if "train" not in state["done"]:
        capture = llm.cfg.eagle3_layers if args.head == "eagle3" else ()
        features = TargetFeatures(llm, capture)
        rec = trainer.train(args, llm.model, features, seqs, out / "train",
                            budget_s=TRAIN_END * budget - state["replies_s"])
        ck = torch.load(out / "train" / "ckpt.pt", weights_only=True, map_location="cpu")["state"]
        stopped = args.stop_after and rec and ck["step"] < (ck["total"] or float("inf"))
        state.update(train_steps=ck["step"], train_s=round(ck["elapsed"], 1), last=rec)
        if stopped:
            save_state(out, state)
            return {}
        state["done"].append("train")
        save_state(out, state)

    if "evaluate" not in state["done"]:
        prompts = heldout_ids(llm, args.eval_prompts, args.max_prompt)
        t0 = time.monotonic()
        result = evaluate.evaluate(llm, out / "train" / "head", args.head, prompts, args.eval_tokens,
                                   args.chain_depth, args.tree or defaults(device).tree,
                                   args.alpha_steps, args.seq_len, progress=not args.quiet)
        result.update(device=str(device), model=args.model, replies={
            "prompts": state.get("prompts"), "sequences": state["sequences"], "reply_tokens": state["reply_tokens"],
            "seconds": round(state["replies_s"], 1)}, train={"steps": state.get("train_steps"),
            "seconds": state.get("train_s"), "last": state.get("last")}, eval_s=round(time.monotonic() - t0, 1))
        (out / "eval.json").write_text(json.dumps(result, indent=1) + "\n")
        evaluate.plot({result["kind"]: result}, out / "eval.png")
        state["done"].append("evaluate")
        save_state(out, state)
    return json.loads((out / "eval.json").read_text())


def main(argv=None) -> int:
    from engine.loader import ModelNotFoundError
    args = parser().parse_args(argv)
    try:
        resolve_device(args.device)  # before any model or data is read
        result = run(args)
    except (ModelNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if result:
        print(json.dumps({k: result[k] for k in ("kind", "n_alpha", "chain", "tree", "vanilla")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
