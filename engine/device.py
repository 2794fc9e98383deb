"""The device choice (`--device {auto,cpu,cuda}`) and what each device defaults to.

The device is chosen once, by the caller, and passed down explicitly; nothing re-derives it from a weight.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class DeviceDefaults:
    dtype: str
    kv_cache_gb: float | None     # None: a share of the device memory left after the weights
    tree: tuple[int, int, int]    # EAGLE-2 dynamic tree: depth, top-k, verified tokens
    min_prob: float               # its confidence cut (trees.DynamicTree); 0: the whole shape every round
    lookup: int                   # chains: drafts looked up by the last this many tokens (engine.lookup); 0: off
    cuda_graphs: bool
    prefill_chunk: int            # the most prompt tokens a step prefills
    prefill_share: float | None   # while streams decode, a step's prefill takes about this share of their
                                  # round's time (adaptive.PrefillPacer); None: no pacing


# A CPU pays for every verified row (on AVX2 a quantized step is compute-bound from 2 rows), so a chain wins
# there: depth 2, top-1, 3 tokens, whose first level verifies 2 tokens where a top-2 tree's verifies 3
# (benchmarks/RESULTS.md, session 11: fixed EAGLE-3 1.02x / 0.94x vanilla against the (2, 2, 4) tree's 0.99x /
# 0.83x); a GPU verifies dozens of tokens for about the price of one: EAGLE-2's defaults (6, 10, 60).
# A CPU prefills a token for about a quarter of a batch-1 decode step, so a fixed chunk either stalls streams
# or starves prompts: there the chunk follows the decoding round's time; on a GPU (whose chunk times are not
# synchronised) a fixed budget, as vLLM's.
DEFAULTS = {
    "cpu": DeviceDefaults(dtype="bfloat16", kv_cache_gb=0.5, tree=(2, 1, 3), min_prob=0.0, lookup=3,
                          cuda_graphs=False, prefill_chunk=512, prefill_share=1.0),
    "cuda": DeviceDefaults(dtype="bfloat16", kv_cache_gb=None, tree=(6, 10, 60), min_prob=0.0, lookup=0,
                           cuda_graphs=True, prefill_chunk=2048, prefill_share=None),
}
CUDA_KV_SHARE = 0.8  # of the free memory after the weights (vLLM's gpu_memory_utilization is 0.9 of all)


class DeviceError(ValueError):
    pass


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """"auto" -> cuda when a GPU is visible, else cpu; "cuda" without one -> DeviceError (one line)."""
    name = str(name)
    if name not in DEVICE_CHOICES and not name.startswith("cuda:"):
        raise DeviceError(f"--device must be one of {', '.join(DEVICE_CHOICES)}, got {name!r}")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        why = "this torch has no CUDA support" if torch.version.cuda is None else "no GPU is visible"
        raise DeviceError(f"--device {name}: no CUDA device available ({why})")
    device = torch.device(name)
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise DeviceError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s)")
    return device


def defaults(device: torch.device) -> DeviceDefaults:
    return DEFAULTS["cuda" if device.type == "cuda" else "cpu"]


def add_device_arg(parser, default: str = "auto"):
    """The shared `--device` flag of the commands and benchmarks."""
    parser.add_argument("--device", default=default, choices=DEVICE_CHOICES,
                        help="auto = cuda when a GPU is visible, else cpu")
