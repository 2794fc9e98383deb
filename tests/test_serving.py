"""The engine under serving: requests joining mid-flight, aborts, per-request seeds, incremental text."""
import random

import pytest
import torch

from engine.llm import LLM, RunStats
from engine.scheduler import SamplingParams, Sequence
from engine.serving import Detokenizer

from conftest import CHAT_PROMPTS


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2-135m", None, kv_cache_gb=0.1, max_batch=16, method="vanilla")


def pool_is_full(llm) -> bool:
    blocks = llm.scheduler.blocks
    return blocks.num_free == blocks.num_blocks and not llm.scheduler.running and not llm.scheduler.waiting


def solo(llm, ids, params):
    seqs, _ = llm.generate([ids], params)
    return seqs[0].output_ids


def test_requests_join_and_leave_between_rounds(llm):
    """Greedy output does not depend on when a request joins a running batch or who else is in it."""
    prompts = [llm.chat_ids(p) for p in CHAT_PROMPTS[:6]]
    params = [SamplingParams(max_new_tokens=n) for n in (12, 20, 6, 16, 9, 14)]
    stats, seqs = RunStats(), []
    for i, (ids, sp) in enumerate(zip(prompts, params)):
        seq = Sequence(ids, sp)
        llm.scheduler.add(seq)
        seqs.append(seq)
        for _ in range(i + 1):   # a few rounds before the next request arrives
            llm.step(stats)
    while llm.has_work:
        llm.step(stats)
    assert pool_is_full(llm)
    for seq, ids, sp in zip(seqs, prompts, params):
        assert seq.output_ids == solo(llm, ids, sp)


def test_abort_returns_blocks_of_running_and_waiting_requests(llm):
    stats = RunStats()
    seqs = [Sequence(llm.chat_ids(p), SamplingParams(max_new_tokens=64)) for p in CHAT_PROMPTS[:4]]
    llm.scheduler.max_batch = 2
    try:
        for s in seqs:
            llm.scheduler.add(s)
        for _ in range(3):
            llm.step(stats)
        assert len(llm.scheduler.running) == 2 and len(llm.scheduler.waiting) == 2
        assert llm.scheduler.blocks.num_free < llm.scheduler.blocks.num_blocks
        llm.abort(seqs[0])     # running
        llm.abort(seqs[3])     # waiting
        assert seqs[0].finish_reason == seqs[3].finish_reason == "abort"
        while llm.has_work:
            llm.step(stats)
    finally:
        llm.scheduler.max_batch = 16
    assert pool_is_full(llm)
    assert all(s.finish_reason in ("stop", "length") and s.output_ids for s in seqs[1:3])


def test_seeded_requests_do_not_depend_on_the_batch(llm):
    ids = [llm.chat_ids(p) for p in CHAT_PROMPTS[:4]]
    seeded = SamplingParams(temperature=1.0, max_new_tokens=24, seed=1234)
    alone = solo(llm, ids[0], seeded)
    others = [SamplingParams(temperature=0.8, max_new_tokens=24), SamplingParams(max_new_tokens=24),
              SamplingParams(temperature=1.0, max_new_tokens=24, seed=7)]
    seqs, _ = llm.generate(ids[1:] + [ids[0]], others + [SamplingParams(temperature=1.0, max_new_tokens=24, seed=1234)])
    assert seqs[-1].output_ids == alone
    other_seed = solo(llm, ids[0], SamplingParams(temperature=1.0, max_new_tokens=24, seed=1235))
    assert other_seed != alone
    assert all(s.generator is None for s in seqs)  # per-request generators go with their sequences


def test_detokenizer_matches_full_decode(llm):
    tok = llm.tokenizer
    rng = random.Random(0)
    text = "Zürich → 東京: naïve café ☕, ∑ x² = 42 🙂 done."
    for trial in range(5):
        ids = tok.encode(text + " " + " ".join(rng.choice(["a", "é", "日本", "🙂", "\n"]) for _ in range(20)))
        detok, out, i = Detokenizer(tok), "", 0
        while i < len(ids):
            i = min(len(ids), i + rng.randint(1, 4))   # tokens arrive a few at a time, as rounds emit them
            out += detok(ids[:i])
        assert out == tok.decode(ids, skip_special_tokens=True)


def test_check_rejects_what_can_never_run(llm):
    ctx = llm.cfg.max_position
    with pytest.raises(ValueError, match="context"):
        llm.scheduler.check(Sequence([1] * ctx, SamplingParams()))
    with pytest.raises(ValueError, match="empty"):
        llm.scheduler.check(Sequence([], SamplingParams()))
    with pytest.raises(ValueError, match="KV blocks"):
        llm.scheduler.check(Sequence([1] * 10, SamplingParams(max_new_tokens=ctx - 20)))
    assert pool_is_full(llm)
