"""Block-quantized weights on the CPU: the GGUF types Q8_0 and Q4_1 (blocks of 32 weights along K).

A quantized [N, K] weight is a uint8 tensor [N / 16, K / 32 * 16 * block bytes] (34 for Q8_0, 20 for Q4_1,
as in a GGUF file): the same fp16 scales and quants as the GGUF blocks, rearranged in groups of 16 rows so
that one SIMD lane computes one output row (csrc/cpu_quant.cpp has the layout). `from_gguf` rearranges a
GGUF tensor's blocks (exactly); `quantize` / `dequantize` convert from and to floats; `rows` dequantizes
chosen rows. `linear_q` runs `eagle::linear_q`: activations quantized per row and block to int8, exact
integer block sums, a fixed fp32 chain per output element (row-invariant, like the bf16 linear).
`ref_linear_q` is the kernel's arithmetic in float64, the tests' reference.
"""
import torch
import torch.nn.functional as F

from . import _ops
from ._ops import has_kernel, ops

BLOCK, GROUP = 32, 16
# type name -> (GGML type id, bytes per block of 32 weights)
QTYPES = {"q4_1": (3, 20), "q8_0": (8, 34)}

_CPU_OP = has_kernel("linear_q", torch.device("cpu"))
_OP = ops().linear_q if _CPU_OP else None
_EMBEDDING_OP = has_kernel("embedding_q", torch.device("cpu"))


def group_bytes(qtype: str, K: int) -> int:
    """Bytes of one group of 16 rows."""
    return K // BLOCK * GROUP * QTYPES[qtype][1]


def supports(N: int, K: int) -> bool:
    """Whether an [N, K] weight can be kept quantized here (whole groups of rows, whole blocks)."""
    return N > 0 and K > 0 and N % GROUP == 0 and K % BLOCK == 0


def out_features(data: torch.Tensor) -> int:
    return data.shape[0] * GROUP


def _check(data: torch.Tensor, qtype: str, K: int):
    if qtype not in QTYPES:
        raise ValueError(f"qtype must be one of {', '.join(QTYPES)}, got {qtype!r}")
    if K <= 0 or K % BLOCK:
        raise ValueError(f"{qtype}: K = {K} is not a positive multiple of {BLOCK}")
    if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != group_bytes(qtype, K):
        raise ValueError(f"{qtype} weight must be uint8 [N / 16, {group_bytes(qtype, K)}] for K = {K}, "
                         f"got {data.dtype} {list(data.shape)}")


def linear_q(x: torch.Tensor, data: torch.Tensor, qtype: str, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x: [..., K] bf16 / fp32 (CPU), data: a quantized [N, K] weight (uint8 [N / 16, ...]) -> [..., N] in
    `out_dtype` (bf16 / fp32; x's by default). x is quantized to the same int8 blocks whatever its dtype, so
    bf16 x with fp32 out is the fp32 result for x.float(), without that copy."""
    K = x.shape[-1]
    if _ops.CHECKED:
        _check(data, qtype, K)
        if x.dtype not in (torch.bfloat16, torch.float32) or x.device.type != "cpu" or data.device.type != "cpu":
            raise ValueError(f"linear_q: x must be a bf16/fp32 CPU tensor and the weight on the CPU, got "
                             f"{x.dtype} on {x.device}, weight on {data.device}")
        if out_dtype not in (None, torch.bfloat16, torch.float32):
            raise ValueError(f"linear_q: out_dtype must be bf16 or fp32, got {out_dtype}")
    if _CPU_OP and x.dim() == 2:  # the engine's packed tokens: no reshapes (this runs ~120 times a token)
        return _OP(x, data, QTYPES[qtype][0], out_dtype)
    rows = x.reshape(-1, K)
    if _CPU_OP:
        y = _OP(rows, data, QTYPES[qtype][0], out_dtype)
    else:  # no extension: the same quantized operands, an fp32 GEMM
        q, d, _ = quantize_x(rows)
        y = F.linear((q * d).reshape(rows.shape), dequantize(data, qtype)).to(out_dtype or x.dtype)
    return y.reshape(*x.shape[:-1], out_features(data))


def embedding_q(ids: torch.Tensor, data: torch.Tensor, qtype: str, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of a quantized [V, K] table, dequantized -> [*ids.shape, K] in `dtype` (the values of `rows`)."""
    if _EMBEDDING_OP and dtype in (torch.bfloat16, torch.float32) and data.device.type == "cpu":
        if ids.dim() == 1:  # the engine's packed tokens
            return ops().embedding_q(ids, data, QTYPES[qtype][0], dtype)
        out = ops().embedding_q(ids.reshape(-1), data, QTYPES[qtype][0], dtype)
    else:
        out = rows(data, qtype, ids.reshape(-1)).to(dtype)
    return out.reshape(*ids.shape, out.shape[-1])


_ARGMAX_OP = has_kernel("argmax_q8", torch.device("cpu"))


def argmax_planes(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What argmax_q8 reads of a Q8_0 weight (csrc/cpu_argmax_q.cpp has the layouts): `planes`, each quant's
    top 5 bits, u = (q + 128) >> 3, beside its block's d (352 bytes a group and block against Q8_0's 544);
    `rows`, the weight row-major (a row's fp16 d's, then its quants), for the few rows computed exactly; and
    the largest |d| of each block over all rows. -> (planes uint8 [N / 16, nb * 352], rows uint8 [N, nb * 34],
    dmax fp32 [nb]): 1.65x the weight's memory."""
    G = data.shape[0]
    blocks = data.reshape(G, -1, GROUP * QTYPES["q8_0"][1])                       # [G, nb, 544]
    nb = blocks.shape[1]
    d = blocks[..., :32]
    u = (blocks[..., 32:].contiguous().view(torch.int8).reshape(G, nb, 8, GROUP * 4).int() + 128) >> 3
    low = (u & 15).to(torch.uint8)                                                 # [G, nb, sub-block j, 64]
    nibbles = low[:, :, :4] | (low[:, :, 4:] << 4)                                 # sub-block j + 4 high
    bits = (u >> 4).to(torch.uint8).reshape(G, nb, 8, 8, 8)                        # mask j, byte k, bit t
    masks = (bits << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)  # [G, nb, 8, 8]
    planes = torch.cat([d, nibbles.reshape(G, nb, -1), masks.reshape(G, nb, -1)], -1).reshape(G, -1).contiguous()
    dw, _, q = _fields(data, "q8_0")                                               # [N, nb], [N, nb, 32]
    rows = torch.cat([dw.contiguous().view(torch.uint8), q.to(torch.int8).reshape(len(q), -1).view(torch.uint8)], 1)
    return planes, rows.contiguous(), dw.float().abs().amax(0).contiguous()


def argmax_q8(x: torch.Tensor, data: torch.Tensor, planes: torch.Tensor, rows: torch.Tensor, dmax: torch.Tensor,
              keyed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The token of a Q8_0 LM head: x [M, K] -> int64 [M], exactly argmax(linear_q(x, data, "q8_0", float32))
    (the first maximum), or with keyed = (temperatures fp32 [M], seeds, positions int64 [M]) exactly
    sample_keyed(those logits, *keyed) (rows at temperature 0: the argmax), from argmax_planes' bounds and the
    exact logits of the few rows they cannot rule out (AVX-512 VNNI, or AVX2 for one x row; elsewhere that full
    product)."""
    if _ARGMAX_OP and x.dim() == 2 and x.dtype == torch.bfloat16 and x.device.type == "cpu":
        return ops().argmax_q8(x, data, planes, rows, dmax, *(keyed or (None, None, None)))
    from .sampling import argmax, sample_keyed
    logits = linear_q(x, data, "q8_0", torch.float32)
    return argmax(logits) if keyed is None else sample_keyed(logits, *keyed)


# ----------------------------------------------------------------------------- layouts

def _pack(d: torch.Tensor, m: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """d, m: fp16 [N, nb]; q: [N, nb, 32] quants in order (int8 for Q8_0, 0..15 for Q4_1) -> [N / 16, ...]."""
    N, nb = d.shape
    G = N // GROUP
    per_block = lambda t: t.reshape(G, GROUP, nb).transpose(1, 2).contiguous().view(torch.uint8)  # [G, nb, 32]
    sub = q.reshape(G, GROUP, nb, 8, 4).permute(0, 2, 3, 1, 4)                 # [G, nb, sub-block j, row, 4]
    if m is None:
        quants = sub.to(torch.int8).contiguous().view(torch.uint8)
        parts = [per_block(d), quants.reshape(G, nb, -1)]
    else:
        sub = sub.to(torch.uint8)
        quants = sub[:, :, :4] | (sub[:, :, 4:] << 4)                          # sub-block j + 4 in the high nibbles
        parts = [per_block(d), per_block(m), quants.reshape(G, nb, -1)]
    return torch.cat(parts, -1).reshape(G, -1).contiguous()


def _fields(data: torch.Tensor, qtype: str):
    """-> (d fp16 [N, nb], m fp16 [N, nb] or None, q int32 [N, nb, 32] in order)."""
    G = data.shape[0]
    blocks = data.reshape(G, -1, GROUP * QTYPES[qtype][1])                     # [G, nb, group block]
    nb = blocks.shape[1]
    per_row = lambda t: t.contiguous().view(torch.float16).transpose(1, 2).reshape(G * GROUP, nb)
    d = per_row(blocks[..., :32])
    if qtype == "q8_0":
        m, sub = None, blocks[..., 32:].contiguous().view(torch.int8).reshape(G, nb, 8, GROUP, 4).int()
    else:
        m = per_row(blocks[..., 32:64])
        packed = blocks[..., 64:].reshape(G, nb, 4, GROUP, 4).int()
        sub = torch.cat([packed & 15, packed >> 4], 2)                          # [G, nb, 8, row, 4]
    q = sub.permute(0, 3, 1, 2, 4).reshape(G * GROUP, nb, BLOCK)
    return d, m, q


def rows(data: torch.Tensor, qtype: str, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (int64 [T]) dequantized -> fp32 [T, K], straight from their groups (a token's embedding)."""
    T, size = len(ids), QTYPES[qtype][1]
    blocks = data[ids // GROUP].reshape(T, -1, GROUP * size)                 # [T, nb, group block]
    lane = (ids % GROUP)[:, None, None].expand(T, blocks.shape[1], 1)         # [T, nb, 1]
    scale = lambda t: t.contiguous().view(torch.float16).gather(2, lane).float()   # [T, nb, 1]
    if qtype == "q8_0":
        quants = blocks[..., 32:].reshape(T, -1, 8, GROUP, 4).view(torch.int8)
        w = scale(blocks[..., :32]) * _lane(quants, lane)
    else:
        packed = _lane(blocks[..., 64:].reshape(T, -1, 4, GROUP, 4), lane)     # [T, nb, 16]
        w = scale(blocks[..., :32]) * torch.cat([packed & 15, packed >> 4], -1) + scale(blocks[..., 32:64])
    return w.reshape(T, -1)


def _lane(sub: torch.Tensor, lane: torch.Tensor) -> torch.Tensor:
    """sub [T, nb, J, 16, 4] -> row `lane` of each: [T, nb, J * 4] (the block's quants in order)."""
    T, nb, J = sub.shape[:3]
    index = lane[..., None, None].expand(T, nb, J, 1, 4)                      # lane: [T, nb, 1]
    return sub.gather(3, index).reshape(T, nb, J * 4)


def from_gguf(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """A GGUF tensor's blocks, uint8 [N, nb * block bytes] (N % 16 == 0) -> this module's layout (the same values)."""
    N = blocks.shape[0]
    b = blocks.reshape(N, -1, QTYPES[qtype][1])
    d = b[..., 0:2].contiguous().view(torch.float16)[..., 0]
    if qtype == "q8_0":
        return _pack(d, None, b[..., 2:].contiguous().view(torch.int8))
    m = b[..., 2:4].contiguous().view(torch.float16)[..., 0]
    nibbles = b[..., 4:]                                 # byte j: weight j (low nibble), weight j + 16 (high)
    return _pack(d, m, torch.cat([nibbles & 15, nibbles >> 4], -1))


def quantize(w: torch.Tensor, qtype: str) -> torch.Tensor:
    """w: float [N, K] -> [N / 16, ...]. Q8_0: d = max|w| / 127, q = round(w / d); Q4_1: m = min, d = (max - min) / 15,
    q = round((w - m) / d) in 0..15. d and m are stored as fp16."""
    N, K = w.shape
    if not supports(N, K):
        raise ValueError(f"{qtype}: a [{N}, {K}] weight does not split into groups of {GROUP} rows and blocks of {BLOCK}")
    blocks = w.float().reshape(N, K // BLOCK, BLOCK)
    if qtype == "q8_0":
        d = blocks.abs().amax(-1) / 127
        q = torch.round(blocks / d.masked_fill(d == 0, 1)[..., None]).clamp(-127, 127)
        return _pack(d.half(), None, q.to(torch.int8))
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    d = (hi - lo) / 15
    q = torch.round((blocks - lo[..., None]) / d.masked_fill(d == 0, 1)[..., None]).clamp(0, 15)
    return _pack(d.half(), lo.half(), q.to(torch.uint8))


def dequantize(data: torch.Tensor, qtype: str) -> torch.Tensor:
    """[N / 16, ...] -> fp32 [N, K]."""
    d, m, q = _fields(data, qtype)
    w = d.float()[..., None] * q
    if m is not None:
        w = w + m.float()[..., None]
    return w.reshape(out_features(data), -1)


# ----------------------------------------------------------------------------- the kernel's arithmetic

def quantize_x(x: torch.Tensor):
    """Activations as the kernel quantizes them: x [M, K] -> (q int32 [M, nb, 32], d fp32 [M, nb, 1], s fp32 [M, nb, 1])."""
    blocks = x.float().reshape(x.shape[0], -1, BLOCK)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.round(blocks * inv).int()          # fp32 product, round half to even, as the kernel
    return q, d, d * q.sum(-1, keepdim=True).float()


def ref_linear_q(x: torch.Tensor, data: torch.Tensor, qtype: str) -> torch.Tensor:
    """The kernel's result in float64 (its only fp32 roundings are the per-block scale products and the
    accumulation): x [M, K] -> [M, N] fp64."""
    qx, dx, sx = quantize_x(x)                   # [M, nb, 32], [M, nb, 1] x2
    dw, mw, qw = _fields(data, qtype)            # [N, nb] (x2), [N, nb, 32]
    isum = torch.einsum("mbk,nbk->mnb", qx.double(), qw.double())           # exact integers
    scale = (dw.float()[None] * dx[:, None, :, 0]).double()                 # fp32 products, [M, N, nb]
    y = (scale * isum).sum(-1)
    if mw is not None:
        y = y + (mw.double()[None] * sx[:, None, :, 0].double()).sum(-1)
    return y
