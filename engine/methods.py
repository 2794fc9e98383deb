"""The decoding methods `LLM` can run (`--method`), each a factory from the loaded LLM to a decoder."""
from __future__ import annotations

from typing import Callable

from .decoding import Decoder, VanillaDecoder
from .device import defaults
from .spec_eagle import EagleDecoder, eagle_head, shipped_head
from .spec_sps import SpSDecoder, load_draft
from .trees import DynamicTree, StaticTree


def check_args(method: str, args: dict, allowed: set[str]):
    unknown = sorted(set(args) - allowed)
    if unknown:
        flags = ", ".join("--" + a.replace("_", "-") for a in unknown)
        raise ValueError(f"{flags} not used by --method {method} (it takes: "
                         f"{', '.join('--' + a.replace('_', '-') for a in sorted(allowed)) or 'nothing'})")


def make_vanilla(llm) -> Decoder:
    check_args("vanilla", llm.method_args, set())
    return VanillaDecoder(llm.runner, llm.sampler, llm.scheduler.blocks)


def make_sps(llm) -> Decoder:
    args = llm.method_args
    check_args("sps", args, {"draft", "draft_len"})
    model, cfg = load_draft(args.get("draft", "early-exit:10"), llm.model, llm.runner.dtype, llm.runner.device)
    return SpSDecoder(llm.runner, llm.sampler, llm.scheduler.blocks, model, cfg, args.get("draft_len", 4),
                      timing=llm.timing)


def make_eagle(llm, kind: str, adaptive: bool = False) -> Decoder:
    """adaptive (or --adaptive): a SpeculationPolicy (LLM.step's) picks each round's depth, 0 .. the dynamic
    tree's."""
    args = llm.method_args
    check_args(kind, args, {"head", "tree", "depth", "topk", "tree_tokens", "min_prob", "adaptive", "lookup"})
    head = eagle_head(args.get("head"), kind, llm.model)
    shape = args.get("tree", "dynamic")
    if shape == "dynamic":
        preset = defaults(llm.runner.device)
        d, k, m = preset.tree
        tree = DynamicTree(args.get("depth", d), args.get("topk", k), args.get("tree_tokens", m),
                           args.get("min_prob", preset.min_prob))
        adaptive = args.get("adaptive", adaptive)
        lookup = args.get("lookup", preset.lookup if tree.chain else 0)
    elif shape == "static":
        check_args(f"{kind} --tree static", args, {"head", "tree"})
        tree, adaptive, lookup = StaticTree(), False, 0
    else:
        raise ValueError(f"--tree must be 'dynamic' or 'static', got {shape!r}")
    return EagleDecoder(llm.runner, llm.sampler, llm.scheduler.blocks, head, tree, timing=llm.timing,
                        adaptive=adaptive, lookup=lookup)


def make_auto(llm) -> Decoder:
    """EAGLE-3 with the adaptive policy when a shipped head fits the target (or --head is given), else vanilla."""
    if llm.method_args.get("head") or shipped_head("eagle3", llm.model.cfg):
        return make_eagle(llm, "eagle3", adaptive=True)
    return make_vanilla(llm)


def draft_elements_per_token(method: str, cfg) -> int:
    """Cache elements a method keeps per token beside the target's KV, counted in the KV budget: EAGLE's head
    KV (one layer shaped like the target's) and inputs (up to three target features, EAGLE-3). SpS's draft
    cache is not counted: its size depends on --draft."""
    if method in ("eagle", "eagle3", "auto"):
        return 2 * cfg.num_kv_heads * cfg.head_dim + 3 * cfg.hidden_size
    return 0


METHODS: dict[str, Callable] = {
    "vanilla": make_vanilla,
    "sps": make_sps,
    "eagle": lambda llm: make_eagle(llm, "eagle"),
    "eagle3": lambda llm: make_eagle(llm, "eagle3"),
    "auto": make_auto,
}
