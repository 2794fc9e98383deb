"""A head's first-step acceptance against how sure the target itself is of the token it is drafting.

On the target's greedy replies to the eighty MT-bench-style prompts (and held-out ShareGPT ones), each
scored first draft (teacher-forced, as train.evaluate's n-alpha at n = 0) is binned by the target's own
probability of its top-1 token at that position. Read with the categories' share of positions in each bin,
it says whether a category is hard for the head because the target's replies there are less predictable
(more positions in the low bins, where every category's drafts miss) or because the head knows it less
(lower acceptance at the same certainty).

    python benchmarks/accept_by_certainty.py [--head engine/heads/smollm2-135m-eagle3] [--sharegpt 60]
        [--tokens 128] [--json out.json] [--png out.png]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.heads import load_head  # noqa: E402
from train.data import Packer, mt_bench_style  # noqa: E402
from train.evaluate import decode  # noqa: E402
from train.features import TargetFeatures, TargetView  # noqa: E402
from train.pipeline import heldout_ids  # noqa: E402
from train.ttt import head_input, shift, take, ttt_unroll, valid_at  # noqa: E402

EDGES = (0.0, 0.3, 0.5, 0.7, 0.9, 1.0001)  # the target's top-1 probability bins


def first_steps(llm, head, features: TargetFeatures, seqs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every scored first draft over `seqs` (prompt + greedy reply): (hit, the target's top-1 probability,
    whether that token lies in the head's draft vocabulary)."""
    drafts = torch.zeros(llm.cfg.vocab_size, dtype=torch.bool)
    drafts[head.to_target(torch.arange(head.d2t.shape[0]))] = True
    data, hits, certainty, known = Packer(seqs, 2048, 4, 0), [], [], []
    for batch in data.batches(0):
        b = features(data.rows_of(batch))
        _, out, idx, _ = next(ttt_unroll(head, b, head_input(head, b), 1))
        valid = take(valid_at(b, 0), idx)
        want = take(shift(b["target_top1"], 1), idx)[valid]
        hits.append(head.to_target(head.logits(out[valid]).argmax(-1)) == want)
        known.append(drafts[want.cpu()])
        with torch.inference_mode():  # the target's distribution at t + 1, the one the draft at t must match
            f = take(shift(b["feature"], 1), idx)[valid]
            certainty.append(torch.cat([llm.model.logits(x).float().softmax(-1).amax(-1) for x in f.split(1024)]))
    return torch.cat(hits).float(), torch.cat(certainty), torch.cat(known)


def table(hit: torch.Tensor, p: torch.Tensor, known: torch.Tensor) -> dict:
    bins = torch.bucketize(p, torch.tensor(EDGES[1:-1]), right=True)
    rows = {}
    for k in range(len(EDGES) - 1):
        m = bins == k
        rows[f"{EDGES[k]:.1f}-{min(EDGES[k + 1], 1.0):.1f}"] = {
            "share": round(m.float().mean().item(), 4),
            "accept": round(hit[m].mean().item(), 4) if m.any() else None,
            "in_vocab": round(known[m].float().mean().item(), 4) if m.any() else None,
            "accept_in_vocab": round(hit[m & known].mean().item(), 4) if (m & known).any() else None}
    return {"positions": len(hit), "accept": round(hit.mean().item(), 4),
            "in_vocab": round(known.float().mean().item(), 4),
            "accept_in_vocab": round(hit[known].mean().item(), 4),
            "mean_certainty": round(p.mean().item(), 4), "bins": rows}


def plot(out: dict, png: str):
    """Acceptance by the target's certainty, a line a group (left), and the groups' shares of positions in each
    certainty bin (right)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    for i, (name, t) in enumerate(out.items()):
        labels = list(t["bins"])
        style = dict(color="black", lw=2.5) if name == "sharegpt" else dict(color=f"C{i}")
        a.plot(labels, [r["accept"] for r in t["bins"].values()], marker="o", label=f"{name} ({t['accept']:.2f})",
               **style)
        b.plot(labels, [r["share"] for r in t["bins"].values()], marker="o", **style)
    a.set(title="first-draft acceptance by the target's top-1 probability", xlabel="target's top-1 probability",
          ylabel="accepted", ylim=(0, 1))
    b.set(title="share of the replies' positions", xlabel="target's top-1 probability", ylabel="share", ylim=(0, 0.6))
    a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--head", default="engine/heads/smollm2-135m-eagle3")
    ap.add_argument("--sharegpt", type=int, default=60, help="held-out ShareGPT prompts (0: none)")
    ap.add_argument("--tokens", type=int, default=128, help="greedy reply tokens a prompt")
    ap.add_argument("--json")
    ap.add_argument("--png")
    args = ap.parse_args(argv)
    if not (Path(args.head) / "config.json").exists():
        print(f"error: no head (config.json) in {args.head}", file=sys.stderr)
        return 2
    from engine.llm import LLM
    llm = LLM()
    head = load_head(args.head, TargetView(llm.model), "eagle3").float().eval()
    features = TargetFeatures(llm, head.capture)
    groups: dict[str, list] = {}
    for c, text in mt_bench_style():
        groups.setdefault(c, []).append(llm.chat_ids(text))
    if args.sharegpt:
        groups["sharegpt"] = heldout_ids(llm, args.sharegpt, 1024)
    out = {}
    for name, prompts in groups.items():
        replies, _ = decode(llm, prompts, args.tokens, "vanilla")
        with torch.no_grad():
            hit, p, known = first_steps(llm, head, features, [(q + r, len(q)) for q, r in zip(prompts, replies) if r])
        out[name] = table(hit, p, known)
        print(json.dumps({name: out[name]}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    if args.png:
        plot(out, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
