// build_tree on CPU: ancestor bitmasks and depths of a batch of BFS-ordered draft trees (DESIGN.md,
// "build_tree").
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

#include "checks.h"

namespace eagle {
namespace {

// One tree of n valid nodes (parents already validated: parents[i] < i). BFS order means a parent's
// row and depth are final before any of its children is visited.
// mask: [N, W], bit j % 32 of word j / 32 in row i set iff j is i or an ancestor of i; depths: [N].
void build_one(const int32_t* parents, int64_t n, int64_t W, uint32_t* mask, int32_t* depths) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t* row = mask + i * W;
    if (i > 0) {
      const int32_t p = parents[i];
      std::copy(mask + p * W, mask + (p + 1) * W, row);
      depths[i] = depths[p] + 1;
    }
    row[i / 32] |= 1u << (i % 32);
  }
}

std::tuple<at::Tensor, at::Tensor> build_tree_cpu(const at::Tensor& parents_in, const at::Tensor& sizes_in) {
  check_tree_args(parents_in, sizes_in);
  const at::Tensor parents = parents_in.contiguous();
  const at::Tensor sizes = sizes_in.contiguous();
  const int64_t B = parents.size(0), N = parents.size(1), W = (N + 31) / 32;
  check_tree_values(parents.data_ptr<int32_t>(), sizes.data_ptr<int32_t>(), B, N);

  at::Tensor mask = at::zeros({B, N, W}, parents.options());
  at::Tensor depths = at::zeros({B, N}, parents.options());
  const int32_t* par = parents.data_ptr<int32_t>();
  const int32_t* sz = sizes.data_ptr<int32_t>();
  // int32 and uint32 may alias; unsigned words keep bit 31 free of sign arithmetic.
  uint32_t* mask_words = reinterpret_cast<uint32_t*>(mask.data_ptr<int32_t>());
  int32_t* depth = depths.data_ptr<int32_t>();
  at::parallel_for(0, B, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) build_one(par + b * N, sz[b], W, mask_words + b * N * W, depth + b * N);
  });
  return {mask, depths};
}

// "" when the trees (and, with vocab > 0, the draft tokens) are valid, else the first problem. Never
// throws: the launchers call it on CPU tensors and raise the message as a ValueError themselves.
std::string tree_errors_cpu(const at::Tensor& parents, const at::Tensor& sizes,
                            const std::optional<at::Tensor>& tokens, int64_t vocab) {
  if (parents.dim() != 2 || parents.size(1) < 1 || parents.scalar_type() != at::kInt || !parents.is_cpu()) {
    return "parents must be an int32 CPU tensor [B, N] with N >= 1";
  }
  const int64_t B = parents.size(0), N = parents.size(1);
  if (sizes.dim() != 1 || sizes.size(0) != B || sizes.scalar_type() != at::kInt || !sizes.is_cpu()) {
    return c10::str("sizes must be an int32 CPU tensor [", B, "]");
  }
  const at::Tensor par = parents.contiguous(), sz = sizes.contiguous();
  std::string err = tree_value_error(par.data_ptr<int32_t>(), sz.data_ptr<int32_t>(), B, N);
  if (!err.empty() || !tokens || vocab <= 0) return err;
  if (tokens->sizes() != parents.sizes() || tokens->scalar_type() != at::kLong || !tokens->is_cpu()) {
    return c10::str("tokens must be an int64 CPU tensor [", B, ", ", N, "]");
  }
  const at::Tensor tok = tokens->contiguous();
  return token_value_error(tok.data_ptr<int64_t>(), sz.data_ptr<int32_t>(), B, N, vocab);
}

}  // namespace

TORCH_LIBRARY_IMPL(eagle, CPU, m) { m.impl("build_tree", &build_tree_cpu); }

// Every backend: the check reads values only after it has seen that all tensors are on the CPU.
TORCH_LIBRARY_IMPL(eagle, CompositeImplicitAutograd, m) { m.impl("tree_errors", &tree_errors_cpu); }

}  // namespace eagle
