"""Our engine against transformers on the real embedded model (SmolLM2-135M-Instruct GGUF), fp32."""
import pytest
import torch

from engine.scheduler import SamplingParams
from tests.conftest import CHAT_PROMPTS

NEW_TOKENS = 64


@pytest.fixture(scope="module")
def hf_model(smollm):
    from transformers import AutoModelForCausalLM
    path = smollm.source.path
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_ids(smollm):
    return [smollm.chat_ids(p) for p in CHAT_PROMPTS]


@pytest.fixture(scope="module")
def ours_batched(smollm, prompt_ids):
    seqs, _ = smollm.generate(prompt_ids, SamplingParams(max_new_tokens=NEW_TOKENS))
    return [s.output_ids for s in seqs]


@pytest.fixture(scope="module")
def hf_logits(hf_model, prompt_ids, ours_batched):
    """transformers' logits over prompt + our greedy output, one forward per prompt."""
    out = []
    for ids, gen in zip(prompt_ids, ours_batched):
        with torch.no_grad():
            out.append(hf_model(torch.tensor([ids + gen])).logits[0].float())
    return out


def test_last_position_logits_match_transformers(smollm, prompt_ids, hf_logits):
    runner = smollm.runner
    for i, ids in enumerate(prompt_ids):
        blocks = smollm.scheduler.blocks
        feature, _, _ = runner.forward(blocks, [10_000 + i], [ids])
        blocks.free(10_000 + i)
        ours = smollm.model.logits(feature[-1:])[0]
        assert (ours - hf_logits[i][len(ids) - 1]).abs().max().item() < 1e-4, CHAT_PROMPTS[i]


def test_greedy_tokens_are_transformers_argmax_at_every_step(prompt_ids, ours_batched, hf_logits):
    """Greedy generation is argmax at each step given the tokens before it: checking every position of
    our output against transformers' logits over the same tokens is `generate`'s check, 64 steps at once."""
    for prompt, ids, ours, logits in zip(CHAT_PROMPTS, prompt_ids, ours_batched, hf_logits):
        assert len(ours) == NEW_TOKENS or ours[-1] == 2, prompt
        steps = logits[len(ids) - 1: len(ids) - 1 + len(ours)]
        assert steps.argmax(-1).tolist() == ours, prompt


def test_greedy_tokens_match_transformers_generate(hf_model, prompt_ids, ours_batched):
    for i in (0, 9, 17):  # generate itself (incremental KV cache) on a few prompts
        ids = prompt_ids[i]
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                    attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        assert out[0, len(ids):].tolist() == ours_batched[i], CHAT_PROMPTS[i]


def test_batched_greedy_equals_each_sequence_alone(smollm, prompt_ids, ours_batched):
    for i in (0, 7, 19):   # a spread of prompt lengths; every prompt ran in the batch of 20
        seqs, _ = smollm.generate([prompt_ids[i]], SamplingParams(max_new_tokens=NEW_TOKENS))
        assert seqs[0].output_ids == ours_batched[i], CHAT_PROMPTS[i]


def test_kv_blocks_all_return_to_the_pool(smollm, prompt_ids):
    smollm.generate(prompt_ids[:4], SamplingParams(max_new_tokens=8))
    assert smollm.scheduler.blocks.num_free == smollm.scheduler.blocks.num_blocks


def test_sampling_is_seeded_and_reproducible(smollm, prompt_ids):
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_new_tokens=16)
    runs = []
    for _ in range(2):
        smollm.reseed(123)
        seqs, _ = smollm.generate(prompt_ids[:2], params)
        runs.append([s.output_ids for s in seqs])
    assert runs[0] == runs[1]
