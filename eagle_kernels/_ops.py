"""Loads the compiled extension `eagle_kernels._C`, which registers the `torch.ops.eagle` operators,
and holds the argument checks shared by the public launchers."""
import contextlib
import importlib
import os

import torch

try:
    importlib.import_module("eagle_kernels._C")
    _LOAD_ERROR = None
except ImportError as err:  # importing the package must work before the extension is built
    _LOAD_ERROR = err


# The GPU code path on CPU tensors: the implementations CUDA tensors take (Triton) run on CPU tensors too,
# through the Triton interpreter (TRITON_INTERPRET=1). Tests and `EAGLE_TRITON_ON_CPU=1` use it to run the
# engine's GPU path without a GPU.
_TRITON_ON_CPU = os.environ.get("EAGLE_TRITON_ON_CPU", "0") == "1"


@contextlib.contextmanager
def triton_on_cpu(enabled: bool = True):
    """Within the block CPU tensors take the CUDA implementations (needs TRITON_INTERPRET=1 set before
    Triton is imported)."""
    global _TRITON_ON_CPU
    old, _TRITON_ON_CPU = _TRITON_ON_CPU, enabled
    try:
        yield
    finally:
        _TRITON_ON_CPU = old


def gpu_path(t: torch.Tensor) -> bool:
    """Whether `t` takes the GPU implementations: CUDA tensors, and CPU tensors inside triton_on_cpu()."""
    return t.is_cuda or (_TRITON_ON_CPU and t.device.type == "cpu")


def ops():
    """`torch.ops.eagle`; ImportError with build instructions if the extension was not built."""
    if _LOAD_ERROR is not None:
        raise ImportError(
            "eagle_kernels._C (the C++/CUDA ops) is not built: run `pip install --no-build-isolation -e .` "
            f"in the repository root with torch installed ({_LOAD_ERROR})") from _LOAD_ERROR
    return torch.ops.eagle


def has_kernel(op: str, device: torch.device) -> bool:
    """Whether eagle::<op> has a kernel for the device type (CUDA kernels exist only in CUDA builds)."""
    key = "CUDA" if device.type == "cuda" else device.type.upper()
    return _LOAD_ERROR is None and torch._C._dispatch_has_kernel_for_dispatch_key(f"eagle::{op}", key)


def check_tensor(t, name: str, dtype: torch.dtype, shape: tuple, device: torch.device | None = None):
    """ValueError unless t is a tensor of this dtype and shape (None matches any size) on device."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
        want = ", ".join("*" if s is None else str(s) for s in shape)
        raise ValueError(f"{name} must have shape [{want}], got {list(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but parents is on {device}")


def check_tree(parents, sizes) -> tuple[int, int]:
    """parents: int32 [B, N] (N >= 1), sizes: int32 [B] on the same device -> (B, N)."""
    check_tensor(parents, "parents", torch.int32, (None, None))
    B, N = parents.shape
    if N < 1:
        raise ValueError("parents must have at least one node per request (N >= 1)")
    check_tensor(sizes, "sizes", torch.int32, (B,), parents.device)
    return B, N
