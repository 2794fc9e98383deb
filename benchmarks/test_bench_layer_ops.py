"""Fused layer ops (C++ on CPU, Triton on CUDA) against their torch versions at decode (1 row) and prefill
(512 rows) sizes of the 135M target in bf16; reports GB/s of the activations read and written (and the cache
rows written). The "triton" rows call the Triton launchers directly and run only where CUDA exists."""
import pytest
import torch

from eagle_kernels import layer_ops

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.bfloat16
H, INTER, HQ, HKV, D = 576, 1536, 9, 3, 64
ROWS = [1, 512]


def _rand(*shape):
    return torch.randn(*shape, device=DEVICE).to(DTYPE)


def _impl(fused, triton, torch_ref, impl):
    if impl == "triton" and DEVICE.type != "cuda":
        pytest.skip("the Triton kernels are benchmarked on CUDA only")
    return {"fused": fused, "triton": triton, "torch": torch_ref}[impl]


@pytest.mark.parametrize("impl", ["fused", "triton", "torch"])
@pytest.mark.parametrize("rows", ROWS)
def test_rms_norm_add(bandwidth, impl, rows):
    x, w, residual = _rand(rows, H), _rand(H), _rand(rows, H)
    fn = _impl(layer_ops.rms_norm, layer_ops.rms_norm_triton, layer_ops.rms_norm_torch, impl)
    nbytes = 4 * rows * H * x.element_size()  # x and residual read, residual and out written
    with torch.inference_mode():
        bandwidth(lambda: fn(x, w, 1e-5, residual), nbytes, DEVICE)


@pytest.mark.parametrize("impl", ["fused", "triton", "torch"])
@pytest.mark.parametrize("rows", ROWS)
def test_silu_and_mul(bandwidth, impl, rows):
    x = _rand(rows, 2 * INTER)
    fn = _impl(layer_ops.silu_and_mul, layer_ops.silu_and_mul_triton, layer_ops.silu_and_mul_torch, impl)
    with torch.inference_mode():
        bandwidth(lambda: fn(x), 3 * rows * INTER * x.element_size(), DEVICE)


@pytest.mark.parametrize("impl", ["fused", "triton", "torch"])
@pytest.mark.parametrize("rows", ROWS)
def test_rope_write_kv(bandwidth, impl, rows):
    qkv = _rand(rows, (HQ + 2 * HKV) * D)
    angles = torch.rand(rows, D // 2, device=DEVICE) * 100
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    blocks = -(-rows // 16)
    k_cache, v_cache = _rand(blocks, 16, HKV, D), _rand(blocks, 16, HKV, D)
    slots = torch.randperm(blocks * 16, device=DEVICE)[:rows]
    fn = _impl(layer_ops.rope_write_kv, layer_ops.rope_write_kv_triton, layer_ops.rope_write_kv_torch, impl)
    # qkv read, q written, k and v written to the cache; cos / sin read in fp32
    nbytes = (qkv.numel() + rows * (HQ + 2 * HKV) * D) * qkv.element_size() + 2 * cos.numel() * 4
    with torch.inference_mode():
        bandwidth(lambda: fn(qkv, cos, sin, k_cache, v_cache, slots, HQ), nbytes, DEVICE)
