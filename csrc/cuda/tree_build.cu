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
build_tree_kernel(const int32_t* __restrict__ parents, const int32_t* __restrict__ sizes, int N, int W,
                  uint32_t* __restrict__ mask, int32_t* __restrict__ depths) {
  extern __shared__ int32_t par[];  // [N]
  const int64_t b = blockIdx.x;
  const int n = min(max(sizes[b], 1), N);
  const int64_t row0 = b * N;
  for (int i = threadIdx.x; i < N; i += blockDim.x) par[i] = parents[row0 + i];
  __syncthreads();

  for (int i = threadIdx.x; i < N; i += blockDim.x) {
    uint32_t* row = mask + (row0 + i) * W;
    if (i < n) {
      depths[row0 + i] = write_mask_row(par, i, W, row);
    } else {
      for (int w = 0; w < W; ++w) row[w] = 0;
      depths[row0 + i] = 0;
    }
  }
}

}  // namespace

cudaError_t build_tree(const int32_t* parents, const int32_t* sizes, int64_t B, int64_t N, int32_t* mask,
                       int32_t* depths, cudaStream_t stream) {
  if (N < 1 || N > kMaxTreeNodes) return cudaErrorInvalidValue;
  if (B == 0) return cudaSuccess;
  const int W = static_cast<int>((N + 31) / 32);
  const size_t smem = N * sizeof(int32_t);
  // int32 and uint32 words share the bit pattern; unsigned keeps bit 31 free of sign handling.
  build_tree_kernel<<<static_cast<unsigned>(B), kThreads, smem, stream>>>(
      parents, sizes, static_cast<int>(N), W, reinterpret_cast<uint32_t*>(mask), depths);
  return cudaGetLastError();
}

}  // namespace eagle_cuda
