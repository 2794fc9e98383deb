"""Automatic prefix caching: full, final KV blocks keyed by their tokens (and the one after), reference
counted, shared by later requests with the same prefix, LRU-evicted only when free. A request's output does
not depend on whether its prefix was cached (every method, greedy and seeded sampled), a second chat turn
prefills only its new tokens, and every block is back in the pool (cached ones count as free)."""
import pytest
import torch

from engine.block_manager import BlockManager, OutOfBlocks, prefix_keys
from engine.llm import LLM, RunStats
from engine.scheduler import SamplingParams, Sequence
from tests.conftest import write_tiny_llama
from tests.test_engine_paths import METHODS, VOCAB
from tests.test_speculative_sampling import write_tokenizer

BS = 8
G = torch.Generator().manual_seed(3)
PROMPTS = [[1] + torch.randint(3, VOCAB, (n,), generator=G).tolist() for n in (20, 33, 17, 41)]
NEW = 10


def test_keys_chain_and_include_the_next_token():
    a = prefix_keys(list(range(30)), 8)
    assert len(a) == 3  # blocks whose next token is known: (30 - 1) // 8
    b = prefix_keys(list(range(24)) + [99] + list(range(25, 30)), 8)
    assert a[:2] == b[:2] and a[2] != b[2]  # block 2 (tokens 16-23) is keyed with token 24 too
    c = prefix_keys([5] + list(range(1, 30)), 8)
    assert all(x != y for x, y in zip(a, c))  # a different first token changes every later key
    assert prefix_keys(list(range(30)), 8, a[0], 1, 2) == a[1:]


def test_share_register_evict():
    bm = BlockManager(num_blocks=4, block_size=4)
    keys = prefix_keys(list(range(13)), 4)           # 3 blocks
    assert bm.share(1, keys) == 0
    bm.allocate(1, 12)
    bm.register(1, 0, keys)
    bm.free(1)
    assert bm.num_free == 4 and len(bm.cached) == 3  # cached blocks count as free
    assert bm.share(2, keys[:2]) == 8 and bm.length(2) == 8 and bm.num_free == 2
    assert bm.share(3, keys) == 12 and bm.refs[bm.block_table(3)[0]] == 2
    bm.allocate(2, 4)                                # takes the never-used block
    with pytest.raises(OutOfBlocks):
        bm.allocate(2, 8)
    bm.free(3)                                       # block 2 of the keys is unheld again
    bm.allocate(2, 4)                                # evicts it: the least recently released
    assert bm.share(4, keys) == 8
    bm.free(2)
    bm.free(4)
    assert bm.num_free == 4
    with pytest.raises(ValueError, match="already has blocks"):
        bm.allocate(5, 1)
        bm.share(5, keys)


def test_side_state_marks_follow_their_blocks():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate(1, 10)                               # 3 blocks
    bm.mark_side(1, 0, 9)                            # blocks 0 and 1 lie wholly below position 9
    assert bm.side_prefix(1, 12) == 8 and bm.side_prefix(1, 4) == 4
    bm.mark_side(1, 9, 12)
    assert bm.side_prefix(1, 12) == 12
    bm.free(1)
    bm.allocate(2, 16)                               # the same blocks, taken anew: no longer marked
    assert bm.side_prefix(2, 16) == 0 and not bm.side


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    hf = write_tiny_llama(path, seed=5, vocab_size=VOCAB, num_hidden_layers=8)
    with torch.no_grad():
        hf.lm_head.weight.mul_(10.0)
    hf.save_pretrained(str(path), safe_serialization=True)
    write_tokenizer(path, VOCAB)
    return str(path)


def make(tiny, cache: bool) -> LLM:
    return LLM(tiny, "float32", device="cpu", kv_cache_gb=0.02, block_size=BS, max_batch=4, seed=1,
               prefix_cache=cache)


@pytest.mark.parametrize("name", ["vanilla"] + list(METHODS))
def test_cached_prefixes_change_no_output(tiny, name):
    method, args = METHODS.get(name, ("vanilla", {}))
    greedy = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=NEW, ignore_eos=True, temperature=0.8, top_k=20, seed=11)
    # An adaptive policy picks each round's depth from the rounds it timed, and a sampled request's draws follow
    # the depths: only its greedy tokens are fixed.
    params = (greedy,) if args.get("adaptive") else (greedy, sampled)
    ref = make(tiny, cache=False)
    ref.set_method(method, args)
    want = [[s.output_ids for s in ref.generate(PROMPTS, p)[0]] for p in params]
    llm = make(tiny, cache=True)
    llm.set_method(method, args)
    for turn in range(2):  # cold, then every prompt's full blocks cached
        for p, w in zip(params, want):
            seqs, stats = llm.generate(PROMPTS, p)
            assert [s.output_ids for s in seqs] == w
            cached = [s.cached_tokens for s in seqs]
            assert cached == ([0] * 4 if turn == 0 and p is greedy else [(len(q) - 1) // BS * BS for q in PROMPTS])
            assert stats.cached_tokens == sum(cached)
    pool = llm.scheduler.blocks
    assert pool.num_free == pool.num_blocks and pool.cached


def test_a_second_turn_prefills_only_its_new_tokens(tiny):
    llm, ref = make(tiny, cache=True), make(tiny, cache=False)
    for x in (llm, ref):
        x.set_method("eagle3", METHODS["eagle3"][1])
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    first = llm.generate([PROMPTS[1]], params)[0][0]
    turn2 = first.all_ids + [4, 5, 6]
    seq, stats = llm.generate([turn2], params)
    assert seq[0].cached_tokens == (len(turn2) - 1) // BS * BS > len(PROMPTS[1])  # the answer's blocks too
    assert seq[0].output_ids == ref.generate([turn2], params)[0][0].output_ids


@pytest.mark.parametrize("name", ["eagle3", "eagle3-chain"])
def test_a_shared_prefix_needs_no_head_catch_up(tiny, name):
    """The head's KV in a cached block is shared with it once the head had fed the block: a second turn's
    head starts after the shared blocks (sampled output, which follows the drafts, still equals the uncached
    run's), and a method switch forgets which blocks hold head KV with the cache."""
    llm, ref = make(tiny, cache=True), make(tiny, cache=False)
    for x in (llm, ref):
        x.set_method(*METHODS[name])
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True, temperature=0.8, seed=4)
    first = llm.generate([PROMPTS[3]], params)[0][0]
    turn2 = first.all_ids + [4, 5, 6]
    seq = Sequence(turn2, params)
    llm.scheduler.add(seq)
    llm.step(RunStats())                                    # its prefill
    assert seq.draft_state.fed >= len(PROMPTS[3]) // BS * BS and seq.draft_state.fed % BS == 0
    assert seq.draft_state.fed <= seq.cached_tokens
    while llm.has_work:
        llm.step(RunStats())
    assert seq.output_ids == ref.generate([turn2], params)[0][0].output_ids
    llm.set_method("vanilla")
    assert not llm.scheduler.blocks.side


def test_identical_prompts_in_one_batch_share_their_prefix(tiny):
    """n copies of a prompt arriving together: the first prefills it, the others wait one step and share
    its blocks; outputs as without the cache."""
    llm, ref = make(tiny, cache=True), make(tiny, cache=False)
    prompts = [PROMPTS[3]] * 3 + [PROMPTS[0]]
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True, temperature=0.8, seed=2)
    seqs, _ = llm.generate(prompts, params)
    assert [s.cached_tokens for s in seqs] == [0] + [(len(PROMPTS[3]) - 1) // BS * BS] * 2 + [0]
    assert [s.output_ids for s in seqs] == [s.output_ids for s in ref.generate(prompts, params)[0]]
    assert llm.scheduler.blocks.num_free == llm.scheduler.blocks.num_blocks


def test_switching_methods_drops_the_cache(tiny):
    """A cached block's per-slot side stores (EAGLE's head inputs) are the decoder's that computed it: a
    method switch forgets the cache, and EAGLE-3 after vanilla on the same prompts still equals vanilla."""
    llm = make(tiny, cache=True)
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    want = [s.output_ids for s in llm.generate(PROMPTS, params)[0]]
    assert llm.scheduler.blocks.cached
    llm.set_method("eagle3", METHODS["eagle3"][1])
    assert not llm.scheduler.blocks.cached and llm.scheduler.blocks.num_free == llm.scheduler.blocks.num_blocks
    seqs, stats = llm.generate(PROMPTS, params)
    assert [s.output_ids for s in seqs] == want and stats.cached_tokens == 0


def test_prompt_logprobs_bypass_the_cache(tiny):
    llm = make(tiny, cache=True)
    params = SamplingParams(max_new_tokens=2, ignore_eos=True, prompt_logprobs=1)
    llm.generate([PROMPTS[0]], SamplingParams(max_new_tokens=2))
    seq = llm.generate([PROMPTS[0]], params)[0][0]
    assert seq.cached_tokens == 0 and len(seq.prompt_logprobs) == len(PROMPTS[0])
