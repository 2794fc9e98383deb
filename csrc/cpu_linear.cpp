// Skinny linear for CPU decode: y[M, N] = x[M, K] @ w[N, K]^T with bf16 weights, M small (<= 32).
//
// Why: on CPUs without native bf16 (AVX2 only) torch's bf16 GEMV runs at ~10 GB/s, half the speed of the
// fp32 GEMV, so a bf16 model decodes slower than an fp32 one. Decode is weight-bandwidth bound; this
// kernel streams each weight row once, widens bf16 -> fp32 in registers (a 16-bit shift) and
// accumulates all M rows of x against it in fp32.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <cstdint>
#include <cstring>

#include "cpu_vec.h"

namespace {

constexpr int64_t kMaxRows = 32;

inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// One weight row against M activation rows (fp32, [M, K] contiguous): out[m] = dot(x[m], w).
void dot_rows_scalar(const float* x, const uint16_t* w, int64_t M, int64_t K, float* out) {
  for (int64_t m = 0; m < M; ++m) out[m] = 0.f;
  for (int64_t k = 0; k < K; ++k) {
    const float wk = bf16_to_float(w[k]);
    for (int64_t m = 0; m < M; ++m) out[m] += x[m * K + k] * wk;
  }
}

#if defined(__x86_64__)
// Requires K % 8 == 0. Accumulators live in registers for 4 (then 2, then 1) rows of x at a time, so
// each weight vector is loaded once per group of rows.
EAGLE_AVX2 void dot_rows_avx2(const float* x, const uint16_t* w, int64_t M,
                              int64_t K, float* out) {
  const auto* wb = reinterpret_cast<const c10::BFloat16*>(w);
  using eagle::cpu::hsum8;
  using eagle::cpu::load8;
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const float* x0 = x + m * K;
    for (int64_t k = 0; k < K; k += 8) {
      const __m256 wk = load8(wb + k);
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + k), wk, a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + K + k), wk, a1);
      a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + 2 * K + k), wk, a2);
      a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + 3 * K + k), wk, a3);
    }
    out[m] = hsum8(a0), out[m + 1] = hsum8(a1), out[m + 2] = hsum8(a2), out[m + 3] = hsum8(a3);
  }
  if (m + 2 <= M) {  // 2 rows x 2 interleaved k-chunks: 4 independent FMA chains hide FMA latency
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
    const float* x0 = x + m * K;
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      const __m256 w0 = load8(wb + k), w1 = load8(wb + k + 8);
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + k), w0, a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + K + k), w0, a1);
      b0 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + k + 8), w1, b0);
      b1 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + K + k + 8), w1, b1);
    }
    for (; k < K; k += 8) {
      const __m256 wk = load8(wb + k);
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + k), wk, a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + K + k), wk, a1);
    }
    out[m] = hsum8(_mm256_add_ps(a0, b0)), out[m + 1] = hsum8(_mm256_add_ps(a1, b1));
    m += 2;
  }
  if (m < M) {  // the last row: 4 k-chunks in flight (one accumulator would wait on each FMA)
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const float* x0 = x + m * K;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + k), load8(wb + k), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + k + 8), load8(wb + k + 8), a1);
      a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + k + 16), load8(wb + k + 16), a2);
      a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + k + 24), load8(wb + k + 24), a3);
    }
    for (; k < K; k += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + k), load8(wb + k), a0);
    out[m] = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  }
}

// Four weight rows against MB rows of x: 4 x MB accumulators in registers (12 + 3 x vectors + 1 weight
// vector = all 16 ymm at MB = 3), so each loaded weight vector feeds MB FMAs and each x vector 4 -- the
// single-row kernel above reloads x for every weight row, which caps it at ~1.6 FMAs a cycle once M > 1.
// out: [4, ldo], column m = x row m.
template <int MB>
EAGLE_AVX2 inline void block4(const float* x, const c10::BFloat16* w, int64_t K, float* out, int64_t ldo) {
  using eagle::cpu::hsum8;
  using eagle::cpu::load8;
  __m256 acc[4][MB];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)
#pragma GCC unroll 3
    for (int j = 0; j < MB; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 xv[MB];
#pragma GCC unroll 3
    for (int j = 0; j < MB; ++j) xv[j] = _mm256_loadu_ps(x + j * K + k);
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const __m256 wv = load8(w + i * K + k);
#pragma GCC unroll 3
      for (int j = 0; j < MB; ++j) acc[i][j] = _mm256_fmadd_ps(xv[j], wv, acc[i][j]);
    }
  }
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < MB; ++j) out[i * ldo + j] = hsum8(acc[i][j]);
}

// Weight rows n .. n+3 against all M rows of x (K % 8 == 0) -> out [4, ldo].
EAGLE_AVX2 void dot4_rows_avx2(const float* x, const uint16_t* w, int64_t M, int64_t K, float* out, int64_t ldo) {
  const auto* wb = reinterpret_cast<const c10::BFloat16*>(w);
  int64_t m = 0;
  for (; m + 3 <= M; m += 3) block4<3>(x + m * K, wb, K, out + m, ldo);
  if (M - m == 2) block4<2>(x + m * K, wb, K, out + m, ldo);
  if (M - m == 1) block4<1>(x + m * K, wb, K, out + m, ldo);
}
#endif

using DotRows = void (*)(const float*, const uint16_t*, int64_t, int64_t, float*);

DotRows pick_kernel(int64_t K) {
#if defined(__x86_64__)
  if (K % 8 == 0 && eagle::cpu::has_avx2()) return dot_rows_avx2;
#endif
  return dot_rows_scalar;
}

template <typename Out>
void store_column(Out* y, int64_t n, int64_t N, const float* col, int64_t M) {
  for (int64_t m = 0; m < M; ++m) y[m * N + n] = static_cast<Out>(col[m]);
}

// One kernel call per step and layer: the output is written in place ([M, N], x's dtype), so no
// conversion or transpose ops surround it (each costs more than the GEMV at these sizes).
at::Tensor linear_bf16_cpu(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.is_contiguous(),
              "linear_bf16: w must be a contiguous bf16 [N, K] tensor");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.size(1), "linear_bf16: x must be [M, K] with K = w.size(1)");
  TORCH_CHECK(x.size(0) <= kMaxRows, "linear_bf16: at most ", kMaxRows, " rows");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "linear_bf16: x must be bf16 or fp32");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const at::Tensor xf = x.scalar_type() == at::kFloat ? x.contiguous() : x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = xf.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  const DotRows dot = pick_kernel(K);
#if defined(__x86_64__)
  const bool blocked = dot == dot_rows_avx2 && M > 1;  // M = 1 is bandwidth-bound: the row kernel is as fast
#else
  const bool blocked = false;
#endif
  const bool out_bf16 = x.scalar_type() == at::kBFloat16;
  auto store = [&](int64_t n, const float* col) {
    if (out_bf16) store_column(y.data_ptr<at::BFloat16>(), n, N, col, M);
    else store_column(y.data_ptr<float>(), n, N, col, M);
  };
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    float cols[4][kMaxRows];
    int64_t n = n0;
#if defined(__x86_64__)
    for (; blocked && n + 4 <= n1; n += 4) {
      dot4_rows_avx2(xp, wp + n * K, M, K, cols[0], kMaxRows);
      for (int i = 0; i < 4; ++i) store(n + i, cols[i]);
    }
#endif
    for (; n < n1; ++n) {  // the chunk's last rows (and CPUs without AVX2)
      dot(xp, wp + n * K, M, K, cols[0]);
      store(n, cols[0]);
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
