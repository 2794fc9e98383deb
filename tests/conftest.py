"""Shared fixtures: the real SmolLM2 target (loaded once per session) and tiny synthetic checkpoints."""
import os
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels run in the interpreter. Triton reads this when a kernel module is
# imported, so it is set here, before any test module imports eagle_kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One intra-op thread: decode is bandwidth-bound (one thread nearly saturates memory here), and with two
# threads any other load on a 2-core host stalls every GEMM on its busy partner (measured 16x slower).
torch.set_num_threads(1)

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a binary search does in two sentences.",
    "Give me three tips for better sleep.",
    "How do I reverse a list in Python?",
    "What is the difference between weather and climate?",
    "Translate 'good morning' into Spanish and German.",
    "Summarize the plot of Romeo and Juliet.",
    "Why is the sky blue?",
    "Write a short poem about autumn leaves.",
    "What are the benefits of drinking water?",
    "Explain recursion to a ten year old.",
    "List five fruits that are red.",
    "What does HTTP stand for?",
    "How many legs does a spider have?",
    "Suggest a name for a friendly robot.",
    "What is photosynthesis?",
    "Write a SQL query that counts rows in a table named users.",
    "Describe a sunset in one paragraph.",
    "What is 17 times 23?",
]


@pytest.fixture(scope="session")
def smollm():
    """The embedded default model in fp32 (the parity reference dtype)."""
    from engine.llm import LLM
    return LLM("smollm2-135m", "float32", kv_cache_gb=0.25, max_batch=32, weights="dense")  # dequantized: parity with transformers


def tiny_llama_config(**overrides) -> dict:
    cfg = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
               rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False,
               bos_token_id=1, eos_token_id=2)
    cfg.update(overrides)
    return cfg


def write_tiny_llama(path: Path, seed: int = 0, max_shard_size: str | None = None, **overrides):
    """A random Llama saved by transformers in the HF checkpoint format; returns the HF model."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**tiny_llama_config(**overrides))).eval()
    with torch.no_grad():  # HF zero-inits nothing here, but make norms non-trivial
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), safe_serialization=True, **kwargs)
    return model
