"""How lookup drafts (engine/lookup.py) compare with the EAGLE head's where both could draft.

    python benchmarks/lookup_acceptance.py [--temperature 0] [--max-tokens 128] [--threads 2] [--k 3] [--batch B]

Over the ten MT-bench-style chat prompts of e2e_cpu_peers.py, one request at a time:
  1. the fixed chain of 2 without lookup (the head drafts every round): at each round's start, whether the
     last n tokens (n = 2, 3, 4) occurred earlier in the prompt or reply, the head's accepted drafts there, and
     how many of the k tokens that followed that occurrence the reply goes on with;
  2. the chain of 2 with lookup (the CPU default's drafts): the looked-up rounds by proposal length, and the
     drafts accepted in them.
  3. with --batch B: the chain of 2 with and without lookup, B requests at a time, over those prompts and four
     that a reply quotes (QUOTING): tau and the looked-up chains (sequence-rounds; beside the head's chains in
     a round where only some sequences match) per batch.
Output is vanilla's either way; these are acceptance counts, not timings (e2e_cpu_peers.py times them).
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


QUOTING = [  # prompts a reply answers partly by quoting them
    "Fix the spelling in this paragraph and write it out again: Yesterday I whent to the markett to by some aples "
    "and orangs, but the shop was closd becuase it was a holliday, so I came back home and maked a cake.",
    "Add type hints to this Python function and return the whole function: def area(width, height):\n    if width "
    "< 0 or height < 0:\n        raise ValueError('negative')\n    return width * height",
    "Turn this list into JSON with keys name and age: Alice 31, Bob 27, Carol 45, Dave 38.",
    "Rewrite these sentences as a numbered list: The sun rises in the east. Water boils at 100 degrees. Cats are "
    "mammals. The earth orbits the sun.",
]


def occurrence(ctx: list[int], n: int, k: int) -> list[int] | None:
    """What followed the latest earlier occurrence of ctx's last n tokens (up to k), or None."""
    key = ctx[-n:]
    for j in range(len(ctx) - n - 1, -1, -1):
        if ctx[j:j + n] == key:
            return ctx[j + n:j + n + k]
    return None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--k", type=int, default=3, help="tokens read after an occurrence (part 1)")
    p.add_argument("--batch", type=int, default=0, help="part 3 at this batch size (0: skip it)")
    args = p.parse_args(argv)
    if args.batch < 0:
        p.error("--batch must be >= 0")
    from e2e_cpu_peers import PROMPTS, prompt_seed
    from engine.llm import LLM
    from engine.scheduler import SamplingParams

    def run(lookup: int, on_round):
        llm = LLM("smollm2-135m", "bfloat16", device="cpu", weights="auto", threads=args.threads, max_batch=1,
                  kv_cache_gb=0.25, method="eagle3", method_args={"lookup": lookup})
        step = llm.decoder.step

        def stepped(seqs, depth=0, chunk=None):
            s = seqs[0]
            ctx = s.prompt_ids + s.output_ids
            v = step(seqs, depth, chunk)
            on_round(ctx, len(s.prompt_ids), v)
            return v
        llm.decoder.step = stepped
        outputs = []
        for text in PROMPTS:
            ids = llm.chat_ids(text)
            seqs, _ = llm.generate([ids], SamplingParams(args.temperature, max_new_tokens=args.max_tokens,
                                                         ignore_eos=True, seed=prompt_seed(ids)))
            outputs.append((ids, seqs[0].output_ids))
        return outputs

    rounds = []
    outputs = run(0, lambda ctx, P, v: rounds.append((ctx, P, len(v.new_tokens[0]) - 1)))
    replies = {tuple(ids): out for ids, out in outputs}
    table = collections.defaultdict(lambda: [0, 0, 0])  # (n, matched) -> rounds, head's accepted, lookup's
    for ctx, P, accepted in rounds:
        if len(ctx) <= P:
            continue
        out = replies[tuple(ctx[:P])]
        i = len(ctx) - P  # the reply's next token
        for n in (2, 3, 4):
            follow = occurrence(ctx, n, args.k)
            run_len = 0
            while follow and run_len < len(follow) and i + run_len < len(out) and follow[run_len] == out[i + run_len]:
                run_len += 1
            row = table[n, follow is not None]
            row[0], row[1], row[2] = row[0] + 1, row[1] + accepted, row[2] + run_len
    mode = f"T = {args.temperature}" if args.temperature else "greedy"
    print(f"chain of 2 without lookup, {mode}, {len(PROMPTS)} prompts x {args.max_tokens} tokens")
    print(f"| n | last n tokens recur | rounds | the head's drafts accepted (of 2) | the {args.k} tokens after, accepted |")
    print("|---|---|---|---|---|")
    for (n, matched), (count, head, looked) in sorted(table.items()):
        print(f"| {n} | {'yes' if matched else 'no'} | {count} | {head / count:.2f} | "
              f"{looked / count:.2f} |" if matched else f"| {n} | no | {count} | {head / count:.2f} | - |")

    by_length = collections.defaultdict(list)
    run(3, lambda ctx, P, v: v.looked_up and by_length[v.depth].append(v.lengths[0]))
    print(f"\nchain of 2 with lookup (n = 3): looked-up rounds by proposal length")
    print("| proposed | rounds | accepted (mean) | all accepted |")
    print("|---|---|---|---|")
    for k, acc in sorted(by_length.items()):
        print(f"| {k} | {len(acc)} | {sum(acc) / len(acc):.2f} | {sum(a == k for a in acc)} |")

    if not args.batch:
        return
    print(f"\nchain of 2 at batch {args.batch}: tau per batch, chains looked up (sequence-rounds; rounds without a head)")
    print("| lookup | tau per batch | chains looked up | rounds without a head | outputs as without lookup |")
    print("|---|---|---|---|---|")
    texts, outputs = PROMPTS + QUOTING, {}
    for lookup in (0, 3):
        llm = LLM("smollm2-135m", "bfloat16", device="cpu", weights="auto", threads=args.threads,
                  max_batch=args.batch, kv_cache_gb=0.5, method="eagle3", method_args={"lookup": lookup})
        taus, found, alone, outs = [], 0, 0, []
        for i in range(0, len(texts), args.batch):
            ids = [llm.chat_ids(t) for t in texts[i:i + args.batch]]
            seqs, stats = llm.generate(ids, [SamplingParams(args.temperature, max_new_tokens=args.max_tokens,
                                                            ignore_eos=True, seed=prompt_seed(x)) for x in ids])
            taus.append(stats.extra["tau"])
            found, alone = found + stats.extra["from_context"], alone + stats.extra["looked_up"]
            outs += [s.output_ids for s in seqs]
        outputs[lookup] = outs
        print(f"| {lookup} | {' '.join(f'{t:.3f}' for t in taus)} (mean {sum(taus) / len(taus):.3f}) | {found} | "
              f"{alone} | {'-' if not lookup else outputs[lookup] == outputs[0]} |")


if __name__ == "__main__":
    main()
