"""build_tree (C++ CPU op; CUDA op when a GPU is present) against the naive reference."""
import pytest
import torch

from eagle_kernels import TreeIndex, build_tree, triton_on_cpu
from kernel_refs_tree import batch_trees, chain_parents, random_bfs_parents, ref_build_tree

CUDA = torch.cuda.is_available()


def make_trees(B: int, N: int, shape: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """B trees padded to N nodes; sizes ragged for B > 1 (always including 1 and N)."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [N] if B == 1 else [N, 1] + torch.randint(1, N + 1, (B - 2,), generator=gen).tolist()
    if shape == "chain":
        trees = [chain_parents(n) for n in sizes]
    elif shape == "star":
        trees = [[-1] + [0] * (n - 1) for n in sizes]
    else:
        trees = [random_bfs_parents(n, gen, max_children=int(shape[-1])) for n in sizes]
    return batch_trees(trees, N)


def assert_tree_equal(out: TreeIndex, ref):
    assert TreeIndex._fields == ("mask", "depths") and len(out) == len(ref) == 2
    for name, got, want in zip(TreeIndex._fields, out, ref):
        assert got.dtype == torch.int32, name
        assert torch.equal(got.cpu(), want), f"{name} differs from the reference"


@pytest.mark.parametrize("shape", ["random2", "random4", "chain", "star"])
@pytest.mark.parametrize("N", [1, 33, 64])
@pytest.mark.parametrize("B", [1, 4])
def test_cpu_matches_reference(B, N, shape):
    parents, sizes = make_trees(B, N, shape, seed=B * 100 + N)
    out = build_tree(parents, sizes)
    assert out.mask.shape == (B, N, (N + 31) // 32) and out.depths.shape == (B, N)
    assert_tree_equal(out, ref_build_tree(parents, sizes))


def test_mask_high_bit_is_negative_int32():
    # Node 31 of a chain sets bit 31 of word 0 in every deeper row: the word reads as a negative int32.
    parents, sizes = batch_trees([chain_parents(40)], 40)
    mask = build_tree(parents, sizes).mask
    assert mask[0, 39, 0].item() == -1 and mask[0, 39, 1].item() == 0xFF
    assert mask[0, 30, 0].item() == 2 ** 31 - 1


def test_small_tree_and_padding():
    parents, sizes = batch_trees([[-1, 0, 0, 1, 1, 2]], 8)
    out = build_tree(parents, sizes)
    assert out.mask[0, :, 0].tolist() == [0b1, 0b11, 0b101, 0b1011, 0b10011, 0b100101, 0, 0]
    assert out.depths[0].tolist() == [0, 1, 1, 2, 2, 2, 0, 0]


def test_triton_on_cpu_keeps_the_cpp_op():
    parents, sizes = make_trees(4, 33, "random2", seed=5)
    with triton_on_cpu():
        assert_tree_equal(build_tree(parents, sizes), ref_build_tree(parents, sizes))
        with pytest.raises(ValueError, match="breaks BFS order"):
            build_tree(torch.tensor([[-1, 0, 2]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32))


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("N", [1, 64, 200])
def test_cuda_matches_reference(N):
    parents, sizes = make_trees(4, N, "random3", seed=N)
    out = build_tree(parents.cuda(), sizes.cuda())
    assert out.mask.is_cuda
    assert_tree_equal(out, ref_build_tree(parents, sizes))


def test_bad_arguments_raise_value_error():
    parents, sizes = batch_trees([[-1, 0, 0]], 4)
    with pytest.raises(ValueError, match="parents must be torch.int32"):
        build_tree(parents.long(), sizes)
    with pytest.raises(ValueError, match=r"sizes must have shape \[1\]"):
        build_tree(parents, sizes.repeat(2))
    with pytest.raises(ValueError, match="sizes is on meta"):
        build_tree(parents, sizes.to("meta"))
    with pytest.raises(ValueError, match="breaks BFS order"):
        build_tree(torch.tensor([[-1, 0, 2, -1]], dtype=torch.int32), sizes)
    with pytest.raises(ValueError, match="outside"):
        build_tree(parents, torch.tensor([5], dtype=torch.int32))
    with pytest.raises(ValueError, match="root"):
        build_tree(torch.tensor([[0, 0, 0, -1]], dtype=torch.int32), sizes)
