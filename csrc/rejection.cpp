// Tree acceptance on CPU (DESIGN.md, "tree_accept_greedy" / "tree_accept_sample"). The fp32
// arithmetic follows cdf_order.h step for step; the Triton kernels (CUDA) reproduce it exactly.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "cdf_order.h"
#include "checks.h"
#include "cpu_vec.h"

namespace eagle {
namespace {

constexpr int64_t kSeg = kCdfSegment;

// The distribution sampled at the current node (unnormalised), with its segment sums. It reads the
// target row in place and copies it only when a rejection modifies it.
class Distribution {
 public:
  explicit Distribution(int64_t V) : V_(V), buf_(V), seg_((V + kSeg - 1) / kSeg) {}

  void load(const float* p) {
    row_ = p;
    refresh_all();
  }
  // max(0, p - q): what remains of the target after a rejected draft drawn from q.
  void load_residual(const float* p, const float* q) {
    for (int64_t i = 0; i < V_; ++i) buf_[i] = std::max(0.f, p[i] - q[i]);
    row_ = buf_.data();
    refresh_all();
  }
  void remove(int64_t x) {
    if (row_ != buf_.data()) {
      std::copy(row_, row_ + V_, buf_.begin());
      row_ = buf_.data();
    }
    buf_[x] = 0.f;
    refresh(x / kSeg);
  }
  float at(int64_t i) const { return row_[i]; }
  float total() const {
    float acc = 0.f;
    for (float s : seg_) acc += s;
    return acc;
  }
  int64_t draw(float u) const;

 private:
  static constexpr int64_t kLanes = 8;  // segments summed side by side: independent add chains

  int64_t begin(int64_t s) const { return s * kSeg; }
  int64_t end(int64_t s) const { return std::min((s + 1) * kSeg, V_); }
  void refresh(int64_t s) {
    float acc = 0.f;
    for (int64_t i = begin(s); i < end(s); ++i) acc += row_[i];
    seg_[s] = acc;
  }
  // Each segment is still summed sequentially; interleaving kLanes of them only hides add latency.
  void refresh_all() {
    const int64_t full = V_ / kSeg;
    int64_t s = 0;
    for (; s + kLanes <= full; s += kLanes) {
      float acc[kLanes] = {};
      const float* base = row_ + s * kSeg;
      for (int64_t k = 0; k < kSeg; ++k) {
        for (int64_t j = 0; j < kLanes; ++j) acc[j] += base[j * kSeg + k];
      }
      std::copy(acc, acc + kLanes, seg_.begin() + s);
    }
    for (; s < static_cast<int64_t>(seg_.size()); ++s) refresh(s);
  }

  int64_t V_;
  const float* row_ = nullptr;  // [V]: the target row, or buf_ once modified
  std::vector<float> buf_;      // [V]
  std::vector<float> seg_;      // [ceil(V / kSeg)]
};

// Inverse CDF in the canonical order; -1 only if nothing has mass.
int64_t Distribution::draw(float u) const {
  const float threshold = u * total();
  float before = 0.f;
  for (size_t s = 0; s < seg_.size(); ++s) {
    const float after = before + seg_[s];
    if (after > threshold) {
      float inner = 0.f;
      for (int64_t i = begin(s); i < end(s); ++i) {
        inner += row_[i];
        if (before + inner > threshold) return i;
      }
    }
    before = after;
  }
  for (int64_t i = V_ - 1; i >= 0; --i) {
    if (row_[i] > 0.f) return i;
  }
  return -1;
}

// One request's rows; probs/draft: [N, V] (draft may be null), uniforms: [N + 1].
struct Request {
  const int32_t* parents;
  const int64_t* tokens;
  int32_t n;
  const float* probs;
  const float* draft;
  const float* uniforms;
  int64_t V;
};

// Deterministic drafts: children in index order; child c (token x) is accepted iff
// u_c < p(x) / total, else x leaves the distribution. Returns the child or -1; `dist` is then the
// remaining distribution at cur.
int32_t try_children(const Request& r, int32_t cur, Distribution& dist) {
  dist.load(r.probs + cur * r.V);
  for (int32_t c = cur + 1; c < r.n; ++c) {
    if (r.parents[c] != cur) continue;
    const int64_t x = r.tokens[c];
    if (r.uniforms[c] < dist.at(x) / dist.total()) return c;
    dist.remove(x);
  }
  return -1;
}

// Chain drafts drawn from q: only the first child is tried, accepted iff u_c < p(x) / q(x)
// (IEEE: q(x) = 0 accepts iff p(x) > 0). On rejection `dist` becomes norm(max(0, p - q)), or p
// itself if rounding left the residual without mass.
int32_t try_first_child_draft(const Request& r, int32_t cur, Distribution& dist) {
  const float* p = r.probs + cur * r.V;
  int32_t c = cur + 1;
  while (c < r.n && r.parents[c] != cur) ++c;
  if (c < r.n) {
    const float* q = r.draft + c * r.V;
    const int64_t x = r.tokens[c];
    if (r.uniforms[c] < p[x] / q[x]) return c;
    dist.load_residual(p, q);
    if (dist.total() > 0.f) return -1;
  }
  dist.load(p);
  return -1;
}

void accept_sample_one(const Request& r, Distribution& dist, int32_t* path, int32_t* len,
                       int64_t* next) {
  int32_t cur = 0, depth = 0;
  path[0] = 0;
  for (;;) {
    const int32_t c = r.draft ? try_first_child_draft(r, cur, dist) : try_children(r, cur, dist);
    if (c < 0) break;
    cur = c;
    path[++depth] = c;
  }
  *len = depth;
  *next = dist.draw(r.uniforms[0]);
}

void accept_greedy_one(const int32_t* parents, const int64_t* tokens, int32_t n,
                       const int64_t* argmax, int32_t* path, int32_t* len, int64_t* next) {
  int32_t cur = 0, depth = 0;
  path[0] = 0;
  for (int32_t c = 1; c < n; ++c) {
    if (parents[c] == cur && tokens[c] == argmax[cur]) {
      cur = c;
      path[++depth] = c;
    }
  }
  *len = depth;
  *next = argmax[cur];
}

using AcceptResult = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

AcceptResult alloc_result(const at::Tensor& parents) {
  const int64_t B = parents.size(0), N = parents.size(1);
  return {at::full({B, N}, -1, parents.options()), at::zeros({B}, parents.options()),
          at::zeros({B}, parents.options().dtype(at::kLong))};
}

AcceptResult tree_accept_greedy_cpu(const at::Tensor& parents_in, const at::Tensor& tokens_in,
                                    const at::Tensor& sizes_in, const at::Tensor& argmax_in) {
  check_accept_args(parents_in, tokens_in, sizes_in);
  check_tensor(argmax_in, "target_argmax", at::kLong, parents_in.sizes());
  check_device(parents_in, argmax_in, "target_argmax");
  const at::Tensor parents = parents_in.contiguous(), tokens = tokens_in.contiguous();
  const at::Tensor sizes = sizes_in.contiguous(), argmax = argmax_in.contiguous();
  const int64_t B = parents.size(0), N = parents.size(1);
  check_tree_values(parents.data_ptr<int32_t>(), sizes.data_ptr<int32_t>(), B, N);

  auto [path, len, next] = alloc_result(parents);
  at::parallel_for(0, B, 256, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      accept_greedy_one(parents.data_ptr<int32_t>() + b * N, tokens.data_ptr<int64_t>() + b * N,
                        sizes.data_ptr<int32_t>()[b], argmax.data_ptr<int64_t>() + b * N,
                        path.data_ptr<int32_t>() + b * N, len.data_ptr<int32_t>() + b,
                        next.data_ptr<int64_t>() + b);
    }
  });
  return {path, len, next};
}

AcceptResult tree_accept_sample_cpu(const at::Tensor& parents_in, const at::Tensor& tokens_in,
                                    const at::Tensor& sizes_in, const at::Tensor& probs_in,
                                    const at::Tensor& uniforms_in,
                                    const std::optional<at::Tensor>& draft_in) {
  check_sample_args(parents_in, tokens_in, sizes_in, probs_in, uniforms_in, draft_in);
  const int64_t B = parents_in.size(0), N = parents_in.size(1), V = probs_in.size(2);
  const at::Tensor parents = parents_in.contiguous(), tokens = tokens_in.contiguous();
  const at::Tensor sizes = sizes_in.contiguous(), probs = probs_in.contiguous();
  const at::Tensor uniforms = uniforms_in.contiguous();
  const at::Tensor draft = draft_in ? draft_in->contiguous() : at::Tensor();
  check_tree_values(parents.data_ptr<int32_t>(), sizes.data_ptr<int32_t>(), B, N);
  const std::string err = token_value_error(tokens.data_ptr<int64_t>(), sizes.data_ptr<int32_t>(), B, N, V);
  TORCH_CHECK_VALUE(err.empty(), err);

  auto [path, len, next] = alloc_result(parents);
  // Requests are independent; small vocabularies batch many per task.
  at::parallel_for(0, B, std::max<int64_t>(1, (1 << 16) / V), [&](int64_t b0, int64_t b1) {
    Distribution dist(V);
    for (int64_t b = b0; b < b1; ++b) {
      const Request r{parents.data_ptr<int32_t>() + b * N, tokens.data_ptr<int64_t>() + b * N,
                      sizes.data_ptr<int32_t>()[b], probs.data_ptr<float>() + b * N * V,
                      draft.defined() ? draft.data_ptr<float>() + b * N * V : nullptr,
                      uniforms.data_ptr<float>() + b * (N + 1), V};
      accept_sample_one(r, dist, path.data_ptr<int32_t>() + b * N, len.data_ptr<int32_t>() + b,
                        next.data_ptr<int64_t>() + b);
    }
  });
  return {path, len, next};
}

#if defined(__x86_64__)
// The maximum of x[0, V), V >= 8; NaN if any element is NaN.
EAGLE_AVX2 float max_or_nan_avx2(const float* x, int64_t V) {
  __m256 m = _mm256_loadu_ps(x), nan = _mm256_cmp_ps(m, m, _CMP_UNORD_Q);
  int64_t j = 8;
  for (; j + 8 <= V; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    m = _mm256_max_ps(m, v);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float top = *std::max_element(lanes, lanes + 8);
  bool any_nan = _mm256_movemask_ps(nan) != 0;
  for (; j < V; ++j) {
    any_nan = any_nan || x[j] != x[j];
    top = std::max(top, x[j]);
  }
  return any_nan ? std::numeric_limits<float>::quiet_NaN() : top;
}
#endif

// The first index of a row's maximum, as torch's max(-1).indices gives it (the first NaN, if any).
int64_t argmax_row(const float* x, int64_t V) {
#if defined(__x86_64__)
  if (eagle::cpu::has_avx2() && V >= 8) {  // the maximum 8 lanes at a time, then its first index
    const float best = max_or_nan_avx2(x, V);
    const bool nan = best != best;
    for (int64_t i = 0; i < V; ++i)
      if (nan ? x[i] != x[i] : x[i] == best) return i;
  }
#endif
  int64_t at = 0;
  for (int64_t j = 1; j < V && x[at] == x[at]; ++j)
    if (x[j] > x[at] || x[j] != x[j]) at = j;
  return at;
}

// x: fp32 [..., V] -> int64 [...].
at::Tensor argmax_rows_cpu(const at::Tensor& x_in) {
  TORCH_CHECK_VALUE(x_in.scalar_type() == at::kFloat && x_in.dim() >= 1 && x_in.size(-1) > 0,
                    "argmax_rows: x must be fp32 [..., V] with V > 0");
  const at::Tensor x = x_in.contiguous();
  const int64_t V = x.size(-1), rows = x.numel() / V;
  auto shape = x.sizes().vec();
  shape.pop_back();
  at::Tensor out = at::empty(shape, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 16) / V), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = argmax_row(xp + r * V, V);
  });
  return out;
}

// The greedy round's verdict straight from the target's logits fp32 [B, N, V] (or their argmax, int64 [B, N]):
// accept_greedy_one's descent, taking the argmax (argmax_row) of the nodes it visits only, then what the host
// reads, int64 [B, 2N + 2]:
// accepted length, next token, the path (node ids from the root, -1 padded), the tokens on it (a padded
// entry repeats the root's). The same values as tree_accept_greedy over argmax_rows' argmax, then the summary.
at::Tensor greedy_verdict_cpu(const at::Tensor& parents_in, const at::Tensor& tokens_in, const at::Tensor& sizes_in,
                              const at::Tensor& logits_in) {
  check_accept_args(parents_in, tokens_in, sizes_in);
  const bool given = logits_in.scalar_type() == at::kLong;  // the argmax of every node, computed already
  if (given) {
    check_tensor(logits_in, "target_argmax", at::kLong, {parents_in.size(0), parents_in.size(1)});
    check_device(parents_in, logits_in, "target_argmax");
  } else {
    check_probs(parents_in, logits_in, "logits");
  }
  const at::Tensor parents = parents_in.contiguous(), tokens = tokens_in.contiguous();
  const at::Tensor sizes = sizes_in.contiguous(), logits = logits_in.contiguous();
  const int64_t B = parents.size(0), N = parents.size(1), V = given ? 1 : logits.size(2), W = 2 * N + 2;
  check_tree_values(parents.data_ptr<int32_t>(), sizes.data_ptr<int32_t>(), B, N);

  at::Tensor out = at::empty({B, W}, tokens.options());
  at::parallel_for(0, B, std::max<int64_t>(1, (1 << 16) / V), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int32_t* par = parents.data_ptr<int32_t>() + b * N;
      const int64_t* tok = tokens.data_ptr<int64_t>() + b * N;
      const float* lg = given ? nullptr : logits.data_ptr<float>() + b * N * V;
      const int64_t* top = given ? logits.data_ptr<int64_t>() + b * N : nullptr;
      auto argmax_at = [&](int32_t c) { return given ? top[c] : argmax_row(lg + c * V, V); };
      int64_t* o = out.data_ptr<int64_t>() + b * W;
      int64_t* path = o + 2;
      int32_t cur = 0, depth = 0;
      int64_t best = argmax_at(0);
      path[0] = 0;
      for (int32_t c = 1; c < sizes.data_ptr<int32_t>()[b]; ++c) {
        if (par[c] == cur && tok[c] == best) {
          cur = c;
          path[++depth] = c;
          best = argmax_at(c);
        }
      }
      for (int64_t j = depth + 1; j < N; ++j) path[j] = -1;
      o[0] = depth;
      o[1] = best;
      for (int64_t j = 0; j < N; ++j) o[2 + N + j] = tok[path[j] < 0 ? 0 : path[j]];
    }
  });
  return out;
}

}  // namespace

namespace cpu {
int64_t first_max(const float* x, int64_t V) { return argmax_row(x, V); }
at::Tensor argmax_rows(const at::Tensor& x) { return argmax_rows_cpu(x); }
}  // namespace cpu

TORCH_LIBRARY_IMPL(eagle, CPU, m) {
  m.impl("tree_accept_greedy", &tree_accept_greedy_cpu);
  m.impl("tree_accept_sample", &tree_accept_sample_cpu);
  m.impl("argmax_rows", &argmax_rows_cpu);
  m.impl("greedy_verdict", &greedy_verdict_cpu);
}

}  // namespace eagle
