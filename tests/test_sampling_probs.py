"""sampling_probs against a row-by-row fp64 reference of temperature -> top-k -> top-p."""
import pytest
import torch

import eagle_kernels
from eagle_kernels.sampling import sampling_probs


def ref_row(logits, temperature, top_k, top_p):
    """One row: softmax(logits / T); keep the top_k most probable (ties -> lower id); of those keep each token
    whose preceding renormalised mass is < top_p; renormalise."""
    p = torch.softmax(logits.double() / temperature, dim=-1)
    order = sorted(range(len(p)), key=lambda i: (-float(p[i]), i))
    if 0 < top_k < len(p):
        order = order[:top_k]
    total = sum(float(p[i]) for i in order)
    kept, before = [], 0.0
    for i in order:
        if before >= top_p * total:
            break
        kept.append(i)
        before += float(p[i])
    out = torch.zeros_like(p)
    out[kept] = p[kept]
    return out / out.sum()


def ref_probs(logits, temperature, top_k, top_p):
    rows = logits.reshape(-1, logits.shape[-1])
    params = [torch.as_tensor(x).double().expand(rows.shape[0]) for x in (temperature, top_k, top_p)]
    return torch.stack([ref_row(rows[i], float(params[0][i]), int(params[1][i]), float(params[2][i]))
                        for i in range(rows.shape[0])]).reshape(logits.shape)


def top_p_between(logits, temperature, top_k, m):
    """A top_p strictly between the cumulative masses of the first m and m + 1 kept tokens, so that exactly
    m + 1 tokens survive with no rounding ambiguity."""
    p = torch.softmax(logits.double() / temperature, dim=-1).sort(descending=True).values
    if 0 < top_k < len(p):
        p = p[:top_k]
    cum = (p / p.sum()).cumsum(0)
    return float((cum[m - 1] + cum[m]) / 2) if m > 0 else float(cum[0] / 2)


def host(x):
    """The same parameter as host values (what the engine passes): a number or a (nested) list."""
    return x.tolist() if isinstance(x, torch.Tensor) else x


# Parameters as tensors (every row takes the full sort) and as host values (the host plans the cheapest path).
FORMS = pytest.mark.parametrize("form", [lambda x: x, host], ids=["tensor", "host"])


def check(out, ref):
    assert out.dtype == torch.float32 and out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, atol=1e-6, rtol=1e-5)
    assert torch.equal(out > 0, ref > 0), "support differs"
    torch.testing.assert_close(out.sum(-1), torch.ones(out.shape[:-1]), atol=1e-5, rtol=0)


@FORMS
def test_per_row_parameters_exact_truncation(form):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 500, generator=gen) * 2
    temperature = torch.tensor([1.0, 0.7, 1.3, 2.0, 0.5, 1.0])
    top_k = torch.tensor([0, 20, 500, 7, 0, 1])
    keep = [10, 5, 40, 3, 1, 0]  # tokens kept by top-p, minus one
    top_p = torch.tensor([top_p_between(logits[i], float(temperature[i]), int(top_k[i]), keep[i])
                          for i in range(6)])
    top_p[2] = 1.0  # top-k only on a disabled top-k: the full softmax
    out = sampling_probs(logits, form(temperature), form(top_k), form(top_p))
    check(out, ref_probs(logits, temperature, top_k, top_p))
    expected_support = [11, 6, 500, 4, 2, 1]
    assert (out > 0).sum(-1).tolist() == expected_support


@FORMS
def test_top_k_only_and_plain_softmax_paths(form):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 300, generator=gen)
    top_k = torch.tensor([5, 0, 1, 299])
    out = sampling_probs(logits, 0.8, form(top_k), 1.0)
    check(out, ref_probs(logits, 0.8, top_k, 1.0))
    assert (out > 0).sum(-1).tolist() == [5, 300, 1, 299]
    check(sampling_probs(logits, 1.5, 0, 1.0), torch.softmax(logits.double() / 1.5, -1))


def test_ties_keep_lowest_ids():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0, 1.0]])
    out = sampling_probs(logits, 1.0, 2, 1.0)
    assert (out[0] > 0).nonzero().flatten().tolist() == [1, 3]
    out = sampling_probs(logits, 1.0, 4, 1.0)
    assert (out[0] > 0).nonzero().flatten().tolist() == [1, 2, 3, 4]


@FORMS
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_leading_dims_broadcast_params_and_half_inputs(dtype, form):
    # Target distributions [B, N, V] with per-request parameters [B].
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(2, 3, 200, generator=gen) * 3).to(dtype)
    temperature, top_k, top_p = torch.tensor([0.6, 1.0]), torch.tensor([50, 0]), torch.tensor([0.9, 0.75])
    out = sampling_probs(logits, form(temperature), form(top_k), form(top_p))
    ref = ref_probs(logits.float().reshape(6, 200), temperature.repeat_interleave(3), top_k.repeat_interleave(3),
                    top_p.repeat_interleave(3)).reshape(2, 3, 200)
    check(out, ref)


@pytest.mark.parametrize("message,kwargs", [
    ("logits must be", dict(logits=torch.zeros(2, 5, dtype=torch.int64))),
    ("temperature must be > 0", dict(temperature=0.0)),
    ("temperature must be > 0", dict(temperature=[1.0, -1.0])),
    ("temperature must be > 0", dict(temperature=float("nan"))),
    ("top_p must be in", dict(top_p=0.0)),
    ("top_p must be in", dict(top_p=[0.5, 1.5])),
    ("top_k must be a scalar", dict(top_k=torch.tensor([1, 2, 3]))),
    ("top_k must be a scalar", dict(top_k=[1, 2, 3])),
    ("top_p must be a scalar", dict(top_p=[[0.5], [0.5]])),
    ("top_k must be a number", dict(top_k="3")),
])
def test_bad_inputs_raise(message, kwargs):
    args = dict(logits=torch.randn(2, 5), temperature=1.0, top_k=0, top_p=1.0) | kwargs
    with pytest.raises(ValueError, match=message):
        sampling_probs(**args)


def test_tensor_values_are_not_checked():
    # Checking a tensor's values would read it on the host: invalid values pass through (NaN rows).
    out = sampling_probs(torch.randn(2, 5), torch.tensor([1.0, -1.0]), 0, torch.tensor([0.5, 1.5]))
    assert out.shape == (2, 5)


@FORMS
def test_top_p_cut_far_down_the_order(form):
    # V > 1024: a peaked row cuts early, a flat row's cut lies past the first 1024 tokens.
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 3000, generator=gen)
    logits[0] *= 6
    logits[2] *= 0.01
    top_k, top_p = torch.tensor([0, 30, 0]), torch.tensor([0.8, 0.95, 0.9])
    for rows in (slice(0, 2), slice(0, 3)):
        out = sampling_probs(logits[rows], 1.0, form(top_k[rows]), form(top_p[rows]))
        check(out, ref_probs(logits[rows], 1.0, top_k[rows], top_p[rows]))
    assert (out[2] > 0).sum() > 1024


@FORMS
def test_top_p_ties_at_the_cut_keep_lowest_ids(form):
    # Integer logits: many tokens share the value at the cut; of those, the lowest ids survive.
    gen = torch.Generator().manual_seed(5)
    logits = torch.randint(-4, 3, (4, 1500), generator=gen).float()
    top_p = [top_p_between(logits[i], 1.0, 0, m) for i, m in enumerate([3, 250, 700, 1200])]
    out = sampling_probs(logits, 1.0, 0, form(torch.tensor(top_p)))
    check(out, ref_probs(logits, 1.0, 0, torch.tensor(top_p)))
    assert (out > 0).sum(-1).tolist() == [4, 251, 701, 1201]


def test_mixed_rows_host_plan_matches_full_sort():
    # One call, every kind of row: untouched, top-k only, top-k + top-p, top-p only (cut in / past 1024).
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(2, 3, 2000, generator=gen) * torch.tensor([3.0, 0.05, 1.0])[:, None]
    temperature = [[0.7, 1.0, 1.3], [1.0, 0.5, 2.0]]
    top_k = [[0, 40, 0], [1500, 0, 7]]
    top_p = [[1.0, 0.9, 0.95], [0.8, 0.6, 1.0]]
    planned = sampling_probs(logits, temperature, top_k, top_p)
    sorted_ = sampling_probs(logits, torch.tensor(temperature), torch.tensor(top_k), torch.tensor(top_p))
    ref = ref_probs(logits.reshape(6, -1), *(torch.tensor(x).flatten() for x in (temperature, top_k, top_p)))
    check(planned, ref.reshape(logits.shape))
    assert torch.equal(planned > 0, sorted_ > 0)
    torch.testing.assert_close(planned, sorted_, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("shape", [(1, 49152), (3, 7), (5, 8), (2, 3, 17), (4, 1), (3, 1000), (1, 4097)])
def test_argmax_is_torchs_first_maximum(shape):
    """eagle_kernels.argmax (the C++ op on fp32 CPU rows) against torch's max(-1).indices: ties (coarse values)
    go to the first index, a row of -inf to 0, a NaN counts as the maximum (the first one)."""
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=g) * 4).round()
    rows = x.view(-1, shape[-1])
    if rows.shape[0] > 1:
        rows[1] = float("-inf")
    if rows.shape[0] > 2 and shape[-1] > 5:
        rows[2, [2, 5]] = float("nan")
    got = eagle_kernels.argmax(x)
    assert got.dtype == torch.int64 and got.shape == shape[:-1]
    assert torch.equal(got, x.max(-1).indices)
    assert torch.equal(eagle_kernels.argmax(x.bfloat16()), x.bfloat16().max(-1).indices)  # torch's path


@pytest.mark.parametrize("scale", [0.02, 0.5, 2.0, 8.0])
def test_top_p_over_a_full_vocabulary_keeps_the_sorted_prefix(scale):
    """The CPU plan's radix select (eagle::top_p_probs) on 49k-token rows from flat to peaked: the kept set is
    exactly the sorted prefix, with the cut placed between two cumulative masses (no rounding ambiguity)."""
    gen = torch.Generator().manual_seed(int(scale * 100))
    logits = torch.randn(3, 49152, generator=gen) * scale
    p = torch.softmax(logits.double(), -1).sort(-1, descending=True)
    for m in (0, 7, 500, 30000):
        if p.values[:, m].min() < 1e-6:  # the cut's gap below fp32 resolution: the cut is ambiguous
            continue
        cum = p.values.cumsum(-1)
        top_p = [float((c[m - 1] + c[m]) / 2) if m else float(c[0] / 2) for c in cum]
        out = sampling_probs(logits, 1.0, 0, top_p)
        assert (out > 0).sum(-1).tolist() == [m + 1] * 3
        assert torch.equal(out > 0, torch.zeros_like(out, dtype=torch.bool).scatter_(1, p.indices[:, :m + 1], True))
        torch.testing.assert_close(out.sum(-1), torch.ones(3), atol=1e-5, rtol=0)


@pytest.mark.parametrize("scale", [0.02, 0.5, 4.0])
def test_top_k_then_top_p_over_a_full_vocabulary(scale):
    """The CPU plan's top-k (a radix select by counts): the k most probable, ties at the cut to the lowest ids
    (integer logits tie by the thousands), then top-p over them; against the fp64 reference."""
    gen = torch.Generator().manual_seed(int(scale * 100) + 1)
    logits = torch.randn(4, 49152, generator=gen) * scale
    logits[3] = torch.randint(-3, 2, (49152,), generator=gen).float()
    for k, top_p in ((1, 1.0), (40, 1.0), (50, 0.9), (3000, 0.95), (49151, 1.0)):
        out = sampling_probs(logits, 0.8, k, top_p)
        ref = ref_probs(logits, 0.8, k, top_p) if k in (40, 50) else None  # the fp64 reference sorts in Python
        if ref is not None:
            check(out, ref)
        kept = (out > 0).sum(-1)
        assert (kept <= k).all() and (top_p < 1.0 or (kept == k).all())
        order = torch.softmax(logits.double() / 0.8, -1).sort(dim=-1, descending=True, stable=True).indices
        if top_p == 1.0:  # exactly the sorted prefix of k, ties by id
            assert torch.equal(out > 0, torch.zeros_like(out, dtype=torch.bool).scatter_(1, order[:, :k], True))
