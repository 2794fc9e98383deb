// build_tree on CPU: ancestor bitmasks, depths, root-to-leaf paths and child/sibling links of a
// batch of BFS-ordered draft trees (DESIGN.md, "build_tree").
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "checks.h"

namespace eagle {
namespace {

struct TreeOut {
  uint32_t* mask;         // [N, W]; bit j % 32 of word j / 32 in row i: j is i or an ancestor of i
  int32_t* depths;        // [N]
  int32_t* retrieve;      // [N, N], prefilled with -1
  int32_t* num_leaves;    // scalar
  int32_t* first_child;   // [N], prefilled with -1
  int32_t* next_sibling;  // [N], prefilled with -1
};

// One tree of n valid nodes (parents already validated: parents[i] < i). BFS order means a
// parent's row, depth and links are final before any of its children is visited.
void build_one(const int32_t* parents, int64_t n, int64_t N, int64_t W, TreeOut out,
               std::vector<int32_t>& last_child) {
  last_child.assign(n, -1);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t* row = out.mask + i * W;
    const int32_t p = parents[i];
    if (i > 0) {
      std::copy(out.mask + p * W, out.mask + (p + 1) * W, row);
      out.depths[i] = out.depths[p] + 1;
      int32_t* link = last_child[p] < 0 ? &out.first_child[p] : &out.next_sibling[last_child[p]];
      *link = static_cast<int32_t>(i);
      last_child[p] = static_cast<int32_t>(i);
    }
    row[i / 32] |= 1u << (i % 32);
  }
  int32_t leaves = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (out.first_child[i] >= 0) continue;
    int32_t* path = out.retrieve + leaves++ * N;
    for (int32_t node = static_cast<int32_t>(i), d = out.depths[i]; d >= 0; node = parents[node], --d) {
      path[d] = node;
    }
  }
  *out.num_leaves = leaves;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> build_tree_cpu(
    const at::Tensor& parents_in, const at::Tensor& sizes_in) {
  check_tree_args(parents_in, sizes_in);
  const at::Tensor parents = parents_in.contiguous();
  const at::Tensor sizes = sizes_in.contiguous();
  const int64_t B = parents.size(0), N = parents.size(1), W = (N + 31) / 32;
  check_tree_values(parents.data_ptr<int32_t>(), sizes.data_ptr<int32_t>(), B, N);

  const auto opts = parents.options();
  at::Tensor mask = at::zeros({B, N, W}, opts);
  at::Tensor depths = at::zeros({B, N}, opts);
  at::Tensor retrieve = at::full({B, N, N}, -1, opts);
  at::Tensor num_leaves = at::zeros({B}, opts);
  at::Tensor first_child = at::full({B, N}, -1, opts);
  at::Tensor next_sibling = at::full({B, N}, -1, opts);

  const int32_t* par = parents.data_ptr<int32_t>();
  const int32_t* sz = sizes.data_ptr<int32_t>();
  // int32 and uint32 may alias; unsigned words keep bit 31 free of sign arithmetic.
  uint32_t* mask_words = reinterpret_cast<uint32_t*>(mask.data_ptr<int32_t>());
  at::parallel_for(0, B, 64, [&](int64_t b0, int64_t b1) {
    std::vector<int32_t> last_child;
    for (int64_t b = b0; b < b1; ++b) {
      TreeOut out{mask_words + b * N * W, depths.data_ptr<int32_t>() + b * N,
                  retrieve.data_ptr<int32_t>() + b * N * N, num_leaves.data_ptr<int32_t>() + b,
                  first_child.data_ptr<int32_t>() + b * N, next_sibling.data_ptr<int32_t>() + b * N};
      build_one(par + b * N, sz[b], N, W, out, last_child);
    }
  });
  return {mask, depths, retrieve, num_leaves, first_child, next_sibling};
}

}  // namespace

TORCH_LIBRARY_IMPL(eagle, CPU, m) { m.impl("build_tree", &build_tree_cpu); }

}  // namespace eagle
