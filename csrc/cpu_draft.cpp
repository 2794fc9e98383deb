// An EAGLE-3 head's top-1 draft chain in one call, for CPU rounds (engine/spec_eagle.py drafts chains this way):
// feed the pending pairs (the head's projection of the target's features, one head step over them), then draft
// a level at a time, each level the draft vocabulary's argmax over the newest node's logits, fed back as one
// more head step while the chain goes on. Every piece is the kernel the per-op head forward calls (embedding,
// rms_norm, the linears, decoder_layers, max, logsumexp), in its order, so the chain is bit-identical to that
// forward's; what goes away is the host time between the pieces (~30 Python launches and a metadata copy a
// level, about as long as streaming the head's weights).
//
// weights: [fc, embed, input_norm, hidden_norm, qkv, o, post_norm, gate_up, down, norm, lm_head]; formats: those
// of [fc, embed, qkv, o, gate_up, down, lm_head] (0: a bf16 [N, K] weight; 3 / 8: Q4_1 / Q8_0 blocks in
// eagle_kernels.quant's layout). The feed: rows slot_mapping [T] of features [slots, R] are the pending pairs'
// raw features, ids [T] their tokens, positions [T] their cache positions; cu_seqlens_q [B + 1] (every sequence
// feeds at least its root pair, its last), prefix_lens [B], block_tables [B, W] as paged_attention's, for the
// head's cache kv = [k_cache, v_cache]. cos, sin: [P, D] rope tables (rows taken, then widened to fp32). max_levels[b]: the most drafts of
// sequence b; with a finite log_floor a chain also ends before its first draft whose cumulative log-probability
// is below it. temperatures[b] > 0 (with keys[b], firsts[b]: the row's sampling key and the index of its depth-1
// draft's token) makes row b's drafts keyed draws instead of argmaxes (its score then the drawn token's).
// -> the chains as engine/trees.py's Tree fields: tokens int64 [B, 1 + N] (the root token then the
// drafts, as target ids: id + d2t[id]), parents and depths int32 [B, 1 + N] (node j: j - 1 and j; padding -1
// and 0), scores fp32 zeros, sizes int32 [B] (1 + the drafts each sequence keeps; N the most kept).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "cpu_ops.h"
#include "cpu_vec.h"

namespace {

enum Weight { kFc, kEmbed, kInputNorm, kHiddenNorm, kQkv, kO, kPostNorm, kGateUp, kDown, kNorm, kLmHead, kWeights };
enum Format { kFcFormat, kEmbedFormat, kQkvFormat, kOFormat, kGateUpFormat, kDownFormat, kLmHeadFormat, kFormats };

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, int64_t format) {
  return format == 0 ? eagle::cpu::linear_dense(x, w) : eagle::cpu::linear_q(x, w, format);
}

struct Head {
  at::TensorList w;
  at::IntArrayRef f;
  double eps;
  const at::Tensor &cos, &sin;
  at::TensorList kv;
  int64_t num_q_heads;
  std::vector<at::Tensor> stack;  // decoder_layers' weights: the layer, its post norm standing in for the unused norms
  std::vector<int64_t> formats;

  Head(at::TensorList w, at::IntArrayRef f, double eps, const at::Tensor& cos, const at::Tensor& sin, at::TensorList kv,
       int64_t num_q_heads)
      : w(w), f(f), eps(eps), cos(cos), sin(sin), kv(kv), num_q_heads(num_q_heads),
        stack{w[kPostNorm], w[kQkv], w[kO], w[kPostNorm], w[kGateUp], w[kDown], w[kPostNorm]},
        formats{f[kQkvFormat], f[kOFormat], f[kGateUpFormat], f[kDownFormat]} {}

  // One head step over rows (ids, hidden, positions): hidden [rows, H] (a buffer of draft_chain's) updated in place
  // to the layer's output. The layer's input row is [rms_norm(embedding), rms_norm(hidden)], each half normed in
  // place by the row kernel rms_norm runs (the same bits as two rms_norm ops and a cat, without their three tensors
  // and dispatches, each slow right after the target's step). With quantized weights nothing is allocated: the
  // temporaries live in the thread's buffers.
  void step(const at::Tensor& ids, at::Tensor& hidden, const at::Tensor& positions, const at::Tensor& slot_mapping,
            const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q, const at::Tensor& prefix_lens) const {
    using eagle::cpu::Buffer;
    using eagle::cpu::thread_buffer;
    const int64_t T = hidden.size(0), H = hidden.size(1);
    at::Tensor emb;
    if (f[kEmbedFormat] == 0) {
      emb = w[kEmbed].index_select(0, ids);
    } else {
      emb = thread_buffer(Buffer::kDraftEmbedding, {T, H}, at::kBFloat16);
      eagle::cpu::embedding_q_into(ids, w[kEmbed], f[kEmbedFormat], emb);
    }
    const at::Tensor in_norm = w[kInputNorm].contiguous(), hidden_norm = w[kHiddenNorm].contiguous();
    const at::Tensor x = thread_buffer(Buffer::kDraftInput, {T, 2 * H}, at::kBFloat16);           // [T, 2H]
    for (int64_t t = 0; t < T; ++t) {
      at::BFloat16* row = x.data_ptr<at::BFloat16>() + t * 2 * H;
      eagle::cpu::rms_norm_rows(emb.data_ptr<at::BFloat16>() + t * H, in_norm.data_ptr<at::BFloat16>(), nullptr, row,
                                1, H, static_cast<float>(eps));
      eagle::cpu::rms_norm_rows(hidden.data_ptr<at::BFloat16>() + t * H, hidden_norm.data_ptr<at::BFloat16>(),
                                nullptr, row + H, 1, H, static_cast<float>(eps));
    }
    const auto [c, s] = rope_rows(positions);
    at::Tensor unused = thread_buffer(Buffer::kDraftOut, {T, H}, at::kBFloat16);  // the stack's final norm, not needed
    eagle::cpu::decoder_layers_into(hidden, stack, formats, eps, c, s, kv, slot_mapping, block_tables, cu_seqlens_q,
                                    prefix_lens, c10::nullopt, num_q_heads, {}, c10::nullopt, x, unused);
  }

  // The rope tables' rows of `positions`, widened to fp32 [T, D] each (the values index_select and a cast to fp32
  // give), in the thread's buffer.
  std::pair<at::Tensor, at::Tensor> rope_rows(const at::Tensor& positions) const {
    if (cos.scalar_type() != sin.scalar_type() || !cos.is_contiguous() || !sin.is_contiguous())
      return {cos.index_select(0, positions).to(at::kFloat), sin.index_select(0, positions).to(at::kFloat)};
    const at::Tensor pos = positions.contiguous();
    const bool wide = pos.scalar_type() == at::kLong;
    const int64_t T = pos.numel(), D = cos.size(1);
    at::Tensor rows = eagle::cpu::thread_buffer(eagle::cpu::Buffer::kDraftRope, {2, T, D}, at::kFloat);
    float* out = rows.data_ptr<float>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, cos.scalar_type(), "draft_chain_rope", [&] {
      for (int64_t t = 0; t < T; ++t) {
        const int64_t p = wide ? pos.data_ptr<int64_t>()[t] : pos.data_ptr<int32_t>()[t];
        TORCH_CHECK_VALUE(p >= 0 && p < cos.size(0), "draft_chain: position ", p, " is outside the rope table's ",
                          cos.size(0), " rows");
        const scalar_t *c = cos.data_ptr<scalar_t>() + p * D, *s = sin.data_ptr<scalar_t>() + p * D;
        for (int64_t i = 0; i < D; ++i) {
          out[t * D + i] = static_cast<float>(c[i]);
          out[(T + t) * D + i] = static_cast<float>(s[i]);
        }
      }
    });
    return {rows[0], rows[1]};
  }

  // [rows, Vd], in the LM head's output dtype (bf16); quantized, in the thread's buffer
  at::Tensor logits(const at::Tensor& out) const {
    using eagle::cpu::Buffer;
    using eagle::cpu::thread_buffer;
    if (f[kLmHeadFormat] == 0 || out.scalar_type() != at::kBFloat16 || !out.is_contiguous() ||
        w[kNorm].scalar_type() != at::kBFloat16)
      return linear(eagle::cpu::rms_norm(out, w[kNorm], eps, c10::nullopt), w[kLmHead], f[kLmHeadFormat]);
    const int64_t B = out.size(0), H = out.size(1);
    const at::Tensor norm = w[kNorm].contiguous();
    TORCH_CHECK_VALUE(norm.numel() == H, "draft_chain: the head's norm must be [", H, "]");
    at::Tensor normed = thread_buffer(Buffer::kDraftNormed, {B, H}, at::kBFloat16);
    eagle::cpu::rms_norm_rows(out.data_ptr<at::BFloat16>(), norm.data_ptr<at::BFloat16>(), nullptr,
                              normed.data_ptr<at::BFloat16>(), B, H, static_cast<float>(eps));
    at::Tensor y = thread_buffer(Buffer::kDraftLogits, {B, w[kLmHead].size(0) * 16}, at::kBFloat16);
    eagle::cpu::linear_q_into(normed, w[kLmHead], f[kLmHeadFormat], y);
    return y;
  }
};

// One row's largest value and the index of its first occurrence, or of its first NaN.
template <typename T>
void top1_row_scalar(const T* x, int64_t V, float* best, int64_t* top) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t arg = 0;
  for (int64_t i = 0; i < V; ++i) {
    const float v = static_cast<float>(x[i]);
    if (std::isnan(v)) {
      m = v, arg = i;
      break;
    }
    if (v > m) m = v, arg = i;
  }
  *best = m, *top = arg;
}

#if defined(__x86_64__)
// top1_row_scalar's answer in two vector passes: the largest value (and whether any is NaN: then the scalar
// scan, which stops at the first), then the first index holding it. The first maximum is the first index
// comparing equal to the largest value (-0 and +0 compare equal, as v > m never prefers the later one).
template <typename T>
EAGLE_AVX2 void top1_row_avx2(const T* x, int64_t V, float* best, int64_t* top) {
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), unordered = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) {
    const __m256 v = eagle::cpu::load8(x + i);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    m = _mm256_max_ps(m, v);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float mx = *std::max_element(lanes, lanes + 8);
  bool nan = _mm256_movemask_ps(unordered) != 0;
  for (int64_t j = i; j < V; ++j) {
    const float v = static_cast<float>(x[j]);
    nan = nan || std::isnan(v);
    mx = std::max(mx, v);
  }
  if (nan) return top1_row_scalar(x, V, best, top);
  const __m256 target = _mm256_set1_ps(mx);
  int64_t arg = 0;
  for (i = 0; i + 8 <= V; i += 8) {
    const int mask = _mm256_movemask_ps(_mm256_cmp_ps(eagle::cpu::load8(x + i), target, _CMP_EQ_OQ));
    if (mask) break;
  }
  for (arg = i; arg < V && static_cast<float>(x[arg]) != mx; ++arg) {
  }
  *best = static_cast<float>(x[arg]), *top = arg;
}
#endif

// Row b's largest logit as fp32 (best[b]) and its index (top[b]), as at::max over the fp32 logits picks them:
// the first of equal maxima, the first NaN if there is one. In place of at::max and a widened copy of the
// logits: two ATen calls a level whose dispatch cost more than the scan, run cold after the target's step.
template <typename T>
void top1_rows(const at::Tensor& logits, float* best, int64_t* top) {
  const int64_t B = logits.size(0), V = logits.size(1);
  const T* x = logits.data_ptr<T>();
  for (int64_t b = 0; b < B; ++b, x += V) {
#if defined(__x86_64__)
    if (eagle::cpu::has_avx2() && V > 0) {
      top1_row_avx2(x, V, best + b, top + b);
      continue;
    }
#endif
    top1_row_scalar(x, V, best + b, top + b);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> draft_chain(const at::Tensor& features, const at::Tensor& ids,
                                               const at::Tensor& positions, const at::Tensor& slot_mapping,
                                               const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q,
                                               const at::Tensor& prefix_lens, at::IntArrayRef max_levels,
                                               double log_floor, at::TensorList weights, at::IntArrayRef formats,
                                               const at::Tensor& d2t, double eps, const at::Tensor& cos,
                                               const at::Tensor& sin, at::TensorList kv, int64_t num_q_heads,
                                               at::IntArrayRef keys, at::IntArrayRef firsts,
                                               at::ArrayRef<double> temperatures) {
  TORCH_CHECK_VALUE(weights.size() == kWeights && formats.size() == kFormats,
                    "draft_chain: weights must hold 11 tensors and formats 7, got ", weights.size(), " and ",
                    formats.size());
  TORCH_CHECK_VALUE(kv.size() == 2 && kv[0].dim() == 4, "draft_chain: kv must be the head's [k_cache, v_cache]");
  TORCH_CHECK_VALUE(cu_seqlens_q.dim() == 1 && cu_seqlens_q.size(0) >= 2 && cu_seqlens_q.scalar_type() == at::kInt,
                    "draft_chain: cu_seqlens_q must be int32 [B + 1], B >= 1");
  const int64_t B = cu_seqlens_q.size(0) - 1, T = ids.numel();
  TORCH_CHECK_VALUE(static_cast<int64_t>(max_levels.size()) == B, "draft_chain: max_levels must hold ", B, " values");
  const bool keyed = !temperatures.empty();
  TORCH_CHECK_VALUE(!keyed || (static_cast<int64_t>(temperatures.size()) == B &&
                               static_cast<int64_t>(keys.size()) == B && static_cast<int64_t>(firsts.size()) == B),
                    "draft_chain: temperatures, keys and firsts must hold ", B, " values each (or none)");
  TORCH_CHECK_VALUE(block_tables.dim() == 2 && block_tables.size(0) == B && block_tables.scalar_type() == at::kInt &&
                        block_tables.is_contiguous(), "draft_chain: block_tables must be a contiguous int32 [", B, ", W]");
  TORCH_CHECK_VALUE(positions.dim() == 1 && positions.numel() == T && ids.dim() == 1,
                    "draft_chain: ids and positions must be [T] vectors of one length");
  TORCH_CHECK_VALUE(cos.dim() == 2 && sin.sizes() == cos.sizes() && at::isFloatingType(cos.scalar_type()),
                    "draft_chain: cos and sin must be floating [P, D] tables");
  const at::Tensor cu = cu_seqlens_q.contiguous(), pos = positions.to(at::kLong).contiguous();
  const int32_t* cup = cu.data_ptr<int32_t>();
  TORCH_CHECK_VALUE(cup[0] == 0 && cup[B] == T, "draft_chain: cu_seqlens_q must run from 0 to T = ", T);
  std::vector<int64_t> root_rows(B);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(cup[b + 1] > cup[b], "draft_chain: every sequence must feed at least its root pair (sequence ",
                      b, " feeds none)");
    TORCH_CHECK_VALUE(max_levels[b] >= 0, "draft_chain: max_levels must be >= 0, got ", max_levels[b]);
    root_rows[b] = cup[b + 1] - 1;
  }
  const Head head(weights, formats, eps, cos, sin, kv, num_q_heads);
  const at::Tensor d2t_host = d2t.to(at::kLong).contiguous();
  // The residual stream [T, H]: the projected features, then each step's output in place (its own tensor where the
  // fc weight is dense, else the thread's buffer).
  const at::Tensor raw = features.index_select(0, slot_mapping);
  at::Tensor out;
  if (formats[kFcFormat] == 0 || raw.scalar_type() != at::kBFloat16) {
    out = linear(raw, weights[kFc], formats[kFcFormat]).contiguous();
  } else {
    out = eagle::cpu::thread_buffer(eagle::cpu::Buffer::kDraftHidden, {T, weights[kFc].size(0) * 16}, at::kBFloat16);
    eagle::cpu::linear_q_into(raw, weights[kFc], formats[kFcFormat], out);
  }
  head.step(ids, out, positions, slot_mapping, block_tables, cu, prefix_lens);
  if (T != B) out = out.index_select(0, at::tensor(root_rows, at::kLong));  // the roots' rows (T == B: all of them)
  std::vector<int64_t> lengths(max_levels.begin(), max_levels.end());
  const int64_t levels = *std::max_element(lengths.begin(), lengths.end());
  // The chains, written in place: column 0 the roots' tokens, column d the depth-d drafts (as target ids).
  at::Tensor tokens = at::empty({B, levels + 1}, at::kLong);
  int64_t* tok = tokens.data_ptr<int64_t>();
  const at::Tensor ids_c = ids.contiguous();
  for (int64_t b = 0; b < B; ++b)
    tok[b * (levels + 1)] = ids_c.scalar_type() == at::kLong ? ids_c.data_ptr<int64_t>()[root_rows[b]]
                                                             : ids_c.data_ptr<int32_t>()[root_rows[b]];
  // A level's step: one new token per sequence at position root + d - 1 (d >= 2), its slot by the block table.
  const int64_t block_size = kv[0].size(1), scratch = kv[0].size(0) - 1, W = block_tables.size(1);
  const int32_t* table = block_tables.data_ptr<int32_t>();
  const int64_t* root_pos = pos.data_ptr<int64_t>();
  at::Tensor step_ids = at::empty({B}, at::kLong), step_pos = at::empty({B}, at::kLong),
             step_slots = at::empty({B}, at::kLong), step_cu = at::arange(B + 1, at::kInt),
             step_prefix = at::empty({B}, at::kInt), best = at::empty({B}, at::kFloat);
  std::vector<int64_t> top(B);
  at::Tensor score = at::zeros({B}, at::kFloat);
  const int64_t* map = d2t_host.data_ptr<int64_t>();
  // Sampled rows draw their drafts keyed, as the target draws (eagle_kernels.sample_keyed): the draft's logits at
  // the row's temperature, under the noise of the draft's target id at its position.
  const at::Tensor target_ids = keyed ? at::arange(d2t_host.size(0), at::kLong) + d2t_host : at::Tensor();
  for (int64_t d = 1; d <= levels; ++d) {
    if (d > 1) {
      for (int64_t b = 0; b < B; ++b) {
        const int64_t p = root_pos[root_rows[b]] + d - 1, blk = p / block_size;
        TORCH_CHECK_VALUE(p < cos.size(0), "draft_chain: position ", p, " is past the rope table's ", cos.size(0));
        const int64_t block = blk < W ? table[b * W + blk] : scratch;
        TORCH_CHECK_VALUE(block >= 0 && block <= scratch, "draft_chain: block_tables[", b, "] holds block ", block,
                          " outside the cache's ", scratch + 1);
        step_ids.data_ptr<int64_t>()[b] = tok[b * (levels + 1) + d - 1];
        step_pos.data_ptr<int64_t>()[b] = p;
        step_slots.data_ptr<int64_t>()[b] = block * block_size + p % block_size;
        step_prefix.data_ptr<int32_t>()[b] = static_cast<int32_t>(p);
      }
      head.step(step_ids, out, step_pos, step_slots, block_tables, step_cu, step_prefix);
    }
    const at::Tensor logits = head.logits(out);                                            // [B, Vd]
    if (logits.scalar_type() == at::kBFloat16) top1_rows<at::BFloat16>(logits, best.data_ptr<float>(), top.data());
    else top1_rows<float>(logits.to(at::kFloat), best.data_ptr<float>(), top.data());
    for (int64_t b = 0; keyed && b < B; ++b) {
      if (!(temperatures[b] > 0)) continue;
      const at::Tensor row = logits[b].to(at::kFloat).contiguous();
      top[b] = eagle::cpu::keyed_draw(row.data_ptr<float>(), row.size(0), keys[b], firsts[b] + d - 1,
                                      static_cast<float>(temperatures[b]), target_ids.data_ptr<int64_t>());
      best.data_ptr<float>()[b] = row.data_ptr<float>()[top[b]];
    }
    for (int64_t b = 0; b < B; ++b)  // the draft vocabulary's id -> the target's
      tok[b * (levels + 1) + d] = top[b] + map[top[b]];
    bool more = false;
    if (std::isfinite(log_floor)) {
      score = score + (best - at::logsumexp(logits.to(at::kFloat), {1}));
      const at::Tensor ok = at::ge(score, log_floor);
      const bool* okp = ok.data_ptr<bool>();
      for (int64_t b = 0; b < B; ++b) {
        if (lengths[b] >= d && !okp[b]) lengths[b] = d - 1;
      }
    }
    for (int64_t b = 0; b < B; ++b) more = more || lengths[b] > d;
    if (!more) break;
  }
  const int64_t N = *std::max_element(lengths.begin(), lengths.end());
  at::Tensor sizes = at::empty({B}, at::kInt), parents = at::empty({B, N + 1}, at::kInt),
             depths = at::empty({B, N + 1}, at::kInt);
  for (int64_t b = 0; b < B; ++b) {
    sizes.data_ptr<int32_t>()[b] = static_cast<int32_t>(lengths[b] + 1);
    for (int64_t j = 0; j <= N; ++j) {  // node j of a chain is at depth j, its parent j - 1; padding: 0 and -1
      const int32_t depth = j <= lengths[b] ? static_cast<int32_t>(j) : 0;
      depths.data_ptr<int32_t>()[b * (N + 1) + j] = depth;
      parents.data_ptr<int32_t>()[b * (N + 1) + j] = depth - 1;
    }
  }
  // Columns past N hold drafts no chain kept (a level drafted, then cut): a chain's nodes come first.
  return {N == levels ? tokens : tokens.narrow(1, 0, N + 1).contiguous(), parents, depths,
          at::zeros({B, N + 1}, at::kFloat), sizes};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(eagle, m) {
  m.def("draft_chain(Tensor features, Tensor ids, Tensor positions, Tensor slot_mapping, Tensor block_tables,"
        " Tensor cu_seqlens_q, Tensor prefix_lens, int[] max_levels, float log_floor, Tensor[] weights, int[] formats,"
        " Tensor d2t, float eps, Tensor cos, Tensor sin, Tensor(a!)[] kv, int num_q_heads, int[] keys=[],"
        " int[] firsts=[], float[] temperatures=[])"
        " -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(eagle, CPU, m) {
  m.impl("draft_chain", &draft_chain);
}
