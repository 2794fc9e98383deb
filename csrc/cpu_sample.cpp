// Keyed draws: one token from each row of logits at a temperature, with noise that is a fixed function of (seed,
// position, token id), so a request draws the same token at a position whichever step, method or batch draws it,
// and whether the logits were all computed (this file) or only bounded (cpu_argmax_q.cpp's quantized LM head).
//
// The noise (eagle_kernels/sampling.py `keyed_uniforms` is the reference, in torch):
//   (k0, k1) = keys(seed, position);  h_i = mix(mix(i ^ k0) ^ k1);  u_i = (h_i + 0.5) 2^-32 in (0, 1)
// and the draw is the Gumbel max: token = argmax_i s_i, s_i = l_i / T + g_i, g_i = -log(-log(u_i)), in double (an
// exact draw from softmax(l / T); the first index among equals; T = 0: the argmax of l, argmax_rows' rule).
//
// Without two logs per token: g is bounded from above by a table over the leading bits of ~h (1 - u's, where g
// moves fastest: a bucket of 2^-6 of 1 - u's scale), so c_i = l_i (1 / T) + gub_i (fp32, vectorised) bounds s_i;
// only the tokens whose bound reaches the best exact score (less a slack for the bound's fp32 rounding) are
// scored exactly, by the same double arithmetic on every instruction set, so the token is the same bits on AVX2,
// AVX-512 and without, from exact logits or from bounded ones.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "cpu_ops.h"
#include "cpu_vec.h"

namespace eagle {
namespace {

// A 32-bit integer hash (a bijection; "triple32", low bias).
inline uint32_t mix(uint32_t x) {
  x ^= x >> 17;
  x *= 0xed5ad4bbu;
  x ^= x >> 11;
  x *= 0xac4c1b51u;
  x ^= x >> 15;
  x *= 0x31848babu;
  x ^= x >> 14;
  return x;
}

inline uint32_t pattern(float v) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  return b;
}

// The noise's bound table. v = ~h (so 1 - u = (v + 0.5) 2^-32); its bucket: f = float(v >> 8) (exact: < 2^24),
// by f's exponent and the top kNoiseBits bits of its mantissa (bucket 0: f = 0). g grows as v falls, so a bucket's
// bound is g at its lowest v, rounded up.
constexpr int kNoiseBits = 6;
constexpr int kNoiseBase = (127 << kNoiseBits) - 1;  // f = 1 -> bucket 1
constexpr int kNoiseBuckets = (24 << kNoiseBits) + 1;

inline int noise_bucket(uint32_t v) {
  return std::max<int>(static_cast<int>(pattern(static_cast<float>(v >> 8)) >> (23 - kNoiseBits)) - kNoiseBase, 0);
}

const float* noise_table() {
  static const std::array<float, kNoiseBuckets> table = [] {
    std::array<float, kNoiseBuckets> t{};
    for (int i = 0; i < kNoiseBuckets; ++i) {
      float f = 0.f;
      if (i > 0) {
        const uint32_t bits = static_cast<uint32_t>(i + kNoiseBase) << (23 - kNoiseBits);
        std::memcpy(&f, &bits, 4);
      }
      const double u = 1.0 - (static_cast<double>(f) * 256.0 + 0.5) * 0x1p-32;  // the bucket's largest u
      const double g = -std::log(-std::log(u));
      float up = static_cast<float>(g);
      up = std::nextafter(std::nextafter(up, INFINITY), INFINITY);  // rounded up, and an ulp more
      t[i] = up;
    }
    return t;
  }();
  return table.data();
}

#if defined(__x86_64__)
EAGLE_AVX2 inline __m256i mix8(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 17));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int32_t>(0xed5ad4bbu)));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 11));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int32_t>(0xac4c1b51u)));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int32_t>(0x31848babu)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 14));
}

// c[i] = b[i] * inv_t + gub(h_i) for i in [begin, end), 8 at a time -> where the scalar tail starts.
EAGLE_AVX2 int64_t bounds_avx2(const float* b, float* c, int64_t begin, int64_t end, uint32_t k0, uint32_t k1,
                               float inv_t, const int64_t* ids) {
  const float* table = noise_table();
  const __m256i key0 = _mm256_set1_epi32(static_cast<int32_t>(k0)), key1 = _mm256_set1_epi32(static_cast<int32_t>(k1));
  const __m256i all = _mm256_set1_epi32(-1), eight = _mm256_set1_epi32(8), base = _mm256_set1_epi32(kNoiseBase);
  const __m256 it = _mm256_set1_ps(inv_t);
  __m256i at = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(static_cast<int32_t>(begin)));
  int64_t i = begin;
  for (; i + 8 <= end; i += 8, at = _mm256_add_epi32(at, eight)) {
    __m256i id = at;
    if (ids) {  // the ids' low 32 bits (token ids are small)
      const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ids + i));
      const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ids + i + 4));
      id = _mm256_permutevar8x32_epi32(_mm256_castps_si256(_mm256_shuffle_ps(
                                           _mm256_castsi256_ps(lo), _mm256_castsi256_ps(hi), _MM_SHUFFLE(2, 0, 2, 0))),
                                       _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));
    }
    const __m256i v = _mm256_xor_si256(mix8(_mm256_xor_si256(mix8(_mm256_xor_si256(id, key0)), key1)), all);
    const __m256 f = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 8));
    const __m256i bucket = _mm256_max_epi32(
        _mm256_sub_epi32(_mm256_srli_epi32(_mm256_castps_si256(f), 23 - kNoiseBits), base), _mm256_setzero_si256());
    const __m256 gub = _mm256_i32gather_ps(table, bucket, 4);
    _mm256_storeu_ps(c + i, _mm256_fmadd_ps(_mm256_loadu_ps(b + i), it, gub));
  }
  return i;
}

// Calls exact(i), in order, for each i whose bound c[i] reaches `reach`, 8 at a time -> where the scalar tail starts.
template <typename Fn>
EAGLE_AVX2 int64_t candidates_avx2(const float* c, int64_t V, float reach, Fn&& exact) {
  const __m256 r = _mm256_set1_ps(reach);
  int64_t i = 0;
  for (; i + 8 <= V; i += 8)
    for (int m = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(c + i), r, _CMP_GE_OQ)); m; m &= m - 1)
      exact(i + __builtin_ctz(m));
  return i;
}
#endif

}  // namespace

namespace cpu {

Keyed::Keyed(int64_t seed, int64_t position, float temperature) : t(temperature), inv_t(1.f / temperature) {
  const uint64_t s = static_cast<uint64_t>(seed);
  k0 = mix(static_cast<uint32_t>(position) ^ mix(static_cast<uint32_t>(s) ^ 0x9e3779b9u));
  k1 = mix(k0 ^ static_cast<uint32_t>(s >> 32) ^ 0x85ebca6bu);
}

double Keyed::score(float logit, int64_t id) const {
  const uint32_t h = mix(mix(static_cast<uint32_t>(id) ^ k0) ^ k1);
  const double u = (static_cast<double>(h) + 0.5) * 0x1p-32;
  return static_cast<double>(logit) / static_cast<double>(t) - std::log(-std::log(u));
}

void Keyed::bounds(const float* b, float* c, int64_t begin, int64_t end, const int64_t* ids) const {
  int64_t i = begin;
#if defined(__x86_64__)
  if (has_avx2()) i = bounds_avx2(b, c, begin, end, k0, k1, inv_t, ids);
#endif
  const float* table = noise_table();
  for (; i < end; ++i) {
    const uint32_t h = mix(mix(static_cast<uint32_t>(ids ? ids[i] : i) ^ k0) ^ k1);
    c[i] = std::fma(b[i], inv_t, table[noise_bucket(~h)]);
  }
}

float Keyed::reach(double floor, double margin) const {
  // c_i (one fp32 product and an fma from l_i and gub_i >= g_i) falls short of s_i by at most a few 2^-24 of
  // |s_i| + 2 max|g|; 2^-20 (|floor| + 64) covers it where s_i >= floor. margin: the bounds' own slack in logits.
  const double r = floor - margin * static_cast<double>(inv_t) * (1 + 0x1p-20) - 0x1p-20 * (std::fabs(floor) + 64);
  float f = static_cast<float>(r);
  return static_cast<double>(f) > r ? std::nextafter(f, -INFINITY) : f;
}

int64_t keyed_draw(const float* l, int64_t V, int64_t seed, int64_t position, float temperature, const int64_t* ids) {
  int64_t at = first_max(l, V);  // argmax_rows' rule: the first maximum, a NaN the first of all
  // greedy; a NaN or +inf (their scores, whatever the noise: the first wins); no token allowed (all -inf)
  if (!(temperature > 0) || !std::isfinite(l[at])) return at;
  const Keyed k(seed, position, temperature);
  thread_local std::vector<float> scratch;
  if (static_cast<int64_t>(scratch.size()) < V) scratch.resize(V);
  float* c = scratch.data();
  k.bounds(l, c, 0, V, ids);
  const int64_t lead = first_max(c, V);  // likely the winner: its score is the floor the others must reach
  const float reach = k.reach(k.score(l[lead], ids ? ids[lead] : lead), 0.0);
  double best = -INFINITY;
  at = lead;
  const auto exact = [&](int64_t i) {
    const double s = k.score(l[i], ids ? ids[i] : i);
    if (s > best) best = s, at = i;  // in index order: the first among equals
  };
  int64_t i = 0;
#if defined(__x86_64__)
  if (has_avx2()) i = candidates_avx2(c, V, reach, exact);
#endif
  for (; i < V; ++i)
    if (c[i] >= reach) exact(i);
  return at;
}

}  // namespace cpu

namespace {

// logits fp32 [..., V], temperatures fp32 [...] (0: argmax), seeds and positions int64 [...], ids int64 [V] or
// None -> int64 [...] (column indices).
at::Tensor sample_keyed_cpu(const at::Tensor& logits_in, const at::Tensor& temperatures_in, const at::Tensor& seeds_in,
                            const at::Tensor& positions_in, const c10::optional<at::Tensor>& ids_in) {
  TORCH_CHECK_VALUE(logits_in.scalar_type() == at::kFloat && logits_in.dim() >= 1 && logits_in.size(-1) > 0,
                    "sample_keyed: logits must be fp32 [..., V] with V > 0");
  auto lead = logits_in.sizes().vec();
  lead.pop_back();
  TORCH_CHECK_VALUE(temperatures_in.scalar_type() == at::kFloat && temperatures_in.sizes().vec() == lead,
                    "sample_keyed: temperatures must be fp32 shaped like logits without its last dim");
  for (const auto* t : {&seeds_in, &positions_in})
    TORCH_CHECK_VALUE(t->scalar_type() == at::kLong && t->sizes().vec() == lead,
                      "sample_keyed: seeds and positions must be int64 shaped like logits without its last dim");
  const at::Tensor logits = logits_in.contiguous(), temps = temperatures_in.contiguous(), seeds = seeds_in.contiguous(),
                   positions = positions_in.contiguous();
  const int64_t V = logits.size(-1), rows = logits.numel() / V;
  at::Tensor ids;
  if (ids_in.has_value()) {
    ids = ids_in->contiguous();
    TORCH_CHECK_VALUE(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.size(0) == V,
                      "sample_keyed: ids must be int64 [V]");
  }
  const int64_t* idp = ids.defined() ? ids.data_ptr<int64_t>() : nullptr;
  at::Tensor out = at::empty(lead, seeds.options());
  const float *l = logits.data_ptr<float>(), *t = temps.data_ptr<float>();
  const int64_t *s = seeds.data_ptr<int64_t>(), *pos = positions.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) o[r] = cpu::keyed_draw(l + r * V, V, s[r], pos[r], t[r], idp);
  });
  return out;
}

// Top-p over one row p [V] (finite, >= 0): in (p desc, id asc) order the tokens whose preceding mass is below
// top_p times the row's mass (the most probable always), renormalised into o [V], zeros elsewhere. Without
// sorting the row, by a two-level radix select over the fp32 bit patterns (which order like the values): a
// histogram of masses by the top 13 bits finds the bucket holding the cut; every token above it is kept (the
// mass before each is below the limit), none below; the cut bucket's tokens go through a histogram by the next
// 12 bits; only the tokens of the sub-bucket at the cut are sorted (ties there by id). Masses in double.
struct TopP {
  std::vector<double> hist;
  std::vector<int64_t> edge;
  std::vector<std::pair<float, int64_t>> cut;
};

void top_p_row(const float* p, int64_t V, double top_p, float* o, TopP& s) {
  constexpr int kBins = 1 << 13;
  s.hist.assign(kBins, 0.0);
  for (int64_t i = 0; i < V; ++i) s.hist[pattern(p[i]) >> 19] += p[i];
  double mass = 0.0;
  for (double h : s.hist) mass += h;
  const double limit = top_p * mass;
  double above = 0.0;
  int b1 = kBins - 1;
  for (; b1 > 0 && above + s.hist[b1] < limit; --b1) above += s.hist[b1];
  s.edge.clear();
  for (int64_t i = 0; i < V; ++i) {
    const uint32_t k = pattern(p[i]) >> 19;
    o[i] = k > static_cast<uint32_t>(b1) ? p[i] : 0.f;
    if (k == static_cast<uint32_t>(b1)) s.edge.push_back(i);
  }
  s.hist.assign(1 << 12, 0.0);
  for (int64_t i : s.edge) s.hist[(pattern(p[i]) >> 7) & 0xFFF] += p[i];
  int b2 = (1 << 12) - 1;
  for (; b2 > 0 && above + s.hist[b2] < limit; --b2) above += s.hist[b2];
  s.cut.clear();
  for (int64_t i : s.edge) {
    const uint32_t k = (pattern(p[i]) >> 7) & 0xFFF;
    if (k > static_cast<uint32_t>(b2)) o[i] = p[i];
    else if (k == static_cast<uint32_t>(b2)) s.cut.emplace_back(p[i], i);
  }
  std::sort(s.cut.begin(), s.cut.end(), [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  });
  double kept = above;  // the mass kept so far: every token above the cut's sub-bucket
  for (size_t j = 0; j < s.cut.size() && (kept < limit || (j == 0 && above == 0.0)); ++j) {
    o[s.cut[j].second] = s.cut[j].first;
    kept += s.cut[j].first;
  }
  const float scale = static_cast<float>(1.0 / kept);
  for (int64_t i = 0; i < V; ++i) o[i] *= scale;
}

// Top-k, then top-p over what it kept, of one row into o [V] (renormalised, zeros elsewhere): the k most probable
// tokens (ties: the lowest ids) by the same two-level radix select with counts instead of masses, sorting only
// the cut's sub-bucket; then those k sorted (p desc, id asc) and cut where their preceding mass reaches top_p times
// theirs.
void top_k_row(const float* p, int64_t V, int64_t k, double top_p, float* o, TopP& s) {
  constexpr int kBins = 1 << 13;
  std::vector<int64_t>& count = s.edge;  // the histograms' counts, then the cut bucket's tokens in `kept`
  count.assign(kBins, 0);
  for (int64_t i = 0; i < V; ++i) ++count[pattern(p[i]) >> 19];
  int64_t above = 0;
  int b1 = kBins - 1;
  for (; b1 > 0 && above + count[b1] < k; --b1) above += count[b1];
  s.cut.clear();
  std::vector<std::pair<float, int64_t>> kept;  // K: its tokens above the cut's bucket first
  kept.reserve(k);
  std::vector<int64_t> bucket;
  for (int64_t i = 0; i < V; ++i) {
    const uint32_t key = pattern(p[i]) >> 19;
    if (key > static_cast<uint32_t>(b1)) kept.emplace_back(p[i], i);
    else if (key == static_cast<uint32_t>(b1)) bucket.push_back(i);
  }
  count.assign(1 << 12, 0);
  for (int64_t i : bucket) ++count[(pattern(p[i]) >> 7) & 0xFFF];
  int b2 = (1 << 12) - 1;
  for (; b2 > 0 && above + count[b2] < k; --b2) above += count[b2];
  for (int64_t i : bucket) {
    const uint32_t key = (pattern(p[i]) >> 7) & 0xFFF;
    if (key > static_cast<uint32_t>(b2)) kept.emplace_back(p[i], i);
    else if (key == static_cast<uint32_t>(b2)) s.cut.emplace_back(p[i], i);
  }
  const auto order = [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); };
  std::sort(s.cut.begin(), s.cut.end(), order);
  for (size_t j = 0; static_cast<int64_t>(kept.size()) < k && j < s.cut.size(); ++j) kept.push_back(s.cut[j]);
  std::sort(kept.begin(), kept.end(), order);
  double mass = 0.0;
  for (const auto& t : kept) mass += t.first;
  const double limit = top_p < 1.0 ? top_p * mass : INFINITY;  // top_p >= 1: off (not a cut at the rounded mass)
  std::fill(o, o + V, 0.f);
  double before = 0.0;
  for (size_t j = 0; j < kept.size() && (j == 0 || before < limit); ++j) {
    o[kept[j].second] = kept[j].first;
    before += kept[j].first;
  }
  const float scale = static_cast<float>(1.0 / before);
  for (const auto& t : kept) o[t.second] *= scale;
}

// probs fp32 [R, V] (finite, >= 0); per row top_k (>= V: off) and top_p (>= 1: off) -> fp32 [R, V]: the kept
// tokens renormalised, zeros elsewhere (a row with neither: copied).
at::Tensor truncate_probs_cpu(const at::Tensor& probs_in, at::IntArrayRef top_k, at::ArrayRef<double> top_p) {
  TORCH_CHECK_VALUE(probs_in.scalar_type() == at::kFloat && probs_in.dim() == 2 && probs_in.size(1) > 0,
                    "truncate_probs: probs must be fp32 [R, V] with V > 0");
  const int64_t R = probs_in.size(0), V = probs_in.size(1);
  TORCH_CHECK_VALUE(static_cast<int64_t>(top_k.size()) == R && static_cast<int64_t>(top_p.size()) == R,
                    "truncate_probs: top_k and top_p must hold ", R, " values each");
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK_VALUE(top_k[r] > 0 && top_p[r] > 0, "truncate_probs: top_k and top_p must be > 0");
  const at::Tensor probs = probs_in.contiguous();
  at::Tensor out = at::empty({R, V}, probs.options());
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    TopP scratch;
    for (int64_t r = r0; r < r1; ++r) {
      const float* p = probs.data_ptr<float>() + r * V;
      float* o = out.data_ptr<float>() + r * V;
      if (top_k[r] < V) top_k_row(p, V, top_k[r], std::min(top_p[r], 1.0), o, scratch);
      else if (top_p[r] < 1) top_p_row(p, V, top_p[r], o, scratch);
      else std::copy(p, p + V, o);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(eagle, CPU, m) {
  m.impl("sample_keyed", &sample_keyed_cpu);
  m.impl("truncate_probs", &truncate_probs_cpu);
}

}  // namespace eagle
