// Skinny linear for CPU decode and tree verification: y[M, N] = x[M, K] @ w[N, K]^T with bf16 weights.
//
// Why: on CPUs without native bf16 (AVX2 only) torch's bf16 GEMV runs at ~10 GB/s, half the speed of the
// fp32 GEMV, so a bf16 model decodes slower than an fp32 one. This kernel streams each weight row once per
// call and widens bf16 -> fp32 in registers. One 256-bit load holds 16 bf16 weights; a 16-bit shift
// widens the even ones and a mask the odd ones (2 ALU ops per 16 weights, against 4 for two
// zero-extend-and-shift widenings), so x is packed once per call into the matching even/odd order.
// Verification runs a block of weight rows against a block of x rows with one accumulator per pair:
// every widened weight vector feeds several FMAs, which is what keeps a 6-32 row tree close to the cost
// of one decoded token.
//
// Batch invariance: every output element is the same chain of fp32 operations whatever M is and wherever
// its row sits in the batch (lane l of one 8-wide accumulator takes k = 16c + 2l, then 16c + 2l + 1, for
// c = 0, 1, ... in order; then a fixed horizontal sum). Verifying a tree (many rows) thus computes bit for
// bit what decoding one token computes; with bf16's coarse rounding, any other order turns near-ties into
// different greedy tokens.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "cpu_vec.h"

namespace {

inline int lane_of(int64_t k) { return static_cast<int>((k % 16) >> 1); }

// The fixed order without SIMD (any K): 8 partial sums, lane (k mod 16) / 2, k ascending; then hsum8's
// pairing. out[i * ldo + j] = dot(x row j, w row i) for NB weight rows and M x rows.
void dot_block_scalar(const float* x, const c10::BFloat16* w, int64_t NB, int64_t M, int64_t K, float* out,
                      int64_t ldo) {
  for (int64_t i = 0; i < NB; ++i) {
    for (int64_t j = 0; j < M; ++j) {
      float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t k = 0; k < K; ++k) lane[lane_of(k)] += x[j * K + k] * static_cast<float>(w[i * K + k]);
      const float a = (lane[0] + lane[4]) + (lane[2] + lane[6]), b = (lane[1] + lane[5]) + (lane[3] + lane[7]);
      out[i * ldo + j] = a + b;
    }
  }
}

#if defined(__x86_64__)
// x rows packed per 16-wide chunk as [even k's, odd k's], the order the widened weight halves come in.
template <typename T>
void pack_even_odd(const T* x, int64_t M, int64_t K, float* out) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < K; c += 16)
      for (int l = 0; l < 8; ++l) {
        out[m * K + c + l] = static_cast<float>(x[m * K + c + 2 * l]);
        out[m * K + c + 8 + l] = static_cast<float>(x[m * K + c + 2 * l + 1]);
      }
}

// Weights come from DRAM (a model's are far larger than the caches) in rows of ~1-3 KB, too short for the
// hardware prefetcher to ramp up on: prefetching the rows 8 ahead takes a 49152 x 576 GEMV from ~25 to
// ~34 GB/s. Prefetches past the weight's end are harmless hints.
constexpr int64_t kPrefetchRows = 8;

// NB weight rows against MB packed x rows, one accumulator per pair (K % 16 == 0). NB * MB accumulators
// + 2 * NB widened weight halves must fit the 16 ymm registers; x is read straight into the FMAs.
template <int NB, int MB>
EAGLE_AVX2 inline void block(const float* x, const c10::BFloat16* w, int64_t K, float* out, int64_t ldo) {
  const __m256i odd_mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 acc[NB][MB];
#pragma GCC unroll 8
  for (int i = 0; i < NB; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < MB; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    __m256 even[NB], odd[NB];
#pragma GCC unroll 8
    for (int i = 0; i < NB; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (i + kPrefetchRows) * K + k), _MM_HINT_T0);
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i * K + k));
      even[i] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      odd[i] = _mm256_castsi256_ps(_mm256_and_si256(v, odd_mask));
    }
#pragma GCC unroll 8
    for (int j = 0; j < MB; ++j) {
      const __m256 xe = _mm256_loadu_ps(x + j * K + k), xo = _mm256_loadu_ps(x + j * K + k + 8);
#pragma GCC unroll 8
      for (int i = 0; i < NB; ++i) acc[i][j] = _mm256_fmadd_ps(xo, odd[i], _mm256_fmadd_ps(xe, even[i], acc[i][j]));
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < NB; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < MB; ++j) out[i * ldo + j] = eagle::cpu::hsum8(acc[i][j]);
}

// All M rows of x against NB weight rows, in ceil(M / MB_MAX) blocks of near-equal size (a lone 1-row block
// would waste most of a weight vector's reuse).
template <int NB, int MB_MAX>
EAGLE_AVX2 void dot_block_avx2(const float* x, const c10::BFloat16* w, int64_t M, int64_t K, float* out,
                               int64_t ldo) {
  const int64_t blocks = (M + MB_MAX - 1) / MB_MAX;
  for (int64_t b = 0, m = 0; b < blocks; ++b) {
    const int64_t mb = (M - m) / (blocks - b);
    const float* xb = x + m * K;
    switch (mb) {
      case 6: if constexpr (MB_MAX >= 6) block<NB, 6>(xb, w, K, out + m, ldo); break;
      case 5: if constexpr (MB_MAX >= 5) block<NB, 5>(xb, w, K, out + m, ldo); break;
      case 4: if constexpr (MB_MAX >= 4) block<NB, 4>(xb, w, K, out + m, ldo); break;
      case 3: if constexpr (MB_MAX >= 3) block<NB, 3>(xb, w, K, out + m, ldo); break;
      case 2: block<NB, 2>(xb, w, K, out + m, ldo); break;
      default: block<NB, 1>(xb, w, K, out + m, ldo); break;
    }
    m += mb;
  }
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
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const auto* wp = w.data_ptr<at::BFloat16>();
  const bool out_bf16 = x.scalar_type() == at::kBFloat16;
  const at::Tensor xc = x.contiguous();
#if defined(__x86_64__)
  const bool avx2 = K % 16 == 0 && eagle::cpu::has_avx2();
#else
  const bool avx2 = false;
#endif
  at::Tensor xf;
  if (avx2) {
    xf = at::empty({M, K}, x.options().dtype(at::kFloat));
#if defined(__x86_64__)
    if (out_bf16) pack_even_odd(xc.data_ptr<at::BFloat16>(), M, K, xf.data_ptr<float>());
    else pack_even_odd(xc.data_ptr<float>(), M, K, xf.data_ptr<float>());
#endif
  } else {
    xf = xc.to(at::kFloat);
  }
  const float* xp = xf.data_ptr<float>();
  // Decode streams 4 weight rows at a time; verification blocks 2 weight rows x up to 6 x rows (12
  // accumulators + 4 widened weight vectors fill the ymm registers). A chunk's last rows, and CPUs without
  // AVX2 or K % 16 != 0, go one row at a time. Every output element is the same per-pair chain in all
  // of these, so the blocking changes speed, not results.
  const int64_t rows_per_block = M == 1 ? 4 : 2;
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    std::vector<float> cols(rows_per_block * M);
    for (int64_t n = n0; n < n1;) {
      const int64_t nb = avx2 && n + rows_per_block <= n1 ? rows_per_block : 1;
      const c10::BFloat16* wn = wp + n * K;
#if defined(__x86_64__)
      if (avx2 && nb == 4) dot_block_avx2<4, 1>(xp, wn, M, K, cols.data(), M);
      else if (avx2 && nb == 2) dot_block_avx2<2, 6>(xp, wn, M, K, cols.data(), M);
      else if (avx2) dot_block_avx2<1, 6>(xp, wn, M, K, cols.data(), M);
      else dot_block_scalar(xp, wn, nb, M, K, cols.data(), M);
#else
      dot_block_scalar(xp, wn, nb, M, K, cols.data(), M);
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
