// Keyed draws: one token from each probability row with noise that is a fixed function of (seed, position,
// token id), so a request draws the same token at a position whichever step, method or batch draws it.
//
// The noise (eagle_kernels/sampling.py `keyed_uniforms` is the reference, in torch):
//   (k0, k1) = keys(seed, position);  h_i = mix(mix(i ^ k0) ^ k1);  u_i = (h_i + 0.5) 2^-32 in (0, 1)
// and the draw is the exponential race: token = argmax_i p_i / E_i, E_i = -log(u_i) ~ Exp(1) i.i.d. (an exact
// draw from p; the first index among equals).
//
// Without a log per token: 1 - u <= -log(u) <= (1 - u) / u bounds each p_i / E_i within [p u / (1 - u),
// p / (1 - u)], so only the tokens whose upper bound reaches the largest lower bound can win (a handful: the
// likely ones and those whose u is near 1). Those are computed exactly, in double precision, in the same scalar
// code on every instruction set: the bounds (vectorised where the compiler can) only pick the candidates, with
// a relative slack that covers their fp32 rounding, so the token is the same bits on AVX2, AVX-512 and without.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

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

struct Keys {
  uint32_t k0, k1;
};

inline Keys keys(int64_t seed, int64_t position) {
  const uint64_t s = static_cast<uint64_t>(seed);
  const uint32_t k0 = mix(static_cast<uint32_t>(position) ^ mix(static_cast<uint32_t>(s) ^ 0x9e3779b9u));
  return {k0, mix(k0 ^ static_cast<uint32_t>(s >> 32) ^ 0x85ebca6bu)};
}

inline uint32_t bits(uint32_t i, Keys k) { return mix(mix(i ^ k.k0) ^ k.k1); }

// The largest lower bound of the row's p_i / E_i (NaN where a p_i is NaN), from u = (h + 0.5) 2^-32 and 1 - u =
// (~h + 0.5) 2^-32 in fp32; h (scratch, V) gets the row's hashes. Results do not depend on the path (see the top).
float lower_bounds_plain(const float* p, int64_t V, Keys k, const int64_t* ids, uint32_t* h) {
  for (int64_t i = 0; i < V; ++i) h[i] = bits(static_cast<uint32_t>(ids ? ids[i] : i), k);
  float best = 0.f;
  for (int64_t i = 0; i < V; ++i) {
    const float lb = p[i] * ((static_cast<float>(h[i]) + 0.5f) / (static_cast<float>(~h[i]) + 0.5f));
    best = lb != lb ? lb : std::max(best, lb);  // a NaN stays (keyed_draw looks for it)
  }
  return best;
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

// uint32 lanes + 0.5 -> fp32, rounded once from the exact halves (relative error <= 2^-24, then the + 0.5's).
EAGLE_AVX2 inline __m256 plus_half(__m256i h) {
  const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(h, 16));
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(h, _mm256_set1_epi32(0xFFFF)));
  return _mm256_add_ps(_mm256_fmadd_ps(hi, _mm256_set1_ps(65536.f), lo), _mm256_set1_ps(0.5f));
}

EAGLE_AVX2 float lower_bounds_avx2(const float* p, int64_t V, Keys k, const int64_t* ids, uint32_t* h) {
  if (ids)
    for (int64_t i = 0; i < V; ++i) h[i] = bits(static_cast<uint32_t>(ids[i]), k);
  const __m256i k0 = _mm256_set1_epi32(static_cast<int32_t>(k.k0)), k1 = _mm256_set1_epi32(static_cast<int32_t>(k.k1));
  const __m256i all = _mm256_set1_epi32(-1), eight = _mm256_set1_epi32(8);
  __m256i at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 best8 = _mm256_setzero_ps(), nan8 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= V; i += 8, at = _mm256_add_epi32(at, eight)) {
    __m256i hv;
    if (ids) {
      hv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + i));
    } else {
      hv = mix8(_mm256_xor_si256(mix8(_mm256_xor_si256(at, k0)), k1));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(h + i), hv);
    }
    const __m256 ratio = _mm256_div_ps(plus_half(hv), plus_half(_mm256_xor_si256(hv, all)));
    const __m256 pv = _mm256_loadu_ps(p + i);
    nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(pv, pv, _CMP_UNORD_Q));
    best8 = _mm256_max_ps(best8, _mm256_mul_ps(pv, ratio));
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, best8);
  float best = _mm256_movemask_ps(nan8) ? NAN : *std::max_element(lanes, lanes + 8);
  for (; i < V; ++i) {
    if (!ids) h[i] = bits(static_cast<uint32_t>(i), k);
    const float lb = p[i] * ((static_cast<float>(h[i]) + 0.5f) / (static_cast<float>(~h[i]) + 0.5f));
    best = lb != lb ? lb : std::max(best, lb);
  }
  return best;
}

// The exact pass's candidates 8 at a time: calls exact(i) for each i whose upper bound reaches `reach`, in order;
// -> where the scalar tail starts.
template <typename Fn>
EAGLE_AVX2 int64_t candidates_avx2(const float* p, int64_t V, const uint32_t* h, float reach, float scale, Fn&& exact) {
  const __m256i all = _mm256_set1_epi32(-1);
  const __m256 r = _mm256_set1_ps(reach), c = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) {
    const __m256i hv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + i));
    const __m256 lhs = _mm256_mul_ps(_mm256_loadu_ps(p + i), c);
    const __m256 rhs = _mm256_mul_ps(r, plus_half(_mm256_xor_si256(hv, all)));
    for (int m = _mm256_movemask_ps(_mm256_cmp_ps(lhs, rhs, _CMP_GE_OQ)); m; m &= m - 1) exact(i + __builtin_ctz(m));
  }
  return i;
}
#endif

}  // namespace

namespace cpu {
// One keyed draw from p [V] (probabilities, or any non-negative multiple of them); ids [V] (or null: 0 .. V - 1)
// the token id of each column, whose noise it takes.
int64_t keyed_draw(const float* p, int64_t V, int64_t seed, int64_t position, const int64_t* ids) {
  thread_local std::vector<uint32_t> scratch;
  if (static_cast<int64_t>(scratch.size()) < V) scratch.resize(V);
  uint32_t* h = scratch.data();
  const Keys k = keys(seed, position);
#if defined(__x86_64__)
  const bool avx2 = eagle::cpu::has_avx2();
  const float floor = (avx2 ? lower_bounds_avx2 : lower_bounds_plain)(p, V, k, ids, h);
#else
  const float floor = lower_bounds_plain(p, V, k, ids, h);
#endif
  if (floor != floor)  // a NaN: it wins, as in the reference's argmax (the first)
    for (int64_t i = 0; i < V; ++i)
      if (p[i] != p[i]) return i;
  // A token can win where its upper bound p 2^32 / (~h + 0.5) reaches the largest lower bound; the slack covers
  // both bounds' fp32 rounding (a few ulps).
  const float reach = floor * (1.f - 0x1p-16f), scale = (1.f + 0x1p-16f) * 0x1p32f;
  int64_t at = -1;
  double best = -1.0;
  const auto exact = [&](int64_t i) {
    if (!(p[i] > 0.f)) return;
    const double v = static_cast<double>(p[i]) / -std::log((static_cast<double>(h[i]) + 0.5) * 0x1p-32);
    if (v > best) best = v, at = i;
  };
  int64_t i = 0;
#if defined(__x86_64__)
  if (avx2) i = candidates_avx2(p, V, h, reach, scale, exact);
#endif
  for (; i < V; ++i)
    if (p[i] * scale >= reach * (static_cast<float>(~h[i]) + 0.5f)) exact(i);
  return at < 0 ? 0 : at;  // every p_i = 0 (no distribution): column 0, as the reference's argmax of zeros
}
}  // namespace cpu

namespace {

// probs fp32 [..., V], seeds and positions int64 [...], ids int64 [V] or None -> int64 [...] (column indices).
at::Tensor sample_keyed_cpu(const at::Tensor& probs_in, const at::Tensor& seeds_in, const at::Tensor& positions_in,
                            const c10::optional<at::Tensor>& ids_in) {
  TORCH_CHECK_VALUE(probs_in.scalar_type() == at::kFloat && probs_in.dim() >= 1 && probs_in.size(-1) > 0,
                    "sample_keyed: probs must be fp32 [..., V] with V > 0");
  auto lead = probs_in.sizes().vec();
  lead.pop_back();
  for (const auto* t : {&seeds_in, &positions_in})
    TORCH_CHECK_VALUE(t->scalar_type() == at::kLong && t->sizes().vec() == lead,
                      "sample_keyed: seeds and positions must be int64 shaped like probs without its last dim");
  const at::Tensor probs = probs_in.contiguous(), seeds = seeds_in.contiguous(), positions = positions_in.contiguous();
  const int64_t V = probs.size(-1), rows = probs.numel() / V;
  at::Tensor ids;
  if (ids_in.has_value()) {
    ids = ids_in->contiguous();
    TORCH_CHECK_VALUE(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.size(0) == V,
                      "sample_keyed: ids must be int64 [V]");
  }
  const int64_t* idp = ids.defined() ? ids.data_ptr<int64_t>() : nullptr;
  at::Tensor out = at::empty(lead, seeds.options());
  const float* p = probs.data_ptr<float>();
  const int64_t *s = seeds.data_ptr<int64_t>(), *pos = positions.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) o[r] = cpu::keyed_draw(p + r * V, V, s[r], pos[r], idp);
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

inline uint32_t pattern(float v) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  return b;
}

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
