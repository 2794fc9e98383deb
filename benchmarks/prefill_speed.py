"""Prefill speed of this checkout against another one (a `git worktree` of an older commit with its extension
built), prompt lengths side by side: each contender measures in its own process, the two alternate round by
round, and the table holds medians of the per-round times and of their ratios.

    python benchmarks/prefill_speed.py --against /tmp/base [--weights auto] [--dtype bfloat16] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent

_PROBE = """
import json, sys, time
import torch
from engine.llm import LLM
from engine.scheduler import SamplingParams
weights, dtype, threads, reps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
llm = LLM("smollm2-135m", dtype, device="cpu", threads=threads, weights=weights, method="vanilla")
g = torch.Generator().manual_seed(0)
out = {}
for n in map(int, sys.argv[5:]):
    ids = torch.randint(100, 40000, (n,), generator=g).tolist()
    llm.generate([ids], SamplingParams(max_new_tokens=1))  # warm-up: scratch buffers, pages
    times = []
    for _ in range(reps):
        _, stats = llm.generate([ids], SamplingParams(max_new_tokens=1))
        times.append(stats.prefill_s)
    out[n] = sorted(times)[len(times) // 2]
print(json.dumps(out))
"""


def measure(root: Path, args) -> dict[int, float]:
    env = dict(os.environ, PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, "-c", _PROBE, args.weights, args.dtype, str(args.threads), str(args.reps),
                           *map(str, args.lengths)], cwd=root, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"prefill_speed: the run in {root} failed:\n{proc.stderr[-2000:]}")
    return {int(k): v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", type=Path, required=True, help="another checkout, extension built in place")
    p.add_argument("--weights", default="auto")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=5, help="timed prefills per length in a run (median)")
    p.add_argument("--lengths", type=int, nargs="+", default=[40, 150, 500, 1000])
    args = p.parse_args(argv)
    if not (args.against / "engine").is_dir():
        p.error(f"--against {args.against}: not a checkout of this project")
    ours, theirs = [], []
    for _ in range(args.rounds):
        ours.append(measure(HERE, args))
        theirs.append(measure(args.against, args))
    print(f"prefill, {args.weights} weights, {args.dtype}, {args.threads} threads, {args.rounds} alternated rounds")
    print(f"{'tokens':>7} {'this ms':>9} {'other ms':>9} {'this/other time':>16}")
    for n in args.lengths:
        a = statistics.median(r[n] for r in ours) * 1e3
        b = statistics.median(r[n] for r in theirs) * 1e3
        ratio = statistics.median(x[n] / y[n] for x, y in zip(ours, theirs))
        print(f"{n:>7} {a:>9.1f} {b:>9.1f} {ratio:>16.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
