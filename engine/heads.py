"""EAGLE draft heads in the official checkpoint formats: EAGLE-1 (feature regression) and EAGLE-3 (fused
multi-layer features, own draft vocabulary).

Both heads are one decoder layer that reads, for a draft position t, the pair (hidden_t, token_{t+1}):
`hidden_t` is the target's feature at t (first draft step) or the head's own output at t (later steps), and
the token is embedded with the target's (frozen) embedding. Protocol shared by both heads:

    hidden = head.target_feature(feature, captured)        # target features -> the head's input width H
    out = head(ids, hidden, positions, kv_cache, meta)      # inference: one layer over the head's paged cache
    out, (k, v) = head.forward_dense(ids, hidden, positions, mask, past_kv)   # training: dense, no cache
    logits = head.logits(out)                               # fp32 over the draft vocabulary
    target_ids = head.to_target(draft_ids)                  # identity for EAGLE-1

`out` is what the next draft step consumes as `hidden` (EAGLE-1: the predicted target feature; EAGLE-3: the
layer's pre-norm output). Positions are relative only (RoPE); the engine puts pair t at position t.

The target's embedding (both) and LM head (EAGLE-1) are shared by reference and are not parameters of the
head: `head.parameters()` is exactly what a trainer optimises and `save` writes.

Checkpoint formats (config.json + model.safetensors, official key names; q/k/v and gate/up are stored
split and fused on load):
- EAGLE-1: fc.weight [H, 2H], fc.bias [H] (unless config "bias": false), layers.0.self_attn.{q,k,v,o}_proj,
  layers.0.post_attention_layernorm, layers.0.mlp.{gate,up,down}_proj. No input_layernorm: fc's output
  feeds attention directly.
- EAGLE-3: fc.weight [H, 3H], midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight,
  midlayer.self_attn.* (q/k/v over 2H inputs), midlayer.mlp.*, norm.weight, lm_head.weight [Vd, H],
  d2t int64 [Vd] (target id = draft id + d2t[draft id]), t2d bool [V]; config "draft_vocab_size".
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from eagle_kernels import apply_rope

from .config import LlamaConfig
from .model import MLP, Attention, AttnMeta, Linear, Llama, RMSNorm, Rotary

# Fused engine weights and the official per-projection names they are stored as (in concatenation order).
_SPLIT = {"self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                        "self_attn.v_proj.weight"),
          "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}
# Stored by some exporters; the head always uses the target's own embedding (frozen during training).
_IGNORED = {"embed_tokens.weight"}


class HeadLayer(nn.Module):
    """The head's decoder layer: attention over `in_dim`-wide inputs, then the usual residual MLP."""

    def __init__(self, cfg: LlamaConfig, in_dim: int):
        super().__init__()
        self.self_attn = Attention(cfg, in_dim=in_dim)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(cfg)

    def mlp_block(self, h):
        return h + self.mlp(self.post_attention_layernorm(h))


def dense_attention(attn: Attention, x, cos, sin, mask, past_kv=None):
    """Attention without a cache. x: [B, S, in_dim]; cos, sin: [B, S, D]; mask: bool [B or 1, S, Sp + S]
    (True = attend; every row needs one True), the first Sp key columns being `past_kv`.
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


class DraftHead(nn.Module):
    """What EAGLE-1 and EAGLE-3 share; subclasses define `_layer_input`, `logits`, `target_feature`."""
    kind: str
    layer: HeadLayer

    def __init__(self, cfg: LlamaConfig, target: Llama):
        super().__init__()
        check_compatible(cfg, target.cfg)
        # The head's rope table must cover the target's context even if its config says less.
        self.cfg = replace(cfg, num_layers=1, max_position=max(cfg.max_position, target.cfg.max_position))
        self.target_cfg = target.cfg
        self._target = (target.embed_tokens, target.lm_head)  # a tuple: shared, not registered
        self.rotary = Rotary(self.cfg)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._target[0]

    @property
    def capture(self) -> tuple[int, ...]:
        """Target layers whose inputs `target_feature` needs (passed as the target forward's `capture`)."""
        return ()

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]

    def forward(self, ids, hidden, positions, kv_cache, meta: AttnMeta):
        """Inference over the head's paged cache. ids, positions: [T]; hidden: [T, H]; kv_cache: the head's
        (k_cache, v_cache) [blocks, block_size, Hkv, D]; meta as for the target. -> out [T, H]."""
        x, residual = self._layer_input(ids, hidden)
        cos, sin = self.rotary(positions, x.dtype)
        h = residual + self.layer.self_attn(x, cos, sin, kv_cache, meta)
        return self.layer.mlp_block(h)

    def forward_dense(self, ids, hidden, positions, mask, past_kv=None):
        """Training forward over whole sequences, no cache.

        ids: int64 [B, S]; positions: int64 [B, S] or [S]; hidden: [B, S, H]; mask: bool [S, Sp + S] or
        [B, S, Sp + S], True where query s may attend key j; the first Sp key columns are `past_kv` = (k, v)
        [B, Hkv, Sp, D] returned by an earlier call. -> (out [B, S, H], (k, v) [B, Hkv, Sp + S, D]).

        Training-time test (EAGLE-3) unrolls K steps: step 0 runs with a causal mask over the real prefix;
        step i feeds step i-1's `out` (shifted by one token) with `past_kv` = step i-1's keys, its mask
        letting query s see the step-0 keys at <= s and, for each earlier step, only its own key s.
        """
        if mask.dim() == 2:
            mask = mask[None]
        positions = positions.expand(ids.shape)
        x, residual = self._layer_input(ids, hidden)
        cos, sin = self.rotary(positions, x.dtype)
        attn, kv = dense_attention(self.layer.self_attn, x, cos, sin, mask, past_kv)
        return self.layer.mlp_block(residual + attn), kv

    def _layer_input(self, ids, hidden):
        """-> (attention input [.., in_dim], residual [.., H])."""
        raise NotImplementedError

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def target_feature(self, feature: torch.Tensor, captured: list[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def save(self, path: str | Path):
        """Write config.json + model.safetensors in the official format (loadable by `load_head`)."""
        from safetensors.torch import save_file
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for name, t in self.state_dict().items():
            for suffix, parts in _SPLIT.items():
                if name.endswith(suffix):
                    base = name[: -len(suffix)]
                    pieces = self._split_sizes(suffix)
                    for part, piece in zip(parts, t.split(pieces, dim=0)):
                        tensors[base + part] = piece.contiguous()
                    break
            else:
                tensors[name] = t.contiguous()
        save_file(tensors, str(path / "model.safetensors"))
        (path / "config.json").write_text(json.dumps(self.config_dict(), indent=2) + "\n")

    def _split_sizes(self, fused: str) -> list[int]:
        c = self.cfg
        if fused.startswith("self_attn"):
            return [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
        return [c.intermediate_size, c.intermediate_size]

    def config_dict(self) -> dict:
        return self.cfg.to_hf()  # num_layers is 1 by construction


class Eagle1Head(DraftHead):
    """EAGLE-1: fc(cat[embed(token), feature]) -> one layer without input norm -> the target's LM head."""
    kind = "eagle"
    d2t = None  # the target's vocabulary

    def __init__(self, cfg: LlamaConfig, target: Llama, bias: bool = True):
        super().__init__(cfg, target)
        H = cfg.hidden_size
        self.fc = Linear(2 * H, H, bias=bias)
        self.layers = nn.ModuleList([HeadLayer(self.cfg, H)])

    @property
    def layer(self) -> HeadLayer:
        return self.layers[0]

    def _layer_input(self, ids, hidden):
        x = self.fc(torch.cat([self.embed_tokens(ids).to(hidden.dtype), hidden], dim=-1))
        return x, x

    def logits(self, out):
        return self._target[1](out).float()

    def target_feature(self, feature, captured):
        return feature

    def config_dict(self):
        return {**super().config_dict(), "bias": self.fc.bias is not None}


class Eagle3Head(DraftHead):
    """EAGLE-3: fc fuses the target's low/mid/high features; attention reads
    cat[input_layernorm(embed(token)), hidden_norm(hidden)]; own final norm and LM head over a draft vocab."""
    kind = "eagle3"

    def __init__(self, cfg: LlamaConfig, target: Llama, draft_vocab_size: int | None = None):
        super().__init__(cfg, target)
        if len(set(self.capture)) != 3:
            raise ValueError(f"EAGLE-3 fuses three distinct target layers; a {target.cfg.num_layers}-layer "
                             f"target gives {self.capture}")
        H, V = cfg.hidden_size, cfg.vocab_size
        Vd = draft_vocab_size or V
        if not 0 < Vd <= V:
            raise ValueError(f"draft_vocab_size must be in [1, {V}], got {Vd}")
        self.fc = Linear(3 * H, H, bias=False)
        self.midlayer = HeadLayer(self.cfg, 2 * H)
        self.midlayer.input_layernorm = RMSNorm(H, cfg.rms_eps)
        self.midlayer.hidden_norm = RMSNorm(H, cfg.rms_eps)
        self.norm = RMSNorm(H, cfg.rms_eps)
        self.lm_head = Linear(H, Vd, bias=False)
        # Until a trainer sets the real mapping, draft id i is target id i.
        self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.int64))
        self.register_buffer("t2d", torch.arange(V) < Vd)

    @property
    def layer(self) -> HeadLayer:
        return self.midlayer

    @property
    def capture(self):
        return self.target_cfg.eagle3_layers

    def _layer_input(self, ids, hidden):
        emb = self.midlayer.input_layernorm(self.embed_tokens(ids).to(hidden.dtype))
        return torch.cat([emb, self.midlayer.hidden_norm(hidden)], dim=-1), hidden

    def logits(self, out):
        return self.lm_head(self.norm(out)).float()

    def target_feature(self, feature, captured):
        # captured: the inputs of target layers (low, mid, high), each [T, H]
        return self.fc(torch.cat(captured, dim=-1))

    def config_dict(self):
        return {**super().config_dict(), "draft_vocab_size": self.lm_head.out_features}


HEADS = {"eagle": Eagle1Head, "eagle3": Eagle3Head}


def check_compatible(cfg: LlamaConfig, target_cfg: LlamaConfig, where: str = "head"):
    if cfg.hidden_size != target_cfg.hidden_size or cfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(f"{where} has hidden size {cfg.hidden_size} and vocabulary {cfg.vocab_size}; the "
                         f"target has {target_cfg.hidden_size} and {target_cfg.vocab_size} (a head for another model?)")


def head_config(target_cfg: LlamaConfig, **overrides) -> LlamaConfig:
    """A one-layer head config with the target's dimensions (for fresh heads)."""
    return replace(target_cfg, num_layers=1, **overrides)


def new_head(kind: str, target: Llama, **kwargs) -> DraftHead:
    """A randomly initialised head of `kind` ("eagle" / "eagle3") for `target` (training, tests)."""
    if kind not in HEADS:
        raise ValueError(f"head kind must be one of {', '.join(HEADS)}, got {kind!r}")
    weight = target.embed_tokens.weight
    return HEADS[kind](head_config(target.cfg), target, **kwargs).to(weight.device, weight.dtype).eval()


def detect_kind(names) -> str:
    """Official layouts differ in the layer's name: `layers.0.*` (EAGLE-1) or `midlayer.*` (EAGLE-3)."""
    if any(n.startswith("midlayer.") for n in names):
        return "eagle3"
    if any(n.startswith("layers.0.") for n in names):
        return "eagle"
    raise ValueError("not an EAGLE head: no layers.0.* (EAGLE-1) or midlayer.* (EAGLE-3) tensors")


def load_head(path: str | Path, target: Llama, kind: str | None = None) -> DraftHead:
    """config.json + model.safetensors (official names) -> a head sharing `target`'s embedding / LM head,
    in the target's dtype and device. `kind` ("eagle" / "eagle3"), when given, must match the checkpoint."""
    from safetensors import safe_open
    path = Path(path)
    if not (path / "config.json").exists() or not (path / "model.safetensors").exists():
        raise ValueError(f"head {path}: expected config.json and model.safetensors there")
    raw = json.loads((path / "config.json").read_text())
    if raw.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"head {path}: {raw['num_hidden_layers']} layers; EAGLE heads have one")
    if raw.get("target_hidden_size", raw["hidden_size"]) != raw["hidden_size"]:
        raise ValueError(f"head {path}: target_hidden_size != hidden_size is not supported")
    cfg = LlamaConfig.from_hf(raw)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    found = detect_kind(tensors)
    if kind is not None and found != kind:
        raise ValueError(f"head {path} is an {found} head, the method needs an {kind} head")
    check_compatible(cfg, target.cfg, f"head {path}")
    if found == "eagle":
        head = Eagle1Head(cfg, target, bias="fc.bias" in tensors)
    else:
        head = Eagle3Head(cfg, target, raw.get("draft_vocab_size"))
    _load_tensors(head, tensors, path)
    weight = target.embed_tokens.weight
    return head.to(weight.device, weight.dtype).eval()


def _load_tensors(head: DraftHead, tensors: dict[str, torch.Tensor], path: Path):
    expected = head.state_dict()
    loaded = {}
    for fused, parts in _SPLIT.items():
        for name in [n for n in expected if n.endswith(fused)]:
            base = name[: -len(fused)]
            if all(base + p in tensors for p in parts):
                loaded[name] = torch.cat([tensors.pop(base + p) for p in parts], dim=0)
    for name, t in tensors.items():
        if name in _IGNORED:
            if t.shape != head.embed_tokens.weight.shape:
                raise ValueError(f"head {path}: {name} has shape {tuple(t.shape)}, the target's embedding "
                                 f"is {tuple(head.embed_tokens.weight.shape)}")
            continue
        if name not in expected:
            raise ValueError(f"head {path}: unexpected tensor {name} for an {head.kind} head")
        loaded[name] = t
    for name, ref in expected.items():
        if name not in loaded:
            raise ValueError(f"head {path}: missing tensor {name}")
        if loaded[name].shape != ref.shape:
            raise ValueError(f"head {path}: {name} has shape {tuple(loaded[name].shape)}, expected "
                             f"{tuple(ref.shape)} from its config")
        loaded[name] = loaded[name].to(ref.dtype)
    head.load_state_dict(loaded)
