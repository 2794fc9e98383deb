"""Reference: a draft head's layer over whole sequences, dense, without a cache (torch SDPA). The engine's
paged forward (tests/test_heads.py) and the trainer's training-time test (tests/test_train.py) are checked
against it."""
import torch
import torch.nn.functional as F

from eagle_kernels import apply_rope


def dense_attention(attn, x, cos, sin, mask, past_kv=None):
    """x: [B, S, in_dim]; cos, sin: [B, S, D]; mask: bool [B or 1, S, Sp + S] (True = attend; every row
    needs one True), the first Sp key columns being `past_kv`.
    -> (out [B, S, H], (k, v) [B, Hkv, Sp + S, D], rotated, past keys first)."""
    B, S, _ = x.shape
    nq, nkv, hd = attn.nq, attn.nkv, attn.hd
    q, k, v = attn.qkv_proj(x).split([nq * hd, nkv * hd, nkv * hd], -1)
    cos, sin = cos.reshape(B * S, hd), sin.reshape(B * S, hd)
    q = apply_rope(q.reshape(B * S, nq, hd), cos, sin).view(B, S, nq, hd).transpose(1, 2)
    k = apply_rope(k.reshape(B * S, nkv, hd), cos, sin).view(B, S, nkv, hd).transpose(1, 2)
    v = v.view(B, S, nkv, hd).transpose(1, 2)
    if past_kv is not None:
        k, v = torch.cat([past_kv[0], k], dim=2), torch.cat([past_kv[1], v], dim=2)
    if mask.shape[-1] != k.shape[2]:
        raise ValueError(f"mask has {mask.shape[-1]} key columns, there are {k.shape[2]} keys")
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=nq != nkv)
    return attn.o_proj(o.transpose(1, 2).reshape(B, S, nq * hd)), (k, v)


def dense_forward(head, ids, hidden, positions, mask, past_kv=None):
    """ids: int64 [B, S]; positions: int64 [B, S] or [S]; hidden: [B, S, H]; mask: bool [S, Sp + S] or
    [B, S, Sp + S], True where query s may attend key j; the first Sp key columns are `past_kv` = (k, v)
    [B, Hkv, Sp, D] returned by an earlier call. -> (out [B, S, H], (k, v) [B, Hkv, Sp + S, D]).

    A chain draft of K steps is step 0 with a causal mask over the real prefix, then step i feeding step
    i-1's `out` (shifted by one token) with `past_kv` = the keys so far."""
    if mask.dim() == 2:
        mask = mask[None]
    positions = positions.expand(ids.shape)
    x, residual = head._layer_input(ids, hidden)
    cos, sin = head.rotary(positions, x.dtype)
    attn, kv = dense_attention(head.layer.self_attn, x, cos, sin, mask, past_kv)
    return head.layer.mlp_block(residual + attn), kv
