// Torch bindings of the CUDA kernels (compiled only in CUDA builds): argument checks, output
// allocation, device guard and current stream; the kernels themselves live in the torch-free .cu files.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "../checks.h"
#include "launchers.h"

namespace eagle {
namespace {

std::tuple<at::Tensor, at::Tensor> build_tree_cuda(const at::Tensor& parents_in, const at::Tensor& sizes_in) {
  check_tree_args(parents_in, sizes_in);
  const int64_t B = parents_in.size(0), N = parents_in.size(1), W = (N + 31) / 32;
  TORCH_CHECK_VALUE(N <= eagle_cuda::kMaxTreeNodes, "build_tree on CUDA supports N <= ",
                    eagle_cuda::kMaxTreeNodes, " nodes, got ", N);
  const c10::cuda::CUDAGuard guard(parents_in.device());
  const at::Tensor parents = parents_in.contiguous(), sizes = sizes_in.contiguous();
  at::Tensor mask = at::empty({B, N, W}, parents.options()), depths = at::empty({B, N}, parents.options());
  const cudaError_t err = eagle_cuda::build_tree(parents.data_ptr<int32_t>(), sizes.data_ptr<int32_t>(), B, N,
                                                 mask.data_ptr<int32_t>(), depths.data_ptr<int32_t>(),
                                                 c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "eagle::build_tree: CUDA launch failed: ", cudaGetErrorString(err));
  return {mask, depths};
}

}  // namespace

TORCH_LIBRARY_IMPL(eagle, CUDA, m) { m.impl("build_tree", &build_tree_cuda); }

}  // namespace eagle
