// Linear layers on block-quantized weights for the CPU: y[M, N] = x[M, K] @ dequant(w)[N, K]^T.
//
// Why: decode on a CPU reads every weight once per token, so bytes per weight set the speed. Weights stay in
// the GGUF types the file holds (4.5 or 8.5 bits a weight instead of bf16's 16), blocks of 32 along K:
//   Q8_0 (GGML type 8): fp16 d, int8 q[32];                 w = d * q
//   Q4_1 (GGML type 3): fp16 d, fp16 m, q[32] in 0..15;     w = d * q + m
// rearranged at load time (eagle_kernels/quant.py; the same values) in groups of 16 rows, so that one SIMD
// lane is one output row: per group and block, the 16 rows' fp16 d's (32 bytes), for Q4_1 their m's (32
// bytes), then the quants in sub-blocks of 4 weights, 16 rows x 4 bytes each (row r at bytes 4r..4r+3):
//   Q8_0: sub-blocks j = 0..7 (k = 4j..4j+3), 64 bytes each, int8;
//   Q4_1: 4 chunks of 64 bytes; chunk j holds sub-block j in its low nibbles and sub-block j + 4 in its high.
//
// Activations are quantized on the fly per row and block (as llama.cpp does): xd = max|x| / 127,
// xq = round-to-nearest-even(x * (1 / xd)), xs = xd * sum(xq). A block's dot product for 16 rows is then 8
// integer multiply-adds of the 16 rows' sub-blocks against the 4 x values broadcast (AVX-512 VNNI dpbusd;
// AVX2 maddubs), exact in int32; the fp32 work is one or two FMAs per block for 16 rows.
//
// Row invariance: output (m, n) is always this chain, whatever M and wherever row m sits, on every instruction
// set, so greedy speculative decoding stays token-identical to vanilla on the same weights:
//   acc = 0; for each block b: acc = fma(dw_b * xd_b, float(sum_k qw_k * xq_k), acc)
//                               Q4_1: acc = fma(mw_b, xs_b, acc)
//   y = acc
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cpu_ops.h"
#include "cpu_vec.h"

#if defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#define EAGLE_AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define EAGLE_AMX __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#endif

namespace {

constexpr int64_t kBlock = 32, kGroup = 16;
constexpr int64_t kQ4_1 = 3, kQ8_0 = 8;  // GGML type ids
// From 16 rows, AMX tiles beat the VNNI kernels (measured, one core, 1536 x 576 in cache: Q4_1 67 vs 98 us at
// 16 rows, 0.90 vs 1.58 ms at 256; Q8_0 57 vs 101 us, 0.84 vs 1.59 ms). At 8 rows they tie in cache (44 vs 50
// us) and lose slightly in a whole verify step at 2 threads (weights from DRAM).
constexpr int64_t kAmxMinRows = 16;

inline float half_to_float(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

template <bool Q4>
constexpr int64_t group_block_bytes() { return Q4 ? 320 : 544; }  // 16 rows x (20 | 34)

using eagle::cpu::QuantX;  // x quantized: q [M, K] int8, d, s [M, nb] fp32, sum [M, nb] int32

QuantX& scratch() {  // kept per calling thread between calls
  thread_local QuantX x;
  return x;
}

bool use_avx512() { return eagle::cpu::use_avx512_vnni(); }  // the VNNI kernels

// AMX tiles (Sapphire Rapids and later) for M >= 2 rows, unless EAGLE_CPU_AMX=0 asks for the VNNI kernels (same
// results). Linux hands the tile registers to a process only on request.
bool use_amx() {
#if defined(__x86_64__)
  static const bool ok = [] {
    const char* env = std::getenv("EAGLE_CPU_AMX");
    if (!use_avx512() || (env && env[0] == '0' && env[1] == 0)) return false;
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-int8")) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

// ---- activation quantization: one block of 32 ----

template <typename T>
void quantize_block_scalar(const T* x, int8_t* q, float* d, float* s, int32_t* sum) {
  float v[kBlock], amax = 0.f;
  for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(v[i] = static_cast<float>(x[i])));
  const float dx = amax / 127.f, id = dx != 0.f ? 1.f / dx : 0.f;
  int total = 0;
  for (int i = 0; i < kBlock; ++i) total += q[i] = static_cast<int8_t>(std::nearbyint(v[i] * id));
  *d = dx;
  *s = dx * static_cast<float>(total);
  *sum = total;
}

#if defined(__x86_64__)
EAGLE_AVX2 inline int hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1))));
}

template <typename T>
EAGLE_AVX2 void quantize_block(const T* x, int8_t* q, float* d, float* s, int32_t* sum) {
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
  const int total = hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3])));
  // packs work per 128-bit lane: [0..3 8..11 | 4..7 12..15] x2 as bytes; the permute restores the order
  const __m256i i8 = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(i8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  *d = dx;
  *s = dx * static_cast<float>(total);
  *sum = total;
}
#endif

void reserve(QuantX& out, int64_t M, int64_t K) {
  out.K = K;
  out.nb = K / kBlock;
  out.q.resize(M * K);
  out.d.resize(M * out.nb);
  out.s.resize(M * out.nb);
  out.sum.resize(M * out.nb);
}

// Blocks [b0, b1) of x's row-major blocks (block b: row b / nb, block b % nb) into out.
template <typename T>
void quantize_blocks(const T* x, int64_t b0, int64_t b1, QuantX& out) {
  for (int64_t b = b0; b < b1; ++b) {
#if defined(__x86_64__)
    if (eagle::cpu::has_avx2()) {
      quantize_block(x + b * kBlock, out.q.data() + b * kBlock, &out.d[b], &out.s[b], &out.sum[b]);
      continue;
    }
#endif
    quantize_block_scalar(x + b * kBlock, out.q.data() + b * kBlock, &out.d[b], &out.s[b], &out.sum[b]);
  }
}

template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, QuantX& out) {
  reserve(out, M, K);
  at::parallel_for(0, M * out.nb, 2048, [&](int64_t b0, int64_t b1) { quantize_blocks(x, b0, b1, out); });
}

// ---- one group of 16 weight rows against R x rows (row r: q + r * K, d / s / sum + r * nb) ----

struct Panel {
  const int8_t* q;
  const float* d;
  const float* s;
  const int32_t* sum;
  int64_t K, nb;
};

template <typename Out>
inline void store(Out* y, float v) { *y = static_cast<Out>(v); }

template <bool Q4, typename Out>
void group_scalar(const uint8_t* w, const Panel& x, int64_t R, int64_t rows, Out* y, int64_t ldy) {
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t n = 0; n < rows; ++n) {
      float acc = 0.f;
      for (int64_t b = 0; b < x.nb; ++b) {
        const uint8_t* blk = w + b * group_block_bytes<Q4>();
        const uint16_t* dw = reinterpret_cast<const uint16_t*>(blk);
        const int8_t* xq = x.q + r * x.K + b * kBlock;
        int p = 0;
        for (int k = 0; k < kBlock; ++k) {
          int q;
          if constexpr (Q4) {
            const uint8_t byte = blk[64 + 64 * (k / 4 % 4) + 4 * n + k % 4];
            q = k < 16 ? byte & 15 : byte >> 4;
          } else {
            q = static_cast<int8_t>(blk[32 + 64 * (k / 4) + 4 * n + k % 4]);
          }
          p += q * xq[k];
        }
        acc = std::fma(half_to_float(dw[n]) * x.d[r * x.nb + b], static_cast<float>(p), acc);
        if constexpr (Q4) acc = std::fma(half_to_float(dw[kGroup + n]), x.s[r * x.nb + b], acc);
      }
      store(y + r * ldy + n, acc);
    }
  }
}

#if defined(__x86_64__)
// One sequential stream per thread is not enough for the hardware prefetchers to keep DRAM busy: every cache
// line of the block 8 blocks ahead is requested too (measured: 1.2x on one thread, 1.1-1.3x on two).
template <bool Q4>
inline void prefetch_ahead(const uint8_t* blk) {
  for (int64_t o = 0; o < group_block_bytes<Q4>(); o += 64)
    _mm_prefetch(reinterpret_cast<const char*>(blk + 8 * group_block_bytes<Q4>() + o), _MM_HINT_T0);
}

EAGLE_AVX2 inline void store8(float* y, __m256 v) { _mm256_storeu_ps(y, v); }
EAGLE_AVX2 inline void store8(c10::BFloat16* y, __m256 v) { eagle::cpu::store8(y, v); }

// AVX2: the group as two halves of 8 rows (a ymm lane per row), side by side, so that each x broadcast serves
// both. Every output's integer sums and fp32 chain are those of a half at a time.
template <bool Q4, int R, typename Out>
EAGLE_AVX2 void group_avx2(const uint8_t* w, const Panel& x, Out* y, int64_t ldy) {
  __m256 acc[2][R];
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < R; ++r) acc[h][r] = _mm256_setzero_ps();
  const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < x.nb; ++b) {
    const uint8_t* blk = w + b * group_block_bytes<Q4>();
    prefetch_ahead<Q4>(blk);
    __m256i isum[2][R];
    if constexpr (Q4) {
      __m256i s16[2][R];  // up to 16 products of 15 * 127 per int16: no overflow
      for (int h = 0; h < 2; ++h)
        for (int r = 0; r < R; ++r) s16[h][r] = _mm256_setzero_si256();
      // Not unrolled: unrolled, GCC hoisted later sub-blocks' loads and broadcasts and spilled the int16
      // accumulators out of the 16 ymm registers (115 stack references in the 3-row loop, 46 now).
#pragma GCC unroll 1
      for (int j = 0; j < 4; ++j) {
        __m256i lo[2], hi[2];
        for (int h = 0; h < 2; ++h) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 + 64 * j + 32 * h));
          lo[h] = _mm256_and_si256(v, nib);
          hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* xq = x.q + r * x.K + b * kBlock;
          int32_t a, c;
          std::memcpy(&a, xq + 4 * j, 4);
          std::memcpy(&c, xq + 16 + 4 * j, 4);
          const __m256i xa = _mm256_set1_epi32(a), xc = _mm256_set1_epi32(c);
          for (int h = 0; h < 2; ++h) {
            s16[h][r] = _mm256_add_epi16(s16[h][r], _mm256_maddubs_epi16(lo[h], xa));
            s16[h][r] = _mm256_add_epi16(s16[h][r], _mm256_maddubs_epi16(hi[h], xc));
          }
        }
      }
      for (int h = 0; h < 2; ++h)
        for (int r = 0; r < R; ++r) isum[h][r] = _mm256_madd_epi16(s16[h][r], ones);
    } else {
      for (int h = 0; h < 2; ++h)
        for (int r = 0; r < R; ++r) isum[h][r] = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {
        __m256i q[2], qa[2];
        for (int h = 0; h < 2; ++h) {
          q[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 + 64 * j + 32 * h));
          qa[h] = _mm256_sign_epi8(q[h], q[h]);  // |q| as unsigned; x takes q's sign
        }
        for (int r = 0; r < R; ++r) {
          int32_t a;
          std::memcpy(&a, x.q + r * x.K + b * kBlock + 4 * j, 4);
          const __m256i xa = _mm256_set1_epi32(a);
          for (int h = 0; h < 2; ++h) {
            const __m256i p = _mm256_maddubs_epi16(qa[h], _mm256_sign_epi8(xa, q[h]));
            isum[h][r] = _mm256_add_epi32(isum[h][r], _mm256_madd_epi16(p, ones));
          }
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * h)));
      const __m256 mw = Q4 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32 + 16 * h)))
                           : _mm256_setzero_ps();
      for (int r = 0; r < R; ++r) {
        const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(x.d[r * x.nb + b]));
        acc[h][r] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(isum[h][r]), acc[h][r]);
        if constexpr (Q4) acc[h][r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.s[r * x.nb + b]), acc[h][r]);
      }
    }
  }
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < R; ++r) store8(y + r * ldy + 8 * h, acc[h][r]);
}

EAGLE_AVX512_VNNI inline void store16(float* y, __m512 v) { _mm512_storeu_ps(y, v); }
EAGLE_AVX512_VNNI inline void store16(c10::BFloat16* y, __m512 v) {
  store8(y, _mm512_castps512_ps256(v));
  store8(y + 8, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

// AVX-512 VNNI: a zmm lane per row of the group. Q8_0 quants become unsigned by +128 (xor 0x80), and the
// block sum takes 128 * sum(xq) back off, exactly. G groups, `gap` groups apart, go side by side: two
// streams from DRAM keep more requests in flight than one (decode reads ~1.3x faster).
template <bool Q4, int R, int G = 1, typename Out>
EAGLE_AVX512_VNNI void group_avx512(const uint8_t* w, const Panel& x, Out* y, int64_t ldy, int64_t gap = 0) {
  __m512 acc[G][R];
  for (int g = 0; g < G; ++g)
    for (int r = 0; r < R; ++r) acc[g][r] = _mm512_setzero_ps();
  const __m512i nib = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const int64_t stride = gap * x.nb * group_block_bytes<Q4>();
  for (int64_t b = 0; b < x.nb; ++b) {
    const uint8_t* blk[G];
    for (int g = 0; g < G; ++g) {
      blk[g] = w + g * stride + b * group_block_bytes<Q4>();
      prefetch_ahead<Q4>(blk[g]);
    }
    // Each sub-block vector is unpacked once and applied to every row, and each row's 4 x values are broadcast
    // once and applied to every group, before the next sub-block (few vectors live: with the groups outside the
    // sub-blocks, GCC kept every broadcast of a block live across the groups and spilled the accumulators).
    // The sums go into C int32 chains a row, added at the end: the same isum as one chain (integer sums are
    // exact). Two chains halve a row's latency where few rows run; from 3 rows the rows' chains are enough.
    constexpr int C = R >= 3 ? 1 : 2;
    __m512i isum[G][R][C];
    const int8_t* xq = x.q + b * kBlock;
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512i init = Q4 ? _mm512_setzero_si512() : _mm512_set1_epi32(-128 * x.sum[r * x.nb + b]);
      for (int g = 0; g < G; ++g) {
        isum[g][r][0] = init;
        if constexpr (C == 2) isum[g][r][C - 1] = _mm512_setzero_si512();
      }
    }
#pragma GCC unroll 8
    for (int j = 0; j < (Q4 ? 4 : 8); ++j) {
      __m512i lo[G], hi[G];
      for (int g = 0; g < G; ++g) {
        if constexpr (Q4) {
          const __m512i v = _mm512_loadu_si512(blk[g] + 64 + 64 * j);
          lo[g] = _mm512_and_si512(v, nib);                           // sub-block j
          hi[g] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);     // sub-block j + 4
        } else {
          lo[g] = _mm512_xor_si512(_mm512_loadu_si512(blk[g] + 32 + 64 * j), flip);
        }
      }
      constexpr int even = 0, odd = C - 1;  // the chains of sub-blocks j and j + 4
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        int32_t a;
        std::memcpy(&a, xq + r * x.K + 4 * j, 4);
        const __m512i xa = _mm512_set1_epi32(a);
        const int k = (j & 1) ? odd : even;
        for (int g = 0; g < G; ++g) isum[g][r][k] = _mm512_dpbusd_epi32(isum[g][r][k], lo[g], xa);
        if constexpr (Q4) {
          int32_t c;
          std::memcpy(&c, xq + r * x.K + 16 + 4 * j, 4);
          const __m512i xc = _mm512_set1_epi32(c);
          const int k2 = (j & 1) ? even : odd;
          for (int g = 0; g < G; ++g) isum[g][r][k2] = _mm512_dpbusd_epi32(isum[g][r][k2], hi[g], xc);
        }
      }
    }
    for (int g = 0; g < G; ++g) {
      const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk[g])));
      const __m512 mw = Q4 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk[g] + 32)))
                           : _mm512_setzero_ps();
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(x.d[r * x.nb + b]));
        const __m512i sum = C == 2 ? _mm512_add_epi32(isum[g][r][0], isum[g][r][C - 1]) : isum[g][r][0];
        acc[g][r] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(sum), acc[g][r]);
        if constexpr (Q4) acc[g][r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x.s[r * x.nb + b]), acc[g][r]);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int r = 0; r < R; ++r) store16(y + g * gap * kGroup + r * ldy, acc[g][r]);
}


// AMX: a block's integer dot products for up to 16 x rows and the group's 16 weight rows in one tile
// multiply, C[r][n] = sum_k xq[r][k] * wq[n][k] (A: R x 32 int8 x rows, B: the block's 8 sub-blocks, which are
// already in the tile's 4-bytes-per-column layout; Q4_1 nibbles are unpacked to bytes first). The same int32
// as the VNNI kernels, then the same fp32 chain per output.
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// y[r, 0..15] = sum over blocks b of dw_b * xd[r, b] * products_b[r] (+ mw_b * xs[r, b]): the VNNI kernels'
// fp32 chain. R_FIXED rows (unrolled: the accumulators stay in registers), or R rows when R_FIXED is 0.
template <bool Q4, int R_FIXED, typename Out>
EAGLE_AMX void scale_products(const uint8_t* wg, const int32_t* products, const float* xd, const float* xs, int64_t nb,
                              int R, Out* y, int64_t ldy) {
  const int rows = R_FIXED ? R_FIXED : R;
  __m512 acc[kGroup];
  for (int r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = wg + b * group_block_bytes<Q4>();
    const int32_t* cb = products + b * kGroup * kGroup;
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
    const __m512 mw = Q4 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)))
                         : _mm512_setzero_ps();
    for (int r = 0; r < rows; ++r) {
      const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(xd[r * nb + b]));
      acc[r] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(_mm512_load_si512(cb + r * kGroup)), acc[r]);
      if constexpr (Q4) acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xs[r * nb + b]), acc[r]);
    }
  }
  for (int r = 0; r < rows; ++r) store16(y + r * ldy, acc[r]);
}

template <bool Q4, typename Out>
EAGLE_AMX void compute_amx(const uint8_t* w, int64_t g0, int64_t g1, const QuantX& xq, int64_t M, int64_t N, Out* y) {
  const int64_t K = xq.K, nb = xq.nb, group_bytes = nb * group_block_bytes<Q4>();
  // per thread: Q4_1's quants of a group as bytes (512 a block), the group's int32 tile products (1 KB a block)
  thread_local std::vector<uint8_t> scratch_store;
  const int64_t need = nb * (512 + 1024) + 64;
  if (static_cast<int64_t>(scratch_store.size()) < need) scratch_store.resize(need);
  uint8_t* unpacked = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(scratch_store.data()) + 63) & ~uintptr_t(63));
  int32_t* products = reinterpret_cast<int32_t*>(unpacked + nb * 512);
  const __m512i nib = _mm512_set1_epi8(0x0F);
  TileConfig cfg;  // panels of 16 x rows; the last one's R rows get tiles 6 (C) and 7 (A)
  const int last = static_cast<int>(M - (M - 1) / kGroup * kGroup);
  for (int t = 0; t < 2; ++t) {
    cfg.rows[t] = kGroup, cfg.colsb[t] = 64;          // C: 16 x 16 int32
    cfg.rows[2 + t] = kGroup, cfg.colsb[2 + t] = 32;  // A: 16 x 32 int8
    cfg.rows[4 + t] = 8, cfg.colsb[4 + t] = 64;       // B: 8 sub-blocks x 16 rows x 4 bytes
  }
  cfg.rows[6] = last, cfg.colsb[6] = 64;
  cfg.rows[7] = last, cfg.colsb[7] = 32;
  _tile_loadconfig(&cfg);
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* wg = w + g * group_bytes;
    if constexpr (Q4) {
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = wg + b * group_block_bytes<Q4>();
        prefetch_ahead<Q4>(blk);
        for (int j = 0; j < 4; ++j) {
          const __m512i v = _mm512_loadu_si512(blk + 64 + 64 * j);
          _mm512_store_si512(unpacked + 512 * b + 64 * j, _mm512_and_si512(v, nib));
          _mm512_store_si512(unpacked + 512 * b + 64 * (j + 4), _mm512_and_si512(_mm512_srli_epi16(v, 4), nib));
        }
      }
    }
    for (int64_t m0 = 0; m0 < M; m0 += kGroup) {
      const int R = static_cast<int>(std::min<int64_t>(kGroup, M - m0));
      const bool full = R == kGroup;
      const int8_t* xrows = xq.q.data() + m0 * K;
      const float* xd = xq.d.data() + m0 * nb;
      const float* xs = xq.s.data() + m0 * nb;
      // all the panel's tile products first, then their scaling: the vector work never waits on a tile
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = wg + b * group_block_bytes<Q4>();
        if (!Q4 && m0 == 0) prefetch_ahead<Q4>(blk);
        const uint8_t* wq = Q4 ? unpacked + 512 * b : blk + 32;
        int32_t* cb = products + b * kGroup * kGroup;
// cb = the block's x rows (tile A) . its weights (tile B), through tile C (tile numbers must be literals)
#define EAGLE_TILE_PRODUCTS(C, A, B)                   \
  _tile_loadd(B, wq, 64);                              \
  _tile_loadd(A, xrows + b * kBlock, K);               \
  _tile_zero(C);                                       \
  if constexpr (Q4) _tile_dpbsud(C, A, B);             \
  else _tile_dpbssd(C, A, B);                          \
  _tile_stored(C, cb, 64);
        if (!full) {
          EAGLE_TILE_PRODUCTS(6, 7, 4)
        } else if (b % 2 == 0) {  // alternate tiles: a block's product need not wait for the last one's store
          EAGLE_TILE_PRODUCTS(0, 2, 4)
        } else {
          EAGLE_TILE_PRODUCTS(1, 3, 5)
        }
#undef EAGLE_TILE_PRODUCTS
      }
      if (full) scale_products<Q4, kGroup>(wg, products, xd, xs, nb, kGroup, y + m0 * N + g * kGroup, N);
      else scale_products<Q4, 0>(wg, products, xd, xs, nb, R, y + m0 * N + g * kGroup, N);
    }
  }
  _tile_release();
}

template <bool Q4, int R, typename Out>
void group_simd(const uint8_t* w, const Panel& x, Out* y, int64_t ldy) {
  if (use_avx512()) group_avx512<Q4, R>(w, x, y, ldy);
  else group_avx2<Q4, R>(w, x, y, ldy);
}

// Up to 4 x rows at a time.
template <bool Q4, typename Out>
void group_any(const uint8_t* w, const Panel& x, int64_t R, Out* y, int64_t ldy) {
  switch (R) {
    case 1: return group_simd<Q4, 1>(w, x, y, ldy);
    case 2: return group_simd<Q4, 2>(w, x, y, ldy);
    case 3: return group_simd<Q4, 3>(w, x, y, ldy);
    default: return group_simd<Q4, 4>(w, x, y, ldy);
  }
}

// AVX-512, up to 4 x rows against G groups `gap` groups apart.
template <bool Q4, int G, typename Out>
void groups_avx512(const uint8_t* w, const Panel& x, int64_t R, Out* y, int64_t ldy, int64_t gap) {
  switch (R) {
    case 1: return group_avx512<Q4, 1, G>(w, x, y, ldy, gap);
    case 2: return group_avx512<Q4, 2, G>(w, x, y, ldy, gap);
    case 3: return group_avx512<Q4, 3, G>(w, x, y, ldy, gap);
    default: return group_avx512<Q4, 4, G>(w, x, y, ldy, gap);
  }
}
#endif

// Groups [g0, g1) of w against all M x rows, in panels of 4: a group's blocks (5-15 KB for these models)
// stay in L1 while the panels pass over them.
template <bool Q4, typename Out>
void compute(const uint8_t* w, int64_t g0, int64_t g1, const QuantX& xq, int64_t M, int64_t N, Out* y) {
  const int64_t K = xq.K, nb = xq.nb, group_bytes = nb * group_block_bytes<Q4>();
  auto panel = [&](int64_t m) {
    return Panel{xq.q.data() + m * K, xq.d.data() + m * nb, xq.s.data() + m * nb, xq.sum.data() + m * nb, K, nb};
  };
#if defined(__x86_64__)
  if (M >= kAmxMinRows && use_amx()) return compute_amx<Q4>(w, g0, g1, xq, M, N, y);
  if (M < kAmxMinRows && use_avx512()) {  // decode and verify: the range's two halves side by side
    const int64_t half = (g1 - g0) / 2;
    for (int64_t g = g0; g < g0 + half; ++g)
      for (int64_t m = 0; m < M; m += 4)
        groups_avx512<Q4, 2>(w + g * group_bytes, panel(m), std::min<int64_t>(4, M - m), y + m * N + g * kGroup, N, half);
    if ((g1 - g0) % 2)
      for (int64_t m = 0; m < M; m += 4)
        groups_avx512<Q4, 1>(w + (g1 - 1) * group_bytes, panel(m), std::min<int64_t>(4, M - m),
                             y + m * N + (g1 - 1) * kGroup, N, 0);
    return;
  }
#endif
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t m = 0; m < M; m += 4) {
      const int64_t R = std::min<int64_t>(4, M - m);
      const Panel x = panel(m);
#if defined(__x86_64__)
      if (eagle::cpu::has_avx2()) {
        group_any<Q4>(w + g * group_bytes, x, R, y + m * N + g * kGroup, N);
        continue;
      }
#endif
      group_scalar<Q4>(w + g * group_bytes, x, R, kGroup, y + m * N + g * kGroup, N);
    }
  }
}

}  // namespace

namespace eagle::cpu {

at::Tensor linear_q(const at::Tensor& x, const at::Tensor& w, int64_t qtype, c10::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK_VALUE(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
                    "linear_q: x must be a bf16 or fp32 [M, K] tensor");
  const at::ScalarType out = out_dtype.value_or(x.scalar_type());
  TORCH_CHECK_VALUE(out == at::kBFloat16 || out == at::kFloat, "linear_q: out_dtype must be bf16 or fp32");
  TORCH_CHECK_VALUE(w.dim() == 2, "linear_q: w must be a contiguous uint8 [N / 16, nb * block bytes] tensor");
  at::Tensor y = at::empty({x.size(0), w.size(0) * kGroup}, x.options().dtype(out));
  linear_q_into(x, w, qtype, y);
  return y;
}

void linear_q_into(const at::Tensor& x, const at::Tensor& w, int64_t qtype, at::Tensor& y) {
  TORCH_CHECK_VALUE(qtype == kQ4_1 || qtype == kQ8_0, "linear_q: qtype must be 3 (Q4_1) or 8 (Q8_0), got ", qtype);
  TORCH_CHECK_VALUE(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
                    "linear_q: x must be a bf16 or fp32 [M, K] tensor");
  const at::ScalarType out = y.scalar_type();
  TORCH_CHECK_VALUE(out == at::kBFloat16 || out == at::kFloat, "linear_q: out_dtype must be bf16 or fp32");
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock;
  const bool q4 = qtype == kQ4_1;
  TORCH_CHECK_VALUE(K % kBlock == 0 && K > 0, "linear_q: K = ", K, " must be a positive multiple of 32");
  const int64_t group_bytes = nb * (q4 ? group_block_bytes<true>() : group_block_bytes<false>());
  TORCH_CHECK_VALUE(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(1) == group_bytes,
                    "linear_q: w must be a contiguous uint8 [N / 16, ", group_bytes, "] tensor (K = ", K, ")");
  TORCH_CHECK_VALUE(x.device().is_cpu() && w.device().is_cpu(), "linear_q: CPU tensors only");
  const int64_t groups = w.size(0), N = groups * kGroup;
  TORCH_CHECK_VALUE(y.dim() == 2 && y.size(0) == M && y.size(1) == N && y.is_contiguous() && y.device().is_cpu(),
                    "linear_q: the output must be a contiguous CPU [", M, ", ", N, "]");
  if (M == 0 || N == 0) return;
  const at::Tensor xc = x.contiguous();
  QuantX& xq = scratch();
  if (x.scalar_type() == at::kBFloat16) quantize_rows(xc.data_ptr<at::BFloat16>(), M, K, xq);
  else quantize_rows(xc.data_ptr<float>(), M, K, xq);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const bool bf16 = out == at::kBFloat16;  // y's dtype (x's is quantized above, the same int8 either way)
  // At least ~32 KB of weights a task.
  at::parallel_for(0, groups, std::max<int64_t>(1, (32 << 10) / group_bytes), [&](int64_t g0, int64_t g1) {
    if (q4 && bf16) compute<true>(wp, g0, g1, xq, M, N, y.data_ptr<at::BFloat16>());
    else if (q4) compute<true>(wp, g0, g1, xq, M, N, y.data_ptr<float>());
    else if (bf16) compute<false>(wp, g0, g1, xq, M, N, y.data_ptr<at::BFloat16>());
    else compute<false>(wp, g0, g1, xq, M, N, y.data_ptr<float>());
  });
}

void quantize_activations(const at::BFloat16* x, int64_t M, int64_t K) { quantize_rows(x, M, K, scratch()); }

void quantize_reserve(QuantX& xq, int64_t M, int64_t K) { reserve(xq, M, K); }

void quantize_part(const at::BFloat16* x, int64_t r0, int64_t r1, int64_t b0, int64_t b1, QuantX& xq) {
  for (int64_t r = r0; r < r1; ++r) quantize_blocks(x, r * xq.nb + b0, r * xq.nb + b1, xq);
}

void linear_q_groups(const uint8_t* w, int64_t qtype, int64_t M, int64_t N, int64_t g0, int64_t g1, at::BFloat16* y,
                     const QuantX* shared) {
  const QuantX& xq = shared ? *shared : scratch();
  if (qtype == kQ4_1) compute<true>(w, g0, g1, xq, M, N, y);
  else compute<false>(w, g0, g1, xq, M, N, y);
}

// Rows `ids` of a quantized [V, K] table (a token's embedding) -> [T, K] in `dtype`: w = d * q (+ m), each an
// fp32 product (and sum) rounded once to `dtype`, as eagle_kernels.quant.rows computes them.
at::Tensor embedding_q(const at::Tensor& ids, const at::Tensor& w, int64_t qtype, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(dtype == at::kBFloat16 || dtype == at::kFloat, "embedding_q: dtype must be bf16 or fp32");
  TORCH_CHECK_VALUE(ids.dim() == 1 && ids.device().is_cpu(), "embedding_q: ids must be a CPU vector");
  const int64_t bb = qtype == kQ4_1 ? group_block_bytes<true>() : group_block_bytes<false>();
  at::Tensor out = at::empty({ids.size(0), w.dim() == 2 ? w.size(1) / bb * kBlock : 0}, w.options().dtype(dtype));
  embedding_q_into(ids, w, qtype, out);
  return out;
}

void embedding_q_into(const at::Tensor& ids_in, const at::Tensor& w, int64_t qtype, at::Tensor& out) {
  TORCH_CHECK_VALUE(qtype == kQ4_1 || qtype == kQ8_0, "embedding_q: qtype must be 3 (Q4_1) or 8 (Q8_0), got ", qtype);
  const at::ScalarType dtype = out.scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kBFloat16 || dtype == at::kFloat, "embedding_q: dtype must be bf16 or fp32");
  const bool q4 = qtype == kQ4_1;
  const int64_t bb = q4 ? group_block_bytes<true>() : group_block_bytes<false>();
  TORCH_CHECK_VALUE(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(1) % bb == 0 &&
                        w.device().is_cpu(), "embedding_q: w must be a contiguous uint8 CPU [V / 16, nb * ", bb, "]");
  TORCH_CHECK_VALUE(ids_in.dim() == 1 && ids_in.device().is_cpu(), "embedding_q: ids must be a CPU vector");
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  const int64_t T = ids.size(0), nb = w.size(1) / bb, K = nb * kBlock, V = w.size(0) * kGroup;
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK_VALUE(id[t] >= 0 && id[t] < V, "embedding_q: ids[", t, "] = ", id[t], " is outside [0, ", V, ")");
  }
  TORCH_CHECK_VALUE(out.dim() == 2 && out.size(0) == T && out.size(1) == K && out.is_contiguous() && out.device().is_cpu(),
                    "embedding_q: the output must be a contiguous CPU [", T, ", ", K, "]");
  thread_local std::vector<float> row;
  row.resize(K);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t lane = id[t] % kGroup;
    const uint8_t* group = w.data_ptr<uint8_t>() + (id[t] / kGroup) * w.size(1);
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = group + b * bb;
      const float d = half_to_float(reinterpret_cast<const uint16_t*>(blk)[lane]);
      float* o = row.data() + b * kBlock;
      if (q4) {
        const float m = half_to_float(reinterpret_cast<const uint16_t*>(blk + 32)[lane]);
        for (int k = 0; k < kBlock; ++k) {
          const uint8_t byte = blk[64 + 64 * (k / 4 % 4) + 4 * lane + k % 4];
          const float dq = d * static_cast<float>(k < 16 ? byte & 15 : byte >> 4);
          o[k] = dq + m;
        }
      } else {
        for (int k = 0; k < kBlock; ++k) o[k] = d * static_cast<float>(static_cast<int8_t>(blk[32 + 64 * (k / 4) + 4 * lane + k % 4]));
      }
    }
    if (dtype == at::kFloat) std::copy(row.begin(), row.end(), out.data_ptr<float>() + t * K);
    else std::copy(row.begin(), row.end(), out.data_ptr<at::BFloat16>() + t * K);
  }
}

}  // namespace eagle::cpu

TORCH_LIBRARY_FRAGMENT(eagle, m) {
  m.def("linear_q(Tensor x, Tensor w, int qtype, ScalarType? out_dtype=None) -> Tensor");
  m.def("embedding_q(Tensor ids, Tensor w, int qtype, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(eagle, CPU, m) {
  m.impl("linear_q", &eagle::cpu::linear_q);
  m.impl("embedding_q", &eagle::cpu::embedding_q);
}
