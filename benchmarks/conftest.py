"""Bandwidth reporting for kernel benchmarks: achieved GB/s = bytes moved / median time, against the device peak.

GPU peaks come from a table of datasheet HBM/GDDR bandwidths keyed by device-name substrings; on CPU the
"peak" is a measured large torch copy (read + write), so the percentages say how close an op gets to what
this machine can actually stream.
"""
import functools
import os
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # kernel_refs_attention

# Datasheet peak memory bandwidth (GB/s). Ordered: the first matching substring wins (H100 NVL/PCIe before
# plain H100, which defaults to SXM).
GPU_PEAK_GBPS = [
    ("H200", 4800.0), ("GH200", 4000.0), ("H100 NVL", 3900.0), ("H100 PCIe", 2000.0), ("H100", 3350.0),
    ("H800", 3350.0), ("B200", 8000.0), ("A100-SXM4-80GB", 2039.0), ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0), ("A10G", 600.0), ("A10", 600.0), ("L40S", 864.0), ("L40", 864.0), ("L4", 300.0),
    ("RTX 4090", 1008.0), ("RTX 3090", 936.0), ("V100", 900.0), ("T4", 320.0),
]

_REPORT = []


@functools.lru_cache(maxsize=None)
def peak_gbps(device_type):
    """Peak GB/s of the current device: the datasheet value on CUDA, a measured copy on CPU."""
    if device_type == "cuda":
        name = torch.cuda.get_device_name()
        return next((gbps for key, gbps in GPU_PEAK_GBPS if key in name), float("nan"))
    return _cpu_copy_gbps()


def _cpu_copy_gbps(nbytes=256 << 20, reps=5):
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best / 1e9


def synced(fn, device):
    """fn wrapped so that the benchmark clock sees finished GPU work."""
    if device.type != "cuda":
        return fn

    def run():
        out = fn()
        torch.cuda.synchronize()
        return out
    return run


@pytest.fixture
def bandwidth(benchmark):
    """bandwidth(fn, nbytes, device): benchmark fn, then record/print GB/s and % of the device peak."""
    def measure(fn, nbytes, device):
        benchmark(synced(fn, device))
        stats = benchmark.stats.stats
        gbps = nbytes / stats.median / 1e9
        peak = peak_gbps(device.type)
        benchmark.extra_info.update(bytes=nbytes, gbps=round(gbps, 2), peak_gbps=round(peak, 1))
        # The min is reported too: on a shared CPU host the median mostly measures the neighbours.
        _REPORT.append(f"{benchmark.name:<58} median {stats.median * 1e6:>10.1f} us (min {stats.min * 1e6:>9.1f})"
                       f" {gbps:>8.2f} GB/s {100 * gbps / peak:>6.1f}% of {peak:.0f} GB/s ({device.type})")
    return measure


def pytest_terminal_summary(terminalreporter):
    if _REPORT:
        terminalreporter.section("achieved bandwidth (bytes moved / median time)")
        # On a shared 2-core host, 2 intra-op threads stall on each other's neighbours (10-30x slower
        # medians under load); OMP_NUM_THREADS=1 gives stable CPU numbers.
        terminalreporter.write_line(f"torch threads: {torch.get_num_threads()}, "
                                    f"load average: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
        for line in _REPORT:
            terminalreporter.write_line(line)
