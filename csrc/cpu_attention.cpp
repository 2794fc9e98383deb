// Paged attention on the CPU: prefill, decode, chains and trees in one call (contract: DESIGN.md,
// "paged_attention"). The torch path it replaces spent ~80 us per layer on Python-side gathers and
// per-sequence SDPA launches for a decode step whose arithmetic takes a few microseconds.
//
// One task = (new token t, kv head h). Its G = Hq / Hkv query heads share every K/V row it reads. Pass 1
// writes the scaled scores of all visible keys to a task-local buffer, then an exact fp32 softmax, then
// pass 2 accumulates the weighted V rows in fp32; the output is rounded to q's dtype once.
// Visible keys of new token i of sequence b: every cached prefix position, then new token j iff j <= i
// (no tree mask) or bit j of tree_mask[t] is set.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu_vec.h"

namespace {

using eagle::cpu::has_avx2;

struct Layout {
  int64_t T, Hq, Hkv, D, G, block_size, max_blocks, mask_words;
  float scale;
};

// Element offsets (into a [num_blocks, block_size, Hkv, D] cache) of the K/V rows that new token i of a
// sequence sees, in order: its cached prefix, then its visible new tokens.
void visible_rows(const int32_t* table, int64_t prefix, int64_t n, int64_t i, const int32_t* mask_row,
                  int64_t kv_head, const Layout& L, std::vector<int64_t>& rows) {
  rows.clear();
  auto add = [&](int64_t pos) {
    const int64_t block = table[pos / L.block_size];
    rows.push_back(((block * L.block_size + pos % L.block_size) * L.Hkv + kv_head) * L.D);
  };
  for (int64_t pos = 0; pos < prefix; ++pos) add(pos);
  for (int64_t j = 0; j < n; ++j) {
    if (mask_row ? (mask_row[j >> 5] >> (j & 31)) & 1 : j <= i) add(prefix + j);
  }
}

// Scores -> unnormalised probabilities in place, per head: scores [G, count] (row stride count).
void softmax_rows(float* scores, int64_t G, int64_t count) {
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * count;
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
EAGLE_AVX2 void softmax_rows_avx2(float* scores, int64_t G, int64_t count) {
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * count;
    const float m = *std::max_element(s, s + count);
    const __m256 mv = _mm256_set1_ps(m);
    int64_t j = 0;
    for (; j + 8 <= count; j += 8) _mm256_storeu_ps(s + j, eagle::cpu::exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv)));
    for (; j < count; ++j) s[j] = std::exp(s[j] - m);
  }
}

// attend_scalar for D = 8 * DV. Row-outer loops: one q row (pass 1) or one output row (pass 2) stays in
// DV registers while the keys stream past, instead of being reloaded and stored for every key.
template <typename T, int DV>
EAGLE_AVX2 void attend_avx2(const float* q, const T* kc, const T* vc, const std::vector<int64_t>& rows,
                            const Layout& L, float* scores, float* acc) {
  using eagle::cpu::hsum8;
  using eagle::cpu::load8;
  const int64_t count = rows.size();
  for (int64_t g = 0; g < L.G; ++g) {
    __m256 qv[DV];
#pragma GCC unroll 16
    for (int i = 0; i < DV; ++i) qv[i] = _mm256_loadu_ps(q + g * L.D + 8 * i);
    float* s = scores + g * count;
    for (int64_t j = 0; j < count; ++j) {
      const T* k = kc + rows[j];
      __m256 a0 = _mm256_setzero_ps(), a1 = a0;  // two chains: one would wait on each FMA
#pragma GCC unroll 16
      for (int i = 0; i < DV; i += 2) {
        a0 = _mm256_fmadd_ps(qv[i], load8(k + 8 * i), a0);
        if (i + 1 < DV) a1 = _mm256_fmadd_ps(qv[i + 1], load8(k + 8 * i + 8), a1);
      }
      s[j] = hsum8(_mm256_add_ps(a0, a1));
    }
  }
  softmax_rows_avx2(scores, L.G, count);
  for (int64_t g = 0; g < L.G; ++g) {
    __m256 av[DV];
#pragma GCC unroll 16
    for (int i = 0; i < DV; ++i) av[i] = _mm256_setzero_ps();
    const float* s = scores + g * count;
    for (int64_t j = 0; j < count; ++j) {
      const T* v = vc + rows[j];
      const __m256 p = _mm256_set1_ps(s[j]);
#pragma GCC unroll 16
      for (int i = 0; i < DV; ++i) av[i] = _mm256_fmadd_ps(p, load8(v + 8 * i), av[i]);
    }
#pragma GCC unroll 16
    for (int i = 0; i < DV; ++i) _mm256_storeu_ps(acc + g * L.D + 8 * i, av[i]);
  }
}
#endif

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const int32_t* tables,
         const std::vector<int64_t>& seq_of, const int32_t* cu, const int32_t* prefix, const int32_t* mask,
         const Layout& L, at::Tensor& out) {
  const T* qp = q.data_ptr<T>();
  const T* kc = k_cache.data_ptr<T>();
  const T* vc = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const bool avx2 = has_avx2() && (L.D == 64 || L.D == 128);  // the head sizes of the supported models
  at::parallel_for(0, L.T * L.Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(L.G * L.D), acc(L.G * L.D), scores;
    std::vector<int64_t> rows;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / L.Hkv, h = task % L.Hkv, b = seq_of[t];
      visible_rows(tables + b * L.max_blocks, prefix[b], cu[b + 1] - cu[b], t - cu[b],
                   mask ? mask + t * L.mask_words : nullptr, h, L, rows);
      const int64_t count = rows.size();
      scores.resize(L.G * count);
      const T* qt = qp + (t * L.Hq + h * L.G) * L.D;  // the group's q heads are adjacent
      for (int64_t e = 0; e < L.G * L.D; ++e) qf[e] = static_cast<float>(qt[e]) * L.scale;
      std::fill(acc.begin(), acc.end(), 0.f);
#if defined(__x86_64__)
      if (avx2 && L.D == 64) attend_avx2<T, 8>(qf.data(), kc, vc, rows, L, scores.data(), acc.data());
      else if (avx2) attend_avx2<T, 16>(qf.data(), kc, vc, rows, L, scores.data(), acc.data());
      else attend_scalar(qf.data(), kc, vc, rows, L, scores.data(), acc.data());
#else
      attend_scalar(qf.data(), kc, vc, rows, L, scores.data(), acc.data());
#endif
      T* ot = op + (t * L.Hq + h * L.G) * L.D;
      for (int64_t g = 0; g < L.G; ++g) {
        float sum = 0.f;
        for (int64_t j = 0; j < count; ++j) sum += scores[g * count + j];
        const float inv = count ? 1.f / sum : 0.f;  // a token that sees nothing gets zeros
        for (int64_t d = 0; d < L.D; ++d) ot[g * L.D + d] = static_cast<T>(acc[g * L.D + d] * inv);
      }
    }
  });
}

#define CHECK_ARG(cond, ...) TORCH_CHECK_VALUE(cond, "paged_attention: ", __VA_ARGS__)

// Shapes and dtypes as the Python launchers check them (same messages), then the values a wrong table
// would turn into out-of-bounds reads: cu_seqlens, prefix lengths and every block id in use.
Layout check_args(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& bt,
                  const at::Tensor& cu, const at::Tensor& pl, const c10::optional<at::Tensor>& tm) {
  CHECK_ARG(q.dim() == 3, "q must be [T, Hq, D], got shape ", q.sizes());
  CHECK_ARG(kc.dim() == 4 && kc.sizes() == vc.sizes(),
            "k_cache/v_cache must both be [num_blocks, block_size, Hkv, D], got ", kc.sizes(), " and ", vc.sizes());
  const auto dt = q.scalar_type();
  CHECK_ARG((dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16) && kc.scalar_type() == dt &&
                vc.scalar_type() == dt,
            "q, k_cache, v_cache must share one of (float32, float16, bfloat16), got ", dt, ", ",
            kc.scalar_type(), ", ", vc.scalar_type());
  CHECK_ARG(kc.size(3) == q.size(2), "head_dim mismatch: q has ", q.size(2), ", cache has ", kc.size(3));
  CHECK_ARG(q.size(1) % kc.size(2) == 0, "Hq=", q.size(1), " must be a multiple of Hkv=", kc.size(2));
  CHECK_ARG(bt.dim() == 2 && bt.scalar_type() == at::kInt,
            "block_tables must be int32 [B, max_blocks], got ", bt.scalar_type(), " ", bt.sizes());
  const int64_t B = bt.size(0);
  CHECK_ARG(cu.scalar_type() == at::kInt && cu.dim() == 1 && cu.size(0) == B + 1,
            "cu_seqlens_q must be int32 [B + 1] = [", B + 1, "], got ", cu.scalar_type(), " ", cu.sizes());
  CHECK_ARG(pl.scalar_type() == at::kInt && pl.dim() == 1 && pl.size(0) == B,
            "prefix_lens must be int32 [B] = [", B, "], got ", pl.scalar_type(), " ", pl.sizes());
  if (tm) {
    CHECK_ARG(tm->scalar_type() == at::kInt && tm->dim() == 2 && tm->size(0) == q.size(0),
              "tree_mask must be int32 [T=", q.size(0), ", W], got ", tm->scalar_type(), " ", tm->sizes());
  }
  for (const at::Tensor* t : {&q, &kc, &vc, &bt, &cu, &pl}) {
    CHECK_ARG(t->device().is_cpu(), "all tensors must be on the CPU for this kernel, got ", t->device());
  }
  CHECK_ARG(kc.is_contiguous() && vc.is_contiguous(), "k_cache and v_cache must be contiguous");
  return Layout{q.size(0), q.size(1), kc.size(2), q.size(2), q.size(1) / kc.size(2), kc.size(1), bt.size(1),
                tm ? tm->size(1) : 0, 0.f};
}

void check_values(const int32_t* cu, const int32_t* prefix, const int32_t* tables, int64_t B,
                  int64_t num_blocks, const Layout& L) {
  CHECK_ARG(cu[0] == 0 && cu[B] == L.T, "cu_seqlens_q must run from 0 to T=", L.T, ", got ", cu[0], "..", cu[B]);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = cu[b + 1] - cu[b], len = prefix[b] + n;
    CHECK_ARG(n >= 0 && prefix[b] >= 0, "sequence ", b, " has ", n, " new and ", prefix[b], " cached tokens");
    CHECK_ARG(len <= L.max_blocks * L.block_size, "sequence ", b, " spans ", len, " tokens but its table holds ",
              L.max_blocks * L.block_size);
    CHECK_ARG(!L.mask_words || n <= 32 * L.mask_words, "sequence ", b, " has ", n,
              " new tokens but tree_mask rows hold ", 32 * L.mask_words, " bits");
    for (int64_t k = 0; k < (len + L.block_size - 1) / L.block_size; ++k) {
      const int32_t id = tables[b * L.max_blocks + k];
      CHECK_ARG(id >= 0 && id < num_blocks, "block_tables[", b, ", ", k, "] = ", id, " is not a block of the cache");
    }
  }
}

at::Tensor paged_attention_cpu(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const at::Tensor& block_tables_in, const at::Tensor& cu_in,
                               const at::Tensor& prefix_in, const c10::optional<at::Tensor>& tree_mask_in,
                               c10::optional<double> scale) {
  Layout L = check_args(q_in, k_cache, v_cache, block_tables_in, cu_in, prefix_in, tree_mask_in);
  L.scale = scale ? static_cast<float>(*scale) : 1.f / std::sqrt(static_cast<float>(L.D));
  const at::Tensor q = q_in.contiguous(), bt = block_tables_in.contiguous(), cu_t = cu_in.contiguous(),
                   pl_t = prefix_in.contiguous();
  const at::Tensor tm = tree_mask_in ? tree_mask_in->contiguous() : at::Tensor();
  const int64_t B = bt.size(0);
  const int32_t *cu = cu_t.data_ptr<int32_t>(), *prefix = pl_t.data_ptr<int32_t>(), *tables = bt.data_ptr<int32_t>();
  check_values(cu, prefix, tables, B, k_cache.size(0), L);
  std::vector<int64_t> seq_of(L.T);
  for (int64_t b = 0; b < B; ++b) std::fill(seq_of.begin() + cu[b], seq_of.begin() + cu[b + 1], b);
  at::Tensor out = at::empty_like(q);
  const int32_t* mask = tm.defined() ? tm.data_ptr<int32_t>() : nullptr;
  switch (q.scalar_type()) {  // the three dtypes check_args admits
    case at::kFloat: run<float>(q, k_cache, v_cache, tables, seq_of, cu, prefix, mask, L, out); break;
    case at::kBFloat16: run<c10::BFloat16>(q, k_cache, v_cache, tables, seq_of, cu, prefix, mask, L, out); break;
    default: run<c10::Half>(q, k_cache, v_cache, tables, seq_of, cu, prefix, mask, L, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(eagle, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor cu_seqlens_q,"
        " Tensor prefix_lens, Tensor? tree_mask=None, float? scale=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(eagle, CPU, m) {
  m.impl("paged_attention", &paged_attention_cpu);
}
