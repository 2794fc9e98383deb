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


def openmp_link_flags() -> list[str]:
    """Link against the OpenMP runtime torch itself loads, never a second copy.

    at::parallel_for is a header template that spreads work over threads only when the extension is
    compiled with -fopenmp; its GOMP_* calls must reach torch's runtime, whose pool torch.set_num_threads
    sizes. Linking with -fopenmp records DT_NEEDED libgomp.so.1, which is torch's copy only when torch
    bundles it under that soname (the CPU wheel here). Wheels that bundle it under a hashed soname
    (torch/lib/libgomp-<hash>.so.1, as pip CUDA wheels do) then get the host compiler's libgomp loaded
    beside torch's: two OpenMP runtimes in one process, the prime suspect for the CUDA build's crashes.
    Linking the bundled file by path makes DT_NEEDED its soname, already loaded by libtorch_cpu.
    """
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    bundled = sorted(glob.glob(os.path.join(torch_lib, "libgomp*.so*")))
    if bundled:
        return [bundled[0], f"-Wl,-rpath,{torch_lib}"]
    return ["-fopenmp"]  # torch linked the system runtime itself (distribution / conda builds)


def libstdcxx_link_flags() -> list[str]:
    """Link the C++ runtime torch uses (the shared libstdc++), never a static copy of it.

    g++ links `-lstdc++`, which takes the first libstdc++ on its search path: a toolchain whose private
    directory holds only libstdc++.a (the GPU machines' /opt/gcc wrapper passes -B to one) folds a second,
    never-initialised copy of the iostream and locale machinery into the extension. It loads and runs, then
    segfaults in the first c10::str (std::ostringstream) it formats: every error message. Naming the shared
    library first resolves those symbols to it; the archive then contributes nothing.
    """
    return ["-l:libstdc++.so.6"] if sys.platform.startswith("linux") else []


def extension():
    cpp_sources = sorted(glob.glob("csrc/*.cpp"))
    cuda_sources = sorted(glob.glob("csrc/cuda/*.cu") + glob.glob("csrc/cuda/*.cpp"))
    with_cuda = (torch.version.cuda is not None and CUDA_HOME is not None
                 and os.environ.get("EAGLE_NO_CUDA", "0") != "1")
    cxx_flags = ["-O3", "-std=c++17", "-fopenmp"]
    link_flags = openmp_link_flags() + libstdcxx_link_flags()
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
    packages=find_packages(include=["engine", "engine.*", "train", "train.*", "eagle_kernels", "eagle_kernels.*"]),
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
        "fastapi",
        "uvicorn",
        "prometheus-client",
        "xgrammar>=0.2.8",   # structured output (engine/grammar.py); it brings triton, as the dev extras do
    ],
    extras_require={
        "dev": ["pytest", "pytest-benchmark", "scipy", "accelerate", "matplotlib", "triton", "openai", "httpx"],
    },
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension},
)
