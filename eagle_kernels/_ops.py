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


# Argument checks before the C++ CPU ops (below) guard every caller; `unchecked()` lets a caller that built
# the arguments itself - the engine's model forward, once per layer per step - skip them. The ops keep
# their own checks behind these.
CHECKED = True


@contextlib.contextmanager
def unchecked():
    global CHECKED
    old, CHECKED = CHECKED, False
    try:
        yield
    finally:
        CHECKED = old


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
    """Whether eagle::<op> has a kernel for the device type (CUDA kernels exist only in CUDA builds; an
    extension built before the op was added has none)."""
    key = "CUDA" if device.type == "cuda" else device.type.upper()
    if _LOAD_ERROR is not None:
        return False
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"eagle::{op}", key)
    except RuntimeError:  # no such operator
        return False


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


def raise_if(error: str):
    """ValueError(error) unless it is empty: the verdict of a non-throwing `*_errors` C++ check."""
    if error:
        raise ValueError(error)


def check_tree_values(parents, sizes, tokens=None, vocab: int = 0):
    """CPU tensors: ValueError unless every tree is BFS-ordered with sizes in [1, N] (and, with vocab > 0,
    every draft token lies in [0, vocab)). One C++ call that returns its verdict as a string: no throw
    crosses the extension boundary and no tensor value is read in Python."""
    raise_if(ops().tree_errors(parents, sizes, tokens, vocab))


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _check_rows(x, op: str):
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOATS:
        raise ValueError(f"{op}: x must be float32, bfloat16 or float16, got "
                         f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.dim() < 1:
        raise ValueError(f"{op}: x must be a tensor [..., H], got a scalar")


def check_rms_norm(x, weight, residual=None):
    """The arguments eagle::rms_norm accepts (ValueError otherwise): x [..., H] float, weight [H] of x's
    dtype, residual a contiguous tensor of x's shape and dtype, all on x's device."""
    T = torch.Tensor
    if (isinstance(x, T) and isinstance(weight, T) and x.dtype in _FLOATS and x.dim() >= 1
            and weight.dim() == 1 and weight.shape[0] == x.shape[-1] and weight.dtype == x.dtype
            and (residual is None or (isinstance(residual, T) and residual.shape == x.shape
                                      and residual.dtype == x.dtype and residual.is_contiguous()
                                      and residual.device == x.device))
            and weight.device == x.device):
        return  # the common case in one test; the checks below name what is wrong
    _check_rows(x, "rms_norm")
    H = x.shape[-1]
    if (not isinstance(weight, torch.Tensor) or weight.dim() != 1 or weight.shape[0] != H
            or weight.dtype != x.dtype or weight.device != x.device):
        got = f"{weight.dtype} {list(weight.shape)} on {weight.device}" if isinstance(weight, torch.Tensor) else weight
        raise ValueError(f"rms_norm: weight must be [{H}] of x's dtype on {x.device}, got {got}")
    if residual is not None and (not isinstance(residual, torch.Tensor) or residual.shape != x.shape
                                 or residual.dtype != x.dtype or residual.device != x.device
                                 or not residual.is_contiguous()):
        raise ValueError("rms_norm: residual must be a contiguous tensor of x's shape, dtype and device")


def check_silu_and_mul(x):
    """x [..., 2I] float (ValueError otherwise)."""
    if isinstance(x, torch.Tensor) and x.dtype in _FLOATS and x.dim() >= 1 and x.shape[-1] % 2 == 0:
        return
    _check_rows(x, "silu_and_mul")
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: the last dim must be even, got {x.shape[-1]}")


# A model's layers call an op with one step's metadata tensors (slots, tables, cos/sin) and same-shaped
# activations and caches: a check that passed is not repeated for the same metadata objects (held here, so
# their ids stay theirs) with the same shapes. The ops keep their own checks behind this one.
_passed: dict[str, tuple] = {}


def _seen(op: str, shapes: tuple, metadata: tuple) -> bool:
    last = _passed.get(op)
    return last is not None and last[0] == shapes and all(a is b for a, b in zip(last[1], metadata))


def check_rope_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_q_heads: int):
    """The arguments eagle::rope_write_kv accepts (ValueError otherwise); on CPU tensors also every slot
    in range, checked in C++ without a throw."""
    key = (getattr(qkv, "shape", None), getattr(k_cache, "shape", None), getattr(v_cache, "shape", None),
           num_q_heads), (cos, sin, slot_mapping)
    if _seen("rope_write_kv", *key):
        return
    _check_rows(qkv, "rope_write_kv")
    tensors = (cos, sin, k_cache, v_cache, slot_mapping)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        raise ValueError("rope_write_kv: cos, sin, k_cache, v_cache and slot_mapping must be tensors")
    if any(t.device != qkv.device for t in tensors):
        raise ValueError(f"rope_write_kv: all tensors must be on {qkv.device}, got "
                         f"{[str(t.device) for t in tensors]}")
    if (k_cache.dim() != 4 or k_cache.shape != v_cache.shape or not k_cache.is_contiguous()
            or not v_cache.is_contiguous() or k_cache.dtype != qkv.dtype or v_cache.dtype != qkv.dtype):
        raise ValueError("rope_write_kv: k_cache/v_cache must be contiguous [num_blocks, block_size, Hkv, D] "
                         "of qkv's dtype")
    T, (Hkv, D) = qkv.shape[0], k_cache.shape[2:]
    width = (num_q_heads + 2 * Hkv) * D
    if qkv.dim() != 2 or num_q_heads < 1 or qkv.shape[1] != width or D % 2:
        raise ValueError(f"rope_write_kv: qkv must be [T, (Hq + 2 Hkv) * D] = [T, {width}], got {list(qkv.shape)}")
    if cos.shape != (T, D) or sin.shape != (T, D) or cos.dtype not in _FLOATS or sin.dtype not in _FLOATS:
        raise ValueError(f"rope_write_kv: cos and sin must be [T, D] = [{T}, {D}] float, got "
                         f"{list(cos.shape)} and {list(sin.shape)}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != T or slot_mapping.dtype not in (torch.int64, torch.int32):
        raise ValueError("rope_write_kv: slot_mapping must be int64 or int32 [T]")
    if qkv.device.type == "cpu":
        raise_if(ops().index_errors(slot_mapping, k_cache.shape[0] * k_cache.shape[1], "rope_write_kv: slot_mapping"))
    _passed["rope_write_kv"] = key


def check_paged_attention_cpu(q, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens, tree_mask=None):
    """Every check of the C++ CPU paged_attention (shapes, dtypes, devices, then cu_seqlens, prefix lengths
    and block ids), in one C++ call that returns its verdict instead of throwing (ValueError here)."""
    key = (getattr(q, "shape", None), getattr(k_cache, "shape", None), getattr(v_cache, "shape", None)), \
        (block_tables, cu_seqlens_q, prefix_lens, tree_mask)
    if _seen("paged_attention", *key):
        return
    tensors = (q, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens)
    if not all(isinstance(t, torch.Tensor) for t in tensors + (() if tree_mask is None else (tree_mask,))):
        raise ValueError("paged_attention: q, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens and "
                         "tree_mask must be tensors")
    raise_if(ops().paged_attention_errors(q, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens, tree_mask))
    _passed["paged_attention"] = key


def openmp_runtimes() -> list[str]:
    """Paths of the OpenMP runtimes mapped into this process (Linux; [] elsewhere). More than one means the
    extension was linked against a different runtime than torch's (see setup.py)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/lib" in line}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.basename(p).startswith(("libgomp", "libomp", "libiomp")))
