"""eagle_kernels.draft_chain (an EAGLE-3 head's feed and top-1 chain in one C++ call) against the head's per-op
forward, its reference: the same drafts round by round (tokens and kept lengths, with and without min_prob's
cut, batched and alone, quantized and bf16 weights, fixed depths and the adaptive policy's; sampled sequences'
keyed drafts among greedy ones), so the same outputs, greedy and seeded sampled (vanilla's); and bad arguments get
a clear ValueError."""
import itertools

import pytest
import torch

import eagle_kernels
import engine.spec_eagle
from engine.heads import new_head
from engine.llm import LLM
from engine.scheduler import SamplingParams
from engine.trees import Tree
from tests.conftest import write_tiny_llama
from tests.test_speculative_sampling import write_tokenizer

VOCAB = 96
PROMPTS = [[1, 5, 9, 11, 4], [1, 7], [1, 3, 3, 3, 4, 5, 6, 7, 8], [1, 40, 41]]
CHAIN = {"head": "random", "depth": 3, "topk": 1, "tree_tokens": 4, "lookup": 0}  # every drafting round the head's


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("chain")
    hf = write_tiny_llama(path, seed=11, vocab_size=VOCAB, num_hidden_layers=8)
    with torch.no_grad():
        hf.lm_head.weight.mul_(8.0)  # peaked: a random head's drafts are accepted now and then
    hf.save_pretrained(str(path), safe_serialization=True)
    write_tokenizer(path, VOCAB)
    return path


@pytest.fixture(scope="module", params=["q4", "bf16"])
def llm(checkpoint, request):
    return LLM(str(checkpoint), "bfloat16", device="cpu", kv_cache_gb=0.02, block_size=8, max_batch=4,
               weights=request.param)


def drafting(llm, args, fused: bool, monkeypatch):
    """Set the method; -> (the rounds' drafts, as (tokens, sizes, parents, depths, scores), the C++ calls made) as they run."""
    llm.set_method("eagle3", args)
    decoder, rounds, calls = llm.decoder, [], []
    if fused:
        with torch.inference_mode():  # as generate runs
            assert eagle_kernels.draft_chain_fit(decoder.features) and decoder.head.chain_weights() is not None
    else:  # the reference: the head's forward op by op, level by level
        decoder.head.chain_weights = lambda: None
    if llm.policy is not None:  # the policy decides, a schedule visiting every depth (0 included) picks
        choose, schedule = llm.policy.choose, itertools.cycle([0, 3, 1, 0, 2])
        llm.policy.choose = lambda batch, *facts: (choose(batch, *facts), next(schedule))[1]
    step, draft, kernel = decoder.step, decoder.draft, eagle_kernels.draft_chain

    def stepped(seqs, depth=0, chunk=None):  # a round without drafts is recorded as None
        n = len(rounds)
        verdict = step(seqs, depth, chunk)
        if len(rounds) == n:
            rounds.append(None)
        return verdict

    def recorded(seqs, depth, caps):
        out = draft(seqs, depth, caps)
        t = out.tree
        rounds.append((t.tokens.clone(), t.sizes.clone(), t.parents.clone(), t.depths.clone(), t.scores.clone()))
        return out

    def counted(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)
    decoder.step, decoder.draft = stepped, recorded
    monkeypatch.setattr(engine.spec_eagle.eagle_kernels, "draft_chain", counted)
    return rounds, calls


@pytest.mark.parametrize("args", [CHAIN, {**CHAIN, "min_prob": 0.03}, {**CHAIN, "adaptive": True}],
                         ids=["chain", "min_prob", "adaptive"])
def test_one_call_drafts_what_the_head_drafts_op_by_op(llm, args, monkeypatch):
    one_call_against_op_by_op(llm, args, monkeypatch)


def test_a_head_with_a_wider_mlp_than_the_targets(llm, tmp_path, monkeypatch):
    """A head whose MLP is wider than the target's (`train.pipeline --grow-mlp`) drafts through the one call as
    op by op."""
    with torch.random.fork_rng():
        torch.manual_seed(1)
        head = new_head("eagle3", llm.model, intermediate_size=3 * llm.cfg.intermediate_size)
    head.save(tmp_path / "wide")
    one_call_against_op_by_op(llm, {**CHAIN, "head": str(tmp_path / "wide")}, monkeypatch)
    assert llm.decoder.head.layer.mlp.down_proj.in_features == 3 * llm.cfg.intermediate_size


def one_call_against_op_by_op(llm, args, monkeypatch):
    greedy = SamplingParams(max_new_tokens=12, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.8, top_k=20, seed=3)
    mixed = [greedy, sampled, SamplingParams(1.2, max_new_tokens=12, ignore_eos=True, seed=4), sampled]
    llm.set_method("vanilla")
    reference = [s.output_ids for s in llm.generate(PROMPTS, greedy)[0]]
    reference_mixed = [s.output_ids for s in llm.generate(PROMPTS, mixed)[0]]
    runs = {}
    for fused in (True, False):
        rounds, calls = drafting(llm, args, fused, monkeypatch)
        outputs = [[s.output_ids for s in llm.generate(PROMPTS, greedy)[0]],
                   llm.generate(PROMPTS[:1], greedy)[0][0].output_ids,
                   [s.output_ids for s in llm.generate(PROMPTS, sampled)[0]],
                   [s.output_ids for s in llm.generate(PROMPTS, mixed)[0]]]
        runs[fused] = rounds, outputs
        assert (len(calls) > 0) == fused
        assert llm.scheduler.blocks.num_free == llm.scheduler.blocks.num_blocks
        monkeypatch.undo()
    (rounds, outputs), (reference_rounds, reference_outputs) = runs[True], runs[False]
    assert len(rounds) == len(reference_rounds)
    for got, want in zip(rounds, reference_rounds):
        assert (got is None) == (want is None)
        assert got is None or all(torch.equal(a, b) for a, b in zip(got, want)), (got, want)
    assert outputs == reference_outputs
    assert outputs[0] == reference and outputs[1] == reference[0]
    assert outputs[3] == reference_mixed  # sampled rows' drafts are keyed draws, verified by the target's
    sizes = torch.cat([r[1] for r in rounds if r is not None])
    if "min_prob" in args:  # chains cut at different lengths
        assert sizes.max() >= 2 and sizes.min() < sizes.max()
    else:
        assert sizes.max() == 4


def tie_the_draft_logits(head):
    """Rows 5 and 7 of the head's LM head one random row r, every other row -r: each level's logits tie, at
    rows 5 and 7 (r . x > 0) or at every other row (r . x < 0); the first maximum is row 5 or row 0."""
    lm_head = head.lm_head
    weight = lm_head.weight if isinstance(lm_head, torch.nn.Linear) else None
    Vd, H = (weight.shape if weight is not None else (lm_head.out_features, lm_head.in_features))
    r = torch.randn(H, generator=torch.Generator().manual_seed(5))
    w = -r.expand(Vd, H).clone()
    w[5] = w[7] = r
    with torch.no_grad():
        if weight is not None:
            weight.copy_(w.to(weight.dtype))
        else:
            lm_head.qweight.copy_(eagle_kernels.quant.quantize(w.to(torch.bfloat16), lm_head.qtype))


def test_tied_draft_logits_draft_their_first_maximum(llm, monkeypatch):
    """The one call's vector top-1 picks the first of equal maxima, as the op-by-op forward's max does."""
    greedy = SamplingParams(max_new_tokens=12, ignore_eos=True)
    runs = {}
    for fused in (True, False):
        rounds, _ = drafting(llm, CHAIN, fused, monkeypatch)
        tie_the_draft_logits(llm.decoder.head)
        runs[fused] = rounds, [s.output_ids for s in llm.generate(PROMPTS, greedy)[0]]
        monkeypatch.undo()
    (rounds, outputs), (reference_rounds, reference_outputs) = runs[True], runs[False]
    assert outputs == reference_outputs
    drafted = set()
    for got, want in zip(rounds, reference_rounds, strict=True):
        assert (got is None) == (want is None)
        if got is not None:
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (got, want)
            tokens, sizes = got[0], got[1]
            drafted |= {t for row, n in zip(tokens.tolist(), sizes.tolist()) for t in row[1:n]}
    first = set(llm.decoder.head.to_target(torch.tensor([0, 5])).tolist())
    assert drafted and drafted <= first, (drafted, first)


def test_bad_arguments_get_a_clear_error(llm, monkeypatch):
    captured = []
    llm.set_method("eagle3", CHAIN)
    kernel = eagle_kernels.draft_chain
    monkeypatch.setattr(engine.spec_eagle.eagle_kernels, "draft_chain",
                        lambda *a: captured.append(a) or kernel(*a))
    llm.generate(PROMPTS[:2], SamplingParams(max_new_tokens=3, ignore_eos=True))
    monkeypatch.undo()
    names = ("features", "ids", "positions", "slot_mapping", "block_tables", "cu_seqlens_q", "prefix_lens",
             "max_levels", "min_prob", "weights", "formats", "d2t", "eps", "cos", "sin", "kv", "num_q_heads")
    good = dict(zip(names, captured[-1]))
    assert good["cu_seqlens_q"].shape[0] == 3
    tokens, parents, depths, scores, sizes = eagle_kernels.draft_chain(**good)
    assert tokens.shape[0] == 2 and sizes.dtype == torch.int32 and 1 <= sizes.min() <= sizes.max() <= tokens.shape[1]
    chains = Tree.chains(tokens, sizes)
    assert torch.equal(parents, chains.parents) and torch.equal(depths, chains.depths)
    assert torch.equal(scores, chains.scores)
    w, f = good["weights"], good["formats"]
    empty = good["cu_seqlens_q"].clone()
    empty[1] = 0
    bad = [
        (dict(weights=w[:-1]), "weights must hold 11"),
        (dict(formats=[5] + f[1:]), "formats must be in"),
        (dict(weights=[w[1]] + w[1:]), "fc must map|uint8|must be"),
        (dict(cu_seqlens_q=empty), "at least one pair"),
        (dict(max_levels=[1]), "max_levels must be 2"),
        (dict(max_levels=[1, -1]), "max_levels must be 2"),
        (dict(d2t=good["d2t"] + VOCAB), "d2t maps"),
        (dict(ids=good["ids"] + 1000), r"ids must be in \[0, 96\)"),
        (dict(slot_mapping=good["slot_mapping"] + 10**6), "slot_mapping must be in"),
        (dict(min_prob=1.0), r"min_prob must be in \[0, 1\)"),
        (dict(cos=good["cos"][:2]), "rope table"),
        (dict(num_q_heads=3), "qkv must map"),
        (dict(keyed=([1], [5], [0.7])), "keyed must be"),
        (dict(keyed=([1, 2], [5, 6], [0.7, -1.0])), "keyed must be"),
    ]
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            eagle_kernels.draft_chain(**{**good, **change})
    with eagle_kernels.unchecked(), pytest.raises(ValueError, match="every sequence must feed"):
        eagle_kernels.draft_chain(**{**good, "cu_seqlens_q": empty})  # the C++ op checks what it indexes by
    with eagle_kernels.unchecked(), pytest.raises(ValueError, match="temperatures, keys and firsts must hold 2"):
        eagle_kernels.draft_chain(**{**good, "keyed": ([1], [5], [0.7])})


def test_a_level_allocates_nothing(checkpoint, monkeypatch):
    """With the head's weights quantized, a level of the chain (a head step, its logits and top-1) runs in the
    thread's buffers: the tensors a call allocates (its inputs' gathers, the chains it returns) are as many for
    four levels as for one (a step's temporaries as new tensors made ~30 a level)."""
    from torch.profiler import ProfilerActivity, profile
    llm = LLM(str(checkpoint), "bfloat16", device="cpu", kv_cache_gb=0.02, block_size=8, max_batch=4, weights="q4")
    llm.set_method("eagle3", CHAIN)
    captured, kernel = [], eagle_kernels.draft_chain
    monkeypatch.setattr(engine.spec_eagle.eagle_kernels, "draft_chain", lambda *a: captured.append(a) or kernel(*a))
    llm.generate(PROMPTS[:2], SamplingParams(max_new_tokens=3, ignore_eos=True))
    monkeypatch.undo()
    args = list(captured[-1])

    def allocations(levels: int) -> list[str]:
        args[7] = [levels] * len(args[7])  # max_levels
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            tokens = kernel(*args)[0]
        assert tokens.shape[1] == levels + 1
        events = prof.events()
        (op,) = [e for e in events if e.name == "eagle::draft_chain"]
        return [e.name for e in events if e.self_cpu_memory_usage > 0
                and op.time_range.start <= e.time_range.start <= op.time_range.end]

    allocations(4)  # the buffers grow to four levels' rows
    one, four = allocations(1), allocations(4)
    assert 0 < len(one) == len(four), (one, four)
