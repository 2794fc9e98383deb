"""eagle_kernels.sample_keyed: keyed exact draws. The C++ op against the float64 torch reference on random rows of
many shapes and sharpness, its edge rows, its argument checks, and the draws' statistics (each position's token
follows p; positions and seeds are independent streams)."""
import pytest
import torch
from scipy.stats import chisquare

import eagle_kernels
from eagle_kernels.sampling import keyed_uniforms, sample_keyed_reference


def rows(n, V, scale, gen):
    return torch.softmax(torch.randn(n, V, generator=gen, dtype=torch.float64) * scale, -1).float()


@pytest.mark.parametrize("V", [1, 2, 3, 17, 256, 4099, 49152])
@pytest.mark.parametrize("scale", [0.1, 2.0, 12.0])
def test_op_matches_the_reference(V, scale):
    gen = torch.Generator().manual_seed(V * 7 + int(scale * 10))
    p = rows(24, V, scale, gen)
    seeds = torch.randint(-2**62, 2**62, (24,), generator=gen)
    positions = torch.randint(0, 100000, (24,), generator=gen)
    got = eagle_kernels.sample_keyed(p, seeds, positions)
    assert got.dtype == torch.int64 and got.shape == (24,)
    assert torch.equal(got, sample_keyed_reference(p, seeds, positions))


@pytest.mark.parametrize("V", [5, 300, 8192])
def test_columns_take_their_token_ids_noise(V):
    """ids: a draft vocabulary's columns (target ids) draw under the noise of those ids: the same column as the
    full vocabulary's draw when the other tokens have no mass."""
    gen = torch.Generator().manual_seed(V)
    ids = torch.randperm(4 * V, generator=gen)[:V].sort().values
    p = rows(12, V, 2.0, gen)
    seeds, positions = torch.randint(0, 2**50, (12,), generator=gen), torch.randint(0, 9999, (12,), generator=gen)
    got = eagle_kernels.sample_keyed(p, seeds, positions, ids)
    assert torch.equal(got, sample_keyed_reference(p, seeds, positions, ids))
    full = torch.zeros(12, 4 * V)
    full[:, ids] = p
    assert torch.equal(ids[got], eagle_kernels.sample_keyed(full, seeds, positions))
    with pytest.raises(ValueError, match="ids must be int64"):
        eagle_kernels.sample_keyed(p, seeds, positions, ids[:-1])


def test_leading_dims_zero_rows_and_nan():
    gen = torch.Generator().manual_seed(0)
    p = rows(6, 300, 3.0, gen).view(2, 3, 300)
    seeds, positions = torch.arange(6).view(2, 3), torch.arange(10, 16).view(2, 3)
    assert torch.equal(eagle_kernels.sample_keyed(p, seeds, positions), sample_keyed_reference(p, seeds, positions))
    one_hot = torch.zeros(4, 50)
    one_hot[torch.arange(4), torch.tensor([0, 7, 49, 7])] = 1
    assert eagle_kernels.sample_keyed(one_hot, torch.arange(4), torch.arange(4)).tolist() == [0, 7, 49, 7]
    nan = rows(1, 20, 1.0, gen)
    nan[0, 5] = nan[0, 9] = float("nan")
    assert eagle_kernels.sample_keyed(nan, torch.tensor([1]), torch.tensor([2])).tolist() == [5]


def test_same_key_same_token_and_row_independence():
    """A row's token depends on its probabilities, seed and position only: not on the rows beside it."""
    gen = torch.Generator().manual_seed(3)
    p = rows(16, 1000, 1.0, gen)
    seeds, positions = torch.randint(0, 2**40, (16,), generator=gen), torch.randint(0, 999, (16,), generator=gen)
    batched = eagle_kernels.sample_keyed(p, seeds, positions)
    alone = [eagle_kernels.sample_keyed(p[i:i + 1], seeds[i:i + 1], positions[i:i + 1]).item() for i in range(16)]
    assert batched.tolist() == alone
    assert not torch.equal(batched, eagle_kernels.sample_keyed(p, seeds, positions + 1))


def test_draws_follow_p_over_positions_and_seeds():
    p = torch.tensor([0.46, 0.3, 0.15, 0.05, 0.03, 0.01])
    n = 60000
    for seeds, positions in ((torch.full((n,), 5), torch.arange(n)), (torch.arange(n) * 7919, torch.full((n,), 3))):
        got = eagle_kernels.sample_keyed(p.expand(n, -1).contiguous(), seeds, positions)
        counts = torch.bincount(got, minlength=6).double()
        assert chisquare(counts.numpy(), (p.double() / p.double().sum() * n).numpy()).pvalue > 1e-3


def test_consecutive_positions_are_independent():
    """Pairs of draws at positions t, t + 1 of one seed: their joint frequencies are the product of p's."""
    p = torch.tensor([0.5, 0.3, 0.2])
    n = 60000
    got = eagle_kernels.sample_keyed(p.expand(n, -1).contiguous(), torch.full((n,), 99), torch.arange(n))
    pairs = torch.bincount(got[:-1] * 3 + got[1:], minlength=9).double()
    expected = torch.outer(p, p).flatten().double()
    assert chisquare(pairs.numpy(), (expected / expected.sum() * (n - 1)).numpy()).pvalue > 1e-3


def test_uniforms_are_in_the_open_interval_and_spread():
    u = keyed_uniforms(torch.tensor([1, 2**40]), torch.tensor([0, 7]), 100000)
    assert u.dtype == torch.float64 and u.shape == (2, 100000)
    assert (u > 0).all() and (u < 1).all()
    hist = torch.histc(u.flatten(), bins=20, min=0, max=1)
    assert chisquare(hist.numpy()).pvalue > 1e-3


@pytest.mark.parametrize("args,message", [
    ((torch.zeros(2, 4, dtype=torch.float64), torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long)), "fp32"),
    ((torch.zeros(2, 4), torch.zeros(3, dtype=torch.long), torch.zeros(2, dtype=torch.long)), "seeds"),
    ((torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.int32)), "positions"),
])
def test_bad_arguments_raise(args, message):
    with pytest.raises(ValueError, match=message):
        eagle_kernels.sample_keyed(*args)
