// The CPU kernels behind the eagle ops, callable directly from C++ (the fused decoder stack calls them
// without the dispatcher). Contracts: DESIGN.md and the op files.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <tuple>
#include <vector>

namespace eagle::cpu {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                    const c10::optional<at::Tensor>& residual);
at::Tensor silu_and_mul(const at::Tensor& x);
at::Tensor rope_write_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                         at::Tensor& v_cache, const at::Tensor& slot_mapping, int64_t num_q_heads);
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q,
                           const at::Tensor& prefix_lens, const c10::optional<at::Tensor>& tree_mask,
                           c10::optional<double> scale);
at::Tensor linear_dense(const at::Tensor& x, const at::Tensor& w);
at::Tensor linear_q(const at::Tensor& x, const at::Tensor& w, int64_t qtype,
                    c10::optional<at::ScalarType> out_dtype = c10::nullopt);
// linear_q into y, a contiguous bf16 or fp32 CPU [M, N] (y's dtype is the output's)
void linear_q_into(const at::Tensor& x, const at::Tensor& w, int64_t qtype, at::Tensor& y);
at::Tensor embedding_q(const at::Tensor& ids, const at::Tensor& w, int64_t qtype, at::ScalarType dtype);
// embedding_q into out, a contiguous bf16 or fp32 CPU [T, K] (out's dtype is the output's)
void embedding_q_into(const at::Tensor& ids, const at::Tensor& w, int64_t qtype, at::Tensor& out);
at::Tensor argmax_rows(const at::Tensor& x);  // fp32 [..., V] -> int64 [...]: each row's first maximum (or NaN)
int64_t first_max(const float* x, int64_t V);  // one row's: the first maximum's index (or the first NaN's)
// Keyed draws (csrc/cpu_sample.cpp): the noise of (seed, position) at a temperature T > 0.
struct Keyed {
  uint32_t k0, k1;
  float t, inv_t;
  Keyed(int64_t seed, int64_t position, float temperature);
  // The exact score of token `id` with logit l: l / T - log(-log(u_id)), in double.
  double score(float logit, int64_t id) const;
  // c[i] = b[i] / T + an upper bound of token (ids[i], or i)'s noise for i in [begin, end), fp32 (c may be b):
  // where b[i] >= l[i], c[i] >= score(l[i]) - what reach() takes off.
  void bounds(const float* b, float* c, int64_t begin, int64_t end, const int64_t* ids) const;
  // The fp32 value a token's bound must reach to possibly score >= floor; margin: how far the b's may fall
  // short of the logits (0: exact).
  float reach(double floor, double margin) const;
};
// One keyed draw from logits l [V] at temperature T (<= 0: argmax_rows' rule): the column whose token (ids[i], or
// i) has the largest score l / T + g.
int64_t keyed_draw(const float* l, int64_t V, int64_t seed, int64_t position, float temperature, const int64_t* ids);
// The Llama decoder stack in one call (csrc/cpu_decoder.cpp; eagle_kernels/decoder.py has the contract).
std::tuple<at::Tensor, std::vector<at::Tensor>> decoder_layers(
    at::Tensor& hidden, at::TensorList weights, at::IntArrayRef formats, double eps, const at::Tensor& cos,
    const at::Tensor& sin, at::TensorList kv, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& cu_seqlens_q, const at::Tensor& prefix_lens, const c10::optional<at::Tensor>& tree_mask,
    int64_t num_q_heads, at::IntArrayRef capture, const c10::optional<at::Tensor>& capture_into,
    const c10::optional<at::Tensor>& first_input);
// The same, with the final norm written into `final_out` (a contiguous bf16 [T, H], a thread_buffer view, say) and
// returned: where the stack runs in one region (quantized weights), a step that allocates nothing once warm.
std::tuple<at::Tensor, std::vector<at::Tensor>> decoder_layers_into(
    at::Tensor& hidden, at::TensorList weights, at::IntArrayRef formats, double eps, const at::Tensor& cos,
    const at::Tensor& sin, at::TensorList kv, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& cu_seqlens_q, const at::Tensor& prefix_lens, const c10::optional<at::Tensor>& tree_mask,
    int64_t num_q_heads, at::IntArrayRef capture, const c10::optional<at::Tensor>& capture_into,
    const c10::optional<at::Tensor>& first_input, at::Tensor& final_out);

// The calling thread's grow-only buffer `slot` seen as a contiguous [sizes] tensor of `dtype` (contents undefined,
// 64-byte aligned): a step's temporaries without an allocation once the buffer has grown to them. Valid until the
// thread asks for the same slot again, so a view never leaves the op that took it. Past 4 MB (a long prompt's
// chunk) a tensor of its own instead, so a thread keeps no more than a few decode steps' worth.
enum class Buffer { kStack, kStackQ, kDraftHidden, kDraftEmbedding, kDraftInput, kDraftRope, kDraftNormed,
                    kDraftLogits, kDraftOut, kCount };
at::Tensor thread_buffer(Buffer slot, at::IntArrayRef sizes, at::ScalarType dtype);

// ---- pieces of those ops, for callers that split a step's work among their own threads (decoder_layers) ----
// None allocates or throws; each computes exactly what its op computes for the rows / columns / tasks given.

// paged_attention's work in size() parts (one per thread, of near-equal work, where the SIMD path runs; else one
// per new token and kv head): built once per step from the metadata (checked as paged_attention checks it,
// against k_cache's geometry); run() does parts [t0, t1) for any layer's caches of that geometry.
class AttentionTasks {
 public:
  AttentionTasks(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q, const at::Tensor& prefix_lens,
                 const c10::optional<at::Tensor>& tree_mask, c10::optional<double> scale);
  int64_t size() const;
  void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, at::Tensor& out, int64_t t0,
           int64_t t1) const;

 private:
  struct Impl;
  std::shared_ptr<const Impl> impl_;
};

// rms_norm of `rows` bf16 rows [rows, H] into out, adding x into `residual` first when it is given.
void rms_norm_rows(const at::BFloat16* x, const at::BFloat16* weight, at::BFloat16* residual, at::BFloat16* out,
                   int64_t rows, int64_t H, float eps);
// silu_and_mul's columns [c0, c1) of every row: gate_up [rows, 2I] -> out [rows, I].
void silu_and_mul_columns(const at::BFloat16* gate_up, int64_t rows, int64_t I, int64_t c0, int64_t c1,
                          at::BFloat16* out);
// rope_write_kv for units [u0, u1) of T x (Hq + Hkv) (unit t * (Hq + Hkv) + h: q head h < Hq, else kv head
// h - Hq, whose k is rotated and v copied into the caches at slots[t]); cos, sin fp32 [T, D]; q out [T, Hq, D].
void rope_write_kv_units(const at::BFloat16* qkv, const float* cos, const float* sin, at::BFloat16* k_cache,
                         at::BFloat16* v_cache, const int64_t* slots, int64_t Hq, int64_t Hkv, int64_t D,
                         at::BFloat16* q, int64_t u0, int64_t u1);
// x [M, K] quantized as linear_q quantizes its input: int8 q [M, K] in blocks of 32 along K, per row and block
// the scale d, d * sum(q) (s) and sum(q) [M, K / 32].
struct QuantX {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> sum;
  int64_t K = 0, nb = 0;
};
// linear_q in two steps: x [M, K] quantized (into the calling thread's scratch, or into `xq` by parts), then the
// output columns of groups [g0, g1) (16 weight rows each) for every row, into y [M, N] (bf16), from the calling
// thread's scratch or from `xq`.
void quantize_activations(const at::BFloat16* x, int64_t M, int64_t K);
// Sizes xq for [M, K] (before threads fill it), then rows [r0, r1) x blocks [b0, b1) of x [M, K] into it: the same
// values quantize_activations gives them, so threads can share one quantization, each filling its part.
void quantize_reserve(QuantX& xq, int64_t M, int64_t K);
void quantize_part(const at::BFloat16* x, int64_t r0, int64_t r1, int64_t b0, int64_t b1, QuantX& xq);
void linear_q_groups(const uint8_t* w, int64_t qtype, int64_t M, int64_t N, int64_t g0, int64_t g1, at::BFloat16* y,
                     const QuantX* xq = nullptr);

}  // namespace eagle::cpu
