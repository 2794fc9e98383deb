"""Lossless speculative sampling on a tiny synthetic Llama: the distribution of whole generated sequences
must be the target's exact distribution (computed with transformers), for every method, temperature,
top-k and top-p, in mixed batches with greedy requests; plus greedy losslessness on many short prompts."""
import dataclasses
import itertools

import pytest
import torch
from scipy.stats import chisquare

import eagle_kernels
from engine.llm import LLM
from engine.scheduler import SamplingParams
from tests.conftest import write_tiny_llama

VOCAB, PROMPT, NEW = 16, [1, 5, 9], 4
GROUPS = [SamplingParams(0.6, top_p=0.8), SamplingParams(1.0, top_k=4), SamplingParams(1.0)]
SAMPLES = 1500  # per group
MIN_TAU = 1.2   # drafts must be accepted often enough for a test to mean something
METHOD_ARGS = {
    "sps": {"draft": "early-exit:2", "draft_len": 3},
    "eagle": {"head": "random", "depth": 3, "topk": 4, "tree_tokens": 10},
    "eagle3": {"head": "random", "depth": 3, "topk": 8, "tree_tokens": 16},
}


def write_tokenizer(path, vocab):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t2", bos_token="t1", unk_token="t0") \
        .save_pretrained(str(path))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """An 8-layer Llama (EAGLE-3 needs three distinct layers) with a sharpened LM head, so sequences
    have a few likely continuations and drafts get accepted often."""
    path = tmp_path_factory.mktemp("tiny")
    hf = write_tiny_llama(path, seed=5, vocab_size=VOCAB, num_hidden_layers=8)
    with torch.no_grad():
        hf.lm_head.weight.mul_(10.0)
    hf.save_pretrained(str(path), safe_serialization=True)
    write_tokenizer(path, VOCAB)
    threads = torch.get_num_threads()
    llm = LLM(str(path), "float32", device="cpu", kv_cache_gb=0.2, block_size=8, max_batch=len(GROUPS) * SAMPLES + 8, seed=3, threads=1)
    yield llm, hf
    torch.set_num_threads(threads)


def use(llm, method, **args):
    llm.set_method(method, args)


def exact_distribution(hf, params: SamplingParams) -> torch.Tensor:
    """P(t1..t4 | prompt) under the target's sampling distribution, after the request's logit transforms:
    fp64 [V ** NEW]."""
    prob = torch.ones(1, dtype=torch.float64)
    for n in range(NEW):
        prefixes = torch.tensor(list(itertools.product(range(VOCAB), repeat=n)), dtype=torch.long).view(VOCAB ** n, n)
        ids = torch.cat([torch.tensor(PROMPT).expand(len(prefixes), -1), prefixes], 1)
        with torch.no_grad():
            logits = transformed(hf(ids).logits[:, -1].float(), prefixes, params)
        step = eagle_kernels.sampling_probs(logits, params.temperature, params.top_k, params.top_p)
        prob = (prob[:, None] * step.double()).flatten()
    return prob


def transformed(logits: torch.Tensor, outputs: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """vLLM's logit transforms in plain torch (independent of Sampler.adjust): logits fp32 [P, V] after the
    output prefixes [P, n]: repetition penalty over prompt and output, then frequency and presence penalties
    over the output, then logit_bias."""
    counts = torch.nn.functional.one_hot(outputs, VOCAB).sum(1).float() if outputs.shape[1] else \
        torch.zeros_like(logits)
    seen = counts > 0
    seen[:, PROMPT] = True
    r = p.repetition_penalty
    logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    logits = logits - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
    for t, v in (p.logit_bias or {}).items():
        logits[:, t] += v
    return logits


def chi_square_pvalue(counts: torch.Tensor, prob: torch.Tensor) -> float:
    """Cells expected below 5 are pooled into one."""
    expected = prob * counts.sum()
    big = expected >= 5
    assert counts[~big & (prob == 0)].sum() == 0, "sampled a sequence the target cannot produce"
    obs = torch.cat([counts[big], counts[~big].sum()[None]]).double()
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    used = exp > 0
    obs, exp = obs[used], exp[used]
    return chisquare(obs.numpy(), (exp * obs.sum() / exp.sum()).numpy()).pvalue  # fp32 rounding in sum(prob)


def sequence_index(tokens: list[int]) -> int:
    return sum(t * VOCAB ** (NEW - 1 - i) for i, t in enumerate(tokens))


@pytest.fixture(scope="module")
def exact(tiny):
    return [exact_distribution(tiny[1], p) for p in GROUPS]


@pytest.mark.parametrize("method", list(METHOD_ARGS))
def test_sampling_is_lossless(tiny, exact, method):
    llm, _ = tiny
    use(llm, method, **METHOD_ARGS[method])
    params = [SamplingParams(p.temperature, p.top_p, p.top_k, NEW, ignore_eos=True) for p in GROUPS]
    greedy = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    batch = [p for p in params for _ in range(SAMPLES)] + [greedy] * 4
    seqs, stats = llm.generate([PROMPT] * len(batch), batch)
    assert stats.extra["tau"] > MIN_TAU
    for g, prob in enumerate(exact):
        counts = torch.zeros(VOCAB ** NEW)
        for s in seqs[g * SAMPLES:(g + 1) * SAMPLES]:
            counts[sequence_index(s.output_ids)] += 1
        pvalue = chi_square_pvalue(counts, prob)
        assert pvalue > 1e-3, GROUPS[g]
    use(llm, "vanilla")
    ref, _ = llm.generate([PROMPT], greedy)
    assert all(s.output_ids == ref[0].output_ids for s in seqs[-4:])


# Penalties and a bias strong enough to move the distribution far from the plain target's.
PENALISED = [SamplingParams(0.8, presence_penalty=1.5, frequency_penalty=0.7, repetition_penalty=1.4,
                            logit_bias={4: 2.5, 6: -3.0}),
             SamplingParams(1.0, top_k=5, frequency_penalty=-0.6, repetition_penalty=0.8)]


@pytest.mark.parametrize("method", list(METHOD_ARGS))
def test_sampling_with_penalties_is_lossless(tiny, method):
    """Verification applies the transforms at every tree node with its drafted ancestors counted as output:
    the sampled sequences follow the transformed target exactly (each node's q is the untransformed draft's,
    which may be far from it: acceptance drops, the distribution must not)."""
    llm, hf = tiny
    use(llm, method, **METHOD_ARGS[method])
    params = [dataclasses.replace(p, max_new_tokens=NEW, ignore_eos=True) for p in PENALISED]
    seqs, stats = llm.generate([PROMPT] * (len(params) * SAMPLES), [p for p in params for _ in range(SAMPLES)])
    assert stats.extra["tau"] > 1.05  # some drafts accepted, or the test proves nothing about verification
    for g, p in enumerate(params):
        counts = torch.zeros(VOCAB ** NEW)
        for s in seqs[g * SAMPLES:(g + 1) * SAMPLES]:
            counts[sequence_index(s.output_ids)] += 1
        assert chi_square_pvalue(counts, exact_distribution(hf, p)) > 1e-3, p
    # the reference itself is not the untransformed distribution (the test could not fail otherwise)
    plain = exact_distribution(hf, dataclasses.replace(params[0], presence_penalty=0, frequency_penalty=0,
                                                       repetition_penalty=1, logit_bias=None))
    assert (plain - exact_distribution(hf, params[0])).abs().sum() > 0.3


@pytest.mark.parametrize("method,args", [
    ("sps", {"draft": "early-exit:4", "draft_len": 4}),
    ("eagle", {"head": "random", "tree": "static"}),
    ("eagle", {"head": "random", "depth": 4, "topk": 4, "tree_tokens": 12}),
    ("eagle3", {"head": "random", "depth": 5, "topk": 10, "tree_tokens": 40}),  # > 32 nodes: 2 mask words
])
def test_greedy_is_lossless_on_many_prompts(tiny, method, args):
    llm, _ = tiny
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB, (int(n),), generator=g).tolist()
               for n in torch.randint(1, 40, (24,), generator=g)]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    use(llm, "vanilla")
    ref, _ = llm.generate(prompts, params)
    use(llm, method, **args)
    out, stats = llm.generate(prompts, params)
    assert [s.output_ids for s in out] == [s.output_ids for s in ref]
    assert stats.extra["tau"] > 1.3
    alone, _ = llm.generate(prompts[:1], params)
    assert alone[0].output_ids == ref[0].output_ids


def test_sps_with_the_target_as_draft_accepts_everything(tiny):
    """q == p: greedy drafts always match, and sampled ones pass min(1, p/q) ~ 1 -- unless the draft
    distributions were misaligned with their nodes."""
    llm, _ = tiny
    use(llm, "vanilla")
    prompts = [[1, 5, 9], [3, 4, 5, 6, 7, 8]]
    greedy = SamplingParams(max_new_tokens=25, ignore_eos=True)
    ref, _ = llm.generate(prompts, greedy)
    use(llm, "sps", draft=str(llm.source.path), draft_len=3)
    out, stats = llm.generate(prompts, greedy)
    assert [s.output_ids for s in out] == [s.output_ids for s in ref]
    assert stats.extra["tau"] > 3.5  # 4 per round but the last, which the token budget caps
    _, stats = llm.generate(prompts * 50, SamplingParams(1.0, max_new_tokens=25, ignore_eos=True))
    assert stats.extra["accept_by_depth"][0] > 0.99 and stats.extra["tau"] > 3.5


SEEDED = [SamplingParams(0.8, seed=11), SamplingParams(1.0, top_p=0.7, seed=12), SamplingParams(1.3, top_k=5, seed=13),
          SamplingParams(0.9, presence_penalty=0.8, repetition_penalty=1.3, logit_bias={4: 1.5}, seed=14)]


@pytest.mark.parametrize("method,args,min_tau", [
    ("eagle3", {"head": "random", "depth": 2, "topk": 1, "tree_tokens": 3}, 1.005),  # the CPU default's chain
    ("eagle3", {"head": "random", "depth": 3, "topk": 8, "tree_tokens": 16}, 1.2),
    ("eagle", {"head": "random", "depth": 4, "topk": 4, "tree_tokens": 12}, 1.2),
])
def test_sampled_output_is_vanillas_for_the_same_key(tiny, method, args, min_tau):
    """A sampled token is a keyed draw (the request's seed and the token's position), and a round whose drafts
    are the draft's choices draws the target's token at every node and walks the tree as greedy verification
    does: the output is token for token vanilla sampling's, alone or batched, seeded or after LLM.reseed. (A
    random head's top-1 chain is seldom right: a few accepted drafts there.)"""
    llm, _ = tiny
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (int(n),), generator=g).tolist() for n in torch.randint(1, 30, (12,), generator=g)]
    params = [dataclasses.replace(SEEDED[i % len(SEEDED)], max_new_tokens=24, ignore_eos=True, seed=100 + i)
              for i in range(len(prompts))]
    unseeded = [dataclasses.replace(p, seed=None) for p in params]
    runs = {}
    for name, a in (("vanilla", {}), (method, args)):
        use(llm, name, **a)
        seeded, stats = llm.generate(prompts, params)
        llm.reseed(7)
        shared, _ = llm.generate(prompts, unseeded)
        alone, _ = llm.generate(prompts[3:4], params[3:4])
        plain, _ = llm.generate(prompts[:1], params[:1])  # a temperature alone: Llama.tokens' keyed draws
        runs[name] = ([s.output_ids for s in seeded], [s.output_ids for s in shared], alone[0].output_ids, stats,
                      plain[0].output_ids)
    ref, out = runs["vanilla"], runs[method]
    assert out[0] == ref[0] and out[1] == ref[1] and out[2] == ref[2] == ref[0][3]
    assert out[4] == ref[4] == ref[0][0]
    assert out[3].extra["tau"] > min_tau  # drafts were accepted: verification, not plain decoding, made these tokens
    assert ref[0] != ref[1]  # the seeds and the engine's stream are different keys (the test could not fail otherwise)
    use(llm, "vanilla")
    greedy, _ = llm.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert sum(a != b.output_ids for a, b in zip(ref[0], greedy)) >= len(prompts) // 2  # they did sample
