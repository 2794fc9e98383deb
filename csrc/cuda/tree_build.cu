// build_tree on CUDA: one block per tree, threads over nodes (DESIGN.md, "build_tree").
#include "launchers.h"

namespace eagle_cuda {
namespace {

constexpr int kThreads = 128;

// Parent of node, or -1 at the root and on a parent that breaks BFS order (ends walks on bad input).
__device__ __forceinline__ int parent_of(const int32_t* par, int node) {
  const int p = par[node];
  return node > 0 && p >= 0 && p < node ? p : -1;
}

// First j in (after, n) with parent `of`, or -1.
__device__ int next_child(const int32_t* par, int of, int after, int n) {
  for (int j = after + 1; j < n; ++j) {
    if (parent_of(par, j) == of) return j;
  }
  return -1;
}

// Row of node i: ancestors are visited in decreasing index order, so each word is final when the walk
// leaves it and is stored once; words without ancestors are stored as 0. Returns the depth of i.
__device__ int write_mask_row(const int32_t* par, int i, int W, uint32_t* row) {
  int word = W - 1, depth = -1;
  uint32_t bits = 0;
  for (int node = i; node >= 0; node = parent_of(par, node), ++depth) {
    for (; word > node / 32; --word, bits = 0) row[word] = bits;
    bits |= 1u << (node % 32);
  }
  for (; word >= 0; --word, bits = 0) row[word] = bits;
  return depth;
}

__global__ void __launch_bounds__(kThreads)
build_tree_kernel(const int32_t* __restrict__ parents, const int32_t* __restrict__ sizes, int N,
                  int W, uint32_t* __restrict__ mask, int32_t* __restrict__ depths,
                  int32_t* __restrict__ retrieve, int32_t* __restrict__ num_leaves,
                  int32_t* __restrict__ first_child, int32_t* __restrict__ next_sibling) {
  extern __shared__ int32_t smem[];
  int32_t* par = smem;            // [N]
  int32_t* is_leaf = smem + N;    // [N]
  int32_t* depth = smem + 2 * N;  // [N]
  const int64_t b = blockIdx.x;
  const int n = min(max(sizes[b], 1), N);
  const int64_t row0 = b * N;
  for (int i = threadIdx.x; i < N; i += blockDim.x) par[i] = parents[row0 + i];
  __syncthreads();

  int32_t* paths = retrieve + row0 * N;  // [N, N]
  for (int64_t k = threadIdx.x; k < int64_t(N) * N; k += blockDim.x) paths[k] = -1;
  for (int i = threadIdx.x; i < N; i += blockDim.x) {
    uint32_t* row = mask + (row0 + i) * W;
    if (i < n) {
      depth[i] = write_mask_row(par, i, W, row);
      const int first = next_child(par, i, i, n);
      first_child[row0 + i] = first;
      next_sibling[row0 + i] = i > 0 ? next_child(par, parent_of(par, i), i, n) : -1;
      is_leaf[i] = first < 0;
    } else {
      for (int w = 0; w < W; ++w) row[w] = 0;
      depth[i] = 0;
      first_child[row0 + i] = next_sibling[row0 + i] = -1;
      is_leaf[i] = 0;
    }
    depths[row0 + i] = depth[i];
  }
  __syncthreads();  // paths prefilled, leaf flags and depths final

  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    if (!is_leaf[i]) continue;
    int rank = 0;
    for (int j = 0; j < i; ++j) rank += is_leaf[j];
    int32_t* path = paths + int64_t(rank) * N;
    for (int node = i, d = depth[i]; node >= 0; node = parent_of(par, node), --d) path[d] = node;
  }
  if (threadIdx.x == 0) {
    int leaves = 0;
    for (int j = 0; j < n; ++j) leaves += is_leaf[j];
    num_leaves[b] = leaves;
  }
}

}  // namespace

cudaError_t build_tree(const int32_t* parents, const int32_t* sizes, int64_t B, int64_t N,
                       int32_t* mask, int32_t* depths, int32_t* retrieve, int32_t* num_leaves,
                       int32_t* first_child, int32_t* next_sibling, cudaStream_t stream) {
  if (N < 1 || N > kMaxTreeNodes) return cudaErrorInvalidValue;
  if (B == 0) return cudaSuccess;
  const int W = static_cast<int>((N + 31) / 32);
  const size_t smem = 3 * N * sizeof(int32_t);
  // int32 and uint32 words share the bit pattern; unsigned keeps bit 31 free of sign handling.
  build_tree_kernel<<<static_cast<unsigned>(B), kThreads, smem, stream>>>(
      parents, sizes, static_cast<int>(N), W, reinterpret_cast<uint32_t*>(mask), depths, retrieve,
      num_leaves, first_child, next_sibling);
  return cudaGetLastError();
}

}  // namespace eagle_cuda
