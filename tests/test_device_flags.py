"""`--device` on the training pipeline and the benchmarks: a CUDA request without a GPU is one line on
stderr and exit code 2, before any model or data is read (and verify_cost's other bad sizes alike)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {
    "pipeline": ["-m", "train.pipeline", "--out", "{tmp}/run"],
    "e2e_vanilla": ["benchmarks/e2e_vanilla.py"],
    "e2e_speculative": ["benchmarks/e2e_speculative.py"],
    "verify_cost": ["benchmarks/verify_cost.py"],
    "gpu_check": ["benchmarks/gpu_check.py", "--phases", "methods", "--out", "{tmp}/check"],
}


@pytest.mark.skipif(torch.cuda.is_available(), reason="asserts the no-GPU error")
@pytest.mark.parametrize("name", list(COMMANDS))
def test_device_cuda_without_a_gpu_is_one_line_and_exit_code_2(name, tmp_path):
    args = [a.format(tmp=tmp_path) for a in COMMANDS[name]]
    r = subprocess.run([sys.executable, *args, "--device", "cuda"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --device cuda"), r.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flags", [["--rows", "0"], ["--context", "-1"], ["--repeats", "0"]])
def test_verify_cost_bad_sizes_are_a_usage_error(flags):
    r = subprocess.run([sys.executable, "benchmarks/verify_cost.py", *flags], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("verify_cost.py: error: --context"), r.stderr


@pytest.mark.parametrize("head", [[], ["--greedy"]], ids=["logits", "greedy"])
def test_verify_cost_from_an_empty_context(head):
    """A decode at context 0 (the first token) was a reshape error; --greedy (the greedy steps' tokens) called
    a method the model no longer had."""
    r = subprocess.run([sys.executable, "benchmarks/verify_cost.py", "--context", "0", "--rows", "1", "2",
                        "--repeats", "1", "--threads", "1", *head], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert f"head={'greedy' if head else 'logits'}" in r.stdout
    rows = [line.split() for line in r.stdout.splitlines() if line.split()[:1] in (["1"], ["2"])]
    assert [row[0] for row in rows] == ["1", "2"] and all(float(row[1]) > 0 for row in rows), r.stdout


def test_pipeline_parses_the_shared_flag():
    from train import pipeline
    assert pipeline.parser().parse_args(["--out", "o"]).device == "auto"
    with pytest.raises(SystemExit):
        pipeline.parser().parse_args(["--out", "o", "--device", "tpu"])


def test_gpu_check_engine_helpers_on_cpu(tmp_path):
    """benchmarks/gpu_check.py's engine-facing helpers against today's engine API, at toy scale."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check as gc
    from dataclasses import replace
    cpu = torch.device("cpu")
    cfg = replace(gc.tiny_config(), vocab_size=512, hidden_size=64, intermediate_size=128, head_dim=16,
                  max_position=512)
    model = gc.random_llama(cfg, torch.float32, cpu)
    assert model.rotary.cos.dtype == torch.float32 and torch.isfinite(model.rotary.cos).all()
    vanilla = gc.build_llm(model, "float32", cpu, kv_cache_gb=0.01)
    prompt = list(range(3, 40))
    ref, stats = gc.generate(vanilla, [prompt], 6)
    assert len(ref[0]) == 6 and gc.round_ms(stats)["step_ms"] > 0
    pool = vanilla.scheduler.blocks
    with vanilla.borrow() as seq:
        seq.forward([prompt])
        depths, mask = gc.tree_index([-1, 0, 0, 1, 1, 2], cpu)
        assert depths.tolist() == [[0, 1, 1, 2, 2, 2]]
        gc.verify_forward(vanilla, seq, torch.tensor([[5, 6, 7, 8, 9, 10]]), depths, mask)
        assert pool.length(seq.ids[0]) == len(prompt)  # the tree rolled back
    assert pool.num_free == pool.num_blocks
    gc.save_random_eagle3_head(model, tmp_path / "head", draft_vocab=128)
    eagle = gc.build_llm(model, "float32", cpu, "eagle3",
                         {"head": str(tmp_path / "head"), "depth": 3, "topk": 4, "tree_tokens": 8}, kv_cache_gb=0.01,
                         timing=True)
    out, stats = gc.generate(eagle, [prompt], 6)
    split = gc.round_ms(stats)
    assert out == ref and split["draft_ms"] > 0 and split["verify_ms"] > 0 and split["tau"] >= 1
    assert gc.report({"phases": {}}).startswith("# GPU check")
