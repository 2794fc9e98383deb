// Tree acceptance on CUDA (DESIGN.md, "tree_accept_*"): sampling runs one block per request, greedy one
// thread per request. The fp32 arithmetic follows csrc/cdf_order.h step for step, with every operation
// pinned to IEEE round-to-nearest in PTX (immune to --use_fast_math, FMA contraction and
// flush-to-zero), so results equal the CPU op's bit for bit.
#include "../cdf_order.h"
#include "launchers.h"

namespace eagle_cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kSeg = eagle::kCdfSegment;

__device__ __forceinline__ float add_rn(float a, float b) {
  float r;
  asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float sub_rn(float a, float b) {
  float r;
  asm("sub.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float mul_rn(float a, float b) {
  float r;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float div_rn(float a, float b) {
  float r;
  asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float max_ieee(float a, float b) {
  float r;
  asm("max.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
// a < b without flushing subnormal operands to zero.
__device__ __forceinline__ bool lt(float a, float b) {
  uint32_t r;
  asm("{\n .reg .pred p;\n setp.lt.f32 p, %1, %2;\n selp.u32 %0, 1, 0, p;\n}" : "=r"(r) : "f"(a), "f"(b));
  return r != 0;
}

// The distribution at the current node: p minus the tokens rejected there (deterministic drafts) or
// max(0, p - q) (residual after a rejected draft drawn from q).
struct Dist {
  const float* p;
  const float* q;           // non-null: residual
  const int32_t* rejected;  // [nrej] tokens whose mass was removed
  int nrej;

  __device__ float operator()(int64_t i) const {
    if (q != nullptr) return max_ieee(0.f, sub_rn(p[i], q[i]));
    for (int r = 0; r < nrej; ++r) {
      if (rejected[r] == i) return 0.f;
    }
    return p[i];
  }
};

__device__ float segment_sum(const Dist& d, int64_t s, int64_t V) {
  float acc = 0.f;
  for (int64_t i = s * kSeg, end = min(V, (s + 1) * kSeg); i < end; ++i) acc = add_rn(acc, d(i));
  return acc;
}

// All threads: seg[s] for every segment, then a barrier.
__device__ void segment_sums(const Dist& d, float* seg, int64_t nseg, int64_t V) {
  for (int64_t s = threadIdx.x; s < nseg; s += blockDim.x) seg[s] = segment_sum(d, s, V);
  __syncthreads();
}

__device__ float seq_total(const float* seg, int64_t nseg) {
  float acc = 0.f;
  for (int64_t s = 0; s < nseg; ++s) acc = add_rn(acc, seg[s]);
  return acc;
}

// One thread: inverse CDF at u in the canonical order; -1 only if nothing has mass.
__device__ int64_t draw(const Dist& d, const float* seg, int64_t nseg, int64_t V, float u) {
  const float threshold = mul_rn(u, seq_total(seg, nseg));
  float before = 0.f;
  for (int64_t s = 0; s < nseg; ++s) {
    const float after = add_rn(before, seg[s]);
    if (lt(threshold, after)) {
      float inner = 0.f;
      for (int64_t i = s * kSeg, end = min(V, (s + 1) * kSeg); i < end; ++i) {
        inner = add_rn(inner, d(i));
        if (lt(threshold, add_rn(before, inner))) return i;
      }
    }
    before = after;
  }
  for (int64_t i = V - 1; i >= 0; --i) {
    if (lt(0.f, d(i))) return i;
  }
  return -1;
}

// One request's rows.
struct Request {
  const int32_t* par;    // [N]
  const int64_t* tok;    // [N]
  const float* probs;    // [N, V]
  const float* draft;    // [N, V] or null
  const float* unif;     // [N + 1]
  int n;
  int64_t V;
};

// One thread, deterministic drafts: children of cur in index order, child token x accepted iff
// u < p(x) / total of what remains, else x joins `rejected` and its segment sum is refreshed.
// Returns the accepted child or -1.
__device__ int try_siblings(const Request& r, int cur, float* seg, int64_t nseg, int32_t* rejected,
                            int* nrej) {
  Dist d{r.probs + cur * r.V, nullptr, rejected, 0};
  for (int c = cur + 1; c < r.n; ++c) {
    const int64_t x = r.tok[c];
    if (r.par[c] != cur || x < 0 || x >= r.V) continue;
    if (lt(r.unif[c], div_rn(d(x), seq_total(seg, nseg)))) return c;
    rejected[d.nrej++] = static_cast<int32_t>(x);
    seg[x / kSeg] = segment_sum(d, x / kSeg, r.V);
  }
  *nrej = d.nrej;
  return -1;
}

// One thread, chain drafts drawn from q: only the first child of cur is tried (stored in *tried),
// accepted iff u < p(x) / q(x). Returns it or -1.
__device__ int try_chain(const Request& r, int cur, int* tried) {
  int c = cur + 1;
  while (c < r.n && r.par[c] != cur) ++c;
  *tried = c < r.n ? c : -1;
  if (c >= r.n) return -1;
  const int64_t x = r.tok[c];
  if (x < 0 || x >= r.V) return -1;
  const float px = r.probs[cur * r.V + x], qx = r.draft[c * r.V + x];
  return lt(r.unif[c], div_rn(px, qx)) ? c : -1;
}

template <bool kDraft>
__global__ void __launch_bounds__(kThreads)
tree_accept_sample_kernel(const int32_t* __restrict__ parents, const int64_t* __restrict__ tokens,
                          const int32_t* __restrict__ sizes, const float* __restrict__ probs,
                          const float* __restrict__ draft, const float* __restrict__ uniforms,
                          int N, int64_t V, int32_t* __restrict__ path_out,
                          int32_t* __restrict__ len_out, int64_t* __restrict__ next_out) {
  const int64_t nseg = (V + kSeg - 1) / kSeg;
  extern __shared__ float seg[];                                    // [nseg] segment sums
  int32_t* rejected = reinterpret_cast<int32_t*>(seg + nseg);       // [N] tokens removed at cur
  __shared__ int s_child, s_tried, s_residual_has_mass;
  const int64_t b = blockIdx.x;
  const Request r{parents + b * N, tokens + b * N, probs + b * N * V,
                  kDraft ? draft + b * N * V : nullptr, uniforms + b * (N + 1),
                  min(max(sizes[b], 1), N), V};
  int32_t* path = path_out + b * N;
  for (int i = threadIdx.x; i < N; i += blockDim.x) path[i] = i == 0 ? 0 : -1;
  __syncthreads();

  int cur = 0, depth = 0, nrej = 0;  // nrej: meaningful in thread 0 only
  for (;;) {
    if (!kDraft) segment_sums(Dist{r.probs + cur * V, nullptr, rejected, 0}, seg, nseg, V);
    if (threadIdx.x == 0) {
      s_child = kDraft ? try_chain(r, cur, &s_tried) : try_siblings(r, cur, seg, nseg, rejected, &nrej);
    }
    __syncthreads();
    const int child = s_child;
    if (child < 0) break;
    cur = child;
    ++depth;
    if (threadIdx.x == 0) path[depth] = child;
    __syncthreads();  // every thread has read s_child before it is rewritten
  }

  const float* p = r.probs + cur * V;
  Dist final_dist{p, nullptr, rejected, nrej};
  if (kDraft) {
    bool use_p = s_tried < 0;
    if (!use_p) {
      final_dist = Dist{p, r.draft + int64_t(s_tried) * V, nullptr, 0};
      segment_sums(final_dist, seg, nseg, V);
      if (threadIdx.x == 0) s_residual_has_mass = lt(0.f, seq_total(seg, nseg));
      __syncthreads();
      use_p = !s_residual_has_mass;
    }
    if (use_p) {
      final_dist = Dist{p, nullptr, rejected, 0};
      segment_sums(final_dist, seg, nseg, V);
    }
  }
  if (threadIdx.x == 0) {
    len_out[b] = depth;
    next_out[b] = draw(final_dist, seg, nseg, V, r.unif[0]);
  }
}

__global__ void tree_accept_greedy_kernel(const int32_t* __restrict__ parents,
                                          const int64_t* __restrict__ tokens,
                                          const int32_t* __restrict__ sizes,
                                          const int64_t* __restrict__ argmax, int64_t B, int N,
                                          int32_t* __restrict__ path_out,
                                          int32_t* __restrict__ len_out,
                                          int64_t* __restrict__ next_out) {
  const int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (b >= B) return;
  const int n = min(max(sizes[b], 1), N);
  const int32_t* par = parents + b * N;
  const int64_t* tok = tokens + b * N;
  int32_t* path = path_out + b * N;
  for (int i = 0; i < N; ++i) path[i] = i == 0 ? 0 : -1;
  int cur = 0, depth = 0;
  int64_t want = argmax[b * N];
  // BFS order: a child follows its parent, so one forward scan sees every child of each new node.
  for (int c = 1; c < n; ++c) {
    if (par[c] == cur && tok[c] == want) {
      cur = c;
      path[++depth] = c;
      want = argmax[b * N + c];
    }
  }
  len_out[b] = depth;
  next_out[b] = want;
}

}  // namespace

cudaError_t tree_accept_greedy(const int32_t* parents, const int64_t* tokens, const int32_t* sizes,
                               const int64_t* target_argmax, int64_t B, int64_t N,
                               int32_t* accept_path, int32_t* accept_len, int64_t* next_token,
                               cudaStream_t stream) {
  if (B == 0) return cudaSuccess;
  constexpr int kGreedyThreads = 128;
  const auto blocks = static_cast<unsigned>((B + kGreedyThreads - 1) / kGreedyThreads);
  tree_accept_greedy_kernel<<<blocks, kGreedyThreads, 0, stream>>>(
      parents, tokens, sizes, target_argmax, B, static_cast<int>(N), accept_path, accept_len,
      next_token);
  return cudaGetLastError();
}

cudaError_t tree_accept_sample(const int32_t* parents, const int64_t* tokens, const int32_t* sizes,
                               const float* target_probs, const float* draft_probs,
                               const float* uniforms, int64_t B, int64_t N, int64_t V,
                               int32_t* accept_path, int32_t* accept_len, int64_t* next_token,
                               cudaStream_t stream) {
  if (B == 0) return cudaSuccess;
  const int64_t nseg = (V + kSeg - 1) / kSeg;
  const size_t smem = nseg * sizeof(float) + N * sizeof(int32_t);
  const auto kernel = draft_probs != nullptr ? tree_accept_sample_kernel<true>
                                             : tree_accept_sample_kernel<false>;
  if (smem > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  kernel<<<static_cast<unsigned>(B), kThreads, smem, stream>>>(
      parents, tokens, sizes, target_probs, draft_probs, uniforms, static_cast<int>(N), V,
      accept_path, accept_len, next_token);
  return cudaGetLastError();
}

}  // namespace eagle_cuda
