"""Load on the OpenAI-compatible server: the official `openai` client on loopback, several concurrencies.

    python benchmarks/serve_load.py [--methods vanilla,eagle3,auto] [--concurrency 1,4,16,64]
        [--max-tokens 128] [--requests 2] [--reps 2] [--threads 2] [--max-seconds 180] [--device cpu]

One `python -m engine.serve` process per method, all started first (an idle server waits on a condition
and takes no CPU); then, for each repetition and concurrency, the methods take turns, so load drift on a
shared machine hits them alike. A level sends max(8, requests x concurrency) streamed chat requests
(held-out ShareGPT first turns of <= 1000 characters, greedy, `max_tokens` each, natural stops) from
`concurrency` client workers, and stops sending after --max-seconds. Per level and method: requests
completed, total tokens/s (completion tokens / wall time of the level), time to first token and
inter-token latency p50 / p99 (per request: (last chunk - first chunk) / (tokens - 1), the decode pace a
reader sees). Medians over repetitions; a PNG and a JSON next to --out.
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
    def __init__(self, method: str, args):
        self.method, self.port = method, free_port()
        cmd = [sys.executable, "-m", "engine.serve", "--port", str(self.port), "--method", method,
               "--max-batch", str(max(args.concurrency)), "--device", args.device]
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


def load_prompts(n: int) -> list[str]:
    from train.data import heldout_prompts
    return [p for p in heldout_prompts(8 * n) if len(p) <= 1000][:n]


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="vanilla,eagle3,auto")
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--requests", type=float, default=2, help="requests per level, as a multiple of concurrency")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--max-seconds", type=float, default=180, help="stop sending at a level after this")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-cache-gb", type=float, default=None)
    p.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "plots" / "serve_load.png"))
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    methods = args.methods.split(",")
    os.makedirs(Path(args.out).parent, exist_ok=True)
    prompts = load_prompts(max(64, 2 * max(args.concurrency)))
    servers = {m: ServerProcess(m, args) for m in methods}
    runs: dict[str, dict[int, list[dict]]] = {m: {c: [] for c in args.concurrency} for m in methods}
    try:
        for s in servers.values():
            s.wait()
        for rep in range(args.reps):
            for c in args.concurrency:
                n = max(8, int(args.requests * c))
                for m in (methods if rep % 2 == 0 else methods[::-1]):
                    r = asyncio.run(level(servers[m].url, prompts, c, n, args.max_tokens, args.max_seconds))
                    runs[m][c].append(r)
                    print(f"rep {rep} c={c:3d} {m:8s} {r['completed']}/{r['sent']} done, {r['tok_s']:7.1f} tok/s, "
                          f"ttft p50 {r['ttft_p50']:.2f} s, itl p50 {1000 * r['itl_p50']:.1f} ms", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    med = lambda rs, k: statistics.median(r[k] for r in rs)
    summary = {m: {c: {k: med(runs[m][c], k) for k in ("tok_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99")} |
                   {"completed": sum(r["completed"] for r in runs[m][c]), "sent": sum(r["sent"] for r in runs[m][c])}
                   for c in args.concurrency} for m in methods}
    print(f"\nmedians over {args.reps} reps, max_tokens {args.max_tokens}, {args.threads} threads, device {args.device}")
    print("| concurrency | method | completed | tokens/s | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) |")
    print("|---|---|---|---|---|---|")
    for c in args.concurrency:
        for m in methods:
            s = summary[m][c]
            print(f"| {c} | {m} | {s['completed']}/{s['sent']} | {s['tok_s']:.1f} | {s['ttft_p50']:.2f} / "
                  f"{s['ttft_p99']:.2f} | {1000 * s['itl_p50']:.1f} / {1000 * s['itl_p99']:.1f} |")
    if "auto" in methods and len(methods) > 1:
        print("\nauto / best of the others (tokens/s): " + ", ".join(
            f"c={c}: {summary['auto'][c]['tok_s'] / max(summary[m][c]['tok_s'] for m in methods if m != 'auto'):.2f}"
            for c in args.concurrency))
    plot(summary, methods, args.concurrency, Path(args.out))
    Path(args.out).with_suffix(".json").write_text(json.dumps({"args": vars(args), "runs": runs, "summary": summary},
                                                              indent=1))
    print(f"plot: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
