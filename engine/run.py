"""Command line: `python -m engine.run "your prompt"` (SmolLM2-135M-Instruct, no flags needed)."""
from __future__ import annotations

import argparse
import json
import sys

from .device import add_device_arg
from .loader import DEFAULT_MODEL, REGISTRY, WEIGHTS, ModelNotFoundError
from .llm import DTYPES, LLM
from .scheduler import SamplingParams


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m engine.run", description=__doc__)
    p.add_argument("prompt", nargs="*", help="user message(s); each is put through the chat template")
    add_engine_args(p, max_batch=16)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--prompts-file", help="JSONL: one prompt per line, a string or {\"prompt\": ...}")
    p.add_argument("--json", action="store_true", help="no streaming; one JSON object per prompt")
    p.add_argument("--raw", action="store_true", help="skip the chat template")
    p.add_argument("--json-schema", metavar="SCHEMA", help="structured output: answer JSON valid under this schema "
                   "(a file, or the schema's JSON itself; '{}': any JSON object)")
    p.add_argument("--regex", help="structured output: the answer matches this regular expression")
    p.add_argument("--grammar", metavar="FILE", help="structured output: the answer follows this EBNF "
                   "(root ::= ...) or Lark (start: ...) grammar")
    return p.parse_args(argv)


def structured(args) -> tuple[str, str] | None:
    """SamplingParams.structured from --json-schema / --regex / --grammar (at most one)."""
    given = [(k, v) for k, v in (("json", args.json_schema), ("regex", args.regex), ("grammar", args.grammar))
             if v is not None]
    if len(given) > 1:
        raise ValueError("give at most one of --json-schema, --regex, --grammar")
    if not given:
        return None
    kind, value = given[0]
    if kind == "regex" or kind == "json" and value.lstrip().startswith("{"):
        return kind, value
    try:
        with open(value) as f:
            return kind, f.read()
    except OSError as e:
        raise ValueError(f"--{'json-schema' if kind == 'json' else kind}: {e}") from None


def add_engine_args(p: argparse.ArgumentParser, max_batch: int):
    """The flags that build the engine (shared by engine.run and engine.serve)."""
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"{', '.join(REGISTRY)}, a HF checkpoint directory or a .gguf file")
    add_device_arg(p)
    p.add_argument("--dtype", default=None, choices=list(DTYPES),
                   help="default bfloat16; float32 (with dense weights unless --weights says otherwise) is the "
                        "parity reference, several times slower on a CPU")
    p.add_argument("--weights", default=None, choices=WEIGHTS,
                   help="auto (default, dense for --dtype float32): a GGUF's Q8_0/Q4_1 blocks stay quantized on "
                        "the CPU; dense (or bf16): dequantize to --dtype; q8_0 / q4: (re)quantize the linear "
                        "layers (CPU)")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="run decode, draft and verify steps eagerly on a GPU")
    p.add_argument("--method", default=None, help="decoding method (default: the best available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-gb", type=float, default=None,
                   help="memory budget of the paged KV cache (default 0.5 on a CPU, 80%% of free memory on a GPU)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="recompute every prompt instead of reusing cached prefixes' KV")
    p.add_argument("--max-batch", type=int, default=max_batch, help="most sequences in the running batch")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="most prompt tokens a step prefills beside the running streams' decoding (default 256 on "
                        "a CPU, 2048 on a GPU; 0: every admitted prompt whole in one step)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    for flag, kw in METHOD_FLAGS:
        p.add_argument(flag, **kw)


def build_llm(args) -> LLM:
    """The engine the flags of `add_engine_args` describe (ModelNotFoundError / ValueError on bad ones)."""
    method_args = {flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_")) for flag, _ in METHOD_FLAGS}
    return LLM(args.model, args.dtype, device=args.device, cuda_graphs=args.cuda_graphs,
               kv_cache_gb=args.kv_cache_gb, block_size=args.block_size, max_batch=args.max_batch,
               seed=args.seed, method=args.method or default_method(), weights=args.weights,
               method_args={k: v for k, v in method_args.items() if v is not None}, threads=args.threads,
               prefix_cache=args.prefix_cache, prefill_chunk=args.prefill_chunk)


# Flags the speculative methods read from `method_args` (unset ones keep each method's default).
METHOD_FLAGS = [
    ("--draft", dict(default=None, help="sps draft: a model name/path or early-exit:N")),
    ("--draft-len", dict(type=int, default=None, help="sps: draft chain length k")),
    ("--head", dict(default=None, help="eagle/eagle3 head checkpoint directory")),
    ("--tree", dict(default=None, help="eagle: 'dynamic' (EAGLE-2) or 'static' (EAGLE-1 tree)")),
    ("--depth", dict(type=int, default=None, help="dynamic tree depth D (default: the device's, engine/device.py)")),
    ("--topk", dict(type=int, default=None, help="dynamic tree top-k K (default: the device's; 1 = a chain)")),
    ("--tree-tokens", dict(type=int, default=None, help="dynamic tree: total verified tokens M (default: the device's)")),
    ("--min-prob", dict(type=float, default=None, help="dynamic tree: draft and verify only paths the head gives at "
                        "least this probability, decided per round (default: the device's; 0 = the whole tree)")),
    ("--lookup", dict(type=int, default=None, help="eagle/eagle3 chains: where the last N tokens occurred before in the "
                      "prompt or reply, verify what followed them instead of the head's drafts (default: the device's; 0 = off)")),
    ("--adaptive", dict(action="store_true", default=None, help="eagle/eagle3: pick each round's draft depth (0 = none) by batch size, measured cost and acceptance (auto does)")),
]


def read_prompts(args) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file:
        with open(args.prompts_file) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    item = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{args.prompts_file}:{n}: not JSON ({e.msg})") from None
                if isinstance(item, dict):
                    item = item.get("prompt")
                if not isinstance(item, str):
                    raise ValueError(f"{args.prompts_file}:{n}: expected a string or {{\"prompt\": str}}")
                prompts.append(item)
    if not prompts:
        raise ValueError("no prompt given (pass a prompt or --prompts-file)")
    return prompts


class Streamer:
    """Prints a single sequence's text as it grows (decoding the whole output keeps multi-token
    characters intact)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.printed = tokenizer, ""

    def __call__(self, seq, _new):
        text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        if text.startswith(self.printed):
            sys.stdout.write(text[len(self.printed):])
            sys.stdout.flush()
            self.printed = text


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        params = SamplingParams(args.temperature, args.top_p, args.top_k, args.max_new_tokens,
                                structured=structured(args)).validate()
        prompts = read_prompts(args)
        llm = build_llm(args)
        ids = [llm.chat_ids(p, args.raw) for p in prompts]
        stream = not args.json and len(prompts) == 1
        seqs, stats = llm.generate(ids, params, on_tokens=Streamer(llm.tokenizer) if stream else None)
    except (ModelNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for prompt, seq in zip(prompts, seqs):
        text = llm.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        if args.json:
            print(json.dumps({"prompt": prompt, "output_ids": seq.output_ids, "text": text,
                              "finish_reason": seq.finish_reason, "stats": stats.as_dict()}))
        elif not stream:
            print(f"### {prompt}\n{text}\n")
    if not args.json:
        print()
        print(format_stats(stats.as_dict()), file=sys.stderr)
    return 0


def default_method() -> str:
    """The "auto" method (adaptive EAGLE-3 with a shipped head that fits the target, else vanilla) once a trained
    head ships under engine/heads/<name>/; vanilla until then."""
    from .spec_eagle import HEADS_DIR
    return "auto" if any(HEADS_DIR.glob("*/model.safetensors")) else "vanilla"


def format_stats(s: dict) -> str:
    line = (f"[stats] prompt tokens {s['prompt_tokens']}, new tokens {s['new_tokens']}, "
            f"prefill {s['prefill_tok_s']} tok/s, decode {s['decode_tok_s']} tok/s")
    if "tau" in s:
        line += f", tau {s['tau']:.2f}"
    return line


if __name__ == "__main__":
    sys.exit(main())
