"""A lean Llama: RMSNorm, RoPE (plain and llama3-scaled), GQA attention over the paged KV cache, SwiGLU.

Tokens of all sequences in a step are packed into one flat batch (`T` tokens); `AttnMeta` says where each
sequence's new tokens live in the paged cache and which of them see each other (causal or tree mask).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import eagle_kernels
from .config import LlamaConfig


@dataclass
class AttnMeta:
    """Per-step attention metadata, built once by the model runner and shared by every layer."""
    slot_mapping: torch.Tensor   # int64 [T]: cache slot (block * block_size + offset) of each new token
    block_tables: torch.Tensor   # int32 [B, max_blocks]
    cu_seqlens_q: torch.Tensor   # int32 [B + 1]: new tokens of sequence b are q[cu[b]:cu[b+1]]
    prefix_lens: torch.Tensor    # int32 [B]: tokens already cached before the new ones
    tree_mask: torch.Tensor | None = None  # int32 [T, W] ancestor bitmask over the new tokens; None = causal


class Linear(nn.Linear):
    """nn.Linear through eagle_kernels.linear (a faster bf16 GEMV on CPUs without native bf16)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return eagle_kernels.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalised in fp32, rounded to the model dtype, then scaled: HF's order, in three ops.
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)


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
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, D]; cos, sin: [T, D]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, in_dim: int | None = None):
        super().__init__()
        self.nq, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        in_dim = in_dim or cfg.hidden_size
        # q, k and v in one matmul: one weight read per step instead of three.
        self.qkv_proj = Linear(in_dim, (self.nq + 2 * self.nkv) * self.hd, bias=False)
        self.o_proj = Linear(self.nq * self.hd, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, kv_cache, meta: AttnMeta):
        # x: [T, in_dim]
        T = x.shape[0]
        qkv = self.qkv_proj(x).view(T, self.nq + 2 * self.nkv, self.hd)
        qk = apply_rope(qkv[:, :self.nq + self.nkv], cos, sin)  # q and k heads rotated in one pass
        q, k, v = qk[:, :self.nq], qk[:, self.nq:], qkv[:, self.nq + self.nkv:]
        k_cache, v_cache = kv_cache
        eagle_kernels.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        o = eagle_kernels.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q,
                                          meta.prefix_lens, meta.tree_mask)
        return self.o_proj(o.reshape(T, self.nq * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(cfg)

    def forward(self, h, cos, sin, kv_cache, meta):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, kv_cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


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

    def forward(self, input_ids, positions, kv_caches, meta: AttnMeta, capture: tuple[int, ...] = ()):
        """input_ids, positions: [T]. Returns the final normed feature [T, H] (EAGLE-1's feature, the LM
        head's input) and the inputs of the layers in `capture` (EAGLE-3's low/mid/high features)."""
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, h.dtype)
        captured = []
        for i, layer in enumerate(self.layers):
            if i in capture:
                captured.append(h)
            h = layer(h, cos, sin, kv_caches[i], meta)
        return self.norm(h), captured

    def logits(self, feature: torch.Tensor) -> torch.Tensor:
        # feature: [N, H] -> fp32 logits [N, V]
        return self.lm_head(feature).float()
