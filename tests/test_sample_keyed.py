"""eagle_kernels.sample_keyed: keyed exact draws from logits at a temperature. The C++ op against the float64 torch
reference on random rows of many shapes, spreads and temperatures, its edge rows (-inf, +inf, NaN, greedy rows),
its argument checks, and the draws' statistics (each position's token follows softmax(l / T); positions and seeds
are independent streams)."""
import pytest
import torch
from scipy.stats import chisquare

import eagle_kernels
from eagle_kernels.sampling import keyed_uniforms, sample_keyed_reference


def keyed_args(n, gen, temperatures=(0.0, 0.05, 0.3, 0.7, 1.0, 2.5)):
    t = torch.tensor(temperatures, dtype=torch.float32)[torch.randint(0, len(temperatures), (n,), generator=gen)]
    return t, torch.randint(-2**62, 2**62, (n,), generator=gen), torch.randint(0, 100000, (n,), generator=gen)


@pytest.mark.parametrize("V", [1, 2, 3, 17, 256, 4099, 49152])
@pytest.mark.parametrize("scale", [0.1, 2.0, 12.0])
def test_op_matches_the_reference(V, scale):
    gen = torch.Generator().manual_seed(V * 7 + int(scale * 10))
    logits = torch.randn(24, V, generator=gen) * scale + 30 * torch.rand(24, 1, generator=gen) - 15
    args = keyed_args(24, gen)
    got = eagle_kernels.sample_keyed(logits, *args)
    assert got.dtype == torch.int64 and got.shape == (24,)
    assert torch.equal(got, sample_keyed_reference(logits, *args))
    greedy = args[0] == 0
    assert torch.equal(got[greedy], eagle_kernels.argmax(logits[greedy]))


def test_crowded_rows_and_extreme_noise():
    """Hundreds of tokens within a few ulps of each other (the bounds' slack decides nothing), a vocabulary whose
    noise reaches the table's every bucket (2^20 tokens: u within 2^-20 of 1 and of 0), huge and tiny logits."""
    gen = torch.Generator().manual_seed(11)
    crowd = torch.full((6, 5000), 3.0) + torch.randint(-3, 4, (6, 5000), generator=gen) * 2.0 ** -21
    args = keyed_args(6, gen, (0.5, 1.0, 1e-3))
    assert torch.equal(eagle_kernels.sample_keyed(crowd, *args), sample_keyed_reference(crowd, *args))
    wide = torch.randn(2, 1 << 20, generator=gen)
    args = keyed_args(2, gen, (1.0, 4.0))
    assert torch.equal(eagle_kernels.sample_keyed(wide, *args), sample_keyed_reference(wide, *args))
    big = torch.randn(8, 3000, generator=gen) * 1e4
    args = keyed_args(8, gen, (1e-4, 1.0, 1e4))
    assert torch.equal(eagle_kernels.sample_keyed(big, *args), sample_keyed_reference(big, *args))


@pytest.mark.parametrize("V", [5, 300, 8192])
def test_columns_take_their_token_ids_noise(V):
    """ids: a draft vocabulary's columns (target ids) draw under the noise of those ids: the same column as the
    full vocabulary's draw when the other tokens are not allowed (-inf)."""
    gen = torch.Generator().manual_seed(V)
    ids = torch.randperm(4 * V, generator=gen)[:V].sort().values
    logits = torch.randn(12, V, generator=gen) * 2
    args = keyed_args(12, gen)
    got = eagle_kernels.sample_keyed(logits, *args, ids)
    assert torch.equal(got, sample_keyed_reference(logits, *args, ids))
    full = torch.full((12, 4 * V), float("-inf"))
    full[:, ids] = logits
    assert torch.equal(ids[got], eagle_kernels.sample_keyed(full, *args))
    with pytest.raises(ValueError, match="ids must be int64"):
        eagle_kernels.sample_keyed(logits, *args, ids[:-1])


def test_leading_dims_and_non_finite_rows():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 300, generator=gen)
    t, seeds, positions = (a.view(2, 3) for a in keyed_args(6, gen, (0.0, 0.8)))
    assert torch.equal(eagle_kernels.sample_keyed(logits, t, seeds, positions),
                       sample_keyed_reference(logits, t, seeds, positions))
    one = torch.full((4, 50), float("-inf"))
    one[torch.arange(4), torch.tensor([0, 7, 49, 7])] = -3.0
    rows = dict(temperatures=torch.full((4,), 0.9), seeds=torch.arange(4), positions=torch.arange(4))
    assert eagle_kernels.sample_keyed(one, *rows.values()).tolist() == [0, 7, 49, 7]
    odd = torch.randn(4, 20, generator=gen)
    odd[0, 5] = odd[0, 9] = float("nan")           # the first NaN, whatever the noise
    odd[1, 3] = odd[1, 12] = float("inf")          # the first +inf
    odd[2] = float("-inf")                         # nothing allowed: column 0, as the reference
    odd[3, 11] = float("nan")
    odd[3, 2] = float("inf")
    got = eagle_kernels.sample_keyed(odd, *rows.values())
    assert got.tolist() == [5, 3, 0, 11] == sample_keyed_reference(odd, *rows.values()).tolist()


def test_same_key_same_token_and_row_independence():
    """A row's token depends on its logits, temperature, seed and position only: not on the rows beside it."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(16, 1000, generator=gen)
    args = keyed_args(16, gen, (0.5, 1.0))
    batched = eagle_kernels.sample_keyed(logits, *args)
    alone = [eagle_kernels.sample_keyed(logits[i:i + 1], *(a[i:i + 1] for a in args)).item() for i in range(16)]
    assert batched.tolist() == alone
    assert not torch.equal(batched, eagle_kernels.sample_keyed(logits, args[0], args[1], args[2] + 1))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_draws_follow_the_tempered_softmax_over_positions_and_seeds(temperature):
    logits = torch.tensor([2.0, 1.6, 0.9, -0.3, -0.8, -2.0, float("-inf")])
    p = torch.softmax(logits.double() / temperature, -1)[:6]
    n = 60000
    t = torch.full((n,), temperature)
    for seeds, positions in ((torch.full((n,), 5), torch.arange(n)), (torch.arange(n) * 7919, torch.full((n,), 3))):
        got = eagle_kernels.sample_keyed(logits.expand(n, -1).contiguous(), t, seeds, positions)
        counts = torch.bincount(got, minlength=7).double()
        assert counts[6] == 0
        assert chisquare(counts[:6].numpy(), (p * n).numpy()).pvalue > 1e-3


def test_consecutive_positions_are_independent():
    """Pairs of draws at positions t, t + 1 of one seed: their joint frequencies are the product of p's."""
    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    n = 60000
    got = eagle_kernels.sample_keyed(logits.expand(n, -1).contiguous(), torch.ones(n), torch.full((n,), 99),
                                     torch.arange(n))
    pairs = torch.bincount(got[:-1] * 3 + got[1:], minlength=9).double()
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    expected = torch.outer(p, p).flatten()
    assert chisquare(pairs.numpy(), (expected / expected.sum() * (n - 1)).numpy()).pvalue > 1e-3


def test_uniforms_are_in_the_open_interval_and_spread():
    u = keyed_uniforms(torch.tensor([1, 2**40]), torch.tensor([0, 7]), 100000)
    assert u.dtype == torch.float64 and u.shape == (2, 100000)
    assert (u > 0).all() and (u < 1).all()
    hist = torch.histc(u.flatten(), bins=20, min=0, max=1)
    assert chisquare(hist.numpy()).pvalue > 1e-3


_L, _T, _I = torch.zeros(2, 4), torch.ones(2), torch.zeros(2, dtype=torch.long)


@pytest.mark.parametrize("args,message", [
    ((_L.double(), _T, _I, _I), "fp32"),
    ((_L, _T.double(), _I, _I), "temperatures"),
    ((_L, torch.ones(3), _I, _I), "temperatures"),
    ((_L, _T, torch.zeros(3, dtype=torch.long), _I), "seeds"),
    ((_L, _T, _I, _I.int()), "positions"),
])
def test_bad_arguments_raise(args, message):
    with pytest.raises(ValueError, match=message):
        eagle_kernels.sample_keyed(*args)
