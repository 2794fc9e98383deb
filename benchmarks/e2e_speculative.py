"""Speculative decoding end to end: every method on the same prompts in one run, against our vanilla.

    python benchmarks/e2e_speculative.py [--prompts 4] [--max-tokens 128] [--dtype float32]
        [--head DIR] [--eagle-head DIR] [--batch 1] [--threads 1] [--trees 3,2,6 ...] [--device auto|cpu|cuda]

Prompts: the first user turns of held-out ShareGPT conversations (train.data's split) and HumanEval
problems, each through the chat template. Greedy decoding with natural stops; the model is loaded once,
and each prompt (or batch) runs through every method back to back so that load drift on a shared machine
hits all methods alike. Per dataset and method: end-to-end tokens/s (prefill + decode), speedup over
vanilla, the decode-phase speedup (tokens after the first over the decode rounds' time: what speculation
changes, without the prompt's prefill, which costs all methods alike and caps the end-to-end ratio of
short generations), tau (tokens per verify round), acceptance by depth (fraction of rounds whose accepted
path reached depth d), the draft / verify time split, and how many outputs equal vanilla's token for token.
Heads: --head (EAGLE-3) and --eagle-head (EAGLE-1) default to shipped heads under engine/heads/, else to
untrained ones (shown as "random": they measure the machinery's overhead, not a speedup).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from train.data import heldout_prompts, humaneval_prompts
from engine.device import DeviceError, add_device_arg, resolve_device
from engine.llm import DTYPES, LLM
from engine.scheduler import SamplingParams
from engine.spec_eagle import shipped_head


def method_configs(args, target_cfg) -> list[tuple[str, str, dict]]:
    """(label, method, method_args) in the order they run."""
    e3 = args.head or shipped_head("eagle3", target_cfg) or "random"
    e1 = args.eagle_head or shipped_head("eagle", target_cfg) or "random"
    dyn = {k: v for k, v in (("depth", args.depth), ("topk", args.topk), ("tree_tokens", args.tree_tokens)) if v}
    tag = lambda h: "random" if h == "random" else "trained"
    return [("vanilla", "vanilla", {}),
            ("sps early-exit", "sps", {"draft": args.draft, "draft_len": args.draft_len}),
            (f"eagle static ({tag(e1)})", "eagle", {"head": e1, "tree": "static"}),
            (f"eagle dynamic ({tag(e1)})", "eagle", {"head": e1, **dyn}),
            (f"eagle3 dynamic ({tag(e3)})", "eagle3", {"head": e3, **dyn})] + [
            (f"eagle3 d{d}k{k}m{m} ({tag(e3)})", "eagle3", {"head": e3, "depth": d, "topk": k, "tree_tokens": m})
            for d, k, m in (map(int, t.split(",")) for t in args.trees)]


def decoder(llm: LLM, method: str, method_args: dict) -> tuple:
    """-> what LLM.use takes to switch back to this method: (decoder, its adaptive policy or None)."""
    return llm.set_method(method, method_args), llm.policy


def run(llm: LLM, decoders: dict, prompts: list[list[int]], max_tokens: int, batch: int) -> dict:
    """Each batch of prompts goes through every method back to back, so load drift on a shared machine
    hits all methods alike. -> {label: (outputs, merged stats, wall seconds)}."""
    params = SamplingParams(max_new_tokens=max_tokens)
    outs = {label: [] for label in decoders}
    stats = {label: [] for label in decoders}
    wall = dict.fromkeys(decoders, 0.0)
    for i in range(0, len(prompts), batch):
        for label, dec in decoders.items():
            llm.use(*dec)
            t0 = time.perf_counter()
            seqs, s = llm.generate(prompts[i:i + batch], params)
            wall[label] += time.perf_counter() - t0
            outs[label] += [q.output_ids for q in seqs]
            stats[label].append(s.as_dict())
    return {label: (outs[label], merge(stats[label]), wall[label]) for label in decoders}


def merge(stats: list[dict]) -> dict:
    """Round-weighted tau and acceptance over several runs."""
    out = {key: sum(s[key] for s in stats) for key in ("new_tokens", "prefill_s", "decode_s")}
    rounds = sum(s.get("rounds", 0) for s in stats)
    if rounds:
        depth = max(len(s["accept_by_depth"]) for s in stats)
        out["tau"] = sum(s["tau"] * s["rounds"] for s in stats) / rounds
        out["accept_by_depth"] = [sum(s["accept_by_depth"][d] * s["rounds"] for s in stats
                                      if d < len(s["accept_by_depth"])) / rounds for d in range(depth)]
        out["draft_s"] = sum(s["draft_s"] for s in stats)
        out["verify_s"] = sum(s["verify_s"] for s in stats)
    return out


def report(name: str, rows: list[tuple[str, dict, float, int]], n: int):
    print(f"\n## {name} ({n} prompts)")
    print(f"{'method':28s} {'tok/s':>7s} {'speedup':>8s} {'decode':>7s} {'tau':>5s} {'draft/verify s':>15s} "
          f"{'=vanilla':>9s}  accept by depth")
    # decode: the tokens after each prompt's first (which its prefill produces) over the decode rounds' time
    decode_rate = lambda s: (s["new_tokens"] - n) / s["decode_s"]
    base, base_decode = rows[0][1]["new_tokens"] / rows[0][2], decode_rate(rows[0][1])
    for label, s, wall, same in rows:
        rate = s["new_tokens"] / wall
        spec = "tau" in s
        split = f"{s['draft_s']:.1f}/{s['verify_s']:.1f}" if spec else "-"
        depth = " ".join(f"{a:.2f}" for a in s.get("accept_by_depth", []))
        print(f"{label:28s} {rate:7.2f} {rate / base:7.2f}x {decode_rate(s) / base_decode:6.2f}x "
              f"{s['tau'] if spec else 1:5.2f} {split:>15s} {same:>4d}/{n:<4d}  {depth}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=4, help="per dataset")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=512, help="skip longer prompts")
    ap.add_argument("--dtype", default="float32", choices=list(DTYPES))
    ap.add_argument("--head", help="EAGLE-3 head directory (default: shipped, else untrained)")
    ap.add_argument("--eagle-head", help="EAGLE-1 head directory (default: shipped, else untrained)")
    ap.add_argument("--draft", default="early-exit:10", help="SpS draft")
    ap.add_argument("--draft-len", type=int, default=4)
    ap.add_argument("--depth", type=int)
    ap.add_argument("--topk", type=int)
    ap.add_argument("--tree-tokens", type=int)
    ap.add_argument("--batch", type=int, default=1, help="requests per generate call")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 on shared cores)")
    ap.add_argument("--methods", nargs="+", help="labels' first words to run, e.g. vanilla eagle3")
    ap.add_argument("--trees", nargs="+", default=[], metavar="D,K,M",
                    help="extra EAGLE-3 dynamic trees to compare: depth, top-k, verified tokens")
    add_device_arg(ap)
    args = ap.parse_args()
    try:
        device = resolve_device(args.device)
    except DeviceError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)

    llm = LLM(args.model, args.dtype, device=str(device), max_batch=args.batch, threads=args.threads,
              timing=True)
    fits = lambda ids: len(ids) <= args.max_prompt_tokens
    datasets = {"ShareGPT held-out": [p for p in map(llm.chat_ids, heldout_prompts(4 * args.prompts)) if fits(p)],
                "HumanEval": [p for p in map(llm.chat_ids, humaneval_prompts(4 * args.prompts)) if fits(p)]}
    every = method_configs(args, llm.cfg)
    unknown = sorted(set(args.methods or ()) - {c[0].split()[0] for c in every})
    if unknown:  # e.g. auto, which e2e_cpu_peers.py compares (its policy learns across prompts, in a process of its own)
        sys.exit(f"error: --methods {' '.join(unknown)}: not compared here (choose from "
                 f"{' '.join(sorted({c[0].split()[0] for c in every}))})")
    configs = [c for c in every if c[0] == "vanilla" or not args.methods or c[0].split()[0] in args.methods]
    print(f"model={args.model} device={device} dtype={args.dtype} threads={args.threads} batch={args.batch} "
          f"max_tokens={args.max_tokens} greedy")
    decoders = {label: decoder(llm, method, margs) for label, method, margs in configs}
    for name, prompts in datasets.items():
        prompts = prompts[:args.prompts]
        for dec in decoders.values():  # warm-up
            llm.use(*dec)
            llm.generate([prompts[0]], SamplingParams(max_new_tokens=8))
        results = run(llm, decoders, prompts, args.max_tokens, args.batch)
        ref = results["vanilla"][0]
        report(name, [(label, s, wall, sum(a == b for a, b in zip(outs, ref)))
                      for label, (outs, s, wall) in results.items()], len(prompts))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
