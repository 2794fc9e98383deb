"""Drafts looked up in the context (engine.lookup): the n-gram index against a brute-force search over random
sequences, proposals that grow while a sequence copies, and on the real SmolLM2 target: greedy and seeded
sampled output equal vanilla's with lookup rounds among the head's, alone and batched, every block returned."""
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.llm import LLM
from engine.lookup import MOST, ContextIndex
from engine.run import parse_args
from engine.scheduler import SamplingParams, Sequence


def brute(ids: list[int], n: int, k: int) -> list[int]:
    """What followed the latest earlier occurrence of the last n tokens (periodically past the end)."""
    L = len(ids)
    for p in range(L - 1, n - 1, -1):  # p: where the continuation starts; the occurrence ends at p - 1 < L - 1
        if ids[p - n:p] == ids[L - n:]:
            out = []
            for j in range(k):
                out.append(ids[p + j] if p + j < L else out[p + j - L])
            return out
    return []


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_proposals_match_a_brute_force_search(n):
    rng = random.Random(n)
    for trial in range(60):
        vocab = rng.choice([2, 3, 5, 20])
        seq = Sequence([rng.randrange(vocab) for _ in range(rng.randrange(0, 12))], SamplingParams())
        index = ContextIndex(n)
        for _ in range(40):  # the sequence grows by 0-4 tokens between calls, as rounds accept them
            seq.output_ids += [rng.randrange(vocab) for _ in range(rng.randrange(0, 5))]
            k = rng.randrange(0, 6)
            index.last = (0, [])  # no growth here (tested below)
            assert index.propose(seq, k) == (brute(seq.prompt_ids + seq.output_ids, n, k) if
                                             seq.num_tokens > n else []), (trial, n, k, seq.all_ids)


def test_a_copying_sequence_gets_longer_proposals():
    """While each proposal was what followed, the next is twice as long (at most `most`); a miss resets it."""
    text = list(range(100, 140))
    seq = Sequence(text + [1, 2, 3], SamplingParams())
    seq.output_ids = list(text[:3])  # starts copying the prompt
    index = ContextIndex(3)
    lengths = []
    for _ in range(5):
        got = index.propose(seq, 2, MOST)
        lengths.append(len(got))
        assert got == text[len(seq.output_ids):len(seq.output_ids) + len(got)]
        seq.output_ids += got + [text[len(seq.output_ids) + len(got)]]  # all accepted, and the bonus token
    assert lengths == [2, 4, MOST, MOST, MOST]
    assert len(index.propose(seq, 2, MOST)) == MOST
    seq.output_ids += [7, 7, 7]  # it stops copying: the proposal was not what followed
    seq.output_ids += text[10:13]  # and starts again elsewhere: a new match, proposals back to k
    assert len(index.propose(seq, 2, MOST)) == 2


def test_no_match_and_bad_sizes():
    seq = Sequence([1, 2, 3, 4, 5], SamplingParams())
    assert ContextIndex(3).propose(seq, 3) == []
    assert ContextIndex(3).propose(Sequence([1, 2], SamplingParams()), 3) == []
    with pytest.raises(ValueError, match="at least 1 token"):
        ContextIndex(0)


COPYING = [  # prompts a small model answers partly by quoting them, or by repeating itself
    "Repeat this list exactly, one item per line: red apple, green pear, yellow banana, red apple, green pear, "
    "yellow banana, red apple, green pear, yellow banana.",
    "Fix the spelling in this sentence and write it out again: The quick brown fox jumpd over the lazy dog "
    "becuase it was very hapy.",
    "Tell me a joke about penguins.",
]
NEW = 48


@pytest.fixture(scope="module")
def llm():
    threads = torch.get_num_threads()
    llm = LLM("smollm2-135m", "float32", device="cpu", kv_cache_gb=0.25, max_batch=4, threads=1, weights="auto")
    prompts = [llm.chat_ids(p) for p in COPYING]
    yield llm, prompts
    torch.set_num_threads(threads)


@pytest.mark.parametrize("method", ["eagle3", "auto"])
def test_lookup_rounds_are_lossless(llm, method):
    llm, prompts = llm
    greedy = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    sampled = [SamplingParams(0.8, max_new_tokens=NEW, ignore_eos=True, seed=i) for i in range(len(prompts))]
    llm.set_method("vanilla")
    ref = [s.output_ids for s in llm.generate(prompts, greedy)[0]]
    ref_sampled = [s.output_ids for s in llm.generate(prompts, sampled)[0]]
    decoder = llm.set_method(method)
    assert decoder.lookup == 3 and decoder.lookahead == MOST + 1  # the CPU default: chains, trigrams
    for params, want in ((greedy, ref), (sampled, ref_sampled)):
        looked_up = 0
        for batch in ([0], [1], [0, 1, 2]):  # alone, and beside requests that match at other rounds
            seqs, stats = llm.generate([prompts[i] for i in batch], params if params is greedy else
                                       [params[i] for i in batch])
            assert [s.output_ids for s in seqs] == [want[i] for i in batch]
            assert sum(stats.extra["depth_hist"]) + stats.extra["looked_up"] == stats.steps
            assert stats.extra["from_context"] >= stats.extra["looked_up"]
            looked_up += stats.extra["looked_up"]
            assert llm.scheduler.blocks.num_free == llm.scheduler.blocks.num_blocks
        assert looked_up > 0  # the repeated list is looked up, not drafted
    llm.set_method("vanilla")


def test_batched_rounds_mix_lookups_and_head_drafts(llm, monkeypatch):
    """In a drafting round where only some sequences' contexts match, those verify what followed their match and
    the head drafts the others' chains in the same round (their caps kept, the matched ones' 0): vanilla's
    output, greedy and seeded sampled, every block returned."""
    llm, prompts = llm
    greedy = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    sampled = [SamplingParams(0.8, max_new_tokens=NEW, ignore_eos=True, seed=i) for i in range(len(prompts))]
    llm.set_method("vanilla")
    refs = [[s.output_ids for s in llm.generate(prompts, params)[0]] for params in (greedy, sampled)]
    decoder = llm.set_method("eagle3", {"depth": 2, "tree_tokens": 3})
    mixed, draft_caps, draft = [], [], decoder.draft

    def noted(seqs, depth, caps):  # the head's drafts: the caps it was given
        draft_caps.append(list(caps))
        return draft(seqs, depth, caps)

    look_up = decoder.look_up

    def watched(seqs, depth, caps):
        found = look_up(seqs, depth, caps)
        if found is not None and not found.looked_up:  # a mix: which rows the head drafted, every row's size
            mixed.append((draft_caps[-1], found.tree.sizes.tolist(), found.from_context))
        return found

    monkeypatch.setattr(decoder, "draft", noted)
    monkeypatch.setattr(decoder, "look_up", watched)
    for params, ref in zip((greedy, sampled), refs):
        seqs, stats = llm.generate(prompts, params)
        assert [s.output_ids for s in seqs] == ref
        assert stats.extra["from_context"] > stats.extra["looked_up"]  # sequence-rounds beside the head's
        assert llm.scheduler.blocks.num_free == llm.scheduler.blocks.num_blocks
    assert mixed
    for caps, sizes, found in mixed:
        assert 0 < found == caps.count(0) < len(caps)
        assert all(size == 3 for cap, size in zip(caps, sizes) if cap)  # the head's chains of 2 where it drafted
    llm.set_method("vanilla")


def test_lookup_off_and_bad_values(llm):
    llm, prompts = llm
    decoder = llm.set_method("eagle3", {"lookup": 0})
    assert decoder.lookup == 0 and decoder.lookahead == 3
    _, stats = llm.generate(prompts[:1], SamplingParams(max_new_tokens=16, ignore_eos=True))
    assert stats.extra["looked_up"] == 0
    with pytest.raises(ValueError, match="need a chain"):
        llm.set_method("eagle3", {"lookup": 3, "topk": 2, "tree_tokens": 4})
    assert llm.set_method("eagle3", {"topk": 2, "tree_tokens": 4}).lookup == 0  # trees do not look up by default
    with pytest.raises(ValueError, match="--lookup must be >= 0"):
        llm.set_method("eagle3", {"lookup": -1})
    assert parse_args(["--lookup", "2", "hi"]).lookup == 2
    llm.set_method("vanilla")


class Plain:
    """A policy stub that keeps every round plain, noting what it is told."""

    def __init__(self):
        self.told = []

    def choose(self, batch, *facts):
        return 0

    def observe(self, batch, d, seconds, accepted, *rest):
        self.told.append((d, seconds, accepted))


def test_plain_rounds_look_up_too(llm):
    """Where the policy drafts nothing (the head does not pay), a round whose context matches still verifies what
    followed (one token, more while a lone sequence copies; no more than MOST extra rows a batch): vanilla's
    output, no time sample for the policy."""
    llm, prompts = llm
    greedy = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    llm.set_method("vanilla")
    ref = [s.output_ids for s in llm.generate(prompts, greedy)[0]]
    llm.set_method("eagle3", {"adaptive": True})
    for batch in ([0], [0, 1, 2]):
        llm.policy = policy = Plain()
        seqs, stats = llm.generate([prompts[i] for i in batch], greedy)
        assert [s.output_ids for s in seqs] == [ref[i] for i in batch]
        timed = sum(seconds is not None for _, seconds, _ in policy.told)  # a step's first build is no sample
        assert len(policy.told) == stats.steps and 0 < stats.extra["looked_up"] <= stats.steps - timed
        assert len(stats.extra["depth_hist"]) == 1  # the head never drafted
        if batch == [0]:  # it grew: more than one lookup token accepted in a round
            assert max(a for _, _, accepted in policy.told for a in accepted) > 1
    llm.set_method("vanilla")


def test_lookup_study_rejects_a_negative_batch():
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "benchmarks/lookup_acceptance.py", "--batch", "-1"], cwd=root,
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(root)})
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].endswith("--batch must be >= 0"), r.stderr
