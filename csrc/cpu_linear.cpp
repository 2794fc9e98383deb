// Dense linear for the CPU: y[M, N] = x[M, K] @ w[N, K]^T, w bf16, fp32 or fp16, x and y bf16 or fp32 (fp16 x
// runs as fp32), fp32 accumulation.
//
// Why: torch's CPU GEMMs give a row results that depend on how many rows are in the call (MKL's fp32 GEMM
// differs between 1, 2, 3, 5, ... rows), so a request's output would depend on its batch companions and on
// prompt chunking. And on CPUs without native bf16 (AVX2 only) torch's bf16 GEMV runs at ~10 GB/s, half the
// speed of the fp32 GEMV, and its GEMMs are several times slower than fp32 ones.
//
// Row invariance: every output element is the same chain of fp32 operations whatever M is and wherever
// its row sits in the batch: lane l of one 8-wide accumulator takes k = 16c + 2l, then 16c + 2l + 1, for
// c = 0, 1, ... in order, each as one FMA (x * w + acc, rounded once); then a fixed horizontal sum,
// ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)). Decoding one token, verifying a tree and
// prefilling a prompt alone or packed with 63 others thus compute the same bits for the same row; with
// bf16's coarse rounding, any other order turns near-ties into different greedy tokens. (Without AVX2,
// or with K % 16 != 0, a scalar loop keeps the same lanes and order but rounds each product before the
// add: row-invariant too, but not bit-equal to the SIMD kernels.)
//
// The weights' dtype only changes how a 16-wide chunk is widened to fp32 and split into its even and odd k's
// (widen16); everything after runs on fp32 values, so fp32 and fp16 weights get the same chain.
//
// The kernels, all computing that chain, picked by M and the CPU:
// - Few rows (decode, small trees: M < 8 with AVX-512, M < 32 with AVX2 only): stream the weights once
//   per call, widening bf16 -> fp32 in registers (a 16-bit shift for the even k's, a mask for the odd
//   ones, against x packed once into the matching even/odd order), one ymm accumulator per (weight row,
//   x row) pair, and prefetch the rows 8 ahead: DRAM-bound, so a small tree costs close to one token.
// - Many rows (prefill, big batches): cache blocking. Each thread takes tiles of weight rows, widens a
//   tile once into a buffer that stays in L2 (512 KB; 256 KB for AVX2), and runs x by in panels of up to
//   8 rows (AVX2: 6) that stay in L1; each panel meets every row group of the tile before the next is
//   read. With AVX-512 a zmm register holds the 8-lane chains of two weight rows against one x row (its
//   halves run exactly the ymm FMAs): 24 accumulators = 3 row pairs x 8 x rows. The AVX2 version holds
//   2 x 6 ymm chains. Where a panel would overflow L1 (K = 1536) its K is split in two, the chains' 8
//   lanes parked in memory in between, which leaves each chain's operations unchanged. On the 135M
//   Llama's shapes this runs at ~145 GFLOP/s per core with AVX-512, on a par with MKL's fp32 GEMM
//   (which needs the weights widened first), and at ~73 GFLOP/s with AVX2 (MKL's AVX2 GEMM: ~90).
//
// EAGLE_CPU_AVX512=0 takes the AVX2 kernels on an AVX-512 CPU (same results; for tests and timings).
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_ops.h"
#include "cpu_vec.h"

namespace {

inline int lane_of(int64_t k) { return static_cast<int>((k % 16) >> 1); }

// The fixed order without SIMD (any K): 8 partial sums, lane (k mod 16) / 2, k ascending; then hsum8's
// pairing. out[i * ldo + j] = dot(x row j, w row i) for NB weight rows and M x rows.
template <typename W>
void dot_block_scalar(const float* x, const W* w, int64_t NB, int64_t M, int64_t K, float* out,
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

template <typename Out>
void store_columns(Out* y, int64_t n, int64_t NB, int64_t N, const float* cols, int64_t M) {
  for (int64_t i = 0; i < NB; ++i)
    for (int64_t m = 0; m < M; ++m) y[m * N + n + i] = static_cast<Out>(cols[i * M + m]);
}

// Grow-only and cache-line aligned (a 64-byte load must not straddle two lines).
class Buffer {
 public:
  Buffer() = default;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { std::free(p_); }
  float* get(int64_t n) {
    if (n > n_) {
      std::free(p_);
      n_ = (n + 15) / 16 * 16;
      p_ = static_cast<float*>(std::aligned_alloc(64, n_ * sizeof(float)));
      if (p_ == nullptr) n_ = 0;
      TORCH_CHECK(p_ != nullptr, "linear_dense: out of memory");
    }
    return p_;
  }

 private:
  float* p_ = nullptr;
  int64_t n_ = 0;
};

// Per-thread scratch kept between calls (fresh large buffers would page-fault on every call): packed x
// (the calling thread's; it keeps the largest M x K fp32 seen, 12 MB for 2048 x 1536), a widened weight
// tile and parked accumulators (each worker's, <= 0.6 MB).
struct Scratch {
  Buffer x, w, part;
};
Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

#if defined(__x86_64__)
// 16 consecutive values of a row widened to fp32 and split as the chains take them: even = k 0, 2, .., 14,
// odd = k 1, 3, .., 15. Pure widening and moves: the values are the inputs', exactly.
// bf16: each 32-bit lane holds a (k even, k odd) pair, so a shift and a mask widen and split at once.
EAGLE_AVX2 inline void widen16(const c10::BFloat16* p, __m256& even, __m256& odd) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// fp32 / fp16: widened in order, then split by shuffles.
template <typename T>
EAGLE_AVX2 inline void widen16(const T* p, __m256& even, __m256& odd) {
  const __m256 a = eagle::cpu::load8(p), b = eagle::cpu::load8(p + 8);
  // per 128-bit lane [a0 a2 b0 b2 | a4 a6 b4 b6]; the 64-bit swap makes it [a0 a2 a4 a6 b0 b2 b4 b6]
  const __m256 e = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)), o = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1));
  even = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), _MM_SHUFFLE(3, 1, 2, 0)));
  odd = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(o), _MM_SHUFFLE(3, 1, 2, 0)));
}

// Rows of x (or of widened weights) packed per 16-wide chunk as [even k's, odd k's], the order the
// kernels' lanes take them in (K % 16 == 0).
template <typename T>
EAGLE_AVX2 void pack_even_odd(const T* x, int64_t rows, int64_t K, float* out) {
  for (int64_t i = 0; i < rows * K; i += 16) {
    __m256 e, o;
    widen16(x + i, e, o);
    _mm256_storeu_ps(out + i, e);
    _mm256_storeu_ps(out + i + 8, o);
  }
}

// ---- Few rows (decode, small trees): stream the weights ----

// Weights come from DRAM (a model's are far larger than the caches) in rows of ~1-3 KB, too short for the
// hardware prefetcher to ramp up on: prefetching the rows 8 ahead takes a 49152 x 576 GEMV from ~25 to
// ~34 GB/s. Prefetches past the weight's end are harmless hints.
constexpr int64_t kPrefetchRows = 8;

// NB weight rows against MB packed x rows, one accumulator per pair (K % 16 == 0). NB * MB accumulators
// + 2 * NB widened weight halves must fit the 16 ymm registers; x is read straight into the FMAs.
template <int NB, int MB, typename W>
EAGLE_AVX2 inline void block(const float* x, const W* w, int64_t K, float* out, int64_t ldo) {
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
      if constexpr (sizeof(W) == 4)  // 64 bytes a chunk: both cache lines
        _mm_prefetch(reinterpret_cast<const char*>(w + (i + kPrefetchRows) * K + k + 8), _MM_HINT_T0);
      widen16(w + i * K + k, even[i], odd[i]);
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
template <int NB, int MB_MAX, typename W>
EAGLE_AVX2 void dot_block_avx2(const float* x, const W* w, int64_t M, int64_t K, float* out,
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

template <typename W>
void streamed(const float* xp, const W* wp, int64_t M, int64_t K, int64_t N, at::Tensor& y) {
  // Decode streams 4 weight rows at a time, small trees 2 weight rows x up to 6 x rows (12 accumulators +
  // 4 widened weight vectors fill the ymm registers); a chunk's last rows go one at a time.
  const int64_t rows_per_block = M == 1 ? 4 : 2;
  const bool out_bf16 = y.scalar_type() == at::kBFloat16;
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    std::vector<float> cols(rows_per_block * M);
    for (int64_t n = n0; n < n1;) {
      const int64_t nb = n + rows_per_block <= n1 ? rows_per_block : 1;
      const W* wn = wp + n * K;
      if (nb == 4) dot_block_avx2<4, 1>(xp, wn, M, K, cols.data(), M);
      else if (nb == 2) dot_block_avx2<2, 6>(xp, wn, M, K, cols.data(), M);
      else dot_block_avx2<1, 6>(xp, wn, M, K, cols.data(), M);
      if (out_bf16) store_columns(y.data_ptr<at::BFloat16>(), n, nb, N, cols.data(), M);
      else store_columns(y.data_ptr<float>(), n, nb, N, cols.data(), M);
      n += nb;
    }
  });
}

// ---- Many rows (prefill, big batches): cache blocking ----
//
// A Kernel computes R weight rows x up to MB x rows per call from a widened weight tile and packed x,
// each output one register chain (see the header).

// 8 chains at once, each with hsum8's pairing ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)); the
// result lists them in v's order.
EAGLE_AVX2 inline __m256 hsum8x8(const __m256* v) {
  __m256 s[4];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)  // [v_i: l_q + l_q+4 for q < 4 | v_i+4: the same]
    s[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[i], v[i + 4], 0x20), _mm256_permute2f128_ps(v[i], v[i + 4], 0x31));
  // per 128-bit lane [s_i: (l0+l4) + (l2+l6), s_i: (l1+l5) + (l3+l7), s_i+1: ..., s_i+1: ...]
  const __m256 t01 = _mm256_add_ps(_mm256_shuffle_ps(s[0], s[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(s[0], s[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 t23 = _mm256_add_ps(_mm256_shuffle_ps(s[2], s[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(s[2], s[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm256_add_ps(_mm256_shuffle_ps(t01, t23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm256_shuffle_ps(t01, t23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// c10's float -> bf16 rounding (nearest even; NaN -> 0x7FC0) of 8 lanes.
EAGLE_AVX2 inline __m128i to_bf16x8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1)),
                                        _mm256_set1_epi32(0x7FFF));
  __m256i top = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
  top = _mm256_blendv_epi8(top, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  const __m256i packed = _mm256_packus_epi32(top, top);  // [t0-3 t0-3 | t4-7 t4-7]
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, _MM_SHUFFLE(3, 1, 2, 0)));
}

// Results row-major [MB][R] (res) stored as y rows, nr <= R columns of each.
template <int R, int MB, typename Out>
inline void store_rows(const Out* res, Out* y, int64_t ldy, int64_t nr) {
  if (nr == R) {
#pragma GCC unroll 16
    for (int j = 0; j < MB; ++j) std::memcpy(y + j * ldy, res + j * R, R * sizeof(Out));
  } else {
    for (int j = 0; j < MB; ++j) std::memcpy(y + j * ldy, res + j * R, nr * sizeof(Out));
  }
}

// AVX2: 2 weight rows x 6 x rows, ymm accumulators (12, + 4 widened weight vectors: the 16 registers).
struct Avx2Kernel {
  static constexpr int R = 2, MB = 6;
  static constexpr int64_t kTileBytes = 256 << 10;  // widened tile: half an L2 of Zen 2/3
  static constexpr int64_t kPanelBytes = 24 << 10;  // x panel slice kept in L1

  // Rows [n0, n1) widened, per row [even k's, odd k's] per chunk; padded to a multiple of R rows with
  // copies of the last (whose results are never stored).
  template <typename W>
  EAGLE_AVX2 static void pack(const W* w, int64_t n0, int64_t n1, int64_t K, float* out) {
    const int64_t rows = n1 - n0, padded = (rows + R - 1) / R * R;
    pack_even_odd(w + n0 * K, rows, K, out);
    for (int64_t r = rows; r < padded; ++r) std::memcpy(out + r * K, out + (rows - 1) * K, K * sizeof(float));
  }

  // y[j * ldy + r] = dot(x row j, w row r), r < nr; chunks [k0, k1) only, starting from / parking the
  // chains in part unless k0 == 0 / k1 == K.
  template <int MBv, typename Out>
  EAGLE_AVX2 static void micro(const float* x, const float* w, int64_t K, int64_t k0, int64_t k1, float* part,
                               Out* y, int64_t ldy, int64_t nr) {
    constexpr int A = MBv * R;  // accumulator j * R + i: x row j, weight row i
    __m256 acc[A];
#pragma GCC unroll 16
    for (int a = 0; a < A; ++a) acc[a] = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(part + 8 * a);
    for (int64_t k = k0; k < k1; k += 16) {
      __m256 even[R], odd[R];
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) {
        even[i] = _mm256_loadu_ps(w + i * K + k);
        odd[i] = _mm256_loadu_ps(w + i * K + k + 8);
      }
#pragma GCC unroll 16
      for (int j = 0; j < MBv; ++j) {
        const __m256 xe = _mm256_loadu_ps(x + j * K + k), xo = _mm256_loadu_ps(x + j * K + k + 8);
#pragma GCC unroll 4
        for (int i = 0; i < R; ++i) acc[j * R + i] = _mm256_fmadd_ps(xo, odd[i], _mm256_fmadd_ps(xe, even[i], acc[j * R + i]));
      }
    }
    if (k1 < K) {
#pragma GCC unroll 16
      for (int a = 0; a < A; ++a) _mm256_storeu_ps(part + 8 * a, acc[a]);
      return;
    }
    constexpr int G = (A + 7) / 8;
    alignas(32) Out res[8 * G];  // row-major [MBv][R]
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
      __m256 v[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) v[i] = g * 8 + i < A ? acc[g * 8 + i] : _mm256_setzero_ps();
      if constexpr (std::is_same_v<Out, float>) _mm256_store_ps(res + 8 * g, hsum8x8(v));
      else _mm_store_si128(reinterpret_cast<__m128i*>(res + 8 * g), to_bf16x8(hsum8x8(v)));
    }
    store_rows<R, MBv>(res, y, ldy, nr);
  }
};

// 16 chains at once, each with hsum8's pairing: v[0..7] hold 16 chains (v[i]'s low half, then its high
// half); the result lists them in that order.
EAGLE_AVX512 inline __m512 hsum8x16(const __m512* v) {
  __m512 s[4];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)  // 128-bit lanes [v_i low, v_i high, v_i+4 low, v_i+4 high], each l_q + l_q+4
    s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 4], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(v[i], v[i + 4], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 t01 = _mm512_add_ps(_mm512_shuffle_ps(s[0], s[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_ps(s[0], s[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 t23 = _mm512_add_ps(_mm512_shuffle_ps(s[2], s[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_ps(s[2], s[3], _MM_SHUFFLE(3, 2, 3, 2)));
  // element 4L + e: v_e (L < 2) or v_e+4 (L >= 2), low half for even L
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(t01, t23, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(t01, t23, _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15), r);
}

// c10's float -> bf16 rounding (nearest even; NaN -> 0x7FC0) of 16 lanes.
EAGLE_AVX512 inline __m256i to_bf16x16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7FFF));
  const __m512i top = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  return _mm512_cvtepi32_epi16(
      _mm512_mask_mov_epi32(top, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0)));
}

// AVX-512: a zmm accumulator holds the 8-lane chains of weight rows 2q and 2q + 1 against one x row in
// its two halves. Each lane runs exactly the FMAs of the ymm kernels, so the results are the same bits.
// 3 row pairs x 8 x rows: 24 accumulators + 6 weight vectors + 1 broadcast x half of the 32 registers.
struct Avx512Kernel {
  static constexpr int NP = 3, R = 2 * NP, MB = 8;
  static constexpr int64_t kTileBytes = 512 << 10;  // widened tile in L2 (1-2 MB on AVX-512 parts)
  static constexpr int64_t kPanelBytes = 32 << 10;

  // Rows [n0, n1) widened and interleaved per row pair: pair q's chunk c at out + q * 2K + 32c is [row
  // 2q's even k's, row 2q + 1's even k's, row 2q's odd k's, row 2q + 1's odd k's]. Padded to a multiple of
  // R rows with copies of the last (whose results are never stored).
  template <typename W>
  EAGLE_AVX512 static void pack(const W* w, int64_t n0, int64_t n1, int64_t K, float* out) {
    const int64_t padded = n0 + (n1 - n0 + R - 1) / R * R;
    for (int64_t r = n0; r < padded; r += 2) {
      const W* a = w + std::min(r, n1 - 1) * K;
      const W* b = w + std::min(r + 1, n1 - 1) * K;
      float* o = out + (r - n0) * K;
      for (int64_t k = 0; k < K; k += 16, o += 32) {
        __m256 ae, ao, be, bo;
        widen16(a + k, ae, ao);
        widen16(b + k, be, bo);
        _mm512_storeu_ps(o, eagle::cpu::join8(ae, be));
        _mm512_storeu_ps(o + 16, eagle::cpu::join8(ao, bo));
      }
    }
  }

  template <int MBv, typename Out>
  EAGLE_AVX512 static void micro(const float* x, const float* w, int64_t K, int64_t k0, int64_t k1, float* part,
                                 Out* y, int64_t ldy, int64_t nr) {
    constexpr int A = MBv * NP;  // accumulator j * NP + q: x row j, weight rows 2q, 2q + 1
    __m512 acc[A];
#pragma GCC unroll 32
    for (int a = 0; a < A; ++a) acc[a] = k0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(part + 16 * a);
    for (int64_t k = k0; k < k1; k += 16) {
      __m512 even[NP], odd[NP];
#pragma GCC unroll 4
      for (int q = 0; q < NP; ++q) {
        even[q] = _mm512_loadu_ps(w + q * 2 * K + 2 * k);
        odd[q] = _mm512_loadu_ps(w + q * 2 * K + 2 * k + 16);
      }
#pragma GCC unroll 16
      for (int j = 0; j < MBv; ++j) {
        const double* xj = reinterpret_cast<const double*>(x + j * K + k);
        const __m512 xe = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd(xj)));
#pragma GCC unroll 4
        for (int q = 0; q < NP; ++q) acc[j * NP + q] = _mm512_fmadd_ps(xe, even[q], acc[j * NP + q]);
        const __m512 xo = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd(xj + 4)));
#pragma GCC unroll 4
        for (int q = 0; q < NP; ++q) acc[j * NP + q] = _mm512_fmadd_ps(xo, odd[q], acc[j * NP + q]);
      }
    }
    if (k1 < K) {
#pragma GCC unroll 32
      for (int a = 0; a < A; ++a) _mm512_storeu_ps(part + 16 * a, acc[a]);
      return;
    }
    constexpr int G = (A + 7) / 8;
    alignas(64) Out res[16 * G];  // row-major [MBv][R]
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
      __m512 v[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) v[i] = g * 8 + i < A ? acc[g * 8 + i] : _mm512_setzero_ps();
      if constexpr (std::is_same_v<Out, float>) _mm512_store_ps(res + 16 * g, hsum8x16(v));
      else _mm256_store_si256(reinterpret_cast<__m256i*>(res + 16 * g), to_bf16x16(hsum8x16(v)));
    }
    store_rows<R, MBv>(res, y, ldy, nr);
  }
};

template <typename Kernel, typename Out>
using Micro = void (*)(const float*, const float*, int64_t, int64_t, int64_t, float*, Out*, int64_t, int64_t);

template <typename Kernel, typename Out, int... I>
constexpr std::array<Micro<Kernel, Out>, sizeof...(I)> micro_table(std::integer_sequence<int, I...>) {
  return {&Kernel::template micro<I + 1, Out>...};
}

// Weight rows [n0, n1) against all of x (packed).
template <typename Kernel, typename Out, typename W>
void tile(const float* xp, const W* w, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1, Out* y) {
  constexpr int R = Kernel::R, MB = Kernel::MB;
  static constexpr auto micro = micro_table<Kernel, Out>(std::make_integer_sequence<int, MB>{});
  Scratch& s = scratch();
  const int64_t rows = n1 - n0, groups = (rows + R - 1) / R;
  float* wt = s.w.get(groups * R * K);
  Kernel::pack(w, n0, n1, K, wt);
  // Past kPanelBytes a panel's K is split into blocks, the chains (all 8 lanes, exactly) parked in part.
  const int64_t kblocks = std::max<int64_t>(1, (MB * K * 4 + Kernel::kPanelBytes - 1) / Kernel::kPanelBytes);
  const int64_t kc = (K / 16 + kblocks - 1) / kblocks * 16;
  float* part = s.part.get(groups * R * MB * 8);
  const int64_t panels = (M + MB - 1) / MB;  // of near-equal size
  for (int64_t b = 0, m = 0; b < panels; ++b) {
    const int64_t mb = (M - m) / (panels - b);
    for (int64_t k0 = 0; k0 < K; k0 += kc)
      for (int64_t g = 0; g < groups; ++g)
        micro[mb - 1](xp + m * K, wt + g * R * K, K, k0, std::min(K, k0 + kc), part + g * R * MB * 8,
                      y + m * N + n0 + g * R, N, std::min<int64_t>(R, rows - g * R));
    m += mb;
  }
}

template <typename Kernel, typename T, typename W>
void blocked(const T* x, const W* w, int64_t M, int64_t K, int64_t N, T* y) {
  constexpr int R = Kernel::R;
  float* xp = scratch().x.get(M * K);  // the calling thread's
  at::parallel_for(0, M, std::max<int64_t>(1, (1 << 16) / K), [&](int64_t m0, int64_t m1) {
    pack_even_odd(x + m0 * K, m1 - m0, K, xp + m0 * K);
  });
  // Tiles of near-equal size, a multiple of R rows, as many per thread.
  const int64_t threads = at::get_num_threads();
  const int64_t max_rows = std::max<int64_t>(R, Kernel::kTileBytes / (4 * K));
  int64_t tiles = (N + max_rows - 1) / max_rows;
  tiles = (tiles + threads - 1) / threads * threads;
  const int64_t tile_rows = ((N + tiles - 1) / tiles + R - 1) / R * R;
  tiles = (N + tile_rows - 1) / tile_rows;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      tile<Kernel>(xp, w, M, K, N, t * tile_rows, std::min(N, (t + 1) * tile_rows), y);
  });
}
#endif

using eagle::cpu::use_avx512;

}  // namespace


namespace {

// y = x @ w^T for x [M, K] of type T (bf16 / fp32, also the output's) and w [N, K] of type W.
template <typename T, typename W>
void dense(const T* x, const W* w, int64_t M, int64_t K, int64_t N, at::Tensor& y) {
#if defined(__x86_64__)
  if (K % 16 == 0 && eagle::cpu::has_avx2()) {
    // From these row counts the blocked kernels win (measured on a Xeon: with AVX-512, 8 rows take the
    // 135M Llama's layers 20-35% faster and leave its 49152-row lm_head within 5%; the AVX2 ones pass the
    // streaming kernel between 16 and 32 rows).
    const bool z = use_avx512();
    if (M >= (z ? 8 : 32)) {
      if (z) blocked<Avx512Kernel>(x, w, M, K, N, y.data_ptr<T>());
      else blocked<Avx2Kernel>(x, w, M, K, N, y.data_ptr<T>());
      return;
    }
    float* xp = scratch().x.get(M * K);
    pack_even_odd(x, M, K, xp);
    streamed(xp, w, M, K, N, y);
    return;
  }
#endif
  // No AVX2 or K % 16 != 0: one weight row at a time.
  const at::Tensor xf = at::from_blob(const_cast<T*>(x), {M, K}, y.options()).to(at::kFloat);
  const float* xp = xf.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    std::vector<float> cols(M);
    for (int64_t n = n0; n < n1; ++n) {
      dot_block_scalar(xp, w + n * K, 1, M, K, cols.data(), M);
      store_columns(y.data_ptr<T>(), n, 1, N, cols.data(), M);
    }
  });
}

template <typename T>
void dense_any_weight(const T* x, const at::Tensor& w, int64_t M, int64_t K, int64_t N, at::Tensor& y) {
  switch (w.scalar_type()) {
    case at::kBFloat16: return dense(x, w.data_ptr<at::BFloat16>(), M, K, N, y);
    case at::kFloat: return dense(x, w.data_ptr<float>(), M, K, N, y);
    default: return dense(x, w.data_ptr<at::Half>(), M, K, N, y);
  }
}

}  // namespace

namespace eagle::cpu {

// One kernel call per step and layer: the output is written in place ([M, N], x's dtype), so no
// conversion or transpose ops surround it (each costs more than the GEMV at these sizes). fp16 x runs
// as fp32 and is rounded once at the end (the same value a direct fp16 store would give).
at::Tensor linear_dense(const at::Tensor& x, const at::Tensor& w) {
  const auto floating = [](at::ScalarType t) { return t == at::kBFloat16 || t == at::kFloat || t == at::kHalf; };
  TORCH_CHECK_VALUE(w.dim() == 2 && floating(w.scalar_type()) && w.is_contiguous() && w.device().is_cpu(),
                    "linear_dense: w must be a contiguous bf16 / fp32 / fp16 CPU [N, K] tensor");
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) == w.size(1) && x.device().is_cpu(),
                    "linear_dense: x must be a CPU [M, K] with K = w.size(1)");
  TORCH_CHECK_VALUE(floating(x.scalar_type()), "linear_dense: x must be bf16, fp32 or fp16");
  if (x.scalar_type() == at::kHalf) return linear_dense(x.to(at::kFloat), w).to(at::kHalf);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) return y.zero_();
  const at::Tensor xc = x.contiguous();
  if (x.scalar_type() == at::kBFloat16) dense_any_weight(xc.data_ptr<at::BFloat16>(), w, M, K, N, y);
  else dense_any_weight(xc.data_ptr<float>(), w, M, K, N, y);
  return y;
}

}  // namespace eagle::cpu

TORCH_LIBRARY_FRAGMENT(eagle, m) {
  m.def("linear_dense(Tensor x, Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(eagle, CPU, m) {
  m.impl("linear_dense", &eagle::cpu::linear_dense);
}
