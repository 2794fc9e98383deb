"""This engine against its CPU peers on the same GGUF, one request at a time, greedy (or sampled).

    python benchmarks/e2e_cpu_peers.py [--prompts 10] [--max-tokens 128] [--passes 1] [--threads 2]
        [--weights auto,bf16] [--no-transformers] [--llama-cpp-bin DIR] [--temperature 0] [--top-p 1]
        [--png benchmarks/plots/e2e_cpu_peers.png]

Contenders, each in its own process (no shared thread pools or caches between them), alternated prompt by
prompt (each prompt runs through every contender back to back, in an order that rotates, so load drift on a
shared machine hits all alike):
  - this engine, vanilla and the default method (`auto`: EAGLE-3 with adaptive depth; --methods adds others,
    e.g. `eagle3`, the fixed CPU chain, or `auto:lookup=0`, a method with arguments), per weight format (--weights: auto = the GGUF's own Q4_1/Q8_0 blocks,
    bf16 = dequantized);
  - llama.cpp through llama-cpp-python (optional: `pip install llama-cpp-python`; the same GGUF file, the
    same threads), greedy;
  - native llama.cpp (optional: --llama-cpp-bin, the binaries `bash benchmarks/build_llama_cpp.sh` builds from
    the llama-cpp-python sdist's sources): `llama-completion` on the same GGUF, the prompt as the engine's
    chat-templated text, greedy; one process per prompt, timed by llama.cpp's own counters (prompt eval, then
    eval: decode tokens/s is its eval rate). It reports no token ids, so its output is not compared; and,
    when the build script converted the shipped EAGLE-3 head (bin/eagle3-head.gguf), llama.cpp's EAGLE-3
    (`llama-speculative-simple --spec-type draft-eagle3`, chains of --llama-cpp-draft drafts), timed by its own
    encode / decode counters (decode tokens/s: the tokens it decoded over its decode time);
  - transformers' generate (the GGUF dequantized by transformers, bf16), greedy.
Every contender gets the same chat-templated prompt tokens and generates exactly --max-tokens tokens (EOS
ignored). Reported per contender: decode tokens/s (tokens after the first over the time after the first:
prefill costs all alike), end-to-end tokens/s, medians over prompts, and the ratios the speed targets are
stated in, each the median of per-prompt ratios: to the engine's vanilla (and its worst prompt), to llama.cpp
(native, llama-cpp-python) and to native llama.cpp's EAGLE-3, where they ran; and for the engine's
speculative contenders, tau (tokens a round) and their rounds by drafted depth (how `auto` played). With
--passes N every prompt runs N times per contender (the order rotated each pass) and its figure is the median
of its runs, so a burst of load from a neighbour during one run does not make that prompt the worst. The
engine's speculative outputs are checked token for token against its vanilla outputs of the same weights
(every pass).
Prompts: MT-bench-style chat turns (writing, roleplay, reasoning, math, coding, extraction, STEM,
humanities), written for this benchmark.
--temperature T > 0 samples instead (with --top-p P, nucleus sampling; no top-k or min-p, llama.cpp told the
same), each prompt with its own seed (the same every pass); the engine's speculative outputs must still equal its
vanilla's token for token (a sampled token is a keyed draw: engine/sampler.py). llama-cpp-python and
transformers run greedy only.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import zlib
from pathlib import Path

import torch

from engine.llm import LLM
from engine.loader import resolve_model
from engine.scheduler import SamplingParams
from train.data import MT_BENCH_STYLE

PROMPTS = MT_BENCH_STYLE  # ten MT-bench-style chat prompts (train/data.py)


def method_spec(spec: str) -> tuple[str, dict]:
    """A --methods entry: 'eagle3:depth=3:tree_tokens=4' -> ("eagle3", {"depth": 3, "tree_tokens": 4}) (the
    engine's method arguments, engine.run's flags without dashes; numbers parsed)."""
    name, *pairs = spec.split(":")
    args = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not key or not eq:
            raise ValueError(f"method argument {pair!r} in {spec!r} is not key=value")
        for kind in (int, float):
            try:
                value = kind(value)
                break
            except ValueError:
                pass
        args[key] = value
    return name, args


class Engine:
    """One engine per (weights, method): a method's state (the adaptive policy's timings and acceptance) lives
    on across prompts, as in a server."""

    def __init__(self, model: str, weights: str, threads: int, method: str, temperature: float = 0.0,
                 top_p: float = 1.0):
        name, method_args = method_spec(method)
        self.llm = LLM(model, "bfloat16", device="cpu", weights=weights, threads=threads, max_batch=1,
                       kv_cache_gb=0.25, method=name, method_args=method_args)
        self.temperature, self.top_p = temperature, top_p
        self.rounds, self.reached, self.depths, self.looked_up = 0, 0.0, [], 0  # over the timed runs (`speculation`)

    def chat_ids(self, text: str) -> list[int]:
        return self.llm.chat_ids(text)

    def text(self, ids: list[int]) -> str:
        """The prompt's text, special tokens spelled out (what llama.cpp's binary tokenizes back)."""
        return self.llm.tokenizer.decode(ids, skip_special_tokens=False)

    def run(self, ids: list[int], n: int) -> tuple[list[int], float, float]:
        """-> (tokens, seconds to the first token, seconds in all)."""
        first = []
        t0 = time.perf_counter()
        params = SamplingParams(self.temperature, self.top_p if self.temperature else 1.0, max_new_tokens=n,
                                ignore_eos=True, seed=prompt_seed(ids))
        seqs, stats = self.llm.generate([ids], params,
                                        on_tokens=lambda seq, toks: first or first.append(time.perf_counter()))
        spec = stats.extra
        if spec.get("rounds"):  # a speculative decoder's counters for this run
            self.rounds += spec["rounds"]
            self.reached += (spec["tau"] - 1) * spec["rounds"]
            self.looked_up += spec.get("looked_up", 0)
            hist = spec["depth_hist"]
            n = max(len(self.depths), len(hist))
            self.depths = [a + b for a, b in zip(self.depths + [0] * (n - len(self.depths)),
                                                 hist + [0] * (n - len(hist)))]
        return seqs[0].output_ids, first[0] - t0, time.perf_counter() - t0

    def speculation(self, reset: bool = False) -> dict:
        """Rounds, tau (tokens a round), rounds by depth the head drafted (the adaptive policy's choices, for
        `auto`) and rounds whose drafts were looked up in the context instead, over the runs so far; `reset`
        starts the count again (after the warm-up)."""
        out = {"rounds": self.rounds, "tau": round(1 + self.reached / max(self.rounds, 1), 3),
               "rounds_by_depth": list(self.depths), "looked_up": self.looked_up}
        if reset:
            self.rounds, self.reached, self.depths, self.looked_up = 0, 0.0, [], 0
        return out


class LlamaCpp:
    def __init__(self, path: Path, threads: int, batch: int):
        from llama_cpp import Llama
        self.llm = Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=2048,
                         n_batch=batch, n_ubatch=batch, verbose=False)

    def run(self, ids: list[int], n: int) -> tuple[list[int], float, float]:
        self.llm.reset()
        out, first = [], None
        t0 = time.perf_counter()
        for tok in self.llm.generate(ids, temp=0.0, top_k=1, reset=True):
            first = first or time.perf_counter()
            out.append(tok)
            if len(out) == n:
                break
        return out, first - t0, time.perf_counter() - t0


def prompt_seed(ids: list[int]) -> int:
    """A prompt's sampling seed (the same in every pass and contender)."""
    return zlib.crc32(str(ids).encode())


def sampling_flags(temperature: float, top_p: float, text: str) -> list[str]:
    """llama.cpp's flags for greedy, or for temperature (and top-p) sampling seeded per prompt."""
    if not temperature:
        return ["--temp", "0"]
    return ["--temp", str(temperature), "--top-k", "0", "--top-p", str(top_p), "--min-p", "0", "--seed",
            str(zlib.crc32(text.encode()))]


class LlamaCppNative:
    """llama.cpp's own `llama-completion` binary, one run per prompt."""

    def __init__(self, bin_dir: Path, path: Path, threads: int, batch: int, temperature: float = 0.0,
                 top_p: float = 1.0):
        self.exe, self.path, self.threads, self.batch = Path(bin_dir) / "llama-completion", path, threads, batch
        self.temperature, self.top_p = temperature, top_p
        if not self.exe.is_file():
            raise ImportError(f"{self.exe} is not built (bash benchmarks/build_llama_cpp.sh)")

    def run(self, text: str, n: int) -> tuple[list[int], float, float]:
        """-> (n placeholders (-1: the binary reports no token ids), seconds of prompt eval, seconds in all),
        from llama.cpp's timers; ValueError if it did not generate exactly n tokens."""
        import re
        import subprocess
        cmd = [str(self.exe), "-m", str(self.path), "-t", str(self.threads), "-tb", str(self.threads), "-c", "2048",
               "-n", str(n), "-ub", str(self.batch), *sampling_flags(self.temperature, self.top_p, text), "--ignore-eos", "-no-cnv",
               "--no-warmup", "-p", text]
        done = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        # "llama_perf_context_print:" (or, in newer builds, "<time> I common_perf_print:") then the timer
        line = r"^.*?(?:llama_perf_context_print|common_perf_print):\s+"
        timers = dict(re.findall(line + r"(prompt eval|eval) time =\s+([\d.]+) ms", done.stderr, re.M))
        runs = re.search(line + r"eval time =.*?/\s+(\d+) runs", done.stderr, re.M)
        if done.returncode or len(timers) != 2 or runs is None:
            raise ValueError(f"llama-completion failed ({done.returncode}): {done.stderr.strip()[-300:]}")
        generated = int(runs[1]) + 1  # the first token comes out of the prompt's evaluation
        if generated != n:
            raise ValueError(f"llama-completion generated {generated} tokens, not {n}")
        prompt_s, eval_s = float(timers["prompt eval"]) / 1e3, float(timers["eval"]) / 1e3
        return [-1] * n, prompt_s, prompt_s + eval_s


class LlamaCppEagle3:
    """llama.cpp's EAGLE-3 drafting (`llama-speculative-simple`) with the shipped head, one run per prompt."""

    def __init__(self, bin_dir: Path, path: Path, threads: int, batch: int, drafts: int, temperature: float = 0.0,
                 top_p: float = 1.0):
        self.exe, self.head = Path(bin_dir) / "llama-speculative-simple", Path(bin_dir) / "eagle3-head.gguf"
        self.path, self.threads, self.batch, self.drafts = path, threads, batch, drafts
        self.temperature, self.top_p = temperature, top_p
        for f in (self.exe, self.head):
            if not f.is_file():
                raise ImportError(f"{f} is not built (bash benchmarks/build_llama_cpp.sh)")

    def run(self, text: str, n: int) -> tuple[list[int], float, float]:
        """-> (n placeholders, seconds to the first token, seconds to the n-th) at its measured decode rate
        (it may decode a few tokens past n: a round's accepted drafts); ValueError if it decoded fewer."""
        import re
        import subprocess
        t = str(self.threads)
        cmd = [str(self.exe), "-m", str(self.path), "-md", str(self.head), "--spec-type", "draft-eagle3",
               "--spec-draft-n-max", str(self.drafts), "-t", t, "-tb", t, "-td", t, "-c", "2048", "-n", str(n),
               "-ub", str(self.batch), *sampling_flags(self.temperature, self.top_p, text), "--ignore-eos", "-p", text]
        done = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        counters = dict((kind, (int(k), float(s))) for kind, k, s in re.findall(
            r"^.*?(encoded|decoded)\s+(\d+) tokens in\s+([\d.]+) seconds", done.stderr, re.M))
        if done.returncode or len(counters) != 2:
            raise ValueError(f"llama-speculative-simple failed ({done.returncode}): {done.stderr.strip()[-300:]}")
        (_, encode_s), (decoded, decode_s) = counters["encoded"], counters["decoded"]
        if decoded < n:
            raise ValueError(f"llama-speculative-simple decoded {decoded} tokens, not {n}")
        per_token = decode_s / decoded
        return [-1] * n, encode_s + per_token, encode_s + n * per_token


class Transformers:
    def __init__(self, path: Path, threads: int):
        from transformers import AutoModelForCausalLM
        torch.set_num_threads(threads)
        self.model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                          dtype=torch.bfloat16).eval()

    def run(self, ids: list[int], n: int) -> tuple[list[int], float, float]:
        from transformers import StoppingCriteria
        first = []

        class FirstToken(StoppingCriteria):
            def __call__(self, input_ids, scores, **kw):
                first or first.append(time.perf_counter())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool)

        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                      stopping_criteria=[FirstToken()], pad_token_id=0)
        return out[0, len(ids):].tolist(), first[0] - t0, time.perf_counter() - t0


def serve(conn, kind: str, args: tuple):
    """A contender in its own process: builds it, then answers (method name, arguments) until None."""
    try:
        obj = {"engine": Engine, "llama.cpp": LlamaCpp, "llama.cpp native": LlamaCppNative,
               "llama.cpp native eagle3": LlamaCppEagle3, "transformers": Transformers}[kind](*args)
    except ImportError as e:
        return conn.send(f"missing: {e}")
    except (ValueError, OSError) as e:  # a bad --weights / --model, an unreadable file
        return conn.send(f"error: {e}")
    conn.send("ready")
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the parent has gone
            return
        if msg is None:
            return
        try:
            conn.send(getattr(obj, msg[0])(*msg[1]))
        except ValueError as e:  # a peer's binary failed on this prompt
            conn.send(RuntimeError(str(e)))


class Worker:
    def __init__(self, kind: str, *args):
        import multiprocessing
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child, kind, args), daemon=True)
        self.proc.start()
        self.kind, self.status = kind, self.conn.recv()

    def call(self, name: str, *args):
        self.conn.send((name, args))
        out = self.conn.recv()
        if isinstance(out, RuntimeError):
            raise RuntimeError(f"{self.kind}: {out}")
        return out

    def run(self, ids: list[int], n: int):
        return self.call("run", ids, n)

    def close(self):
        if self.status == "ready":
            self.conn.send(None)
        self.proc.join()


def measure(contenders: dict, prompts: list[list[int]], max_tokens: int, passes: int = 1,
            counters: dict | None = None) -> tuple[dict, dict, dict]:
    """Every contender on every prompt, alternated prompt by prompt (after one warm-up prompt), `passes` times
    over the prompts (the order rotated each pass). -> decode tok/s and end-to-end tok/s per contender and
    prompt (the median over the passes: a burst of load from a neighbour during one run moves it less), and
    outputs per contender, prompt and pass. `counters`: name -> a callable(reset) whose counts restart after
    the warm-up (the engine's speculation counters)."""
    counters = counters or {}
    for ids in prompts[:1]:  # warm-up: first-call allocations, the policy's first timings
        for run in contenders.values():
            run(ids, 16)
    for counts in counters.values():
        counts(True)  # the warm-up's rounds do not count
    names = list(contenders)
    decode, e2e = ({n: [[] for _ in prompts] for n in names} for _ in range(2))
    outputs = {n: [[] for _ in prompts] for n in names}
    for k in range(passes):
        for i, ids in enumerate(prompts):
            shift = (i + k) % len(names)
            for name in names[shift:] + names[:shift]:
                out, first_s, total_s = contenders[name](ids, max_tokens)
                assert len(out) == max_tokens, (name, len(out))
                decode[name][i].append((len(out) - 1) / (total_s - first_s))
                e2e[name][i].append(len(out) / total_s)
                outputs[name][i].append(out)
            print(f"pass {k + 1}/{passes} prompt {i + 1}/{len(prompts)}: " +
                  ", ".join(f"{n} {decode[n][i][-1]:.1f}" for n in names), flush=True)
    per_prompt = lambda runs: {n: [statistics.median(r) for r in runs[n]] for n in names}  # noqa: E731
    return per_prompt(decode), per_prompt(e2e), outputs


def ratios(decode: dict, name: str, base: str) -> tuple[float, float]:
    """(median, min) over the prompts of name's decode tok/s / base's: both ran each prompt back to back."""
    r = [a / b for a, b in zip(decode[name], decode[base])]
    return statistics.median(r), min(r)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="a GGUF model (registry name or path)")
    p.add_argument("--prompts", type=int, default=len(PROMPTS))
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--passes", type=int, default=1,
                   help="runs of every contender on every prompt; a prompt's figure is the median of its runs")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--weights", default="auto,bf16", help="comma-separated engine weight formats")
    p.add_argument("--methods", default="vanilla,auto",
                   help="comma-separated engine methods (vanilla first; e.g. vanilla,auto,eagle3 to see a fixed chain), "
                        "each with method arguments if wanted (auto:lookup=0, eagle3:depth=3:tree_tokens=4)")
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--llama-cpp-batch", type=int, default=512,
                   help="llama.cpp's prompt batch (native: its micro-batch, -ub); 1 evaluates the prompt token by "
                        "token (its decode speed is the same), for builds whose batched kernels fail on a machine "
                        "(native llama.cpp 0.3.36's AMX build segfaults in prompt eval on the AMX Xeon)")
    p.add_argument("--llama-cpp-bin", help="directory of native llama.cpp binaries (bash "
                   "benchmarks/build_llama_cpp.sh prints it); without it native llama.cpp is left out")
    p.add_argument("--llama-cpp-draft", type=int, default=3, help="native llama.cpp EAGLE-3's drafts a round")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample at this temperature (no top-k / min-p), a seed per prompt; 0: greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature: nucleus sampling's p")
    p.add_argument("--png", default="benchmarks/plots/e2e_cpu_peers.png")
    p.add_argument("--json", default="benchmarks/plots/e2e_cpu_peers.json")
    args = p.parse_args(argv)
    if not 1 <= args.prompts <= len(PROMPTS):
        p.error(f"--prompts must be in 1..{len(PROMPTS)}")
    if args.passes < 1:
        p.error(f"--passes must be >= 1, got {args.passes}")
    if args.temperature < 0:
        p.error(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        p.error(f"--top-p must be in (0, 1], got {args.top_p}")
    T, P = args.temperature, args.top_p
    src = resolve_model(args.model)
    if src.kind != "gguf":
        p.error(f"--model must be a GGUF model (llama.cpp reads GGUF), got {src.path}")
    weights, methods = args.weights.split(","), args.methods.split(",")
    if methods[0] != "vanilla" or len(set(methods)) != len(methods):
        p.error(f"--methods must start with vanilla and name each method once, got {args.methods}")
    try:
        [method_spec(m) for m in methods]
    except ValueError as e:
        p.error(f"--methods: {e}")
    workers = {f"engine {m} ({w})": Worker("engine", args.model, w, args.threads, m, T, P) for w in weights
               for m in methods}
    for name, w in workers.items():
        if w.status != "ready":
            sys.exit(f"e2e_cpu_peers: {name}: {w.status}")
    if T:
        print("--temperature: llama-cpp-python and transformers (greedy only here) are left out", file=sys.stderr)
    else:
        workers["llama.cpp"] = Worker("llama.cpp", src.path, args.threads, args.llama_cpp_batch)
        if workers["llama.cpp"].status != "ready":
            print("llama-cpp-python is not installed (pip install llama-cpp-python): llama.cpp is left out",
                  file=sys.stderr)
            workers.pop("llama.cpp").close()
    if args.llama_cpp_bin:
        native = Worker("llama.cpp native", Path(args.llama_cpp_bin), src.path, args.threads, args.llama_cpp_batch, T, P)
        if native.status != "ready":
            sys.exit(f"e2e_cpu_peers: native llama.cpp: {native.status}")
        workers["llama.cpp native"] = native
        eagle3 = Worker("llama.cpp native eagle3", Path(args.llama_cpp_bin), src.path, args.threads,
                        args.llama_cpp_batch, args.llama_cpp_draft, T, P)
        if eagle3.status == "ready":
            workers["llama.cpp native eagle3"] = eagle3
        else:
            print(f"native llama.cpp EAGLE-3 is left out: {eagle3.status}", file=sys.stderr)
            eagle3.close()
    else:
        print("no --llama-cpp-bin: native llama.cpp is left out (bash benchmarks/build_llama_cpp.sh builds it)",
              file=sys.stderr)
    if not args.no_transformers and not T:
        workers["transformers"] = Worker("transformers", src.path, args.threads)
    contenders = {name: w.run for name, w in workers.items()}

    tok = workers[f"engine vanilla ({weights[0]})"]
    prompts = [tok.call("chat_ids", text) for text in PROMPTS[:args.prompts]]
    texts = {tuple(ids): tok.call("text", ids) for ids in prompts}
    for name in ("llama.cpp native", "llama.cpp native eagle3"):  # they take the prompt as text
        if name in workers:
            contenders[name] = lambda ids, n, w=workers[name]: w.run(texts[tuple(ids)], n)
    try:
        decode, e2e, outputs = measure(contenders, prompts, args.max_tokens, args.passes,
                                       {n: lambda reset, w=workers[n]: w.call("speculation", reset)
                                        for n in workers if n.startswith("engine ") and "vanilla" not in n})
    except RuntimeError as e:
        sys.exit(f"e2e_cpu_peers: {e}\n(a llama.cpp build whose batched prompt kernels crash here runs with "
                 "--llama-cpp-batch 1)")
    names = list(contenders)


    # a prompt counts as equal when every pass of the method produced vanilla's first pass's tokens
    same = {f"{m} ({w})": sum(all(o == ref_runs[0] for o in runs) for ref_runs, runs in
                              zip(outputs[f"engine vanilla ({w})"], outputs[f"engine {m} ({w})"]))
            for w in weights for m in methods[1:]}
    vanilla = f"engine vanilla ({weights[0]})"
    refs = [r for r in ("llama.cpp native", "llama.cpp", "llama.cpp native eagle3") if r in contenders]
    med = {n: statistics.median(decode[n]) for n in names}
    mode = (f"sampled at T = {T}" + (f", top-p {P}" if P < 1 else "")) if T else "greedy"
    print(f"\n{len(prompts)} prompts x {args.max_tokens} tokens x {args.passes} passes, {mode}, {args.threads} "
          f"threads, batch 1; ratios: medians of per-prompt ratios (both ran the prompt back to back)")
    print(f"| contender | decode tok/s | end-to-end tok/s | / {vanilla} (worst prompt) |" +
          "".join(f" / {r} |" for r in refs))
    print("|---|---|---|---|" + "---|" * len(refs))
    for n in names:
        row = f"| {n} | {med[n]:.1f} | {statistics.median(e2e[n]):.1f} | %.3f (%.3f) |" % ratios(decode, n, vanilla)
        print(row + "".join(f" {ratios(decode, n, r)[0]:.2f} |" for r in refs))
    for name, k in same.items():
        w = name.split(" (")[1][:-1]
        print(f"engine {name} output == engine vanilla ({w}) output: {k}/{len(prompts)} prompts")
    spec = {n: workers[n].call("speculation") for n in names if n.startswith("engine ") and "vanilla" not in n}
    for n, c in spec.items():
        print(f"{n}: tau {c['tau']} over {c['rounds']} rounds; rounds by drafted depth {c['rounds_by_depth']}, "
              f"looked up {c['looked_up']}")
    if "llama.cpp" in contenders and "engine vanilla (auto)" in contenders:
        agree = sum(a[0] == b[0] for a, b in zip(outputs["llama.cpp"], outputs["engine vanilla (auto)"]))
        print(f"llama.cpp output == engine vanilla (auto) output: {agree}/{len(prompts)} prompts "
              f"(different kernels round differently; informational)")

    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"args": vars(args), "decode_tok_s": decode, "e2e_tok_s": e2e,
                                           "spec_equals_vanilla": same, "speculation": spec}, indent=1))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(names) + 1.5))
    ax.barh(names[::-1], [med[n] for n in names[::-1]], color=["#888" if "engine" not in n else "#37c" for n in names[::-1]])
    for y, n in enumerate(names[::-1]):
        ax.text(med[n], y, f" {med[n]:.0f}", va="center")
    ax.set_xlabel(f"decode tokens/s (median of {len(prompts)} prompts, {args.max_tokens} tokens, {args.threads} threads)")
    ax.set_title(f"{src.path.name}: {mode}, one request at a time")
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)
    print(f"wrote {args.png}, {args.json}")
    for w in workers.values():
        w.close()


if __name__ == "__main__":
    main()
