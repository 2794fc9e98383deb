"""The CLI: bad input gives one line on stderr and exit code 2; --json output is parseable."""
import json
import subprocess
import sys

import pytest
import torch


def run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "engine.run", *args], capture_output=True, text=True,
                          timeout=timeout, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("args, message", [
    (["--model", "no-such-model", "hi"], "not a known name"),
    (["--max-new-tokens", "0", "hi"], "max_new_tokens must be > 0"),
    (["--temperature", "-1", "hi"], "temperature must be >= 0"),
    (["--top-p", "1.5", "hi"], "top_p must be in (0, 1]"),
    (["--top-p", "0", "hi"], "top_p must be in (0, 1]"),
    ([], "no prompt given"),
    (["--prefill-chunk", "-3", "hi"], "prefill_chunk must be >= 0"),
    (["--regex", "a", "--json-schema", "{}", "hi"], "at most one of --json-schema, --regex, --grammar"),
    (["--grammar", "/no/such/file", "hi"], "--grammar: [Errno 2]"),
])
def test_bad_input_is_one_line_and_exit_code_2(args, message):
    r = run_cli(*args)
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_prompt_longer_than_context_and_json_output(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Name a color."}) + "\n" + json.dumps("Say hi.") + "\n")
    r = run_cli("--method", "vanilla", "--json", "--max-new-tokens", "4", "--prompts-file", str(prompts))
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["prompt"] for row in rows] == ["Name a color.", "Say hi."]
    assert all(len(row["output_ids"]) <= 4 and row["text"] and "decode_tok_s" in row["stats"] for row in rows)
    assert all("cached_tokens" in row["stats"] for row in rows)

    r = run_cli("--method", "vanilla", "--raw", "word " * 9000)
    assert r.returncode == 2 and "context" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_a_gpu_is_a_one_line_error(capsys):
    from engine.run import main
    assert main(["--device", "cuda", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --device cuda: no CUDA device available")


def test_prefix_cache_flag():
    from engine.run import parse_args
    assert parse_args(["hi"]).prefix_cache is True and parse_args(["--no-prefix-cache", "hi"]).prefix_cache is False


def test_prefill_chunk_flag():
    from engine.run import parse_args
    assert parse_args(["hi"]).prefill_chunk is None and parse_args(["--prefill-chunk", "64", "hi"]).prefill_chunk == 64


def test_structured_output_flags(tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"color": {"enum": ["red", "blue"]}},
                                  "required": ["color"]}))
    r = run_cli("--method", "vanilla", "--json", "--max-new-tokens", "16", "--json-schema", str(schema), "Name a color.")
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout)
    assert json.loads(row["text"])["color"] in ("red", "blue") and row["finish_reason"] == "stop"
