"""Training on torch.distributed, on the CPU: `torchrun --nproc_per_node 2 -m train.pipeline` over gloo on a tiny
target takes the steps one process takes on the same data (replies, losses, head), resumes, exports once and
evaluates on rank 0; a time budget stops every rank at the same step; a launch without torchrun's
environment fails with one line.

Run as a script (by torchrun, from the budget test): trainer.train on fixed sequences in each rank."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import write_tiny_llama
from train import data, distributed, pipeline
from train.pipeline import parser

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["--device", "cpu", "--dtype", "float32", "--kv-cache-gb", "0.01", "--threads", "1", "--quiet",
         "--num-prompts", "5", "--samples-per-prompt", "1", "--max-new-tokens", "16", "--gen-batch", "2",
         "--max-prompt", "48", "--seq-len", "64", "--rows", "3", "--draft-vocab", "48", "--ttt-steps", "3",
         "--steps", "6", "--save-every", "2", "--lr", "3e-3", "--warmup", "2",
         "--eval-prompts", "1", "--eval-tokens", "8", "--chain-depth", "2", "--alpha-steps", "2"]


def torchrun(*argv, timeout=180) -> subprocess.CompletedProcess:
    """2 ranks on this host over gloo (--standalone: a free rendezvous port). Ranks that disagree hang in a
    collective: past the timeout the launcher is stopped (SIGTERM: it stops its ranks) and the test fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *map(str, argv)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
        pytest.fail(f"{' '.join(cmd)}: still running after {timeout} s")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """An 8-layer Llama (EAGLE-3 fuses three distinct layers) with a character tokenizer whose chat template
    keeps a prompt's first 24 characters: replies and features in milliseconds."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    path = tmp_path_factory.mktemp("tiny")
    hf = write_tiny_llama(path, seed=5, vocab_size=64, num_hidden_layers=8)
    with torch.no_grad():
        hf.lm_head.weight.mul_(4.0)
    hf.save_pretrained(str(path), safe_serialization=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{chr(97 + i): 3 + i for i in range(26)},
             **{f"t{i}": i for i in range(29, 64)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            chat_template="{% for m in messages %}{{ m['content'][:24] | lower }}{% endfor %}"
                            ).save_pretrained(str(path))
    return path


def log_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in open(run / "train" / "train_log.jsonl")]


def test_torchrun_two_ranks_train_as_one_process(tiny_model, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    flags = ["--model", str(tiny_model), *FLAGS]
    pipeline.run(parser().parse_args(["--out", str(one), *flags]))
    assert not torch.distributed.is_initialized()  # one process: no process group
    # 2 ranks, stopped in training (--stop-after) and resumed: every rank reads the checkpoint
    first = torchrun("-m", "train.pipeline", "--out", two, *flags, "--stop-after", "3")
    assert first.returncode == 0, first.stderr[-3000:]
    assert torch.load(two / "train" / "ckpt.pt", weights_only=True)["state"]["step"] == 3
    second = torchrun("-m", "train.pipeline", "--out", two, *flags, "--resume")
    assert second.returncode == 0, second.stderr[-3000:]
    assert json.loads(second.stdout)["kind"] == "eagle3"  # one summary: rank 0's

    # replies: the ranks' parts are one process's, chunk by chunk
    parts = sorted(p.name for p in (one / "replies").iterdir())
    assert parts == sorted(p.name for p in (two / "replies").iterdir()) and len(parts) == 3
    assert all((one / "replies" / p).read_bytes() == (two / "replies" / p).read_bytes() for p in parts)
    # a batch of one row: the second rank has none and still joins the step
    packer = data.Packer(data.read_replies(one / "replies"), 64, 3, 0)
    assert [len(b) for b in packer.batches(0)] == [3, 3, 3, 1]

    # the same loss curve, the same head
    a, b = log_of(one), log_of(two)
    assert [r["step"] for r in b] == list(range(1, 7))  # rank 0 alone logs
    for ra, rb in zip(a, b):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-4), (ra, rb)
        assert rb["acc"] == pytest.approx(ra["acc"], abs=1e-4) and rb["n"] == ra["n"] and rb["lr"] == ra["lr"]
        assert rb["gnorm"] == pytest.approx(ra["gnorm"], rel=1e-3)
    ha = torch.load(one / "train" / "ckpt.pt", weights_only=True)["head"]
    hb = torch.load(two / "train" / "ckpt.pt", weights_only=True)["head"]
    for k in ha:
        torch.testing.assert_close(hb[k], ha[k], rtol=1e-4, atol=1e-5, msg=k)

    # one export, rank 0's evaluation
    assert sorted(p.name for p in (two / "train").iterdir()) == ["ckpt.pt", "head", "train_log.jsonl"]
    state = json.loads((two / "state.json").read_text())
    assert state["done"] == ["replies", "train", "evaluate"] and state["prompts"] == 5
    assert json.loads((two / "eval.json").read_text())["train"]["steps"] == 6


def test_time_budget_stops_every_rank_at_the_same_step(tmp_path):
    run = torchrun(__file__, tmp_path / "run", 1.0)
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["step"] == ranks[1]["step"]
    assert all(r["rows_error"].startswith("--rows 1 cannot be split across 2 ranks") for r in ranks)
    st = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=True)["state"]
    assert st["step"] == ranks[0]["step"] and st["total"] > 4
    assert st["step"] == st["total"] or st["elapsed"] >= 1.0


def test_a_launch_without_torchrun_variables_fails_with_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name in ("LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert pipeline.main(["--out", str(tmp_path / "run"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: a distributed run needs LOCAL_RANK, MASTER_ADDR, "
                                               "MASTER_PORT in the environment: launch it with torchrun"), err
    assert err[0].endswith("(rank 0 of 2)") and not (tmp_path / "run").exists()
    assert not torch.distributed.is_initialized()


if __name__ == "__main__":  # a rank of test_time_budget_stops_every_rank_at_the_same_step
    from test_data import tiny_features, tiny_target
    from test_train import args_for, tiny_seqs
    from train.trainer import check_args, train
    torch.set_num_threads(1)
    distributed.init(torch.device("cpu"))
    out, budget, rows_error = sys.argv[1], float(sys.argv[2]), ""
    try:
        check_args(args_for(out, "--rows", "1"))
    except ValueError as e:
        rows_error = str(e)
    if distributed.rank() == 1:  # a clock twice as fast: only a time the ranks agree on gives one step count
        time.monotonic = lambda real=time.monotonic: 2 * real()
    model = tiny_target()
    rec = train(args_for(out, "--rows", "2", "--save-every", "1000"), model, tiny_features(model), tiny_seqs(), out,
                budget_s=budget)
    Path(out).with_name(f"rank{distributed.rank()}.json").write_text(json.dumps({"step": rec["step"],
                                                                                  "rows_error": rows_error}))
    distributed.barrier()  # as pipeline.main: both ranks tear down together
    distributed.close()
