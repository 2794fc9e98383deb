"""Speculation under load: total tokens/s of vanilla, fixed EAGLE-3 and the default (`auto`: EAGLE-3 with the
adaptive depth policy) at several concurrencies, offline (all requests of a batch in one LLM.generate).

    python benchmarks/adaptive_batch.py [--batches 1 4 16 64] [--max-tokens 128] [--repeats 3] [--threads 2]
        [--requests 4] [--dtype bfloat16] [--device auto|cpu|cuda]

Prompts: held-out ShareGPT first user turns (train.data, never trained on) through the chat template, at
most --max-prompt-tokens long, repeated to fill the batch. At concurrency B every method serves the same
max(B, --requests) requests, B at a time. Greedy; natural stops; tokens/s = new tokens / wall time of the
generate calls, prefill included. One model load; methods alternate batch by batch (their order rotating
from repeat to repeat) so that load drift on a shared machine hits them alike; `llm.set_method` builds each
run's decoder afresh, but `auto` keeps its policy (its measurements per batch bucket) from run to run, as a
server does. Medians over repeats; the ratio is auto / max(vanilla, eagle3), and auto's depth histogram
counts its rounds per drafted depth.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from train.data import heldout_prompts
from engine.device import DeviceError, add_device_arg, resolve_device
from engine.llm import DTYPES, LLM
from engine.scheduler import SamplingParams

METHODS = ("vanilla", "eagle3", "auto")


def serve(llm: LLM, method: str, prompts: list[list[int]], batch: int, max_tokens: int) -> tuple[float, list[int]]:
    """-> (tokens/s, depth histogram) of serving `prompts` `batch` at a time with a fresh decoder."""
    llm.set_method(method)
    params = SamplingParams(max_new_tokens=max_tokens)
    tokens, hist, t0 = 0, [], time.perf_counter()
    for i in range(0, len(prompts), batch):
        _, stats = llm.generate(prompts[i:i + batch], params)
        tokens += stats.new_tokens
        for d, n in enumerate(stats.extra.get("depth_hist", [])):
            hist += [0] * (d + 1 - len(hist))
            hist[d] += n
    return tokens / (time.perf_counter() - t0), hist


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=4, help="at least this many requests per concurrency")
    ap.add_argument("--max-prompt-tokens", type=int, default=256, help="skip longer prompts")
    ap.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-gb", type=float, default=None,
                    help="default: 2 on a CPU (every request of a 64-batch at once), the device's on a GPU")
    add_device_arg(ap)
    args = ap.parse_args()
    try:
        device = resolve_device(args.device)
    except DeviceError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    most = max(args.batches)
    kv_gb = args.kv_cache_gb or (2.0 if device.type == "cpu" else None)
    llm = LLM(args.model, args.dtype, device=str(device), max_batch=most, threads=args.threads, kv_cache_gb=kv_gb)
    pool = [p for p in map(llm.chat_ids, heldout_prompts(4 * most)) if len(p) <= args.max_prompt_tokens]
    print(f"model={args.model} device={device} dtype={args.dtype} threads={args.threads} "
          f"max_tokens={args.max_tokens} repeats={args.repeats} greedy, {len(pool)} distinct prompts", flush=True)
    for method in METHODS:  # warm-up
        serve(llm, method, pool[:2], 2, 8)
    rates = {(b, m): [] for b in args.batches for m in METHODS}
    hists = {b: [] for b in args.batches}
    for r in range(args.repeats):
        for b in args.batches:
            prompts = [pool[i % len(pool)] for i in range(max(b, args.requests))]
            order = METHODS[r % 3:] + METHODS[:r % 3]
            for m in order:
                rate, hist = serve(llm, m, prompts, b, args.max_tokens)
                rates[b, m].append(rate)
                if m == "auto":
                    hists[b].append(hist)
            print(f"repeat {r + 1} batch {b:3d}: " + "  ".join(f"{m} {rates[b, m][-1]:7.1f}" for m in METHODS)
                  + f"  auto depths {hists[b][-1]}", flush=True)

    print(f"\n{'batch':>5s} {'vanilla':>8s} {'eagle3':>8s} {'auto':>8s} {'auto/best':>9s}  auto depth histogram "
          f"(rounds at d = 0, 1, ..., all repeats)")
    for b in args.batches:
        med = {m: statistics.median(rates[b, m]) for m in METHODS}
        hist = [sum(h[d] for h in hists[b] if d < len(h)) for d in range(max(map(len, hists[b])))]
        print(f"{b:5d} {med['vanilla']:8.1f} {med['eagle3']:8.1f} {med['auto']:8.1f} "
              f"{med['auto'] / max(med['vanilla'], med['eagle3']):8.2f}x  {hist}")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
