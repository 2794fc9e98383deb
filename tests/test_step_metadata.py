"""The step metadata's host layout (ModelRunner._plan_ints, built with C-level extends) against a plain
reference of the layout its views read: slots, positions, cu_seqlens, prefix lengths, padded block tables, ids."""
import random

import pytest
import torch

from engine.model_runner import ModelRunner, StepPlan


def reference(plan: StepPlan, ids, block_size: int, width: int, scratch: int) -> list[int]:
    slots, pos, cu = [], [], [0]
    for table, start, n in zip(plan.tables, plan.starts, plan.counts):
        for p in range(start, start + n):
            blk = p // block_size
            slots.append((table[blk] if blk < len(table) else scratch) * block_size + p % block_size)
            pos.append(p)
        cu.append(cu[-1] + n)
    tables = [b for t in plan.tables for b in (t[:width] + [scratch] * (width - len(t)))]
    return slots + pos + cu + list(plan.starts) + tables + list(ids or [])


@pytest.mark.parametrize("seed", range(6))
def test_plan_ints_match_the_reference_layout(seed):
    from engine.config import LlamaConfig
    from engine.model import Llama
    rng = random.Random(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16, rms_eps=1e-5, rope_theta=10000.0, max_position=rng.choice([40, 64, 100]),
                      eos_token_ids=(2,))
    block_size = rng.choice([4, 16])
    runner = ModelRunner(Llama(cfg), cfg, torch.float32, torch.device("cpu"), 32, block_size, cfg.max_position)
    for _ in range(20):
        B = rng.randint(1, 6)
        tables = [rng.sample(range(32), rng.randint(0, runner.width)) for _ in range(B)]  # [] for padded rows
        starts = [rng.randint(0, max(0, len(t) * block_size - 1)) for t in tables]
        counts = [rng.randint(0, 5) for _ in range(B)]
        plan = StepPlan(tables, starts, counts)
        ids = [rng.randint(0, 63) for _ in range(sum(counts))] if rng.random() < 0.5 else None
        got = runner._plan_ints(plan, ids)
        assert list(got) == reference(plan, ids, block_size, runner.width, runner.scratch)
        meta, pos, staged = runner.meta(plan, ids=ids)
        assert meta.block_tables.shape == (B, runner.width)
        assert pos.tolist() == [p for s, n in zip(starts, counts) for p in range(s, s + n)]
        assert (staged is None) == (ids is None) and (ids is None or staged.tolist() == ids)
