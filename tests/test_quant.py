"""Block-quantized weights (Q8_0, Q4_1): eagle::linear_q against its float64 reference on random shapes,
row invariance (bit-exact whatever the batch, threads or instruction set), the layout conversions against
gguf-py, argument errors, and the loader's --weights formats on the embedded model."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import eagle_kernels
from eagle_kernels import quant

QTYPES = ("q8_0", "q4_1")
SHAPES = [(1, 32, 16), (2, 192, 48), (3, 576, 32), (4, 96, 16), (5, 576, 96), (9, 1536, 80), (17, 64, 128), (40, 256, 16)]


def random_weight(N, K, gen):
    # rows of different scales, some blocks constant (d = 0 for Q4_1) and some all-zero
    w = torch.randn(N, K, generator=gen) * (0.1 + 3 * torch.rand(N, 1, generator=gen))
    w[0, :32] = 0.0
    if N > 1 and K >= 64:
        w[1, 32:64] = 0.25
    return w


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("M,K,N", SHAPES)
def test_linear_q_matches_reference(qtype, M, K, N):
    gen = torch.Generator().manual_seed(M * 1000 + K + N)
    data = quant.quantize(random_weight(N, K, gen), qtype)
    x = torch.randn(M, K, generator=gen) * (1 + 4 * torch.rand(M, 1, generator=gen))
    if K >= 64:
        x[0, -32:] = 0.0  # an all-zero activation block (xd = 0)
    for dtype, tol in ((torch.float32, 2e-6), (torch.bfloat16, 8e-3)):
        xx = x.to(dtype)
        y = eagle_kernels.linear_q(xx, data, qtype)
        assert y.dtype == dtype and y.shape == (M, N)
        ref = quant.ref_linear_q(xx, data, qtype)
        err = ((y.double() - ref).abs() / (ref.abs() + ref.abs().mean())).max().item()
        assert err < tol, (dtype, err)


@pytest.mark.parametrize("qtype", QTYPES)
def test_linear_q_rows_do_not_depend_on_the_batch(qtype):
    """Each output row is bit-identical alone, in any batch, in any position, with 1 or 2 threads."""
    gen = torch.Generator().manual_seed(7)
    data = quant.quantize(random_weight(208, 576, gen), qtype)
    x = torch.randn(37, 576, generator=gen).bfloat16()
    full = eagle_kernels.linear_q(x, data, qtype)
    alone = torch.cat([eagle_kernels.linear_q(x[i:i + 1], data, qtype) for i in range(len(x))])
    assert torch.equal(full, alone)
    perm = torch.randperm(len(x), generator=gen)
    assert torch.equal(eagle_kernels.linear_q(x[perm], data, qtype), full[perm])
    for m in (2, 3, 4, 5, 8, 13):
        assert torch.equal(eagle_kernels.linear_q(x[:m], data, qtype), full[:m])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(eagle_kernels.linear_q(x, data, qtype), full)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("M,K,N", SHAPES[:6])
def test_linear_q_out_dtype(qtype, M, K, N):
    """bf16 x with fp32 out (an LM head's logits) is bit for bit the fp32 result of x.float(): the same int8
    blocks either way, no bf16 rounding of the outputs; fp32 x with bf16 out is that result rounded."""
    gen = torch.Generator().manual_seed(M + K + N)
    data = quant.quantize(random_weight(N, K, gen), qtype)
    x = torch.randn(M, K, generator=gen).bfloat16()
    y = eagle_kernels.linear_q(x, data, qtype, torch.float32)
    assert y.dtype == torch.float32 and torch.equal(y, eagle_kernels.linear_q(x.float(), data, qtype))
    assert torch.equal(eagle_kernels.linear_q(x.float(), data, qtype, torch.bfloat16), y.bfloat16())
    assert torch.equal(eagle_kernels.linear_q(x[None], data, qtype, torch.float32)[0], y)  # the reshaping path
    with pytest.raises(ValueError, match="out_dtype"):
        eagle_kernels.linear_q(x, data, qtype, torch.float16)


_SCRIPT = """
import sys, torch
from eagle_kernels import linear_q, quant
gen = torch.Generator().manual_seed(3)
out = []
for qtype in ("q8_0", "q4_1"):
    for M, K, N in ((1, 576, 64), (3, 1536, 48), (9, 160, 128), (16, 576, 32), (37, 64, 48)):
        data = quant.quantize(torch.randn(N, K, generator=gen), qtype)
        x = torch.randn(M, K, generator=gen)
        out += [linear_q(x, data, qtype), linear_q(x.bfloat16(), data, qtype)]
torch.save(out, sys.argv[1])
"""


def test_linear_q_same_bits_on_every_instruction_set(tmp_path):
    """The default (AMX tiles from 16 rows where the CPU has them, else AVX-512 VNNI), EAGLE_CPU_AMX=0 (VNNI
    only) and EAGLE_CPU_AVX512=0 (the AVX2 kernels) compute the same chain, bit for bit. On a CPU without one
    of them the runs fall back to the same kernels and still must agree."""
    results = []
    for i, flags in enumerate(({}, {"EAGLE_CPU_AMX": "0"}, {"EAGLE_CPU_AVX512": "0"})):
        out = tmp_path / f"out{i}.pt"
        env = {k: v for k, v in os.environ.items() if k not in ("EAGLE_CPU_AMX", "EAGLE_CPU_AVX512")}
        subprocess.run([sys.executable, "-c", _SCRIPT, str(out)], check=True, env={**env, **flags})
        results.append(torch.load(out))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


@pytest.mark.parametrize("qtype", QTYPES)
def test_quantize_round_trip(qtype):
    gen = torch.Generator().manual_seed(11)
    w = random_weight(64, 256, gen)
    back = quant.dequantize(quant.quantize(w, qtype), qtype)
    blocks, err = w.reshape(64, -1, 32), (back - w).reshape(64, -1, 32).abs().amax(-1)
    step = blocks.abs().amax(-1) / 127 if qtype == "q8_0" else (blocks.amax(-1) - blocks.amin(-1)) / 15
    assert (err <= step * 0.5 * 1.01 + 1e-3 * blocks.abs().amax(-1)).all()   # half a step, fp16 scales
    assert torch.equal(back[0, :32], torch.zeros(32)) and torch.allclose(back[1, 32:64], torch.full((32,), 0.25), atol=1e-3)


@pytest.mark.parametrize("qtype", QTYPES)
def test_from_gguf_keeps_gguf_values(qtype):
    """GGUF blocks (made by gguf-py's own quantizer) rearranged: the same values as gguf-py dequantizes."""
    gguf = pytest.importorskip("gguf")
    kind = getattr(gguf.GGMLQuantizationType, qtype.upper())
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((32, 192)) * rng.uniform(0.1, 3, (32, 1))).astype(np.float32)
    blocks = gguf.quants.quantize(w, kind)                                   # uint8 [32, 6 * block bytes]
    ours = quant.dequantize(quant.from_gguf(torch.from_numpy(np.array(blocks)), qtype), qtype)
    assert torch.equal(ours, torch.from_numpy(np.array(gguf.quants.dequantize(blocks, kind), dtype=np.float32)))


@pytest.mark.parametrize("qtype", QTYPES)
def test_embedding_q_rows(qtype):
    gen = torch.Generator().manual_seed(2)
    data = quant.quantize(torch.randn(48, 128, generator=gen), qtype)
    ids = torch.tensor([[3, 47], [0, 19], [19, 16]])
    rows = eagle_kernels.embedding_q(ids, data, qtype, torch.bfloat16)
    assert rows.shape == (3, 2, 128) and rows.dtype == torch.bfloat16
    assert torch.equal(rows, quant.dequantize(data, qtype)[ids].bfloat16())
    ids = torch.randint(0, 48, (40,), generator=gen)
    for dtype in (torch.bfloat16, torch.float32):  # the C++ op against the torch path it replaces
        assert torch.equal(eagle_kernels.embedding_q(ids, data, qtype, dtype), quant.rows(data, qtype, ids).to(dtype))
    with pytest.raises(ValueError, match="outside"):
        eagle_kernels.embedding_q(torch.tensor([48]), data, qtype, torch.bfloat16)


def test_linear_q_bad_arguments():
    data = quant.quantize(torch.randn(16, 128), "q4_1")
    x = torch.randn(2, 128)
    with pytest.raises(ValueError, match="qtype"):
        eagle_kernels.linear_q(x, data, "q5_0")
    with pytest.raises(ValueError, match="uint8"):
        eagle_kernels.linear_q(x, data[:, :-1].contiguous(), "q4_1")
    with pytest.raises(ValueError, match="uint8"):
        eagle_kernels.linear_q(torch.randn(2, 96), data, "q4_1")
    with pytest.raises(ValueError, match="multiple of 32"):
        eagle_kernels.linear_q(torch.randn(2, 100), data, "q4_1")
    with pytest.raises(ValueError, match="bf16/fp32"):
        eagle_kernels.linear_q(x.half(), data, "q4_1")
    with pytest.raises(ValueError, match="groups of 16"):
        quant.quantize(torch.randn(8, 32), "q8_0")
    with pytest.raises(ValueError):  # the op's own checks, behind the launcher's
        eagle_kernels._ops.ops().linear_q(x, data, 5)


# ----------------------------------------------------------------------------- argmax_q8 (greedy LM heads)

def _argmax_ref(x, data):
    return eagle_kernels.argmax(eagle_kernels.linear_q(x, data, "q8_0", torch.float32))


def _negative_scales(data, gen):
    """The same weights with d and q negated in about half the (row, block)s (quantize's d are never negative,
    a GGUF's may be): the logits keep their values, the bounds take the other side of each such block."""
    d, _, q = quant._fields(data, "q8_0")
    flip = torch.rand(d.shape, generator=gen) < 0.5
    return quant._pack(torch.where(flip, -d, d), None, torch.where(flip[..., None], -q, q))


def test_argmax_planes_hold_the_top_five_bits():
    gen = torch.Generator().manual_seed(5)
    data = quant.quantize(random_weight(64, 96, gen), "q8_0")
    planes, rows, dmax = quant.argmax_planes(data)
    d, _, q = quant._fields(data, "q8_0")                                           # q: [N, nb, 32]
    G, nb = 4, 3
    p = planes.reshape(G, nb, 352)
    nib = p[..., 32:288].reshape(G, nb, 4, 16, 4).int()
    low = torch.cat([nib & 15, nib >> 4], 2)                                         # [G, nb, 8, row, 4]
    masks = p[..., 288:].reshape(G, nb, 8, 8).int()
    bit4 = ((masks[..., None] >> torch.arange(8)) & 1).reshape(G, nb, 8, 16, 4)
    u = (low + 16 * bit4).permute(0, 3, 1, 2, 4).reshape(64, nb, 32)
    assert torch.equal(u, (q + 128) >> 3)
    assert torch.equal(p[..., :32].contiguous().view(torch.float16).transpose(1, 2).reshape(64, nb), d)
    assert torch.equal(dmax, d.float().abs().amax(0))
    assert torch.equal(rows[:, :6].contiguous().view(torch.float16), d)
    assert torch.equal(rows[:, 6:].view(torch.int8).reshape(64, nb, 32).int(), q)


def _random_head(seed: int, groups: int, rows: int, spread: float):
    """A random Q8_0 weight [16 * (1 .. groups - 1), 32 * (1 .. 19)] (odd seeds: negative scales in about half
    its blocks) and 1 .. rows - 1 bf16 x rows of random scales -> (data, x, the generator)."""
    gen = torch.Generator().manual_seed(seed)
    N = 16 * int(torch.randint(1, groups, (), generator=gen))
    K = 32 * int(torch.randint(1, 20, (), generator=gen))
    M = int(torch.randint(1, rows, (), generator=gen))
    data = quant.quantize(random_weight(N, K, gen), "q8_0")
    if seed % 2:
        data = _negative_scales(data, gen)
    x = (torch.randn(M, K, generator=gen) * (0.1 + spread * torch.rand(M, 1, generator=gen))).bfloat16()
    return data, x, gen


@pytest.mark.parametrize("seed", range(12))
def test_argmax_q8_is_the_argmax_of_the_logits(seed):
    """Random shapes and scales, 1-9 rows: the index argmax_rows picks from linear_q's fp32 logits."""
    data, x, _ = _random_head(100 + seed, 160, 10, 5)
    assert torch.equal(quant.argmax_q8(x, data, *quant.argmax_planes(data)), _argmax_ref(x, data))


def _keyed(M, gen, temperatures=(0.0, 0.2, 0.7, 1.0, 3.0)):
    t = torch.tensor(temperatures, dtype=torch.float32)[torch.randint(0, len(temperatures), (M,), generator=gen)]
    return t, torch.randint(0, 2**62, (M,), generator=gen), torch.randint(0, 10**6, (M,), generator=gen)


@pytest.mark.parametrize("seed", range(12))
def test_argmax_q8_keyed_is_the_keyed_draw_of_the_logits(seed):
    """With temperatures, seeds and positions: sample_keyed's draw from linear_q's fp32 logits (temperature 0:
    their argmax), 1-10 rows (past 8: the full product), whatever the bounds' slack."""
    data, x, gen = _random_head(300 + seed, 400, 11, 8)
    keyed = _keyed(len(x), gen)
    want = eagle_kernels.sample_keyed(eagle_kernels.linear_q(x, data, "q8_0", torch.float32), *keyed)
    assert torch.equal(quant.argmax_q8(x, data, *quant.argmax_planes(data), keyed=keyed), want)


def test_argmax_q8_keyed_crowds_and_checks():
    """A crowd of near-copies within the bounds' slack at every temperature, a non-finite x row, and the keyed
    arguments' checks."""
    gen = torch.Generator().manual_seed(17)
    N, K = 2048, 256
    base = torch.randn(K, generator=gen)
    data = quant.quantize(base + 0.004 * torch.randn(N, K, generator=gen), "q8_0")
    parts = quant.argmax_planes(data)
    x = torch.stack([base, -base, torch.randn(K, generator=gen), base]).bfloat16()
    x[3, 9] = float("nan")
    for temperature in (0.01, 0.5, 2.0):
        keyed = (torch.full((4,), temperature), torch.arange(4) * 31, torch.arange(4) + 100)
        want = eagle_kernels.sample_keyed(eagle_kernels.linear_q(x, data, "q8_0", torch.float32), *keyed)
        assert torch.equal(quant.argmax_q8(x, data, *parts, keyed=keyed), want)
    op = eagle_kernels._ops.ops().argmax_q8
    with pytest.raises(ValueError, match="go together"):
        op(x, data, *parts, torch.ones(4), None, None)
    with pytest.raises(ValueError, match="temperatures must"):
        op(x, data, *parts, torch.ones(3), torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="seeds and positions"):
        op(x, data, *parts, torch.ones(4), torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.int32))


def test_argmax_q8_ties_and_crowds():
    """Equal maxima go to the lowest index; hundreds of rows within the bounds' slack of the maximum (each
    differing from one row in a few low bits) are all told apart exactly."""
    gen = torch.Generator().manual_seed(7)
    N, K = 1024, 256
    base = torch.randn(K, generator=gen)
    w = base + 0.004 * torch.randn(N, K, generator=gen)                   # a crowd of near-copies
    w[700] = w[300]
    data = quant.quantize(w, "q8_0")
    x = torch.stack([base, -base, torch.randn(K, generator=gen)]).bfloat16()
    got = quant.argmax_q8(x, data, *quant.argmax_planes(data))
    assert torch.equal(got, _argmax_ref(x, data))
    flipped = _negative_scales(data, gen)
    assert torch.equal(quant.argmax_q8(x, flipped, *quant.argmax_planes(flipped)), got)
    twin = data.clone()                                                   # the winner's row copied lower down
    win = int(got[0])
    low = (win // 16) * 16 + (1 if win % 16 == 0 else 0)
    if low != win:
        d, _, q = quant._fields(data, "q8_0")
        d[low], q[low] = d[win], q[win]
        twin = quant._pack(d, None, q)
        assert int(quant.argmax_q8(x[:1], twin, *quant.argmax_planes(twin))) == min(low, win) == int(_argmax_ref(x[:1], twin))


def test_argmax_q8_non_finite():
    """A non-finite x or scale takes every logit (argmax_rows' rule: a NaN is the maximum)."""
    gen = torch.Generator().manual_seed(9)
    data = quant.quantize(random_weight(64, 64, gen), "q8_0")
    x = torch.randn(3, 64, generator=gen).bfloat16()
    x[1, 5] = float("inf")
    x[2, 7] = float("nan")
    assert torch.equal(quant.argmax_q8(x, data, *quant.argmax_planes(data)), _argmax_ref(x, data))
    d, _, q = quant._fields(data, "q8_0")
    d[37, 1] = float("inf")
    bad = quant._pack(d, None, q)
    assert torch.equal(quant.argmax_q8(x, bad, *quant.argmax_planes(bad)), _argmax_ref(x, bad))


def test_argmax_q8_bad_arguments():
    data = quant.quantize(torch.randn(32, 64), "q8_0")
    planes, rows, dmax = quant.argmax_planes(data)
    x = torch.randn(2, 64).bfloat16()
    op = eagle_kernels._ops.ops().argmax_q8
    with pytest.raises(ValueError, match="planes"):
        op(x, data, planes[:1].contiguous(), rows, dmax)
    with pytest.raises(ValueError, match="rows"):
        op(x, data, planes, rows[:16].contiguous(), dmax)
    with pytest.raises(ValueError, match="dmax"):
        op(x, data, planes, rows, dmax[:1].contiguous())
    with pytest.raises(ValueError, match="w must"):
        op(torch.randn(2, 96).bfloat16(), data, planes, rows, dmax)
    with pytest.raises(ValueError, match="bf16"):
        op(x.float(), data, planes, rows, dmax)
    assert torch.equal(quant.argmax_q8(x.float(), data, planes, rows, dmax), _argmax_ref(x.float(), data))


_ARGMAX_SCRIPT = """
import sys, torch
from eagle_kernels import quant
gen = torch.Generator().manual_seed(4)
out = []
for M, K, N in ((1, 576, 4096), (3, 192, 800), (8, 64, 48), (5, 256, 1024), (2, 320, 2048), (4, 576, 1024),
                (3, 96, 4000)):
    w = torch.randn(N, K, generator=gen) * 0.05
    if N == 1024:  # a crowd of near-copies: hundreds of rows computed exactly
        w = w[:1] + 0.002 * torch.randn(N, K, generator=gen)
    data = quant.quantize(w, "q8_0")
    if N == 4000:  # negative scales in about half the (row, block)s: the bounds take the other side there
        d, _, q = quant._fields(data, "q8_0")
        flip = torch.rand(d.shape, generator=gen) < 0.5
        data = quant._pack(torch.where(flip, -d, d), None, torch.where(flip[..., None], -q, q))
    x = torch.randn(M, K, generator=gen).bfloat16() * 4
    if N == 1024:
        x[0] = w[0].bfloat16() * 4
    parts = quant.argmax_planes(data)
    out.append(quant.argmax_q8(x, data, *parts))
    keyed = (torch.rand(M, generator=gen) * 2, torch.randint(0, 2**40, (M,), generator=gen), torch.arange(M))
    out.append(quant.argmax_q8(x, data, *parts, keyed=keyed))
torch.save(out, sys.argv[1])
"""


def test_argmax_q8_same_on_every_instruction_set(tmp_path):
    """The AVX-512 VNNI and the AVX2 (EAGLE_CPU_AVX512=0) bound kernels pick the same tokens (both exact), for
    1-8 x rows, negative scales among them, greedy and keyed."""
    results = []
    for i, flags in enumerate(({}, {"EAGLE_CPU_AVX512": "0"})):
        out = tmp_path / f"out{i}.pt"
        env = {k: v for k, v in os.environ.items() if k not in ("EAGLE_CPU_AMX", "EAGLE_CPU_AVX512")}
        subprocess.run([sys.executable, "-c", _ARGMAX_SCRIPT, str(out)], check=True, env={**env, **flags})
        results.append(torch.load(out))
    assert all(torch.equal(a, b) for a, b in zip(*results))


# ----------------------------------------------------------------------------- the loader's formats

def _linears(model):
    return {name: (type(m).__name__, getattr(m, "qtype", None)) for name, m in model.named_modules()
            if name.endswith(("_proj", "lm_head", "embed_tokens"))}


def test_loader_weight_formats():
    from engine.loader import load_model
    from engine.model import QLinear
    auto, cfg, _ = load_model("smollm2-135m", torch.bfloat16, weights="auto")
    kinds = _linears(auto)
    assert kinds["layers.0.self_attn.qkv_proj"] == ("QLinear", "q4_1")
    assert kinds["layers.29.mlp.down_proj"] == ("QLinear", "q4_1")
    assert kinds["embed_tokens"] == ("QEmbedding", "q8_0") and kinds["lm_head"] == ("QLinear", "q8_0")
    assert auto.lm_head.qweight is auto.embed_tokens.qweight               # tied, one copy
    dense, _, _ = load_model("smollm2-135m", torch.float32, weights="bf16")
    assert all(kind == "Linear" or kind == "Embedding" for kind, _ in _linears(dense).values())
    # the kept blocks hold exactly the values the dequantizing loader produces
    for name in ("layers.3.self_attn.qkv_proj", "layers.7.mlp.gate_up_proj", "lm_head"):
        q, d = auto.get_submodule(name), dense.get_submodule(name)
        assert torch.equal(quant.dequantize(q.qweight, q.qtype), d.weight), name
    q8, _, _ = load_model("smollm2-135m", torch.bfloat16, weights="q8_0")
    assert {qtype for _, qtype in _linears(q8).values()} == {"q8_0"}
    assert isinstance(q8.layers[0].mlp.down_proj, QLinear)
    # a greedy step's tokens from the tied Q8_0 LM head (argmax_q8) are the logits' argmax, on hidden states
    # of the model's own final norm (the real logit spread, where a few rows crowd the maximum)
    emb = auto.embed_tokens(torch.arange(0, 49152, 97))
    feature = auto.norm(emb + auto.embed_tokens(torch.arange(5, 49152, 97)))
    assert torch.equal(auto.tokens(feature), eagle_kernels.argmax(auto.logits(feature)))
    for rows in (slice(0, 1), slice(1, 4), slice(4, 12)):  # keyed draws at temperature 0.7, one to eight rows
        f = feature[rows]
        keyed = (torch.full((len(f),), 0.7), torch.arange(len(f)) + 5, torch.arange(len(f)) * 3)
        assert torch.equal(auto.tokens(f, keyed), eagle_kernels.sample_keyed(auto.logits(f), *keyed))


def test_loader_weights_errors():
    from engine.loader import load_model
    with pytest.raises(ValueError, match="weights must be one of"):
        load_model("smollm2-135m", weights="q3")
    with pytest.raises(ValueError, match="CPU only"):
        load_model("smollm2-135m", weights="q4", device="cuda")


@pytest.mark.parametrize("weights", ["q4", "q8_0"])
def test_quantized_hf_checkpoint_speculates_losslessly(tmp_path, weights):
    """A safetensors checkpoint quantized at load: its linears run on blocks, and speculation reproduces vanilla's
    greedy tokens: SpS from the first 6 of 8 layers (accepted often: paths of several lengths mix) and EAGLE-3
    (a random head reading the quantized embedding)."""
    from engine.llm import LLM
    from engine.model import QEmbedding, QLinear
    from engine.scheduler import SamplingParams
    from tests.conftest import write_tiny_llama
    from tests.test_speculative_sampling import write_tokenizer
    hf = write_tiny_llama(tmp_path, seed=3, vocab_size=96, num_hidden_layers=8)
    with torch.no_grad():
        hf.lm_head.weight.mul_(8.0)
    hf.save_pretrained(str(tmp_path), safe_serialization=True)
    write_tokenizer(tmp_path, 96)
    llm = LLM(str(tmp_path), "bfloat16", device="cpu", kv_cache_gb=0.02, block_size=8, max_batch=4, weights=weights)
    assert isinstance(llm.model.layers[0].mlp.gate_up_proj, QLinear) and isinstance(llm.model.lm_head, QLinear)
    assert isinstance(llm.model.embed_tokens, QEmbedding)
    prompts = [[1, 5, 9, 11, 4], [1, 7], [1, 3, 3, 3, 4, 5]]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    llm.set_method("vanilla")
    vanilla = [s.output_ids for s in llm.generate(prompts, params)[0]]
    for method, args in (("sps", {"draft": "early-exit:6", "draft_len": 3}),
                         ("eagle3", {"head": "random", "depth": 3, "topk": 3, "tree_tokens": 8})):
        llm.set_method(method, args)
        seqs, stats = llm.generate(prompts, params)
        assert [s.output_ids for s in seqs] == vanilla, method
        assert llm.scheduler.blocks.num_free == llm.scheduler.blocks.num_blocks
        if method == "sps":
            assert stats.as_dict()["tau"] > 1.1
