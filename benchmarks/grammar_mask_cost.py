"""What a grammar engine costs per token on this CPU: xgrammar against llguidance, with the engine's tokenizer.

    python benchmarks/grammar_mask_cost.py [--model smollm2-135m] [--repeats 20]

Structured output computes, before every token a constrained request decides, the bitmask of the tokens its
grammar allows (on the host), then advances the grammar by the decided token; in a speculative round it does so
once per tree node. This times, for one JSON schema and a realistic JSON answer tokenized by the model's
tokenizer, each engine's one-time setup (the tokenizer's vocabulary index), its compile of the schema (no cache:
a fresh compiler / matcher each repeat), and per token the mask into a [1, V / 32] int32 bitmask and the token's
commit; medians over the answer's tokens and the repeats, and the whole answer (compile + every token's mask
and commit). Also the same for a regex. Both engines are single-threaded here (one matcher); `pip install
xgrammar llguidance` first.

--engine: also what the engine pays per decided token with its grammar engine (Sampler.constrain: the mask and
its application to the target's logits), in a real generation under the schema (one thread, CLI defaults),
for vanilla and `auto` (per verified tree node), beside the median decode step.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "skills": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object",
                    "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                   "zip": {"type": "string"}},
                    "required": ["street", "city"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "skills"],
}
ANSWER = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com",
          "skills": ["mathematics", "poetry", "analytical engines"],
          "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH"}, "active": True}
REGEX = r"[0-9]{3}-[0-9]{3}-[0-9]{4}( \(ext\. [0-9]{1,5}\))?"
REGEX_ANSWER = "555-867-5309 (ext. 42)"


def walk(mask, commit, tokens) -> tuple[list[float], list[float]]:
    """Per token: seconds to compute the mask, seconds to commit the token."""
    masks, commits = [], []
    for t in tokens:
        t0 = time.perf_counter()
        mask()
        t1 = time.perf_counter()
        assert commit(t), f"the grammar rejected token {t}"
        masks.append(t1 - t0)
        commits.append(time.perf_counter() - t1)
    return masks, commits


def xgrammar_engine(tokenizer, vocab: int):
    import xgrammar as xgr
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    setup = time.perf_counter() - t0
    bitmask = xgr.allocate_token_bitmask(1, vocab)

    def compile_(kind, source):
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        grammar = compiler.compile_json_schema(source) if kind == "json" else compiler.compile_regex(source)
        return xgr.GrammarMatcher(grammar)

    def run(matcher, tokens):
        return walk(lambda: matcher.fill_next_token_bitmask(bitmask), matcher.accept_token, tokens)
    return setup, compile_, run


def llguidance_engine(tokenizer, vocab: int):
    import llguidance
    import llguidance.hf
    import llguidance.torch
    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    setup = time.perf_counter() - t0
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)

    def compile_(kind, source):
        grammar = (llguidance.LLMatcher.grammar_from_json_schema(source) if kind == "json" else
                   llguidance.LLMatcher.grammar_from_regex(source))
        matcher = llguidance.LLMatcher(lltok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def run(matcher, tokens):
        return walk(lambda: llguidance.torch.fill_next_token_bitmask(matcher, bitmask),
                    matcher.consume_token, tokens)
    return setup, compile_, run


def measure(name, engine, cases, repeats: int) -> dict:
    setup, compile_, run = engine
    out = {"engine": name, "setup_ms": 1e3 * setup}
    for case, (kind, source, tokens) in cases.items():
        compiles, masks, commits = [], [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            matcher = compile_(kind, source)
            compiles.append(time.perf_counter() - t0)
            m, c = run(matcher, tokens)
            masks += m
            commits += c
        out[case] = {"compile_ms": 1e3 * statistics.median(compiles), "tokens": len(tokens),
                     "mask_us": 1e6 * statistics.median(masks), "mask_p90_us": 1e6 * sorted(masks)[9 * len(masks) // 10],
                     "mask_mean_us": 1e6 * statistics.mean(masks), "commit_us": 1e6 * statistics.median(commits),
                     "answer_ms": 1e3 * (statistics.median(compiles) + (sum(masks) + sum(commits)) / repeats)}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--engine", action="store_true", help="also time the engine's mask per decided token")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from engine.loader import load_tokenizer, resolve_model
    tokenizer = load_tokenizer(resolve_model(args.model))
    vocab = len(tokenizer)
    cases = {"json_schema": ("json", json.dumps(SCHEMA), tokenizer.encode(json.dumps(ANSWER))),
             "regex": ("regex", REGEX, tokenizer.encode(REGEX_ANSWER))}
    print(f"tokenizer {args.model}: vocab {vocab}; answer tokens: json {len(cases['json_schema'][2])}, "
          f"regex {len(cases['regex'][2])}; {args.repeats} repeats")
    for name, make in (("xgrammar", xgrammar_engine), ("llguidance", llguidance_engine)):
        r = measure(name, make(tokenizer, vocab), cases, args.repeats)
        print(f"{name:<11} setup (tokenizer index) {r['setup_ms']:8.1f} ms")
        for case in cases:
            c = r[case]
            print(f"  {case:<11} compile {c['compile_ms']:8.2f} ms   mask {c['mask_us']:7.1f} us/token "
                  f"(p90 {c['mask_p90_us']:6.1f}, mean {c['mask_mean_us']:6.1f})   commit {c['commit_us']:5.1f} us/token   "
                  f"compile + whole answer {c['answer_ms']:6.2f} ms")
    if args.engine:
        engine_cost(args.model)


def engine_cost(model: str, new_tokens: int = 96):
    from engine.llm import LLM
    from engine.scheduler import SamplingParams
    llm = LLM(model, max_batch=1, threads=1)
    ids = llm.chat_ids("Describe a fictional person as JSON.")
    params = SamplingParams(max_new_tokens=new_tokens, structured=("json", json.dumps(SCHEMA)))
    real, calls = llm.sampler.constrain, []

    def timed(logits, seqs, tree=None):
        t0 = time.perf_counter()
        out = real(logits, seqs, tree)
        calls.append((time.perf_counter() - t0, 1 if tree is None else tree.num_nodes))
        return out
    llm.sampler.constrain = timed
    for method in ("vanilla", "auto"):
        llm.set_method(method)
        llm.generate([ids], params)   # warm-up: compile, first-use allocations
        calls.clear()
        seqs, stats = llm.generate([ids], params)
        per_call = statistics.median(t for t, _ in calls[1:])   # the prefill's first
        per_node = statistics.median(t / n for t, n in calls[1:])
        print(f"engine {method:<8} {len(seqs[0].output_ids)} tokens: constrain {1e6 * per_call:6.0f} us a step "
              f"({1e6 * per_node:5.0f} us a verified token), decode step {1e3 * stats.decode_s / stats.steps:5.2f} ms")


if __name__ == "__main__":
    main()
