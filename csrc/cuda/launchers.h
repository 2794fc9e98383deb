// Launchers of the eagle CUDA kernels: raw device pointers and a stream, no torch types, so each .cu
// compiles standalone with nvcc. All tensors are contiguous; each launcher returns the launch status.
// Device values are not validated (the CPU ops do that): kernels only guarantee memory safety, e.g.
// sizes are clamped to [1, N] and out-of-order parents end ancestor walks.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace eagle_cuda {

// Largest N build_tree accepts on CUDA (the parents of one tree in shared memory).
constexpr int64_t kMaxTreeNodes = 4096;

// parents: [B, N], sizes: [B] -> mask [B, N, ceil(N / 32)], depths [B, N]; every output element is
// written.
cudaError_t build_tree(const int32_t* parents, const int32_t* sizes, int64_t B, int64_t N, int32_t* mask,
                       int32_t* depths, cudaStream_t stream);

}  // namespace eagle_cuda
