"""Where a decoding round's time goes: each C++ op, the Python of the decoder's step, and the Python around it.

    python benchmarks/round_split.py [--methods vanilla,eagle3,auto] [--repeats 3] [--threads 2]
        [--max-tokens 128] [--temperature 0] [--avx2] [--json out.json]

Each method runs in its own process (methods alternated repeat by repeat, so that the machine's drift hits
them alike) over the 10 chat prompts of e2e_cpu_peers.py, one request at a time, greedy (--temperature T:
sampled at T alone, a seed per prompt); `eagle3` is the CPU
default's shape, a chain of 2. Inside a process every `torch.ops.eagle` call made during a decoding round
(`Decoder.step`) is timed, as is the round itself and `LLM.step` around it (prefill chunks apart). Per round,
in ms: the round's wall time (`LLM.step` without its prefill), each op, the Python of the decoder's step (its
time less its ops: metadata, the verdict, the draft's bookkeeping), and the Python around it (`LLM.step` less
the round: the scheduler, an adaptive policy). --avx2 runs the AVX2 kernels on an AVX-512 machine
(EAGLE_CPU_AVX512=0). The timers add ~1 us a call; medians over the repeats.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
METHOD_ARGS = {"eagle3": {"depth": 2, "topk": 1, "tree_tokens": 3}}


def measure(method: str, max_tokens: int, threads: int, temperature: float = 0.0) -> dict:
    """One repeat of `method` over the prompts, in this process -> ms a round by part, and the rounds."""
    import torch
    import torch._ops

    from e2e_cpu_peers import PROMPTS
    from engine.llm import LLM
    from engine.scheduler import SamplingParams

    llm = LLM("smollm2-135m", "bfloat16", device="cpu", weights="auto", threads=threads, max_batch=1,
              kv_cache_gb=0.25, method=method, method_args=METHOD_ARGS.get(method))
    seconds, inside = Counter(), [False]
    packet_call = torch._ops.OpOverloadPacket.__call__

    def timed_op(self, *args, **kwargs):
        if not inside[0]:
            return packet_call(self, *args, **kwargs)
        t0 = time.perf_counter()
        try:
            return packet_call(self, *args, **kwargs)
        finally:
            seconds["op " + self._qualified_op_name.split("::")[-1]] += time.perf_counter() - t0

    def timed(name, fn, flag=False):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            inside[0] = inside[0] or flag
            try:
                return fn(*args, **kwargs)
            finally:
                inside[0] = inside[0] and not flag
                seconds[name] += time.perf_counter() - t0
        return run

    torch._ops.OpOverloadPacket.__call__ = timed_op
    decoder = llm.decoder
    decoder.step = timed("round", decoder.step, flag=True)
    llm.step = timed("llm.step", llm.step)
    llm._prefill = timed("prefill", llm._prefill)
    prompts = [llm.chat_ids(p) for p in PROMPTS]
    llm.generate([prompts[0]], SamplingParams(temperature, max_new_tokens=16, ignore_eos=True, seed=0))  # first use
    seconds.clear()
    rounds = 0
    for i, p in enumerate(prompts):
        _, stats = llm.generate([p], SamplingParams(temperature, max_new_tokens=max_tokens, ignore_eos=True, seed=i))
        rounds += stats.extra.get("rounds", max_tokens) if stats.extra else max_tokens
    ops = {k[3:]: v for k, v in seconds.items() if k.startswith("op ")}
    ms = lambda s: 1e3 * s / rounds  # noqa: E731
    return {"rounds": rounds, "wall": ms(seconds["llm.step"] - seconds["prefill"]),
            "ops": {k: ms(v) for k, v in sorted(ops.items(), key=lambda kv: -kv[1])},
            "python in the step": ms(seconds["round"] - sum(ops.values())),
            "python around it": ms(seconds["llm.step"] - seconds["prefill"] - seconds["round"])}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="vanilla,eagle3,auto")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="sample at this temperature (0: greedy)")
    p.add_argument("--avx2", action="store_true", help="the AVX2 kernels (EAGLE_CPU_AVX512=0)")
    p.add_argument("--json", help="write the per-repeat results here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child, args.max_tokens, args.threads, args.temperature)))
        return 0
    methods = args.methods.split(",")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "benchmarks")])}
    if args.avx2:
        env["EAGLE_CPU_AVX512"] = "0"
    runs = {m: [] for m in methods}
    for r in range(args.repeats):
        for m in methods[r % len(methods):] + methods[:r % len(methods)]:
            out = subprocess.run([sys.executable, __file__, "--child", m, "--max-tokens", str(args.max_tokens),
                                  "--threads", str(args.threads), "--temperature", str(args.temperature)],
                                 env=env, capture_output=True, text=True)
            if out.returncode:
                print(out.stderr[-2000:], file=sys.stderr)
                return 1
            runs[m].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"repeat {r + 1}/{args.repeats} {m}: {runs[m][-1]['wall']:.3f} ms a round", flush=True)
    med = lambda m, f: statistics.median(f(r) for r in runs[m])  # noqa: E731
    weight = {op: max(med(m, lambda r, op=op: r["ops"].get(op, 0.0)) for m in methods)
              for rs in runs.values() for r in rs for op in r["ops"]}
    names = sorted((op for op, w in weight.items() if w >= 0.005), key=lambda op: -weight[op])
    for rs in runs.values():  # the ops of a few rounds only (a request's first feed) as one column
        for r in rs:
            r["ops"]["other ops"] = sum(v for op, v in r["ops"].items() if op not in names)
    names.append("other ops")
    print(f"\nms a round (medians of {args.repeats} repeats; {'AVX2' if args.avx2 else 'default'} kernels, "
          f"{args.threads} threads, {f'T = {args.temperature}' if args.temperature else 'greedy'})")
    print("| method | rounds | wall | " + " | ".join(names) + " | Python in the step | Python around it |")
    print("|---|---|---|" + "---|" * len(names) + "---|---|")
    for m in methods:
        cells = [f"{med(m, lambda r, op=op: r['ops'].get(op, 0.0)):.3f}" for op in names]
        print(f"| {m} | {med(m, lambda r: r['rounds']):.0f} | {med(m, lambda r: r['wall']):.3f} | " + " | ".join(cells)
              + f" | {med(m, lambda r: r['python in the step']):.3f} | {med(m, lambda r: r['python around it']):.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
