"""build_tree: the C++ op (CPU, or the CUDA op for CUDA tensors) against the naive reference.

Bytes moved = parents and sizes read + mask and depths written.
"""
import pytest
import torch

from eagle_kernels import build_tree
from eagle_kernels._ops import has_kernel
from kernel_refs_tree import batch_trees, random_bfs_parents, ref_build_tree

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SHAPES = {"B1-N64": (1, 64), "B16-N64": (16, 64), "B64-N64": (64, 64)}
if DEVICE.type == "cuda":
    SHAPES["B256-N128"] = (256, 128)
REFERENCE_SHAPES = {"B1-N64", "B16-N64"}  # the naive loops take ~20 ms per tree

IMPLS = ["native", "reference"]


def tree_bytes(B: int, N: int) -> int:
    W = (N + 31) // 32
    return 4 * (B * N + B) + 4 * (B * N * W + B * N)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_build_tree(bandwidth, shape, impl):
    B, N = SHAPES[shape]
    if impl == "reference" and shape not in REFERENCE_SHAPES:
        pytest.skip("the reference is too slow for this shape")
    if impl == "native" and DEVICE.type == "cuda" and not has_kernel("build_tree", DEVICE):
        pytest.skip("eagle_kernels._C was built without CUDA")
    gen = torch.Generator().manual_seed(0)
    parents, sizes = batch_trees([random_bfs_parents(N, gen) for _ in range(B)], N)
    if impl == "reference":
        bandwidth(lambda: ref_build_tree(parents, sizes), tree_bytes(B, N), torch.device("cpu"))
    else:
        parents, sizes = parents.to(DEVICE), sizes.to(DEVICE)
        bandwidth(lambda: build_tree(parents, sizes), tree_bytes(B, N), DEVICE)
