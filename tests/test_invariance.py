"""A request's tokens do not depend on its batch companions, their order, how its prompt is chunked, the thread
count or the CPU's instruction set (tests/invariance_probe.py says what is compared).

The probe runs in this process on the machine's best kernels, and again in a subprocess under each narrower
instruction set the CPU has (EAGLE_CPU_AMX=0: AVX-512 VNNI instead of AMX tiles; EAGLE_CPU_AVX512=0: the AVX2
kernels of AVX2-only CPUs), so a run on an AVX-512 or AMX machine also proves the AVX2 path; every run's
outputs must be the same bits."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import invariance_probe

ROOT = Path(__file__).resolve().parent.parent


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((l for l in text.splitlines() if l.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


FLAGS = _cpu_flags()
# The narrower instruction sets this CPU can also run, as the environment that selects each.
NARROWER = ({"no-amx": {"EAGLE_CPU_AMX": "0"}} if "amx_int8" in FLAGS else {}) | (
    {"avx2": {"EAGLE_CPU_AVX512": "0", "EAGLE_CPU_AMX": "0"}} if "avx512f" in FLAGS else {})
# What the subprocesses re-run: the configs whose kernels differ by instruction set (quantized: AMX / VNNI /
# AVX2 int8; dense: the AVX-512 / AVX2 linear and attention kernels).
NARROW_CONFIGS = ("bf16-quantized", "bf16-dense")


@pytest.fixture(scope="module")
def outputs():
    with torch.inference_mode():
        return invariance_probe.run()


@pytest.mark.parametrize("config", list(invariance_probe.CONFIGS))
def test_alone_batched_reordered_and_chunked_agree(outputs, config):
    """The probe asserted the equalities while it ran; here: it covered every method of this config, greedy and
    sampled, and the chunked features."""
    _, _, methods, lengths, modes = invariance_probe.CONFIGS[config]
    expected = {f"{config}/features"} | {f"{config}/{m}/{mode}" for m in methods for mode in modes}
    assert expected <= set(outputs)
    for key in expected - {f"{config}/features"}:
        assert [len(o) for o in outputs[key]] == [invariance_probe.NEW_TOKENS] * len(lengths), key


def test_greedy_speculation_equals_vanilla(outputs):
    for config, (_, _, methods, _, _) in invariance_probe.CONFIGS.items():
        for method in methods:
            assert outputs[f"{config}/{method}/greedy"] == outputs[f"{config}/vanilla/greedy"], (config, method)


@pytest.mark.parametrize("isa", list(NARROWER) or [pytest.param("none", marks=pytest.mark.skip(
    reason="this CPU has no AVX-512 / AMX: its kernels are the narrowest, checked in-process"))])
def test_every_instruction_set_gives_the_same_bits(outputs, isa, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("EAGLE_CPU_AMX", "EAGLE_CPU_AVX512")}
    env |= NARROWER[isa]
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = tmp_path / "probe.pt"
    proc = subprocess.run([sys.executable, "-m", "tests.invariance_probe", str(out), *NARROW_CONFIGS],
                          env=env, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = torch.load(out)
    assert theirs and set(theirs) <= set(outputs)
    for key, value in theirs.items():
        same = torch.equal(value, outputs[key]) if isinstance(value, torch.Tensor) else value == outputs[key]
        assert same, f"{key} differs under {isa}"
