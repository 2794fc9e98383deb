"""How well the draft's own confidence predicts acceptance: per chain level, the acceptance of drafts by their
top-1 probability p (EAGLE-2 reads p as the chance a draft is accepted; a confidence cut, `min_prob`, relies on it).

    python benchmarks/draft_calibration.py [--depth 3] [--max-tokens 128] [--threads 2] [--json out.json]

Greedy chains of --depth drafts over the 10 chat prompts of e2e_cpu_peers.py (the shipped head on the quantized
target), drafted level by level through the head's per-op forward (the same drafts as the one-call chain) so
that each level's logits can be read: p = softmax(logits).max() of that level. A level's draft counts as
accepted when the round's accepted length reaches it, and only rounds whose chain reached the level before it
count. Prints acceptance (and rounds) per p bin and level, and the mean p against the acceptance.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

BINS = (0.0, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.01)


def record(depth: int, max_tokens: int, threads: int) -> list[tuple[list[float], int]]:
    """-> per round: each level's top-1 draft probability, and the drafts accepted."""
    from e2e_cpu_peers import PROMPTS
    from engine.llm import LLM
    from engine.scheduler import SamplingParams

    llm = LLM("smollm2-135m", "bfloat16", device="cpu", weights="auto", threads=threads, max_batch=1,
              kv_cache_gb=0.25, method="eagle3", method_args={"depth": depth, "topk": 1, "tree_tokens": depth + 1})
    decoder, rounds, levels = llm.decoder, [], []
    head = decoder.head
    decoder.chain_weights = None  # the per-op chain, whose logits pass through head.logits
    logits_of = head.logits

    def logits(out):
        x = logits_of(out)
        levels.append(torch.softmax(x.float(), -1).max(-1).values[0].item())
        return x

    head.logits = logits
    read = decoder.read

    def read_verdict(seqs, summary, logprobs, draft):
        verdict = read(seqs, summary, logprobs, draft)
        rounds.append((list(levels), verdict.lengths[0]))
        levels.clear()
        return verdict

    decoder.read = read_verdict
    for p in PROMPTS:
        levels.clear()
        llm.generate([llm.chat_ids(p)], SamplingParams(max_new_tokens=max_tokens, ignore_eos=True))
    return rounds


def table(rounds, depth: int) -> list[dict]:
    rows = []
    for j in range(1, depth + 1):
        seen = [(ps[j - 1], accepted >= j) for ps, accepted in rounds if len(ps) >= j and accepted >= j - 1]
        cells = []
        for lo, hi in zip(BINS, BINS[1:]):
            hits = [ok for p, ok in seen if lo <= p < hi]
            cells.append((sum(hits) / len(hits) if hits else None, len(hits)))
        mean_p = sum(p for p, _ in seen) / max(len(seen), 1)
        rate = sum(ok for _, ok in seen) / max(len(seen), 1)
        rows.append({"level": j, "bins": cells, "mean_p": mean_p, "accepted": rate, "rounds": len(seen)})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="write the rounds and the table here")
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    rounds = record(args.depth, args.max_tokens, args.threads)
    rows = table(rounds, args.depth)
    labels = [f"{lo:.1f}-{hi:.1f}" if hi <= 1 else f">= {lo:.1f}" for lo, hi in zip(BINS, BINS[1:])]
    print(f"acceptance by the draft's top-1 probability p (rounds in brackets), {len(rounds)} rounds")
    print("| level | " + " | ".join(labels) + " | all | mean p |")
    print("|---|" + "---|" * (len(labels) + 2))
    for r in rows:
        cells = [f"{a:.2f} ({n})" if a is not None else "-" for a, n in r["bins"]]
        print(f"| {r['level']} | " + " | ".join(cells) + f" | {r['accepted']:.2f} ({r['rounds']}) | {r['mean_p']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": rounds, "table": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
