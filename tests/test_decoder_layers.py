"""eagle_kernels.decoder_layers (the decoder stack in one C++ call) against the model's per-layer forward, its
reference: the same bits for features, captured layer inputs and KV caches, on random weights in every format,
for decode steps, chains of several lengths and tree-masked steps over batches with different prefixes."""
import pytest
import torch

import eagle_kernels
from engine.llm import LLM
from engine.model_runner import StepPlan
from engine.scheduler import SamplingParams
from tests.conftest import write_tiny_llama
from tests.test_speculative_sampling import write_tokenizer

VOCAB = 96


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("stack")
    hf = write_tiny_llama(path, seed=11, vocab_size=VOCAB, num_hidden_layers=8)
    with torch.no_grad():
        hf.lm_head.weight.mul_(8.0)  # peaked: drafts of a random head are accepted now and then
    hf.save_pretrained(str(path), safe_serialization=True)
    write_tokenizer(path, VOCAB)
    return path


def engine(path, weights):
    return LLM(str(path), "bfloat16", device="cpu", kv_cache_gb=0.02, block_size=8, max_batch=4, weights=weights)


def tree_rows(parents: list[int]) -> list[int]:
    """Ancestor bitmasks (self included) of one sequence's new tokens, parents[i] < i or -1."""
    rows = []
    for i, p in enumerate(parents):
        rows.append((rows[p] if p >= 0 else 0) | (1 << i))
    return rows


def both_ways(llm, seq_ids, counts, trees=None, capture=()):
    """One step appending counts[b] random tokens to each sequence, run fused and per layer from the same
    cache. -> [(feature, captured, kv)] for fused, per layer, and with a capture, fused and per layer again
    writing the captured inputs to a slot-indexed store (captured: [its rows at the step's slots])."""
    runner, blocks, model = llm.runner, llm.scheduler.blocks, llm.model
    starts = [blocks.length(s) for s in seq_ids]
    for s, start, n in zip(seq_ids, starts, counts):
        blocks.reserve(s, start + n)
    plan = StepPlan([blocks.block_table(s) for s in seq_ids], starts, counts)
    ids = torch.randint(3, VOCAB, (sum(counts),)).tolist()
    mask = None
    if trees is not None:
        mask = torch.tensor([[r] for t in trees for r in tree_rows(t)], dtype=torch.int32)
    meta, pos, ids = runner.meta(plan, ids=ids, tree_mask=mask)
    if trees is not None:  # a node's position is its root's + its depth
        depth = [d for t in trees for d in _depths(t)]
        pos = torch.tensor([starts[b] for b, n in enumerate(counts) for _ in range(n)]) + torch.tensor(depth)
    before = runner.kv.clone()
    out = []
    for fused, into in [(True, False), (False, False)] + ([(True, True), (False, True)] if capture else []):
        runner.kv.copy_(before)
        model.fused = fused
        assert (model.stack() is not None) == fused
        store = torch.randn(runner.kv.shape[2] * runner.kv.shape[3], len(capture) * 64).bfloat16() if into else None
        with torch.inference_mode():
            feature, captured = model(ids, pos, runner.layers, meta, capture, store)
        if into:
            assert captured == []
            captured = [store[meta.slot_mapping]]
        out.append((feature, captured, runner.kv.clone()))
    model.fused = True
    return out


def _depths(parents):
    d = []
    for p in parents:
        d.append(0 if p < 0 else d[p] + 1)
    return d


@pytest.mark.parametrize("weights", ["bf16", "q4", "q8_0"])
def test_decoder_layers_equals_the_per_layer_forward(checkpoint, weights):
    torch.manual_seed(0)
    llm = engine(checkpoint, weights)
    blocks = llm.scheduler.blocks
    seq_ids = [0, 1, 2]
    for s, n in zip(seq_ids, (5, 19, 40)):  # prompts: the last one's prefill goes to SDPA, as in the engine
        blocks.allocate(s, 0)
        with torch.inference_mode():
            llm.runner.forward(blocks, [s], [torch.randint(3, VOCAB, (n,)).tolist()])
    steps = [dict(counts=[1, 1, 1]), dict(counts=[1, 4, 7], capture=(1, 4, 7)), dict(counts=[32, 2, 9]),
             dict(counts=[6, 3, 5], trees=[[-1, 0, 0, 1, 1, 2], [-1, 0, 1], [-1, 0, 0, 0, 3]], capture=(0, 2, 5)),
             dict(counts=[1, 1, 1], capture=(7,))]
    for step in steps:
        (f1, c1, kv1), (f2, c2, kv2), *into = both_ways(llm, seq_ids, **step)
        assert f1.dtype == torch.bfloat16 and f1.shape == (sum(step["counts"]), 64)
        assert f1.abs().sum() > 0 and torch.equal(f1, f2), step
        assert len(c1) == len(step.get("capture", ())) and all(torch.equal(a, b) for a, b in zip(c1, c2)), step
        assert torch.equal(kv1, kv2), step
        for feature, rows, kv in into:  # the same inputs written to a store by slot instead
            assert torch.equal(feature, f1) and torch.equal(rows[0], torch.cat(c1, -1)) and torch.equal(kv, kv1)
        llm.runner.kv.copy_(kv1)  # the step's tokens stay: the next step sees longer prefixes


def test_a_step_past_the_thread_buffers_cap(checkpoint):
    """A step whose temporaries pass what a thread keeps between steps (4 MB: ~2500 tokens of this model) gets
    tensors of its own, alive while they are read (freed early, the process crashed): the per-layer bits."""
    llm = LLM(str(checkpoint), "bfloat16", device="cpu", kv_cache_gb=0.05, block_size=8, max_batch=16, weights="q4")
    seq_ids = list(range(12))
    for s in seq_ids:
        llm.scheduler.blocks.allocate(s, 0)
    (f1, _, kv1), (f2, _, kv2) = both_ways(llm, seq_ids, [230] * 12)
    assert f1.shape[0] == 2760 and f1.abs().sum() > 0
    assert torch.equal(f1, f2) and torch.equal(kv1, kv2)


@pytest.mark.parametrize("weights", ["q4", "q8_0"])
def test_decoder_layers_same_bits_on_any_thread_count(checkpoint, weights):
    """Quantized small steps run in one parallel region whose phases split work by thread count: the bits must
    not depend on it (nor on how attention rows are cut into per-thread parts)."""
    steps = (dict(counts=[1, 1, 1], capture=(2, 5)),
             dict(counts=[6, 3, 5], trees=[[-1, 0, 0, 1, 1, 2], [-1, 0, 1], [-1, 0, 0, 0, 3]], capture=(0, 7)),
             dict(counts=[1, 1, 1]))
    threads, runs = torch.get_num_threads(), []
    try:
        for n in (1, 2, 3):  # a fresh engine each: the same prompts, blocks and steps
            torch.set_num_threads(n)
            torch.manual_seed(1)
            llm = engine(checkpoint, weights)
            for s, length in zip([0, 1, 2], (3, 30, 11)):
                llm.scheduler.blocks.allocate(s, 0)
                with torch.inference_mode():
                    llm.runner.forward(llm.scheduler.blocks, [s], [torch.randint(3, VOCAB, (length,)).tolist()])
            runs.append([])
            for step in steps:
                results = both_ways(llm, [0, 1, 2], **step)  # fused, per layer (and both writing a store)
                assert _same(results[0], results[1]), step
                runs[-1].append(results)
                llm.runner.kv.copy_(results[0][2])
    finally:
        torch.set_num_threads(threads)
    for run, other in zip(runs, runs[1:]):
        for step, a, b in zip(steps, run, other):
            assert all(_same(x, y) for x, y in zip(a, b)), step


def _same(a, b) -> bool:
    """Two (feature, captured, kv) results, bit for bit."""
    return (torch.equal(a[0], b[0]) and len(a[1]) == len(b[1]) and all(map(torch.equal, a[1], b[1]))
            and torch.equal(a[2], b[2]))


def test_the_engine_decodes_the_same_tokens_fused_or_not(checkpoint):
    llm = engine(checkpoint, "q4")
    prompts = [[1, 5, 9, 11, 4], [1, 7], [1, 3, 3, 3, 4, 5]]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    out = {}
    for method, args in (("vanilla", None), ("eagle3", {"head": "random"})):
        llm.set_method(method, args)
        for fused in (True, False):
            llm.model.fused = fused
            out[method, fused] = [s.output_ids for s in llm.generate(prompts, params)[0]]
    llm.model.fused = True
    assert out["vanilla", True] == out["vanilla", False] == out["eagle3", True] == out["eagle3", False]


def test_decoder_layers_fit_and_stack():
    hidden = torch.zeros(3, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert eagle_kernels.decoder_layers_fit(hidden)
        assert eagle_kernels.decoder_layers_fit(torch.zeros(500, 64, dtype=torch.bfloat16))  # prefills too
        assert not eagle_kernels.decoder_layers_fit(hidden.float())
    assert not eagle_kernels.decoder_layers_fit(hidden)                  # autograd on


def test_fp32_models_keep_the_per_layer_forward(checkpoint):
    llm = LLM(str(checkpoint), "float32", device="cpu", kv_cache_gb=0.02, block_size=8, weights="bf16")
    assert llm.model.stack() is None


def test_decoder_layers_bad_arguments(checkpoint):
    llm = engine(checkpoint, "q4")
    model, runner = llm.model, llm.runner
    weights, formats = model.stack()
    llm.scheduler.blocks.allocate(0, 0)
    llm.scheduler.blocks.reserve(0, 2)
    meta, pos, ids = runner.meta(StepPlan([llm.scheduler.blocks.block_table(0)], [0], [2]), ids=[4, 5])
    hidden = torch.randn(2, 64).bfloat16()
    cos, sin = model.rotary(pos, torch.float32)
    kv = [c for pair in runner.layers for c in pair]
    args = lambda **kw: {**dict(hidden=hidden.clone(), weights=weights, formats=formats, eps=1e-5, cos=cos, sin=sin,
                                kv=kv, slot_mapping=meta.slot_mapping, block_tables=meta.block_tables,
                                cu_seqlens_q=meta.cu_seqlens_q, prefix_lens=meta.prefix_lens, tree_mask=None,
                                num_q_heads=4), **kw}
    feature, _ = eagle_kernels.decoder_layers(**args())
    assert feature.shape == (2, 64)
    bad = [
        (dict(hidden=hidden.float()), "hidden must be a contiguous bf16"),
        (dict(weights=weights[:-1]), "6 per layer"),
        (dict(formats=formats[:-1]), "formats 4 per layer"),
        (dict(formats=[5] + formats[1:]), "formats must be in"),
        (dict(weights=[weights[0], weights[2]] + weights[2:]), "qkv must map 64"),
        (dict(weights=weights[:4] + [torch.zeros(256, 64, dtype=torch.bfloat16)] + weights[5:],
              formats=formats[:2] + [0] + formats[3:]), None),   # a bf16 gate_up is fine
        (dict(weights=weights[:5] + [weights[4]] + weights[6:]), "uint8"),
        (dict(num_q_heads=3), "qkv must map 64"),
        (dict(cos=cos[:1]), "cos and sin"),
        (dict(prefix_lens=meta.prefix_lens + 1000), "spans 1002 tokens"),
        (dict(capture=[1], capture_into=torch.zeros(4096, 128, dtype=torch.bfloat16)), "capture_into must be"),
        (dict(capture=[1], capture_into=torch.zeros(1, 64, dtype=torch.bfloat16)), "outside capture_into"),
        (dict(capture=[1], capture_into=torch.zeros(4096, 64)), "capture_into must be"),
    ]
    for change, message in bad:
        if message is None:
            eagle_kernels.decoder_layers(**args(**change))
            continue
        with pytest.raises(ValueError, match=message):
            eagle_kernels.decoder_layers(**args(**change))
        with eagle_kernels.unchecked(), pytest.raises(ValueError):  # the C++ op's own checks, as the engine runs it
            eagle_kernels.decoder_layers(**args(**change))
    with eagle_kernels.unchecked(), pytest.raises(ValueError, match="outside the cache"):
        eagle_kernels.decoder_layers(**args(slot_mapping=meta.slot_mapping + 10**6))
    # a bound stack (what the engine passes: the embedding and rope tables too, rows taken by ids and positions):
    # the same values and KV, the C++ op's checks on every call
    ids = torch.tensor([4, 5])
    table, fmt = model.embed_tokens.qweight, eagle_kernels.decoder.FORMATS[model.embed_tokens.qtype]
    before = [c.clone() for c in kv]
    want = eagle_kernels.decoder_layers(**args(hidden=model.embed_tokens(ids)))[0]
    written = [c.clone() for c in kv]
    for c, b in zip(kv, before):
        c.copy_(b)
    stack = eagle_kernels.decoder.bind(weights, formats, kv, table, fmt, model.rotary.cos, model.rotary.sin)
    bound = lambda **kw: {**dict(ids=ids, positions=pos, stack=stack, eps=1e-5, slot_mapping=meta.slot_mapping,
                                 block_tables=meta.block_tables, cu_seqlens_q=meta.cu_seqlens_q,
                                 prefix_lens=meta.prefix_lens, tree_mask=None, num_q_heads=4), **kw}
    assert torch.equal(eagle_kernels.decoder.decoder_layers_bound(**bound())[0], want)
    assert all(torch.equal(c, w) for c, w in zip(kv, written))
    with pytest.raises(ValueError, match="6 per layer"):
        eagle_kernels.decoder.bind(weights[:-1], formats, kv, table, fmt, model.rotary.cos, model.rotary.sin)
    with pytest.raises(ValueError, match="formats must be in"):
        eagle_kernels.decoder.bind(weights, [5] + formats[1:], kv, table, fmt, model.rotary.cos, model.rotary.sin)
    with pytest.raises(ValueError, match="embed_format must be in"):
        eagle_kernels.decoder.bind(weights, formats, kv, table, 5, model.rotary.cos, model.rotary.sin)
    with pytest.raises(ValueError, match="outside the cache"):
        eagle_kernels.decoder.decoder_layers_bound(**bound(slot_mapping=meta.slot_mapping + 10**6))
    with pytest.raises(ValueError, match="one length"):
        eagle_kernels.decoder.decoder_layers_bound(**bound(positions=pos[:1]))


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
@pytest.mark.parametrize("weights", ["bf16", "q4", "q8_0"])
def test_head_layer_fused_equals_the_per_op_forward(checkpoint, weights, kind):
    """An EAGLE head's layer through decoder_layers (first_input: the head's own attention input) gives the
    bits of its per-op forward: outputs and the head's KV, for prefill-like, decode and tree steps."""
    from engine.model import QLinear
    from engine.spec_eagle import eagle_head
    torch.manual_seed(1)
    llm = engine(checkpoint, weights)
    head = eagle_head("random", kind, llm.model)
    quantized = [isinstance(lin, QLinear) for lin in (head.fc, head.layer.mlp.down_proj)
                 + ((head.lm_head,) if kind == "eagle3" else ())]
    assert quantized == [weights != "bf16"] * len(quantized)  # quantized like the target's projections
    runner, blocks = llm.runner, llm.scheduler.blocks
    kv = runner.new_cache(1, head.cfg.num_kv_heads, head.cfg.head_dim)
    layer_kv = (kv[0, 0], kv[0, 1])
    for s in (0, 1):
        blocks.allocate(s, 0)
    for counts, trees in (([7, 20], None), ([1, 1], None), ([3, 5], [[-1, 0, 0], [-1, 0, 1, 1, 0]])):
        starts = [blocks.length(s) for s in (0, 1)]
        for s, start, n in zip((0, 1), starts, counts):
            blocks.reserve(s, start + n)
        plan = StepPlan([blocks.block_table(s) for s in (0, 1)], starts, counts)
        mask = None if trees is None else torch.tensor([[r] for t in trees for r in tree_rows(t)], dtype=torch.int32)
        meta, pos, ids = runner.meta(plan, ids=torch.randint(3, VOCAB, (sum(counts),)).tolist(), tree_mask=mask)
        hidden = torch.randn(sum(counts), 64).bfloat16()
        before, out = kv.clone(), []
        for fused in (True, False):
            kv.copy_(before)
            head.fused = fused
            assert (head._stack() is not None) == fused
            with torch.inference_mode():
                out.append((head(ids.long(), hidden, pos.long(), layer_kv, meta), kv.clone()))
        head.fused = True
        (o1, kv1), (o2, kv2) = out
        assert o1.abs().sum() > 0 and torch.equal(o1, o2) and torch.equal(kv1, kv2), (weights, kind, counts)
        kv.copy_(kv1)
