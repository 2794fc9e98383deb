"""Training data: streamed ShareGPT parse, held-out split, target replies on disk, draft vocabulary, packing,
online target features."""
import hashlib
import io
import json
from collections import Counter

import pytest
import torch

from train import data
from engine.config import LlamaConfig
from engine.model import Llama
from train.features import TargetFeatures


def conv(i, turns=2):
    msgs = [{"from": "human" if k % 2 == 0 else "gpt", "value": f"turn {k} of conversation {i} é✓"}
            for k in range(turns)]
    return {"id": f"conv_{i}", "conversations": msgs}


def truncated_file(tmp_path, n=50):
    text = json.dumps([conv(i) for i in range(n)], indent=2)
    cut = text.index('"conv_49"') + 20  # inside the last element
    path = tmp_path / "sharegpt.json"
    path.write_bytes(text[:cut].encode())
    return path


@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])
def test_stream_parse_stops_cleanly_at_cut(tmp_path, chunk):
    # small chunks split elements and multi-byte characters across reads
    with open(truncated_file(tmp_path), "rb") as f:
        got = list(data.iter_json_array(f, chunk=chunk))
    assert got == [conv(i) for i in range(49)]


def test_stream_parse_whole_and_empty():
    whole = json.dumps([conv(0), conv(1)]).encode()
    assert list(data.iter_json_array(io.BytesIO(whole), chunk=5)) == [conv(0), conv(1)]
    assert list(data.iter_json_array(io.BytesIO(b"[]"))) == []
    assert list(data.iter_json_array(io.BytesIO(b""))) == []


def test_heldout_split_disjoint_and_stable(tmp_path):
    path = tmp_path / "many.json"
    path.write_text(json.dumps([conv(i) for i in range(3000)]))
    train = {cid for cid, _ in data.sharegpt_conversations("train", str(path))}
    held = {cid for cid, _ in data.sharegpt_conversations("heldout", str(path))}
    assert not train & held and len(train | held) == 3000
    assert 0.01 < len(held) / 3000 < 0.03
    # a pure function of the id (sha1), so every process and Python version splits alike
    want = {f"conv_{i}" for i in range(3000)
            if int.from_bytes(hashlib.sha1(f"conv_{i}".encode()).digest()[:4], "big") % 1000 < 20}
    assert held == want


def test_heldout_prompts_are_first_user_turns():
    prompts = data.heldout_prompts(5)
    assert len(prompts) == 5 and all(isinstance(p, str) and p for p in prompts)
    assert len(data.humaneval_prompts()) == 164


def test_clean_turns_alternates_from_user():
    turns = [{"from": "gpt", "value": "x"}, {"from": "human", "value": "q"}]
    assert data.clean_turns(turns) == []
    turns = [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}, {"from": "gpt", "value": "b"}]
    assert data.clean_turns(turns) == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]


def test_draft_vocab_d2t_t2d():
    V, Vd = 100, 10
    counts = Counter({t: 1000 - 7 * t for t in range(0, 100, 3)})  # 34 seen tokens, frequency by id
    d2t, t2d = data.build_draft_vocab(counts, Vd, V)
    assert d2t.dtype == torch.int64 and d2t.shape == (Vd,) and t2d.dtype == torch.bool and t2d.shape == (V,)
    target = torch.arange(Vd) + d2t
    assert target.tolist() == [3 * k for k in range(Vd)]  # the Vd most frequent, in id order
    assert t2d.nonzero().flatten().tolist() == target.tolist()
    assert t2d.sum() == Vd
    # more draft slots than seen tokens: unseen ones fill by id, still a bijection
    d2t, t2d = data.build_draft_vocab(counts, 40, V)
    target = torch.arange(40) + d2t
    assert len(set(target.tolist())) == 40 and t2d[target].all() and t2d.sum() == 40


def tiny_target(seed=0, layers=8):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=layers, num_heads=4,
                      num_kv_heads=2, head_dim=8, max_position=256, eos_token_ids=(2,))
    return Llama(cfg).eval()



def tiny_features(model, capture=None, blocks=64):
    """Online features of a tiny target through its own engine (a pool of `blocks` blocks of 16)."""
    from engine.llm import LLM
    cfg = model.cfg
    block_bytes = 16 * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    llm = LLM(model, "float32", device="cpu", kv_cache_gb=(blocks + 0.5) * block_bytes / 2**30)
    capture = model.cfg.eagle3_layers if capture is None else capture
    return TargetFeatures(llm, capture)


def test_online_features_are_the_engine_forward_of_each_sequence():
    model = tiny_target()
    feats = tiny_features(model)
    g = torch.Generator().manual_seed(0)
    seqs = [(torch.randint(3, 64, (n,), generator=g).tolist(), p) for n, p in ((20, 5), (7, 3), (12, 1))]
    batch = feats([[seqs[0], seqs[1]], [seqs[2]]])
    pool = feats.llm.scheduler.blocks
    assert pool.num_free == pool.num_blocks  # the feature sequences' blocks went back
    assert batch["input_ids"].shape == (2, 27) and batch["hidden"].shape == (2, 27, 96)
    assert batch["doc"][1].tolist() == [0] * 12 + [1] * 15  # padding: its own conversation
    assert batch["pos"][0].tolist() == list(range(20)) + list(range(7))
    assert batch["loss_mask"][0].tolist() == [0] * 5 + [1] * 15 + [0] * 3 + [1] * 4
    alone = tiny_features(model)
    for r, start, (ids, n) in ((0, 0, seqs[0]), (0, 20, seqs[1]), (1, 0, seqs[2])):
        want = alone([[(ids, n)]])
        sl = slice(start, start + len(ids))
        assert batch["input_ids"][r, sl].tolist() == ids
        torch.testing.assert_close(batch["feature"][r, sl], want["feature"][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(batch["hidden"][r, sl], want["hidden"][0], atol=1e-5, rtol=1e-5)
        top1 = model.logits(want["feature"][0]).argmax(-1)
        got = batch["target_top1"][r, sl]
        assert got[n - 1:].tolist() == top1[n - 1:].tolist() and not got[:n - 1].any()
    # a 3-layer capture is EAGLE-3's; EAGLE-1 needs none and gets no hidden
    assert "hidden" not in tiny_features(model, capture=())([[seqs[1]]])


def test_generate_replies_stores_greedy_and_sampled_replies_and_resumes(smollm, tmp_path):
    from safetensors.torch import load_file
    from engine.scheduler import SamplingParams
    prompts = ["Say hi.", "Name a color.", "word " * 400, "Count to three."]
    kw = dict(samples=2, max_new_tokens=6, max_prompt=64, chunk=2, seed=3)
    assert data.generate_replies(smollm, prompts, tmp_path, **kw) == 4
    p0, p1 = (load_file(str(tmp_path / f"part_0000{k}.safetensors")) for k in (0, 1))
    assert p0["prompt_index"].tolist() == [0, 0, 0, 1, 1, 1] and p0["sample"].tolist() == [0, 1, 2] * 2
    assert p1["prompt_index"].tolist() == [3, 3, 3]  # the 400-word prompt is longer than max_prompt
    seqs = data.read_replies(tmp_path)
    assert len(seqs) == 9
    for (ids, n), text in zip(seqs[::3], [prompts[0], prompts[1], prompts[3]]):
        prompt = smollm.chat_ids(text)
        (greedy,), _ = smollm.generate([prompt], SamplingParams(max_new_tokens=6))
        assert ids[:n] == prompt and ids[n:] == greedy.output_ids
    replies = [tuple(ids[n:]) for ids, n in seqs]
    assert any(replies[i + s] != replies[i] for i in (0, 3, 6) for s in (1, 2))  # sampled, not greedy
    # resume: a whole part is kept as it is, a missing one is redone identically (the stream restarts per part)
    before, stamp = (tmp_path / "part_00001.safetensors").read_bytes(), (tmp_path / "part_00000.safetensors").stat()
    (tmp_path / "part_00001.safetensors").unlink()
    assert data.generate_replies(smollm, prompts, tmp_path, **kw) == 4
    assert (tmp_path / "part_00001.safetensors").read_bytes() == before
    assert (tmp_path / "part_00000.safetensors").stat().st_mtime_ns == stamp.st_mtime_ns
    # no chunk starts after the deadline
    assert data.generate_replies(smollm, prompts, tmp_path / "late", deadline=0.0, **kw) == 0
    assert not list((tmp_path / "late").glob("part_*"))
    counts = data.reply_counts(seqs, smollm.cfg.vocab_size)
    assert counts.sum() == sum(len(ids) - n for ids, n in seqs) and counts[smollm.tokenizer.eos_token_id] <= 9


def test_packer_fits_rows_and_is_a_function_of_seed_and_epoch():
    g = torch.Generator().manual_seed(0)
    seqs = [(list(range(int(n))), 1) for n in torch.randint(2, 50, (20,), generator=g)]
    p = data.Packer(seqs, 32, 2, seed=0)
    b0 = p.batches(0)
    rows = [r for b in b0 for r in b]
    assert sorted(k for r in rows for k in r) == list(range(20))
    assert all(len(b) <= 2 for b in b0)
    assert all(sum(len(p.seqs[k][0]) for k in r) <= 32 for r in rows)  # longer sequences were truncated
    assert data.Packer(seqs, 32, 2, seed=0).batches(0) == b0 and p.batches(1) != b0
    assert p.rows_of(b0[0])[0][0] == p.seqs[b0[0][0][0]]
    with pytest.raises(ValueError, match="no training sequences"):
        data.Packer([], 32, 2, 0)


def test_sharegpt_file_gzipped_gives_the_same_prompts(tmp_path):
    """train.pipeline --sharegpt FILE (what benchmarks/gpu_train_stage.py packs for a GPU): a .json.gz reads
    as its .json does, split by id as the package's file is."""
    import gzip
    convs = [conv(i) for i in range(300)]
    plain, packed = tmp_path / "c.json", tmp_path / "c.json.gz"
    plain.write_text(json.dumps(convs))
    with gzip.open(packed, "wt") as f:
        json.dump(convs, f)
    for split in ("train", "heldout"):
        want = data.source_prompts("sharegpt", split, 1000, str(plain))
        assert want and data.source_prompts("sharegpt", split, 1000, str(packed)) == want
    assert len(data.source_prompts("sharegpt", "train", 5, str(packed))) == 5
    # --skip-prompts: a later run continues where an earlier one stopped, with no prompt twice
    first = data.source_prompts("sharegpt", "train", 7, str(packed))
    assert data.source_prompts("sharegpt", "train", 4, str(packed), skip=3) == first[3:7]
    assert data.source_prompts("humaneval", "train", 2, skip=1) == data.source_prompts("humaneval", "train", 3)[1:]


def test_later_turns_are_prompts_with_their_context_and_a_staged_copy_reads_alike(tmp_path):
    """--source sharegpt-turns: each user turn after the first, with the conversation before it (messages for
    the chat template), while that context is at most TURN_CHARS characters; the copy
    benchmarks/gpu_train_stage.py packs (each train conversation cut after its last such turn) gives both
    ShareGPT sources' prompts, in order, as the full file does (--skip-prompts numbers them alike)."""
    import importlib.util
    convs = [conv(i, turns=1 + i % 6) for i in range(300)]  # 1-3 user turns
    long = next(c for c in convs if len(c["conversations"]) >= 5 and not data.is_heldout(c["id"]))
    long["conversations"][1]["value"] = "x" * data.TURN_CHARS  # its context too long from its second user turn
    full = tmp_path / "full.json"
    full.write_text(json.dumps(convs))
    turns = data.source_prompts("sharegpt-turns", "train", 10**6, str(full))
    train = [c for c in convs if not data.is_heldout(c["id"])]
    want = [msgs[:k + 1] for c in train for msgs in [data.clean_turns(c["conversations"])]
            for k in range(2, len(msgs), 2) if c is not long]
    assert turns == want and len(turns) > 100
    assert all(t[-1]["role"] == "user" and len(t) % 2 == 1 for t in turns)
    assert data.source_prompts("sharegpt-turns", "train", 4, str(full), skip=3) == turns[3:7]
    with pytest.raises(ValueError, match="unknown prompt source"):
        data.source_prompts("sharegpt-lastturns", "train", 1, str(full))

    spec = importlib.util.spec_from_file_location("gpu_train_stage", "benchmarks/gpu_train_stage.py")
    stage = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stage)
    staged = tmp_path / "staged.json.gz"
    counts = stage.write_prompts(staged, 10**6, 10**6, str(full))
    assert counts["train"] == len(train) and counts["heldout"] == len(convs) - len(train)
    for source, split in (("sharegpt", "train"), ("sharegpt", "heldout"), ("sharegpt-turns", "train")):
        assert (data.source_prompts(source, split, 10**6, str(staged)) ==
                data.source_prompts(source, split, 10**6, str(full))), (source, split)
    assert staged.stat().st_size < full.stat().st_size  # the cut-off tails are not carried


def test_staged_calls_each_fit_and_carry_everything_once():
    """gpu_train_stage.plan_calls: whatever the GGUF's and the reply archives' sizes, every call stays within
    its room (the last one's with the prompts beside), the GGUF's ranges tile it in order, every archive
    rides exactly one call, and no call more is used than the load needs beyond what whole archives cost;
    an archive larger than a call is refused."""
    import importlib.util
    import random
    spec = importlib.util.spec_from_file_location("gpu_train_stage", "benchmarks/gpu_train_stage.py")
    stage = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stage)
    rng = random.Random(0)
    for _ in range(300):
        room = rng.randint(3 << 20, 40 << 20)
        last = rng.randint(0, room // 2)
        gguf = rng.randint(1, 120 << 20)
        tars = [rng.randint(1, room) for _ in range(rng.randint(0, 9))]
        cuts, homes = stage.plan_calls(gguf, tars, last, room)
        n = len(cuts)
        assert cuts[0][0] == 0 and cuts[-1][1] == gguf
        assert all(a[1] == b[0] for a, b in zip(cuts, cuts[1:])) and all(s <= e for s, e in cuts)
        assert len(homes) == len(tars) and all(0 <= k < n for k in homes)
        for k, (s, e) in enumerate(cuts):
            load = e - s + sum(t for t, h in zip(tars, homes) if h == k) + (last if k == n - 1 else 0)
            assert load <= room, (k, load, room)
        assert n >= -(-(gguf + sum(tars) + last) // room)
        if not tars:  # the GGUF alone cuts anywhere: the fewest calls
            assert n == max(1, -(-(gguf + last) // room))
    with pytest.raises(ValueError, match="largest reply archive"):
        stage.plan_calls(10 << 20, [(8 << 20) + 1], 1 << 20, 8 << 20)


def test_replies_from_elsewhere_are_read_counted_and_checked(tmp_path):
    """--replies-from: another run's parts join the training set with their counts; a directory without parts
    and a token outside the target's vocabulary (another model's replies) are refused."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    data.write_part(data.part_path(a, 0), [([1, 2, 3, 4], 2), ([5, 6], 2)], [(0, 0), (0, 1)])  # 2nd: no reply
    data.write_part(data.part_path(b, 3), [([7, 8, 9], 1)], [(3, 0)])
    seqs, counts = data.read_extra_replies([str(a), str(b)], vocab=10)
    assert seqs == [([1, 2, 3, 4], 2), ([7, 8, 9], 1)]
    assert counts == {str(a): {"sequences": 1, "reply_tokens": 2}, str(b): {"sequences": 1, "reply_tokens": 2}}
    assert data.reply_dirs_error([str(a), str(b)]) is None
    assert data.reply_dirs_error([str(a), str(tmp_path / "none")]) == \
        f"--replies-from {tmp_path / 'none'}: no reply parts (part_*.safetensors) there"
    with pytest.raises(ValueError, match=r"token id 9 is outside the target's vocabulary \[0, 9\)"):
        data.read_extra_replies([str(a), str(b)], vocab=9)


def test_staged_replies_travel_gzipped_and_unpack_to_the_same_parts(tmp_path):
    """gpu_train_stage.py packs each --replies directory into <k>.tar.gz (a GPU session's parts do not fit a
    device call raw); unpacked as gpu_train_run.sh does, they read back as the same sequences."""
    import importlib.util
    import tarfile
    spec = importlib.util.spec_from_file_location("gpu_train_stage", "benchmarks/gpu_train_stage.py")
    stage = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stage)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    data.write_part(data.part_path(a, 0), [([1, 2, 3, 4], 2)], [(0, 0)])
    data.write_part(data.part_path(a, 1), [([5, 6, 7], 1)], [(1, 0)])
    data.write_part(data.part_path(b, 0), [([7, 8, 9, 9, 9], 1)], [(3, 0)])
    stage.pack_replies([a, b], tmp_path / "staged")
    assert sorted(f.name for f in (tmp_path / "staged").iterdir()) == ["0.tar.gz", "1.tar.gz"]
    for k, d in enumerate((a, b)):
        out = tmp_path / "unpacked" / str(k)
        out.mkdir(parents=True)
        with tarfile.open(tmp_path / "staged" / f"{k}.tar.gz") as t:
            t.extractall(out, filter="data")
        assert data.read_replies(out) == data.read_replies(d)
    with pytest.raises(ValueError, match="no reply parts"):
        stage.pack_replies([tmp_path / "unpacked"], tmp_path / "again")
