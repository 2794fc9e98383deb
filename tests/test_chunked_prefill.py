"""Chunked prefill: prompts enter the cache at most `prefill_chunk` tokens a step (over all requests), beside
the running streams' decoding round. A request's output does not depend on how its prompt was chunked or on
what arrived while it ran (every method, greedy and seeded sampled, logprobs and prompt logprobs, the prefix
cache), a stream gains tokens in every step while a long prompt prefills, and every block is back after."""
import pytest
import torch

from engine.adaptive import PrefillPacer
from engine.llm import LLM, RunStats
from engine.scheduler import SamplingParams, Scheduler, Sequence
from tests.test_engine_paths import METHODS, VOCAB
from tests.test_prefix_cache import BS, tiny  # noqa: F401 (the module's tiny model fixture)

G = torch.Generator().manual_seed(8)
PROMPTS = [[1] + torch.randint(3, VOCAB, (n,), generator=G).tolist() for n in (45, 12, 70, 3)]
NEW = 8
GREEDY = SamplingParams(max_new_tokens=NEW, ignore_eos=True, logprobs=2)
SAMPLED = SamplingParams(max_new_tokens=NEW, ignore_eos=True, temperature=0.8, top_k=20, seed=11, logprobs=1)


def make(tiny, chunk: int, method: str = "vanilla", cache: bool = True) -> LLM:
    m, args = METHODS.get(method, ("vanilla", {}))
    return LLM(tiny, "float32", device="cpu", kv_cache_gb=0.02, block_size=BS, max_batch=4, seed=1,
               prefix_cache=cache, prefill_chunk=chunk, method=m, method_args=args)


def run(llm: LLM, params, arrivals: dict[int, list[int]] | None = None) -> list[Sequence]:
    """Step the engine by hand; arrivals[s]: the prompts added before step s (step 0: the first ones)."""
    seqs, stats, step = [], RunStats(), 0
    while step == 0 or llm.has_work or any(s >= step for s in arrivals):
        for p in arrivals.get(step, []):
            seqs.append(Sequence(list(p), params))
            llm.scheduler.add(seqs[-1])
        if llm.has_work:
            llm.step(stats)
        step += 1
    pool = llm.scheduler.blocks
    assert pool.num_free == pool.num_blocks
    return seqs


def outputs(seqs):
    return [(s.output_ids, [round(lp, 4) for lp, _ in s.logprobs]) for s in seqs]


@pytest.mark.parametrize("name", ["vanilla"] + list(METHODS))
def test_chunking_and_arrivals_change_no_output(tiny, name):
    """Whole prompts in one step (the reference), 7-token chunks with requests arriving mid-run, 1-token
    chunks: the same tokens and logprobs. (An adaptive policy picks each round's depth from the rounds it timed,
    and a sampled request's draws follow the depths: only its greedy tokens are fixed.)"""
    for params in (GREEDY,) if "adaptive" in name else (GREEDY, SAMPLED):
        want = outputs(run(make(tiny, 0, name, cache=False), params, {0: PROMPTS}))
        assert outputs(run(make(tiny, 7, name), params, {0: PROMPTS[:2], 3: PROMPTS[2:3], 9: PROMPTS[3:]})) == want
        if name in ("vanilla", "eagle3-chain"):
            assert outputs(run(make(tiny, 1, name), params, {0: PROMPTS})) == want


def test_prompt_logprobs_come_chunk_by_chunk(tiny):
    params = SamplingParams(max_new_tokens=2, ignore_eos=True, prompt_logprobs=3, temperature=0.7, seed=3)
    want = run(make(tiny, 0), params, {0: PROMPTS[:3]})
    got = run(make(tiny, 5), params, {0: PROMPTS[:3]})
    for a, b in zip(want, got):
        assert len(b.prompt_logprobs) == len(b.prompt_ids) and b.prompt_logprobs[0] is None
        assert [(round(x[0], 4), x[1][0][0]) for x in a.prompt_logprobs[1:]] == \
               [(round(x[0], 4), x[1][0][0]) for x in b.prompt_logprobs[1:]]
        assert a.output_ids == b.output_ids


def test_streams_keep_decoding_while_a_long_prompt_prefills(tiny):
    llm = make(tiny, 8)
    stream = Sequence(PROMPTS[1], SamplingParams(max_new_tokens=40, ignore_eos=True))
    llm.scheduler.add(stream)
    stats = RunStats()
    llm.step(stats)                                   # its prompt (13 tokens) in two steps
    llm.step(stats)
    assert len(stream.output_ids) == 1
    long = Sequence(PROMPTS[2], SamplingParams(max_new_tokens=2, ignore_eos=True))
    llm.scheduler.add(long)
    steps = 0
    while not long.output_ids:
        before = len(stream.output_ids)
        done = llm.step(stats)
        steps += 1
        assert len(stream.output_ids) == before + 1 and done.lengths == [1] and done.prefilled <= 8
    assert steps == -(-len(PROMPTS[2]) // 8) and long.prefilled == len(PROMPTS[2])
    llm.abort_all()


def test_the_budget_is_shared_first_come_first_served():
    s = Scheduler(num_blocks=64, block_size=4, max_batch=4, max_model_len=256, eos_ids=())
    a, b, c = (Sequence(list(range(n, 2 * n)), SamplingParams(max_new_tokens=4)) for n in (7, 12, 5))
    for x in (a, b, c):
        s.add(x)
    s.admit()
    assert [(x is a, x is b, n) for x, n in s.chunks(10)] == [(True, False, 7), (False, True, 3)]
    s.prepare([a, b], [7, 3])
    s.advance(a, 7)
    s.advance(b, 3)
    assert s.blocks.length(a.seq_id) == 7 + s.lookahead and s.blocks.length(b.seq_id) == 3
    assert a.prefilling and s.decoding() == []       # a's first token is not committed yet
    s.commit(a, [9])
    assert not a.prefilling and s.decoding() == [a]
    assert [(x is b, n) for x, n in s.chunks(10)] == [(True, 9), (False, 1)]
    assert [n for _, n in s.chunks(None)] == [9, 5]
    assert s.prefilling() == 2                        # b and c; a decodes


def test_the_pacer_gives_prefill_about_the_decoding_rounds_time():
    pacer = PrefillPacer(cap=512, share=1.0, floor=16)
    assert pacer.budget(0.0) == 512 and pacer.budget(0.05) == 512  # nothing decoding / no rate measured yet
    pacer.observe(400, 1.0)                                          # 400 tokens/s
    assert pacer.budget(0.1) == 40 and pacer.budget(0.01) == 16 and pacer.budget(5.0) == 512
    assert pacer.budget(0.0) == 512
    pacer.observe(100, 1.0)                                          # the rate follows: 0.7 * 400 + 0.3 * 100
    assert pacer.budget(0.1) == 31
    assert PrefillPacer(cap=None, share=None).budget(0.1) is None   # unchunked


def test_the_pacers_share_grows_with_the_prompts_waiting_per_decoding_sequence():
    pacer = PrefillPacer(cap=512, share=1.0, floor=16)
    pacer.observe(400, 1.0)
    assert pacer.budget(0.1, prefilling=2, decoding=8) == 40       # fewer wait than decode: the base share
    assert pacer.budget(0.1, prefilling=8, decoding=8) == 40
    assert pacer.budget(0.1, prefilling=24, decoding=8) == 120     # 3 waiting per decoding sequence: 3x
    assert pacer.budget(0.1, prefilling=64, decoding=1) == 512     # never past the cap


def test_mixed_steps_are_paced_by_the_rounds_and_chunks_run_apart():
    """A mixed step's decoding part is the last plain round's time, and the prefill rate is measured on chunks
    run apart: a mixed step's own time cannot be split, and an estimate from it would feed each chunk's time
    into the next one's size. One step in REFRESH keeps them apart (none mixes before a plain round)."""
    pacer = PrefillPacer(cap=512, share=1.0, floor=16, decay=0.0)
    assert not pacer.mix()                                  # no plain round measured yet
    pacer.observe(1000, 1.0)                                # 1000 tokens/s, a chunk run apart
    assert pacer.observe_round(0.05) == 0.05                # a plain decoding round
    assert pacer.budget(pacer.round_s, 1, 8) == 50
    for _ in range(5):                                      # chunks slower than planned change nothing
        assert pacer.observe_round(0.5, prefilled=50) == 0.05
        assert pacer.rate == 1000 and pacer.budget(pacer.round_s, 1, 8) == 50
    pacer.mixed = 0
    assert [pacer.mix() for _ in range(2 * PrefillPacer.REFRESH)].count(False) == 2


def test_a_paced_llm_prefills_less_while_streams_decode(tiny):
    """With a generous cap, a long prompt arriving beside a decoding stream goes in chunks the pacer sizes
    (here: a slow measured prefill rate makes them its floor), and the output is unchanged."""
    llm = make(tiny, 64)
    stream = Sequence(PROMPTS[1], SamplingParams(max_new_tokens=30, ignore_eos=True))
    llm.scheduler.add(stream)
    stats = RunStats()
    llm.step(stats)
    assert stream.output_ids and llm.pacer.rate is not None and llm.pacer.share == 1.0
    llm.pacer.rate = 1.0                                           # as if the CPU prefilled a token a second
    long = Sequence(PROMPTS[2], SamplingParams(max_new_tokens=4, ignore_eos=True))
    llm.scheduler.add(long)
    sizes = []
    while not long.output_ids:
        sizes.append(llm.step(stats).prefilled)
        llm.pacer.rate = 1.0
    assert sizes == [16] * (len(PROMPTS[2]) // 16) + [len(PROMPTS[2]) % 16]
    while llm.has_work:
        llm.step(stats)
    ref = make(tiny, 0, cache=False).generate([PROMPTS[2], PROMPTS[1]], [long.params, stream.params])[0]
    assert [long.output_ids, stream.output_ids] == [s.output_ids for s in ref]


@pytest.mark.parametrize("name", ["vanilla", "eagle3-adaptive", "eagle3-chain", "sps"])
def test_a_round_that_drafts_nothing_carries_the_chunk_in_its_forward(tiny, name):
    """While a stream decodes, its plain decode round and the next prompt chunk run as one target forward (a
    mixed step); a drafting round (a fixed chain) and SpS (whose prefill runs its draft model too) prefill in a
    forward of their own. Outputs as with whole prompts."""
    llm = make(tiny, 8, name)
    llm.pacer.REFRESH = 10**9  # no step kept apart to measure again
    if llm.policy:  # the adaptive policy's first rounds in a new batch bucket draft nothing
        assert llm.policy.choose(1) == 0
    forwards = []
    hook = llm.model.register_forward_hook(lambda m, args, out: forwards.append(args[0].numel()))
    stream = Sequence(PROMPTS[1], SamplingParams(max_new_tokens=30, ignore_eos=True))
    llm.scheduler.add(stream)
    stats = RunStats()
    while not stream.output_ids:
        llm.step(stats)
    long = Sequence(PROMPTS[2], SamplingParams(max_new_tokens=4, ignore_eos=True))
    llm.scheduler.add(long)
    per_step = []
    while not long.output_ids:
        forwards.clear()
        done = llm.step(stats)
        assert done.prefilled and done.lengths
        per_step.append(list(forwards))
    hook.remove()
    if name in ("vanilla", "eagle3-adaptive"):  # the first step measures a plain round (and the chunk apart)
        assert len(per_step[0]) == 2 and all(len(f) == 1 and f[0] > 1 for f in per_step[1:]), per_step
    else:
        assert all(len(f) >= 2 for f in per_step), per_step
    while llm.has_work:
        llm.step(stats)
    ref = make(tiny, 0, name, cache=False).generate([PROMPTS[2], PROMPTS[1]], [long.params, stream.params])[0]
    assert [long.output_ids, stream.output_ids] == [s.output_ids for s in ref]
    pool = llm.scheduler.blocks
    assert pool.num_free == pool.num_blocks


def test_identical_prompts_wait_for_the_chunks_they_share(tiny):
    """n copies of a prompt: the first prefills it chunk by chunk, the copies wait until its blocks are
    registered and share them; an unrelated request behind them is not held up."""
    llm, ref = make(tiny, 8), make(tiny, 0, cache=False)
    prompts = [PROMPTS[2]] * 3 + [PROMPTS[1]]
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True, temperature=0.8, seed=2)
    seqs = run(llm, params, {0: prompts})
    assert [s.cached_tokens for s in seqs] == [0] + [(len(PROMPTS[2]) - 1) // BS * BS] * 2 + [0]
    assert [s.output_ids for s in seqs] == [s.output_ids for s in run(ref, params, {0: prompts})]
    assert seqs[3].output_ids and seqs[3].cached_tokens == 0
