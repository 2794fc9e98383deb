"""A lean Llama: RMSNorm, RoPE (plain and llama3-scaled), GQA attention over the paged KV cache, SwiGLU.

Tokens of all sequences in a step are packed into one flat batch (`T` tokens); `AttnMeta` says where each
sequence's new tokens live in the paged cache and which of them see each other (causal or tree mask).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

import eagle_kernels
from .config import LlamaConfig


@dataclass
class AttnMeta:
    """Per-step attention metadata, built once by the model runner and shared by every layer."""
    slot_mapping: torch.Tensor   # int64 [T] (widened once per step): cache slot (block * block_size + offset) of each new token
    block_tables: torch.Tensor   # int32 [B, max_blocks]
    cu_seqlens_q: torch.Tensor   # int32 [B + 1]: new tokens of sequence b are q[cu[b]:cu[b+1]]
    prefix_lens: torch.Tensor    # int32 [B]: tokens already cached before the new ones
    tree_mask: torch.Tensor | None = None  # int32 [T, W] ancestor bitmask over the new tokens; None = causal


class Linear(nn.Linear):
    """nn.Linear through eagle_kernels.linear (a faster bf16 GEMV on CPUs without native bf16)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return eagle_kernels.linear(x, self.weight, self.bias)


class QLinear(nn.Module):
    """A linear layer on GGUF block-quantized weights (CPU): qweight in eagle_kernels.quant's layout."""

    def __init__(self, qweight: torch.Tensor, qtype: str, in_features: int, bias: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.register_buffer("bias", bias)
        self.argmax_parts = None  # argmax_q8's (planes, rows, dmax), built on first use (Llama.tokens)
        self.qtype, self.in_features, self.out_features = qtype, in_features, eagle_kernels.quant.out_features(qweight)

    @classmethod
    def of(cls, linear: nn.Linear, qtype: str) -> "QLinear":
        """A dense Linear's weight quantized to `qtype` (its bias kept dense, in the weight's dtype)."""
        w = linear.weight.detach()
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(eagle_kernels.quant.quantize(w, qtype), qtype, linear.in_features, bias)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        y = eagle_kernels.linear_q(x, self.qweight, self.qtype, out_dtype)  # in x's dtype by default
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def tokens(self, x: torch.Tensor, keyed: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        """x [M, K] -> int64 [M]: the argmax of self(x, fp32), the first maximum, or with keyed = (temperatures,
        seeds, positions) sample_keyed's draws from it. A Q8_0 weight without bias reads ~65% of its bytes for
        them (eagle_kernels.quant.argmax_q8; what it reads costs 1.65x the weight's memory)."""
        if self.qtype != "q8_0" or self.bias is not None or self.qweight.device.type != "cpu":
            logits = self(x, torch.float32)
            return eagle_kernels.argmax(logits) if keyed is None else eagle_kernels.sample_keyed(logits, *keyed)
        if self.argmax_parts is None:
            self.argmax_parts = eagle_kernels.quant.argmax_planes(self.qweight)
        return eagle_kernels.quant.argmax_q8(x, self.qweight, *self.argmax_parts, keyed=keyed)


class QEmbedding(nn.Module):
    """An embedding table in GGUF blocks (shared with a tied QLinear LM head); rows come out in `dtype`."""

    def __init__(self, qweight: torch.Tensor, qtype: str, dim: int, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.qtype, self.embedding_dim, self.dtype = qtype, dim, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return eagle_kernels.embedding_q(ids, self.qweight, self.qtype, self.dtype)


def dense_weight(module: nn.Module) -> torch.Tensor:
    """The [N, K] weight of a Linear / Embedding, or of a QLinear / QEmbedding dequantized to fp32."""
    if isinstance(module, (QLinear, QEmbedding)):
        return eagle_kernels.quant.dequantize(module.qweight, module.qtype)
    return module.weight


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """norm(x); with `residual`: residual += x in place, -> norm(residual) (the fused pre-norm add)."""
        return eagle_kernels.rms_norm(x, self.weight, self.eps, residual)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "llama3":
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: llama3)")
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor, old_ctx = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_ctx / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(wavelen > old_ctx / low, inv_freq / factor,
                       torch.where(wavelen < old_ctx / high, inv_freq, blended))


class Rotary(nn.Module):
    """cos/sin table for all positions, indexed once per forward and shared by every layer."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        angles = torch.outer(torch.arange(cfg.max_position, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)  # [P, D]: HF's half-split layout
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: int32 / int64 [T] (or [B, S]) -> cos, sin [T, D] ([B, S, D]); index_select of the packed
        # tokens' positions costs a few times less host time than indexing, and no cast where none is asked
        if positions.dim() != 1:
            cos, sin = self(positions.reshape(-1), dtype)
            return cos.view(*positions.shape, -1), sin.view(*positions.shape, -1)
        cos, sin = self.cos.index_select(0, positions), self.sin.index_select(0, positions)
        return (cos, sin) if dtype == torch.float32 else (cos.to(dtype), sin.to(dtype))


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, in_dim: int | None = None):
        super().__init__()
        self.nq, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        in_dim = in_dim or cfg.hidden_size
        # q, k and v in one matmul: one weight read per step instead of three.
        self.qkv_proj = Linear(in_dim, (self.nq + 2 * self.nkv) * self.hd, bias=False)
        self.o_proj = Linear(self.nq * self.hd, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, kv_cache, meta: AttnMeta):
        # x: [T, in_dim]; cos, sin: [T, D]
        k_cache, v_cache = kv_cache
        q = eagle_kernels.rope_write_kv(self.qkv_proj(x), cos, sin, k_cache, v_cache, meta.slot_mapping, self.nq)
        o = eagle_kernels.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q,
                                          meta.prefix_lens, meta.tree_mask)  # [T, Hq, D]
        return self.o_proj(o.reshape(x.shape[0], self.nq * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(eagle_kernels.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(cfg)

    def forward(self, delta, residual, cos, sin, kv_cache, meta):
        """residual: the hidden state [T, H] before `delta`, the previous layer's MLP output (None at layer 0),
        is added; the fused norms do both residual adds in place. -> this layer's MLP output [T, H]."""
        x = self.input_layernorm(residual) if delta is None else self.input_layernorm(delta, residual)
        x = self.post_attention_layernorm(self.self_attn(x, cos, sin, kv_cache, meta), residual)
        return self.mlp(x)


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(cfg)
        self.fused, self._stack, self._bound = True, None, None  # CPU steps: eagle_kernels.decoder_layers (stack())

    def forward(self, input_ids, positions, kv_caches, meta: AttnMeta, capture: tuple[int, ...] = (),
                capture_into: torch.Tensor | None = None):
        """input_ids, positions: [T]. Returns the final normed feature [T, H] (EAGLE-1's feature, the LM
        head's input) and the inputs of the layers in `capture` (EAGLE-3's low/mid/high features), or, with
        `capture_into` ([slots, len(capture) * H]), writes those side by side at row meta.slot_mapping[t] for
        token t and returns none."""
        with eagle_kernels.unchecked():           # every layer's arguments are built here, from meta
            stack = self.bound(kv_caches)
            if stack is not None:                 # the same kernels as the layers below, in one C++ call
                return eagle_kernels.decoder.decoder_layers_bound(
                    input_ids, positions, stack, self.norm.eps, meta.slot_mapping, meta.block_tables,
                    meta.cu_seqlens_q, meta.prefix_lens, meta.tree_mask, self.cfg.num_heads, capture, capture_into)
            residual = self.embed_tokens(input_ids)   # [T, H], the hidden state, updated in place
            cos, sin = self.rotary(positions, torch.float32)
            delta, captured = None, []
            for i, layer in enumerate(self.layers):
                if i in capture:  # layer i's input: a copy, since the residual keeps changing in place
                    captured.append(residual.clone() if delta is None else residual + delta)
                delta = layer(delta, residual, cos, sin, kv_caches[i], meta)
        if capture_into is not None:
            capture_into.index_copy_(0, meta.slot_mapping, torch.cat(captured, -1))
            captured = []
        return self.norm(delta, residual), captured

    def stack(self) -> tuple[list[torch.Tensor], list[int]] | None:
        """Every layer's weights and linear formats for eagle_kernels.decoder_layers, or None where a layer
        does not fit it (fp32 / fp16 weights) or `fused` is off. Built on first use, dropped by .to()."""
        if not self.fused:
            return None
        if self._stack is None:
            self._stack = _stack_of(self.layers, self.norm) or False
        return self._stack or None

    def bound(self, kv_caches):
        """stack(), kv_caches, the embedding and the rope tables bound as one object for decoder_layers_bound
        (eagle_kernels.decoder.bind), kept while the same caches come (a runner passes one list every step);
        None where the step does not fit decoder_layers (stack() None, activations not bf16 on the CPU)."""
        embed = self.embed_tokens
        table, fmt, dtype = ((embed.qweight, eagle_kernels.decoder.FORMATS[embed.qtype], embed.dtype)
                             if isinstance(embed, QEmbedding) else (embed.weight, 0, embed.weight.dtype))
        if not self.fused or not eagle_kernels.decoder.fits(dtype, table.device):
            return None
        if self._bound is None or self._bound[0] is not kv_caches:
            stack = self.stack()
            if stack is None:
                return None
            self._bound = kv_caches, eagle_kernels.decoder.bind(*stack, [c for kv in kv_caches for c in kv], table,
                                                                 fmt, self.rotary.cos, self.rotary.sin)
        return self._bound[1]

    def _apply(self, fn, *args, **kwargs):
        self._stack = self._bound = None
        return super()._apply(fn, *args, **kwargs)

    def logits(self, feature: torch.Tensor) -> torch.Tensor:
        # feature: [N, H] -> fp32 logits [N, V]; a quantized head writes them in fp32 (the same int8 activations
        # from bf16 or fp32 x), with no bf16 rounding and no cast of V values
        if isinstance(self.lm_head, QLinear):
            return self.lm_head(feature, torch.float32)
        return self.lm_head(feature).float()

    def tokens(self, feature: torch.Tensor, keyed: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        # feature: [N, H] -> int64 [N]: argmax(logits(feature)), a greedy step's tokens, or with keyed =
        # (temperatures fp32, seeds, positions int64 [N]) sample_keyed(logits(feature), *keyed) (temperature 0:
        # the argmax); a quantized head finds them without computing every logit
        if isinstance(self.lm_head, QLinear):
            return self.lm_head.tokens(feature, keyed)
        logits = self.logits(feature)
        return eagle_kernels.argmax(logits) if keyed is None else eagle_kernels.sample_keyed(logits, *keyed)


def _stack_of(layers, final_norm: RMSNorm) -> tuple[list[torch.Tensor], list[int]] | None:
    weights, formats = [], []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        fitted = [fused_weight(lin) for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if None in fitted:
            return None
        (qkv, _), (o, _), (gate_up, _), (down, _) = fitted
        weights += [layer.input_layernorm.weight, qkv, o, layer.post_attention_layernorm.weight, gate_up, down]
        formats += [f for _, f in fitted]
    return weights + [final_norm.weight], formats


def fused_weight(lin: nn.Module) -> tuple[torch.Tensor, int] | None:
    """(weight, format) of a linear layer for decoder_layers; None for one it cannot run (fp32 / fp16, a bias)."""
    if isinstance(lin, QLinear):
        return None if lin.bias is not None else (lin.qweight, eagle_kernels.decoder.FORMATS[lin.qtype])
    if lin.bias is None and lin.weight.dtype == torch.bfloat16 and lin.weight.is_contiguous():
        return lin.weight, eagle_kernels.decoder.FORMATS["bf16"]
    return None
