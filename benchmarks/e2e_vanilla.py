"""Vanilla decoding: our engine against transformers' `generate` on the same GGUF, side by side in one run.

    python benchmarks/e2e_vanilla.py [--dtypes bfloat16 float32] [--prompts 5] [--new-tokens 64] [--repeats 1]
        [--device auto|cpu|cuda]

Both sides run on --device; generate exactly --new-tokens tokens per prompt (EOS ignored), batch size 1, greedy, the same
thread count; each prompt is timed end to end (prefill + decode), ours and transformers alternating prompt by
prompt. Prints per-dtype median tokens/s and the ratio of the medians, ours / transformers.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from engine.device import DeviceError, add_device_arg, resolve_device
from engine.llm import DTYPES, LLM
from engine.scheduler import SamplingParams

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a hash map works.",
    "What are the main causes of inflation?",
    "Describe the water cycle for a school report.",
    "Give step-by-step instructions to bake bread.",
    "Why do cats purr?",
    "Compare Python and Rust for systems programming.",
    "Write a limerick about a programmer.",
]


def ours_runner(llm: LLM, new_tokens: int):
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)

    def run(ids) -> int:
        seqs, _ = llm.generate([ids], params)
        return len(seqs[0].output_ids)
    return run


def transformers_runner(model, new_tokens: int, device: torch.device):
    def run(ids) -> int:
        x = torch.tensor([ids], device=device)
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False)
        return out.shape[1] - len(ids)
    return run


def synced(run, device: torch.device):
    """`run` returning only once the device has finished its work (so wall time is the real time)."""
    def call(ids) -> int:
        n = run(ids)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return n
    return call


def paired_rates(runners, prompt_ids, repeats: int) -> list[list[float]]:
    """tokens/s per runner, interleaved prompt by prompt so that machine drift hits both sides alike."""
    for run in runners:
        run(prompt_ids[0])  # warm-up
    rates = [[] for _ in runners]
    for _ in range(repeats):
        for ids in prompt_ids:
            for run, out in zip(runners, rates):
                t0 = time.perf_counter()
                n = run(ids)
                out.append(n / (time.perf_counter() - t0))
    return rates


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=list(DTYPES))
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=1, help="passes over the prompts")
    add_device_arg(ap)
    args = ap.parse_args()
    try:
        device = resolve_device(args.device)
    except DeviceError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    print(f"device={device} threads={args.threads} prompts={args.prompts} new_tokens={args.new_tokens} "
          f"(bs=1, greedy)")
    print(f"{'dtype':10s} {'ours tok/s':>11s} {'hf tok/s':>9s} {'ratio':>6s}")
    for dtype in args.dtypes:
        llm = LLM(dtype=dtype, device=str(device))
        prompt_ids = [llm.chat_ids(p) for p in PROMPTS[:args.prompts]]
        path = llm.source.path
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                  dtype=DTYPES[dtype]).to(device).eval()
        runners = [synced(ours_runner(llm, args.new_tokens), device),
                   synced(transformers_runner(hf, args.new_tokens, device), device)]
        ours, theirs = map(statistics.median, paired_rates(runners, prompt_ids, args.repeats))
        print(f"{dtype:10s} {ours:11.1f} {theirs:9.1f} {ours / theirs:6.2f}x", flush=True)
        del llm, hf


if __name__ == "__main__":
    main()
