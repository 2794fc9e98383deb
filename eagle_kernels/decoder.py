"""A Llama decoder stack in one C++ call (csrc/cpu_decoder.cpp), for CPU steps.

It runs, layer after layer, exactly the kernels a per-layer forward calls (rms_norm, linear_dense / linear_q,
rope_write_kv, paged_attention, silu_and_mul) in the same order, so its output is bit-identical to that
forward's; it saves the host time between them. Per layer, `weights` holds [input_norm, qkv, o, post_norm,
gate_up, down] and `formats` the four linears' formats (FORMATS); the final norm comes last. With
`first_input` the first layer's attention reads that [T, K0] tensor instead of input_norm(hidden): an EAGLE
head's layer, whose norms and concatenation come before it.
"""
import torch

from . import _ops
from ._ops import check_paged_attention_cpu, check_rms_norm, has_kernel, ops
from .quant import QTYPES, _check as check_quantized, out_features

_CPU_OP = has_kernel("decoder_layers", torch.device("cpu"))
FORMATS = {"bf16": 0, **{name: ggml for name, (ggml, _) in QTYPES.items()}}
PER_LAYER = 6


def decoder_layers_fit(hidden: torch.Tensor) -> bool:
    """Whether decoder_layers serves this step: bf16 CPU activations, autograd off (any step: prefills,
    decode, chains and trees run the same kernels as the per-layer forward)."""
    return fits(hidden.dtype, hidden.device)


def fits(dtype: torch.dtype, device: torch.device) -> bool:
    """decoder_layers_fit for activations of this dtype and device."""
    return (_CPU_OP and dtype == torch.bfloat16 and device.type == "cpu" and not _ops._TRITON_ON_CPU
            and not torch.is_grad_enabled())


def decoder_layers(hidden, weights, formats, eps, cos, sin, kv, slot_mapping, block_tables, cu_seqlens_q,
                   prefix_lens, tree_mask, num_q_heads: int, capture=(), capture_into=None, first_input=None):
    """hidden: [T, H] bf16 embeddings (the residual stream: updated in place); cos, sin: fp32 [T, D];
    kv: [k_cache, v_cache] per layer; metadata as paged_attention's. -> (the final norm's output [T, H],
    the inputs of the layers in `capture`, in order). With `capture_into` (bf16 [slots, len(capture) * H])
    those inputs go there instead, side by side, token t's at row slot_mapping[t] (int64), and none return."""
    if _ops.CHECKED:
        check_decoder_layers(hidden, weights, formats, cos, sin, kv, slot_mapping, block_tables, cu_seqlens_q,
                             prefix_lens, tree_mask, num_q_heads, first_input)
    return ops().decoder_layers(hidden, weights, formats, eps, cos, sin, kv, slot_mapping, block_tables,
                                cu_seqlens_q, prefix_lens, tree_mask, num_q_heads, list(capture), capture_into,
                                first_input)


def bind(weights, formats, kv, embed, embed_format: int, cos, sin):
    """A model's decoder stack as one C++ object for decoder_layers_bound: the layers' weights and formats, the
    KV caches, the embedding table (embed_format: FORMATS' bf16 rows, or Q4_1 / Q8_0 blocks dequantized to bf16)
    and the fp32 rope tables [P, D]. A step then passes it with its token ids and positions instead of ~240
    tensors, whose boxing costs ~75 us a call with their Python objects cold (a 30-layer stack), and two ops
    fewer. The object keeps the tensors alive; bind again after replacing any. Each call checks them as
    decoder_layers does (the op's own checks)."""
    _check_lengths(weights, formats, kv)
    if embed_format not in FORMATS.values():
        raise ValueError(f"decoder_layers: embed_format must be in {FORMATS}, got {embed_format}")
    return torch.classes.eagle.DecoderStack(list(weights), list(formats), list(kv), embed, embed_format, cos, sin)


def decoder_layers_bound(ids, positions, stack, eps, slot_mapping, block_tables, cu_seqlens_q, prefix_lens,
                         tree_mask, num_q_heads: int, capture=(), capture_into=None):
    """decoder_layers over a bound stack (bind's) from token ids and positions [T]: hidden = the embedding's rows
    of ids, cos / sin = the rope tables' rows of positions; the same kernels, the same bits; no first_input."""
    return ops().decoder_layers_bound(ids, positions, stack, eps, slot_mapping, block_tables, cu_seqlens_q,
                                      prefix_lens, tree_mask, num_q_heads, list(capture), capture_into)


def check_decoder_layers(hidden, weights, formats, cos, sin, kv, slot_mapping, block_tables, cu_seqlens_q,
                         prefix_lens, tree_mask, num_q_heads, first_input=None):
    """ValueError unless the arguments form a stack decoder_layers can run (shapes chain from layer to layer)."""
    if not (isinstance(hidden, torch.Tensor) and hidden.dtype == torch.bfloat16 and hidden.dim() == 2
            and hidden.is_contiguous() and hidden.device.type == "cpu"):
        raise ValueError("decoder_layers: hidden must be a contiguous bf16 CPU tensor [T, H]")
    L = _check_lengths(weights, formats, kv)
    T, H = hidden.shape
    if first_input is not None and not (
            isinstance(first_input, torch.Tensor) and first_input.dtype == torch.bfloat16 and first_input.dim() == 2
            and first_input.shape[0] == T and first_input.is_contiguous() and first_input.device.type == "cpu"):
        raise ValueError(f"decoder_layers: first_input must be a contiguous bf16 CPU tensor [{T}, K0]")
    Hkv, D = kv[0].shape[2:]
    I2 = _out_features(weights[4], formats[2], H)
    widths = [(H, (num_q_heads + 2 * Hkv) * D), (num_q_heads * D, H), (H, I2), (I2 // 2, H)]
    for i in range(L):
        w, f = weights[PER_LAYER * i:PER_LAYER * (i + 1)], formats[4 * i:4 * (i + 1)]
        for norm in (w[0], w[3]):
            check_rms_norm(hidden, norm)
        for name, weight, fmt, (K, N) in zip(("qkv", "o", "gate_up", "down"), (w[1], w[2], w[4], w[5]), f, widths):
            if name == "qkv" and i == 0 and first_input is not None:
                K = first_input.shape[1]
            if _out_features(weight, fmt, K) != N:
                raise ValueError(f"decoder_layers: layer {i} {name} must map {K} -> {N} features")
        q = hidden.new_empty(T, num_q_heads, D)
        _ops.check_rope_write_kv(hidden.new_empty(T, widths[0][1]), cos, sin, kv[2 * i], kv[2 * i + 1],
                                 slot_mapping, num_q_heads)
        check_paged_attention_cpu(q, kv[2 * i], kv[2 * i + 1], block_tables, cu_seqlens_q, prefix_lens, tree_mask)
    check_rms_norm(hidden, weights[-1])


def _check_lengths(weights, formats, kv) -> int:
    """-> the layers L; ValueError unless kv holds 2 caches a layer, weights 6 a layer and the final norm, formats
    4 a layer, each one of FORMATS."""
    L = len(kv) // 2
    if L < 1 or len(kv) != 2 * L or len(weights) != PER_LAYER * L + 1 or len(formats) != 4 * L:
        raise ValueError(f"decoder_layers: kv must hold 2 caches per layer, weights {PER_LAYER} per layer and the "
                         f"final norm, formats 4 per layer; got {len(kv)}, {len(weights)}, {len(formats)}")
    if any(f not in FORMATS.values() for f in formats):
        raise ValueError(f"decoder_layers: formats must be in {FORMATS}, got {sorted(set(formats))}")
    return L


def _out_features(weight, fmt: int, K: int) -> int:
    """N of a [N, K] weight in format `fmt` (ValueError if it is not one)."""
    if not isinstance(weight, torch.Tensor) or weight.device.type != "cpu":
        raise ValueError("decoder_layers: every weight must be a CPU tensor")
    if fmt == FORMATS["bf16"]:
        if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.shape[1] != K or not weight.is_contiguous():
            raise ValueError(f"decoder_layers: a bf16 weight must be contiguous [N, {K}], got {weight.dtype} "
                             f"{list(weight.shape)}")
        return weight.shape[0]
    name = next(n for n, (g, _) in QTYPES.items() if g == fmt)
    check_quantized(weight, name, K)
    return out_features(weight)
