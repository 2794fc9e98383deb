// Fused per-layer ops for CPU decode: RMSNorm with the residual add, SiLU-and-mul, and RoPE + KV-cache
// write. At decode sizes each torch op costs more in dispatch than in arithmetic, and the unfused layer
// ran ~20 of them; each of these is one call.
//
// Math is fp32 with the rounding points of the Hugging Face Llama (and of the torch paths in
// eagle_kernels/layer_ops.py): for 16-bit dtypes the normalised hidden state is rounded before the
// weight multiply, and silu(gate) before the multiply by up.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "cpu_ops.h"
#include "cpu_vec.h"

namespace {

constexpr int64_t kRowsPerTask = 16;  // small steps run inline: a thread hand-off costs more than a row

template <typename T>
inline float round_trip(float v) {  // the value v takes when stored in T
  return static_cast<float>(static_cast<T>(v));
}

void check_rows(const at::Tensor& x, const char* op) {
  const auto dt = x.scalar_type();
  TORCH_CHECK_VALUE(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, op,
                    ": x must be float32, bfloat16 or float16, got ", dt);
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.device().is_cpu(), op, ": x must be a CPU tensor [..., H]");
}

// ---- rms_norm, one row: the residual sum stored in T first (as the unfused `h = h + x` does), the sum of
// squares in 8 lanes (lane l takes d = l, l + 8, ..., one FMA each) added in hsum8's order, then the
// normalised row, rounded to T (16-bit T) before the weight multiply. The scalar and AVX2 paths agree bit for bit.

inline float sum_of_squares_tail(const float* lanes_in, const float* v, int64_t from, int64_t H) {
  float lanes[8];
  std::copy(lanes_in, lanes_in + 8, lanes);
  for (int64_t d = from; d < H; ++d) lanes[d % 8] = std::fma(v[d - from], v[d - from], lanes[d % 8]);
  return ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
}

template <typename T>
void rms_norm_row_scalar(const T* x, const T* w, T* res, T* out, int64_t H, float eps) {
  if (res) {
    for (int64_t d = 0; d < H; ++d) res[d] = static_cast<T>(static_cast<float>(res[d]) + static_cast<float>(x[d]));
    x = res;
  }
  std::vector<float> v(H);
  for (int64_t d = 0; d < H; ++d) v[d] = static_cast<float>(x[d]);
  const float zeros[8] = {};
  const float inv = 1.f / std::sqrt(sum_of_squares_tail(zeros, v.data(), 0, H) / static_cast<float>(H) + eps);
  for (int64_t d = 0; d < H; ++d) {
    const float normed = v[d] * inv;
    out[d] = static_cast<T>(round_trip<T>(normed) * static_cast<float>(w[d]));
  }
}

#if defined(__x86_64__)
template <typename T>
EAGLE_AVX2 void rms_norm_row_avx2(const T* x, const T* w, T* res, T* out, int64_t H, float eps) {
  using namespace eagle::cpu;
  const int64_t body = H / 8 * 8;
  if (res) {
    for (int64_t d = 0; d < body; d += 8) store8(res + d, _mm256_add_ps(load8(res + d), load8(x + d)));
    for (int64_t d = body; d < H; ++d) res[d] = static_cast<T>(static_cast<float>(res[d]) + static_cast<float>(x[d]));
    x = res;
  }
  __m256 ss = _mm256_setzero_ps();
  for (int64_t d = 0; d < body; d += 8) {
    const __m256 v = load8(x + d);
    ss = _mm256_fmadd_ps(v, v, ss);
  }
  float lanes[8], tail[8];
  _mm256_storeu_ps(lanes, ss);
  for (int64_t d = body; d < H; ++d) tail[d - body] = static_cast<float>(x[d]);
  const float inv = 1.f / std::sqrt(sum_of_squares_tail(lanes, tail, body, H) / static_cast<float>(H) + eps);
  const __m256 vinv = _mm256_set1_ps(inv);
  for (int64_t d = 0; d < body; d += 8) {
    store8(out + d, _mm256_mul_ps(round_trip8(_mm256_mul_ps(load8(x + d), vinv), out), load8(w + d)));
  }
  for (int64_t d = body; d < H; ++d) {
    out[d] = static_cast<T>(round_trip<T>(static_cast<float>(x[d]) * inv) * static_cast<float>(w[d]));
  }
}
#endif

}  // namespace

namespace eagle::cpu {

// residual (when given) += x in place, then out = rms_norm(residual or x) * weight.
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight, double eps,
                    const c10::optional<at::Tensor>& residual) {
  check_rows(x_in, "rms_norm");
  const int64_t H = x_in.size(-1);
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == H && weight.scalar_type() == x_in.scalar_type(),
                    "rms_norm: weight must be [", H, "] of x's dtype, got ", weight.scalar_type(), " ", weight.sizes());
  if (residual) {
    TORCH_CHECK_VALUE(residual->sizes() == x_in.sizes() && residual->scalar_type() == x_in.scalar_type() &&
                          residual->is_contiguous(),
                      "rms_norm: residual must be a contiguous tensor of x's shape and dtype");
  }
  const at::Tensor x = x_in.contiguous(), w = weight.contiguous();
  at::Tensor out = at::empty_like(x);
  const int64_t rows = x.numel() / H;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_cpu", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* rp = residual ? residual->data_ptr<scalar_t>() : nullptr;
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kRowsPerTask, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        scalar_t* res = rp ? rp + r * H : nullptr;
#if defined(__x86_64__)
        if constexpr (!std::is_same_v<scalar_t, double>) {
          if (has_avx2()) {
            rms_norm_row_avx2(xp + r * H, wp, res, op + r * H, H, static_cast<float>(eps));
            continue;
          }
        }
#endif
        rms_norm_row_scalar(xp + r * H, wp, res, op + r * H, H, static_cast<float>(eps));
      }
    });
  });
  return out;
}

}  // namespace eagle::cpu

namespace {

template <typename T>
void silu_mul_row_scalar(const T* gate, const T* up, T* out, int64_t I, int64_t from) {
  for (int64_t d = from; d < I; ++d) {
    const float g = static_cast<float>(gate[d]);
    out[d] = static_cast<T>(round_trip<T>(g / (1.f + std::exp(-g))) * static_cast<float>(up[d]));
  }
}

#if defined(__x86_64__)
// The scalar loop spends ~8 ns an element in std::exp; this one evaluates 8 exps at once.
template <typename T>
EAGLE_AVX2 void silu_mul_row_avx2(const T* gate, const T* up, T* out, int64_t I) {
  using namespace eagle::cpu;
  int64_t d = 0;
  for (; d + 8 <= I; d += 8) {
    const __m256 g = load8(gate + d);
    const __m256 act = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
    store8(out + d, _mm256_mul_ps(round_trip8(act, gate), load8(up + d)));
  }
  silu_mul_row_scalar(gate, up, out, I, d);
}
#endif


#if defined(__x86_64__)
// RoPE of one head, 8 pairs at a time: the scalar loop's products and sums, unfused (as torch and the Triton
// kernel compute them; GCC would contract them into FMAs). -> pairs done.
template <typename T>
EAGLE_AVX2 __attribute__((optimize("fp-contract=off"))) int64_t rotate_avx2(const T* x, const float* c, const float* s, T* o, int64_t half) {
  using namespace eagle::cpu;
  for (int64_t d = 0; d < half; d += 8) {
    const __m256 a = load8(x + d), b = load8(x + d + half);
    store8(o + d, _mm256_sub_ps(_mm256_mul_ps(a, _mm256_loadu_ps(c + d)), _mm256_mul_ps(b, _mm256_loadu_ps(s + d))));
    store8(o + d + half, _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(c + d + half)),
                                       _mm256_mul_ps(a, _mm256_loadu_ps(s + d + half))));
  }
  return half;
}
#endif

template <typename T>
void rotate_head(const T* x, const float* c, const float* s, T* o, int64_t half) {
  int64_t d = 0;
#if defined(__x86_64__)
  if constexpr (!std::is_same_v<T, double>) {
    if (half % 8 == 0 && eagle::cpu::has_avx2()) d = rotate_avx2(x, c, s, o, half);
  }
#endif
  for (; d < half; ++d) {
    const float a = static_cast<float>(x[d]), b = static_cast<float>(x[d + half]);
    o[d] = static_cast<T>(a * c[d] - b * s[d]);
    o[d + half] = static_cast<T>(b * c[d + half] + a * s[d + half]);
  }
}

// One unit of rope_write_kv (see cpu_ops.h): a q head of token t, or a kv head's k (rotated) and v (copied).
template <typename T>
void rope_unit(const T* qkv, const float* cos, const float* sin, T* k_cache, T* v_cache, const int64_t* slots,
               int64_t Hq, int64_t Hkv, int64_t D, T* q, int64_t unit) {
  const int64_t t = unit / (Hq + Hkv), h = unit % (Hq + Hkv);
  const T* row = qkv + t * (Hq + 2 * Hkv) * D;
  const float *c = cos + t * D, *s = sin + t * D;
  if (h < Hq) return rotate_head(row + h * D, c, s, q + (t * Hq + h) * D, D / 2);
  T* k = k_cache + (slots[t] * Hkv + h - Hq) * D;
  rotate_head(row + h * D, c, s, k, D / 2);
  std::copy(row + (h + Hkv) * D, row + (h + Hkv + 1) * D, v_cache + (slots[t] * Hkv + h - Hq) * D);
}
}  // namespace

namespace eagle::cpu {

// x: [..., 2I] = [gate | up] -> silu(gate) * up: [..., I].
at::Tensor silu_and_mul(const at::Tensor& x_in) {
  check_rows(x_in, "silu_and_mul");
  TORCH_CHECK_VALUE(x_in.size(-1) % 2 == 0, "silu_and_mul: the last dim must be even, got ", x_in.size(-1));
  const at::Tensor x = x_in.contiguous();
  const int64_t I = x.size(-1) / 2, rows = x.numel() / (2 * I);
  auto shape = x.sizes().vec();
  shape.back() = I;
  at::Tensor out = at::empty(shape, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul_cpu", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kRowsPerTask, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t *gate = xp + r * 2 * I, *up = gate + I;
#if defined(__x86_64__)
        if constexpr (!std::is_same_v<scalar_t, double>) {
          if (eagle::cpu::has_avx2()) {
            silu_mul_row_avx2(gate, up, op + r * I, I);
            continue;
          }
        }
#endif
        silu_mul_row_scalar(gate, up, op + r * I, I, 0);
      }
    });
  });
  return out;
}

// qkv: [T, (Hq + 2 Hkv) * D] (q heads, k heads, v heads); cos, sin: [T, D] in the half-split layout.
// Rotates q and k, writes k and v to the cache slots, returns the rotated q [T, Hq, D].
at::Tensor rope_write_kv(const at::Tensor& qkv_in, const at::Tensor& cos_in, const at::Tensor& sin_in,
                         at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping,
                         int64_t num_q_heads) {
  check_rows(qkv_in, "rope_write_kv");
  TORCH_CHECK_VALUE(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                        v_cache.is_contiguous() && k_cache.scalar_type() == qkv_in.scalar_type() &&
                        v_cache.scalar_type() == qkv_in.scalar_type(),
                    "rope_write_kv: k_cache/v_cache must be contiguous [num_blocks, block_size, Hkv, D] of qkv's dtype");
  const int64_t T = qkv_in.size(0), Hkv = k_cache.size(2), D = k_cache.size(3), Hq = num_q_heads;
  const int64_t slots = k_cache.size(0) * k_cache.size(1);
  TORCH_CHECK_VALUE(qkv_in.dim() == 2 && qkv_in.size(1) == (Hq + 2 * Hkv) * D && D % 2 == 0,
                    "rope_write_kv: qkv must be [T, (Hq + 2 Hkv) * D] = [T, ", (Hq + 2 * Hkv) * D, "], got ",
                    qkv_in.sizes());
  TORCH_CHECK_VALUE(cos_in.sizes() == at::IntArrayRef({T, D}) && sin_in.sizes() == cos_in.sizes(),
                    "rope_write_kv: cos and sin must be [T, D] = [", T, ", ", D, "], got ", cos_in.sizes(), " and ",
                    sin_in.sizes());
  TORCH_CHECK_VALUE(slot_mapping.dim() == 1 && slot_mapping.size(0) == T &&
                        (slot_mapping.scalar_type() == at::kLong || slot_mapping.scalar_type() == at::kInt),
                    "rope_write_kv: slot_mapping must be int64 or int32 [T]");
  const at::Tensor qkv = qkv_in.contiguous(), slot = slot_mapping.to(at::kLong).contiguous();
  const at::Tensor cos = cos_in.to(at::kFloat).contiguous(), sin = sin_in.to(at::kFloat).contiguous();
  const int64_t* sp = slot.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK_VALUE(sp[t] >= 0 && sp[t] < slots, "rope_write_kv: slot_mapping[", t, "] = ", sp[t],
                      " is outside the cache's ", slots, " slots");
  }
  at::Tensor q = at::empty({T, Hq, D}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_write_kv_cpu", [&] {
    const scalar_t* xp = qkv.data_ptr<scalar_t>();
    const float *cp = cos.data_ptr<float>(), *snp = sin.data_ptr<float>();
    scalar_t *qp = q.data_ptr<scalar_t>(), *kp = k_cache.data_ptr<scalar_t>(), *vp = v_cache.data_ptr<scalar_t>();
    at::parallel_for(0, T * (Hq + Hkv), kRowsPerTask * (Hq + Hkv), [&](int64_t u0, int64_t u1) {
      for (int64_t u = u0; u < u1; ++u) rope_unit(xp, cp, snp, kp, vp, sp, Hq, Hkv, D, qp, u);
    });
  });
  return q;
}

void rms_norm_rows(const at::BFloat16* x, const at::BFloat16* weight, at::BFloat16* residual, at::BFloat16* out,
                   int64_t rows, int64_t H, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    at::BFloat16* res = residual ? residual + r * H : nullptr;
#if defined(__x86_64__)
    if (has_avx2()) {
      rms_norm_row_avx2(x + r * H, weight, res, out + r * H, H, eps);
      continue;
    }
#endif
    rms_norm_row_scalar(x + r * H, weight, res, out + r * H, H, eps);
  }
}

// c0 and c1 multiples of 8 (or c1 = I): each column then takes the path (SIMD or scalar exp) it takes in the op.
void silu_and_mul_columns(const at::BFloat16* gate_up, int64_t rows, int64_t I, int64_t c0, int64_t c1,
                          at::BFloat16* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const at::BFloat16 *gate = gate_up + r * 2 * I + c0, *up = gate + I;
    at::BFloat16* o = out + r * I + c0;
#if defined(__x86_64__)
    if (has_avx2()) {
      silu_mul_row_avx2(gate, up, o, c1 - c0);
      continue;
    }
#endif
    silu_mul_row_scalar(gate, up, o, c1 - c0, 0);
  }
}

void rope_write_kv_units(const at::BFloat16* qkv, const float* cos, const float* sin, at::BFloat16* k_cache,
                         at::BFloat16* v_cache, const int64_t* slots, int64_t Hq, int64_t Hkv, int64_t D,
                         at::BFloat16* q, int64_t u0, int64_t u1) {
  for (int64_t u = u0; u < u1; ++u) rope_unit(qkv, cos, sin, k_cache, v_cache, slots, Hq, Hkv, D, q, u);
}

}  // namespace eagle::cpu

namespace {

// "" when every entry of the int32/int64 CPU vector `index` lies in [0, limit), else the first that does
// not (as "<name>[i] = v is outside the cache's <limit> slots"); never throws.
std::string index_errors(const at::Tensor& index, int64_t limit, c10::string_view name) {
  const auto dt = index.scalar_type();
  if (index.dim() != 1 || !index.is_cpu() || (dt != at::kLong && dt != at::kInt)) {
    return c10::str(name, " must be an int64 or int32 CPU vector");
  }
  const at::Tensor idx = index.to(at::kLong).contiguous();
  const int64_t* p = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < idx.numel(); ++i) {
    if (p[i] < 0 || p[i] >= limit) return c10::str(name, "[", i, "] = ", p[i], " is outside the cache's ", limit, " slots");
  }
  return {};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(eagle, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!)? residual=None) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rope_write_kv(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache,"
        " Tensor slot_mapping, int num_q_heads) -> Tensor");
  m.def("index_errors(Tensor index, int limit, str name) -> str");
}

TORCH_LIBRARY_IMPL(eagle, CPU, m) {
  m.impl("rms_norm", &eagle::cpu::rms_norm);
  m.impl("silu_and_mul", &eagle::cpu::silu_and_mul);
  m.impl("rope_write_kv", &eagle::cpu::rope_write_kv);
}

// Every backend: values are read only from a CPU tensor.
TORCH_LIBRARY_IMPL(eagle, CompositeImplicitAutograd, m) {
  m.impl("index_errors", &index_errors);
}
