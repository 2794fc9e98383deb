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
// is below it. -> the chains as engine/trees.py's Tree fields: tokens int64 [B, 1 + N] (the root token then the
// drafts, as target ids: id + d2t[id]), parents and depths int32 [B, 1 + N] (node j: j - 1 and j; padding -1
// and 0), scores fp32 zeros, sizes int32 [B] (1 + the drafts each sequence keeps; N the most kept).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu_ops.h"

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

  // One head step over rows (ids, hidden, positions) -> the layer's output [rows, H].
  at::Tensor step(const at::Tensor& ids, const at::Tensor& hidden, const at::Tensor& positions,
                  const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q,
                  const at::Tensor& prefix_lens) const {
    const at::Tensor emb = f[kEmbedFormat] == 0 ? w[kEmbed].index_select(0, ids)
                                                : eagle::cpu::embedding_q(ids, w[kEmbed], f[kEmbedFormat], at::kBFloat16);
    const at::Tensor x = at::cat({eagle::cpu::rms_norm(emb, w[kInputNorm], eps, c10::nullopt),
                                  eagle::cpu::rms_norm(hidden, w[kHiddenNorm], eps, c10::nullopt)}, 1);
    at::Tensor out = hidden.clone();  // the residual stream, updated in place to the layer's output
    eagle::cpu::decoder_layers(out, stack, formats, eps, cos.index_select(0, positions).to(at::kFloat),
                               sin.index_select(0, positions).to(at::kFloat), kv, slot_mapping, block_tables, cu_seqlens_q, prefix_lens, c10::nullopt, num_q_heads, {},
                               c10::nullopt, x);
    return out;
  }

  at::Tensor logits(const at::Tensor& out) const {  // [rows, Vd], in the LM head's output dtype (bf16)
    return linear(eagle::cpu::rms_norm(out, w[kNorm], eps, c10::nullopt), w[kLmHead], f[kLmHeadFormat]);
  }
};

// Row b's largest logit as fp32 (best[b]) and its index (top[b]), as at::max over the fp32 logits picks them:
// the first of equal maxima, the first NaN if there is one. In place of at::max and a widened copy of the
// logits: two ATen calls a level whose dispatch cost more than the scan, run cold after the target's step.
template <typename T>
void top1_rows(const at::Tensor& logits, float* best, int64_t* top) {
  const int64_t B = logits.size(0), V = logits.size(1);
  const T* x = logits.data_ptr<T>();
  for (int64_t b = 0; b < B; ++b, x += V) {
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
    best[b] = m, top[b] = arg;
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> draft_chain(const at::Tensor& features, const at::Tensor& ids,
                                               const at::Tensor& positions, const at::Tensor& slot_mapping,
                                               const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q,
                                               const at::Tensor& prefix_lens, at::IntArrayRef max_levels,
                                               double log_floor, at::TensorList weights, at::IntArrayRef formats,
                                               const at::Tensor& d2t, double eps, const at::Tensor& cos,
                                               const at::Tensor& sin, at::TensorList kv, int64_t num_q_heads) {
  TORCH_CHECK_VALUE(weights.size() == kWeights && formats.size() == kFormats,
                    "draft_chain: weights must hold 11 tensors and formats 7, got ", weights.size(), " and ",
                    formats.size());
  TORCH_CHECK_VALUE(kv.size() == 2 && kv[0].dim() == 4, "draft_chain: kv must be the head's [k_cache, v_cache]");
  TORCH_CHECK_VALUE(cu_seqlens_q.dim() == 1 && cu_seqlens_q.size(0) >= 2 && cu_seqlens_q.scalar_type() == at::kInt,
                    "draft_chain: cu_seqlens_q must be int32 [B + 1], B >= 1");
  const int64_t B = cu_seqlens_q.size(0) - 1, T = ids.numel();
  TORCH_CHECK_VALUE(static_cast<int64_t>(max_levels.size()) == B, "draft_chain: max_levels must hold ", B, " values");
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
  const at::Tensor rows = at::tensor(root_rows, at::kLong);
  const at::Tensor hidden = linear(features.index_select(0, slot_mapping), weights[kFc], formats[kFcFormat]);  // [T, H]
  at::Tensor out = head.step(ids, hidden, positions, slot_mapping, block_tables, cu, prefix_lens).index_select(0, rows);
  std::vector<at::Tensor> tokens{ids.to(at::kLong).index_select(0, rows)};  // per level [B]
  std::vector<int64_t> lengths(max_levels.begin(), max_levels.end());
  const int64_t levels = *std::max_element(lengths.begin(), lengths.end());
  // A level's step: one new token per sequence at position root + d - 1 (d >= 2), its slot by the block table.
  const int64_t block_size = kv[0].size(1), scratch = kv[0].size(0) - 1, W = block_tables.size(1);
  const int32_t* table = block_tables.data_ptr<int32_t>();
  const int64_t* root_pos = pos.data_ptr<int64_t>();
  at::Tensor step_pos = at::empty({B}, at::kLong), step_slots = at::empty({B}, at::kLong),
             step_cu = at::arange(B + 1, at::kInt), step_prefix = at::empty({B}, at::kInt);
  at::Tensor score = at::zeros({B}, at::kFloat);
  for (int64_t d = 1; d <= levels; ++d) {
    if (d > 1) {
      for (int64_t b = 0; b < B; ++b) {
        const int64_t p = root_pos[root_rows[b]] + d - 1, blk = p / block_size;
        TORCH_CHECK_VALUE(p < cos.size(0), "draft_chain: position ", p, " is past the rope table's ", cos.size(0));
        const int64_t block = blk < W ? table[b * W + blk] : scratch;
        TORCH_CHECK_VALUE(block >= 0 && block <= scratch, "draft_chain: block_tables[", b, "] holds block ", block,
                          " outside the cache's ", scratch + 1);
        step_pos.data_ptr<int64_t>()[b] = p;
        step_slots.data_ptr<int64_t>()[b] = block * block_size + p % block_size;
        step_prefix.data_ptr<int32_t>()[b] = static_cast<int32_t>(p);
      }
      out = head.step(tokens.back(), out, step_pos, step_slots, block_tables, step_cu, step_prefix);
    }
    const at::Tensor logits = head.logits(out).contiguous();                              // [B, Vd]
    at::Tensor best = at::empty({B}, at::kFloat), next = at::empty({B}, at::kLong);
    int64_t* ids_out = next.data_ptr<int64_t>();
    if (logits.scalar_type() == at::kBFloat16) top1_rows<at::BFloat16>(logits, best.data_ptr<float>(), ids_out);
    else top1_rows<float>(logits.to(at::kFloat), best.data_ptr<float>(), ids_out);
    const int64_t* map = d2t_host.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) ids_out[b] += map[ids_out[b]];  // the draft vocabulary's id -> the target's
    tokens.push_back(next);
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
  return {at::stack(at::TensorList(tokens).slice(0, N + 1), 1), parents, depths, at::zeros({B, N + 1}, at::kFloat),
          sizes};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(eagle, m) {
  m.def("draft_chain(Tensor features, Tensor ids, Tensor positions, Tensor slot_mapping, Tensor block_tables,"
        " Tensor cu_seqlens_q, Tensor prefix_lens, int[] max_levels, float log_floor, Tensor[] weights, int[] formats,"
        " Tensor d2t, float eps, Tensor cos, Tensor sin, Tensor(a!)[] kv, int num_q_heads)"
        " -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(eagle, CPU, m) {
  m.impl("draft_chain", &draft_chain);
}
