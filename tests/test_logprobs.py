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


# --------------------------------------------------------------------- logit transforms (penalties, ...)

PENALTIES = dict(presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.3, logit_bias={7: 3.0, 9: -2.0},
                 min_tokens=5)


def reference_logprobs(llm, seq, params):  # noqa: F811
    """Each output token's transformed logprob, recomputed position by position in plain torch from a
    teacher-forced forward (an implementation independent of Sampler.adjust)."""
    ids = seq.prompt_ids + seq.output_ids
    with torch.inference_mode(), llm.borrow() as b:
        feature, _, _ = b.forward([ids[:-1]])
        logits = llm.model.logits(feature[len(seq.prompt_ids) - 1:]).float()
    out = []
    for i, (row, tok) in enumerate(zip(logits, seq.output_ids)):
        counts = torch.bincount(torch.tensor(seq.output_ids[:i], dtype=torch.long), minlength=row.numel()).float()
        seen = counts > 0
        seen[seq.prompt_ids] = True
        rp = params.repetition_penalty
        row = torch.where(seen, torch.where(row > 0, row / rp, row * rp), row)  # first, as vLLM
        row = row - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
        for t, v in (params.logit_bias or {}).items():
            row[t] += v
        if i < params.min_tokens:
            row[list(llm.sampler.eos_ids)] = -math.inf
        row = row.to(logits.dtype)
        lp = llm.sampler.logprobs(row[None], [params], torch.tensor([tok]), 0)
        out.append(lp[0, 0].item())
    return out


@pytest.mark.parametrize("name", ["vanilla"] + list(METHODS))
def test_penalties_greedy_equal_vanilla(llm, name):  # noqa: F811
    """Greedy under every transform at once: each method's tokens and logprobs are vanilla's, and both are
    the plain-torch reference's."""
    params = SamplingParams(max_new_tokens=NEW, logprobs=2, **PENALTIES)
    ref = run(llm, "vanilla", {}, params)
    method, args = METHODS.get(name, ("vanilla", {}))
    for s, r in zip(run(llm, method, args, params), ref):
        assert s.output_ids == r.output_ids and s.logprobs == r.logprobs
        assert [lp for lp, _ in s.logprobs] == pytest.approx(reference_logprobs(llm, s, params), abs=1e-5)


@pytest.mark.parametrize("name", ["sps", "eagle3", "eagle3-adaptive"])
def test_penalties_sampled_follow_the_transformed_target(llm, name):  # noqa: F811
    params = SamplingParams(max_new_tokens=NEW, temperature=0.9, seed=3, logprobs=0, **PENALTIES)
    method, args = METHODS[name]
    for s in run(llm, method, args, params):
        got = [lp for lp, _ in s.logprobs]
        assert got == pytest.approx(reference_logprobs(llm, s, params), abs=1e-5) and min(got) > -math.inf


def test_transforms_do_what_they_say(llm):  # noqa: F811
    method, args = METHODS["eagle3"]
    out = run(llm, method, args, SamplingParams(max_new_tokens=NEW, ignore_eos=True, logit_bias={11: 100.0}))
    assert all(s.output_ids == [11] * NEW for s in out)
    eos = sorted(llm.sampler.eos_ids)[0]
    out = run(llm, method, args, SamplingParams(max_new_tokens=NEW, logit_bias={eos: 100.0}, min_tokens=4))
    assert all(s.output_ids[4:] == [eos] and s.finish_reason == "stop" for s in out)


def test_bad_transform_values(llm):  # noqa: F811
    for bad, match in ((dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency"),
                       (dict(repetition_penalty=0), "repetition_penalty"), (dict(logit_bias={1: 101}), "logit_bias"),
                       (dict(min_tokens=9, max_new_tokens=8), "min_tokens")):
        with pytest.raises(ValueError, match=match):
            SamplingParams(**bad).validate()
    with pytest.raises(ValueError, match="logit_bias: token ids"):
        llm.generate([PROMPTS[0]], SamplingParams(logit_bias={10**6: 1.0}))
    assert llm.scheduler.blocks.num_free == llm.scheduler.blocks.num_blocks


def test_adjust_over_a_tree_is_adjust_after_each_nodes_path(llm):  # noqa: F811
    """Sampler.adjust at tree node j (random trees of depth up to 4, every transform) equals adjust of a
    plain step whose output holds the path's drafted tokens: what vanilla would see there."""
    from engine.scheduler import Sequence
    from engine.trees import Tree
    g = torch.Generator().manual_seed(0)
    V = llm.cfg.vocab_size
    parents = torch.tensor([[-1, 0, 0, 1, 3, 4, 2], [-1, 0, 1, 2, 3, 1, 5]], dtype=torch.int32)
    depths = torch.tensor([[0, 1, 1, 2, 3, 4, 2], [0, 1, 2, 3, 4, 2, 3]], dtype=torch.int32)
    tokens = torch.randint(3, V, (2, 7), generator=g)
    tree = Tree(tokens, parents, depths, torch.zeros(2, 7), torch.tensor([7, 7], dtype=torch.int32))
    seqs = [Sequence([1, 5, 9], SamplingParams(max_new_tokens=16, **PENALTIES)),
            Sequence([1, 7], SamplingParams(max_new_tokens=16))]
    seqs[0].output_ids, seqs[1].output_ids = [11, 11, int(tokens[0, 0])], [4, int(tokens[1, 0])]
    logits = torch.randn(2, 7, V, generator=g) * 3
    with torch.inference_mode():
        got = llm.sampler.adjust(logits, seqs, tree)
        assert torch.equal(got[1], logits[1])  # no transforms asked: the row untouched
        for j in range(7):
            path, i = [], j
            while i > 0:
                path.append(int(tokens[0, i]))
                i = int(parents[0, i])
            plain = Sequence(seqs[0].prompt_ids, seqs[0].params, output_ids=seqs[0].output_ids + path[::-1])
            assert torch.equal(got[0, j], llm.sampler.adjust(logits[0, j][None], [plain])[0]), j


@pytest.mark.parametrize("name", ["vanilla", "eagle3", "sps"])
def test_prompt_logprobs_are_a_forward_over_the_prompt(llm, name):  # noqa: F811
    """Prompt logprobs (echo): None for the first token, then each token's under the request's distribution
    from the prefill, equal to a teacher-forced forward's, batched or alone, whatever the method."""
    params = SamplingParams(max_new_tokens=2, ignore_eos=True, prompt_logprobs=2)
    method, args = METHODS.get(name, ("vanilla", {}))
    seqs = run(llm, method, args, params)
    alone = [llm.generate([p], params)[0][0] for p in PROMPTS]
    for s in seqs:
        assert len(s.prompt_logprobs) == len(s.prompt_ids) and s.prompt_logprobs[0] is None
        with torch.inference_mode(), llm.borrow() as b:
            feature, _, _ = b.forward([s.prompt_ids])
            want = llm.sampler.logprobs(llm.model.logits(feature[:-1]), [params] * (len(s.prompt_ids) - 1),
                                        torch.tensor(s.prompt_ids[1:]), 2).tolist()
        for (lp, top), row in zip(s.prompt_logprobs[1:], want):
            assert lp == pytest.approx(row[0], abs=1e-5) and [t for t, _ in top] == [int(t) for t in row[1:3]]
        assert s.logprobs == []
    assert [s.prompt_logprobs for s in seqs] == [s.prompt_logprobs for s in alone]
