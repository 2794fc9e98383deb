"""Owns the model and the paged KV-cache tensors; turns per-sequence token lists into one packed forward.

Metadata (slots, block tables, prefix lengths) is built once per step and shared by every layer.
"""
from __future__ import annotations

import torch

from .block_manager import BlockManager
from .model import AttnMeta


class ModelRunner:
    def __init__(self, model, cfg, kv_cache_gb: float = 0.5, block_size: int = 16, num_blocks: int | None = None):
        """num_blocks, when given, overrides kv_cache_gb (a draft's cache mirrors the target's block count)."""
        self.model, self.cfg = model, cfg
        weight = model.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype
        per_block = 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * weight.element_size()
        num_blocks = num_blocks or int(kv_cache_gb * 2**30 // per_block)
        if num_blocks < 1:
            raise ValueError(f"--kv-cache-gb {kv_cache_gb} holds no block of {per_block} bytes")
        # kv: [layers, 2, blocks, block_size, Hkv, D]. Zero-filled: slots past a sequence's end may be
        # read inside a partially filled block, and masked garbage (NaN * 0) must not leak into outputs.
        self.kv = torch.zeros(cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                              dtype=self.dtype, device=self.device)
        self.kv_layers = [(self.kv[i, 0], self.kv[i, 1]) for i in range(cfg.num_layers)]
        self.blocks = BlockManager(num_blocks, block_size)

    def _tensor(self, data, dtype) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)

    def build_meta(self, seq_ids: list[int], counts: list[int], tree_mask=None) -> tuple[AttnMeta, list[int], list[int]]:
        """Allocate cache room for `counts[i]` new tokens of each sequence; -> metadata, prefix lengths,
        cu_seqlens (as a list, so callers never read it back from the device)."""
        prefix = [self.blocks.length(s) for s in seq_ids]
        slots = [slot for s, n in zip(seq_ids, counts) for slot in self.blocks.allocate(s, n)]
        tables = [self.blocks.block_table(s) for s in seq_ids]
        width = max(len(t) for t in tables)
        cu = [0]
        for n in counts:
            cu.append(cu[-1] + n)
        meta = AttnMeta(
            slot_mapping=self._tensor(slots, torch.int64),
            block_tables=self._tensor([t + [0] * (width - len(t)) for t in tables], torch.int32),
            cu_seqlens_q=self._tensor(cu, torch.int32),
            prefix_lens=self._tensor(prefix, torch.int32),
            tree_mask=tree_mask)
        return meta, prefix, cu

    @torch.inference_mode()
    def forward(self, seq_ids: list[int], tokens: list[list[int]], positions: list[list[int]] | None = None,
                tree_mask: torch.Tensor | None = None, capture: tuple[int, ...] = ()):
        """Append `tokens[i]` to sequence `seq_ids[i]` in the cache and run the target over them.

        positions default to the cache positions (prefix + 0..n-1); trees pass prefix + depth.
        -> (feature [T, H], captured layer inputs, cu_seqlens list)."""
        counts = [len(t) for t in tokens]
        meta, prefix, cu = self.build_meta(seq_ids, counts, tree_mask)
        if positions is None:
            positions = [list(range(p, p + n)) for p, n in zip(prefix, counts)]
        ids = self._tensor([t for toks in tokens for t in toks], torch.int64)
        pos = self._tensor([p for ps in positions for p in ps], torch.int64)
        feature, captured = self.model(ids, pos, self.kv_layers, meta, capture)
        return feature, captured, cu

    def last_positions(self, cu: list[int]) -> list[int]:
        return [c - 1 for c in cu[1:]]
