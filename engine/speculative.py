"""Speculative decoding, the parts every method shares: one-forward verification of a batch of draft trees
with lossless acceptance, keeping the accepted path's KV, the draft's own paged cache, round statistics,
and the method factories registered in `engine.llm.METHODS`.

Cache invariant between rounds: the target cache holds every token of a sequence but the last (the root
of the next tree), exactly as in vanilla decoding. A round appends the whole tree to the target cache,
then moves the accepted path's KV to contiguous positions and truncates the rest.

Methods: spec_sps.py (SpS: a draft LM proposes a chain), spec_eagle.py (EAGLE-1/2/3: a head proposes a
tree); tree construction lives in trees.py.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import eagle_kernels
from .model_runner import ModelRunner
from .sampler import Sampler
from .scheduler import Sequence
from .trees import Tree

HEADS_DIR = Path(__file__).parent / "heads"  # shipped trained heads: engine/heads/<name>/


@dataclass
class Verdict:
    """The outcome of verifying a batch of trees."""
    paths: list[list[int]]        # accepted node indices per sequence, root first
    new_tokens: list[list[int]]   # accepted draft tokens + the bonus / corrected token
    rows: torch.Tensor            # int64 [sum(len(path))]: the accepted nodes' rows in `feature`
    feature: torch.Tensor         # [T, H] target features of every verified node
    captured: list[torch.Tensor]  # the target's captured layer inputs, [T, H] each


@torch.inference_mode()
def verify(runner: ModelRunner, sampler: Sampler, seqs: list[Sequence], tree: Tree, capture=(),
           draft_probs: torch.Tensor | None = None) -> Verdict:
    """Run the target once over every tree (root + drafts) and accept the longest lossless path.

    Greedy rows accept while the draft token equals the target's argmax; sampled rows use tree rejection
    sampling (`draft_probs` [B, N, V]: chains drawn from a draft distribution, else top-k drafts).
    The accepted path's KV is kept; everything else in the tree is rolled back."""
    ids = [s.seq_id for s in seqs]
    prefixes = [runner.blocks.length(i) for i in ids]
    sizes = tree.sizes.tolist()
    tokens = [row[:n] for row, n in zip(tree.tokens.tolist(), sizes)]
    positions, mask = None, None
    if not tree.chain:
        index = eagle_kernels.build_tree(tree.parents, tree.sizes)
        positions = [[p + d for d in row[:n]] for p, row, n in zip(prefixes, index.depths.tolist(), sizes)]
        mask = torch.cat([m[:n] for m, n in zip(index.mask, sizes)])                     # [T, W]
    feature, captured, cu = runner.forward(ids, tokens, positions, mask, capture)
    logits = runner.model.logits(feature)                                                # [T, V]
    # rows[b, i]: the packed row of node i of tree b (padding repeats the last node).
    node = torch.arange(tree.tokens.shape[1], device=logits.device)
    starts = torch.tensor(cu[:-1], device=logits.device)
    rows = starts[:, None] + torch.minimum(node[None], tree.sizes.to(logits.device)[:, None] - 1)
    path, length, nxt = accept(sampler, seqs, tree, logits, rows, draft_probs)
    lengths = length.tolist()  # the round's one host sync: the accepted lengths (and paths, same copy)
    paths = [p[:n + 1] for p, n in zip(path.tolist(), lengths)]
    keep_paths(runner, ids, prefixes, paths)
    new_tokens = [[tok[i] for i in p[1:]] + [t] for tok, p, t in zip(tokens, paths, nxt.tolist())]
    kept = torch.tensor([c + i for c, p in zip(cu, paths) for i in p], device=feature.device)
    return Verdict(paths, new_tokens, kept, feature, captured)


def accept(sampler: Sampler, seqs, tree: Tree, logits, rows, draft_probs):
    """-> accept_path int32 [B, N], accept_len int32 [B], next_token int64 [B] (greedy and sampled rows
    each through their kernel)."""
    B, N = tree.tokens.shape
    path = torch.full((B, N), -1, dtype=torch.int32)
    length = torch.zeros(B, dtype=torch.int32)
    nxt = torch.zeros(B, dtype=torch.int64)
    greedy = [b for b, s in enumerate(seqs) if s.params.greedy]
    sampled = [b for b, s in enumerate(seqs) if not s.params.greedy]
    for group, greedy_group in ((greedy, True), (sampled, False)):
        if not group:
            continue
        g = torch.tensor(group, device=tree.tokens.device)
        args = (tree.parents[g], tree.tokens[g], tree.sizes[g])
        if greedy_group:
            out = eagle_kernels.tree_accept_greedy(*args, logits.argmax(-1)[rows[g]])
        else:
            probs = sampler.probs(logits[rows[g]], [seqs[b].params for b in group])       # [G, N, V]
            uniforms = torch.rand(len(group), N + 1, generator=sampler.generator, device=logits.device)
            out = eagle_kernels.tree_accept_sample(*args, probs, uniforms,
                                                   None if draft_probs is None else draft_probs[g])
        path[group], length[group], nxt[group] = (t.cpu() for t in out)
    return path, length, nxt


def keep_paths(runner: ModelRunner, seq_ids, prefixes, paths):
    """Move each accepted path's KV (tree node i sits at prefix + i) to prefix + 0.., then truncate."""
    src, dst = [], []
    for sid, prefix, path in zip(seq_ids, prefixes, paths):
        slots = runner.blocks.slots(sid, prefix, prefix + max(path) + 1)
        moved = [(slots[node], slots[j]) for j, node in enumerate(path) if node != j]
        src += [s for s, _ in moved]
        dst += [d for _, d in moved]
    if src:
        src_t = torch.tensor(src, device=runner.device)
        dst_t = torch.tensor(dst, device=runner.device)
        for k_cache, v_cache in runner.kv_layers:
            eagle_kernels.move_kv(k_cache, v_cache, src_t, dst_t)
    for sid, prefix, path in zip(seq_ids, prefixes, paths):
        runner.blocks.truncate(sid, prefix + len(path))


class DraftCache:
    """A draft model's own paged KV cache, mirroring the target's block geometry: it can hold whatever the
    scheduler admitted (its lookahead covers the draft's extra tokens)."""

    def __init__(self, model, cfg, target: ModelRunner):
        self.runner = ModelRunner(model, cfg, block_size=target.blocks.block_size,
                                  num_blocks=target.blocks.num_blocks)
        self.blocks, self.target = self.runner.blocks, target

    def release_retired(self) -> list[int]:
        """Free the sequences the target no longer holds (retired or aborted); -> their ids."""
        gone = [sid for sid in self.blocks.tables if sid not in self.target.blocks.tables]
        for sid in gone:
            self.blocks.free(sid)
        return gone

    def truncate(self, seq_ids, lengths):
        for sid, n in zip(seq_ids, lengths):
            self.blocks.truncate(sid, n)


class SpeculativeDecoder:
    """What every draft-and-verify method shares: the draft's cache and per-sequence state, the target
    prefill, and round statistics. The scheduler retires sequences after a call returns, so their draft
    blocks and state are released at the start of the next call."""

    def __init__(self, runner: ModelRunner, sampler: Sampler, draft_model, draft_cfg):
        self.runner, self.sampler = runner, sampler
        self.cache = DraftCache(draft_model, draft_cfg, runner)
        self.state: dict[int, torch.Tensor] = {}  # seq_id -> what the next round drafts from
        self._stats = SpecStats()

    def stats(self) -> dict:
        """Counters since the last call (LLM.generate calls this once per run)."""
        out, self._stats = self._stats.as_dict(), SpecStats()
        return out

    def release_retired(self):
        for sid in self.cache.release_retired():
            self.state.pop(sid, None)

    def prefill_target(self, seqs: list[Sequence], capture=()):
        """Target prefill + first sampled token. -> (first tokens, feature [T, H], captured, cu_seqlens)."""
        self.release_retired()
        feature, captured, cu = self.runner.forward([s.seq_id for s in seqs], [s.prompt_ids for s in seqs],
                                                    capture=capture)
        logits = self.runner.model.logits(feature[self.runner.last_positions(cu)])
        return self.sampler(logits, [s.params for s in seqs]).tolist(), feature, captured, cu

    def timer(self, attr: str) -> "Timer":
        return Timer(self._stats, attr, self.runner.device)


@dataclass
class SpecStats:
    """Per-run counters: rounds are (sequence, verify) pairs; depth d is reached when >= d drafts pass."""
    rounds: int = 0
    reached: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0

    def record(self, paths: list[list[int]]):
        self.rounds += len(paths)
        for path in paths:
            for d in range(1, len(path)):
                if d > len(self.reached):
                    self.reached.append(0)
                self.reached[d - 1] += 1

    def as_dict(self) -> dict:
        n = max(self.rounds, 1)
        return {"tau": round(1 + sum(self.reached) / n, 3), "rounds": self.rounds,
                "accept_by_depth": [round(r / n, 3) for r in self.reached],
                "draft_s": round(self.draft_s, 4), "verify_s": round(self.verify_s, 4)}


class Timer:
    """Adds the wall time of a `with` block to stats.<attr> (synchronising CUDA so the split is real)."""

    def __init__(self, stats: SpecStats, attr: str, device: torch.device):
        self.stats, self.attr, self.cuda = stats, attr, device.type == "cuda"

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
        setattr(self.stats, self.attr, getattr(self.stats, self.attr) + time.perf_counter() - self.t0)


def depth_caps(seqs: list[Sequence], max_position: int) -> list[int]:
    """The deepest draft worth verifying per sequence: a round yields at most depth + 1 tokens, and tree
    positions (the root's + depth) must stay inside the model's context."""
    return [min(s.params.max_new_tokens - len(s.output_ids) - 1, max_position - len(s.all_ids)) for s in seqs]


def check_args(method: str, args: dict, allowed: set[str]):
    unknown = sorted(set(args) - allowed)
    if unknown:
        flags = ", ".join("--" + a.replace("_", "-") for a in unknown)
        raise ValueError(f"{flags} not used by --method {method} (it takes: "
                         f"{', '.join('--' + a.replace('_', '-') for a in sorted(allowed)) or 'nothing'})")


def make_sps(llm):
    from .spec_sps import SpSDecoder, load_draft
    args = llm.method_args
    check_args("sps", args, {"draft", "draft_len"})
    model, cfg = load_draft(args.get("draft", "early-exit:10"), llm.model, llm.runner.dtype, llm.runner.device)
    return SpSDecoder(llm.runner, llm.sampler, model, cfg, args.get("draft_len", 4))


def make_eagle(llm, kind: str):
    from .spec_eagle import EagleDecoder, eagle_head
    from .trees import DynamicTree, StaticTree
    args = llm.method_args
    check_args(kind, args, {"head", "tree", "depth", "topk", "tree_tokens"})
    head = eagle_head(args.get("head"), kind, llm.model)
    shape = args.get("tree", "dynamic")
    if shape == "dynamic":
        # Verifying is compute-bound on a CPU (4 rows cost ~1.1x one, 6 ~1.35x, 16 ~3x), so a small tree
        # wins there: depth 2, top-2, 4 verified tokens measured best for the shipped head
        # (benchmarks/RESULTS.md, bf16, 2 threads). GPUs verify dozens of tokens for the price of one:
        # EAGLE-2's defaults (depth 6, top-10, 60 tokens).
        d, k, m = (6, 10, 60) if llm.runner.device.type == "cuda" else (2, 2, 4)
        tree = DynamicTree(args.get("depth", d), args.get("topk", k), args.get("tree_tokens", m))
    elif shape == "static":
        check_args(f"{kind} --tree static", args, {"head", "tree"})
        tree = StaticTree()
    else:
        raise ValueError(f"--tree must be 'dynamic' or 'static', got {shape!r}")
    return EagleDecoder(llm.runner, llm.sampler, head, tree)


def make_auto(llm):
    """EAGLE-3 when a shipped head fits the target, else None (the caller falls back to vanilla)."""
    from .spec_eagle import shipped_head
    found = llm.method_args.get("head") or shipped_head("eagle3", llm.model.cfg)
    return make_eagle(llm, "eagle3") if found else None
