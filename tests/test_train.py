"""Trainer: TTT attention vs a naive chain-draft loop, loss decrease on a tiny target, exact resume, time
budgets; the pipeline end to end on the real target, killed and resumed; its CLI."""
import collections
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine.heads import load_head, new_head
from head_refs import dense_forward
from test_data import tiny_features, tiny_target
from train import data, evaluate, pipeline, topics
from train.pipeline import parser
from train.trainer import PACE_STEPS, remap_draft_vocab, train
from train.ttt import n_alpha, prefix_mask, shift, ttt_unroll, valid_at

ROOT = Path(__file__).resolve().parents[1]


def tiny_batch(model, lens=(12, 9), seed=1):
    """One packed row of conversations (the first third of each is its prompt) with online features."""
    g = torch.Generator().manual_seed(seed)
    return tiny_features(model)([[(torch.randint(3, 64, (n,), generator=g).tolist(), n // 3) for n in lens]])


def naive_chain(head, batch, steps):
    """Per position t and step i, an inference-like chain draft with dense_forward: the real prefix of
    t's conversation at step 0, then one query per step over [prefix keys, earlier chain keys]."""
    ids, doc = batch["input_ids"][0], batch["doc"][0]
    hidden0 = head.target_feature(batch["feature"], [batch["hidden"]])[0]
    S = ids.shape[0]
    outs = torch.full((steps, S, hidden0.shape[-1]), float("nan"))
    for t in range(S):
        start = int((doc == doc[t]).nonzero()[0])
        if t + 1 >= S or doc[t + 1] != doc[t]:
            continue  # no next token: nothing to draft
        n = t - start + 1
        pref_ids = ids[start + 1:t + 2][None]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        out, kv = dense_forward(head, pref_ids, hidden0[start:t + 1][None], torch.arange(n), causal)
        outs[0, t], h = out[0, -1], out[:, -1:]
        for i in range(1, steps):
            nxt = t + 1 + i
            if nxt >= S or doc[nxt] != doc[t]:
                break
            h, kv = dense_forward(head, ids[nxt][None, None], h, torch.tensor([n - 1 + i]),
                                       torch.ones(1, kv[0].shape[2] + 1, dtype=torch.bool), kv)
            outs[i, t] = h[0, 0]
    return outs


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
def test_ttt_matches_naive_chain_draft(kind):
    model = tiny_target()
    torch.manual_seed(0)
    head = new_head(kind, model, **({"draft_vocab_size": 40} if kind == "eagle3" else {}))
    batch = tiny_batch(model)
    steps = 4
    want = naive_chain(head, batch, steps)
    with torch.no_grad():
        got = list(ttt_unroll(head, batch, head.target_feature(batch["feature"], [batch["hidden"]]), steps))
    for i, out, idx, ok in got:
        for t, o in zip(idx[0][ok[0]].tolist(), out[0][ok[0]]):
            if not torch.isnan(want[i, t]).any():
                torch.testing.assert_close(o, want[i, t], atol=1e-5, rtol=1e-5)
    # every position scored at step i has a chain draft of i + 1 steps
    for i, out, idx, ok in got:
        scored = valid_at(batch, i)[0].nonzero().flatten()
        assert set(scored.tolist()) <= set(idx[0][ok[0]].tolist())
        assert not torch.isnan(want[i, scored]).any()


def test_ttt_step_cannot_see_future():
    model = tiny_target()
    torch.manual_seed(0)
    head = new_head("eagle3", model, draft_vocab_size=40)
    batch = tiny_batch(model, lens=(21,))
    hidden = head.target_feature(batch["feature"], [batch["hidden"]])
    noisy = dict(batch, input_ids=batch["input_ids"].clone())
    cut = 10
    noisy["input_ids"][0, cut:] = 5
    hidden2 = hidden.clone()
    hidden2[0, cut:] += 3.0
    with torch.no_grad():
        ref = list(ttt_unroll(head, batch, hidden, 4))
        new = list(ttt_unroll(head, noisy, hidden2, 4))
    # step i at t reads tokens up to t + 1 + i and features up to t: earlier positions must not change
    for (i, out, idx, _), (_, out2, idx2, _) in zip(ref, new):
        assert torch.equal(idx, idx2)
        safe = idx[0] < cut - 1 - i
        torch.testing.assert_close(out[0][safe], out2[0][safe], atol=1e-6, rtol=1e-6)
        assert not torch.allclose(out[0][~safe], out2[0][~safe])


def test_prefix_mask_and_shift():
    doc = torch.tensor([[0, 0, 1, 1, 1]])
    m = prefix_mask(doc)[0]
    assert m.tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]
    assert shift(torch.arange(5)[None], 2, -1).tolist() == [[2, 3, 4, -1, -1]]


def peaked_target():
    """The tiny target with a sharpened LM head: low-entropy soft targets leave room to learn."""
    model = tiny_target()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return model


def tiny_seqs(n_seqs=24, seed=0):
    """Sequences of a deterministic token pattern (4 prompt tokens), so a head can learn the target's next token."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for _ in range(n_seqs):
        n = int(torch.randint(10, 30, (1,), generator=g))
        start, step = int(torch.randint(3, 64, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
        seqs.append(([(start + step * k) % 61 + 3 for k in range(n)], 4))
    return seqs


def args_for(out, *extra):
    return parser().parse_args(["--out", str(out), "--draft-vocab", "48", "--seq-len", "64", "--rows", "1",
                                "--ttt-steps", "3", "--lr", "3e-3", "--warmup", "3", "--threads", "1", "--quiet",
                                "--device", "cpu", *extra])


def run_train(args, model, seqs, budget_s=None):
    capture = model.cfg.eagle3_layers if args.head == "eagle3" else ()
    return train(args, model, tiny_features(model, capture), seqs, args.out, budget_s)


def test_bf16_autocast_trains_like_fp32(tmp_path):
    """--train-dtype auto is bfloat16 autocast on a GPU: over the same batches its losses follow fp32's (the
    head's weights and optimizer stay fp32), and it still learns."""
    from train.trainer import train_dtype
    assert train_dtype("auto", torch.device("cpu")) == "float32"
    assert train_dtype("auto", torch.device("cuda")) == "bfloat16"
    assert train_dtype("float32", torch.device("cuda")) == "float32"
    model, seqs = peaked_target(), tiny_seqs()
    logs = {}
    for dt in ("float32", "bfloat16"):
        run_train(args_for(tmp_path / dt, "--steps", "100", "--save-every", "100", "--train-dtype", dt), model, seqs)
        logs[dt] = [json.loads(line)["loss"] for line in open(tmp_path / dt / "train_log.jsonl")]
        assert torch.load(tmp_path / dt / "ckpt.pt", weights_only=True)["state"]["train_dtype"] == dt
    fp32, bf16 = logs["float32"], logs["bfloat16"]
    assert bf16 != fp32 and max(abs(b - f) / f for b, f in zip(bf16, fp32)) < 0.02  # rounded differently
    assert sum(bf16[-5:]) < 0.8 * sum(bf16[:5])                                      # and it learns


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
def test_tiny_training_lowers_loss(tmp_path, kind):
    model, seqs = peaked_target(), tiny_seqs()
    run_train(args_for(tmp_path / "run", "--head", kind, "--steps", "100", "--save-every", "100"), model, seqs)
    log = [json.loads(line) for line in open(tmp_path / "run" / "train_log.jsonl")]
    first, last = sum(r["loss"] for r in log[:5]) / 5, sum(r["loss"] for r in log[-5:]) / 5
    assert last < 0.8 * first, (first, last)
    assert sum(log[-1]["acc"]) > sum(log[0]["acc"])
    # where the steps' time went: the three phases, summed over the steps, within the steps' own time
    split = [r["split"] for r in log]
    assert set(split[-1]) == {"features", "head", "optimizer"}
    assert all(a[k] <= b[k] for a, b in zip(split, split[1:]) for k in a) and split[-1]["head"] > 0
    assert sum(split[-1].values()) <= log[-1]["elapsed"] + 0.03
    head = load_head(tmp_path / "run" / "head", model)  # the exported official checkpoint loads back
    assert head.kind == kind
    cfg = json.loads((tmp_path / "run" / "head" / "config.json").read_text())
    if kind == "eagle3":
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 48
        assert torch.equal(head.t2d.nonzero().flatten(), torch.arange(48) + head.d2t)
    capture = model.cfg.eagle3_layers if kind == "eagle3" else ()
    hits, counts = n_alpha(head.float(), tiny_features(model, capture)([seqs[:2]]), 3)
    assert (hits <= counts).all() and counts[0] > 0


def test_resume_is_bit_identical(tmp_path):
    model, seqs = tiny_target(), tiny_seqs()
    common = ("--steps", "8", "--save-every", "100", "--rows", "2")
    run_train(args_for(tmp_path / "full", *common), model, seqs)
    run_train(args_for(tmp_path / "pieces", *common, "--stop-after", "3"), model, seqs)
    run_train(args_for(tmp_path / "pieces", *common, "--stop-after", "2", "--resume"), model, seqs)
    run_train(args_for(tmp_path / "pieces", *common, "--resume"), model, seqs)
    a = torch.load(tmp_path / "full" / "ckpt.pt", weights_only=True)
    b = torch.load(tmp_path / "pieces" / "ckpt.pt", weights_only=True)
    assert a["state"]["step"] == b["state"]["step"] == 8
    assert a["state"]["epoch"] == b["state"]["epoch"] and a["state"]["batch"] == b["state"]["batch"]
    for k in a["head"]:
        assert torch.equal(a["head"][k], b["head"][k]), k
    for sa, sb in zip(a["opt"]["state"].values(), b["opt"]["state"].values()):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    full = [json.loads(x)["loss"] for x in open(tmp_path / "full" / "train_log.jsonl")]
    pieces = [json.loads(x)["loss"] for x in open(tmp_path / "pieces" / "train_log.jsonl")]
    assert full == pieces


def test_init_continues_from_an_exported_head(tmp_path):
    model, seqs = peaked_target(), tiny_seqs()
    run_train(args_for(tmp_path / "a", "--steps", "40", "--save-every", "100"), model, seqs)
    # A near-zero learning rate: the warm-started head must export exactly the head it started from.
    run_train(args_for(tmp_path / "b", "--steps", "2", "--lr", "1e-12", "--init", str(tmp_path / "a" / "head")),
              model, seqs)
    a, b = load_head(tmp_path / "a" / "head", model), load_head(tmp_path / "b" / "head", model)
    for (name, ta), tb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(ta, tb), name
    first = lambda run: json.loads(open(tmp_path / run / "train_log.jsonl").readline())["loss"]  # noqa: E731
    assert first("b") < first("a")  # it starts where run a ended, not from scratch
    with pytest.raises(ValueError, match="draft vocabulary"):
        run_train(args_for(tmp_path / "c", "--steps", "1", "--draft-vocab", "32",
                           "--init", str(tmp_path / "a" / "head")), model, seqs)


def test_grow_mlp_computes_what_the_head_did_and_trains_only_the_new_units(tmp_path):
    """--grow-mlp N: the widened head drafts exactly what the trained one did until it trains; then only the new
    units move (the trained units' gate / up rows and down columns, and every other weight, as exported before)."""
    from train.trainer import grow_mlp
    from train.ttt import head_input
    model, seqs = peaked_target(), tiny_seqs()
    run_train(args_for(tmp_path / "a", "--steps", "40", "--save-every", "100"), model, seqs)
    a = load_head(tmp_path / "a" / "head", model).float()
    batch = tiny_features(model, model.cfg.eagle3_layers)([seqs[:2]])
    outs = lambda head: [o for _, o, _, _ in ttt_unroll(head, batch, head_input(head, batch), 3)]  # noqa: E731
    with torch.no_grad():
        before = outs(a)
        grow_mlp(a, 160)
        after = outs(a)
    assert all(torch.allclose(x, y, atol=1e-6, rtol=0) for x, y in zip(before, after))
    assert [n for n, p in a.named_parameters() if p.requires_grad] == [
        "midlayer.mlp.gate_up_proj.weight", "midlayer.mlp.down_proj.weight"]
    run_train(args_for(tmp_path / "b", "--steps", "20", "--save-every", "100", "--init", str(tmp_path / "a" / "head"),
                       "--grow-mlp", "160"), model, seqs)
    old, new = load_head(tmp_path / "a" / "head", model), load_head(tmp_path / "b" / "head", model)
    assert json.loads((tmp_path / "b" / "head" / "config.json").read_text())["intermediate_size"] == 160
    I = old.cfg.intermediate_size
    for (name, t_old), t_new in zip(old.state_dict().items(), new.state_dict().values()):
        if name.endswith("gate_up_proj.weight"):
            assert torch.equal(t_new[:I], t_old[:I]) and torch.equal(t_new[160:160 + I], t_old[I:]), name
        elif name.endswith("down_proj.weight"):
            assert torch.equal(t_new[:, :I], t_old) and t_new[:, I:].abs().sum() > 0, name  # the new units learned
        else:
            assert torch.equal(t_new, t_old), name
    for extra, message in ((["--grow-mlp", "160"], "--grow-mlp widens a trained head"),
                           (["--init", str(tmp_path / "a" / "head"), "--grow-mlp", "160", "--weight-decay", "0.1"],
                            "give --weight-decay 0"),
                           (["--init", str(tmp_path / "a" / "head"), "--grow-mlp", str(I)], "already has")):
        with pytest.raises(ValueError, match=message):
            run_train(args_for(tmp_path / "c", "--steps", "1", *extra), model, seqs)


def test_remap_draft_vocab_keeps_rows_and_fits_new_ones():
    model = tiny_target()  # H = 32: 48 kept-or-dropped rows determine the map A
    head = new_head("eagle3", model, draft_vocab_size=48).float()
    g = torch.Generator().manual_seed(0)
    old_ids = torch.randperm(64, generator=g)[:48].sort().values
    new_ids = torch.cat([old_ids[8:], torch.tensor([t for t in range(64) if t not in old_ids])[:8]]).sort().values
    A = torch.randn(32, 32, generator=g)
    with torch.no_grad():
        head.lm_head.weight.copy_(model.lm_head.weight[old_ids] @ A)  # a draft head exactly linear in the target's
        head.d2t.copy_(old_ids - torch.arange(48))
    old_rows = dict(zip(old_ids.tolist(), head.lm_head.weight.clone()))
    t2d = torch.zeros(64, dtype=torch.bool)
    t2d[new_ids] = True
    r2 = remap_draft_vocab(head, model, new_ids - torch.arange(48), t2d)
    assert r2 > 0.999
    assert torch.equal(head.to_target(torch.arange(48)), new_ids) and torch.equal(head.t2d, t2d)
    for row, tok in enumerate(new_ids.tolist()):
        want = old_rows[tok] if tok in old_rows else model.lm_head.weight[tok] @ A
        assert torch.allclose(head.lm_head.weight[row], want, atol=1e-3), tok
        if tok in old_rows:
            assert torch.equal(head.lm_head.weight[row], old_rows[tok])


def test_rebuild_vocab_flag(tmp_path):
    model, seqs = peaked_target(), tiny_seqs()
    with pytest.raises(ValueError, match="rebuild-vocab"):
        run_train(args_for(tmp_path / "b", "--steps", "1", "--rebuild-vocab"), model, seqs)
    run_train(args_for(tmp_path / "c", "--steps", "40", "--save-every", "100", "--lr", "1e-3"), model, seqs)
    counts = data.reply_counts(seqs, 64)
    run_train(args_for(tmp_path / "d", "--steps", "1", "--save-every", "100", "--lr", "1e-12", "--rebuild-vocab",
                       "--init", str(tmp_path / "c" / "head")), model, seqs)
    c, d = load_head(tmp_path / "c" / "head", model), load_head(tmp_path / "d" / "head", model)
    assert torch.equal(d.t2d, data.build_draft_vocab(counts, 48, 64)[1])
    assert torch.equal(c.t2d, d.t2d)  # same data, same vocabulary: every row is kept as it was
    assert torch.equal(c.lm_head.weight, d.lm_head.weight)


def test_time_budget_is_spent_after_a_slow_start(tmp_path):
    """The step count follows the pace as it settles: first steps slowed (a cold page cache under the replies,
    a GPU's warm-up) do not end the run early. (Paced once, over the first PACE_STEPS steps, an H200 run
    stopped at a sixth of its budget.)"""
    model, seqs = tiny_target(), tiny_seqs()
    args = args_for(tmp_path / "run", "--save-every", "1000")
    features, calls = tiny_features(model, model.cfg.eagle3_layers), []

    def slow_start(rows):
        calls.append(None)
        if len(calls) <= 1 + PACE_STEPS:
            time.sleep(0.3)
        return features(rows)

    train(args, model, slow_start, seqs, args.out, budget_s=2.0)
    st = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=True)["state"]
    # paced once it would stop near 1.2 s + two fast steps
    assert st["elapsed"] >= 1.7 and st["step"] == st["total"] or st["elapsed"] >= 2.0


def test_time_budget_sets_the_step_count_and_ends_the_schedule(tmp_path):
    model, seqs = tiny_target(), tiny_seqs()
    args = args_for(tmp_path / "run", "--save-every", "1000", "--min-lr-ratio", "0.1")
    run_train(args, model, seqs, budget_s=1.0)
    st = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=True)["state"]
    log = [json.loads(line) for line in open(tmp_path / "run" / "train_log.jsonl")]
    assert st["total"] > 1 + PACE_STEPS and st["step"] == len(log) and (tmp_path / "run" / "head").is_dir()
    # it ends at the estimated step count (the cosine at its floor) or when the budget is spent
    assert st["step"] == st["total"] or st["elapsed"] >= 1.0
    assert log[-1]["elapsed"] < 1.0 + 3 * (log[-1]["elapsed"] - log[-2]["elapsed"]) + 0.5
    if st["step"] == st["total"]:
        assert log[-1]["lr"] == pytest.approx(args.lr * args.min_lr_ratio, rel=0.1)


# --------------------------------------------------------------------------- the pipeline, real target

PIPELINE = ["--device", "cpu", "--dtype", "float32", "--kv-cache-gb", "0.25", "--threads", "1", "--quiet",
            "--num-prompts", "4", "--samples-per-prompt", "1", "--max-new-tokens", "8", "--gen-batch", "2",
            "--max-prompt", "128",
            "--seq-len", "256", "--rows", "1", "--draft-vocab", "512", "--ttt-steps", "3", "--save-every", "2",
            "--eval-prompts", "1", "--eval-tokens", "8", "--chain-depth", "3", "--alpha-steps", "3"]


@pytest.fixture(scope="module")
def eagle3_run(smollm, tmp_path_factory):
    """An EAGLE-3 pipeline run SIGKILLed during training (a subprocess), then resumed here to the end on
    the session's target (same model and dtype). -> (run dir, checkpoint step at the kill, replies bytes)."""
    out = tmp_path_factory.mktemp("pipeline") / "e3"
    proc = subprocess.Popen([sys.executable, "-m", "train.pipeline", "--out", str(out), *PIPELINE, "--steps", "400"],
                            cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    t0 = time.monotonic()
    while not (out / "train" / "ckpt.pt").exists() and proc.poll() is None and time.monotonic() - t0 < 120:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    _, err = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, err.decode()[-2000:]
    killed_at = torch.load(out / "train" / "ckpt.pt", weights_only=True)["state"]["step"]
    replies = {p.name: p.read_bytes() for p in (out / "replies").glob("part_*")}
    pipeline.run(parser().parse_args(["--out", str(out), *PIPELINE, "--steps", str(killed_at + 3), "--resume"]),
                 llm=smollm)
    return out, killed_at, replies


def test_pipeline_killed_and_resumed_ends_with_an_evaluated_official_head(eagle3_run, smollm):
    out, killed_at, replies = eagle3_run
    assert killed_at >= 2 and sorted(replies) == ["part_00000.safetensors", "part_00001.safetensors"]
    assert {p.name: p.read_bytes() for p in (out / "replies").glob("part_*")} == replies  # not regenerated
    steps = [json.loads(line)["step"] for line in open(out / "train" / "train_log.jsonl")]
    assert steps[-3:] == [killed_at + 1, killed_at + 2, killed_at + 3]  # continued from the checkpoint
    state = json.loads((out / "state.json").read_text())
    assert state["done"] == ["replies", "train", "evaluate"] and state["sequences"] == 6  # 1 of 4 too long
    cfg = json.loads((out / "train" / "head" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 512
    e = json.loads((out / "eval.json").read_text())
    assert e["kind"] == "eagle3" and len(e["n_alpha"]) == 3 and all(0 <= a <= 1 for a in e["n_alpha"])
    assert e["n_alpha_counts"][0] > 0 and e["train"]["steps"] == killed_at + 3
    mt = e["mt_bench_style"]  # the second held-out set: the MT-bench-style prompts' greedy replies
    assert mt["prompts"] == len(data.MT_BENCH_STYLE) and len(mt["n_alpha"]) == 3
    assert list(mt["first_step_by_category"]) == list(dict.fromkeys(data.FIRST_TEN_CATEGORIES))
    assert all(0 <= a <= 1 for a in mt["first_step_by_category"].values())
    assert all(0 <= a <= 1 for a in mt["n_alpha"]) and mt["n_alpha_counts"][0] > 0
    assert abs(mt["n_alpha_chain_accept_len"] - evaluate.chain_accept_length(mt["n_alpha"])) < 2e-3  # alpha rounded
    assert mt["chain"]["same_as_vanilla"] and mt["chain"]["tau"] >= 1 and mt["chain"]["rounds"] > 0
    from engine.device import defaults
    for run, shape in (("chain", [3, 1, 4]), ("tree", list(defaults(torch.device("cpu")).tree))):  # the CPU default
        assert e[run]["shape"] == shape and e[run]["same_as_vanilla"] and e[run]["tau"] >= 1
        assert e[run]["rounds"] > 0 and len(e[run]["accept_by_depth"]) <= shape[0]
    assert e["vanilla"]["new_tokens"] == e["chain"]["new_tokens"] > 0
    assert (out / "eval.png").stat().st_size > 10_000
    # a finished run resumed does nothing more; without --resume the directory is refused
    again = pipeline.run(parser().parse_args(["--out", str(out), *PIPELINE, "--resume"]), llm=smollm)
    assert again == e and [json.loads(x)["step"] for x in open(out / "train" / "train_log.jsonl")] == steps
    with pytest.raises(ValueError, match="--resume"):
        pipeline.run(parser().parse_args(["--out", str(out), *PIPELINE]), llm=smollm)
    with pytest.raises(ValueError, match="--head eagle differs from the run's"):
        pipeline.run(parser().parse_args(["--out", str(out), *PIPELINE, "--head", "eagle", "--resume"]), llm=smollm)


def test_pipeline_eagle1_and_the_comparison_plot(eagle3_run, smollm, tmp_path, capsys):
    out = tmp_path / "e1"
    e = pipeline.run(parser().parse_args(["--out", str(out), *PIPELINE, "--head", "eagle", "--steps", "2"]),
                     llm=smollm)
    assert e["kind"] == "eagle" and e["chain"]["same_as_vanilla"] and e["tree"]["same_as_vanilla"]
    assert load_head(out / "train" / "head", smollm.model).kind == "eagle"
    assert evaluate.main(["--compare", str(out), str(eagle3_run[0]), "--png", str(tmp_path / "cmp.png")]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["run"].split()[0] for r in rows] == ["EAGLE-1", "EAGLE-3"] and len(rows[1]["n_alpha"]) == 3
    assert (tmp_path / "cmp.png").stat().st_size > 10_000
    assert evaluate.main(["--compare", str(tmp_path / "none"), "--png", str(tmp_path / "x.png")]) == 2


def test_pipeline_trains_on_replies_from_another_run(eagle3_run, smollm, tmp_path):
    """--num-prompts 0 --replies-from: no replies of its own, training on the other run's (what a GPU session
    does with replies the CPU generated in earlier sessions)."""
    out = tmp_path / "from"
    src = eagle3_run[0] / "replies"
    e = pipeline.run(parser().parse_args(["--out", str(out), *PIPELINE, "--num-prompts", "0", "--replies-from",
                                          str(src), "--steps", "2"]), llm=smollm)
    assert not list((out / "replies").glob("part_*")) and e["train"]["steps"] == 2
    assert e["replies"]["sequences"] == 0 and e["replies"]["from"] == {
        str(src): {"sequences": 6, "reply_tokens": sum(len(s) - n for s, n in data.read_replies(src))}}
    assert e["chain"]["same_as_vanilla"]


def test_pipeline_answers_later_turns_in_their_conversation(smollm, tmp_path):
    """--source sharegpt-turns: the target answers later user turns with the conversation before each in its
    prompt (the chat template over the messages), as stored replies say."""
    out = tmp_path / "turns"
    e = pipeline.run(parser().parse_args(["--out", str(out), *PIPELINE, "--source", "sharegpt-turns",
                                          "--num-prompts", "2", "--max-prompt", "1024", "--steps", "1"]), llm=smollm)
    turns = data.source_prompts("sharegpt-turns", "train", 2)
    want = [ids for ids in map(smollm.chat_ids, turns) if len(ids) <= 1024]
    assert want and all(len(t) >= 3 for t in turns)
    assert [s[:n] for s, n in data.read_replies(out / "replies")] == [ids for ids in want for _ in range(2)]
    assert e["replies"]["prompts"] == 2 and e["train"]["steps"] == 1


@pytest.mark.parametrize("argv, message", [
    (["--steps", "-1"], "--steps: must be >= 0"),
    (["--minutes", "0"], "--minutes: must be > 0"),
    (["--tree", "2,2"], "--tree: expected DEPTH,TOPK,TOKENS"),
    (["--gen-batch", "x"], "--gen-batch: expected a int"),
    (["--head", "medusa"], "--head: invalid choice"),
    (["--replies-share", "0.9"], "--replies-share: must be below 0.85"),
    (["--skip-prompts", "-3"], "--skip-prompts: must be >= 0"),
])
def test_pipeline_bad_flags_are_one_line_and_exit_2(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        pipeline.main(["--out", str(tmp_path / "run"), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith(f"error: argument {message}"), err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv, message", [
    (["--init", "no-such-head"], "--init no-such-head: no config.json there"),
    (["--rebuild-vocab"], "--rebuild-vocab moves a trained EAGLE-3 head"),
    (["--grow-mlp", "3072"], "--grow-mlp widens a trained head's MLP (--init)"),
    (["--replies-from", "no-such-dir"], "--replies-from no-such-dir: no reply parts (part_*.safetensors) there"),
])
def test_pipeline_inconsistent_flags_fail_before_loading_anything(argv, message, tmp_path, capsys):
    assert pipeline.main(["--out", str(tmp_path / "run"), "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {message}"), err
    assert not (tmp_path / "run").exists()


def test_mt_bench_style_prompts_eighty_ten_a_category_mixed_from_the_first_n():
    every = data.mt_bench_style()
    categories, texts = zip(*every)
    assert len(set(texts)) == 80 and list(texts[:10]) == data.MT_BENCH_STYLE
    assert set(collections.Counter(categories).values()) == {10}
    assert set(categories) == set(data.MORE_MT_BENCH_STYLE)
    assert set(categories[10:18]) == set(data.MORE_MT_BENCH_STYLE)  # any n mixes them
    assert all(p in data.MORE_MT_BENCH_STYLE[c] for c, p in every[10:])
    assert data.mt_bench_style(12) == every[:12]
    for n in (0, 81):
        with pytest.raises(ValueError, match="there are 80 MT-bench-style prompts"):
            data.mt_bench_style(n)


# The held-out MT-bench-style STEM and humanities prompts' subjects: no training topic may name one.
MT_SUBJECTS = ["sky", "french", "vaccine", "immune", "weather", "climate", "plato", "aristotle", "photosynthesis",
               "silk", "ice", "density", "renaissance", "battery", "democracy", "monarchy", "seasons",
               "industrial", "virus", "bacterium", "primary", "refrigerator", "nile", "egypt", "dna", "demand",
               "press", "fibonacci", "probability", "detective", "hash"]


def test_topic_questions_are_distinct_mix_fields_and_name_no_held_out_subject():
    every = topics.world_questions()
    n_topics = sum(len(ts) for ts in topics.TOPICS.values())
    assert len(every) == len(set(every)) == n_topics * len(topics.QUESTIONS)
    assert topics.world_questions(40) == every[:40]
    first = every[:len(topics.TOPICS)]  # the first round asks every field once
    assert all(any(t in q for t in ts) for q, ts in zip(first, topics.TOPICS.values()))
    assert len({q.split()[0] for q in every[:len(topics.QUESTIONS)]}) > 3  # and mixes the question forms
    words = {w for ts in topics.TOPICS.values() for t in ts for w in re.findall(r"[a-z]+", t.lower())}
    assert words.isdisjoint(MT_SUBJECTS), sorted(words & set(MT_SUBJECTS))
    held_out = {p for _, p in data.mt_bench_style()}
    assert held_out.isdisjoint(every)
    assert data.source_prompts("topics", "train", 5, skip=3) == every[3:8]
    assert parser().parse_args(["--out", "x", "--source", "topics"]).source == "topics"


@pytest.mark.parametrize("n", ["0", "81"])
def test_evaluate_heads_rejects_mt_prompts_out_of_range(n, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--heads", str(tmp_path), "--mt-prompts", n])
    assert e.value.code == 2 and "--mt-prompts must be 1..80" in capsys.readouterr().err


def test_accept_by_certainty_counts_what_n_alpha_counts_and_bins_by_the_targets_own_probability():
    import importlib.util
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "accept_by_certainty.py"
    spec = importlib.util.spec_from_file_location("accept_by_certainty", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    model = tiny_target()
    head = new_head("eagle3", model, draft_vocab_size=40).float()
    features = tiny_features(model)
    g = torch.Generator().manual_seed(3)
    seqs = [(torch.randint(3, 64, (n,), generator=g).tolist(), n // 3) for n in (30, 22, 17)]
    with torch.no_grad():
        hit, p, known = bench.first_steps(features.llm, head, features, seqs)
        hits, counts = n_alpha(head, features([seqs]), 1)
    assert len(hit) == counts[0] and hit.sum() == hits[0]  # the same drafts, scored alike
    assert ((p > 1 / 64) & (p <= 1)).all()
    in_draft = set((torch.arange(40) + head.d2t).tolist())
    starts = [sum(len(s) for s, _ in seqs[:i]) for i in range(len(seqs))]
    scored = [a + t for a, (s, n) in zip(starts, seqs) for t in range(n - 2, len(s) - 2)]  # x_{t+2} replies
    assert len(scored) == len(hit)
    feature = features([seqs])["feature"][0]
    wants = [int(model.logits(feature[t + 1]).argmax()) for t in scored]  # the target's top-1 for x_{t+2}
    certain = model.logits(feature[[t + 1 for t in scored]]).softmax(-1).amax(-1)
    torch.testing.assert_close(p.sort().values, certain.sort().values)  # the Packer orders them its own way
    assert known.sum() == sum(w in in_draft for w in wants)
    assert not known.all() and known.any()  # 40 of 64 ids: both kinds occur
    t = bench.table(torch.tensor([1.0, 0, 1, 1]), torch.tensor([0.1, 0.2, 0.95, 0.6]),
                    torch.tensor([True, False, True, True]))
    assert t["bins"]["0.0-0.3"] == {"share": 0.5, "accept": 0.5, "in_vocab": 0.5, "accept_in_vocab": 1.0}
    assert t["bins"]["0.3-0.5"]["accept"] is None and t["bins"]["0.9-1.0"]["accept"] == 1.0
    assert t["accept"] == 0.75 and t["in_vocab"] == 0.75 and t["accept_in_vocab"] == 1.0
