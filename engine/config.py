"""Model configuration: the Llama hyper-parameters the engine needs, read from HF config.json or GGUF."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF "rope_scaling" dict; rope_type "llama3" is supported
    max_position: int = 8192
    tie_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @property
    def eagle3_layers(self) -> tuple[int, int, int]:
        """Layers whose inputs EAGLE-3 fuses: low, mid, high features."""
        return (2, self.num_layers // 2, self.num_layers - 3)

    @classmethod
    def from_hf(cls, cfg: dict) -> "LlamaConfig":
        num_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        # Meta's checkpoints say "rope_scaling"; transformers >= 5 writes "rope_parameters" (with theta).
        scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        theta = cfg.get("rope_theta") or (scaling or {}).get("rope_theta", 10000.0)
        if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
            scaling = None
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads", num_heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position=cfg.get("max_position_embeddings", 8192),
            tie_embeddings=cfg.get("tie_word_embeddings", False),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos,
        )

    def to_hf(self) -> dict:
        """The inverse of from_hf, for writing checkpoints (tests, trained heads)."""
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_eps, "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling, "max_position_embeddings": self.max_position,
            "tie_word_embeddings": self.tie_embeddings, "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids), "hidden_act": "silu",
        }
