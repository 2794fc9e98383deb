// The greedy token of a Q8_0 LM head, argmax_n (x @ dequant(w)^T)[m, n], without reading all of w: exact (the
// index argmax_rows picks from linear_q's fp32 logits) from ~65% of the bytes.
//
// Why: a CPU decode step streams every weight from DRAM, and a tied 49k x 576 Q8_0 LM head is ~30 MB of the
// ~96 MB a step of SmolLM2 reads; a greedy step needs the largest logit, not all of them.
//
// How: each quant q (int8) is split as q = 8 (u - 16) + l, u = (q + 128) >> 3 in 0..31, l = (q + 128) & 7 in
// 0..7. `planes` hold u only (5 bits), in linear_q's groups of 16 rows: per group and block, the 16 fp16 d's
// (32 bytes), u's low 4 bits as Q4_1's nibbles (256 bytes: chunk j holds sub-block j low, j + 4 high), and u's
// bit 4 as 8 masks of 64 bits (mask j: bit 4r + i for row r, weight 4j + i): 352 bytes against Q8_0's 544.
// With x quantized as linear_q quantizes it (xd, xq per block), a block's integer sum is
// sum(q xq) = 8 sum(u xq) - 128 sum(xq) + sum(l xq), and sum(l xq) lies in [7 neg, 7 pos] (neg, pos: the sums
// of the block's negative and positive xq), so
//   ub[m, n] = the fp32 chain of (dw xd)_b * (8 U_b - 128 S_b + 7 (dw < 0 ? neg_b : pos_b)) over the blocks
// bounds the logit from above, up to fp32 rounding, which `margin` covers (both chains' roundings: each term
// at most dmax_b xd_b 384 sum|xq_b| in size, dmax_b the largest |d| of block b over all rows; (nb + 2) 2^-21
// of their sum, 4x the first-order bound). Then per x row: the exact logits (linear_q's own chain, in its
// order: the same fp32 values) of the 8 rows with the largest bounds give a threshold T (the largest bound
// alone misses the argmax about a quarter of the time on SmolLM2, and then lets in thousands of rows), and
// every other row whose bound reaches T - margin is computed exactly (tens of rows, some hundreds); the
// largest logit, the lowest index among equals, wins. Exact logits read `rows`, the weight row-major (per row
// its nb fp16 d's, then its quants): a candidate costs 612 contiguous bytes there against a whole 9.8 KB
// group in linear_q's layout.
// A row with a non-finite value (x, a bound, a logit) takes linear_q and argmax_rows' rule (a NaN is the
// maximum). With temperatures, seeds and positions a row's token is instead sample_keyed's keyed draw from those
// logits (csrc/cpu_sample.cpp): each bound becomes its score's (eagle::cpu::Keyed::bounds) and the exact logits
// are scored exactly; the rest as above.
//
// The bound pass runs on AVX-512 VNNI (up to 8 x rows) and AVX2 (one: a decode step); elsewhere the op is
// linear_q + argmax_rows (the same result).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_ops.h"
#include "cpu_vec.h"

#if defined(__x86_64__)
#define EAGLE_AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#endif

namespace {

constexpr int64_t kBlock = 32, kGroup = 16, kQ8Bytes = 544, kPlaneBytes = 352, kRowBlockBytes = 34;
constexpr int kLeads = 8;
// Beyond 8 x rows the bounds' arithmetic and the exact rows cost more than the bytes saved (Zen 5, cold: 16 / 32
// / 64 rows 1.05 / 1.15 / 1.09x the full product's time; 4 / 8 rows 0.66 / 0.77x), and AMX takes those.
constexpr int64_t kMaxBoundRows = 8;

#if defined(__x86_64__)
// x quantized, with what the bounds add per row and block: 7 pos - 128 S and 7 neg - 128 S.
struct Rows {
  eagle::cpu::QuantX xq;
  std::vector<int32_t> up, down;
};

// Row n's logit for x row r (xq, xd: its blocks), linear_q's Q8_0 chain: acc = fma(dw_b * xd_b, isum_b, acc).
EAGLE_AVX2 float exact_logit(const uint8_t* rows, int64_t n, const int8_t* xq, const float* xd, int64_t nb) {
  const uint8_t* row = rows + n * nb * kRowBlockBytes;
  const uint8_t* q = row + 2 * nb;
  const __m256i ones = _mm256_set1_epi16(1);
  float acc = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + b * kBlock));
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kBlock));
    // |q| as unsigned, x with q's sign: pairs of products up to 2 * 127 * 127, no int16 saturation
    const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)), ones);
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    uint16_t dbits;
    std::memcpy(&dbits, row + 2 * b, 2);
    acc = std::fma(static_cast<float>(c10::Half(dbits, c10::Half::from_bits())) * xd[b],
                   static_cast<float>(_mm_cvtsi128_si32(s)), acc);
  }
  return acc;
}

// The bounds of group g and the group `gap` after it (G = 2: two DRAM streams, as linear_q's decode kernel) for
// x rows m0 .. m0 + R - 1, into ub [M, N].
template <int R, int G>
EAGLE_AVX512_VNNI void bound_groups(const uint8_t* planes, int64_t group_bytes, int64_t g, int64_t gap,
                                    const Rows& x, int64_t m0, float* ub, int64_t N) {
  const int64_t nb = x.xq.nb, K = x.xq.K;
  __m512 acc[G][R];
  for (int i = 0; i < G; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
  const __m512i nib = _mm512_set1_epi8(0x0F), sixteen = _mm512_set1_epi8(16);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk[G];
    for (int i = 0; i < G; ++i) {
      blk[i] = planes + (g + i * gap) * group_bytes + b * kPlaneBytes;
      for (int64_t o = 0; o < kPlaneBytes; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(blk[i] + 8 * kPlaneBytes + o), _MM_HINT_T0);
    }
    __m512i isum[G][R];
    for (int i = 0; i < G; ++i)
      for (int r = 0; r < R; ++r) isum[i][r] = _mm512_setzero_si512();
    const int8_t* xb = x.xq.q.data() + m0 * K + b * kBlock;
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      __m512i lo[G], hi[G];
      for (int i = 0; i < G; ++i) {  // u of sub-blocks j and j + 4: the nibble, plus 16 where bit 4 is set
        const __m512i v = _mm512_loadu_si512(blk[i] + 32 + 64 * j);
        __mmask64 mlo, mhi;
        std::memcpy(&mlo, blk[i] + 288 + 8 * j, 8);
        std::memcpy(&mhi, blk[i] + 288 + 8 * (j + 4), 8);
        const __m512i l = _mm512_and_si512(v, nib), h = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
        lo[i] = _mm512_mask_add_epi8(l, mlo, l, sixteen);
        hi[i] = _mm512_mask_add_epi8(h, mhi, h, sixteen);
      }
      for (int r = 0; r < R; ++r) {
        int32_t a, c;
        std::memcpy(&a, xb + r * K + 4 * j, 4);
        std::memcpy(&c, xb + r * K + 16 + 4 * j, 4);
        const __m512i xa = _mm512_set1_epi32(a), xc = _mm512_set1_epi32(c);
        for (int i = 0; i < G; ++i) {
          isum[i][r] = _mm512_dpbusd_epi32(isum[i][r], lo[i], xa);
          isum[i][r] = _mm512_dpbusd_epi32(isum[i][r], hi[i], xc);
        }
      }
    }
    for (int i = 0; i < G; ++i) {
      const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk[i])));
      const __mmask16 negative = _mm512_cmp_ps_mask(dw, _mm512_setzero_ps(), _CMP_LT_OQ);
      for (int r = 0; r < R; ++r) {
        const int64_t rb = (m0 + r) * nb + b;
        const __m512i rest =
            _mm512_mask_blend_epi32(negative, _mm512_set1_epi32(x.up[rb]), _mm512_set1_epi32(x.down[rb]));
        const __m512i top = _mm512_add_epi32(_mm512_slli_epi32(isum[i][r], 3), rest);
        acc[i][r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(x.xq.d[rb])), _mm512_cvtepi32_ps(top), acc[i][r]);
      }
    }
  }
  for (int i = 0; i < G; ++i)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(ub + (m0 + r) * N + (g + i * gap) * kGroup, acc[i][r]);
}

template <int G>
void bound_panel(const uint8_t* planes, int64_t group_bytes, int64_t g, int64_t gap, const Rows& x, int64_t m0,
                 int64_t R, float* ub, int64_t N) {
  switch (R) {
    case 1: return bound_groups<1, G>(planes, group_bytes, g, gap, x, m0, ub, N);
    case 2: return bound_groups<2, G>(planes, group_bytes, g, gap, x, m0, ub, N);
    case 3: return bound_groups<3, G>(planes, group_bytes, g, gap, x, m0, ub, N);
    default: return bound_groups<4, G>(planes, group_bytes, g, gap, x, m0, ub, N);
  }
}

// AVX2: the group as two halves of 8 rows (a ymm lane per row), one x row. Bit 4 of u comes from its mask as
// bytes: each of the mask's 4 bytes of a half spread over 8 bytes (vpshufb), tested against 1, 2, .., 128, and
// 16 where set. The int16 sums hold 4 sub-blocks (4 x 2 x 31 x 127 < 2^15) before widening. Several x rows would
// unpack each block again (they ran slower than the full product with Zen 5 running AVX2).
EAGLE_AVX2 inline __m256i plus16(const uint8_t* mask) {  // 32 mask bits -> 32 bytes of 0 / 16
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  int32_t m;
  std::memcpy(&m, mask, 4);
  const __m256i b = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(m), spread), bit);
  return _mm256_and_si256(_mm256_cmpeq_epi8(b, bit), _mm256_set1_epi8(16));
}

EAGLE_AVX2 void bound_group_avx2(const uint8_t* planes, int64_t group_bytes, int64_t g, const Rows& x, float* ub) {
  const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t b = 0; b < x.xq.nb; ++b) {
    const uint8_t* blk = planes + g * group_bytes + b * kPlaneBytes;
    for (int64_t o = 0; o < kPlaneBytes; o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(blk + 8 * kPlaneBytes + o), _MM_HINT_T0);
    const int8_t* xb = x.xq.q.data() + b * kBlock;
    __m256i s16[2][2] = {};  // [half][sub-blocks 0..3 | 4..7]
    for (int j = 0; j < 4; ++j) {
      int32_t a, c;
      std::memcpy(&a, xb + 4 * j, 4);
      std::memcpy(&c, xb + 16 + 4 * j, 4);
      const __m256i xa = _mm256_set1_epi32(a), xc = _mm256_set1_epi32(c);
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 + 64 * j + 32 * h));
        const __m256i lo = _mm256_add_epi8(_mm256_and_si256(v, nib), plus16(blk + 288 + 8 * j + 4 * h));
        const __m256i hi = _mm256_add_epi8(_mm256_and_si256(_mm256_srli_epi16(v, 4), nib),
                                           plus16(blk + 288 + 8 * (j + 4) + 4 * h));
        s16[h][0] = _mm256_add_epi16(s16[h][0], _mm256_maddubs_epi16(lo, xa));
        s16[h][1] = _mm256_add_epi16(s16[h][1], _mm256_maddubs_epi16(hi, xc));
      }
    }
    const __m256i up = _mm256_set1_epi32(x.up[b]), down = _mm256_set1_epi32(x.down[b]);
    const __m256 xd = _mm256_set1_ps(x.xq.d[b]);
    for (int h = 0; h < 2; ++h) {
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * h)));
      const __m256i negative = _mm256_castps_si256(_mm256_cmp_ps(dw, _mm256_setzero_ps(), _CMP_LT_OQ));
      const __m256i isum = _mm256_add_epi32(_mm256_madd_epi16(s16[h][0], ones), _mm256_madd_epi16(s16[h][1], ones));
      const __m256i top = _mm256_add_epi32(_mm256_slli_epi32(isum, 3), _mm256_blendv_epi8(up, down, negative));
      acc[h] = _mm256_fmadd_ps(_mm256_mul_ps(dw, xd), _mm256_cvtepi32_ps(top), acc[h]);
    }
  }
  for (int h = 0; h < 2; ++h) _mm256_storeu_ps(ub + g * kGroup + 8 * h, acc[h]);
}

// The kLeads rows with the largest bounds, largest first -> how many (all kLeads when N >= kLeads), or -1 when
// a bound is not finite.
EAGLE_AVX2 int leading_rows(const float* ub, int64_t N, int64_t* lead) {
  float bound[kLeads];
  int count = 0;
  __m256 thr = _mm256_set1_ps(-INFINITY), bad = _mm256_setzero_ps();
  for (int64_t n = 0; n < N; n += 8) {  // N is whole groups of 16
    const __m256 v = _mm256_loadu_ps(ub + n);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_mul_ps(v, _mm256_setzero_ps()), _mm256_setzero_ps(), _CMP_NEQ_UQ));
    for (int m = _mm256_movemask_ps(_mm256_cmp_ps(v, thr, _CMP_GT_OQ)); m; m &= m - 1) {
      const int64_t i = n + __builtin_ctz(m);
      if (count == kLeads && !(ub[i] > bound[kLeads - 1])) continue;
      int slot = count < kLeads ? count++ : kLeads - 1;  // insertion, largest bound first
      for (; slot > 0 && bound[slot - 1] < ub[i]; --slot) lead[slot] = lead[slot - 1], bound[slot] = bound[slot - 1];
      lead[slot] = i, bound[slot] = ub[i];
      if (count == kLeads) thr = _mm256_set1_ps(bound[kLeads - 1]);
    }
  }
  return _mm256_movemask_ps(bad) ? -1 : count;
}

// Appends to `out` every n outside `skip` whose bound reaches `floor`.
EAGLE_AVX2 void rows_from(const float* ub, int64_t N, float floor, const std::vector<int64_t>& skip,
                          std::vector<int64_t>& out) {
  const __m256 fl = _mm256_set1_ps(floor);
  for (int64_t n = 0; n < N; n += 8)
    for (int m = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(ub + n), fl, _CMP_GE_OQ)); m; m &= m - 1) {
      const int64_t i = n + __builtin_ctz(m);
      if (std::find(skip.begin(), skip.end(), i) == skip.end()) out.push_back(i);
    }
}

// The bounds' path: -> the argmax of each x row (of its keyed scores where keyed[m]), or -1 for a row that needs
// the full product.
void argmax_bounded(const at::Tensor& x, const at::Tensor& planes, const at::Tensor& rows, const at::Tensor& dmax,
                    const std::vector<c10::optional<eagle::cpu::Keyed>>& keyed, int64_t* out) {
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock, groups = planes.size(0), N = groups * kGroup;
  Rows xr;
  eagle::cpu::quantize_reserve(xr.xq, M, K);
  eagle::cpu::quantize_part(x.data_ptr<at::BFloat16>(), 0, M, 0, nb, xr.xq);
  xr.up.resize(M * nb), xr.down.resize(M * nb);
  std::vector<float> margin(M);
  const float* dm = dmax.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    double total = 0.0;
    for (int64_t b = 0; b < nb; ++b) {
      int32_t pos = 0, neg = 0;
      const int8_t* q = xr.xq.q.data() + m * K + b * kBlock;
      for (int k = 0; k < kBlock; ++k) (q[k] > 0 ? pos : neg) += q[k];
      const int64_t rb = m * nb + b;
      xr.up[rb] = 7 * pos - 128 * xr.xq.sum[rb], xr.down[rb] = 7 * neg - 128 * xr.xq.sum[rb];
      total += static_cast<double>(dm[b]) * xr.xq.d[rb] * 384.0 * (pos - neg);
    }
    margin[m] = static_cast<float>(total * (nb + 2) * std::ldexp(1.0, -21) + 1e-30);
  }
  thread_local std::vector<float> bounds;  // kept between calls: no allocation (and its page faults) a step
  if (static_cast<int64_t>(bounds.size()) < M * N) bounds.resize(M * N);
  float* ub = bounds.data();
  const uint8_t* pp = planes.data_ptr<uint8_t>();
  const int64_t plane_group = nb * kPlaneBytes;
  const bool vnni = eagle::cpu::use_avx512_vnni();
  at::parallel_for(0, groups, std::max<int64_t>(1, (32 << 10) / plane_group), [&](int64_t g0, int64_t g1) {
    // then a keyed row's bounds become its scores' (logit / T + the noise's bound), while they are in cache
    const auto keyed_bounds = [&]() {
      for (int64_t m = 0; m < M; ++m)
        if (keyed[m]) keyed[m]->bounds(ub + m * N, ub + m * N, g0 * kGroup, g1 * kGroup, nullptr);
    };
    if (!vnni) {  // one x row (argmax_q8 sends more to the full product)
      for (int64_t g = g0; g < g1; ++g) bound_group_avx2(pp, plane_group, g, xr, ub);
      return keyed_bounds();
    }
    const int64_t half = (g1 - g0) / 2;  // the range's two halves side by side
    for (int64_t g = g0; g < g0 + half; ++g)
      for (int64_t m = 0; m < M; m += 4)
        bound_panel<2>(pp, plane_group, g, half, xr, m, std::min<int64_t>(4, M - m), ub, N);
    if ((g1 - g0) % 2)
      for (int64_t m = 0; m < M; m += 4)
        bound_panel<1>(pp, plane_group, g1 - 1, 0, xr, m, std::min<int64_t>(4, M - m), ub, N);
    keyed_bounds();
  });
  // Per x row: the exact logits of its leading rows, then of every row whose bound reaches their best - margin.
  // Each stage's logits for all x rows are computed by both threads, each first requesting the cache lines of
  // all its rows (612 bytes each, scattered over the weight: latency, not bandwidth, is their cost).
  const uint8_t* rp = rows.data_ptr<uint8_t>();
  struct Task {
    int64_t m, n;
    float v;
  };
  std::vector<Task> tasks;
  std::vector<int64_t> best(M, -1), found;
  std::vector<double> top(M, 0.0);  // the best score: the logit, or a keyed row's l / T + g
  std::vector<char> finite(M, 1);
  auto run = [&]() {
    at::parallel_for(0, static_cast<int64_t>(tasks.size()), 4, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i)
        for (int64_t o = 0; o < nb * kRowBlockBytes; o += 64)
          _mm_prefetch(reinterpret_cast<const char*>(rp + tasks[i].n * nb * kRowBlockBytes + o), _MM_HINT_T0);
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t m = tasks[i].m;
        tasks[i].v = exact_logit(rp, tasks[i].n, xr.xq.q.data() + m * K, xr.xq.d.data() + m * nb, nb);
      }
    });
    for (const Task& t : tasks) {
      finite[t.m] = finite[t.m] && std::isfinite(t.v);
      const double v = keyed[t.m] ? keyed[t.m]->score(t.v, t.n) : t.v;
      if (best[t.m] < 0 || v > top[t.m] || (v == top[t.m] && t.n < best[t.m])) best[t.m] = t.n, top[t.m] = v;
    }
  };
  std::vector<int64_t> leads(M * kLeads);
  std::vector<int> count(M);
  for (int64_t m = 0; m < M; ++m) {
    count[m] = leading_rows(ub + m * N, N, leads.data() + m * kLeads);
    finite[m] = count[m] >= 0 && std::isfinite(margin[m]);
    for (int j = 0; finite[m] && j < count[m]; ++j) tasks.push_back({m, leads[m * kLeads + j], 0.f});
  }
  run();
  tasks.clear();
  for (int64_t m = 0; m < M; ++m) {
    if (!finite[m]) continue;
    // T - margin in double, then the float at or below it: no row that can reach T is left out
    const std::vector<int64_t> skip(leads.begin() + m * kLeads, leads.begin() + m * kLeads + count[m]);
    found.clear();
    const float floor = keyed[m] ? keyed[m]->reach(top[m], margin[m])
                                 : std::nextafter(static_cast<float>(top[m] - margin[m]), -INFINITY);
    rows_from(ub + m * N, N, floor, skip, found);
    for (int64_t n : found) tasks.push_back({m, n, 0.f});
  }
  run();
  for (int64_t m = 0; m < M; ++m) out[m] = finite[m] ? best[m] : -1;
}
#endif

}  // namespace

// x: bf16 [M, K]; w: Q8_0 [N, K] in linear_q's layout (uint8 [N / 16, K / 32 * 544]); planes: its top 5 bits
// (uint8 [N / 16, K / 32 * 352]); rows: it row-major (uint8 [N, K / 32 * 34]: a row's fp16 d's, then its
// quants); dmax: fp32 [K / 32], the largest |d| of each block over the rows (eagle_kernels.quant.argmax_planes).
// -> int64 [M]: the first maximum of each row of linear_q(x, w, Q8_0, fp32); with temperatures fp32 [M] (0: that
// argmax), seeds and positions int64 [M]: sample_keyed's draw from that row instead.
at::Tensor argmax_q8(const at::Tensor& x_in, const at::Tensor& w, const at::Tensor& planes, const at::Tensor& rows,
                     const at::Tensor& dmax, const c10::optional<at::Tensor>& temperatures,
                     const c10::optional<at::Tensor>& seeds, const c10::optional<at::Tensor>& positions) {
  TORCH_CHECK_VALUE(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16 && x_in.device().is_cpu(),
                    "argmax_q8: x must be a bf16 CPU tensor [M, K]");
  const int64_t M = x_in.size(0), K = x_in.size(1), nb = K / kBlock;
  TORCH_CHECK_VALUE(K > 0 && K % kBlock == 0, "argmax_q8: K = ", K, " must be a positive multiple of 32");
  TORCH_CHECK_VALUE(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.device().is_cpu() &&
                        w.size(1) == nb * kQ8Bytes && w.size(0) > 0,
                    "argmax_q8: w must be a contiguous uint8 CPU tensor [N / 16, ", nb * kQ8Bytes, "] (Q8_0, K = ", K,
                    ")");
  const int64_t groups = w.size(0), N = groups * kGroup;
  TORCH_CHECK_VALUE(planes.dim() == 2 && planes.scalar_type() == at::kByte && planes.is_contiguous() &&
                        planes.device().is_cpu() && planes.size(0) == groups && planes.size(1) == nb * kPlaneBytes,
                    "argmax_q8: planes must be a contiguous uint8 CPU tensor [", groups, ", ", nb * kPlaneBytes, "]");
  TORCH_CHECK_VALUE(rows.dim() == 2 && rows.scalar_type() == at::kByte && rows.is_contiguous() &&
                        rows.device().is_cpu() && rows.size(0) == N && rows.size(1) == nb * kRowBlockBytes,
                    "argmax_q8: rows must be a contiguous uint8 CPU tensor [", N, ", ", nb * kRowBlockBytes, "]");
  TORCH_CHECK_VALUE(dmax.dim() == 1 && dmax.scalar_type() == at::kFloat && dmax.is_contiguous() &&
                        dmax.device().is_cpu() && dmax.size(0) == nb,
                    "argmax_q8: dmax must be a contiguous fp32 CPU tensor [", nb, "]");
  TORCH_CHECK_VALUE(temperatures.has_value() == seeds.has_value() && seeds.has_value() == positions.has_value(),
                    "argmax_q8: temperatures, seeds and positions go together");
  std::vector<c10::optional<eagle::cpu::Keyed>> keyed(M);
  at::Tensor temps, keys, where;
  if (temperatures) {
    temps = temperatures->contiguous(), keys = seeds->contiguous(), where = positions->contiguous();
    TORCH_CHECK_VALUE(temps.scalar_type() == at::kFloat && temps.dim() == 1 && temps.size(0) == M && temps.is_cpu(),
                      "argmax_q8: temperatures must be a fp32 CPU tensor [", M, "]");
    for (const at::Tensor* t : {&keys, &where})
      TORCH_CHECK_VALUE(t->scalar_type() == at::kLong && t->dim() == 1 && t->size(0) == M && t->is_cpu(),
                        "argmax_q8: seeds and positions must be int64 CPU tensors [", M, "]");
    for (int64_t m = 0; m < M; ++m) {
      const float t = temps.data_ptr<float>()[m];
      if (t > 0) keyed[m].emplace(keys.data_ptr<int64_t>()[m], where.data_ptr<int64_t>()[m], t);
    }
  }
  if (M == 0) return at::empty({0}, x_in.options().dtype(at::kLong));
  const at::Tensor x = x_in.contiguous();
  const bool bounded = eagle::cpu::use_avx512_vnni() ? M <= kMaxBoundRows : eagle::cpu::has_avx2() && M == 1;
  at::Tensor out = at::empty({M}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  std::fill(o, o + M, -1);
#if defined(__x86_64__)
  if (bounded) argmax_bounded(x, planes, rows, dmax, keyed, o);
#endif
  // The full product: rows past the bounds' reach, or with a non-finite value (in x: its quantized values, finite,
  // need not obey the bounds); the same rules (keyed_draw).
  std::vector<int64_t> rest;
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  for (int64_t m = 0; m < M; ++m) {
    bool finite = true;
    for (int64_t k = 0; k < K; ++k) finite = finite && (xb[m * K + k] & 0x7F80) != 0x7F80;
    if (o[m] < 0 || !finite) rest.push_back(m);
  }
  if (rest.empty()) return out;
  const at::Tensor logits =
      eagle::cpu::linear_q(rest.size() == static_cast<size_t>(M) ? x : x.index_select(0, at::tensor(rest)), w, 8,
                           at::kFloat).contiguous();
  at::parallel_for(0, static_cast<int64_t>(rest.size()), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t m = rest[i];
      const eagle::cpu::Keyed* k = keyed[m] ? &*keyed[m] : nullptr;
      // keyed_draw at temperature 0 is argmax_rows' rule
      o[m] = eagle::cpu::keyed_draw(logits.data_ptr<float>() + i * N, N, k ? keys.data_ptr<int64_t>()[m] : 0,
                                    k ? where.data_ptr<int64_t>()[m] : 0, k ? k->t : 0.f, nullptr);
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(eagle, m) {
  m.def("argmax_q8(Tensor x, Tensor w, Tensor planes, Tensor rows, Tensor dmax, Tensor? temperatures=None, "
        "Tensor? seeds=None, Tensor? positions=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(eagle, CPU, m) {
  m.impl("argmax_q8", &argmax_q8);
}
