"""What tests/test_invariance.py checks, as a function that returns every output it compared, so the same
probe runs in-process and, with EAGLE_CPU_AVX512=0 / EAGLE_CPU_AMX=0, in a subprocess (the instruction-set
switches are read once per process): `python -m tests.invariance_probe OUT.pt [CONFIG ...]`.

Each probe asserts, on the real SmolLM2 target, that a request's tokens are the same alone (1 thread), in a
batch of prompts of mixed lengths around every kernel threshold (2 threads), and in that batch reversed;
greedy and seeded sampled; and that the target's features for a prompt are the same bits prefilled in one
chunk, in uneven chunks, token by token, and beside another sequence.
"""
from __future__ import annotations

import sys

import torch

METHOD_ARGS = {
    "vanilla": {},
    "eagle3": {"depth": 2, "topk": 2, "tree_tokens": 4},        # the shipped head, a fixed small tree
    "sps": {"draft": "early-exit:24", "draft_len": 3},
    "eagle": {"head": "random", "depth": 2, "topk": 2, "tree_tokens": 4},  # EAGLE-1: no shipped head
    "auto": {},                                                           # adaptive: greedy only (see README)
}
# Prompt lengths around the kernels' thresholds: dense linears switch kernels at 8 (AVX-512) / 32 (AVX2)
# rows, quantized ones at 16 (AMX), attention cuts tasks at 48 query rows (16 tokens x 3 heads) and once
# sent > 32-token prefills elsewhere; 1-token and long prompts at the ends.
LENGTHS = (1, 8, 16, 17, 33, 48, 130)
SHORT = (1, 17, 48, 70)
NEW_TOKENS = 6
BOTH, GREEDY = ("greedy", "sampled"), ("greedy",)
# (dtype, weights, methods, prompt lengths, modes): every CPU dtype, quantized and dense weights; every method
# on one config or another, greedy and seeded sampled on the default (bf16 activations, quantized weights) and
# on dense bf16 weights; the other configs take fewer prompts and greedy requests (the same sampling code).
CONFIGS = {
    "bf16-quantized": ("bfloat16", "auto", ("vanilla", "eagle3", "sps"), LENGTHS, BOTH),
    "fp32-quantized": ("float32", "auto", ("vanilla", "auto"), SHORT, GREEDY),
    "bf16-dense": ("bfloat16", "dense", ("vanilla", "eagle3", "eagle"), SHORT, BOTH),
    "fp32-dense": ("float32", "dense", ("vanilla",), SHORT, GREEDY),
    "fp16-dense": ("float16", "dense", ("vanilla",), SHORT, GREEDY),
}
TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
        "movable metal type, oil-based ink and a wooden screw press into a system that could produce books "
        "faster and more cheaply than ever before. Within a few decades presses had spread to more than two "
        "hundred cities across Europe, and the number of books in circulation grew from thousands to millions. "
        "Scholars argue about how much the press changed the way people thought, but few doubt that it changed "
        "how quickly ideas could travel: pamphlets, newspapers, scientific journals and cheap novels all followed. "
        "Today we take printed text for granted, yet each page still carries a little of that first experiment.")


def _prompts(llm, lengths=LENGTHS) -> list[list[int]]:
    ids = llm.tokenizer.encode(TEXT)
    assert len(ids) >= max(lengths), len(ids)
    return [ids[:n] for n in lengths]


def _generate(llm, prompts, params, threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        seqs, _ = llm.generate(prompts, params)
    finally:
        torch.set_num_threads(old)
    return [s.output_ids for s in seqs]


def check_requests(llm, method: str, name: str, lengths, modes) -> dict:
    """Greedy and seeded sampled tokens alone, batched and batched in reverse: all equal, or AssertionError."""
    from engine.scheduler import SamplingParams
    llm.set_method(method, METHOD_ARGS[method])
    prompts = _prompts(llm, lengths)
    out = {}
    for mode in modes:
        params = [SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                 **({} if mode == "greedy" else {"temperature": 0.9, "top_p": 0.95, "seed": 7 + i}))
                  for i in range(len(prompts))]
        alone = [_generate(llm, [p], [sp], threads=1)[0] for p, sp in zip(prompts, params)]
        batched = _generate(llm, prompts, params, threads=2)
        reverse = _generate(llm, prompts[::-1], params[::-1], threads=2)[::-1]
        for n, a, b, r in zip(lengths, alone, batched, reverse):
            assert a == b == r, f"{name} {method} {mode}: the {n}-token prompt gave {a} alone, {b} batched, {r} reversed"
        out[f"{name}/{method}/{mode}"] = alone
    return out


def check_chunks(llm, name: str) -> dict:
    """The target's final features for one prompt: one chunk == uneven chunks == token by token == beside
    another sequence, bit for bit (through the runner's test entry, on a block pool of its own)."""
    from engine.block_manager import BlockManager
    prompt, other = _prompts(llm, (70, 48))
    blocks = BlockManager(llm.runner.num_blocks, llm.runner.block_size)
    splits = {"one chunk": [len(prompt)], "uneven chunks": [23, 1, 15, 31], "token by token": [1] * len(prompt)}
    feats = {}
    for sid, (how, sizes) in enumerate(splits.items()):
        parts, at = [], 0
        for size in sizes:
            feature, _, _ = llm.runner.forward(blocks, [sid], [prompt[at:at + size]])
            parts.append(feature)
            at += size
        feats[how] = torch.cat(parts)
        blocks.free(sid)
    feature, _, cu = llm.runner.forward(blocks, [10, 11], [other, prompt])
    feats["beside another"] = feature[cu[1]:cu[2]]
    blocks.free(10)
    blocks.free(11)
    for how, f in feats.items():
        assert torch.equal(f, feats["one chunk"]), f"{name}: features prefilled {how} differ from one chunk"
    return {f"{name}/features": feats["one chunk"]}


def run(names=tuple(CONFIGS)) -> dict:
    from engine.llm import LLM
    out = {}
    for name in names:
        dtype, weights, methods, lengths, modes = CONFIGS[name]
        llm = LLM("smollm2-135m", dtype, device="cpu", kv_cache_gb=0.1, max_batch=len(lengths), threads=1,
                  weights=weights)
        with torch.inference_mode():
            out |= check_chunks(llm, name)
        for method in methods:
            out |= check_requests(llm, method, name, lengths, modes)
        del llm
    return out


if __name__ == "__main__":
    torch.save(run(sys.argv[2:] or tuple(CONFIGS)), sys.argv[1])
