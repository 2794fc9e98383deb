"""What verifying a tree costs: one target forward (+ LM-head logits) over M new tokens, against M = 1 (a decode).

    python benchmarks/verify_cost.py [--dtype bfloat16] [--threads 2] [--context 300] [--rows 1 2 4 6 8 16 32]
        [--greedy] [--plot benchmarks/plots/verify_cost.png] [--device auto|cpu|cuda]

--greedy ends each forward with the greedy tokens (Llama.tokens: what greedy decode and verification steps
take, which a quantized LM head finds without every logit) instead of all the logits (sampling's steps).

A speculative round pays one such forward plus the draft, and yields tau tokens, so this curve decides which
tree sizes can pay off on a machine: where it stays flat, verification is bandwidth-bound (the weights are read
once whatever M is); where it climbs, it is compute-bound. The M tokens are appended after a context of
--context cached tokens as a causal chain, then rolled back, so every repeat sees the same cache. Sizes are
interleaved repeat by repeat so that drift on a shared machine hits them alike; medians.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from engine.device import DeviceError, add_device_arg, resolve_device
from engine.llm import DTYPES, LLM


def forward_ms(llm: LLM, context: int, rows: list[int], repeats: int, device: torch.device,
               greedy: bool = False) -> dict[int, float]:
    times = {m: [] for m in rows}
    head = llm.model.tokens if greedy else llm.model.logits
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def once(m: int) -> float:
        sync()
        t0 = time.perf_counter()
        feature, _, _ = seq.forward([list(range(200, 200 + m))])
        head(feature)
        sync()
        dt = time.perf_counter() - t0
        seq.truncate([context])
        return dt

    with torch.inference_mode(), llm.borrow() as seq:
        if context:
            seq.forward([list(range(100, 100 + context))])
        for m in rows:  # warm-up
            once(m)
        for _ in range(repeats):
            for m in rows:
                times[m].append(once(m))
    return {m: 1e3 * statistics.median(ts) for m, ts in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 8, 12, 16, 24, 32])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--greedy", action="store_true", help="the greedy tokens instead of all the logits")
    ap.add_argument("--plot", help="write the curve to this PNG")
    add_device_arg(ap)
    args = ap.parse_args()
    if args.context < 0 or args.repeats < 1 or min(args.rows) < 1:
        ap.error("--context must be >= 0, --repeats and every --rows value >= 1")
    try:
        device = resolve_device(args.device)
    except DeviceError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if 1 not in args.rows:
        args.rows = [1] + args.rows
    llm = LLM(args.model, args.dtype, device=str(device), threads=args.threads)
    ms = forward_ms(llm, args.context, args.rows, args.repeats, device, args.greedy)
    print(f"model={args.model} device={device} dtype={args.dtype} threads={args.threads} context={args.context} "
          f"head={'greedy' if args.greedy else 'logits'}")
    print(f"{'rows':>5s} {'ms':>7s} {'x decode':>9s} {'ms/row':>7s}")
    for m, t in ms.items():
        print(f"{m:5d} {t:7.1f} {t / ms[1]:8.2f}x {t / m:7.2f}")
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot(list(ms), [t / ms[1] for t in ms.values()], "o-", label="measured")
        ax.plot(list(ms), list(ms), ":", color="gray", label="compute-bound limit (x M)")
        ax.axhline(1, color="gray", lw=0.5)
        ax.set_xlabel("tokens verified in one forward (M)")
        ax.set_ylabel("cost / one decode step")
        ax.set_ylim(0, max(t / ms[1] for t in ms.values()) * 1.2)
        ax.set_title(f"{args.model} {args.dtype} on {device}, {args.threads} threads, context {args.context}",
                     fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
