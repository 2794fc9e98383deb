// Linear layers on block-quantized weights for the CPU: y[M, N] = x[M, K] @ dequant(w)[N, K]^T.
//
// Why: decode on a CPU reads every weight once per token, so bytes per weight set the speed. Weights stay in
// the GGUF types the file holds (4.5 or 8.5 bits a weight instead of bf16's 16), blocks of 32 along K:
//   Q8_0 (GGML type 8): fp16 d, int8 q[32];                 w = d * q
//   Q4_1 (GGML type 3): fp16 d, fp16 m, q[32] in 0..15;     w = d * q + m
// rearranged at load time (eagle_kernels/quant.py, same bits) so that SIMD loads fit: a row is its nb fp16 d's,
// (Q4_1) its nb fp16 m's, then its quants by pairs of blocks (64 weights), each pair in "interleaved" order:
// position o holds weight k = 4 * (g / 2) + o % 4 of block 2c + g % 2, g = o / 4 (4-byte groups alternate
// between the two blocks). Q8_0 stores the 64 int8 as they are; Q4_1 packs position o (low nibble) with
// position o + 32 (high nibble) in byte o, so one 32-byte load splits into positions 0-31 and 32-63.
//
// Activations are quantized on the fly per row and block (as llama.cpp does): xd = max|x| / 127,
// xq = round-to-nearest-even(x * (1 / xd)), xs = xd * sum(xq), stored in the same interleaved order. Each
// 4-byte group's products then sum exactly in an int32 lane (AVX2 maddubs + madd, AVX-512 VNNI dpbusd: no
// saturation for |xq| <= 127 against 0..15 or |q| <= 128), and the fp32 work is one FMA per block.
//
// Row invariance: element (m, n) is always this chain, whatever M and wherever row m sits (and on either
// instruction set), so greedy speculative decoding stays token-identical to vanilla on the same weights:
//   s_b = dw_b * xd_b; for each pair c, each of the 16 groups g: acc[g] = fma(s_{2c + g % 2}, float(p_g), acc[g])
//   mt (Q4_1) = hsum8 of 8 lanes fma(mw_b, xs_b, lane[b % 8]) over b < nb8 = nb / 8 * 8, then fma over b >= nb8
//   y = hsum8(acc[0..8) + acc[8..16)) + mt,  hsum8(v) = ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7))
// The scalar path (no AVX2) computes the same chain with std::fma and gives the same bits.
//
// Tiles: a few x rows (decode, verification) stream the weights once, NB weight rows x R x rows per pass with
// every accumulator in a register; more rows go in panels of 4 over chunks of weight rows that stay in L1.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"

#if defined(__x86_64__)
#define EAGLE_AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#endif

namespace {

constexpr int64_t kBlock = 32, kPair = 64;
constexpr int64_t kQ4_1 = 3, kQ8_0 = 8;  // GGML type ids

inline float half_to_float(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

struct Weights {
  const uint8_t* p;
  int64_t nb, row_bytes;
  bool q4;
  const uint16_t* d(int64_t n) const { return reinterpret_cast<const uint16_t*>(p + n * row_bytes); }
  const uint16_t* m(int64_t n) const { return d(n) + nb; }
  const uint8_t* q(int64_t n) const { return p + n * row_bytes + (q4 ? 4 : 2) * nb; }
};

// x quantized: q [M, K] (interleaved by pairs), d and s [M, nb]. Kept per calling thread between calls.
struct QuantX {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  int64_t K = 0, nb = 0;
};

QuantX& scratch() {
  thread_local QuantX x;
  return x;
}

inline int64_t interleaved(int64_t o) { return 32 * ((o / 4) % 2) + 4 * (o / 8) + o % 4; }  // pair position -> natural

bool use_avx512() {
#if defined(__x86_64__)
  static const bool ok = [] {
    const char* env = std::getenv("EAGLE_CPU_AVX512");
    const bool off = env && env[0] == '0' && env[1] == 0;
    return !off && eagle::cpu::has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  }();
  return ok;
#else
  return false;
#endif
}

// ---- activation quantization: one pair of blocks (64 values) ----

template <typename T>
void quantize_pair_scalar(const T* x, int8_t* q, float* d, float* s) {
  int8_t nat[kPair];
  for (int blk = 0; blk < 2; ++blk) {
    float v[kBlock], amax = 0.f;
    for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(v[i] = static_cast<float>(x[blk * kBlock + i])));
    const float dx = amax / 127.f, id = dx != 0.f ? 1.f / dx : 0.f;
    int sum = 0;
    for (int i = 0; i < kBlock; ++i) sum += nat[blk * kBlock + i] = static_cast<int8_t>(std::nearbyint(v[i] * id));
    d[blk] = dx;
    s[blk] = dx * static_cast<float>(sum);
  }
  for (int o = 0; o < kPair; ++o) q[o] = nat[interleaved(o)];
}

#if defined(__x86_64__)
EAGLE_AVX2 inline int hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1))));
}

// 32 values -> 32 int8 in natural order (as 8-lane int32 groups: lane l = bytes 4l..4l+3), d, s.
template <typename T>
EAGLE_AVX2 inline __m256i quantize_block(const T* x, float* d, float* s) {
  __m256 v[4];
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i] = eagle::cpu::load8(x + 8 * i)));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  const float dx = _mm_cvtss_f32(m) / 127.f, id = dx != 0.f ? 1.f / dx : 0.f;
  __m256i i32[4];
  for (int i = 0; i < 4; ++i)
    i32[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], _mm256_set1_ps(id)),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const int sum = hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3])));
  *d = dx;
  *s = dx * static_cast<float>(sum);
  // packs work per 128-bit lane: [0..3 8..11 | 4..7 12..15] x2 as bytes; the permute restores the order
  const __m256i i8 = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3]));
  return _mm256_permutevar8x32_epi32(i8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

template <typename T>
EAGLE_AVX2 void quantize_pair(const T* x, int8_t* q, float* d, float* s) {
  const __m256i a = quantize_block(x, d, s), b = quantize_block(x + kBlock, d + 1, s + 1);
  // int32 groups a0 b0 a1 b1 ... : unpack per 128-bit lane, then put the lanes in order
  const __m256i lo = _mm256_unpacklo_epi32(a, b), hi = _mm256_unpackhi_epi32(a, b);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permute2x128_si256(lo, hi, 0x20));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32), _mm256_permute2x128_si256(lo, hi, 0x31));
}
#endif

template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, QuantX& out) {
  out.K = K;
  out.nb = K / kBlock;
  out.q.resize(M * K);
  out.d.resize(M * out.nb);
  out.s.resize(M * out.nb);
  at::parallel_for(0, M * K / kPair, 1024, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
#if defined(__x86_64__)
      if (eagle::cpu::has_avx2()) {
        quantize_pair(x + c * kPair, out.q.data() + c * kPair, &out.d[2 * c], &out.s[2 * c]);
        continue;
      }
#endif
      quantize_pair_scalar(x + c * kPair, out.q.data() + c * kPair, &out.d[2 * c], &out.s[2 * c]);
    }
  });
}

// ---- per (weight row, x row): block scales s_b = dw_b * xd_b and the Q4_1 m-term ----

struct Scales {
  float* s;  // [nb]
  float mt;
};

void scales_scalar(const Weights& w, int64_t n, const float* xd, const float* xs, float* s, float* mt) {
  const uint16_t* dw = w.d(n);
  for (int64_t b = 0; b < w.nb; ++b) s[b] = half_to_float(dw[b]) * xd[b];
  if (!w.q4) return void(*mt = 0.f);
  const uint16_t* mw = w.m(n);
  const int64_t nb8 = w.nb / 8 * 8;
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t b = 0; b < nb8; ++b) lane[b % 8] = std::fma(half_to_float(mw[b]), xs[b], lane[b % 8]);
  float t = ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
  for (int64_t b = nb8; b < w.nb; ++b) t = std::fma(half_to_float(mw[b]), xs[b], t);
  *mt = t;
}

#if defined(__x86_64__)
EAGLE_AVX2 void scales(const Weights& w, int64_t n, const float* xd, const float* xs, float* s, float* mt) {
  const uint16_t* dw = w.d(n);
  const int64_t nb8 = w.nb / 8 * 8;
  for (int64_t b = 0; b < nb8; b += 8)
    _mm256_storeu_ps(s + b, _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dw + b))),
                                          _mm256_loadu_ps(xd + b)));
  for (int64_t b = nb8; b < w.nb; ++b) s[b] = _cvtsh_ss(dw[b]) * xd[b];
  if (!w.q4) return void(*mt = 0.f);
  const uint16_t* mw = w.m(n);
  __m256 lane = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb8; b += 8)
    lane = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mw + b))),
                           _mm256_loadu_ps(xs + b), lane);
  float t = eagle::cpu::hsum8(lane);
  for (int64_t b = nb8; b < w.nb; ++b) t = std::fma(_cvtsh_ss(mw[b]), xs[b], t);
  *mt = t;
}
#endif

// ---- the dot products: NB weight rows [n, n + NB) against R x rows [r0, r0 + R) ----

struct Panel {  // R quantized x rows
  const int8_t* q;  // row r at q + r * K
  const float* d;   // row r at d + r * nb
  const float* s;
  int64_t K, nb;
};

template <typename Out>
void tile_scalar(const Weights& w, int64_t n, int64_t NB, const Panel& x, int64_t R, Out* y, int64_t ldy) {
  std::vector<float> s(x.nb);
  for (int64_t i = 0; i < NB; ++i) {
    const uint8_t* q = w.q(n + i);
    for (int64_t r = 0; r < R; ++r) {
      float mt;
      scales_scalar(w, n + i, x.d + r * x.nb, x.s + r * x.nb, s.data(), &mt);
      const int8_t* xq = x.q + r * x.K;
      float acc[16] = {};
      for (int64_t c = 0; c < x.nb / 2; ++c) {
        for (int g = 0; g < 16; ++g) {
          int p = 0;
          for (int o = 4 * g; o < 4 * g + 4; ++o) {
            const int wq = w.q4 ? (o < 32 ? q[32 * c + o] & 15 : q[32 * c + o - 32] >> 4)
                                : static_cast<int8_t>(q[64 * c + o]);
            p += wq * xq[kPair * c + o];
          }
          acc[g] = std::fma(s[2 * c + g % 2], static_cast<float>(p), acc[g]);
        }
      }
      float v[8];
      for (int l = 0; l < 8; ++l) v[l] = acc[l] + acc[l + 8];
      y[r * ldy + i] = static_cast<Out>((((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]))) + mt);
    }
  }
}

#if defined(__x86_64__)
// Weights come from DRAM once per token in rows of 360-960 bytes, too short for the hardware prefetcher to
// ramp up: each pass also prefetches the rows this many tiles ahead.
constexpr int64_t kPrefetchTiles = 2;

float* scale_buffer(int64_t n) {  // the calling thread's: a tile's block scales
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

EAGLE_AVX2 inline __m256i dot4(__m256i u8, __m256i s8) {  // int32 lane l: the 4 products of bytes 4l..4l+3
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u8, s8), _mm256_set1_epi16(1));
}

template <bool Q4, int NB, int R, typename Out>
EAGLE_AVX2 void tile_avx2(const Weights& w, int64_t n, const Panel& x, Out* y, int64_t ldy) {
  float* s[NB][R];
  float mt[NB][R];
  for (int i = 0; i < NB; ++i)
    for (int r = 0; r < R; ++r) {
      s[i][r] = scale_buffer(NB * R * x.nb) + (i * R + r) * x.nb;
      scales(w, n + i, x.d + r * x.nb, x.s + r * x.nb, s[i][r], &mt[i][r]);
    }
  __m256 lo[NB][R], hi[NB][R];
  for (int i = 0; i < NB; ++i)
    for (int r = 0; r < R; ++r) lo[i][r] = hi[i][r] = _mm256_setzero_ps();
  const __m256i nib = _mm256_set1_epi8(0x0F);
  const int64_t ahead = kPrefetchTiles * NB * w.row_bytes, step = w.row_bytes / (x.nb / 2);
  for (int64_t c = 0; c < x.nb / 2; ++c) {
    for (int i = 0; i < NB; ++i) {
      const uint8_t* q = w.q(n + i) + c * (Q4 ? 32 : 64);
      _mm_prefetch(reinterpret_cast<const char*>(w.p + (n + i) * w.row_bytes + ahead + c * step), _MM_HINT_T0);
      __m256i wl, wh;
      if constexpr (Q4) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
        wl = _mm256_and_si256(v, nib);
        wh = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
      } else {
        wl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
        wh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32));
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* xq = x.q + r * x.K + kPair * c;
        const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
        const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32));
        const __m256i pl = Q4 ? dot4(wl, xl) : dot4(_mm256_sign_epi8(wl, wl), _mm256_sign_epi8(xl, wl));
        const __m256i ph = Q4 ? dot4(wh, xh) : dot4(_mm256_sign_epi8(wh, wh), _mm256_sign_epi8(xh, wh));
        double pair;  // (s_2c, s_2c+1), broadcast to alternate lanes
        std::memcpy(&pair, &s[i][r][2 * c], sizeof pair);
        const __m256 sc = _mm256_castpd_ps(_mm256_set1_pd(pair));
        lo[i][r] = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(pl), lo[i][r]);
        hi[i][r] = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(ph), hi[i][r]);
      }
    }
  }
  for (int i = 0; i < NB; ++i)
    for (int r = 0; r < R; ++r)
      y[r * ldy + i] = static_cast<Out>(eagle::cpu::hsum8(_mm256_add_ps(lo[i][r], hi[i][r])) + mt[i][r]);
}

// AVX-512 VNNI: one zmm holds a pair's 16 groups; dpbusd sums each group's 4 products exactly.
template <bool Q4, int NB, int R, typename Out>
EAGLE_AVX512_VNNI void tile_avx512(const Weights& w, int64_t n, const Panel& x, Out* y, int64_t ldy) {
  float* s[NB][R];
  float mt[NB][R];
  for (int i = 0; i < NB; ++i)
    for (int r = 0; r < R; ++r) {
      s[i][r] = scale_buffer(NB * R * x.nb) + (i * R + r) * x.nb;
      scales(w, n + i, x.d + r * x.nb, x.s + r * x.nb, s[i][r], &mt[i][r]);
    }
  __m512 acc[NB][R];
  for (int i = 0; i < NB; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
  const __m512i nib = _mm512_set1_epi8(0x0F), shift = _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4);
  const __m512i zero = _mm512_setzero_si512();
  const int64_t ahead = kPrefetchTiles * NB * w.row_bytes, step = w.row_bytes / (x.nb / 2);
  for (int64_t c = 0; c < x.nb / 2; ++c) {
    for (int i = 0; i < NB; ++i) {
      const uint8_t* q = w.q(n + i) + c * (Q4 ? 32 : 64);
      _mm_prefetch(reinterpret_cast<const char*>(w.p + (n + i) * w.row_bytes + ahead + c * step), _MM_HINT_T0);
      __m512i wq;
      __mmask64 neg = 0;
      if constexpr (Q4) {
        const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
        wq = _mm512_and_si512(_mm512_srlv_epi64(v, shift), nib);
      } else {
        const __m512i v = _mm512_loadu_si512(q);
        neg = _mm512_movepi8_mask(v);
        wq = _mm512_abs_epi8(v);
      }
      for (int r = 0; r < R; ++r) {
        __m512i xv = _mm512_loadu_si512(x.q + r * x.K + kPair * c);
        if constexpr (!Q4) xv = _mm512_mask_sub_epi8(xv, neg, zero, xv);
        const __m512i p = _mm512_dpbusd_epi32(zero, wq, xv);
        double pair;
        std::memcpy(&pair, &s[i][r][2 * c], sizeof pair);
        acc[i][r] = _mm512_fmadd_ps(_mm512_castpd_ps(_mm512_set1_pd(pair)), _mm512_cvtepi32_ps(p), acc[i][r]);
      }
    }
  }
  for (int i = 0; i < NB; ++i)
    for (int r = 0; r < R; ++r) {
      const __m256 v = _mm256_add_ps(_mm512_castps512_ps256(acc[i][r]),
                                     _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[i][r]), 1)));
      y[r * ldy + i] = static_cast<Out>(eagle::cpu::hsum8(v) + mt[i][r]);
    }
}

// Rows [n0, n1) against R x rows, NB at a time (the rest one by one).
template <bool Z, int NB, int R, typename Out>
void rows(const Weights& w, int64_t n0, int64_t n1, const Panel& x, Out* y, int64_t ldy) {
  const auto tile = [&](auto nb, int64_t n) {
    constexpr int B = decltype(nb)::value;
    if (w.q4) Z ? tile_avx512<true, B, R>(w, n, x, y + n, ldy) : tile_avx2<true, B, R>(w, n, x, y + n, ldy);
    else Z ? tile_avx512<false, B, R>(w, n, x, y + n, ldy) : tile_avx2<false, B, R>(w, n, x, y + n, ldy);
  };
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) tile(std::integral_constant<int, NB>{}, n);
  for (; n < n1; ++n) tile(std::integral_constant<int, 1>{}, n);
}

template <typename Out>
void rows_simd(const Weights& w, int64_t n0, int64_t n1, const Panel& x, int64_t R, Out* y, int64_t ldy) {
  if (use_avx512()) {
    switch (R) {
      case 1: return rows<true, 4, 1>(w, n0, n1, x, y, ldy);
      case 2: return rows<true, 4, 2>(w, n0, n1, x, y, ldy);
      case 3: return rows<true, 2, 3>(w, n0, n1, x, y, ldy);
      default: return rows<true, 2, 4>(w, n0, n1, x, y, ldy);
    }
  }
  switch (R) {
    case 1: return rows<false, 4, 1>(w, n0, n1, x, y, ldy);
    case 2: return rows<false, 2, 2>(w, n0, n1, x, y, ldy);
    case 3: return rows<false, 1, 3>(w, n0, n1, x, y, ldy);
    default: return rows<false, 1, 4>(w, n0, n1, x, y, ldy);
  }
}
#endif

// Columns [n0, n1) of y [M, N].
template <typename Out>
void compute(const Weights& w, int64_t n0, int64_t n1, const QuantX& xq, int64_t M, int64_t N, Out* y) {
  const int64_t K = xq.K, nb = xq.nb;
  // Up to 4 x rows: one pass streams the weights. More: chunks of weight rows that stay in L1 (~16 KB)
  // while every panel of 4 x rows passes over them.
  const int64_t chunk = M <= 4 ? n1 - n0 : std::max<int64_t>(8, (16 << 10) / w.row_bytes / 8 * 8);
  for (int64_t c0 = n0; c0 < n1; c0 += chunk) {
    const int64_t c1 = std::min(n1, c0 + chunk);
    for (int64_t m = 0; m < M; m += 4) {
      const int64_t R = std::min<int64_t>(4, M - m);
      const Panel x{xq.q.data() + m * K, xq.d.data() + m * nb, xq.s.data() + m * nb, K, nb};
#if defined(__x86_64__)
      if (eagle::cpu::has_avx2()) {
        rows_simd(w, c0, c1, x, R, y + m * N, N);
        continue;
      }
#endif
      tile_scalar(w, c0, c1 - c0, x, R, y + m * N + c0, N);
    }
  }
}

at::Tensor linear_q_cpu(const at::Tensor& x, const at::Tensor& w, int64_t qtype) {
  TORCH_CHECK_VALUE(qtype == kQ4_1 || qtype == kQ8_0, "linear_q: qtype must be 3 (Q4_1) or 8 (Q8_0), got ", qtype);
  TORCH_CHECK_VALUE(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
                    "linear_q: x must be a bf16 or fp32 [M, K] tensor");
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock;
  TORCH_CHECK_VALUE(K % kPair == 0, "linear_q: K = ", K, " must be a multiple of 64");
  const int64_t row_bytes = nb * (qtype == kQ4_1 ? 20 : 34);
  TORCH_CHECK_VALUE(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(1) == row_bytes,
                    "linear_q: w must be a contiguous uint8 [N, ", row_bytes, "] tensor (K = ", K, ")");
  TORCH_CHECK_VALUE(x.device().is_cpu() && w.device().is_cpu(), "linear_q: CPU tensors only");
  const int64_t N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) return y.zero_();
  const at::Tensor xc = x.contiguous();
  QuantX& xq = scratch();
  if (x.scalar_type() == at::kBFloat16) quantize_rows(xc.data_ptr<at::BFloat16>(), M, K, xq);
  else quantize_rows(xc.data_ptr<float>(), M, K, xq);
  const Weights wt{w.data_ptr<uint8_t>(), nb, row_bytes, qtype == kQ4_1};
  // Work split in multiples of 8 rows, at least ~32 KB of weights a task.
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / row_bytes / 8);
  at::parallel_for(0, (N + 7) / 8, grain, [&](int64_t g0, int64_t g1) {
    const int64_t n0 = 8 * g0, n1 = std::min(N, 8 * g1);
    if (x.scalar_type() == at::kBFloat16) compute(wt, n0, n1, xq, M, N, y.data_ptr<at::BFloat16>());
    else compute(wt, n0, n1, xq, M, N, y.data_ptr<float>());
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(eagle, m) {
  m.def("linear_q(Tensor x, Tensor w, int qtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(eagle, CPU, m) {
  m.impl("linear_q", &linear_q_cpu);
}
