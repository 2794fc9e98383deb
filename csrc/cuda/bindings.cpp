// Torch bindings of the CUDA kernels (compiled only in CUDA builds): argument checks, output
// allocation, device guard and current stream; the kernels themselves live in the torch-free .cu files.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "../checks.h"
#include "launchers.h"

namespace eagle {
namespace {

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "eagle::", op, ": CUDA launch failed: ", cudaGetErrorString(err));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> build_tree_cuda(
    const at::Tensor& parents_in, const at::Tensor& sizes_in) {
  check_tree_args(parents_in, sizes_in);
  const int64_t B = parents_in.size(0), N = parents_in.size(1), W = (N + 31) / 32;
  TORCH_CHECK_VALUE(N <= eagle_cuda::kMaxTreeNodes, "build_tree on CUDA supports N <= ",
                    eagle_cuda::kMaxTreeNodes, " nodes, got ", N);
  const c10::cuda::CUDAGuard guard(parents_in.device());
  const at::Tensor parents = parents_in.contiguous(), sizes = sizes_in.contiguous();
  const auto opts = parents.options();
  at::Tensor mask = at::empty({B, N, W}, opts), depths = at::empty({B, N}, opts);
  at::Tensor retrieve = at::empty({B, N, N}, opts), num_leaves = at::empty({B}, opts);
  at::Tensor first_child = at::empty({B, N}, opts), next_sibling = at::empty({B, N}, opts);
  check_launch(eagle_cuda::build_tree(parents.data_ptr<int32_t>(), sizes.data_ptr<int32_t>(), B, N,
                                      mask.data_ptr<int32_t>(), depths.data_ptr<int32_t>(),
                                      retrieve.data_ptr<int32_t>(), num_leaves.data_ptr<int32_t>(),
                                      first_child.data_ptr<int32_t>(),
                                      next_sibling.data_ptr<int32_t>(),
                                      c10::cuda::getCurrentCUDAStream()),
               "build_tree");
  return {mask, depths, retrieve, num_leaves, first_child, next_sibling};
}

using AcceptResult = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

AcceptResult alloc_result(const at::Tensor& parents) {
  const int64_t B = parents.size(0), N = parents.size(1);
  return {at::empty({B, N}, parents.options()), at::empty({B}, parents.options()),
          at::empty({B}, parents.options().dtype(at::kLong))};
}

AcceptResult tree_accept_greedy_cuda(const at::Tensor& parents_in, const at::Tensor& tokens_in,
                                     const at::Tensor& sizes_in, const at::Tensor& argmax_in) {
  check_accept_args(parents_in, tokens_in, sizes_in);
  check_tensor(argmax_in, "target_argmax", at::kLong, parents_in.sizes());
  check_device(parents_in, argmax_in, "target_argmax");
  const c10::cuda::CUDAGuard guard(parents_in.device());
  const at::Tensor parents = parents_in.contiguous(), tokens = tokens_in.contiguous();
  const at::Tensor sizes = sizes_in.contiguous(), argmax = argmax_in.contiguous();
  auto [path, len, next] = alloc_result(parents);
  check_launch(eagle_cuda::tree_accept_greedy(
                   parents.data_ptr<int32_t>(), tokens.data_ptr<int64_t>(),
                   sizes.data_ptr<int32_t>(), argmax.data_ptr<int64_t>(), parents.size(0),
                   parents.size(1), path.data_ptr<int32_t>(), len.data_ptr<int32_t>(),
                   next.data_ptr<int64_t>(), c10::cuda::getCurrentCUDAStream()),
               "tree_accept_greedy");
  return {path, len, next};
}

AcceptResult tree_accept_sample_cuda(const at::Tensor& parents_in, const at::Tensor& tokens_in,
                                     const at::Tensor& sizes_in, const at::Tensor& probs_in,
                                     const at::Tensor& uniforms_in,
                                     const std::optional<at::Tensor>& draft_in) {
  check_sample_args(parents_in, tokens_in, sizes_in, probs_in, uniforms_in, draft_in);
  const int64_t B = parents_in.size(0), N = parents_in.size(1), V = probs_in.size(2);
  const c10::cuda::CUDAGuard guard(parents_in.device());
  const at::Tensor parents = parents_in.contiguous(), tokens = tokens_in.contiguous();
  const at::Tensor sizes = sizes_in.contiguous(), probs = probs_in.contiguous();
  const at::Tensor uniforms = uniforms_in.contiguous();
  const at::Tensor draft = draft_in ? draft_in->contiguous() : at::Tensor();
  auto [path, len, next] = alloc_result(parents);
  check_launch(eagle_cuda::tree_accept_sample(
                   parents.data_ptr<int32_t>(), tokens.data_ptr<int64_t>(),
                   sizes.data_ptr<int32_t>(), probs.data_ptr<float>(),
                   draft.defined() ? draft.data_ptr<float>() : nullptr, uniforms.data_ptr<float>(),
                   B, N, V, path.data_ptr<int32_t>(), len.data_ptr<int32_t>(),
                   next.data_ptr<int64_t>(), c10::cuda::getCurrentCUDAStream()),
               "tree_accept_sample");
  return {path, len, next};
}

}  // namespace

TORCH_LIBRARY_IMPL(eagle, CUDA, m) {
  m.impl("build_tree", &build_tree_cuda);
  m.impl("tree_accept_greedy", &tree_accept_greedy_cuda);
  m.impl("tree_accept_sample", &tree_accept_sample_cuda);
}

}  // namespace eagle
