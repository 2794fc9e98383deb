"""Trainer: TTT attention vs a naive chain-draft loop, loss decrease on a tiny target, exact resume."""
import json

import pytest
import torch

from engine import data
from engine.heads import load_head, new_head
from engine.train import PackedData, parser, remap_draft_vocab, train
from engine.train_ttt import n_alpha, prefix_mask, shift, ttt_unroll
from test_data import tiny_target


def tiny_batch(model, lens=(12, 9), seed=1):
    """One packed row of conversations with their features, as PackedData.load returns."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 64, (sum(lens),), generator=g)
    doc = torch.cat([torch.full((n,), j) for j, n in enumerate(lens)])
    pos = torch.cat([torch.arange(n) for n in lens])
    mask = torch.cat([(torch.arange(n) >= n // 3).long() for n in lens])
    hidden, feature = [], []
    for j, n in enumerate(lens):
        h, f = data.target_features(model, ids[doc == j][None], model.cfg.eagle3_layers)
        hidden.append(h[0])
        feature.append(f[0])
    feature = torch.cat(feature)
    with torch.inference_mode():
        top1 = model.logits(feature).argmax(-1)
    return {"input_ids": ids[None], "doc": doc[None], "pos": pos[None], "loss_mask": mask[None],
            "hidden": torch.cat(hidden)[None].clone(), "feature": feature[None].clone(), "target_top1": top1[None]}


def naive_chain(head, batch, steps):
    """Per position t and step i, an inference-like chain draft with forward_dense: the real prefix of
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
        out, kv = head.forward_dense(pref_ids, hidden0[start:t + 1][None], torch.arange(n), causal)
        outs[0, t], h = out[0, -1], out[:, -1:]
        for i in range(1, steps):
            nxt = t + 1 + i
            if nxt >= S or doc[nxt] != doc[t]:
                break
            h, kv = head.forward_dense(ids[nxt][None, None], h, torch.tensor([n - 1 + i]),
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
    from engine.train_ttt import valid_at
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


def write_tiny_data(tmp_path, model, n_seqs=24, seed=0):
    """Conversations of a deterministic token pattern, so a head can learn the target's next token."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for _ in range(n_seqs):
        n = int(torch.randint(10, 30, (1,), generator=g))
        start, step = int(torch.randint(3, 64, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
        ids = [(start + step * k) % 61 + 3 for k in range(n)]
        seqs.append((ids, [0] * 4 + [1] * (n - 4)))
    root = tmp_path / "cache"
    root.mkdir()
    for k in range(0, n_seqs, 8):
        data.write_shard(root / f"shard_{k // 8:05d}.safetensors", model, model.cfg.eagle3_layers,
                         seqs[k:k + 8], batch_tokens=64)
    return root


def args_for(root, out, *extra):
    return parser().parse_args(["--data", str(root), "--out", str(out), "--draft-vocab", "48", "--seq-len", "64",
                                "--ttt-steps", "3", "--lr", "3e-3", "--warmup", "3", "--threads", "1", "--quiet",
                                "--device", "cpu", *extra])


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
def test_tiny_training_lowers_loss(tmp_path, kind):
    model = peaked_target()
    root = write_tiny_data(tmp_path, model)
    train(args_for(root, tmp_path / "run", "--head", kind, "--steps", "100", "--save-every", "100"), target=model)
    log = [json.loads(line) for line in open(tmp_path / "run" / "train_log.jsonl")]
    first, last = sum(r["loss"] for r in log[:5]) / 5, sum(r["loss"] for r in log[-5:]) / 5
    assert last < 0.8 * first, (first, last)
    assert sum(log[-1]["acc"]) > sum(log[0]["acc"])
    head = load_head(tmp_path / "run" / "head", model)  # the exported official checkpoint loads back
    assert head.kind == kind
    cfg = json.loads((tmp_path / "run" / "head" / "config.json").read_text())
    if kind == "eagle3":
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 48
        assert torch.equal(head.t2d.nonzero().flatten(), torch.arange(48) + head.d2t)
    batch = PackedData(root, 64, 1, 0).load([[0, 1]])
    hits, counts = n_alpha(head.float(), batch, 3)
    assert (hits <= counts).all() and counts[0] > 0


def test_resume_is_bit_identical(tmp_path):
    model = tiny_target()
    root = write_tiny_data(tmp_path, model)
    common = ("--steps", "8", "--save-every", "100", "--rows", "2")
    train(args_for(root, tmp_path / "full", *common), target=model)
    train(args_for(root, tmp_path / "pieces", *common, "--stop-after", "3"), target=model)
    train(args_for(root, tmp_path / "pieces", *common, "--stop-after", "2", "--resume"), target=model)
    train(args_for(root, tmp_path / "pieces", *common, "--resume"), target=model)
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
    model = peaked_target()
    root = write_tiny_data(tmp_path, model)
    train(args_for(root, tmp_path / "a", "--steps", "40", "--save-every", "100"), target=model)
    # A near-zero learning rate: the warm-started head must export exactly the head it started from.
    train(args_for(root, tmp_path / "b", "--steps", "2", "--lr", "1e-12", "--init", str(tmp_path / "a" / "head")),
          target=model)
    a, b = load_head(tmp_path / "a" / "head", model), load_head(tmp_path / "b" / "head", model)
    for (name, ta), tb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(ta, tb), name
    first = lambda run: json.loads(open(tmp_path / run / "train_log.jsonl").readline())["loss"]  # noqa: E731
    assert first("b") < first("a")  # it starts where run a ended, not from scratch
    with pytest.raises(ValueError, match="draft vocabulary"):
        train(args_for(root, tmp_path / "c", "--steps", "1", "--draft-vocab", "32",
                       "--init", str(tmp_path / "a" / "head")), target=model)


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
    model = peaked_target()
    root = write_tiny_data(tmp_path, model)
    with pytest.raises(ValueError, match="rebuild-vocab"):
        train(args_for(root, tmp_path / "b", "--steps", "1", "--rebuild-vocab"), target=model)
    train(args_for(root, tmp_path / "c", "--steps", "40", "--save-every", "100", "--lr", "1e-3"), target=model)
    counts = data.token_counts(root, 64)
    train(args_for(root, tmp_path / "d", "--steps", "1", "--save-every", "100", "--lr", "1e-12", "--rebuild-vocab",
                   "--init", str(tmp_path / "c" / "head")), target=model)
    c, d = load_head(tmp_path / "c" / "head", model), load_head(tmp_path / "d" / "head", model)
    assert torch.equal(d.t2d, data.build_draft_vocab(counts, 48, 64)[1])
    assert torch.equal(c.t2d, d.t2d)  # same data, same vocabulary: every row is kept as it was
    assert torch.equal(c.lm_head.weight, d.lm_head.weight)
