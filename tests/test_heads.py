"""EAGLE heads: official checkpoint format round trips, shape errors, and paged inference == dense training."""
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.config import LlamaConfig
from engine.heads import load_head, new_head
from head_refs import dense_forward
from engine.model import Llama
from engine.model_runner import ModelRunner

EAGLE1_KEYS = {"fc.weight", "fc.bias", "layers.0.post_attention_layernorm.weight",
               *(f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"),
               *(f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))}
EAGLE3_KEYS = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
               *(f"midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")),
               *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
               *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))}


def tiny_target(seed=0, **overrides) -> Llama:
    torch.manual_seed(seed)
    cfg = dict(vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=8, num_heads=4,
               num_kv_heads=2, head_dim=8, max_position=128)
    cfg.update(overrides)
    return Llama(LlamaConfig(**cfg)).eval()


def randomize(head, seed=1):
    """Non-trivial norms and biases, so that a dropped or swapped tensor shows up."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_()
    return head


def make_head(kind, target, **kw):
    head = randomize(new_head(kind, target, **kw))
    if kind == "eagle3" and kw.get("draft_vocab_size"):
        vd = kw["draft_vocab_size"]
        perm = torch.randperm(target.cfg.vocab_size, generator=torch.Generator().manual_seed(3))[:vd].sort().values
        head.d2t.copy_(perm - torch.arange(vd))
        head.t2d.zero_()[perm] = True
    return head


def inputs(head, T, seed=2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, head.cfg.vocab_size, (T,), generator=g)
    hidden = torch.randn(T, head.cfg.hidden_size, generator=g)
    return ids, hidden


@pytest.mark.parametrize("kind,kw,keys", [("eagle", {}, EAGLE1_KEYS),
                                          ("eagle3", {"draft_vocab_size": 20}, EAGLE3_KEYS)])
def test_save_load_round_trip_with_official_keys(tmp_path, kind, kw, keys):
    target = tiny_target()
    head = make_head(kind, target, **kw)
    head.save(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == keys
        if kind == "eagle3":
            assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("t2d").dtype == torch.bool
            assert f.get_tensor("midlayer.self_attn.q_proj.weight").shape == (32, 64)  # reads 2H inputs
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_hidden_layers"] == 1
    assert config.get("draft_vocab_size", 20) == 20
    loaded = load_head(tmp_path, target, kind)
    assert type(loaded) is type(head)
    for (name, a), b in zip(head.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    ids, hidden = inputs(head, 5)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    pos = torch.arange(5)
    assert torch.equal(dense_forward(head, ids[None], hidden[None], pos, mask)[0],
                       dense_forward(loaded, ids[None], hidden[None], pos, mask)[0])


def test_eagle1_without_bias_and_target_embedding_in_checkpoint(tmp_path):
    """LLaMA3 EAGLE-1 heads are stored with "bias": false; some exporters also store the embedding."""
    target = tiny_target()
    head = make_head("eagle", target, bias=False)
    head.save(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["bias"] is False
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    save_file({**tensors, "embed_tokens.weight": target.embed_tokens.weight.detach().clone()},
              str(tmp_path / "model.safetensors"))
    loaded = load_head(tmp_path, target)
    assert loaded.fc.bias is None


def test_head_parameters_exclude_the_shared_target_weights():
    target = tiny_target()
    for kind in ("eagle", "eagle3"):
        head = new_head(kind, target)
        names = dict(head.named_parameters())
        assert not any("embed_tokens" in n for n in names)
        assert all(p is not target.lm_head.weight for p in names.values())
        assert head.embed_tokens is target.embed_tokens


def test_forward_shapes():
    target = tiny_target()
    e1, e3 = make_head("eagle", target), make_head("eagle3", target, draft_vocab_size=20)
    ids, hidden = inputs(e1, 7)
    mask = torch.ones(7, 7, dtype=torch.bool).tril()
    for head, vocab in ((e1, 48), (e3, 20)):
        out, (k, v) = dense_forward(head, ids.expand(2, 7), hidden.expand(2, 7, 32), torch.arange(7), mask)
        assert out.shape == (2, 7, 32) and k.shape == v.shape == (2, 2, 7, 8)
        assert head.logits(out).shape == (2, 7, vocab) and head.logits(out).dtype == torch.float32
    captured = [torch.randn(7, 32) for _ in e3.capture]
    assert e3.capture == (2, 4, 5) and e3.target_feature(None, captured).shape == (7, 32)
    feature = torch.randn(7, 32)
    assert e1.capture == () and torch.equal(e1.target_feature(feature, []), feature)
    draft_ids = torch.arange(20)
    assert torch.equal(e3.t2d[e3.to_target(draft_ids)], torch.ones(20, dtype=torch.bool))
    assert torch.equal(e1.to_target(draft_ids), draft_ids)


def test_projection_is_row_wise():
    """EagleDecoder keeps raw features and projects them later, many rounds' rows in one matmul."""
    target = tiny_target()
    for head in (make_head("eagle", target), make_head("eagle3", target)):
        feature, captured = torch.randn(7, 32), [torch.randn(7, 32) for _ in head.capture]
        raw = [head.raw_feature(feature[i:i + 1], [c[i:i + 1] for c in captured]) for i in range(7)]
        rows = torch.cat([head.project(r) for r in raw])
        torch.testing.assert_close(head.project(torch.cat(raw)), rows)
        torch.testing.assert_close(head.target_feature(feature, captured), rows)


def test_shape_mismatch_is_a_clear_error(tmp_path):
    head = make_head("eagle3", tiny_target(), draft_vocab_size=20)
    head.save(tmp_path / "h")
    with pytest.raises(ValueError, match="hidden size 32 .* target has 64"):
        load_head(tmp_path / "h", tiny_target(hidden_size=64, head_dim=16))
    with pytest.raises(ValueError, match="vocabulary 48; the target has 32 and 50"):
        load_head(tmp_path / "h", tiny_target(vocab_size=50))
    with pytest.raises(ValueError, match="is an eagle3 head, the method needs an eagle head"):
        load_head(tmp_path / "h", tiny_target(), "eagle")
    config = json.loads((tmp_path / "h" / "config.json").read_text())
    (tmp_path / "h" / "config.json").write_text(json.dumps({**config, "intermediate_size": 80}))
    with pytest.raises(ValueError, match="midlayer.mlp.gate_up_proj.weight has shape"):
        load_head(tmp_path / "h", tiny_target())
    with pytest.raises(ValueError, match="expected config.json and model.safetensors"):
        load_head(tmp_path / "missing", tiny_target())


def test_missing_and_unexpected_tensors(tmp_path):
    target = tiny_target()
    make_head("eagle", target).save(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    save_file({k: v for k, v in tensors.items() if k != "fc.weight"}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensor fc.weight"):
        load_head(tmp_path, target)
    save_file({**tensors, "layers.0.input_layernorm.weight": torch.ones(32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected tensor layers.0.input_layernorm.weight"):
        load_head(tmp_path, target)


def paged_forward(head, ids, hidden, chunks, tree_parents=None):
    """Feed the tokens to the head's paged cache in `chunks` (a causal prefix, then optionally a tree);
    -> outputs of every token."""
    from engine.block_manager import BlockManager
    from engine.model_runner import StepPlan
    runner = ModelRunner(head, head.cfg, torch.float32, torch.device("cpu"), 16, 4, head.cfg.max_position)
    blocks = BlockManager(16, 4)
    outs, start = [], 0
    for i, n in enumerate(chunks):
        mask = None
        pos = torch.arange(start, start + n)
        if tree_parents is not None and i == len(chunks) - 1:
            from tests.kernel_refs_attention import ancestor_mask_bits
            mask = ancestor_mask_bits(tree_parents)
            pos = start + tree_depths(tree_parents)
        blocks.reserve(0, start + n)
        meta, _, _ = runner.meta(StepPlan([blocks.block_table(0)], [start], [n]), tree_mask=mask)
        with torch.inference_mode():
            outs.append(head(ids[start:start + n], hidden[start:start + n], pos, runner.layers[0], meta))
        start += n
    return torch.cat(outs)


def tree_depths(parents):
    depth = [0] * len(parents)
    for i, p in enumerate(parents):
        depth[i] = depth[p] + 1 if i else 0
    return torch.tensor(depth)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_paged_forward_matches_dense_causal(kind):
    head = make_head(kind, tiny_target())
    ids, hidden = inputs(head, 11)
    paged = paged_forward(head, ids, hidden, [6, 1, 4])  # prefill, decode, chain
    dense, _ = dense_forward(head, ids[None], hidden[None], torch.arange(11), torch.ones(11, 11).tril().bool())
    torch.testing.assert_close(paged, dense[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_paged_tree_forward_matches_dense_with_ancestor_mask(kind):
    head = make_head(kind, tiny_target())
    parents = [-1, 0, 0, 1, 1, 2, 3]
    P = 5
    ids, hidden = inputs(head, P + len(parents))
    paged = paged_forward(head, ids, hidden, [P, len(parents)], parents)
    anc = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for i in range(len(parents)):
        j = i
        while j >= 0:
            anc[i, j] = True
            j = parents[j]
    mask = torch.ones(P + len(parents), P + len(parents)).tril().bool()
    mask[P:, P:] = anc
    pos = torch.cat([torch.arange(P), P + tree_depths(parents)])
    dense, _ = dense_forward(head, ids[None], hidden[None], pos, mask)
    torch.testing.assert_close(paged, dense[0], atol=1e-5, rtol=1e-5)


def test_dense_past_kv_unrolls_training_time_test():
    """Step 1 over past_kv (step 0's keys) == one dense call over both steps' tokens with the same mask."""
    head = make_head("eagle3", tiny_target())
    S = 6
    ids, hidden = inputs(head, 2 * S)
    causal = torch.ones(S, S).tril().bool()
    pos = torch.arange(S)
    out0, kv0 = dense_forward(head, ids[None, :S], hidden[None, :S], pos, causal)
    mask1 = torch.cat([causal, torch.eye(S, dtype=torch.bool)], dim=1)  # prefix <= s, own earlier step
    out1, kv1 = dense_forward(head, ids[None, S:], out0, pos, mask1, past_kv=kv0)
    assert kv1[0].shape == (1, 2, 2 * S, 8)
    full_mask = torch.zeros(2 * S, 2 * S, dtype=torch.bool)
    full_mask[:S, :S] = causal
    full_mask[S:] = mask1
    both, _ = dense_forward(head, ids[None], torch.cat([hidden[None, :S], out0], 1), torch.cat([pos, pos]), full_mask)
    torch.testing.assert_close(out1, both[:, S:], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="key columns"):
        dense_forward(head, ids[None, S:], out0, pos, causal, past_kv=kv0)


# ------------------------------------------------------------------ heads as published: .bin, stray buffers, full vocab

def saved_tensors(head, path):
    """The head's official checkpoint tensors (as `save` writes them) and its config dict."""
    head.save(path)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return tensors, json.loads((path / "config.json").read_text())


def write_bin_head(path, tensors, config):
    """A head directory as many are published: config.json + pytorch_model.bin (torch.save of a state dict)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    torch.save(tensors, str(path / "pytorch_model.bin"))
    return path


def assert_same_head(a, b):
    assert type(a) is type(b)
    for (name, x), (name_b, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert name == name_b and torch.equal(x, y), name
    ids, hidden = inputs(a, 5)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    pos = torch.arange(5)
    out_a, out_b = (dense_forward(h, ids[None], hidden[None], pos, mask)[0] for h in (a, b))
    assert torch.equal(out_a, out_b) and torch.equal(a.logits(out_a), b.logits(out_b))


class MarkerPayload:
    """Unpickling this creates `path` (open(path, "w")): the proof that code from a checkpoint ran."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


@pytest.mark.parametrize("kind,kw", [("eagle", {}), ("eagle3", {"draft_vocab_size": 20})])
def test_pytorch_model_bin_loads_like_safetensors(tmp_path, kind, kw):
    target = tiny_target()
    tensors, config = saved_tensors(make_head(kind, target, **kw), tmp_path / "st")
    write_bin_head(tmp_path / "bin", tensors, config)
    assert_same_head(load_head(tmp_path / "st", target), load_head(tmp_path / "bin", target, kind))


def test_safetensors_is_preferred_over_a_bin_beside_it(tmp_path):
    target = tiny_target()
    head = make_head("eagle", target)
    head.save(tmp_path)
    marker = tmp_path / "ran"
    torch.save({"fc.weight": torch.zeros(3), "x": MarkerPayload(marker)}, str(tmp_path / "pytorch_model.bin"))
    assert_same_head(head, load_head(tmp_path, target))
    assert not marker.exists()


def test_a_bin_that_is_not_a_flat_tensor_dict_is_refused_and_runs_nothing(tmp_path):
    target = tiny_target()
    tensors, config = saved_tensors(make_head("eagle", target), tmp_path / "st")
    marker = tmp_path / "code_ran"
    bad = {"pickled object": {**tensors, "evil": MarkerPayload(marker)},
           "nested dict": {**tensors, "extra": {"fc.weight": tensors["fc.weight"]}},
           "non-tensor value": {**tensors, "step": 3},
           "wrapped state dict": {"state_dict": tensors},
           "a list": [tensors["fc.weight"]]}
    for case, obj in bad.items():
        write_bin_head(tmp_path / "bad", obj, config)
        with pytest.raises(ValueError, match="pytorch_model.bin: refused") as err:
            load_head(tmp_path / "bad", target)
        assert "\n" not in str(err.value), case
        assert not marker.exists(), case
    write_bin_head(tmp_path / "bad", bad["pickled object"], config)
    with pytest.raises(ValueError, match=r"refused.*Unsupported global.*open"):
        load_head(tmp_path / "bad", target)
    assert not marker.exists()
    # The control: an unrestricted unpickle of the same file does run the payload.
    torch.load(str(tmp_path / "bad" / "pytorch_model.bin"), weights_only=False)
    assert marker.exists()


def test_convert_cli_writes_safetensors_that_load_identically(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from engine.heads import main
    target = tiny_target()
    tensors, config = saved_tensors(make_head("eagle3", target, draft_vocab_size=20), tmp_path / "st")
    half = {k: v.half() if v.is_floating_point() else v for k, v in tensors.items()}  # as published: fp16
    qkv = [f"midlayer.self_attn.{p}_proj.weight" for p in "qkv"]  # views of one storage (safetensors refuses)
    half.update(zip(qkv, torch.cat([half[n] for n in qkv]).split([half[n].shape[0] for n in qkv])))
    src = write_bin_head(tmp_path / "bin", {**half, "midlayer.self_attn.rotary_emb.inv_freq": torch.ones(4)}, config)
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "engine.heads", "convert", str(src), "--out", str(tmp_path / "out")],
                          cwd=repo, env={**__import__("os").environ, "PYTHONPATH": str(repo)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / "out" / "model.safetensors")
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == config
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(half) | {"midlayer.self_attn.rotary_emb.inv_freq"}
        assert all(torch.equal(f.get_tensor(k), v) for k, v in half.items())  # names and dtypes kept
    assert_same_head(load_head(src, target), load_head(tmp_path / "out", target))
    # In place: model.safetensors next to the .bin, then preferred; a second run will not overwrite it.
    assert main(["convert", str(src)]) == 0 and (src / "model.safetensors").exists()
    assert_same_head(load_head(src, target), load_head(tmp_path / "out", target))
    assert main(["convert", str(src)]) == 2
    assert main(["convert", str(src), "--force"]) == 0
    assert main(["convert", str(tmp_path / "st")]) == 2  # no .bin there


def test_stray_rotary_buffers_are_ignored_other_tensors_are_not(tmp_path):
    target = tiny_target()
    for kind, layer in (("eagle", "layers.0"), ("eagle3", "midlayer")):
        head = make_head(kind, target)
        tensors, config = saved_tensors(head, tmp_path / kind)
        inv_freq = 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8)
        save_file({**tensors, f"{layer}.self_attn.rotary_emb.inv_freq": inv_freq,
                   "embed_tokens.weight": target.embed_tokens.weight.detach().clone()},
                  str(tmp_path / kind / "model.safetensors"))
        assert_same_head(head, load_head(tmp_path / kind, target))
        save_file({**tensors, f"{layer}.self_attn.rotary_emb.cos_cached": torch.ones(4)},
                  str(tmp_path / kind / "model.safetensors"))
        with pytest.raises(ValueError, match="unexpected tensor .*rotary_emb.cos_cached"):
            load_head(tmp_path / kind, target)


def official_eagle3_config(**overrides):
    """Shaped like published EAGLE-3 configs (SpecForge / SGLang style), for the tiny target's dimensions:
    no head_dim (hidden / heads), llama3 rope scaling, draft_vocab_size, target_hidden_size."""
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "bos_token_id": 1,
           "eos_token_id": [2, 3], "hidden_act": "silu", "hidden_size": 32, "initializer_range": 0.02,
           "intermediate_size": 64, "max_position_embeddings": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_hidden_layers": 1, "pad_token_id": 0, "rms_norm_eps": 1e-05,
           "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                            "original_max_position_embeddings": 32, "rope_type": "llama3"},
           "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "float16",
           "transformers_version": "4.28.1", "use_cache": True, "vocab_size": 48, "draft_vocab_size": 20,
           "target_hidden_size": 32}
    cfg.update(overrides)
    return cfg


def test_official_eagle3_config_loads(tmp_path):
    from engine.model import rope_inv_freq
    target = tiny_target()
    head = make_head("eagle3", target, draft_vocab_size=20)
    tensors, _ = saved_tensors(head, tmp_path / "st")
    config = official_eagle3_config()
    loaded = load_head(write_bin_head(tmp_path / "h", tensors, config), target, "eagle3")
    assert loaded.cfg.head_dim == 8 and loaded.cfg.rope_theta == 500000.0
    assert loaded.cfg.rope_scaling == config["rope_scaling"] and loaded.cfg.max_position == 128  # the target's
    inv_freq = rope_inv_freq(8, 500000.0, config["rope_scaling"])
    angles = torch.outer(torch.arange(128, dtype=torch.float64), inv_freq)
    assert torch.equal(loaded.rotary.cos, torch.cat([angles, angles], -1).cos().float())
    assert torch.equal(loaded.to_target(torch.arange(20)), head.to_target(torch.arange(20)))
    # A head whose features come from a target of another width is not supported: a clear error.
    (tmp_path / "h" / "config.json").write_text(json.dumps({**config, "target_hidden_size": 64}))
    with pytest.raises(ValueError, match="target_hidden_size != hidden_size"):
        load_head(tmp_path / "h", target)


def test_reduced_vocab_map_is_completed_and_checked(tmp_path):
    target = tiny_target()
    head = make_head("eagle3", target, draft_vocab_size=20)
    tensors, config = saved_tensors(head, tmp_path / "st")
    no_t2d = {k: v for k, v in tensors.items() if k != "t2d"}
    assert_same_head(head, load_head(write_bin_head(tmp_path / "a", no_t2d, config), target))  # t2d from d2t
    write_bin_head(tmp_path / "b", {k: v for k, v in tensors.items() if k != "d2t"}, config)
    with pytest.raises(ValueError, match="missing tensor d2t"):
        load_head(tmp_path / "b", target)
    write_bin_head(tmp_path / "c", {**tensors, "d2t": tensors["d2t"] + 40}, config)
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        load_head(tmp_path / "c", target)
    write_bin_head(tmp_path / "d", {**tensors, "t2d": ~tensors["t2d"]}, config)
    with pytest.raises(ValueError, match="t2d does not mark exactly"):
        load_head(tmp_path / "d", target)


@pytest.mark.parametrize("draft_vocab_size", [None, 48])
def test_full_vocabulary_eagle3_head_without_d2t_t2d(tmp_path, draft_vocab_size):
    target = tiny_target()
    head = make_head("eagle3", target)  # draft vocabulary = the target's
    tensors, _ = saved_tensors(head, tmp_path / "st")
    tensors = {k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}
    config = official_eagle3_config(draft_vocab_size=draft_vocab_size, rope_scaling=None, rope_theta=10000.0)
    if draft_vocab_size is None:
        del config["draft_vocab_size"]
    loaded = load_head(write_bin_head(tmp_path / "h", tensors, config), target, "eagle3")
    assert loaded.lm_head.weight.shape == (48, 32)
    assert torch.equal(loaded.to_target(torch.arange(48)), torch.arange(48)) and bool(loaded.t2d.all())
    assert_same_head(head, loaded)


def test_full_vocabulary_eagle3_head_decodes_like_vanilla(tmp_path):
    """An official-style full-vocabulary EAGLE-3 head (pytorch_model.bin, no d2t / t2d, no draft_vocab_size)
    through the engine: speculative greedy output is vanilla's."""
    from engine.heads import new_head
    from engine.llm import LLM
    from engine.scheduler import SamplingParams
    from tests.conftest import write_tiny_llama
    from tests.test_speculative_sampling import write_tokenizer
    vocab = 96
    hf = write_tiny_llama(tmp_path / "target", seed=5, vocab_size=vocab, num_hidden_layers=8)
    with torch.no_grad():
        hf.lm_head.weight.mul_(10.0)
    hf.save_pretrained(str(tmp_path / "target"), safe_serialization=True)
    write_tokenizer(tmp_path / "target", vocab)
    llm = LLM(str(tmp_path / "target"), "float32", device="cpu", kv_cache_gb=0.02, block_size=8, max_batch=4, seed=1)
    head = randomize(new_head("eagle3", llm.model))
    tensors, config = saved_tensors(head, tmp_path / "st")
    del config["draft_vocab_size"]
    write_bin_head(tmp_path / "head", {k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}, config)
    prompts = [[1, 5, 9, 11, 4], [1, 7], [1, 3, 3, 3, 4, 5, 6, 7, 8]]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    llm.set_method("vanilla")
    vanilla = [s.output_ids for s in llm.generate(prompts, params)[0]]
    llm.set_method("eagle3", {"head": str(tmp_path / "head"), "depth": 3, "topk": 4, "tree_tokens": 8})
    assert torch.equal(llm.decoder.head.to_target(torch.arange(vocab)), torch.arange(vocab))
    seqs, stats = llm.generate(prompts, params)
    assert [s.output_ids for s in seqs] == vanilla
    assert stats.as_dict()["rounds"] > 0
