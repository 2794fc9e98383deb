// Skinny linear for CPU decode and tree verification: y[M, N] = x[M, K] @ w[N, K]^T with bf16 weights.
//
// Why: on CPUs without native bf16 (AVX2 only) torch's bf16 GEMV runs at ~10 GB/s, half the speed of the
// fp32 GEMV, so a bf16 model decodes slower than an fp32 one. Decode is weight-bandwidth bound; this
// kernel streams each weight row once per call, widens bf16 -> fp32 in registers (a 16-bit shift) and
// accumulates the rows of x against it in fp32.
//
// Batch invariance: every output element is the same chain of fp32 operations whatever M is and wherever
// its row sits in the batch (lane l of one 8-wide accumulator takes k = l, l + 8, ... in order, then a
// fixed horizontal sum). Verifying a tree (many rows) thus computes bit for bit what decoding one token
// computes; with bf16's coarse rounding, any other order turns near-ties into different greedy tokens.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "cpu_vec.h"

namespace {

// The fixed order, without SIMD: 8 partial sums (k mod 8), then hsum8's pairing. out[j * ldo + i] =
// dot(x row j, w row i) for NB weight rows and M x rows.
void dot_block_scalar(const float* x, const c10::BFloat16* w, int64_t NB, int64_t M, int64_t K, float* out,
                      int64_t ldo) {
  for (int64_t i = 0; i < NB; ++i) {
    for (int64_t j = 0; j < M; ++j) {
      float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t k = 0; k < K; ++k) lane[k % 8] += x[j * K + k] * static_cast<float>(w[i * K + k]);
      const float a = (lane[0] + lane[4]) + (lane[2] + lane[6]), b = (lane[1] + lane[5]) + (lane[3] + lane[7]);
      out[i * ldo + j] = a + b;
    }
  }
}

#if defined(__x86_64__)
// NB weight rows against MB rows of x, one accumulator chain per pair (K % 8 == 0). At NB = 4, MB = 3:
// 12 accumulators + 3 x vectors + 1 weight vector = all 16 ymm registers, each weight vector loaded once
// for MB FMAs and each x vector once for NB.
template <int NB, int MB>
EAGLE_AVX2 inline void block(const float* x, const c10::BFloat16* w, int64_t K, float* out, int64_t ldo) {
  using eagle::cpu::hsum8;
  using eagle::cpu::load8;
  __m256 acc[NB][MB];
#pragma GCC unroll 4
  for (int i = 0; i < NB; ++i)
#pragma GCC unroll 3
    for (int j = 0; j < MB; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 xv[MB];
#pragma GCC unroll 3
    for (int j = 0; j < MB; ++j) xv[j] = _mm256_loadu_ps(x + j * K + k);
#pragma GCC unroll 4
    for (int i = 0; i < NB; ++i) {
      const __m256 wv = load8(w + i * K + k);
#pragma GCC unroll 3
      for (int j = 0; j < MB; ++j) acc[i][j] = _mm256_fmadd_ps(xv[j], wv, acc[i][j]);
    }
  }
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) out[i * ldo + j] = hsum8(acc[i][j]);
}

template <int NB>
EAGLE_AVX2 void dot_block_avx2(const float* x, const c10::BFloat16* w, int64_t M, int64_t K, float* out,
                               int64_t ldo) {
  int64_t m = 0;
  for (; m + 3 <= M; m += 3) block<NB, 3>(x + m * K, w, K, out + m, ldo);
  if (M - m == 2) block<NB, 2>(x + m * K, w, K, out + m, ldo);
  if (M - m == 1) block<NB, 1>(x + m * K, w, K, out + m, ldo);
}
#endif

template <typename Out>
void store_columns(Out* y, int64_t n, int64_t NB, int64_t N, const float* cols, int64_t M) {
  for (int64_t i = 0; i < NB; ++i)
    for (int64_t m = 0; m < M; ++m) y[m * N + n + i] = static_cast<Out>(cols[i * M + m]);
}

// One kernel call per step and layer: the output is written in place ([M, N], x's dtype), so no
// conversion or transpose ops surround it (each costs more than the GEMV at these sizes).
at::Tensor linear_bf16_cpu(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.is_contiguous(),
              "linear_bf16: w must be a contiguous bf16 [N, K] tensor");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.size(1), "linear_bf16: x must be [M, K] with K = w.size(1)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "linear_bf16: x must be bf16 or fp32");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const at::Tensor xf = x.scalar_type() == at::kFloat ? x.contiguous() : x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = xf.data_ptr<float>();
  const auto* wp = w.data_ptr<at::BFloat16>();
#if defined(__x86_64__)
  const bool avx2 = K % 8 == 0 && eagle::cpu::has_avx2();
#endif
  const bool out_bf16 = x.scalar_type() == at::kBFloat16;
  // Weight rows in blocks of 4 (then single rows at a chunk's end); either way each output element is
  // computed by the same per-pair chain, so the blocking changes speed, not results.
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    std::vector<float> cols(4 * M);
    for (int64_t n = n0; n < n1;) {
      const int64_t nb = n + 4 <= n1 ? 4 : 1;
#if defined(__x86_64__)
      if (avx2 && nb == 4) dot_block_avx2<4>(xp, wp + n * K, M, K, cols.data(), M);
      else if (avx2) dot_block_avx2<1>(xp, wp + n * K, M, K, cols.data(), M);
      else dot_block_scalar(xp, wp + n * K, nb, M, K, cols.data(), M);
#else
      dot_block_scalar(xp, wp + n * K, nb, M, K, cols.data(), M);
#endif
      if (out_bf16) store_columns(y.data_ptr<at::BFloat16>(), n, nb, N, cols.data(), M);
      else store_columns(y.data_ptr<float>(), n, nb, N, cols.data(), M);
      n += nb;
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(eagle, m) {
  m.def("linear_bf16(Tensor x, Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(eagle, CPU, m) {
  m.impl("linear_bf16", &linear_bf16_cpu);
}
