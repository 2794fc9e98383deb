"""Owns the paged KV-cache tensors and runs a model (the target or a draft) over one step's tokens.

A `StepPlan` (plain Python, from the scheduler's block tables) says where each sequence's new tokens go.
The runner turns it into attention metadata with one host-to-device copy and runs the model. Every cache
(the target's, a draft's) has the same block geometry and shares the scheduler's tables. One block past
the pool is scratch: table padding points at it, so padded batch rows and draft positions past a table
write there and nowhere else.

Fixed-shape steps (a decode step, a draft step, a verify step) run through `StepGraph`s: static input
buffers per batch bucket, filled by one copy, then a CUDA graph replay (CUDA) or the same code run eagerly
(CPU, or graphs off). Padded rows are invisible: callers read only the first B rows of the outputs.
"""
from __future__ import annotations

import array
from dataclasses import dataclass
from typing import Callable

import torch

from .model import AttnMeta


@dataclass
class StepPlan:
    """Where a step's new tokens go, per sequence (host values)."""
    tables: list[list[int]]   # block ids
    starts: list[int]         # cache position of the first new token
    counts: list[int]         # new tokens

    def padded(self, batch: int) -> "StepPlan":
        """The plan with `batch - B` empty-table rows (their tokens write to the scratch block)."""
        extra = batch - len(self.tables)
        n = self.counts[-1]
        return StepPlan(self.tables + [[]] * extra, self.starts + [0] * extra, self.counts + [n] * extra)


def bucket(batch: int) -> int:
    """CUDA-graph batch buckets: 1, 2, 4, 8, 16, 32, ..."""
    return 1 << max(0, batch - 1).bit_length()


class ModelRunner:
    def __init__(self, model, cfg, dtype: torch.dtype, device: torch.device, num_blocks: int, block_size: int,
                 max_model_len: int, cuda_graphs: bool = False):
        self.model, self.cfg, self.dtype, self.device = model, cfg, dtype, device
        self.num_blocks, self.block_size = num_blocks, block_size
        self.scratch = num_blocks                              # block id of the scratch block
        self.width = -(-max_model_len // block_size) + 1       # block-table columns (fixed: no recompiles)
        self.cuda_graphs = cuda_graphs and device.type == "cuda"
        self.bucketed = self.cuda_graphs  # pad batches to buckets (tests turn it on for the CPU too)
        self.kv = self.new_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        self.layers = kv_layers(self.kv)
        self._staging = Staging(device)
        self._padding = array.array("i")  # a table row's padding: scratch block ids
        self._pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None

    @staticmethod
    def blocks_for_budget(cfg, dtype: torch.dtype, block_size: int, gb: float, extra_per_token: int = 0) -> int:
        """Blocks of the target's KV cache, and of `extra_per_token` elements a token beside it (a draft's
        caches and stores), that fit in `gb`."""
        per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim + extra_per_token
        per_block = block_size * per_token * dtype.itemsize
        num_blocks = int(gb * 2**30 // per_block)
        if num_blocks < 1:
            raise ValueError(f"--kv-cache-gb {gb} holds no block of {per_block} bytes")
        return num_blocks

    def new_cache(self, num_layers: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
        """kv: [layers, 2, blocks + 1 (scratch), block_size, Hkv, D]. Zero-filled: slots past a sequence's
        end may be read inside a partially filled block, and masked garbage (NaN * 0) must not leak."""
        return torch.zeros(num_layers, 2, self.num_blocks + 1, self.block_size, num_kv_heads, head_dim,
                           dtype=self.dtype, device=self.device)

    def new_store(self, width: int) -> torch.Tensor:
        """Per-token rows by cache slot, [slots (with scratch), width], for state a method keeps of every
        target step beside its KV (EAGLE's head inputs): written and moved by the same slots."""
        return torch.zeros((self.num_blocks + 1) * self.block_size, width, dtype=self.dtype, device=self.device)

    # --- metadata ------------------------------------------------------------------------------------------

    def _plan_ints(self, plan: StepPlan, ids: list[int] | None) -> array.array:
        """int32 [slots T | cache positions T | cu B + 1 | prefix B | tables B * width | ids T]. Built with
        C-level extends: the tables are B * width ints a step (mostly padding), too many for a Python loop
        at large batches."""
        bs, width, scratch = self.block_size, self.width, self.scratch
        slots, pos, cu = array.array("i"), array.array("i"), array.array("i", [0])
        for table, start, n in zip(plan.tables, plan.starts, plan.counts):
            for p in range(start, start + n):
                blk = p // bs
                slots.append((table[blk] if blk < len(table) else scratch) * bs + p % bs)
            pos.extend(range(start, start + n))
            cu.append(cu[-1] + n)
        if len(self._padding) != width:
            self._padding = array.array("i", [scratch]) * width
        out = slots + pos + cu
        out.extend(plan.starts)
        for t in plan.tables:
            out.extend(t[:width])
            out.extend(self._padding[:width - len(t)])
        if ids:
            out.extend(ids)
        return out

    def _views(self, buf: torch.Tensor, plan: StepPlan, tree_mask=None, with_ids=False):
        """Metadata views into one int32 device buffer laid out by _plan_ints."""
        B, T = len(plan.counts), sum(plan.counts)
        o = [0, T, 2 * T, 2 * T + B + 1, 2 * T + 2 * B + 1, 2 * T + 2 * B + 1 + B * self.width]
        meta = AttnMeta(slot_mapping=buf[o[0]:o[1]], block_tables=buf[o[4]:o[5]].view(B, self.width),
                        cu_seqlens_q=buf[o[2]:o[3]], prefix_lens=buf[o[3]:o[4]], tree_mask=tree_mask)
        ids = buf[o[5]:o[5] + T] if with_ids else None
        return meta, buf[o[1]:o[2]], ids

    def meta(self, plan: StepPlan, ids: list[int] | None = None, tree_mask=None):
        """-> (AttnMeta, cache positions int32 [T], ids int32 [T] or None), all from one copy."""
        buf = self._staging.to_device(self._plan_ints(plan, ids))
        meta, pos, ids = self._views(buf, plan, tree_mask, ids is not None)
        meta.slot_mapping = meta.slot_mapping.long()  # widened once per step, not in every layer
        return meta, pos, ids

    @torch.inference_mode()
    def forward(self, blocks, seq_ids: list[int], tokens: list[list[int]], capture: tuple[int, ...] = ()):
        """Append tokens[i] to sequence seq_ids[i] in `blocks` (a BlockManager; room is reserved) and run the
        target over them, causally. For callers outside the decoders: tests, benchmarks, the trainer's online
        target features (train/features.py).
        -> (feature [T, H], captured layer inputs, cu_seqlens list)."""
        starts = [blocks.length(s) for s in seq_ids]
        for s, start, t in zip(seq_ids, starts, tokens):
            blocks.reserve(s, start + len(t))
        plan = StepPlan([blocks.block_table(s) for s in seq_ids], starts, [len(t) for t in tokens])
        meta, pos, ids = self.meta(plan, ids=[t for ts in tokens for t in ts])
        feature, captured = self.model(ids, pos, self.layers, meta, capture)
        cu = [0]
        for t in tokens:
            cu.append(cu[-1] + len(t))
        return feature, captured, cu

    def to_device(self, ints: list[int]) -> torch.Tensor:
        """Host ints -> int64 [n] on the device, through the staging copy (a pageable copy would sync)."""
        return self._staging.to_device(ints).long()

    def index(self, ints: list[int]) -> torch.Tensor:
        """Host ints -> an int32 index tensor on the device (index_select takes int32)."""
        return self._staging.to_device(ints)

    def batch_rows(self, batch: int) -> int:
        return bucket(batch) if self.bucketed else batch

    # --- running ---------------------------------------------------------------------------------------------

    def graph(self, graphs: dict, key: tuple, plan: StepPlan, fn: Callable, inputs: dict[str, tuple],
              host_ids: bool = False) -> "StepGraph":
        """The StepGraph of `key` in `graphs` (the caller's: graphs live and die with the decoder whose `fn`
        they run), built on first use: static metadata for plan's shape and static `inputs` (name ->
        (shape, dtype) or (shape, dtype, fill): what rows no caller fills hold, 0 by default); `fn(graph)`
        computes the outputs from graph.meta and graph.inputs."""
        g = graphs.get(key)
        if g is None:
            g = graphs[key] = StepGraph(self, plan, fn, inputs, host_ids)
        return g


def kv_layers(kv: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(kv[i, 0], kv[i, 1]) for i in range(kv.shape[0])]


class Staging:
    """Host ints -> an int32 device tensor in one copy. On CUDA through pinned buffers used in a ring, each
    reused only once its last copy has completed (an event), so no copy waits for the device."""
    RING = 8

    def __init__(self, device: torch.device):
        self.device, self.cuda = device, device.type == "cuda"
        self._bufs, self._events, self._next = [None] * self.RING, [None] * self.RING, 0

    def to_device(self, ints: "list[int] | array.array", out: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(ints, array.array):
            ints = array.array("i", ints)
        host = torch.frombuffer(ints, dtype=torch.int32) if ints else torch.empty(0, dtype=torch.int32)
        if not self.cuda:
            return host if out is None else out.copy_(host)
        i, self._next = self._next, (self._next + 1) % self.RING
        if self._events[i] is not None:
            self._events[i].synchronize()
        if self._bufs[i] is None or self._bufs[i].numel() < len(ints):
            self._bufs[i] = torch.empty(max(len(ints), 4096), dtype=torch.int32, pin_memory=True)
        pinned = self._bufs[i][:len(ints)]
        pinned.copy_(host)
        out = torch.empty(len(ints), dtype=torch.int32, device=self.device) if out is None else out
        out.copy_(pinned, non_blocking=True)
        self._events[i] = torch.cuda.Event()
        self._events[i].record()
        return out


class StepGraph:
    """One fixed-shape step: a static int32 metadata buffer, static named inputs and the outputs of `fn`.
    `run` fills the buffers (one host copy for the metadata, and the token ids with `host_ids`; device copies
    for the inputs, except that an eager step without padding reads a contiguous input of the buffer's shape
    where the caller has it) and replays the captured CUDA graph, or calls `fn` eagerly where graphs are off;
    outputs are the same tensors each time."""

    def __init__(self, runner: ModelRunner, plan: StepPlan, fn: Callable, inputs: dict[str, tuple],
                 host_ids: bool = False):
        self.runner, self.fn = runner, fn
        self.pad_ids = [0] * sum(plan.counts) if host_ids else None
        n = len(runner._plan_ints(plan, self.pad_ids))
        self.buf = torch.zeros(n, dtype=torch.int32, device=runner.device)
        self.meta, self.positions, self.ids = runner._views(self.buf, plan, with_ids=host_ids)
        self.slots = self.meta.slot_mapping                  # int32 view of buf; widened by run()
        self.meta.slot_mapping = torch.zeros(self.slots.shape, dtype=torch.int64, device=runner.device)
        self.static = {k: torch.full(spec[0], spec[2] if len(spec) > 2 else 0, dtype=spec[1], device=runner.device)
                       for k, spec in inputs.items()}
        self.inputs = dict(self.static)  # what fn reads: the static buffers (or, eager, the callers' own tensors)
        if "tree_mask" in self.inputs:  # rows no caller fills (padded sequences) see themselves
            mask = self.inputs["tree_mask"]
            n = mask.shape[0] // len(plan.counts)
            own = torch.arange(mask.shape[0], device=mask.device) % n
            mask.scatter_(1, (own // 32)[:, None], (1 << (own % 32)).int()[:, None])
            self.meta.tree_mask = mask
        self.cuda_graph, self.out = None, None

    def run(self, plan: StepPlan, host_ids: list[int] | None = None, **inputs):
        """host_ids: token ids of the first rows, staged with the metadata (padded rows get token 0)."""
        ids = None if host_ids is None else host_ids + self.pad_ids[len(host_ids):]
        self.runner._staging.to_device(self.runner._plan_ints(plan, ids), out=self.buf)
        self.meta.slot_mapping.copy_(self.slots)
        for k, v in inputs.items():  # the first rows: padded ones keep what they hold
            dst = self.static[k]
            if (not self.runner.cuda_graphs and v.shape == dst.shape and v.dtype == dst.dtype
                    and v.is_contiguous() and dst is not self.meta.tree_mask):
                self.inputs[k] = v  # eager and unpadded: the caller's tensor serves as it is, no copy op
            else:
                (dst if v.shape[0] == dst.shape[0] else dst[:v.shape[0]]).copy_(v, non_blocking=True)
                self.inputs[k] = dst
        if not self.runner.cuda_graphs:
            self.out = self.fn(self)
        elif self.cuda_graph is None:
            self._capture()
        else:
            self.cuda_graph.replay()
        return self.out

    def _capture(self):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.fn(self)                                   # warm-up: Triton compiles, allocator settles
        torch.cuda.current_stream().wait_stream(stream)
        self.cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.cuda_graph, pool=self.runner._pool):
            self.out = self.fn(self)
        self.cuda_graph.replay()
