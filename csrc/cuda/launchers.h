// Launchers of the eagle CUDA kernels: raw device pointers and a stream, no torch types, so each .cu
// compiles standalone with nvcc. All tensors are contiguous; each launcher returns the launch status.
// Device values are not validated (the CPU ops do that): kernels only guarantee memory safety, e.g.
// sizes are clamped to [1, N], out-of-order parents end ancestor walks, out-of-vocabulary draft tokens
// are never accepted.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace eagle_cuda {

// Largest N build_tree accepts on CUDA (three int32 arrays of N in shared memory).
constexpr int64_t kMaxTreeNodes = 4096;

// parents: [B, N], sizes: [B] -> mask [B, N, ceil(N / 32)], depths [B, N], retrieve [B, N, N],
// num_leaves [B], first_child [B, N], next_sibling [B, N]; every output element is written.
cudaError_t build_tree(const int32_t* parents, const int32_t* sizes, int64_t B, int64_t N,
                       int32_t* mask, int32_t* depths, int32_t* retrieve, int32_t* num_leaves,
                       int32_t* first_child, int32_t* next_sibling, cudaStream_t stream);

// parents, tokens, target_argmax: [B, N], sizes: [B] -> accept_path [B, N], accept_len [B],
// next_token [B].
cudaError_t tree_accept_greedy(const int32_t* parents, const int64_t* tokens, const int32_t* sizes,
                               const int64_t* target_argmax, int64_t B, int64_t N,
                               int32_t* accept_path, int32_t* accept_len, int64_t* next_token,
                               cudaStream_t stream);

// target_probs, draft_probs (nullptr: deterministic drafts): [B, N, V], uniforms: [B, N + 1].
cudaError_t tree_accept_sample(const int32_t* parents, const int64_t* tokens, const int32_t* sizes,
                               const float* target_probs, const float* draft_probs,
                               const float* uniforms, int64_t B, int64_t N, int64_t V,
                               int32_t* accept_path, int32_t* accept_len, int64_t* next_token,
                               cudaStream_t stream);

}  // namespace eagle_cuda
