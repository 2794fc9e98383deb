"""Block-quantized weights on the CPU: the GGUF types Q8_0 and Q4_1 (blocks of 32 weights along K).

A quantized weight is a uint8 tensor [N, K / 32 * block bytes] (34 for Q8_0, 20 for Q4_1, as in a GGUF
file) whose rows hold the same scales and quants as the GGUF blocks, rearranged for SIMD loads: the row's
fp16 d's, (Q4_1) its fp16 m's, then its quants by pairs of blocks in interleaved order (csrc/cpu_quant.cpp
has the layout). `from_gguf` rearranges a GGUF tensor's blocks (exactly), `quantize` / `dequantize` convert
from and to floats. `linear_q` runs `eagle::linear_q`: activations quantized per row and block to int8,
exact integer block sums, a fixed fp32 chain per output element (row-invariant, like the bf16 linear).
`ref_linear_q` is the kernel's arithmetic in float64, the tests' reference.
"""
import torch
import torch.nn.functional as F

from . import _ops
from ._ops import has_kernel, ops

BLOCK = 32
# type name -> (GGML type id, bytes per block of 32 weights)
QTYPES = {"q4_1": (3, 20), "q8_0": (8, 34)}

_CPU_OP = has_kernel("linear_q", torch.device("cpu"))


def row_bytes(qtype: str, K: int) -> int:
    return K // BLOCK * QTYPES[qtype][1]


def supports(K: int) -> bool:
    """Whether rows of K weights can be quantized here (the kernels take blocks by pairs)."""
    return K > 0 and K % (2 * BLOCK) == 0


def _check(data: torch.Tensor, qtype: str, K: int):
    if qtype not in QTYPES:
        raise ValueError(f"qtype must be one of {', '.join(QTYPES)}, got {qtype!r}")
    if not supports(K):
        raise ValueError(f"{qtype}: K = {K} is not a positive multiple of {2 * BLOCK}")
    if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != row_bytes(qtype, K):
        raise ValueError(f"{qtype} weight must be uint8 [N, {row_bytes(qtype, K)}] for K = {K}, "
                         f"got {data.dtype} {list(data.shape)}")


def linear_q(x: torch.Tensor, data: torch.Tensor, qtype: str) -> torch.Tensor:
    """x: [..., K] bf16 / fp32 (CPU), data: a quantized [N, K] weight -> [..., N] in x's dtype."""
    K = x.shape[-1]
    if _ops.CHECKED:
        _check(data, qtype, K)
        if x.dtype not in (torch.bfloat16, torch.float32) or x.device.type != "cpu" or data.device.type != "cpu":
            raise ValueError(f"linear_q: x must be a bf16/fp32 CPU tensor and the weight on the CPU, got "
                             f"{x.dtype} on {x.device}, weight on {data.device}")
    rows = x.reshape(-1, K)
    if _CPU_OP:
        y = ops().linear_q(rows, data, QTYPES[qtype][0])
    else:  # no extension: the same quantized operands, an fp32 GEMM
        q, d, _ = quantize_x(rows)
        y = F.linear((q * d).reshape(rows.shape), dequantize(data, qtype)).to(x.dtype)
    return y.reshape(*x.shape[:-1], data.shape[0])


def embedding_q(ids: torch.Tensor, data: torch.Tensor, qtype: str, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of a quantized [V, K] table, dequantized -> [*ids.shape, K] in `dtype`."""
    rows = dequantize(data[ids.reshape(-1)], qtype)
    return rows.to(dtype).reshape(*ids.shape, rows.shape[-1])


# ----------------------------------------------------------------------------- layouts

def _interleave() -> torch.Tensor:
    """Position o of a pair of blocks -> the natural index (32 * block + k) of the weight stored there."""
    o = torch.arange(2 * BLOCK)
    return 32 * ((o // 4) % 2) + 4 * (o // 8) + o % 4


_PAIR = _interleave()
_UNPAIR = torch.argsort(_PAIR)


def _pack(d: torch.Tensor, m: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """d, m: fp16 [N, nb]; q: [N, nb, 32] quants in natural order (int8 for Q8_0, 0..15 for Q4_1) -> rows."""
    N, nb = d.shape
    pairs = q.reshape(N, nb // 2, 2 * BLOCK)[..., _PAIR]                     # [N, nb / 2, 64]
    if m is None:
        quants = pairs.to(torch.int8).view(torch.uint8)
    else:
        pairs = pairs.to(torch.uint8)
        quants = pairs[..., :32] | (pairs[..., 32:] << 4)
    scales = [d.contiguous().view(torch.uint8)] + ([] if m is None else [m.contiguous().view(torch.uint8)])
    return torch.cat(scales + [quants.reshape(N, -1)], -1).contiguous()


def _fields(data: torch.Tensor, qtype: str):
    """Rows -> (d fp16 [N, nb], m fp16 [N, nb] or None, q int32 [N, nb, 32] in natural order)."""
    N = data.shape[0]
    nb = data.shape[1] // QTYPES[qtype][1]
    d = data[:, :2 * nb].contiguous().view(torch.float16)
    if qtype == "q8_0":
        pairs = data[:, 2 * nb:].contiguous().view(torch.int8).reshape(N, nb // 2, 2 * BLOCK).int()
        m = None
    else:
        m = data[:, 2 * nb:4 * nb].contiguous().view(torch.float16)
        packed = data[:, 4 * nb:].reshape(N, nb // 2, BLOCK).int()
        pairs = torch.cat([packed & 15, packed >> 4], -1)
    return d, m, pairs[..., _UNPAIR].reshape(N, nb, BLOCK)


def from_gguf(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """A GGUF tensor's blocks, uint8 [N, nb * block bytes] -> this module's rows (the same values)."""
    N = blocks.shape[0]
    b = blocks.reshape(N, -1, QTYPES[qtype][1])
    d = b[..., 0:2].contiguous().view(torch.float16)[..., 0]
    if qtype == "q8_0":
        return _pack(d, None, b[..., 2:].contiguous().view(torch.int8))
    m = b[..., 2:4].contiguous().view(torch.float16)[..., 0]
    nibbles = b[..., 4:]                                 # byte j: weight j (low nibble), weight j + 16 (high)
    return _pack(d, m, torch.cat([nibbles & 15, nibbles >> 4], -1))


def quantize(w: torch.Tensor, qtype: str) -> torch.Tensor:
    """w: float [N, K] -> rows. Q8_0: d = max|w| / 127, q = round(w / d); Q4_1: m = min, d = (max - min) / 15,
    q = round((w - m) / d) in 0..15. d and m are stored as fp16."""
    N, K = w.shape
    _check(torch.empty(N, row_bytes(qtype, K), dtype=torch.uint8), qtype, K)
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
    """Rows -> fp32 [N, K]."""
    d, m, q = _fields(data, qtype)
    w = d.float()[..., None] * q
    if m is not None:
        w = w + m.float()[..., None]
    return w.reshape(data.shape[0], -1)


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
