"""benchmarks/e2e_cpu_peers.py's native llama.cpp contender, against a stand-in binary that prints llama.cpp's
timer lines: it reads prompt-eval and eval times, checks the token count, and says clearly what is missing."""
import importlib.util
import stat
from pathlib import Path

import pytest

from engine.lookup import MOST

ROOT = Path(__file__).resolve().parents[1]
TIMERS = ("llama_perf_context_print: prompt eval time =      50.00 ms /    20 tokens (    2.50 ms per token,   "
          "400.00 tokens per second)\n"
          "llama_perf_context_print:        eval time =     635.00 ms /   {runs} runs   (    5.00 ms per token,   "
          "200.00 tokens per second)\n")


def peers():
    spec = importlib.util.spec_from_file_location("e2e_cpu_peers", ROOT / "benchmarks" / "e2e_cpu_peers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_binary(directory: Path, stderr: str, code: int = 0):
    directory.mkdir(exist_ok=True)
    exe = directory / "llama-completion"
    exe.write_text(f"#!/bin/sh\necho \"$@\" > '{directory}/args'\ncat >&2 <<'EOF'\n{stderr}EOF\nexit {code}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)


@pytest.mark.parametrize("prefix", ["", "0.00.797.470 I "])
def test_native_llama_cpp_reads_its_own_timers(tmp_path, prefix):
    """Older builds print llama_perf_context_print lines, newer ones common_perf_print with a timestamp."""
    module = peers()
    timers = TIMERS.format(runs=127)
    if prefix:
        timers = "".join(prefix + line.replace("llama_perf_context_print", "common_perf_print") + "\n"
                         for line in timers.splitlines())
    fake_binary(tmp_path / "bin", "load_tensors: ...\n" + timers)
    native = module.LlamaCppNative(tmp_path / "bin", tmp_path / "model.gguf", 2, 1)
    out, first_s, total_s = native.run("<|im_start|>user\nhi<|im_end|>\n", 128)
    assert len(out) == 128 and first_s == pytest.approx(0.05) and total_s == pytest.approx(0.685)
    assert " -ub 1 " in (tmp_path / "bin" / "args").read_text()  # the micro-batch asked for
    with pytest.raises(ValueError, match="generated 128 tokens, not 64"):
        native.run("hi", 64)


def test_native_llama_cpp_failures_are_clear(tmp_path):
    module = peers()
    with pytest.raises(ImportError, match="build_llama_cpp.sh"):
        module.LlamaCppNative(tmp_path / "nowhere", tmp_path / "model.gguf", 2, 512)
    fake_binary(tmp_path / "bin", "error: failed to load model\n", code=1)
    with pytest.raises(ValueError, match=r"llama-completion failed \(1\).*failed to load model"):
        module.LlamaCppNative(tmp_path / "bin", tmp_path / "model.gguf", 2, 512).run("hi", 8)


def test_native_llama_cpp_eagle3_reads_its_counters(tmp_path):
    """llama-speculative-simple's encode / decode counters; it may decode past n (a round's accepted drafts)."""
    module = peers()
    bin_dir = tmp_path / "bin"
    with pytest.raises(ImportError, match="llama-speculative-simple is not built"):
        module.LlamaCppEagle3(bin_dir, tmp_path / "model.gguf", 2, 512, 3)
    fake_binary(bin_dir, "0.01.854.073 I encoded   11 tokens in    0.100 seconds, speed:  110.000 t/s\n"
                         "0.01.854.103 I decoded  130 tokens in    1.300 seconds, speed:  100.000 t/s\n")
    (bin_dir / "llama-completion").rename(bin_dir / "llama-speculative-simple")
    with pytest.raises(ImportError, match="eagle3-head.gguf is not built"):
        module.LlamaCppEagle3(bin_dir, tmp_path / "model.gguf", 2, 512, 3)
    (bin_dir / "eagle3-head.gguf").write_bytes(b"")
    eagle3 = module.LlamaCppEagle3(bin_dir, tmp_path / "model.gguf", 2, 512, 3)
    out, first_s, total_s = eagle3.run("hi", 128)
    assert len(out) == 128 and first_s == pytest.approx(0.11) and total_s == pytest.approx(1.38)
    with pytest.raises(ValueError, match="decoded 130 tokens, not 256"):
        eagle3.run("hi", 256)


def test_measure_takes_each_prompts_median_over_passes():
    """Contenders alternate prompt by prompt in an order rotated per prompt and per pass; a prompt's decode
    rate is the median of its passes, so one slow run (a neighbour's burst) does not set it."""
    module = peers()
    calls, slow = [], {("b", 1, 0)}  # contender b's first pass over prompt 1 runs 10x slow

    def contender(name):
        def run(ids, n):
            if n == 16:  # the warm-up
                return [0] * n, 0.0, 1.0
            k = sum(c[0] == name and c[1] == ids[0] for c in calls)  # this contender's pass over this prompt
            calls.append((name, ids[0]))
            seconds = (n - 1) / (100 if name == "a" else 50) * (10 if (name, ids[0], k) in slow else 1)
            return list(range(n)), 0.0, seconds
        return run

    resets = []
    decode, e2e, outputs = module.measure({"a": contender("a"), "b": contender("b")}, [[0], [1], [2]], 9, passes=3,
                                          counters={"b": lambda reset: resets.append((reset, len(calls)))})
    assert resets == [(True, 0)]  # counts restart once, after the warm-up and before the timed runs
    assert decode == {"a": [100.0] * 3, "b": [50.0] * 3}  # the slow run is outvoted
    assert [len(runs) for runs in outputs["b"]] == [3, 3, 3]
    first = [c[0] for c in calls[::2]]  # who ran first on each (pass, prompt)
    assert first == ["a", "b", "a", "b", "a", "b", "a", "b", "a"]
    assert module.ratios(decode, "b", "a") == (0.5, 0.5)


def test_engine_counts_its_rounds_by_depth():
    """The engine contender's speculation counters: tau, rounds by drafted depth (the fixed chain drafts 2
    levels a round, but where the reply's end caps it) and rounds looked up in the context over its runs,
    restarted by a reset."""
    engine = peers().Engine("smollm2-135m", "auto", 2, "eagle3")
    ids = engine.chat_ids("Count from one to twenty.")
    assert engine.speculation() == {"rounds": 0, "tau": 1.0, "rounds_by_depth": [], "looked_up": 0}
    engine.run(ids, 24)
    engine.run(ids, 24)
    counts = engine.speculation(reset=True)
    by_depth, looked_up = counts["rounds_by_depth"], counts["looked_up"]
    assert counts["rounds"] == sum(by_depth) + looked_up and len(by_depth) == 3
    assert by_depth[2] >= counts["rounds"] - looked_up - 4
    assert 1.0 < counts["tau"] <= 1 + MOST and counts["rounds"] * counts["tau"] >= 2 * 23  # 23 tokens a run after the first
    assert engine.speculation()["rounds"] == 0


def test_methods_take_arguments():
    """--methods entries carry the engine's method arguments: auto:lookup=0 is `auto` without lookup drafts."""
    spec = peers().method_spec
    assert spec("auto") == ("auto", {})
    assert spec("eagle3:depth=3:tree_tokens=4:min_prob=0.1:head=random") == (
        "eagle3", {"depth": 3, "tree_tokens": 4, "min_prob": 0.1, "head": "random"})
    with pytest.raises(ValueError, match="not key=value"):
        spec("auto:lookup")
    engine = peers().Engine("smollm2-135m", "auto", 2, "auto:lookup=0")
    assert engine.llm.decoder.lookup == 0
