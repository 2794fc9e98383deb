"""Held-out evaluation of a trained head, and the EAGLE-1 vs EAGLE-3 comparison.

`evaluate` (the pipeline's last stage), on held-out prompts and greedy decoding:
- the engine's own speculative decoding with the exported head, one prompt at a time: a chain (top-1
  drafts, `chain_depth` deep) and a tree (EAGLE-2 dynamic: depth, top-k, verified tokens); tau (tokens per
  verify round), acceptance by depth, decode tokens/s and the speedup over vanilla, whether the output
  equals vanilla's (it must);
- n-alpha: chain-draft acceptance with n self-predicted inputs (EAGLE's n-alpha) on the target's own
  greedy replies, teacher-forced, with target features from the engine's forward;
- where the caller passes them, MT-bench-style prompts (issue 23 item 3's set: the pipeline passes the ten of
  train.data.MT_BENCH_STYLE, --heads all eighty of train.data.mt_bench_style()): the chain's tau on them and
  n-alpha on their greedy replies ("mt_bench_style").

    python -m train.evaluate --compare runs/e1 runs/e3 --png runs/e1_vs_e3.png   # n-alpha by step, one plot
    python -m train.evaluate --heads engine/heads/smollm2-135m-eagle3 runs/new/train/head [--prompts 20]
        [--mt-prompts 80]
        # heads side by side on the served target (this machine, default weights): held-out ShareGPT and the
        # MT-bench-style prompts, the chain of 3 and the 3/2/6 tree
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from engine.heads import load_head
from .data import Packer, Seq, mt_bench_style
from .features import TargetFeatures, TargetView
from .ttt import n_alpha


def n_alpha_on(head, features: TargetFeatures, seqs: list[Seq], steps: int, seq_len: int = 2048,
               rows: int = 4) -> tuple[list[float], list[int]]:
    """n-alpha for n = 0 .. steps-1 over `seqs` (prompt + greedy reply). -> (alpha, scored positions)."""
    data = Packer(seqs, seq_len, rows, 0)
    hits, counts = torch.zeros(steps), torch.zeros(steps)
    for batch in data.batches(0):
        h, c = n_alpha(head, features(data.rows_of(batch)), steps)
        hits, counts = hits + h.cpu(), counts + c.cpu()
    return (hits / counts.clamp(min=1)).tolist(), counts.long().tolist()


def chain_accept_length(alpha: list[float]) -> float:
    """Expected tokens per verify round of a greedy chain of len(alpha) drafts: 1 + sum_k prod_{j<=k}
    alpha_j (alpha_j: acceptance given all earlier drafts accepted)."""
    total, p = 1.0, 1.0
    for a in alpha:
        p *= a
        total += p
    return total


def decode(llm, prompts: list[list[int]], max_new_tokens: int, method: str, method_args: dict | None = None,
           desc: str | None = None):
    """Greedy, one prompt at a time, after a short warm-up (CUDA graph capture, lazy init) not counted.
    -> (outputs, summary: tokens/s and, when speculative, tau and acceptance by depth over all rounds)."""
    from tqdm import tqdm
    from engine.scheduler import SamplingParams
    llm.set_method(method, method_args)
    llm.generate([prompts[0]], SamplingParams(max_new_tokens=min(4, max_new_tokens)))
    outs, new, decode_s, total_s, rounds, reached = [], 0, 0.0, 0.0, 0, []
    for p in tqdm(prompts, desc=desc, disable=desc is None, dynamic_ncols=True):
        (seq,), stats = llm.generate([p], SamplingParams(max_new_tokens=max_new_tokens))
        s = stats.as_dict()
        outs.append(seq.output_ids)
        new, decode_s = new + s["new_tokens"], decode_s + s["decode_s"]
        total_s += s["decode_s"] + s["prefill_s"]
        for d, a in enumerate(s.get("accept_by_depth", [])):
            reached += [0.0] * (d + 1 - len(reached))
            reached[d] += a * s["rounds"]
        rounds += s.get("rounds", 0)
    out = {"new_tokens": new, "decode_tok_s": round(new / max(decode_s, 1e-9), 2),
           "tok_s": round(new / max(total_s, 1e-9), 2)}
    if method != "vanilla":
        n = max(rounds, 1)
        out.update(tau=round(1 + sum(reached) / n, 3), rounds=rounds,
                   accept_by_depth=[round(r / n, 4) for r in reached])
    return outs, out


def evaluate(llm, head_dir: str | Path, kind: str, prompts: list[list[int]], max_new_tokens: int,
             chain_depth: int, tree: tuple[int, int, int], alpha_steps: int, seq_len: int = 2048,
             progress: bool = False, mt_prompts: list[list[int]] = (), mt_categories: list[str] = ()) -> dict:
    """-> eval.json's content (see the module docstring); with `mt_prompts` (MT-bench-style prompts as chat
    ids) also their n-alpha on the target's greedy replies ("mt_bench_style"), and with `mt_categories` (theirs,
    prompt by prompt) its first step by category. Leaves `llm` on vanilla decoding."""
    if not prompts:
        raise ValueError("no held-out prompt to evaluate on (all longer than --max-prompt?)")
    head_dir = str(head_dir)
    try:
        ref, vanilla = decode(llm, prompts, max_new_tokens, "vanilla", desc="eval vanilla" if progress else None)
        runs = {"vanilla": vanilla}
        shapes = {"chain": (chain_depth, 1, chain_depth + 1), "tree": tree}
        for name, (depth, topk, tokens) in shapes.items():
            outs, runs[name] = decode(llm, prompts, max_new_tokens, kind,
                                      {"head": head_dir, "depth": depth, "topk": topk, "tree_tokens": tokens},
                                      desc=f"eval {name}" if progress else None)
            runs[name].update(shape=[depth, topk, tokens], same_as_vanilla=outs == ref,
                              decode_speedup=round(runs[name]["decode_tok_s"] / vanilla["decode_tok_s"], 3),
                              speedup=round(runs[name]["tok_s"] / vanilla["tok_s"], 3))
    finally:
        llm.set_method("vanilla")
    view = TargetView(llm.model)
    head = load_head(head_dir, view, kind).float().eval()
    features = TargetFeatures(llm, head.capture)
    seqs = [(p + o, len(p)) for p, o in zip(prompts, ref) if o]
    alpha, counts = n_alpha_on(head, features, seqs, alpha_steps, seq_len)
    extra = {}
    if mt_prompts:  # their greedy replies (vanilla), the chain's acceptance on them, and n-alpha
        mt_ref, _ = decode(llm, list(mt_prompts), max_new_tokens, "vanilla")
        try:
            mt_outs, mt_chain = decode(llm, list(mt_prompts), max_new_tokens, kind,
                                       {"head": head_dir, "depth": chain_depth, "topk": 1, "tree_tokens": chain_depth + 1})
        finally:
            llm.set_method("vanilla")
        mt_seqs = [(p + o, len(p)) for p, o in zip(mt_prompts, mt_ref) if o]
        mt_alpha, mt_counts = n_alpha_on(head, features, mt_seqs, alpha_steps, seq_len)
        extra["mt_bench_style"] = {
            "prompts": len(mt_prompts), "n_alpha": [round(a, 4) for a in mt_alpha], "n_alpha_counts": mt_counts,
            "n_alpha_chain_accept_len": round(chain_accept_length(mt_alpha[:chain_depth]), 3),
            "chain": {k: mt_chain[k] for k in ("tau", "rounds", "accept_by_depth")} | {"same_as_vanilla": mt_outs == mt_ref}}
        if mt_categories:
            by = {}
            for c, p, o in zip(mt_categories, mt_prompts, mt_ref):
                if o:
                    by.setdefault(c, []).append((p + o, len(p)))
            extra["mt_bench_style"]["first_step_by_category"] = {
                c: round(n_alpha_on(head, features, s, 1, seq_len)[0][0], 4) for c, s in by.items()}
    return {"kind": kind, "prompts": len(prompts), "max_new_tokens": max_new_tokens,
            "n_alpha": [round(a, 4) for a in alpha], "n_alpha_counts": counts,
            "n_alpha_chain_accept_len": round(chain_accept_length(alpha[:chain_depth]), 3), **extra, **runs}


def plot(evals: dict[str, dict], png: str | Path):
    """n-alpha by step of each run (left) and acceptance by depth of their chain and tree decoding (right)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (name, e) in enumerate(evals.items()):
        a.plot(range(len(e["n_alpha"])), e["n_alpha"], marker="o", color=f"C{i}", label=name)
        for style, run in (("-", "chain"), ("--", "tree")):
            if run in e:
                r = e[run]
                b.plot(range(1, len(r["accept_by_depth"]) + 1), r["accept_by_depth"], style, marker="o",
                       color=f"C{i}", label=f"{name} {run} {tuple(r['shape'])}: tau {r['tau']:.2f}")
    a.set(title="n-alpha on held-out replies (greedy, teacher-forced)", xlabel="n (self-predicted inputs)",
          ylabel="acceptance rate", ylim=(0, 1))
    b.set(title="engine decoding: rounds accepting >= d drafts", xlabel="depth d", ylabel="fraction of rounds",
          ylim=(0, 1))
    a.xaxis.get_major_locator().set_params(integer=True)
    b.xaxis.get_major_locator().set_params(integer=True)
    a.legend(fontsize=8)
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(str(png), dpi=110)
    plt.close(fig)


def evaluate_heads(heads: list[str], n_prompts: int, tokens: int, max_prompt: int = 1024,
                   mt_prompts: int = 80) -> dict[str, dict]:
    """Each head directory evaluated on the target as served here (the default model and weights, one LLM for
    all, so their numbers compare): evaluate() on `n_prompts` held-out ShareGPT prompts and on the first
    `mt_prompts` MT-bench-style ones, a chain of 3 and the 3/2/6 tree. -> {head: eval dict}."""
    from engine.llm import LLM
    from .pipeline import heldout_ids
    llm = LLM()
    prompts = heldout_ids(llm, n_prompts, max_prompt)
    categories, texts = zip(*mt_bench_style(mt_prompts))
    mt = [llm.chat_ids(p) for p in texts]
    return {h: evaluate(llm, h, "eagle3", prompts, tokens, 3, (3, 2, 6), 4, mt_prompts=mt, mt_categories=categories)
            for h in heads}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Compare trained heads: n-alpha by step and decoding acceptance, "
                                            "from the eval.json of pipeline runs (--compare, one PNG), or "
                                            "evaluated here side by side (--heads).")
    p.add_argument("--compare", nargs="+", metavar="RUN", help="pipeline output directories")
    p.add_argument("--png")
    p.add_argument("--heads", nargs="+", metavar="DIR", help="EAGLE-3 head directories to evaluate here")
    p.add_argument("--prompts", type=int, default=20, help="held-out ShareGPT prompts (--heads)")
    p.add_argument("--mt-prompts", type=int, default=80,
                   help="MT-bench-style prompts (--heads): the first N of train.data.mt_bench_style()'s 80")
    p.add_argument("--tokens", type=int, default=128, help="greedy tokens a prompt (--heads)")
    p.add_argument("--json", help="--heads: write every evaluation here")
    args = p.parse_args(argv)
    if bool(args.compare) == bool(args.heads) or (args.compare and not args.png):
        p.error("give either --compare RUN ... --png PNG, or --heads DIR ...")
    if not 1 <= args.mt_prompts <= len(mt_bench_style()):
        p.error(f"--mt-prompts must be 1..{len(mt_bench_style())}, got {args.mt_prompts}")
    if args.heads:
        missing = [h for h in args.heads if not (Path(h) / "config.json").exists()]
        if missing:
            print(f"error: no head (config.json) in {', '.join(missing)}", file=sys.stderr)
            return 2
        evals = evaluate_heads(args.heads, args.prompts, args.tokens, mt_prompts=args.mt_prompts)
        for head, e in evals.items():
            mt = e["mt_bench_style"]
            print(json.dumps({"head": head, "sharegpt": {"n_alpha": e["n_alpha"], "chain_tau": e["chain"]["tau"],
                                                         "tree_tau": e["tree"]["tau"]},
                              "mt_bench_style": {"n_alpha": mt["n_alpha"], "chain_tau": mt["chain"]["tau"],
                                                 "first_step_by_category": mt["first_step_by_category"]},
                              "same_as_vanilla": all(r["same_as_vanilla"] for r in (e["chain"], e["tree"], mt["chain"]))}))
        if args.json:
            Path(args.json).write_text(json.dumps(evals, indent=1) + "\n")
        return 0
    evals = {}
    for run in args.compare:
        path = Path(run) / "eval.json"
        if not path.exists():
            print(f"error: {path} does not exist (run python -m train.pipeline --out {run} first)", file=sys.stderr)
            return 2
        e = json.loads(path.read_text())
        evals[f"{'EAGLE-3' if e['kind'] == 'eagle3' else 'EAGLE-1'} ({Path(run).name})"] = e
    plot(evals, args.png)
    for name, e in evals.items():
        print(json.dumps({"run": name, "n_alpha": e["n_alpha"], "chain_tau": e["chain"]["tau"],
                          "tree_tau": e["tree"]["tau"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
