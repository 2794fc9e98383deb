"""CPU bf16 linear against torch's bf16 and fp32 linear: decode-sized (reports weight GB/s) and prefill-sized
(also GFLOP/s, listed after the module's benchmarks and stored in extra_info)."""
import pytest
import torch
import torch.nn.functional as F

import eagle_kernels

SHAPES = [(1, 576, 3072), (8, 576, 3072), (1, 576, 49152), (32, 4096, 4096)]
# Prefill / big-batch rows on the 135M target's gate_up and lm_head shapes: compute-bound.
LARGE = [(256, 576, 3072), (1024, 576, 3072), (256, 576, 49152), (1024, 576, 49152)]

class _FlopsReport:
    """GFLOP/s lines, written in the terminal summary (a plugin registered by the first large benchmark)."""

    def __init__(self):
        self.lines = []

    def pytest_terminal_summary(self, terminalreporter):
        if self.lines:
            terminalreporter.section("achieved GFLOP/s (2 M N K / median time)")
            for line in self.lines:
                terminalreporter.write_line(line)


@pytest.fixture
def flops_report(request):
    manager = request.config.pluginmanager
    report = manager.get_plugin("eagle_linear_flops")
    if report is None:
        report = _FlopsReport()
        manager.register(report, "eagle_linear_flops")
    return report.lines


@pytest.mark.parametrize("impl", ["eagle", "torch_bf16", "torch_fp32"])
@pytest.mark.parametrize("M, K, N", SHAPES)
def test_linear(bandwidth, impl, M, K, N):
    x = torch.randn(M, K)
    w = torch.randn(N, K)
    if impl != "torch_fp32":
        x, w = x.bfloat16(), w.bfloat16()
    fn = {"eagle": eagle_kernels.linear, "torch_bf16": F.linear, "torch_fp32": F.linear}[impl]
    nbytes = w.numel() * w.element_size() + x.numel() * x.element_size()
    with torch.inference_mode():
        bandwidth(lambda: fn(x, w), nbytes, x.device)


@pytest.mark.parametrize("impl", ["eagle", "torch_fp32", "widen_fp32"])
@pytest.mark.parametrize("M, K, N", LARGE)
def test_linear_large(bandwidth, benchmark, flops_report, impl, M, K, N):
    """eagle: the kernel on bf16 x and weights (row-invariant); torch_fp32: MKL's GEMM on fp32 x and
    weights; widen_fp32: bf16 x and weights widened to fp32 around that GEMM (bf16 models' former
    prefill route). Bytes: weights, x and y as stored."""
    x, w = torch.randn(M, K), torch.randn(N, K)
    if impl == "torch_fp32":
        fn = F.linear
    else:
        x, w = x.bfloat16(), w.bfloat16()
        fn = eagle_kernels.linear if impl == "eagle" else (lambda a, b: F.linear(a.float(), b.float()).to(a.dtype))
    nbytes = (w.numel() * w.element_size() + x.numel() * x.element_size() + M * N * x.element_size())
    with torch.inference_mode():
        bandwidth(lambda: fn(x, w), nbytes, x.device)
    gflops = 2 * M * N * K / benchmark.stats.stats.median / 1e9
    benchmark.extra_info["gflops"] = round(gflops, 1)
    flops_report.append(f"{benchmark.name:<58} median {benchmark.stats.stats.median * 1e3:>9.2f} ms "
                        f"{gflops:>8.1f} GFLOP/s")


QUANT_SHAPES = [(1, 576, 3072), (4, 576, 3072), (16, 576, 3072), (1, 1536, 576), (1, 576, 49152), (256, 576, 3072)]


@pytest.mark.parametrize("impl", ["q4_1", "q8_0", "bf16"])
@pytest.mark.parametrize("M, K, N", QUANT_SHAPES)
def test_linear_quantized(bandwidth, benchmark, flops_report, impl, M, K, N):
    """eagle::linear_q on GGUF-type blocks (bytes: the blocks, 20 / 34 per 32 weights) against the bf16 kernel
    on the same shape (bytes: 2 per weight): decode and verification sizes are bound by the weight bytes."""
    x, w = torch.randn(M, K).bfloat16(), torch.randn(N, K)
    if impl == "bf16":
        wb = w.bfloat16()
        fn, nbytes = (lambda: eagle_kernels.linear(x, wb)), wb.numel() * 2
    else:
        blocks = eagle_kernels.quant.quantize(w, impl)
        fn, nbytes = (lambda: eagle_kernels.linear_q(x, blocks, impl)), blocks.numel()
    with torch.inference_mode():
        bandwidth(fn, nbytes + x.numel() * 2 + M * N * 2, x.device)
    gflops = 2 * M * N * K / benchmark.stats.stats.median / 1e9
    benchmark.extra_info["gflops"] = round(gflops, 1)
    flops_report.append(f"{benchmark.name:<58} median {benchmark.stats.stats.median * 1e3:>9.2f} ms "
                        f"{gflops:>8.1f} GFLOP/s")
