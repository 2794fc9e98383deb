// topk_expand on CPU (DESIGN.md, "topk_expand"): one pass over each frontier row's draft logits for its
// log-sum-exp and its top-k, then the best k of the R * k candidates, in one call instead of ~15 torch ops.
//
// Row top-k: (logit desc, draft id asc): the row is scanned in id order and a value enters the kept k only
// when it beats the k-th strictly, so among equal logits the lower ids stay. Candidates: (score desc, row
// asc, rank asc), a stable sort of the (row, rank)-ordered list. Scores: parent + (logit - max) - log(sum
// exp(logit - max)), the sum in double; the ranking never depends on how the scores round, only the score
// values may differ from torch's log_softmax in the last bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <tuple>
#include <vector>

namespace {

template <typename T>
void expand_row(const T* x, int64_t V, int64_t k, float parent, int64_t* ids, float* scores) {
  std::vector<float> vals(k, -INFINITY);
  std::fill(ids, ids + k, int64_t{-1});
  float mx = -INFINITY;
  for (int64_t i = 0; i < V; ++i) {
    const float v = static_cast<float>(x[i]);
    mx = std::max(mx, v);
    if (v > vals[k - 1] || ids[k - 1] < 0) {  // the first k ids fill the slots whatever their values
      int64_t j = k - 1;
      while (j > 0 && (v > vals[j - 1] || ids[j - 1] < 0)) {
        vals[j] = vals[j - 1];
        ids[j] = ids[j - 1];
        --j;
      }
      vals[j] = v;
      ids[j] = i;
    }
  }
  double sum = 0;
  for (int64_t i = 0; i < V; ++i) sum += std::exp(static_cast<double>(static_cast<float>(x[i])) - mx);
  const double lse = static_cast<double>(mx) + std::log(sum);
  for (int64_t j = 0; j < k; ++j) scores[j] = static_cast<float>(parent + (static_cast<double>(vals[j]) - lse));
}

// logits [B, R, V] (fp32 / bf16 / fp16), parent_scores fp32 [B, R], d2t int32 / int64 [V] or none ->
// (tokens int64 [B, k], scores fp32 [B, k], parents int64 [B, k], row_tokens int64 [B, R, k], row_scores fp32
// [B, R, k]); tokens are target ids (draft id + d2t[draft id]).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> topk_expand_cpu(
    const at::Tensor& logits_in, const at::Tensor& parent_in, int64_t k, const c10::optional<at::Tensor>& d2t_in) {
  TORCH_CHECK_VALUE(logits_in.dim() == 3 && logits_in.is_cpu(), "topk_expand: logits must be a CPU tensor [B, R, V]");
  const int64_t B = logits_in.size(0), R = logits_in.size(1), V = logits_in.size(2);
  TORCH_CHECK_VALUE(k >= 1 && k <= V, "topk_expand: k must be in [1, V=", V, "], got ", k);
  TORCH_CHECK_VALUE(parent_in.scalar_type() == at::kFloat && parent_in.sizes() == at::IntArrayRef({B, R}),
                    "topk_expand: parent_scores must be fp32 [", B, ", ", R, "]");
  const at::Tensor logits = logits_in.contiguous(), parent = parent_in.contiguous();
  at::Tensor d2t;
  if (d2t_in.has_value()) {
    TORCH_CHECK_VALUE(d2t_in->dim() == 1 && d2t_in->size(0) == V, "topk_expand: d2t must be [V=", V, "]");
    d2t = d2t_in->to(at::kLong).contiguous();
  }
  const auto i64 = logits.options().dtype(at::kLong), f32 = logits.options().dtype(at::kFloat);
  at::Tensor row_tokens = at::empty({B, R, k}, i64), row_scores = at::empty({B, R, k}, f32);
  at::Tensor tokens = at::empty({B, k}, i64), scores = at::empty({B, k}, f32), parents = at::empty({B, k}, i64);
  int64_t* rt = row_tokens.data_ptr<int64_t>();
  float* rs = row_scores.data_ptr<float>();
  const float* ps = parent.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "topk_expand", [&] {
    const scalar_t* x = logits.data_ptr<scalar_t>();
    // ~V / 1000 us a row: small batches stay on the calling thread
    at::parallel_for(0, B * R, std::max<int64_t>(1, 65536 / V), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) expand_row(x + r * V, V, k, ps[r], rt + r * k, rs + r * k);
    });
  });
  const int64_t* map = d2t.defined() ? d2t.data_ptr<int64_t>() : nullptr;
  std::vector<int64_t> order(R * k);
  for (int64_t b = 0; b < B; ++b) {
    const float* cand = rs + b * R * k;
    std::iota(order.begin(), order.end(), int64_t{0});
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t c) { return cand[a] > cand[c]; });
    for (int64_t j = 0; j < k; ++j) {
      const int64_t id = rt[b * R * k + order[j]];
      tokens.data_ptr<int64_t>()[b * k + j] = map ? id + map[id] : id;
      scores.data_ptr<float>()[b * k + j] = cand[order[j]];
      parents.data_ptr<int64_t>()[b * k + j] = order[j] / k;
    }
  }
  if (map) {
    for (int64_t i = 0; i < B * R * k; ++i) rt[i] += map[rt[i]];
  }
  return {tokens, scores, parents, row_tokens, row_scores};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(eagle, m) {
  m.def("topk_expand(Tensor logits, Tensor parent_scores, int k, Tensor? d2t) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(eagle, CPU, m) { m.impl("topk_expand", &topk_expand_cpu); }
