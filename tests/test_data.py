"""Training data: streamed ShareGPT parse, held-out split, chat loss mask, draft vocabulary, features."""
import hashlib
import io
import json
from collections import Counter

import pytest
import torch

from engine import data
from engine.config import LlamaConfig
from engine.model import Llama


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


@pytest.fixture(scope="module")
def tokenizer():
    from engine.loader import load_tokenizer, resolve_model
    return load_tokenizer(resolve_model("smollm2-135m"))


def test_assistant_only_loss_mask(tokenizer):
    msgs = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "One, two, three."}]
    ids, mask = data.chat_tokens(tokenizer, msgs)
    full = tokenizer.encode(tokenizer.apply_chat_template(msgs, tokenize=False), add_special_tokens=False)
    assert ids == full and len(mask) == len(ids)
    # masked runs are exactly the assistant replies, each ending with the end-of-turn token
    runs, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    runs += [cur] if cur else []
    eos = tokenizer.eos_token_id
    assert [r[-1] for r in runs] == [eos, eos]
    assert [tokenizer.decode(r[:-1]) for r in runs] == ["Hello! How can I help?", "One, two, three."]
    short, smask = data.chat_tokens(tokenizer, msgs, max_len=10)
    assert short == ids[:10] and smask == mask[:10]


def test_regenerate_skips_prompts_that_cannot_fit(smollm):
    convs = [[{"role": "user", "content": "Say hi."}], [{"role": "user", "content": "word " * 400}],
             [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Red."},
              {"role": "user", "content": "word " * 400}]]
    out = data.regenerate(smollm, convs, max_new_tokens=3, turns=2, max_prompt=64)
    roles = [[m["role"] for m in c] for c in out]
    assert roles == [["user", "assistant"], ["user"], ["user", "assistant", "user"]]
    assert out[2][1]["content"] != "Red."  # the first round was regenerated


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


def test_dense_features_match_paged_engine():
    from engine.block_manager import BlockManager
    from engine.model_runner import ModelRunner
    model = tiny_target()
    runner = ModelRunner(model, model.cfg, torch.float32, torch.device("cpu"), 16, 16, model.cfg.max_position)
    seqs = [torch.randint(0, 64, (n,)).tolist() for n in (20, 7)]
    feat, cap, cu = runner.forward(BlockManager(16, 16), [0, 1], seqs, capture=model.cfg.eagle3_layers)
    ids = torch.zeros(2, 20, dtype=torch.long)
    ids[0], ids[1, :7] = torch.tensor(seqs[0]), torch.tensor(seqs[1])
    hidden, feature = data.target_features(model, ids, model.cfg.eagle3_layers)
    paged_hidden = torch.cat(cap, -1)
    torch.testing.assert_close(feature[0], feat[:20], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(feature[1, :7], feat[20:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden[0], paged_hidden[:20], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden[1, :7], paged_hidden[20:], atol=1e-5, rtol=1e-5)


def test_write_shard_roundtrip(tmp_path):
    model = tiny_target()
    seqs = [(torch.randint(0, 64, (n,)).tolist(), [0] * (n // 2) + [1] * (n - n // 2)) for n in (9, 30, 4)]
    path = tmp_path / "shard_00000.safetensors"
    data.write_shard(path, model, model.cfg.eagle3_layers, seqs, batch_tokens=40)
    s = data.load_shard(path)
    assert s["cu_seqlens"].tolist() == [0, 9, 39, 43]
    assert s["input_ids"].tolist() == [t for ids, _ in seqs for t in ids]
    assert s["loss_mask"].tolist() == [m for _, mask in seqs for m in mask]
    assert s["hidden"].shape == (43, 96) and s["hidden"].dtype == torch.bfloat16
    ids = torch.tensor(seqs[1][0])[None]
    hidden, feature = data.target_features(model, ids, model.cfg.eagle3_layers)
    torch.testing.assert_close(s["feature"][9:39].float(), feature[0], atol=2e-2, rtol=1e-2)
    with torch.inference_mode():
        assert s["target_top1"][9:39].tolist() == model.logits(feature[0]).argmax(-1).tolist()
    counts = data.token_counts(tmp_path, 64)
    want = torch.bincount(s["input_ids"].long()[s["loss_mask"].bool()], minlength=64)
    assert torch.equal(counts, want)


def test_cli_builds_a_cache_on_the_chosen_device(tmp_path):
    out = tmp_path / "cache"
    rc = data.main(["--out", str(out), "--source", "humaneval", "--num", "2", "--max-new-tokens", "4",
                    "--max-len", "512", "--shard-convs", "2", "--gen-batch", "2", "--kv-cache-gb", "0.05",
                    "--threads", "1", "--device", "cpu"])
    assert rc == 0
    s = data.load_shard(out / "shard_00000.safetensors")
    assert s["cu_seqlens"].numel() == 3 and s["loss_mask"].sum() > 0
    assert s["hidden"].device.type == "cpu" and s["hidden"].shape[1] == 3 * 576
    assert json.loads((out / "meta.json").read_text())["source"] == "humaneval"
