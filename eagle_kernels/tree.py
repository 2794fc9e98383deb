"""Tree index of a batch of BFS-ordered draft trees (DESIGN.md, "build_tree").

The work runs in the C++ op `eagle::build_tree` (CPU, and CUDA in CUDA builds); the torch reference
lives in tests/kernel_refs_tree.py.
"""
from typing import NamedTuple

import torch

from ._ops import check_tree, has_kernel, ops


class TreeIndex(NamedTuple):
    mask: torch.Tensor          # int32 [B, N, W], W = ceil(N / 32): bit j % 32 of word j // 32 in row i
                                #   is set iff j is i or an ancestor of i (padding rows all zero)
    depths: torch.Tensor        # int32 [B, N]: root 0, padding 0
    retrieve: torch.Tensor      # int32 [B, N, N]: row k = root-to-leaf path of the k-th leaf in index order
    num_leaves: torch.Tensor    # int32 [B]
    first_child: torch.Tensor   # int32 [B, N], -1 where none
    next_sibling: torch.Tensor  # int32 [B, N], -1 where none


def build_tree(parents: torch.Tensor, sizes: torch.Tensor) -> TreeIndex:
    """parents: int32 [B, N] in BFS order (parents[:, 0] = -1, parents[b, i] < i), sizes: int32 [B].

    CPU tensors are validated in full (ValueError on a malformed tree); CUDA tensors are not checked
    element-wise (that would synchronise). A CUDA tensor without a CUDA build of the extension
    round-trips through the CPU op.
    """
    check_tree(parents, sizes)
    if parents.device.type == "cpu" or has_kernel("build_tree", parents.device):
        return TreeIndex(*ops().build_tree(parents, sizes))
    out = ops().build_tree(parents.cpu(), sizes.cpu())
    return TreeIndex(*(t.to(parents.device, non_blocking=True) for t in out))
