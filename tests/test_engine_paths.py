"""The whole engine on a tiny random Llama through both kernel paths: the CPU's C++ ops and the GPU's
implementations (Triton, run on CPU tensors by the interpreter inside `eagle_kernels.triton_on_cpu()`,
with batches padded to CUDA-graph buckets as on a GPU). Every method, greedy and sampled, batch 1 and 4
(the interpreter is slow: on the GPU path vanilla and adaptive EAGLE-3, and SpS sampled): greedy output
equals vanilla's, caches come back empty, and a round's draft and verify bodies make no host reads (the GPU's
sync-freedom, proven on the CPU). The adaptive policy (plain Python, in LLM.step) still decides, but its depths
are forced through a schedule that visits every depth, 0 (no drafts) included."""
import itertools
from functools import partial

import pytest
import torch

import eagle_kernels
from engine.llm import LLM
from engine.scheduler import SamplingParams
from tests.conftest import write_tiny_llama
from tests.host_reads import HostRead, no_host_reads
from tests.test_speculative_sampling import write_tokenizer

VOCAB = 96
PROMPTS = [[1, 5, 9, 11, 4], [1, 7], [1, 3, 3, 3, 4, 5, 6, 7, 8], [1, 40, 41]]
NEW = 6
NEW_LONG = 24  # enough rounds for the random head's drafts to be accepted now and then
METHODS = {
    "sps": ("sps", {"draft": "early-exit:4", "draft_len": 3}),
    "eagle-static": ("eagle", {"head": "random", "tree": "static"}),
    "eagle-dynamic": ("eagle", {"head": "random", "depth": 3, "topk": 3, "tree_tokens": 7}),
    "eagle3": ("eagle3", {"head": "random", "depth": 3, "topk": 4, "tree_tokens": 8}),
    "eagle3-chain": ("eagle3", {"head": "random", "depth": 3, "topk": 1, "tree_tokens": 4}),
    "eagle-chain": ("eagle", {"head": "random", "depth": 2, "topk": 1, "tree_tokens": 3}),
    "eagle3-adaptive": ("eagle3", {"head": "random", "depth": 3, "topk": 4, "tree_tokens": 8, "adaptive": True}),
}
DEPTHS = [0, 3, 1, 0, 2]  # the adaptive policy's forced schedule


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    """8 layers (EAGLE-3 fuses three distinct ones) and a sharpened LM head, so drafts get accepted and
    accepted paths of several lengths mix in one batch."""
    path = tmp_path_factory.mktemp("tiny")
    hf = write_tiny_llama(path, seed=5, vocab_size=VOCAB, num_hidden_layers=8)
    with torch.no_grad():
        hf.lm_head.weight.mul_(10.0)
    hf.save_pretrained(str(path), safe_serialization=True)
    write_tokenizer(path, VOCAB)
    return LLM(str(path), "float32", device="cpu", kv_cache_gb=0.02, block_size=8, max_batch=4, seed=1)


@pytest.fixture(scope="module")
def reference(llm):
    """Vanilla greedy on the C++ CPU path, each prompt alone."""
    llm.set_method("vanilla")
    return [llm.generate([p], SamplingParams(max_new_tokens=NEW, ignore_eos=True))[0][0].output_ids
            for p in PROMPTS]


def gpu_path(llm, on: bool):
    llm.runner.bucketed = on
    return eagle_kernels.triton_on_cpu(on)


def forbid_host_reads(decoder):
    """Run the decoder's round bodies (a decode step's forward; draft and verify) inside no_host_reads()."""
    names = ["draft", "verify", "_decode", "_draft_tree_fn", "_verify_direct_fn"]  # round bodies, fused steps
    for name in ["_decode"] if type(decoder).__name__ == "VanillaDecoder" else filter(partial(hasattr, decoder), names):
        fn = getattr(decoder, name)

        def wrapped(*args, _fn=fn, **kwargs):
            with no_host_reads():
                return _fn(*args, **kwargs)
        setattr(decoder, name, wrapped)


def force_depths(policy):
    """The policy still decides but the schedule picks the depth."""
    choose, schedule = policy.choose, itertools.cycle(DEPTHS)
    policy.choose = lambda batch, *facts: (choose(batch, *facts), next(schedule))[1]


def run(llm, prompts, method, args, greedy=True, new=NEW):
    llm.set_method(method, args)
    forbid_host_reads(llm.decoder)
    if llm.policy:
        force_depths(llm.policy)
    params = SamplingParams(max_new_tokens=new, ignore_eos=True, temperature=0.0 if greedy else 0.8,
                            top_k=0 if greedy else 20)
    seqs, stats = llm.generate(prompts, params)
    if llm.policy:  # rounds without drafts and with them
        assert stats.extra["depth_hist"][0] >= 1 and sum(stats.extra["depth_hist"][1:]) >= 1
    assert llm.scheduler.blocks.num_free == llm.scheduler.blocks.num_blocks
    assert all(s.draft_state is None and s.generator is None for s in seqs)
    return [s.output_ids for s in seqs], stats.as_dict()


# The interpreter is slow: the GPU path runs one EAGLE decoder, EAGLE-3 with the adaptive schedule (every depth,
# the full tree included). The static tree and EAGLE-1's head differ from it only in torch ops, the same on
# both paths, and their rounds are proven free of host reads on the CPU path. SpS's chains run there sampled
# (its draft distributions in the Triton rejection kernel); greedy, its verify is a causal step like prefill.
@pytest.mark.parametrize("path,name", [("cpu", n) for n in ["vanilla"] + list(METHODS)]
                         + [("gpu", n) for n in ("vanilla", "eagle3-adaptive")])
def test_greedy_equals_vanilla_without_host_reads(llm, reference, path, name):
    method, args = METHODS.get(name, ("vanilla", {}))
    with gpu_path(llm, path == "gpu"):
        batched, stats = run(llm, PROMPTS, method, args)
        alone, _ = run(llm, PROMPTS[:1], method, args)
    assert batched == reference and alone == reference[:1]
    if name == "sps":  # its drafts get accepted here: the KV moves of mixed paths are exercised
        assert stats["tau"] > 1.0


def test_gpu_round_feeds_in_one_fixed_step_as_eagerly(llm, reference, monkeypatch):
    """On the GPU path a tree round feeds the last round's accepted pairs as one fixed-shape step (rows padded
    to max_depth + 1 a sequence: EagleDecoder._feed_round). Its roots must be the eager feed's: the same
    drafts, so the same acceptance, round by round (a wrong root would still give vanilla's output)."""
    from engine.spec_eagle import EagleDecoder
    method, args = METHODS["eagle3-adaptive"]
    monkeypatch.setattr(llm.runner, "bucketed", True)  # the GPU path's shapes; the C++ kernels (the interpreter
    fixed, stats = run(llm, PROMPTS, method, args, new=NEW_LONG)                   # is too slow for 24 tokens)
    assert any(key[0] == "feed" for key in llm.decoder.graphs), "the fixed-shape feed never ran"
    monkeypatch.setattr(EagleDecoder, "_feed_round", lambda self, seqs: None)
    eager, eager_stats = run(llm, PROMPTS, method, args, new=NEW_LONG)
    assert not any(key[0] == "feed" for key in llm.decoder.graphs)
    assert fixed == eager and [o[:NEW] for o in fixed] == reference
    assert stats["tau"] > 1.0 and stats["tau"] == eager_stats["tau"]
    assert stats["accept_by_depth"] == eager_stats["accept_by_depth"]


@pytest.mark.parametrize("path,name", [("cpu", n) for n in ["vanilla"] + list(METHODS)]
                         + [("gpu", n) for n in ("vanilla", "sps", "eagle3-adaptive")])
def test_sampled_runs_without_host_reads(llm, path, name):
    method, args = METHODS.get(name, ("vanilla", {}))
    with gpu_path(llm, path == "gpu"):
        out, _ = run(llm, PROMPTS[:2 if path == "gpu" else 3], method, args, greedy=False)
    assert all(len(o) == NEW and all(0 <= t < VOCAB for t in o) for o in out)


def test_the_host_read_guard_catches_reads():
    x = torch.arange(3)
    with no_host_reads():
        for read in (lambda: x.tolist(), lambda: x[0].item(), lambda: bool(x.any()), lambda: int(x[1]),
                     lambda: x.cpu(), lambda: x.nonzero(), lambda: torch.nonzero(x)):
            with pytest.raises(HostRead):
                read()


def test_kernels_reject_tensors_on_another_device():
    meta = torch.device("meta")
    parents = torch.tensor([[-1, 0]], dtype=torch.int32)
    sizes = torch.tensor([2], dtype=torch.int32)
    with pytest.raises(ValueError, match="device|on meta|on cpu"):
        eagle_kernels.build_tree(parents, sizes.to(meta))
    with pytest.raises(ValueError, match="device|on meta|on cpu"):
        eagle_kernels.tree_accept_greedy(parents, torch.zeros(1, 2, dtype=torch.long), sizes,
                                         torch.zeros(1, 2, dtype=torch.long, device=meta))
    q = torch.randn(2, 4, 8)
    cache = torch.zeros(4, 4, 2, 8)
    tables = torch.zeros(1, 2, dtype=torch.int32)
    cu = torch.tensor([0, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="on"):
        eagle_kernels.paged_attention(q, cache, cache, tables, cu, torch.zeros(1, dtype=torch.int32, device=meta))
    with pytest.raises(ValueError, match="device|on meta|on cpu"):
        eagle_kernels.topk_expand(torch.randn(1, 8), torch.zeros(1, device=meta), 2)


def test_kv_budget_holds_the_draft_state_too(tmp_path):
    """--kv-cache-gb bounds the target's KV plus EAGLE's head KV and head inputs (one block of each over:
    the scratch block); vanilla gets the whole budget for the target."""
    write_tiny_llama(tmp_path, seed=1, vocab_size=VOCAB, num_hidden_layers=8).save_pretrained(str(tmp_path))
    write_tokenizer(tmp_path, VOCAB)
    gb = 0.004
    sizes = {}
    for method in ("vanilla", "eagle3"):
        llm = LLM(str(tmp_path), "float32", device="cpu", kv_cache_gb=gb, block_size=8, method=method,
                  method_args={"head": "random"} if method != "vanilla" else None)
        caches = [llm.runner.kv] + ([llm.decoder.kv, llm.decoder.features] if method != "vanilla" else [])
        total = sum(c.numel() * c.element_size() for c in caches)
        blocks = llm.runner.num_blocks
        assert total * blocks / (blocks + 1) <= gb * 2**30 < total * (blocks + 2) / (blocks + 1)
        sizes[method] = blocks
    assert sizes["eagle3"] < sizes["vanilla"]


@pytest.mark.parametrize("depth,topk", [(2, 1), (2, 2)])
def test_the_policy_is_charged_the_catch_up_not_the_prompt_feed(llm, depth, topk):
    """A request's first drafting round feeds its prompt's pairs: time kept out of the round's sample, but no
    catch-up (a prompt is fed once whatever the policy plays; charged as one, a new request's prompt made the
    policy's re-probes look too dear to ever run again); the policy learns the seconds a prompt pair takes
    from it (`fed`). The pairs rounds without drafts left are catch-up."""
    llm.set_method("eagle3", {"head": "random", "depth": depth, "topk": topk, "tree_tokens": depth * topk + 1,
                              "adaptive": True, "lookup": 0})  # every drafting round the head's
    schedule, told = iter([depth] + [0] * 6 + [depth] * NEW_LONG), []
    llm.policy.choose = lambda batch, behind=0, *facts: (told.append(behind), next(schedule))[1]
    rounds, step, observe = [], llm.decoder.step, llm.policy.observe

    def spy_step(*args, **kwargs):
        v = step(*args, **kwargs)
        rounds.append((v.depth, v.backlog_s, v.catch_up_s))
        return v
    charged = []
    llm.decoder.step = spy_step
    llm.policy.observe = lambda *a: (charged.append(a[4]), fed.append(a[6]), observe(*a))
    fed = []
    prompt = list(range(1, 40))
    llm.generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True))
    (d1, backlog1, catch1), plain, (d8, backlog8, catch8) = rounds[0], rounds[1:7], rounds[7]
    assert d1 == depth and backlog1 > 0 and catch1 == 0 and charged[0] == 0
    assert all(r == (0, 0.0, 0.0) for r in plain)
    assert d8 == depth and 0 < catch8 == backlog8 and charged[7] == catch8
    # what the policy is told the draft is behind by: nothing for the prompt, at most a pair a round without
    # drafts (a round feeds the newest few itself), and the catch-up's seconds a pair are learnt from it
    assert told[0] == 0 and 0 < told[7] <= 6 and llm.policy.catch_up == catch8 / told[7]
    # the prompt's pairs (all unread before the first round) and their seconds: the feed's cost a pair, learnt
    # from the next request's (the first round of a new decoder builds its steps: no sample)
    assert fed[0] == (backlog1, len(prompt) - 1) and all(n == 0 for _, n in fed[1:]) and not llm.policy.feed_rate
    n1, second = len(rounds), list(range(2, 30))
    llm.generate([second], SamplingParams(max_new_tokens=4, ignore_eos=True))
    backlog = rounds[n1][1]
    assert rounds[n1][0] == depth and fed[n1] == (backlog, len(second) - 1) > (0, 0)
    assert llm.policy.feed_rate == backlog / (len(second) - 1)


# min_prob reads the draft's scores on the host (the CPU's default, not the GPU's), so these run unguarded. Each
# shape's cut lies inside the random head's top-1 probabilities here (0.01 - 0.1), so rounds get cut.
GATED = {"chain": ({"depth": 3, "topk": 1, "tree_tokens": 4}, 0.02),
         "tree": ({"depth": 3, "topk": 3, "tree_tokens": 7}, 0.05)}


@pytest.mark.parametrize("shape", list(GATED))
def test_confidence_cut_stays_lossless_and_cuts(llm, reference, shape):
    """With min_prob, rounds draft and verify less (the depth histogram moves down), greedy output is still
    vanilla's, batched and alone, a seeded sampled request draws the same tokens alone as beside companions
    whose chains were cut otherwise, and every block comes back."""
    args, cut = {"head": "random", **GATED[shape][0]}, GATED[shape][1]
    greedy = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    llm.set_method("eagle3", args)
    full = llm.generate(PROMPTS, greedy)[1].extra["depth_hist"]
    llm.set_method("eagle3", {**args, "min_prob": cut})
    seqs, stats = llm.generate(PROMPTS, greedy)
    hist = stats.extra["depth_hist"]
    assert [s.output_ids for s in seqs] == reference
    assert sum(d * n for d, n in enumerate(hist)) < sum(d * n for d, n in enumerate(full)), (hist, full)
    assert llm.generate(PROMPTS[:1], greedy)[0][0].output_ids == reference[0]
    sampled = SamplingParams(max_new_tokens=NEW, ignore_eos=True, temperature=0.8, top_k=20, seed=7)
    others = SamplingParams(max_new_tokens=NEW, ignore_eos=True, temperature=0.8, top_k=20)
    alone = llm.generate(PROMPTS[:1], sampled)[0][0].output_ids
    assert llm.generate(PROMPTS, [sampled] + [others] * 3)[0][0].output_ids == alone
    assert llm.scheduler.blocks.num_free == llm.scheduler.blocks.num_blocks


def test_min_prob_out_of_range_is_a_clear_error(llm):
    for bad in (-0.1, 1.0, 2.0):
        with pytest.raises(ValueError, match="min_prob must be in"):
            llm.set_method("eagle3", {"head": "random", "min_prob": bad})
