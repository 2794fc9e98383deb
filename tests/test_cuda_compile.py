"""Every csrc/cuda/*.cu compiles standalone for sm_90 with nvcc (plain CUDA, no torch headers), and the
Triton acceptance kernels compile ahead of time for sm_90. Neither needs a GPU; a missing nvcc or a file
that does not compile fails the test (no skip)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CU_FILES = sorted((ROOT / "csrc" / "cuda").glob("*.cu"))
NVCC_FLAGS = ["-arch=sm_90", "-std=c++17", "-O3", "--use_fast_math"]  # the flags setup.py builds with


def nvcc() -> str:
    path = shutil.which("nvcc") or str(Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc")
    assert Path(path).exists(), "nvcc not found on PATH or in $CUDA_HOME/bin: the CUDA compile check needs it"
    return path


def test_cuda_sources_exist():
    # Tree acceptance on CUDA is the Triton kernels only (one implementation per op and device).
    assert {p.name for p in CU_FILES} == {"tree_build.cu"}


@pytest.mark.parametrize("cu", CU_FILES, ids=lambda p: p.name)
def test_cu_file_compiles_standalone_for_sm90(cu, tmp_path):
    source = cu.read_text()
    assert "torch/" not in source and "ATen/" not in source, f"{cu.name} must not include torch headers"
    obj = tmp_path / f"{cu.stem}.o"
    done = subprocess.run([nvcc(), *NVCC_FLAGS, "-c", str(cu), "-o", str(obj)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, f"nvcc failed on {cu.name}:\n{done.stderr}"
    assert obj.stat().st_size > 0


# Compiles in a child process: the Triton kernels must be decorated with TRITON_INTERPRET unset.
TRITON_AOT = """
import triton
from triton.backends.compiler import GPUTarget
import eagle_kernels.rejection as r

types = dict(parents="*i32", tokens="*i64", sizes="*i32", probs="*fp32", draft="*fp32", uniforms="*fp32",
             work="*fp32", seg="*fp32", argmax="*i64", path_out="*i32", len_out="*i32", next_out="*i64",
             N="i32", V="i32")

def compile_sm90(kernel, num_warps, **constexprs):
    signature = {a: types.get(a, "constexpr") for a in kernel.arg_names}
    src = triton.compiler.ASTSource(kernel, signature, constexprs=constexprs)
    out = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=num_warps, enable_fp_fusion=False))
    assert out.asm["cubin"], kernel.__name__

for has_draft in (False, True):
    compile_sm90(r._tree_accept_sample_kernel, 4, HAS_DRAFT=has_draft, SEG=r.CDF_SEGMENT, LANES=512,
                 BLOCK_N=64, BLOCK_V=1024)
compile_sm90(r._tree_accept_greedy_kernel, 1, BLOCK_N=64)
"""


def test_triton_kernels_compile_for_sm90():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "0"
    done = subprocess.run([sys.executable, "-c", TRITON_AOT], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
