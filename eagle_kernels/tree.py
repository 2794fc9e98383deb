"""Tree index of a batch of BFS-ordered draft trees (DESIGN.md, "build_tree").

The work runs in the C++ op `eagle::build_tree`: the CUDA kernel for CUDA tensors, the CPU kernel for CPU
tensors (inside `triton_on_cpu()` too). The torch reference lives in tests/kernel_refs_tree.py.
"""
import functools
from typing import NamedTuple

import torch

from ._ops import check_tree, check_tree_values, has_kernel, ops

CUDA_MAX_NODES = 4096  # csrc/cuda/launchers.h: kMaxTreeNodes


class TreeIndex(NamedTuple):
    mask: torch.Tensor    # int32 [B, N, W], W = ceil(N / 32): bit j % 32 of word j // 32 in row i
                          #   is set iff j is i or an ancestor of i (padding rows all zero)
    depths: torch.Tensor  # int32 [B, N]: root 0, padding 0


def build_tree(parents: torch.Tensor, sizes: torch.Tensor) -> TreeIndex:
    """parents: int32 [B, N] in BFS order (parents[:, 0] = -1, parents[b, i] < i), sizes: int32 [B].

    CPU tensors are validated in full (ValueError on a malformed tree); CUDA tensors are not checked
    element-wise (that would synchronise) and need a CUDA build of eagle_kernels._C.
    """
    _, N = check_tree(parents, sizes)
    if parents.is_cuda:
        if not _cuda_kernel():
            raise ValueError("build_tree on CUDA tensors needs eagle_kernels._C built with CUDA "
                             "(a CUDA torch and toolkit when running setup.py)")
        if N > CUDA_MAX_NODES:
            raise ValueError(f"build_tree on CUDA supports N <= {CUDA_MAX_NODES} nodes, got {N}")
    elif parents.device.type == "cpu":
        check_tree_values(parents, sizes)
    else:
        raise ValueError(f"build_tree supports CPU and CUDA tensors, got {parents.device}")
    return TreeIndex(*ops().build_tree(parents, sizes))


@functools.cache
def _cuda_kernel() -> bool:
    return has_kernel("build_tree", torch.device("cuda"))
