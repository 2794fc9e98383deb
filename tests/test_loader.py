"""Loaders against transformers on small synthetic checkpoints in the formats of the real targets."""
import json
import shutil

import pytest
import torch

from engine.loader import ModelNotFoundError, load_model, resolve_model
from engine.block_manager import BlockManager
from engine.model_runner import ModelRunner
from tests.conftest import write_tiny_llama

LLAMA31_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def our_logits(path, ids, dtype=torch.float32):
    model, cfg, _ = load_model(str(path), dtype)
    runner = ModelRunner(model, cfg, dtype, torch.device("cpu"), 32, 8, cfg.max_position)
    feature, _, _ = runner.forward(BlockManager(32, 8), [0], [ids])
    return model.logits(feature)


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("overrides", [
    {}, {"tie_word_embeddings": True}, {"rope_scaling": LLAMA31_SCALING, "rope_theta": 500000.0},
    {"num_key_value_heads": 4}, {"num_key_value_heads": 1}])
def test_hf_checkpoint_matches_transformers(tmp_path, overrides):
    hf = write_tiny_llama(tmp_path, seed=1, **overrides)
    ids = torch.randint(3, 64, (150,), generator=torch.Generator().manual_seed(0)).tolist()  # > 32 positions: scaled rope matters
    ours, ref = our_logits(tmp_path, ids), hf_logits(hf, ids)
    assert (ours - ref).abs().max().item() < 1e-4


def test_sharded_checkpoint_loads_shard_by_shard(tmp_path):
    hf = write_tiny_llama(tmp_path, seed=2, max_shard_size="60KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    ids = list(range(3, 40))
    assert (our_logits(tmp_path, ids) - hf_logits(hf, ids)).abs().max().item() < 1e-4


def test_bf16_and_fp16_load(tmp_path):
    hf = write_tiny_llama(tmp_path, seed=3)
    ids = list(range(3, 30))
    ref = hf_logits(hf, ids)
    for dtype in (torch.bfloat16, torch.float16):
        ours = our_logits(tmp_path, ids, dtype)
        assert torch.equal(ours.argmax(-1)[:5], ref.argmax(-1)[:5]) or (ours - ref).abs().max() < 0.1


def test_missing_shard_is_a_clear_error(tmp_path):
    write_tiny_llama(tmp_path, max_shard_size="60KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ModelNotFoundError, match="missing"):
        load_model(str(tmp_path))


def test_truncated_safetensors_is_a_clear_error(tmp_path):
    write_tiny_llama(tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ValueError, match="safetensors"):
        load_model(str(tmp_path))


def test_checkpoint_missing_tensors(tmp_path):
    write_tiny_llama(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_hidden_layers"] = 5  # config claims a layer the weights lack
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="missing"):
        load_model(str(tmp_path))


def test_truncated_gguf_is_a_clear_error(tmp_path):
    src = resolve_model("smollm2-135m").path
    bad = tmp_path / "cut.gguf"
    with open(src, "rb") as f:
        bad.write_bytes(f.read(5_000_000))
    with pytest.raises(ValueError, match="GGUF"):
        load_model(str(bad))


def test_unknown_model_name():
    with pytest.raises(ModelNotFoundError, match="not a known name"):
        resolve_model("no-such-model")


def test_named_model_missing_from_hf_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="Meta-Llama-3-8B-Instruct.*Hugging Face cache"):
        resolve_model("llama3-8b")


def test_named_model_resolves_from_hf_cache(tmp_path, monkeypatch):
    snap = tmp_path / "models--meta-llama--Llama-3.1-8B-Instruct" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    write_tiny_llama(snap, rope_scaling=LLAMA31_SCALING)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    src = resolve_model("llama3.1-8b")
    assert src.kind == "hf" and src.path == snap
    model, cfg, _ = load_model("llama3.1-8b")
    assert cfg.rope_scaling["rope_type"] == "llama3"
