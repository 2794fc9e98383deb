"""Load on the OpenAI-compatible server: the official `openai` client on loopback, several concurrencies.

    python benchmarks/serve_load.py [--methods vanilla,eagle3,auto] [--concurrency 1,4,16,64]
        [--max-tokens 128] [--requests 2] [--reps 2] [--threads 2] [--max-seconds 180] [--device cpu]
        [--prefill-chunks 0,256] [--workload chat|mixed|both]

One `python -m engine.serve` process per contender (a method, and with several --prefill-chunks each chunk size
of it: `vanilla@256`; 0 = every admitted prompt whole in one step), all started first (an idle server waits on a
condition and takes no CPU); then, for each repetition and level, the contenders take turns, so load drift on a
shared machine hits them alike.

Workload `chat`: a level sends max(8, requests x concurrency) streamed chat requests (held-out ShareGPT first
turns of <= 1000 characters, greedy, `max_tokens` each, natural stops) from `concurrency` client workers, and
stops sending after --max-seconds. Per level and contender: requests completed, total tokens/s (completion
tokens / wall time of the level), time to first token and inter-token latency p50 / p99 (per request: (last
chunk - first chunk) / (tokens - 1), the decode pace a reader sees).

Workload `mixed`: --streams requests decode (--stream-tokens each, min_tokens so none stops early); once each
has streamed --steady-tokens chunks, a burst of --burst prompts arrives at once, half long (held-out prompts
joined to ~--long-chars characters) and half short, --burst-tokens each. Per contender: the streams' gaps
between chunks before the burst, once all are decoding (steady), and while it prefills (gaps overlapping its
arrival to its last first token): p50 / p99 / max, and the burst's time to first token. With chunked prefill
the streams keep a pace through the burst (issue 25: burst p99 within 3x the p50); without it they stall for
the burst's whole prefill.

Medians over repetitions; a PNG and a JSON next to --out.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, name: str, args):
        self.method, self.port = name, free_port()
        method, _, chunk = name.partition("@")
        cmd = [sys.executable, "-m", "engine.serve", "--port", str(self.port), "--method", method,
               "--max-batch", str(max(args.concurrency + [args.streams + args.burst])), "--device", args.device]
        if chunk:
            cmd += ["--prefill-chunk", chunk]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        if args.kv_cache_gb:
            cmd += ["--kv-cache-gb", str(args.kv_cache_gb)]
        self.log = open(Path(tempfile.gettempdir()) / f"serve_load.{method}.{self.port}.log", "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait(self, timeout: float = 300):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.method} server exited ({self.proc.returncode}); see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"{self.method} server did not start in {timeout} s")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


async def one_request(client, model: str, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or now
            last = now
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return {"ttft": (first or time.perf_counter()) - t0, "tokens": tokens,
            "itl": (last - first) / (tokens - 1) if first and tokens > 1 else None}


async def level(url: str, prompts: list[str], concurrency: int, n: int, max_tokens: int, max_seconds: float) -> dict:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=max_seconds + 600)
    model = (await client.models.list()).data[0].id
    queue = list(range(n))
    results, failures = [], 0
    t0 = time.perf_counter()

    async def worker():
        nonlocal failures
        while queue and time.perf_counter() - t0 < max_seconds:
            i = queue.pop(0)
            try:
                results.append(await one_request(client, model, prompts[i % len(prompts)], max_tokens))
            except openai.APIError:
                failures += 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    await client.close()
    ttft = sorted(r["ttft"] for r in results)
    itl = sorted(r["itl"] for r in results if r["itl"] is not None)
    pct = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")
    return {"sent": n - len(queue), "completed": len(results), "failed": failures,
            "tokens": sum(r["tokens"] for r in results), "wall_s": wall,
            "tok_s": sum(r["tokens"] for r in results) / wall,
            "ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99), "itl_p50": pct(itl, 0.5), "itl_p99": pct(itl, 0.99)}


async def timed_stream(client, model: str, prompt: str, max_tokens: int, times: list[float]) -> float:
    """A streamed greedy chat request that decodes max_tokens tokens; appends each content chunk's arrival time
    to `times`. -> the request's start time."""
    t0 = time.perf_counter()
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
        stream=True, extra_body={"min_tokens": max_tokens})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
    return t0


async def mixed(url: str, prompts: list[str], long_prompts: list[str], args) -> dict:
    """The mixed workload (module docstring): running streams, then a burst of long and short prompts."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=1800)
    model = (await client.models.list()).data[0].id
    stream_times = [[] for _ in range(args.streams)]
    streams = [asyncio.create_task(timed_stream(client, model, prompts[i], args.stream_tokens, stream_times[i]))
               for i in range(args.streams)]
    while min(len(t) for t in stream_times) < args.steady_tokens:  # every stream decoding for a while
        await asyncio.sleep(0.01)
        if any(t.done() for t in streams):
            raise SystemExit("a stream ended before the burst: raise --stream-tokens")
    t_all = max(t[0] for t in stream_times)  # the last stream's first token: from here on, steady decoding
    burst_prompts = [long_prompts[i // 2] if i % 2 == 0 else prompts[args.streams + i] for i in range(args.burst)]
    burst_times = [[] for _ in burst_prompts]
    t_burst = time.perf_counter()
    burst = await asyncio.gather(*(timed_stream(client, model, p, args.burst_tokens, t)
                                   for p, t in zip(burst_prompts, burst_times)))
    t_end = max(t[0] for t in burst_times)
    ended = [max(t) for t in stream_times]
    await asyncio.gather(*streams)
    await client.close()
    if min(ended) < t_end:
        print("  warning: a stream ended before the burst's last first token (raise --stream-tokens)")
    steady, during = [], []
    for times in stream_times:
        for a, b in zip(times, times[1:]):
            if b <= t_burst:
                if a >= t_all:
                    steady.append(b - a)
            elif a < t_end:  # the gap overlaps the burst's prefill
                during.append(b - a)
    ttft = sorted(t[0] - s for t, s in zip(burst_times, burst))
    pct = lambda xs, q: sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")
    return {"steady_p50": pct(steady, 0.5), "steady_p99": pct(steady, 0.99), "burst_p50": pct(during, 0.5),
            "burst_p99": pct(during, 0.99), "burst_max": max(during, default=float("nan")),
            "burst_ttft_p50": pct(ttft, 0.5), "burst_ttft_p99": pct(ttft, 0.99), "burst_s": t_end - t_burst,
            "gaps_during": len(during)}


def long_texts(prompts: list[str], n: int, chars: int) -> list[str]:
    """n prompts of ~chars characters: held-out prompts joined, asking for a summary."""
    out, i = [], 0
    for _ in range(n):
        parts = []
        while sum(map(len, parts)) < chars:
            parts.append(prompts[i % len(prompts)])
            i += 1
        out.append("Summarize these requests in one sentence each:\n\n" + "\n\n".join(parts))
    return out


def load_prompts(n: int) -> list[str]:
    """n distinct chat prompts of <= 1000 characters: held-out ShareGPT first turns, then the train split's."""
    from train.data import source_prompts
    out = {}
    for split in ("heldout", "train"):
        out |= {p: None for p in source_prompts("sharegpt", split, 16 * n) if len(p) <= 1000}
        if len(out) >= n:
            break
    return list(out)[:n]


class Prompts:
    """Fresh prompts for each level: a level's contenders get the same ones, no later level repeats them (a
    prompt seen before would be served from the prefix cache)."""

    def __init__(self, pool: list[str]):
        self.pool, self.next = pool, 0

    def take(self, n: int) -> list[str]:
        if self.next + n > len(self.pool):
            print("  warning: prompts exhausted, reusing them (the prefix cache will hit)")
            self.next = 0
        self.next += n
        return self.pool[self.next - n:self.next]


def plot(summary: dict, methods: list[str], levels: list[int], path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for m in methods:
        tok = [summary[m][c]["tok_s"] for c in levels]
        axes[0].plot(levels, tok, marker="o", label=m)
        axes[1].plot(levels, [summary[m][c]["ttft_p50"] for c in levels], marker="o", label=m)
        axes[2].plot(levels, [1000 * summary[m][c]["itl_p50"] for c in levels], marker="o", label=m)
    for ax, title in zip(axes, ("total tokens/s", "time to first token p50 (s)", "inter-token latency p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent requests")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_mixed(summary: dict, names: list[str], path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    x = range(len(names))
    for k, label, off in (("steady_p50", "steady p50", -0.3), ("burst_p50", "during burst p50", -0.1),
                          ("burst_p99", "during burst p99", 0.1), ("burst_max", "during burst max", 0.3)):
        axes[0].bar([i + off for i in x], [1000 * summary[n][k] for n in names], width=0.2, label=label)
    axes[0].set_title("running streams: gap between tokens (ms)")
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=8)
    for k, label, off in (("burst_ttft_p50", "p50", -0.15), ("burst_ttft_p99", "p99", 0.15)):
        axes[1].bar([i + off for i in x], [summary[n][k] for n in names], width=0.3, label=label)
    axes[1].set_title("the burst's time to first token (s)")
    axes[1].legend(fontsize=8)
    for ax in axes:
        ax.set_xticks(list(x), names)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="vanilla,eagle3,auto")
    p.add_argument("--prefill-chunks", default="", help="comma-separated --prefill-chunk values to compare per "
                   "method (default: the server's own)")
    p.add_argument("--workload", default="chat", choices=["chat", "mixed", "both"])
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--requests", type=float, default=2, help="requests per level, as a multiple of concurrency")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--max-seconds", type=float, default=180, help="stop sending at a level after this")
    p.add_argument("--streams", type=int, default=8, help="mixed: running streams")
    p.add_argument("--stream-tokens", type=int, default=768, help="mixed: tokens each stream decodes")
    p.add_argument("--steady-tokens", type=int, default=24, help="mixed: tokens every stream has streamed "
                   "before the burst")
    p.add_argument("--burst", type=int, default=8, help="mixed: prompts arriving at once (half long)")
    p.add_argument("--burst-tokens", type=int, default=16, help="mixed: tokens each burst request decodes")
    p.add_argument("--long-chars", type=int, default=6000, help="mixed: characters of a long prompt")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-cache-gb", type=float, default=None)
    p.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "plots" / "serve_load.png"))
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    chunks = [c for c in args.prefill_chunks.split(",") if c]
    names = [f"{m}@{c}" if chunks else m for m in args.methods.split(",") for c in chunks or [""]]
    os.makedirs(Path(args.out).parent, exist_ok=True)
    per_rep = (sum(max(8, int(args.requests * c)) for c in args.concurrency) if args.workload != "mixed" else 0) + \
        (args.streams + args.burst + (args.burst + 1) // 2 * (args.long_chars // 150 + 1) if args.workload != "chat" else 0)
    prompts = Prompts(load_prompts(args.reps * per_rep))
    servers = {n: ServerProcess(n, args) for n in names}
    chat = args.workload in ("chat", "both")
    runs: dict[str, dict[int, list[dict]]] = {n: {c: [] for c in args.concurrency} for n in names}
    mixed_runs: dict[str, list[dict]] = {n: [] for n in names}
    try:
        for s in servers.values():
            s.wait()
        for rep in range(args.reps):
            order = names if rep % 2 == 0 else names[::-1]
            for c in args.concurrency if chat else []:
                n = max(8, int(args.requests * c))
                level_prompts = prompts.take(n)
                for m in order:
                    r = asyncio.run(level(servers[m].url, level_prompts, c, n, args.max_tokens, args.max_seconds))
                    runs[m][c].append(r)
                    print(f"rep {rep} c={c:3d} {m:12s} {r['completed']}/{r['sent']} done, {r['tok_s']:7.1f} tok/s, "
                          f"ttft p50 {r['ttft_p50']:.2f} s, itl p50 {1000 * r['itl_p50']:.1f} ms", flush=True)
            if args.workload != "chat":
                short = prompts.take(args.streams + args.burst)
                long = long_texts(prompts.take((args.burst + 1) // 2 * (args.long_chars // 150 + 1)),
                                  (args.burst + 1) // 2, args.long_chars)
            for m in order if args.workload != "chat" else []:
                r = asyncio.run(mixed(servers[m].url, short, long, args))
                mixed_runs[m].append(r)
                print(f"rep {rep} mixed {m:12s} gaps steady p50 {1000 * r['steady_p50']:.1f} ms, during the burst "
                      f"p50 {1000 * r['burst_p50']:.1f} / p99 {1000 * r['burst_p99']:.1f} / max "
                      f"{1000 * r['burst_max']:.1f} ms; burst ttft p50 {r['burst_ttft_p50']:.2f} s", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    med = lambda rs, k: statistics.median(r[k] for r in rs)
    summary = {m: {c: {k: med(runs[m][c], k) for k in ("tok_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99")} |
                   {"completed": sum(r["completed"] for r in runs[m][c]), "sent": sum(r["sent"] for r in runs[m][c])}
                   for c in args.concurrency} for m in names} if chat else {}
    mixed_summary = {m: {k: med(mixed_runs[m], k) for k in mixed_runs[m][0]} for m in names} \
        if args.workload != "chat" else {}
    print(f"\nmedians over {args.reps} reps, {args.threads} threads, device {args.device}")
    if chat:
        print(f"\nchat workload, max_tokens {args.max_tokens}")
        print("| concurrency | server | completed | tokens/s | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) |")
        print("|---|---|---|---|---|---|")
        for c in args.concurrency:
            for m in names:
                s = summary[m][c]
                print(f"| {c} | {m} | {s['completed']}/{s['sent']} | {s['tok_s']:.1f} | {s['ttft_p50']:.2f} / "
                      f"{s['ttft_p99']:.2f} | {1000 * s['itl_p50']:.1f} / {1000 * s['itl_p99']:.1f} |")
        if "auto" in names and len(names) > 1:
            print("\nauto / best of the others (tokens/s): " + ", ".join(
                f"c={c}: {summary['auto'][c]['tok_s'] / max(summary[m][c]['tok_s'] for m in names if m != 'auto'):.2f}"
                for c in args.concurrency))
        plot(summary, names, args.concurrency, Path(args.out))
    if mixed_summary:
        print(f"\nmixed workload: {args.streams} streams x {args.stream_tokens} tokens, a burst of {args.burst} "
              f"prompts (half ~{args.long_chars} characters) x {args.burst_tokens} tokens")
        print("| server | stream gap steady p50 (ms) | during the burst p50 / p99 / max (ms) | burst p99 / steady p50 | "
              "burst TTFT p50 / p99 (s) | burst prefill (s) |")
        print("|---|---|---|---|---|---|")
        for m in names:
            s = mixed_summary[m]
            print(f"| {m} | {1000 * s['steady_p50']:.1f} | {1000 * s['burst_p50']:.1f} / {1000 * s['burst_p99']:.1f} / "
                  f"{1000 * s['burst_max']:.1f} | {s['burst_p99'] / s['steady_p50']:.1f}x | "
                  f"{s['burst_ttft_p50']:.2f} / {s['burst_ttft_p99']:.2f} | {s['burst_s']:.2f} |")
        plot_mixed(mixed_summary, names, Path(args.out).with_name(Path(args.out).stem + "_mixed.png"))
    Path(args.out).with_suffix(".json").write_text(json.dumps(
        {"args": vars(args), "runs": runs, "summary": summary, "mixed_runs": mixed_runs, "mixed": mixed_summary},
        indent=1))
    print(f"plots and JSON next to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
