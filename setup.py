"""Builds eagle_kernels._C: C++ CPU ops always, CUDA ops when a CUDA toolkit and a CUDA torch exist.

Install torch first (CPU: `pip install torch==2.13.0`), then `pip install --no-build-isolation -e .`
"""
import glob
import os
import sys

from setuptools import find_packages, setup

try:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
except ImportError:
    sys.exit("setup.py: torch must be installed first (pip install torch==2.13.0), "
             "then run pip install --no-build-isolation -e .")


def extension():
    cpp_sources = sorted(glob.glob("csrc/*.cpp"))
    cuda_sources = sorted(glob.glob("csrc/cuda/*.cu") + glob.glob("csrc/cuda/*.cpp"))
    with_cuda = (torch.version.cuda is not None and CUDA_HOME is not None
                 and os.environ.get("EAGLE_NO_CUDA", "0") != "1")
    # OpenMP: at::parallel_for is a header template that only spreads work over threads when the extension
    # itself is compiled with -fopenmp; the soname matches the libgomp torch bundles, so torch's copy (and
    # thread pool) is the one used.
    cxx_flags = ["-O3", "-std=c++17", "-fopenmp"]
    link_flags = ["-fopenmp"]
    if with_cuda:
        arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
        nvcc_flags = ["-O3", "-std=c++17", "--use_fast_math"]
        if arch is None:
            os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0"
        return CUDAExtension(
            "eagle_kernels._C", cpp_sources + cuda_sources,
            define_macros=[("EAGLE_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags}, extra_link_args=link_flags)
    return CppExtension("eagle_kernels._C", cpp_sources, extra_compile_args={"cxx": cxx_flags},
                        extra_link_args=link_flags)


setup(
    name="eagle-engine",
    version="0.1.0",
    description="Lossless EAGLE speculative decoding: a lean Llama engine with tree kernels",
    packages=find_packages(include=["engine", "engine.*", "eagle_kernels", "eagle_kernels.*"]),
    package_data={"engine": ["heads/**/*"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "numpy",
        "safetensors",
        "gguf>=0.10",
        "transformers>=4.45",
        "tokenizers",
        "jinja2",
        "tqdm",
    ],
    extras_require={
        "dev": ["pytest", "pytest-benchmark", "scipy", "accelerate", "matplotlib", "triton"],
    },
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension},
)
