"""Output-token logprobs (SamplingParams.logprobs): each token's log-probability under the distribution it
is drawn from, with the k most likely alternatives, identical under vanilla and every speculative method
(greedy: the same tokens and the same numbers; sampled: each reported number is what a teacher-forced
forward of the same tokens gives), truncated with the tokens at a stop."""
import math

import pytest
import torch

from engine.scheduler import SamplingParams
from tests.test_engine_paths import METHODS, PROMPTS, llm  # noqa: F401 (the tiny target fixture)

NEW = 8
K = 3


def run(llm, method, args, params):  # noqa: F811
    llm.set_method(method, args)
    seqs, _ = llm.generate(PROMPTS, params)
    assert llm.scheduler.blocks.num_free == llm.scheduler.blocks.num_blocks
    return seqs


def teacher_forced(llm, seq, params):  # noqa: F811
    """The logprobs of seq's output tokens from one forward over prompt + output (LLM.borrow)."""
    ids = seq.prompt_ids + seq.output_ids
    with torch.inference_mode(), llm.borrow() as b:
        feature, _, _ = b.forward([ids[:-1]])
        logits = llm.model.logits(feature[len(seq.prompt_ids) - 1:])
        rows = llm.sampler.logprobs(logits, [params] * logits.shape[0], torch.tensor(seq.output_ids), K)
    return rows.tolist()


@pytest.mark.parametrize("name", ["vanilla"] + list(METHODS))
def test_greedy_logprobs_equal_vanilla(llm, name):  # noqa: F811
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True, logprobs=K)
    ref = run(llm, "vanilla", {}, params)
    method, args = METHODS.get(name, ("vanilla", {}))
    seqs = run(llm, method, args, params)
    for s, r in zip(seqs, ref):
        assert s.output_ids == r.output_ids and s.logprobs == r.logprobs
        assert len(s.logprobs) == len(s.output_ids)
        for tok, (lp, top) in zip(s.output_ids, s.logprobs):
            assert len(top) == K and top[0] == (tok, lp)  # greedy: the chosen token is the most likely
            assert all(a[1] >= b[1] for a, b in zip(top, top[1:])) and lp <= 0
            assert sum(math.exp(v) for _, v in top) <= 1 + 1e-5


@pytest.mark.parametrize("name", ["vanilla", "sps", "eagle3", "eagle3-chain", "eagle3-adaptive"])
def test_sampled_logprobs_are_the_targets(llm, name):  # noqa: F811
    """Sampled (top-k 20, temperature 0.8): each token's logprob is under the transformed distribution, the
    same numbers a teacher-forced forward gives; tokens outside the top-k have -inf there."""
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True, temperature=0.8, top_k=20, seed=7, logprobs=K)
    method, args = METHODS.get(name, ("vanilla", {}))
    for s in run(llm, method, args, params):
        want = teacher_forced(llm, s, params)
        for (lp, top), row in zip(s.logprobs, want):
            assert lp == pytest.approx(row[0], abs=1e-5) and lp > -math.inf
            assert [t for t, _ in top] == [int(t) for t in row[1:1 + K]]
            assert [v for _, v in top] == pytest.approx(row[1 + K:], abs=1e-5)


def test_logprobs_off_and_zero_alternatives(llm):  # noqa: F811
    seqs = run(llm, "eagle3", METHODS["eagle3"][1], SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert all(s.logprobs == [] for s in seqs)
    seqs = run(llm, "eagle3", METHODS["eagle3"][1], SamplingParams(max_new_tokens=NEW, ignore_eos=True, logprobs=0))
    assert all(len(s.logprobs) == NEW and all(top == [] for _, top in s.logprobs) for s in seqs)


def test_mixed_batch_and_stop_truncation(llm):  # noqa: F811
    """Companions without logprobs do not change a request's; a stop cuts logprobs with the tokens."""
    method, args = METHODS["eagle3"]
    alone = run(llm, method, args, SamplingParams(max_new_tokens=NEW, ignore_eos=True, logprobs=2))[0]
    llm.set_method(method, args)
    params = [SamplingParams(max_new_tokens=NEW, ignore_eos=True, logprobs=2),
              SamplingParams(max_new_tokens=NEW, ignore_eos=True),
              SamplingParams(max_new_tokens=3, ignore_eos=True, logprobs=1)]
    seqs, _ = llm.generate(PROMPTS[:3], params)
    assert seqs[0].logprobs == alone.logprobs and seqs[1].logprobs == []
    assert len(seqs[2].output_ids) == len(seqs[2].logprobs) == 3


def test_bad_logprobs_value():
    for bad in (-1, 21):
        with pytest.raises(ValueError, match="logprobs must be in"):
            SamplingParams(logprobs=bad).validate()
