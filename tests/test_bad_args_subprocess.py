"""Bad arguments to the C++-backed ops raise ValueError and leave the process alive.

Each case runs in a child process: if raising across the extension boundary crashed (as it did in a CUDA
build that loaded a second OpenMP runtime, see setup.py), the child dies by a signal and this test fails
instead of taking pytest down. Every case is the first error its process raises.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SETUP = """
import re, sys
import torch
import eagle_kernels
from eagle_kernels import attention
from eagle_kernels._ops import check_paged_attention_cpu, openmp_runtimes, ops

def paged_case(bad_block=False):
    q = torch.randn(3, 4, 64)
    k_cache, v_cache = torch.randn(2, 16, 2, 64), torch.randn(2, 16, 2, 64)
    tables = torch.tensor([[1 if not bad_block else 7]], dtype=torch.int32)
    cu, prefix = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
    return q, k_cache, v_cache, tables, cu, prefix

def tree_case():
    parents = torch.tensor([[-1, 0, 0, 1]] * 2, dtype=torch.int32)
    sizes = torch.tensor([4, 3], dtype=torch.int32)
    tokens = torch.tensor([[0, 1, 2, 3]] * 2)
    probs = torch.softmax(torch.randn(2, 4, 8), -1)
    return dict(parents=parents, tokens=tokens, sizes=sizes, target_probs=probs, uniforms=torch.rand(2, 5))
"""

# name: (the call that must raise, the ValueError message it must match)
CASES = {
    "rms_norm": ("eagle_kernels.rms_norm(torch.randn(2, 64), torch.randn(32), 1e-5)", "weight must be"),
    "rms_norm-op": ("ops().rms_norm(torch.randn(2, 64), torch.randn(32), 1e-5, None)", "weight must be"),
    "tree_accept_sample-vocab": (
        "eagle_kernels.tree_accept_sample(**{**tree_case(), 'tokens': torch.tensor([[0, 1, 8, 2]] * 2)})",
        r"tokens\[0, 2\] = 8 is outside the vocabulary"),
    "tree_accept_sample-op": (
        "c = tree_case(); ops().tree_accept_sample(c['parents'], c['tokens'].fill_(9), c['sizes'], "
        "c['target_probs'], c['uniforms'], None)", "outside the vocabulary"),
    "build_tree-bfs": (
        "eagle_kernels.build_tree(torch.tensor([[-1, 0, 3, 1]], dtype=torch.int32), "
        "torch.tensor([4], dtype=torch.int32))", "breaks BFS order"),
    "build_tree-op": (
        "ops().build_tree(torch.tensor([[-1, 2, 0]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32))",
        "breaks BFS order"),
    "paged_attention-cpp": ("attention.paged_attention(*paged_case(bad_block=True))",
                            "is not a block of the cache"),
    "paged_attention-op-shape": ("q, *rest = paged_case(); ops().paged_attention(q[0], *rest)", "q must be"),
    "paged_attention-check": ("check_paged_attention_cpu(*paged_case(bad_block=True))",
                              "is not a block of the cache"),
}

CHILD = SETUP + """
try:
    exec(sys.argv[1])
except ValueError as err:
    assert re.search(sys.argv[2], str(err)), f"unexpected message: {err}"
    print("raised ValueError:", err)
    print("OpenMP runtimes loaded:", len(openmp_runtimes()), openmp_runtimes())
    sys.exit(0)
sys.exit("no ValueError raised")
"""


@pytest.mark.parametrize("case", list(CASES))
def test_bad_argument_raises_in_child(case):
    call, message = CASES[case]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.run([sys.executable, "-c", CHILD, call, message], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=300)
    assert child.returncode >= 0, f"child killed by signal {-child.returncode}:\n{child.stdout}{child.stderr}"
    assert child.returncode == 0, child.stdout + child.stderr
    assert "raised ValueError" in child.stdout
    assert "OpenMP runtimes loaded: 0" in child.stdout or "OpenMP runtimes loaded: 1" in child.stdout, (
        f"more than one OpenMP runtime in the process (see setup.py):\n{child.stdout}")


def test_launcher_checks_raise_before_any_cpp_op():
    """The Python-side checks the launchers run first (no C++ throw involved), with the C++ ops' messages."""
    import torch

    from eagle_kernels._ops import check_rms_norm, check_rope_write_kv, check_silu_and_mul

    x = torch.randn(2, 64)
    for call, message in [
        (lambda: check_rms_norm(x, torch.randn(32)), "weight must be"),
        (lambda: check_rms_norm(x, torch.randn(64).double()), "weight must be"),
        (lambda: check_rms_norm(x, torch.randn(64), x[:1].clone()), "residual"),
        (lambda: check_rms_norm(x.int(), torch.randn(64)), "float32, bfloat16 or float16"),
        (lambda: check_silu_and_mul(x.double()), "float32, bfloat16 or float16"),
        (lambda: check_silu_and_mul(x[:, :63]), "even"),
    ]:
        with pytest.raises(ValueError, match=message):
            call()
    check_rms_norm(x, torch.randn(64), x.clone())
    check_silu_and_mul(x)

    T, Hq, Hkv, D = 3, 2, 1, 64
    qkv, cos, sin = torch.randn(T, (Hq + 2 * Hkv) * D), torch.randn(T, D), torch.randn(T, D)
    k, v = torch.zeros(3, 8, Hkv, D), torch.zeros(3, 8, Hkv, D)
    slots = torch.tensor([0, 1, 2])
    check_rope_write_kv(qkv, cos, sin, k, v, slots, Hq)
    for args, message in [
        ((qkv, cos, sin, k, v, torch.tensor([0, 1, 24]), Hq), r"slot_mapping\[2\] = 24 is outside the cache"),
        ((qkv, cos, sin, k, v, slots, 3), "qkv must be"),
        ((qkv, cos[:2], sin, k, v, slots, Hq), "cos and sin"),
        ((qkv, cos, sin, k, v[:, :4], slots, Hq), "k_cache/v_cache"),
        ((qkv, cos, sin, k, v, slots.float(), Hq), "slot_mapping must be"),
        ((qkv, cos, sin, k, v, slots.to("meta"), Hq), "all tensors must be on cpu"),
    ]:
        with pytest.raises(ValueError, match=message):
            check_rope_write_kv(*args)


def test_extension_carries_no_copy_of_the_cpp_runtime():
    """The extension links the shared libstdc++ torch uses. A toolchain whose own directory holds only
    libstdc++.a (the GPU machines' /opt/gcc) once folded a second, uninitialised iostream/locale copy into
    it: every error message (c10::str) then segfaulted, on the GPU box only. setup.py names the shared
    library first; this reads the built file's exported symbols for std::locale, which only a copy defines."""
    import shutil

    import eagle_kernels._C as ext
    nm = shutil.which("nm")
    assert nm, "nm (binutils) not found: it comes with the compiler the extension is built with"
    out = subprocess.run([nm, "-D", "--defined-only", ext.__file__], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    copied = [line.split()[-1] for line in out.stdout.splitlines() if "_ZNSt6locale" in line]
    assert not copied, f"{ext.__file__} defines {len(copied)} std::locale symbols, e.g. {copied[:3]}"
