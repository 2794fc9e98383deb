"""Draft-head training report: loss / per-step accuracy curves from training logs, and n-alpha (chain-draft
acceptance with n self-predicted inputs) of EAGLE-1 vs EAGLE-3 heads on held-out replies (token ids as
train.pipeline stores them; target features computed online by the engine's forward).

    python benchmarks/train_report.py --log eagle3=runs/e3/train_log.jsonl --log eagle1=runs/e1/train_log.jsonl \
        --head eagle3=engine/heads/smollm2-135m-eagle3 --head eagle1=engine/heads/smollm2-135m-eagle1 \
        --heldout sharegpt=runs/e3/replies
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib
import torch

from train.evaluate import chain_accept_length

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PLOTS = Path(__file__).parent / "plots"


def read_log(path: str) -> list[dict]:
    """The last run's records (a resumed run appends; later records of a step win)."""
    by_step = {}
    for line in open(path):
        r = json.loads(line)
        by_step[r["step"]] = r
    return [by_step[s] for s in sorted(by_step)]


def smooth(xs: list[float], k: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc = x if i == 0 else acc + (x - acc) / min(i + 1, k)
        out.append(acc)
    return out


def plot_curves(logs: dict[str, list[dict]], k: int):
    fig, ax = plt.subplots(1, len(logs), figsize=(6 * len(logs), 4), squeeze=False)
    for a, (name, log) in zip(ax[0], logs.items()):
        steps = [r["step"] for r in log]
        a.plot(steps, [r["loss"] for r in log], alpha=0.25, color="C0")
        a.plot(steps, smooth([r["loss"] for r in log], k), color="C0")
        a.set(title=f"{name}: training loss", xlabel="optimizer step", ylabel="loss")
    fig.tight_layout()
    fig.savefig(PLOTS / "train_loss.png", dpi=110)
    fig, ax = plt.subplots(1, len(logs), figsize=(6 * len(logs), 4), squeeze=False)
    for a, (name, log) in zip(ax[0], logs.items()):
        steps = [r["step"] for r in log]
        for i in range(len(log[0]["acc"])):
            a.plot(steps, smooth([r["acc"][i] for r in log], k), label=f"step {i}")
        a.set(title=f"{name}: per-step top-1 accuracy (train batches)", xlabel="optimizer step",
              ylabel="accuracy", ylim=(0, 1))
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(PLOTS / "train_acc.png", dpi=110)


@torch.no_grad()
def heldout_alpha(head, llm, root: str, steps: int, seq_len: int) -> list[float]:
    from train.data import read_replies
    from train.evaluate import n_alpha_on
    from train.features import TargetFeatures
    features = TargetFeatures(llm, head.capture)
    return n_alpha_on(head, features, read_replies(root), steps, seq_len)[0]


def plot_alpha(results: dict[str, dict[str, list[float]]]):
    fig, ax = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for a, (data, by_head) in zip(ax[0], results.items()):
        for name, alpha in by_head.items():
            a.plot(range(len(alpha)), alpha, marker="o", label=name)
        a.set(title=f"n-alpha on held-out {data}", xlabel="n (self-predicted inputs)",
              ylabel="acceptance rate (greedy)", ylim=(0, 1))
        a.legend()
    fig.tight_layout()
    fig.savefig(PLOTS / "n_alpha.png", dpi=110)


def pairs(items: list[str]) -> dict[str, str]:
    return dict(x.split("=", 1) for x in items)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--log", action="append", default=[], help="NAME=train_log.jsonl")
    p.add_argument("--head", action="append", default=[], help="NAME=head directory")
    p.add_argument("--heldout", action="append", default=[],
                   help="NAME=replies directory (train.pipeline's <out>/replies)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--steps", type=int, default=7, help="n = 0 .. steps-1")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--smooth", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    PLOTS.mkdir(parents=True, exist_ok=True)
    summary = {}
    if args.log:
        logs = {name: read_log(path) for name, path in pairs(args.log).items()}
        plot_curves(logs, args.smooth)
        summary["train"] = {name: {"steps": log[-1]["step"], "elapsed_s": log[-1]["elapsed"],
                                   "loss_last": sum(r["loss"] for r in log[-args.smooth:]) / len(log[-args.smooth:]),
                                   "acc_last": [round(sum(r["acc"][i] for r in log[-args.smooth:]) /
                                                      len(log[-args.smooth:]), 4) for i in range(len(log[-1]["acc"]))]}
                            for name, log in logs.items()}
    if args.head and args.heldout:
        from engine.heads import load_head
        from engine.llm import LLM
        from train.features import TargetView
        llm = LLM(args.model, "float32", device="cpu")
        view = TargetView(llm.model)
        heads = {name: load_head(path, view).float() for name, path in pairs(args.head).items()}
        results = {data: {name: heldout_alpha(h, llm, root, args.steps, args.seq_len) for name, h in heads.items()}
                   for data, root in pairs(args.heldout).items()}
        plot_alpha(results)
        summary["n_alpha"] = {d: {n: {"alpha": [round(a, 4) for a in al], "chain_accept_len": round(chain_accept_length(al), 3)}
                                  for n, al in r.items()} for d, r in results.items()}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
