"""An EAGLE-3 head's top-1 draft chain in one C++ call (csrc/cpu_draft.cpp), for CPU rounds.

One call feeds the pending pairs (rows of the raw-feature store projected by fc, one head step over them) and
drafts the chain: at each level the draft vocabulary's argmax over the newest node's logits (or, for a sampled
sequence, its keyed draw), mapped to a target id, fed back as one more head step, one new token a sequence at
the next position of the head's paged cache, while a chain goes on (max_levels, and min_prob: a chain ends
before its first draft whose cumulative probability is below it). Every piece runs the kernel the per-op head forward runs, in its order, so the result
is bit-identical to drafting op by op (tests/test_draft_chain.py holds the two against each other).
"""
import math

import torch

from . import _ops
from ._ops import check_tensor, has_kernel, ops
from .decoder import FORMATS, _out_features, check_decoder_layers
from .quant import QTYPES, _check as check_quantized

_CPU_OP = has_kernel("draft_chain", torch.device("cpu"))
WEIGHTS = ("fc", "embed", "input_norm", "hidden_norm", "qkv", "o", "post_norm", "gate_up", "down", "norm", "lm_head")
LINEARS = ("fc", "embed", "qkv", "o", "gate_up", "down", "lm_head")  # what `formats` gives, in this order
_INTS = (torch.int32, torch.int64)


def draft_chain_fit(features: torch.Tensor) -> bool:
    """Whether draft_chain serves a head beside this raw-feature store: bf16 on the CPU, autograd off."""
    return (_CPU_OP and features.dtype == torch.bfloat16 and features.device.type == "cpu"
            and not _ops._TRITON_ON_CPU and not torch.is_grad_enabled())


def draft_chain(features, ids, positions, slot_mapping, block_tables, cu_seqlens_q, prefix_lens,
                max_levels: list[int], min_prob: float, weights, formats, d2t, eps: float, cos, sin, kv,
                num_q_heads: int, keyed: tuple[list[int], list[int], list[float]] | None = None):
    """features: bf16 [slots, R] (the head's raw inputs by cache slot); the feed's pairs: ids [T], positions
    [T], slot_mapping int64 [T], with paged_attention's block_tables int32 [B, W], cu_seqlens_q int32 [B + 1]
    (every sequence feeds at least one pair; its last is the chain's root) and prefix_lens int32 [B];
    weights / formats: the head's, named by WEIGHTS / LINEARS (formats: FORMATS values); d2t int64 [Vd];
    cos, sin [P, D] rope tables (rows widened to fp32); kv: the head's [k_cache, v_cache] (written).
    keyed: (keys, firsts, temperatures), a value per sequence: a sequence with temperature > 0 drafts keyed
    draws (sample_keyed over softmax(logits / temperature), the noise of each draft's target id at position
    firsts[b] + depth - 1 under key keys[b]) instead of argmaxes; None: argmaxes.
    -> the chains as a Tree's fields (engine/trees.py): tokens int64 [B, 1 + N] (the root token, then the drafts
    as target ids), parents and depths int32 [B, 1 + N] (node j: j - 1 and j; padding -1 and 0), scores fp32
    zeros [B, 1 + N], sizes int32 [B] (1 + the drafts each sequence keeps)."""
    if _ops.CHECKED:
        check_draft_chain(features, ids, positions, slot_mapping, block_tables, cu_seqlens_q, prefix_lens,
                          max_levels, min_prob, weights, formats, d2t, cos, sin, kv, num_q_heads)
        if keyed is not None and not (len(keyed) == 3 and all(len(v) == len(max_levels) for v in keyed)
                                      and all(t >= 0 for t in keyed[2])):
            _fail("keyed must be (keys, firsts, temperatures >= 0), a value per sequence each")
    floor = math.log(min_prob) if min_prob > 0 else -math.inf
    keys, firsts, temperatures = ([], [], []) if keyed is None else (list(v) for v in keyed)
    return ops().draft_chain(features, ids, positions, slot_mapping, block_tables, cu_seqlens_q, prefix_lens,
                             list(max_levels), floor, list(weights), list(formats), d2t, eps, cos, sin, list(kv),
                             num_q_heads, keys, firsts, [float(t) for t in temperatures])


def _fail(msg):
    raise ValueError(f"draft_chain: {msg}")


def check_draft_chain(features, ids, positions, slot_mapping, block_tables, cu_seqlens_q, prefix_lens, max_levels,
                      min_prob, weights, formats, d2t, cos, sin, kv, num_q_heads):
    """ValueError unless the arguments form a chain draft_chain can run (reads them on the host)."""
    cpu = torch.device("cpu")
    if not (isinstance(features, torch.Tensor) and features.dim() == 2 and features.dtype == torch.bfloat16
            and features.device == cpu):
        _fail("features must be a bf16 CPU tensor [slots, R]")
    if len(weights) != len(WEIGHTS) or len(formats) != len(LINEARS):
        _fail(f"weights must hold {len(WEIGHTS)} tensors ({', '.join(WEIGHTS)}) and formats {len(LINEARS)}, "
              f"got {len(weights)} and {len(formats)}")
    if any(f not in FORMATS.values() for f in formats):
        _fail(f"formats must be in {FORMATS}, got {list(formats)}")
    w = dict(zip(WEIGHTS, weights))
    f = dict(zip(LINEARS, formats))
    H = w["norm"].shape[-1] if isinstance(w["norm"], torch.Tensor) else 0
    for name in ("input_norm", "hidden_norm", "post_norm", "norm"):
        check_tensor(w[name], f"draft_chain: {name}", torch.bfloat16, (H,), cpu)
    if _out_features(w["fc"], f["fc"], features.shape[1]) != H:
        _fail(f"fc must map the features' {features.shape[1]} columns to H = {H}")
    V = _table_rows(w["embed"], f["embed"], H)
    Vd = _out_features(w["lm_head"], f["lm_head"], H)
    check_tensor(d2t, "draft_chain: d2t", torch.int64, (Vd,), cpu)
    targets = torch.arange(Vd) + d2t
    if Vd and (targets.min() < 0 or targets.max() >= V):
        _fail(f"d2t maps draft ids outside the embedding's {V} rows")
    if not (isinstance(ids, torch.Tensor) and ids.dim() == 1 and ids.dtype in _INTS and ids.device == cpu):
        _fail("ids must be an int32 / int64 CPU vector [T]")
    T = ids.shape[0]
    if T and (ids.min() < 0 or ids.max() >= V):
        _fail(f"ids must be in [0, {V})")
    if not (isinstance(positions, torch.Tensor) and positions.dtype in _INTS and tuple(positions.shape) == (T,)):
        _fail(f"positions must be int32 / int64 [{T}]")
    check_tensor(slot_mapping, "draft_chain: slot_mapping", torch.int64, (T,), cpu)
    if T and (slot_mapping.min() < 0 or slot_mapping.max() >= features.shape[0]):
        _fail(f"slot_mapping must be in [0, {features.shape[0]}) (the feature store's rows)")
    check_tensor(cu_seqlens_q, "draft_chain: cu_seqlens_q", torch.int32, (None,), cpu)
    B = cu_seqlens_q.shape[0] - 1
    counts = cu_seqlens_q.diff()
    if B < 1 or cu_seqlens_q[0] != 0 or cu_seqlens_q[-1] != T or (counts < 1).any():
        _fail(f"cu_seqlens_q must run from 0 to T = {T} with every sequence feeding at least one pair")
    if len(max_levels) != B or any(not isinstance(n, int) or n < 0 for n in max_levels):
        _fail(f"max_levels must be {B} ints >= 0")
    if not 0 <= min_prob < 1:
        _fail(f"min_prob must be in [0, 1), got {min_prob}")
    for name, t in (("cos", cos), ("sin", sin)):
        if not (isinstance(t, torch.Tensor) and t.dim() == 2 and t.is_floating_point() and t.device == cpu):
            _fail(f"{name} must be a floating CPU table [P, D]")
    roots = positions[cu_seqlens_q[1:].long() - 1].long()
    if T and (positions.min() < 0 or roots.max() + max(max_levels) > cos.shape[0]):
        _fail(f"positions and the chain past them must lie in the rope table's {cos.shape[0]} rows")
    if cos.shape != sin.shape or len(kv) != 2:
        _fail("cos and sin must have one shape, kv must be the head's [k_cache, v_cache]")
    # The head's layer: decoder_layers over [T, H] with a [T, 2H] first input, the feed's rows and metadata.
    stack = [w["post_norm"], w["qkv"], w["o"], w["post_norm"], w["gate_up"], w["down"], w["post_norm"]]
    hidden = torch.empty(T, H, dtype=torch.bfloat16)
    check_decoder_layers(hidden, stack, [f["qkv"], f["o"], f["gate_up"], f["down"]], cos[:T].float(), sin[:T].float(), kv,
                         slot_mapping, block_tables, cu_seqlens_q, prefix_lens, None, num_q_heads,
                         first_input=torch.empty(T, 2 * H, dtype=torch.bfloat16))


def _table_rows(table, fmt: int, H: int) -> int:
    """Rows of an embedding table of width H in format `fmt` (ValueError if it is not one)."""
    if fmt == FORMATS["bf16"]:
        check_tensor(table, "draft_chain: embed", torch.bfloat16, (None, H), torch.device("cpu"))
        return table.shape[0]
    name = next(n for n, (g, _) in QTYPES.items() if g == fmt)
    check_quantized(table, name, H)
    return table.shape[0] * 16
