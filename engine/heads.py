"""EAGLE draft heads in the official checkpoint formats: EAGLE-1 (feature regression) and EAGLE-3 (fused
multi-layer features, own draft vocabulary).

Both heads are one decoder layer that reads, for a draft position t, the pair (hidden_t, token_{t+1}):
`hidden_t` is the target's feature at t (first draft step) or the head's own output at t (later steps), and
the token is embedded with the target's (frozen) embedding. Protocol shared by both heads:

    hidden = head.target_feature(feature, captured)        # target features -> the head's input width H
                                                            # = head.project(head.raw_feature(..)), row-wise
    out = head(ids, hidden, positions, kv_cache, meta)      # inference: one layer over the head's paged cache
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
  A head over the full vocabulary (draft_vocab_size absent or equal to vocab_size) may omit d2t / t2d.

As published, heads also come as pytorch_model.bin (a torch pickle): it is read with
torch.load(weights_only=True) only, must be a flat name -> tensor dict, and `python -m engine.heads convert
DIR` rewrites it once as model.safetensors (preferred when both exist). Rotary `inv_freq` buffers that some
exports carry are ignored (the head computes its own from its config), as is a copy of the embedding.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from .config import LlamaConfig
import eagle_kernels
from .model import MLP, Attention, AttnMeta, Linear, Llama, QEmbedding, QLinear, RMSNorm, Rotary, fused_weight

# Fused engine weights and the official per-projection names they are stored as (in concatenation order).
_SPLIT = {"self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                        "self_attn.v_proj.weight"),
          "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}
# Stored by some exporters; the head always uses the target's own embedding (frozen during training).
_IGNORED = {"embed_tokens.weight"}
# Rotary buffers saved by older transformers (e.g. layers.0.self_attn.rotary_emb.inv_freq): derived from the
# config's rope settings, recomputed by the head.
_IGNORED_SUFFIX = "rotary_emb.inv_freq"
SAFETENSORS, TORCH_BIN = "model.safetensors", "pytorch_model.bin"


class HeadLayer(nn.Module):
    """The head's decoder layer: attention over `in_dim`-wide inputs, then the usual residual MLP."""

    def __init__(self, cfg: LlamaConfig, in_dim: int):
        super().__init__()
        self.self_attn = Attention(cfg, in_dim=in_dim)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(cfg)

    def mlp_block(self, h):
        return h + self.mlp(self.post_attention_layernorm(h))


class DraftHead(nn.Module):
    """What EAGLE-1 and EAGLE-3 share; subclasses define `_layer_input`, `logits`, `raw_feature`, `project`."""
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
        self.fused, self._fused = True, None  # CPU steps through eagle_kernels.decoder_layers (see _stack)

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
        cos, sin = self.rotary(positions, torch.float32)
        stack = self._stack() if eagle_kernels.decoder_layers_fit(residual) else None
        if stack is not None:  # the same kernels as below in one C++ call (CPU steps)
            out = residual.clone()  # the residual stream, updated in place to the layer's output
            with eagle_kernels.unchecked():
                eagle_kernels.decoder_layers(out, *stack, self.cfg.rms_eps, cos, sin, list(kv_cache),
                                             meta.slot_mapping, meta.block_tables, meta.cu_seqlens_q,
                                             meta.prefix_lens, meta.tree_mask, self.cfg.num_heads,
                                             first_input=x.contiguous())
            return out
        h = residual + self.layer.self_attn(x, cos, sin, kv_cache, meta)
        return self.layer.mlp_block(h)

    def _stack(self):
        """The layer's weights for eagle_kernels.decoder_layers (its attention input comes as first_input, so
        the input-norm slot is a placeholder, as is the final norm's, whose output goes unused), or None where
        a linear does not fit it or `fused` is off. Built on first use, dropped by .to()."""
        if not self.fused:
            return None
        if self._fused is None:
            layer = self.layer
            attn, mlp = layer.self_attn, layer.mlp
            fitted = [fused_weight(lin) for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            norm = layer.post_attention_layernorm.weight
            self._fused = False if None in fitted or norm.dtype != torch.bfloat16 else (
                [norm, fitted[0][0], fitted[1][0], norm, fitted[2][0], fitted[3][0], norm], [f for _, f in fitted])
        return self._fused or None

    def _apply(self, fn, *args, **kwargs):
        self._fused = None
        return super()._apply(fn, *args, **kwargs)

    def chain_weights(self) -> tuple[list[torch.Tensor], list[int]] | None:
        """The weights and formats eagle_kernels.draft_chain drafts a chain with, or None where it cannot."""
        return None

    def _layer_input(self, ids, hidden):
        """-> (attention input [.., in_dim], residual [.., H])."""
        raise NotImplementedError

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def target_feature(self, feature: torch.Tensor, captured: list[torch.Tensor]) -> torch.Tensor:
        return self.project(self.raw_feature(feature, captured))

    def raw_feature(self, feature: torch.Tensor, captured: list[torch.Tensor]) -> torch.Tensor:
        """The target features `project` reads, one row per token: [.., raw_width] (may be a view of the
        target's outputs; a caller that keeps it copies it)."""
        raise NotImplementedError

    @property
    def raw_width(self) -> int:
        return self.cfg.hidden_size * max(1, len(self.capture))

    def project(self, raw: torch.Tensor) -> torch.Tensor:
        """raw_feature rows -> the head's input width H, row by row."""
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

    def raw_feature(self, feature, captured):
        return feature

    def project(self, raw):
        return raw

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

    def chain_weights(self):
        """eagle_kernels.draft_chain's weights (named by eagle_kernels.draft.WEIGHTS) and formats, or None where
        one does not fit: the layer outside decoder_layers, fc or the LM head with a bias or in fp32, a table
        that is not bf16 or block-quantized bf16 rows."""
        stack, emb = self._stack(), self.embed_tokens
        fc, lm_head = fused_weight(self.fc), fused_weight(self.lm_head)
        if isinstance(emb, QEmbedding):
            table = (emb.qweight, eagle_kernels.decoder.FORMATS[emb.qtype]) if emb.dtype == torch.bfloat16 else None
        else:
            table = (emb.weight, 0) if emb.weight.dtype == torch.bfloat16 else None
        norms = [n.weight for n in (self.midlayer.input_layernorm, self.midlayer.hidden_norm, self.norm)]
        if stack is None or None in (fc, lm_head, table) or any(n.dtype != torch.bfloat16 for n in norms):
            return None
        (post_norm, qkv, o, _, gate_up, down, _), layer_formats = stack
        weights = [fc[0], table[0], norms[0], norms[1], qkv, o, post_norm, gate_up, down, norms[2], lm_head[0]]
        return weights, [fc[1], table[1], *layer_formats, lm_head[1]]

    def raw_feature(self, feature, captured):
        # captured: the inputs of target layers (low, mid, high), each [.., H]
        return torch.cat(captured, dim=-1)

    def project(self, raw):
        return self.fc(raw)

    def config_dict(self):
        return {**super().config_dict(), "draft_vocab_size": self.lm_head.out_features}


HEADS = {"eagle": Eagle1Head, "eagle3": Eagle3Head}


def quantize_like_target(head: DraftHead, target: Llama) -> DraftHead:
    """The head as served beside a block-quantized target: every linear of its own (fc, the layer, EAGLE-3's
    LM head over the draft vocabulary) in the format of the target's projections, so a draft step reads ~0.6
    bytes a weight (Q4_1) instead of bf16's 2. The shipped head accepts as often this way as in bf16 or with
    a Q8_0 LM head (benchmarks/RESULTS.md, session 11). In place; a dense target leaves the head as it is.
    For inference only: a trainer works on the dense weights and saves them."""
    proj = target.layers[0].self_attn.qkv_proj
    if not isinstance(proj, QLinear):
        return head
    linears = [(head, "fc"), (head.layer.self_attn, "qkv_proj"), (head.layer.self_attn, "o_proj"),
               (head.layer.mlp, "gate_up_proj"), (head.layer.mlp, "down_proj")]
    if isinstance(head, Eagle3Head):
        linears.append((head, "lm_head"))
    for owner, name in linears:
        lin = getattr(owner, name)
        if isinstance(lin, nn.Linear) and quant_supported(lin):
            setattr(owner, name, QLinear.of(lin, proj.qtype))
    head._fused = None
    return head


def quant_supported(lin: nn.Linear) -> bool:
    from eagle_kernels.quant import supports
    return supports(lin.out_features, lin.in_features)


def check_compatible(cfg: LlamaConfig, target_cfg: LlamaConfig, where: str = "head"):
    if cfg.hidden_size != target_cfg.hidden_size or cfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(f"{where} has hidden size {cfg.hidden_size} and vocabulary {cfg.vocab_size}; the "
                         f"target has {target_cfg.hidden_size} and {target_cfg.vocab_size} (a head for another model?)")


def head_config(target_cfg: LlamaConfig, **overrides) -> LlamaConfig:
    """A one-layer head config with the target's dimensions (for fresh heads)."""
    return replace(target_cfg, num_layers=1, **overrides)


def new_head(kind: str, target: Llama, intermediate_size: int | None = None, **kwargs) -> DraftHead:
    """A randomly initialised head of `kind` ("eagle" / "eagle3") for `target` (training, tests); its MLP as wide
    as the target's unless `intermediate_size` says otherwise."""
    if kind not in HEADS:
        raise ValueError(f"head kind must be one of {', '.join(HEADS)}, got {kind!r}")
    weight = next(target.parameters())  # the target's device and compute dtype (norms stay dense)
    cfg = head_config(target.cfg, **({"intermediate_size": intermediate_size} if intermediate_size else {}))
    return HEADS[kind](cfg, target, **kwargs).to(weight.device, weight.dtype).eval()


def detect_kind(names) -> str:
    """Official layouts differ in the layer's name: `layers.0.*` (EAGLE-1) or `midlayer.*` (EAGLE-3)."""
    if any(n.startswith("midlayer.") for n in names):
        return "eagle3"
    if any(n.startswith("layers.0.") for n in names):
        return "eagle"
    raise ValueError("not an EAGLE head: no layers.0.* (EAGLE-1) or midlayer.* (EAGLE-3) tensors")


def load_head(path: str | Path, target: Llama, kind: str | None = None) -> DraftHead:
    """config.json + model.safetensors or pytorch_model.bin (official names) -> a head sharing `target`'s
    embedding / LM head, in the target's dtype and device. `kind` ("eagle" / "eagle3"), when given, must
    match the checkpoint."""
    path = Path(path)
    if not (path / "config.json").exists() or weights_file(path) is None:
        raise ValueError(f"head {path}: expected config.json and {SAFETENSORS} (or {TORCH_BIN}) there")
    raw = json.loads((path / "config.json").read_text())
    if raw.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"head {path}: {raw['num_hidden_layers']} layers; EAGLE heads have one")
    if raw.get("target_hidden_size", raw["hidden_size"]) != raw["hidden_size"]:
        raise ValueError(f"head {path}: target_hidden_size != hidden_size is not supported")
    cfg = LlamaConfig.from_hf(raw)
    tensors = read_weights(path)
    found = detect_kind(tensors)
    if kind is not None and found != kind:
        raise ValueError(f"head {path} is an {found} head, the method needs an {kind} head")
    check_compatible(cfg, target.cfg, f"head {path}")
    if found == "eagle":
        head = Eagle1Head(cfg, target, bias="fc.bias" in tensors)
    else:
        lm_head = tensors.get("lm_head.weight")
        # Official configs state draft_vocab_size; without it the LM head's rows say it.
        vd = raw.get("draft_vocab_size") or (lm_head.shape[0] if lm_head is not None else None)
        head = Eagle3Head(cfg, target, vd)
        _vocab_map(head, tensors, path)
    _load_tensors(head, tensors, path)
    weight = next(target.parameters())  # the target's device and compute dtype (norms stay dense)
    return head.to(weight.device, weight.dtype).eval()


def _vocab_map(head: Eagle3Head, tensors: dict[str, torch.Tensor], path: Path):
    """Completes and checks the draft -> target mapping in `tensors`. A full-vocabulary head may omit d2t
    (draft id = target id: the head keeps its identity d2t / t2d, as the official loader does); a missing
    t2d follows from d2t."""
    Vd, V = head.lm_head.out_features, head.cfg.vocab_size
    if "d2t" not in tensors:
        if Vd != V:
            raise ValueError(f"head {path}: missing tensor d2t (its draft vocabulary has {Vd} of {V} tokens)")
        tensors["d2t"], tensors["t2d"] = head.d2t, head.t2d
        return
    d2t = tensors["d2t"]
    if d2t.shape != (Vd,) or d2t.is_floating_point() or d2t.is_complex() or d2t.dtype == torch.bool:
        raise ValueError(f"head {path}: d2t must be integer [{Vd}], got {d2t.dtype} {tuple(d2t.shape)}")
    ids = torch.arange(Vd) + d2t.long()
    if Vd and (ids.min() < 0 or ids.max() >= V):
        raise ValueError(f"head {path}: d2t maps draft ids outside the target vocabulary [0, {V})")
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    if "t2d" not in tensors:
        tensors["t2d"] = t2d
    elif tensors["t2d"].shape == (V,) and not torch.equal(tensors["t2d"].bool(), t2d):
        raise ValueError(f"head {path}: t2d does not mark exactly the target ids of d2t")


def weights_file(path: str | Path) -> Path | None:
    """The head's weights: model.safetensors, else pytorch_model.bin, else None."""
    for name in (SAFETENSORS, TORCH_BIN):
        if (Path(path) / name).is_file():
            return Path(path) / name
    return None


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a head directory's weights file (see `weights_file`), on the CPU."""
    file = weights_file(path)
    if file is None:
        raise ValueError(f"head {path}: no {SAFETENSORS} or {TORCH_BIN} there")
    if file.name == TORCH_BIN:
        return read_torch_bin(file)
    from safetensors import safe_open
    with safe_open(str(file), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def read_torch_bin(file: str | Path) -> dict[str, torch.Tensor]:
    """A pytorch_model.bin state dict, unpickled with torch's weights-only unpickler (which builds tensors
    and plain containers and calls nothing else, so no code in the file runs); anything but a flat
    dict of str -> Tensor is refused."""
    try:
        obj = torch.load(str(file), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - whatever the unpickler refuses, say why in one line
        raise ValueError(f"{file}: refused, not a plain tensor checkpoint ({_load_error(e)})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{file}: refused, expected a dict of name -> tensor, found a {type(obj).__name__}")
    for k, v in obj.items():
        if not isinstance(k, str) or not isinstance(v, torch.Tensor):
            raise ValueError(f"{file}: refused, expected a flat dict of name -> tensor, entry {k!r} is a "
                             f"{type(v).__name__}")
    return dict(obj)


def _load_error(e: Exception) -> str:
    """The informative line of a torch.load error (the weights-only unpickler's reason), on one line."""
    text = str(e)
    marker = "WeightsUnpickler error: "
    if marker in text:
        text = text.split(marker, 1)[1]
        text = text.split(". ", 1)[0]
    text = " ".join(text.split())
    return f"{type(e).__name__}: {text[:200]}"


def convert_checkpoint(path: str | Path, out: str | Path | None = None, overwrite: bool = False) -> Path:
    """One-time conversion of a head's pytorch_model.bin (read as `read_torch_bin` does) to
    model.safetensors, written to `out` (default: next to it; config.json is copied there), so that later
    loads read safetensors. Tensor names and dtypes are kept. -> the written file."""
    path = Path(path)
    src = path / TORCH_BIN
    if not src.is_file():
        raise ValueError(f"{path}: no {TORCH_BIN} to convert")
    out = Path(out) if out is not None else path
    dst = out / SAFETENSORS
    if dst.exists() and not overwrite:
        raise ValueError(f"{dst} exists already (pass --force to replace it)")
    tensors = read_torch_bin(src)
    detect_kind(tensors)  # refuse what is not an EAGLE head before writing anything
    from safetensors.torch import save_file
    out.mkdir(parents=True, exist_ok=True)
    seen, flat = set(), {}
    for name, t in tensors.items():
        # safetensors stores each tensor alone: views and tensors sharing storage are copied out.
        storage = t.untyped_storage()
        shared = storage.data_ptr() in seen or storage.nbytes() != t.nbytes or not t.is_contiguous()
        seen.add(storage.data_ptr())
        flat[name] = t.contiguous().clone() if shared else t
    tmp = dst.with_name(dst.name + ".tmp")
    save_file(flat, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, dst)  # a partial file is never taken for the head's weights
    if (path / "config.json").exists() and out.resolve() != path.resolve():
        shutil.copyfile(path / "config.json", out / "config.json")
    return dst


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
            embedding = (head.target_cfg.vocab_size, head.target_cfg.hidden_size)
            if tuple(t.shape) != embedding:
                raise ValueError(f"head {path}: {name} has shape {tuple(t.shape)}, the target's embedding "
                                 f"is {embedding}")
            continue
        if name.endswith(_IGNORED_SUFFIX) and name not in expected:
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.heads", description="EAGLE head checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser("convert", help="rewrite a head's pytorch_model.bin as model.safetensors (read "
                                          "with torch.load(weights_only=True): no code in it runs)")
    conv.add_argument("dir", help="head directory with pytorch_model.bin (and config.json)")
    conv.add_argument("--out", help="directory to write model.safetensors (+ config.json) to; default: DIR")
    conv.add_argument("--force", action="store_true", help="replace an existing model.safetensors")
    args = parser.parse_args(argv)
    try:
        dst = convert_checkpoint(args.dir, args.out, overwrite=args.force)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(dst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
