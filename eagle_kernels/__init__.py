"""EAGLE kernels: fused layer ops, tree-masked paged attention, top-k expansion, tree building, tree rejection sampling.

Public functions pick the implementation by device (Triton on CUDA, C++ / torch on CPU). Contracts:
DESIGN.md. This package knows nothing of `engine`.
"""
from ._ops import gpu_path, triton_on_cpu, unchecked
from .attention import paged_attention, write_kv
from .decoder import decoder_layers, decoder_layers_fit
from .draft import draft_chain, draft_chain_fit
from .expand import topk_expand
from .layer_ops import apply_rope, rms_norm, rope_write_kv, silu_and_mul
from .linear import linear
from .quant import embedding_q, linear_q
from .rejection import greedy_verdict, tree_accept_greedy, tree_accept_sample, verdict_summary
from .sampling import argmax, sample_keyed, sampling_probs
from .tree import TreeIndex, build_tree

__all__ = [
    "linear", "linear_q", "embedding_q", "rms_norm", "silu_and_mul", "apply_rope", "rope_write_kv", "paged_attention", "write_kv", "decoder_layers", "decoder_layers_fit", "draft_chain", "draft_chain_fit", "topk_expand", "sampling_probs", "sample_keyed", "argmax",
    "build_tree", "TreeIndex", "gpu_path", "triton_on_cpu", "unchecked", "tree_accept_greedy", "tree_accept_sample", "greedy_verdict", "verdict_summary",
]
