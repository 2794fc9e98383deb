// Paged attention on the CPU: prefill, decode, chains and trees in one call (contract: DESIGN.md,
// "paged_attention"). The torch path it replaces spent ~80 us per layer on Python-side gathers and
// per-sequence SDPA launches for a decode step whose arithmetic takes a few microseconds.
//
// Per query row (a new token's q head): pass 1 writes the scaled scores of all visible keys to a task-local
// buffer, then an exact fp32 softmax, then pass 2 accumulates the weighted V rows in fp32; the output is
// rounded to q's dtype once. With AVX2 the rows are cut into one part of near-equal work per thread, a task
// holding a part's rows of one (sequence, kv head), which share the prefix's K/V (group_tasks); otherwise one
// task per (new token, kv head). AttentionTasks holds a step's split, for paged_attention and decoder_layers.
// Visible keys of new token i of sequence b: every cached prefix position, then new token j iff j <= i
// (no tree mask) or bit j of tree_mask[t] is set.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "cpu_ops.h"
#include "cpu_vec.h"

namespace {

using eagle::cpu::dup8;
using eagle::cpu::has_avx2;
using eagle::cpu::high8;
using eagle::cpu::join8;

struct Layout {
  int64_t T, Hq, Hkv, D, G, block_size, max_blocks, mask_words;
  float scale;
};

// Element offsets (into a [num_blocks, block_size, Hkv, D] cache) of the K/V rows that new token i of a
// sequence sees, in order: its cached prefix (append_prefix_rows), then its visible new tokens
// (append_new_rows). Block by block: a division per key costs more than the key's dot product.
void append_prefix_rows(const int32_t* table, int64_t prefix, int64_t kv_head, const Layout& L,
                        std::vector<int64_t>& rows) {
  for (int64_t start = 0; start < prefix; start += L.block_size) {
    const int64_t base = (static_cast<int64_t>(table[start / L.block_size]) * L.block_size * L.Hkv + kv_head) * L.D;
    const int64_t len = std::min(L.block_size, prefix - start);
    for (int64_t o = 0; o < len; ++o) rows.push_back(base + o * L.Hkv * L.D);
  }
}

void append_new_rows(const int32_t* table, int64_t prefix, int64_t n, int64_t i, const int32_t* mask_row,
                     int64_t kv_head, const Layout& L, std::vector<int64_t>& rows) {
  for (int64_t j = 0; j < n; ++j) {
    if (!(mask_row ? (mask_row[j >> 5] >> (j & 31)) & 1 : j <= i)) continue;
    const int64_t pos = prefix + j, block = table[pos / L.block_size];
    rows.push_back(((block * L.block_size + pos % L.block_size) * L.Hkv + kv_head) * L.D);
  }
}

// Scores -> unnormalised probabilities in place, per head: scores [G, count] (row stride count).
void softmax_rows(float* scores, int64_t G, int64_t count) {
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * count;
    if (count == 0) continue;
    const float m = *std::max_element(s, s + count);
    for (int64_t j = 0; j < count; ++j) s[j] = std::exp(s[j] - m);
  }
}

// q: fp32 [G, D] (already scaled); rows: visible K/V row offsets; scores: [G, rows]; acc: fp32 [G, D],
// zeroed, receives sum_j p_gj v_j.
template <typename T>
void attend_scalar(const float* q, const T* kc, const T* vc, const std::vector<int64_t>& rows, const Layout& L,
                   float* scores, float* acc) {
  const int64_t count = rows.size();
  for (int64_t j = 0; j < count; ++j) {
    const T* k = kc + rows[j];
    for (int64_t g = 0; g < L.G; ++g) {
      float s = 0.f;
      for (int64_t d = 0; d < L.D; ++d) s += q[g * L.D + d] * static_cast<float>(k[d]);
      scores[g * count + j] = s;
    }
  }
  softmax_rows(scores, L.G, count);
  for (int64_t j = 0; j < count; ++j) {
    const T* v = vc + rows[j];
    for (int64_t g = 0; g < L.G; ++g) {
      const float p = scores[g * count + j];
      for (int64_t d = 0; d < L.D; ++d) acc[g * L.D + d] += p * static_cast<float>(v[d]);
    }
  }
}

#if defined(__x86_64__)
// The maximum of s[0, count), count >= 1 (any order gives the same value).
EAGLE_AVX2 inline float max_avx2(const float* s, int64_t count) {
  __m256 m = _mm256_set1_ps(s[0]);
  int64_t j = 0;
  for (; j + 8 <= count; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + j));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float best = *std::max_element(lanes, lanes + 8);
  for (; j < count; ++j) best = std::max(best, s[j]);
  return best;
}

// Whole 8-key chunks of sum_lanes into lanes; -> the keys done.
EAGLE_AVX2 inline int64_t sum8_avx2(const float* p, int64_t count, float* lanes) {
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= count; j += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(p + j));
  _mm256_storeu_ps(lanes, acc);
  return j;
}

EAGLE_AVX2 void softmax_rows_avx2(float* scores, int64_t G, int64_t count) {
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * count;
    const float m = max_avx2(s, count);
    const __m256 mv = _mm256_set1_ps(m);
    int64_t j = 0;
    for (; j + 8 <= count; j += 8) _mm256_storeu_ps(s + j, eagle::cpu::exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv)));
    for (; j < count; ++j) s[j] = std::exp(s[j] - m);
  }
}

// The grouped path: one task = the query rows [r0, r1) (row = new token * G + q head) of one sequence and kv
// head. Prefix keys, which every row sees, are widened to fp32 a block at a time and reused by all the
// task's rows, instead of once per row; the new tokens' keys, which rows see selectively, are read per row.
// A row's arithmetic does not depend on the other rows of its task (the same dot-product chains over the same
// keys in the same order, the same softmax and accumulation order), so a token's output is bit-identical
// whether it is decoded alone or verified inside a tree: the property that keeps bf16 speculative decoding
// equal to vanilla. Inner loops are row-outer: a q row (scores) or an output row (PV) stays in DV registers
// while a block of keys streams past.
constexpr int64_t kKeyBlock = 16;

// q . k for one key, k either a widened fp32 row or the cache's own row: load8 widens exactly, so both give
// the same bits.
template <int DV, typename S>
EAGLE_AVX2 inline float dot_avx2(const __m256* qv, const S* k) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0;
#pragma GCC unroll 16
  for (int i = 0; i < DV; i += 2) {
    a0 = _mm256_fmadd_ps(qv[i], eagle::cpu::load8(k + 8 * i), a0);
    if (i + 1 < DV) a1 = _mm256_fmadd_ps(qv[i + 1], eagle::cpu::load8(k + 8 * i + 8), a1);
  }
  return eagle::cpu::hsum8(_mm256_add_ps(a0, a1));
}

template <typename T>
EAGLE_AVX2 inline void widen_rows(const T* cache, const int64_t* rows, int64_t n, int64_t D, float* out) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(out + j * D + d, eagle::cpu::load8(cache + rows[j] + d));
}

struct RowKeys {     // the keys one query row sees
  int64_t count;     // all of them: its shared keys, then its extra ones
  int64_t shared;    // a prefix of the task's shared keys (the cached prefix, and causally its new tokens)
  const int64_t* extra;  // tree rows: the visible new tokens, read per row
  int64_t n_extra;
};

// Scores of `nk` keys for rows [0, R): k(j) -> the key row (fp32 or T), with q rows staying in registers.
template <int DV, typename KeyAt>
EAGLE_AVX2 inline void score_keys(const float* q, int64_t R, int64_t nk, KeyAt k, float* scores, int64_t stride) {
  for (int64_t r = 0; r < R; ++r) {
    __m256 qv[DV];
#pragma GCC unroll 16
    for (int i = 0; i < DV; ++i) qv[i] = _mm256_loadu_ps(q + r * 8 * DV + 8 * i);
    for (int64_t j = 0; j < nk; ++j) scores[r * stride + j] = dot_avx2<DV>(qv, k(j));
  }
}

// acc[r] += sum_j p[r, j] v(j) for rows [0, R), j in order, with an output row staying in registers.
template <int DV, typename ValAt>
EAGLE_AVX2 inline void accumulate_values(const float* p, int64_t stride, int64_t R, int64_t nk, ValAt v, float* acc) {
  for (int64_t r = 0; r < R; ++r) {
    __m256 av[DV];
#pragma GCC unroll 16
    for (int i = 0; i < DV; ++i) av[i] = _mm256_loadu_ps(acc + r * 8 * DV + 8 * i);
    for (int64_t j = 0; j < nk; ++j) {
      const __m256 pj = _mm256_set1_ps(p[r * stride + j]);
      const auto* vj = v(j);
#pragma GCC unroll 16
      for (int i = 0; i < DV; ++i) av[i] = _mm256_fmadd_ps(pj, eagle::cpu::load8(vj + 8 * i), av[i]);
    }
#pragma GCC unroll 16
    for (int i = 0; i < DV; ++i) _mm256_storeu_ps(acc + r * 8 * DV + 8 * i, av[i]);
  }
}

// Widening a key block costs about two rows' worth of in-register widening: below this many rows, read
// the cache directly.
constexpr int64_t kWidenRows = 3;

// AVX-512 on widened key blocks, each lane doing exactly what its AVX2 lane does (the same bits): a zmm holds
// the 8-lane chains of two keys (scores) or of two rows (values).
// Keys of a block in pairs, pair-major: pair p, chunk i -> 16 floats, key 2p's d = 8i .. 8i + 7, then key 2p + 1's.
template <typename T>
EAGLE_AVX512 inline void widen_key_pairs(const T* cache, const int64_t* rows, int64_t n, int DV, float* out) {
  for (int64_t j = 0; j < n; j += 2) {
    const T* a = cache + rows[j];
    const T* b = j + 1 < n ? cache + rows[j + 1] : a;
    for (int i = 0; i < DV; ++i) {
      const __m256 lo = eagle::cpu::load8(a + 8 * i), hi = eagle::cpu::load8(b + 8 * i);
      _mm512_storeu_ps(out + (j / 2 * DV + i) * 16, join8(lo, hi));
    }
  }
}

// hsum8 of each 256-bit half, in hsum8's order: ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)).
EAGLE_AVX512 inline void hsum8_pair(__m512 v, float* lo, float* hi) {
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(2, 3, 0, 1)));
  v = _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(1, 0, 3, 2)));
  v = _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(0, 0, 0, 1)));
  alignas(64) float out[16];
  _mm512_store_ps(out, v);
  *lo = out[0];
  *hi = out[8];
}

template <int DV>
EAGLE_AVX512 void score_key_pairs(const float* q, int64_t R, int64_t nk, const float* pairs, float* scores,
                                  int64_t stride) {
  for (int64_t r = 0; r < R; ++r) {
    __m512 qv[DV];
#pragma GCC unroll 16
    for (int i = 0; i < DV; ++i) qv[i] = dup8(q + r * 8 * DV + 8 * i);
    float* out = scores + r * stride;
    for (int64_t j = 0; j < nk; j += 2) {
      const float* k = pairs + j / 2 * DV * 16;
      __m512 a0 = _mm512_setzero_ps(), a1 = a0;
#pragma GCC unroll 16
      for (int i = 0; i < DV; i += 2) {
        a0 = _mm512_fmadd_ps(qv[i], _mm512_loadu_ps(k + 16 * i), a0);
        if (i + 1 < DV) a1 = _mm512_fmadd_ps(qv[i + 1], _mm512_loadu_ps(k + 16 * i + 16), a1);
      }
      float second;
      hsum8_pair(_mm512_add_ps(a0, a1), out + j, &second);
      if (j + 1 < nk) out[j + 1] = second;
    }
  }
}

// acc[r] += sum_j p[r, j] v_j, two rows per zmm; v: widened rows [nk, 8 * DV]. An odd last row goes alone.
template <int DV>
EAGLE_AVX512 void accumulate_value_pairs(const float* p, int64_t stride, int64_t R, int64_t nk, const float* v,
                                         float* acc) {
  constexpr int D = 8 * DV;
  int64_t r = 0;
  for (; r + 2 <= R; r += 2) {
    __m512 av[DV];
#pragma GCC unroll 16
    for (int i = 0; i < DV; ++i)
      av[i] = join8(_mm256_loadu_ps(acc + r * D + 8 * i), _mm256_loadu_ps(acc + (r + 1) * D + 8 * i));
    for (int64_t j = 0; j < nk; ++j) {
      const __m512 pj = join8(_mm256_set1_ps(p[r * stride + j]), _mm256_set1_ps(p[(r + 1) * stride + j]));
#pragma GCC unroll 16
      for (int i = 0; i < DV; ++i) av[i] = _mm512_fmadd_ps(pj, dup8(v + j * D + 8 * i), av[i]);
    }
#pragma GCC unroll 16
    for (int i = 0; i < DV; ++i) {
      _mm256_storeu_ps(acc + r * D + 8 * i, _mm512_castps512_ps256(av[i]));
      _mm256_storeu_ps(acc + (r + 1) * D + 8 * i, high8(av[i]));
    }
  }
  if (r < R) accumulate_values<DV>(p + r * stride, stride, 1, nk, [&](int64_t j) { return v + j * D; }, acc + r * D);
}

// The cache rows of keys [j0, j0 + kKeyBlock) (of P) on their way into L1 while the block before is processed:
// a step reads each layer's K and V once, from DRAM, in rows scattered over blocks.
template <typename T>
EAGLE_AVX2 inline void prefetch_rows(const T* cache, const int64_t* rows, int64_t j0, int64_t P, int64_t D) {
  for (int64_t j = j0; j < std::min(P, j0 + kKeyBlock); ++j)
    for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(cache + rows[j]) + b, _MM_HINT_T0);
}

// How many of the shared keys [j0, j0 + nk) row r sees (rows see a prefix of the shared keys).
inline int64_t seen_in_block(const RowKeys& row, int64_t j0, int64_t nk) {
  return std::min(nk, std::max<int64_t>(0, row.shared - j0));
}

// q: fp32 [R, D] scaled; scores: [R, stride]; acc: fp32 [R, D] zeroed; buf: fp32 [kKeyBlock, D].
// The shared keys stream past in blocks, each read (and widened) once for all the rows that see part of it:
// rows are ordered by token, so under a causal mask they see ever longer prefixes of the shared keys, and the
// rows of one block fall into runs that see the same number of its keys.
template <typename T, int DV>
EAGLE_AVX2 void attend_group_avx2(const float* q, int64_t R, const T* kc, const T* vc,
                                  const std::vector<int64_t>& shared_rows, const std::vector<RowKeys>& keys,
                                  int64_t stride, float* scores, float* acc, float* buf) {
  constexpr int D = 8 * DV;
  const int64_t S = shared_rows.size();
  const int64_t* pr = shared_rows.data();
  const bool avx512 = eagle::cpu::use_avx512();
  // fn(r0, r1, m): rows [r0, r1) each see the block's first m keys (m > 0); -> the rows that see some.
  auto runs = [&](int64_t j0, int64_t nk, auto&& fn) {
    int64_t r = 0;
    while (r < R && seen_in_block(keys[r], j0, nk) == 0) ++r;
    const int64_t users = R - r;
    while (r < R) {
      const int64_t m = seen_in_block(keys[r], j0, nk);
      int64_t r1 = r + 1;
      while (r1 < R && seen_in_block(keys[r1], j0, nk) == m) ++r1;
      if (m > 0) fn(r, r1, m, users);
      r = r1;
    }
  };
  prefetch_rows(kc, pr, 0, S, D);
  for (int64_t j0 = 0; j0 < S; j0 += kKeyBlock) {
    const int64_t nk = std::min(kKeyBlock, S - j0);
    prefetch_rows(kc, pr, j0 + kKeyBlock, S, D);
    int widened = 0;  // 1: fp32 rows in buf, 2: AVX-512 key pairs in buf
    runs(j0, nk, [&](int64_t r0, int64_t r1, int64_t m, int64_t users) {
      if (!widened && users >= kWidenRows) {
        widened = avx512 ? 2 : 1;
        if (avx512) widen_key_pairs(kc, pr + j0, nk, DV, buf);
        else widen_rows(kc, pr + j0, nk, D, buf);
      }
      float* out = scores + r0 * stride + j0;
      if (widened == 2) score_key_pairs<DV>(q + r0 * D, r1 - r0, m, buf, out, stride);
      else if (widened == 1) score_keys<DV>(q + r0 * D, r1 - r0, m, [&](int64_t j) { return buf + j * D; }, out, stride);
      else score_keys<DV>(q + r0 * D, r1 - r0, m, [&](int64_t j) { return kc + pr[j0 + j]; }, out, stride);
    });
  }
  for (int64_t r = 0; r < R; ++r) {
    const RowKeys& own = keys[r];
    score_keys<DV>(q + r * D, 1, own.n_extra, [&](int64_t e) { return kc + own.extra[e]; },
                   scores + r * stride + own.shared, stride);
    if (own.count) softmax_rows_avx2(scores + r * stride, 1, own.count);
  }
  prefetch_rows(vc, pr, 0, S, D);
  for (int64_t j0 = 0; j0 < S; j0 += kKeyBlock) {
    const int64_t nk = std::min(kKeyBlock, S - j0);
    prefetch_rows(vc, pr, j0 + kKeyBlock, S, D);
    bool widened = false;
    runs(j0, nk, [&](int64_t r0, int64_t r1, int64_t m, int64_t users) {
      if (!widened && users >= kWidenRows) {
        widened = true;
        widen_rows(vc, pr + j0, nk, D, buf);
      }
      const float* p = scores + r0 * stride + j0;
      if (widened && avx512) accumulate_value_pairs<DV>(p, stride, r1 - r0, m, buf, acc + r0 * D);
      else if (widened) accumulate_values<DV>(p, stride, r1 - r0, m, [&](int64_t j) { return buf + j * D; }, acc + r0 * D);
      else accumulate_values<DV>(p, stride, r1 - r0, m, [&](int64_t j) { return vc + pr[j0 + j]; }, acc + r0 * D);
    });
  }
  for (int64_t r = 0; r < R; ++r) {
    const RowKeys& own = keys[r];
    accumulate_values<DV>(scores + r * stride + own.shared, stride, 1, own.n_extra,
                          [&](int64_t e) { return vc + own.extra[e]; }, acc + r * D);
  }
}
#endif

// sum_j p[j] as 8 lanes (lane l adds j = l, l + 8, ... in order), then hsum8's order: one fixed chain that
// SIMD and scalar code compute alike, without a serial add per key.
float sum_lanes(const float* p, int64_t count) {
  int64_t j = 0;
  float lanes[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#if defined(__x86_64__)
  if (has_avx2()) j = sum8_avx2(p, count, lanes);
#endif
  for (; j < count; ++j) lanes[j % 8] += p[j];
  return ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
}

// Per-row normalisation and the store, shared by both paths: out = acc / sum(p) (a row that sees nothing
// gets zeros).
template <typename T>
void store_row(const float* acc, const float* p, int64_t count, int64_t D, T* out) {
  const float sum = sum_lanes(p, count);
  const float inv = count ? 1.f / sum : 0.f;
  for (int64_t d = 0; d < D; ++d) out[d] = static_cast<T>(acc[d] * inv);
}

// Scalar path (no AVX2, or a head size other than 64 / 128): one task per (new token, kv head); tasks [begin, end).
template <typename T>
void scalar_tasks(const T* qp, const T* kc, const T* vc, const int32_t* tables, const std::vector<int64_t>& seq_of,
                  const int32_t* cu, const int32_t* prefix, const int32_t* mask, const Layout& L, T* op,
                  int64_t begin, int64_t end) {
  thread_local std::vector<float> qf, acc, scores;
  thread_local std::vector<int64_t> rows;
  qf.resize(L.G * L.D);
  acc.resize(L.G * L.D);
  for (int64_t task = begin; task < end; ++task) {
    const int64_t t = task / L.Hkv, h = task % L.Hkv, b = seq_of[t];
    rows.clear();
    append_prefix_rows(tables + b * L.max_blocks, prefix[b], h, L, rows);
    append_new_rows(tables + b * L.max_blocks, prefix[b], cu[b + 1] - cu[b], t - cu[b],
                    mask ? mask + t * L.mask_words : nullptr, h, L, rows);
    const int64_t count = rows.size();
    scores.resize(L.G * count);
    const T* qt = qp + (t * L.Hq + h * L.G) * L.D;  // the group's q heads are adjacent
    for (int64_t e = 0; e < L.G * L.D; ++e) qf[e] = static_cast<float>(qt[e]) * L.scale;
    std::fill(acc.begin(), acc.end(), 0.f);
    attend_scalar(qf.data(), kc, vc, rows, L, scores.data(), acc.data());
    for (int64_t g = 0; g < L.G; ++g)
      store_row(acc.data() + g * L.D, scores.data() + g * count, count, L.D, op + (t * L.Hq + h * L.G + g) * L.D);
  }
}

struct GroupTask {
  int64_t b, h, r0, r1;  // sequence, kv head, query rows [r0, r1) of that sequence (row = token * G + head)
};

// The grouped path's tasks in `pieces` runs of near-equal work, one per thread: the query rows (sequence, kv
// head, row) in order, cut where the running sum of their work (a row's keys: its sequence's cached tokens and
// the new ones it sees, all of them under a tree mask, itself and those before it causally) crosses each
// 1 / pieces of the total. A task is the rows of one (sequence, kv head) within one piece, so a piece reads
// each kv head's keys once. Piece p holds tasks [starts[p], starts[p + 1]).
struct TaskList {
  std::vector<GroupTask> tasks;
  std::vector<int64_t> starts;
};

// The most query rows of one task: a long prefill's rows are cut into tasks whose scores ([rows, keys] fp32)
// stay in the L2 cache between the two passes; each task then reads the keys again (from L2 / L3).
constexpr int64_t kTaskRows = 48;

TaskList group_tasks(const int32_t* cu, const int32_t* prefix, int64_t B, const Layout& L, int64_t pieces,
                     bool causal) {
  auto cost = [&](int64_t b, int64_t row) {  // row = token * G + q head
    return prefix[b] + (causal ? row / L.G + 1 : cu[b + 1] - cu[b]);
  };
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t r = 0; r < (cu[b + 1] - cu[b]) * L.G; ++r) total += L.Hkv * cost(b, r);
  TaskList list;
  list.starts.push_back(0);
  int64_t piece = 0, done = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t rows = (cu[b + 1] - cu[b]) * L.G;
    for (int64_t h = 0; h < L.Hkv && rows; ++h) {
      int64_t r0 = 0;
      for (int64_t r = 0; r < rows; ++r) {
        while (piece + 1 < pieces && done >= total * (piece + 1) / pieces) {  // piece full: close it
          if (r > r0) list.tasks.push_back({b, h, r0, r});
          r0 = r;
          ++piece;
          list.starts.push_back(list.tasks.size());
        }
        if (r - r0 == kTaskRows) {  // a task's scores stay in L2
          list.tasks.push_back({b, h, r0, r});
          r0 = r;
        }
        done += cost(b, r);
      }
      list.tasks.push_back({b, h, r0, rows});
    }
  }
  while (static_cast<int64_t>(list.starts.size()) <= pieces) list.starts.push_back(list.tasks.size());
  return list;
}

#if defined(__x86_64__)
// Tasks [begin, end) of a TaskList.
template <typename T>
void grouped_tasks(const std::vector<GroupTask>& tasks, const T* qp, const T* kc, const T* vc, const int32_t* tables,
                   const int32_t* cu, const int32_t* prefix, const int32_t* mask, const Layout& L, T* op,
                   int64_t begin, int64_t end) {
  thread_local std::vector<float> qf, acc, scores, buf;
  thread_local std::vector<int64_t> shared_rows;
  thread_local std::vector<std::vector<int64_t>> extra;
  thread_local std::vector<RowKeys> keys;
  buf.resize(kKeyBlock * L.D);
  for (int64_t k = begin; k < end; ++k) {
    const GroupTask& task = tasks[k];
    const int64_t n = cu[task.b + 1] - cu[task.b], P = prefix[task.b], R = task.r1 - task.r0;
    const int32_t* table = tables + task.b * L.max_blocks;
    // Shared keys: the cached prefix and, without a tree mask, the new tokens up to the task's last one (row
    // token i sees the first P + i + 1); a tree row's visible new tokens are its own extra keys.
    const int64_t i0 = task.r0 / L.G, i1 = (task.r1 - 1) / L.G + 1;  // the task's new tokens
    shared_rows.clear();
    append_prefix_rows(table, P, task.h, L, shared_rows);
    if (!mask) append_new_rows(table, P, n, i1 - 1, nullptr, task.h, L, shared_rows);
    extra.resize(i1 - i0);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = cu[task.b] + i;
      extra[i - i0].clear();
      if (mask) append_new_rows(table, P, n, i, mask + t * L.mask_words, task.h, L, extra[i - i0]);
    }
    qf.resize(R * L.D);
    keys.resize(R);
    for (int64_t r = 0; r < R; ++r) {
      const int64_t i = (task.r0 + r) / L.G, g = (task.r0 + r) % L.G;
      const T* qt = qp + ((cu[task.b] + i) * L.Hq + task.h * L.G + g) * L.D;
      for (int64_t d = 0; d < L.D; ++d) qf[r * L.D + d] = static_cast<float>(qt[d]) * L.scale;
      const auto& e = extra[i - i0];
      const int64_t shared = mask ? P : P + i + 1, n_extra = e.size();
      keys[r] = {shared + n_extra, shared, e.data(), n_extra};
    }
    const int64_t stride = P + n;
    scores.resize(R * stride);
    acc.assign(R * L.D, 0.f);
    if (L.D == 64) attend_group_avx2<T, 8>(qf.data(), R, kc, vc, shared_rows, keys, stride, scores.data(),
                                           acc.data(), buf.data());
    else attend_group_avx2<T, 16>(qf.data(), R, kc, vc, shared_rows, keys, stride, scores.data(), acc.data(),
                                  buf.data());
    for (int64_t r = 0; r < R; ++r) {
      const int64_t i = (task.r0 + r) / L.G, g = (task.r0 + r) % L.G;
      store_row(acc.data() + r * L.D, scores.data() + r * stride, keys[r].count, L.D,
                op + ((cu[task.b] + i) * L.Hq + task.h * L.G + g) * L.D);
    }
  }
}
#endif

// Each check returns the first problem as "paged_attention: ..." (the Python launchers' messages), or ""
// when all is well; they never throw, so the `paged_attention_errors` op can hand the message to Python.
#define FAIL_UNLESS(cond, ...) \
  if (!(cond)) return c10::str("paged_attention: ", __VA_ARGS__)

// Shapes, dtypes and devices as the Python launchers check them; fills L on success.
std::string arg_error(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& bt,
                      const at::Tensor& cu, const at::Tensor& pl, const c10::optional<at::Tensor>& tm, Layout& L) {
  FAIL_UNLESS(q.dim() == 3, "q must be [T, Hq, D], got shape ", q.sizes());
  FAIL_UNLESS(kc.dim() == 4 && kc.sizes() == vc.sizes(),
              "k_cache/v_cache must both be [num_blocks, block_size, Hkv, D], got ", kc.sizes(), " and ", vc.sizes());
  const auto dt = q.scalar_type();
  FAIL_UNLESS((dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16) && kc.scalar_type() == dt &&
                  vc.scalar_type() == dt,
              "q, k_cache, v_cache must share one of (float32, float16, bfloat16), got ", dt, ", ",
              kc.scalar_type(), ", ", vc.scalar_type());
  FAIL_UNLESS(kc.size(3) == q.size(2), "head_dim mismatch: q has ", q.size(2), ", cache has ", kc.size(3));
  FAIL_UNLESS(kc.size(2) > 0 && q.size(1) % kc.size(2) == 0, "Hq=", q.size(1), " must be a multiple of Hkv=",
              kc.size(2));
  FAIL_UNLESS(bt.dim() == 2 && bt.scalar_type() == at::kInt,
              "block_tables must be int32 [B, max_blocks], got ", bt.scalar_type(), " ", bt.sizes());
  const int64_t B = bt.size(0);
  FAIL_UNLESS(cu.scalar_type() == at::kInt && cu.dim() == 1 && cu.size(0) == B + 1,
              "cu_seqlens_q must be int32 [B + 1] = [", B + 1, "], got ", cu.scalar_type(), " ", cu.sizes());
  FAIL_UNLESS(pl.scalar_type() == at::kInt && pl.dim() == 1 && pl.size(0) == B,
              "prefix_lens must be int32 [B] = [", B, "], got ", pl.scalar_type(), " ", pl.sizes());
  if (tm) {
    FAIL_UNLESS(tm->scalar_type() == at::kInt && tm->dim() == 2 && tm->size(0) == q.size(0),
                "tree_mask must be int32 [T=", q.size(0), ", W], got ", tm->scalar_type(), " ", tm->sizes());
    FAIL_UNLESS(tm->device().is_cpu(), "all tensors must be on the CPU for this kernel, got ", tm->device());
  }
  for (const at::Tensor* t : {&q, &kc, &vc, &bt, &cu, &pl}) {
    FAIL_UNLESS(t->device().is_cpu(), "all tensors must be on the CPU for this kernel, got ", t->device());
  }
  FAIL_UNLESS(kc.is_contiguous() && vc.is_contiguous(), "k_cache and v_cache must be contiguous");
  L = Layout{q.size(0), q.size(1), kc.size(2), q.size(2), q.size(1) / kc.size(2), kc.size(1), bt.size(1),
             tm ? tm->size(1) : 0, 0.f};
  return {};
}

// The values a wrong table would turn into out-of-bounds reads: cu_seqlens, prefix lengths and every
// block id in use.
std::string value_error(const int32_t* cu, const int32_t* prefix, const int32_t* tables, int64_t B,
                        int64_t num_blocks, const Layout& L) {
  FAIL_UNLESS(cu[0] == 0 && cu[B] == L.T, "cu_seqlens_q must run from 0 to T=", L.T, ", got ", cu[0], "..", cu[B]);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = cu[b + 1] - cu[b], len = prefix[b] + n;
    FAIL_UNLESS(n >= 0 && prefix[b] >= 0, "sequence ", b, " has ", n, " new and ", prefix[b], " cached tokens");
    FAIL_UNLESS(len <= L.max_blocks * L.block_size, "sequence ", b, " spans ", len,
                " tokens but its table holds ", L.max_blocks * L.block_size);
    FAIL_UNLESS(!L.mask_words || n <= 32 * L.mask_words, "sequence ", b, " has ", n,
                " new tokens but tree_mask rows hold ", 32 * L.mask_words, " bits");
    for (int64_t k = 0; k < (len + L.block_size - 1) / L.block_size; ++k) {
      const int32_t id = tables[b * L.max_blocks + k];
      FAIL_UNLESS(id >= 0 && id < num_blocks, "block_tables[", b, ", ", k, "] = ", id,
                  " is not a block of the cache");
    }
  }
  return {};
}

#undef FAIL_UNLESS

// All checks of paged_attention_cpu; "" when it may run.
std::string paged_attention_errors_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                       const at::Tensor& block_tables, const at::Tensor& cu,
                                       const at::Tensor& prefix, const c10::optional<at::Tensor>& tree_mask) {
  Layout L{};
  std::string err = arg_error(q, k_cache, v_cache, block_tables, cu, prefix, tree_mask, L);
  if (!err.empty()) return err;
  const at::Tensor bt = block_tables.contiguous(), cu_t = cu.contiguous(), pl_t = prefix.contiguous();
  return value_error(cu_t.data_ptr<int32_t>(), pl_t.data_ptr<int32_t>(), bt.data_ptr<int32_t>(), bt.size(0),
                     k_cache.size(0), L);
}

}  // namespace

namespace eagle::cpu {

struct AttentionTasks::Impl {
  Layout L;
  at::Tensor tables_t, cu_t, prefix_t, mask_t;  // contiguous copies (or the tensors themselves), kept alive
  const int32_t *tables, *cu, *prefix, *mask;
  std::vector<int64_t> seq_of;
  bool grouped = false;
  TaskList list;  // the grouped path's pieces (else a unit is one new token and kv head)

  template <typename T>
  void run(const T* q, const T* kc, const T* vc, T* out, int64_t u0, int64_t u1) const {
#if defined(__x86_64__)
    if (grouped) {
      return grouped_tasks(list.tasks, q, kc, vc, tables, cu, prefix, mask, L, out, list.starts[u0], list.starts[u1]);
    }
#endif
    scalar_tasks(q, kc, vc, tables, seq_of, cu, prefix, mask, L, out, u0, u1);
  }
};

AttentionTasks::AttentionTasks(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q,
                               const at::Tensor& prefix_lens, const c10::optional<at::Tensor>& tree_mask,
                               c10::optional<double> scale) {
  auto impl = std::make_shared<Impl>();
  Layout& L = impl->L;
  const std::string arg_err = arg_error(q, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens, tree_mask, L);
  TORCH_CHECK_VALUE(arg_err.empty(), arg_err);
  L.scale = scale ? static_cast<float>(*scale) : 1.f / std::sqrt(static_cast<float>(L.D));
  impl->tables_t = block_tables.contiguous();
  impl->cu_t = cu_seqlens_q.contiguous();
  impl->prefix_t = prefix_lens.contiguous();
  impl->mask_t = tree_mask ? tree_mask->contiguous() : at::Tensor();
  impl->tables = impl->tables_t.data_ptr<int32_t>();
  impl->cu = impl->cu_t.data_ptr<int32_t>();
  impl->prefix = impl->prefix_t.data_ptr<int32_t>();
  impl->mask = impl->mask_t.defined() ? impl->mask_t.data_ptr<int32_t>() : nullptr;
  const int64_t B = impl->tables_t.size(0);
  const std::string value_err = value_error(impl->cu, impl->prefix, impl->tables, B, k_cache.size(0), L);
  TORCH_CHECK_VALUE(value_err.empty(), value_err);
#if defined(__x86_64__)
  impl->grouped = has_avx2() && (L.D == 64 || L.D == 128);  // the head sizes of the supported models
  if (impl->grouped) impl->list = group_tasks(impl->cu, impl->prefix, B, L, at::get_num_threads(), impl->mask == nullptr);
#endif
  if (!impl->grouped) {
    impl->seq_of.resize(L.T);
    for (int64_t b = 0; b < B; ++b) std::fill(impl->seq_of.begin() + impl->cu[b], impl->seq_of.begin() + impl->cu[b + 1], b);
  }
  impl_ = std::move(impl);
}

int64_t AttentionTasks::size() const {
  return impl_->grouped ? static_cast<int64_t>(impl_->list.starts.size()) - 1 : impl_->L.T * impl_->L.Hkv;
}

void AttentionTasks::run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, at::Tensor& out,
                         int64_t t0, int64_t t1) const {
  switch (q.scalar_type()) {  // the three dtypes arg_error admits
    case at::kFloat:
      return impl_->run(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                        out.data_ptr<float>(), t0, t1);
    case at::kBFloat16:
      return impl_->run(q.data_ptr<c10::BFloat16>(), k_cache.data_ptr<c10::BFloat16>(),
                        v_cache.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), t0, t1);
    default:
      return impl_->run(q.data_ptr<c10::Half>(), k_cache.data_ptr<c10::Half>(), v_cache.data_ptr<c10::Half>(),
                        out.data_ptr<c10::Half>(), t0, t1);
  }
}

at::Tensor paged_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& cu, const at::Tensor& prefix,
                           const c10::optional<at::Tensor>& tree_mask, c10::optional<double> scale) {
  const AttentionTasks tasks(q_in, k_cache, v_cache, block_tables, cu, prefix, tree_mask, scale);
  const at::Tensor q = q_in.contiguous();
  at::Tensor out = at::empty_like(q);
  at::parallel_for(0, tasks.size(), 1, [&](int64_t t0, int64_t t1) { tasks.run(q, k_cache, v_cache, out, t0, t1); });
  return out;
}

}  // namespace eagle::cpu

TORCH_LIBRARY_FRAGMENT(eagle, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor cu_seqlens_q,"
        " Tensor prefix_lens, Tensor? tree_mask=None, float? scale=None) -> Tensor");
  m.def("paged_attention_errors(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables,"
        " Tensor cu_seqlens_q, Tensor prefix_lens, Tensor? tree_mask=None) -> str");
}

TORCH_LIBRARY_IMPL(eagle, CPU, m) {
  m.impl("paged_attention", &eagle::cpu::paged_attention);
}

// Every backend: the check reads values only after it has seen that all tensors are on the CPU.
TORCH_LIBRARY_IMPL(eagle, CompositeImplicitAutograd, m) {
  m.impl("paged_attention_errors", &paged_attention_errors_cpu);
}
