// The Llama decoder stack in one call, for CPU steps of a few tokens per sequence (decode, draft chains,
// tree verification). Each layer is what engine/model.py's DecoderLayer computes, with the same kernels in
// the same order, so the result is bit-identical to the per-op forward; what goes away is the host time
// between kernels (~9 Python launcher calls and dispatcher hops per layer, ~1.5 ms a token for a 30-layer
// model, a quarter of a quantized decode step).
//
// weights: per layer [input_norm [H], qkv, o, post_norm [H], gate_up, down], then the final norm [H];
// first_input, when given ([T, K0] bf16), is layer 0's attention input in place of input_norm(hidden) (an EAGLE
// head's layer: its own norms and concatenation come before; layer 0's input_norm is then not applied);
// formats: per layer the four linears' formats, 0 = a bf16 [N, K] weight (linear_dense), 3 / 8 = a Q4_1 / Q8_0
// weight in eagle_kernels.quant's layout (linear_q). kv: per layer its k and v caches.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <thread>
#include <utility>
#include <vector>

#include "cpu_ops.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPerLayer = 6, kLinears = 4;
constexpr int64_t kQ4_1 = 3, kQ8_0 = 8, kGroup = 16;  // GGML type ids; quantized weights come in groups of 16 rows
constexpr int64_t kBlock = 32;  // the quantized linears' block along K (their activations' too)

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, int64_t format) {
  return format == 0 ? eagle::cpu::linear_dense(x, w) : eagle::cpu::linear_q(x, w, format);
}

// Layer k of `capture`'s input (hidden + delta, rounded once, as at::add does) for every token, into row
// slots[t] of `into` [slots, width] at column k * H.
void capture_rows(const at::BFloat16* hidden, const at::BFloat16* delta, int64_t T, int64_t H, const int64_t* slots,
                  int64_t k, at::BFloat16* into, int64_t width) {
  for (int64_t t = 0; t < T; ++t) {
    at::BFloat16* row = into + slots[t] * width + k * H;
    for (int64_t j = 0; j < H; ++j) {
      row[j] = delta ? at::BFloat16(static_cast<float>(hidden[t * H + j]) + static_cast<float>(delta[t * H + j]))
                     : hidden[t * H + j];
    }
  }
}

// ---- Small steps with quantized weights: one parallel region for the whole stack ----
//
// A decode step's layer is ~2 MB of weights in four linears and a few microseconds of other work; run op by
// op, each linear and the attention open a parallel region (~1 us each), every op allocates its output, and
// the norms, RoPE and SiLU run on one thread while the other waits. Here the threads enter one region for all
// layers and meet at spin barriers between phases that each split their work (linear output groups, RoPE
// heads, attention tasks, the norms' rows; the gate and up rows of the same columns go to one thread, which
// applies SiLU to them at once). A linear's input is quantized once, its parts by the threads that produced
// them, not by every thread whole (a cost that grows with the tokens a step verifies). Every output element is
// computed by the same kernel code as in the op-by-op path, so the results are bit-identical whatever the
// thread count.

class SpinBarrier {
 public:
  static constexpr int kSpins = 1 << 10;  // ~50 us of pauses (SPR: ~140 cycles each), longer than a phase
  void wait(int threads) {
    if (threads == 1) return;
    const int phase = phase_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == threads - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      phase_.store(phase + 1, std::memory_order_release);
      return;
    }
    for (int spins = 0; phase_.load(std::memory_order_acquire) == phase; ++spins) {
      if (spins >= kSpins) {  // more threads than free cores: let the one we wait for run
        std::this_thread::yield();
        continue;
      }
#if defined(__x86_64__)
      _mm_pause();
#endif
    }
  }

 private:
  alignas(64) std::atomic<int> arrived_{0};
  alignas(64) std::atomic<int> phase_{0};
};

// Thread tid's contiguous share of n items.
std::pair<int64_t, int64_t> share(int64_t n, int tid, int threads) {
  const int64_t chunk = (n + threads - 1) / threads;
  return {std::min(n, tid * chunk), std::min(n, (tid + 1) * chunk)};
}

int64_t quantized_row_bytes(int64_t format, int64_t K) { return K / 32 * kGroup * (format == kQ4_1 ? 20 : 34); }

bool is_bf16_vector(const at::Tensor& t, int64_t n) {
  return t.dim() == 1 && t.size(0) == n && t.scalar_type() == at::kBFloat16 && t.is_contiguous() && t.device().is_cpu();
}

// Whether the one-region path can run these arguments; anything it does not take (bf16 weights, captured inputs
// returned as tensors, odd shapes, bad arguments) goes op by op, whose ops report bad arguments.
bool fits_one_region(const at::Tensor& hidden, at::TensorList weights, at::IntArrayRef formats, const at::Tensor& cos,
                     const at::Tensor& sin, at::TensorList kv, const at::Tensor& slot_mapping, int64_t Hq,
                     at::IntArrayRef capture, bool into, const c10::optional<at::Tensor>& first_input) {
  const int64_t L = static_cast<int64_t>(kv.size()) / 2, T = hidden.size(0), H = hidden.size(1);
  if (hidden.scalar_type() != at::kBFloat16 || (!capture.empty() && !into) || T == 0) return false;
  const at::Tensor& k0 = kv[0];
  if (k0.dim() != 4 || Hq <= 0 || k0.size(2) <= 0 || Hq % k0.size(2) != 0 || k0.size(3) % 2) return false;
  const int64_t Hkv = k0.size(2), D = k0.size(3), slots = k0.size(0) * k0.size(1);
  for (const at::Tensor& c : kv) {
    if (c.sizes() != k0.sizes() || c.scalar_type() != at::kBFloat16 || !c.is_contiguous() || !c.device().is_cpu())
      return false;
  }
  for (const at::Tensor* t : {&cos, &sin}) {
    if (t->scalar_type() != at::kFloat || !t->is_contiguous() || t->sizes() != at::IntArrayRef({T, D})) return false;
  }
  if (slot_mapping.scalar_type() != at::kLong || !slot_mapping.is_contiguous() || slot_mapping.numel() != T) return false;
  const int64_t* sp = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    if (sp[t] < 0 || sp[t] >= slots) return false;
  }
  const at::Tensor& gate_up = weights[4];
  const int64_t I = gate_up.dim() == 2 ? gate_up.size(0) * kGroup / 2 : 0;
  if (H % kBlock || (Hq * D) % kBlock || I % kBlock || I == 0) return false;
  const int64_t K0 = first_input.has_value() ? first_input->size(1) : H;
  if (first_input.has_value() && (first_input->scalar_type() != at::kBFloat16 || !first_input->is_contiguous() ||
                                  first_input->dim() != 2 || first_input->size(0) != T || K0 % 32))
    return false;
  const int64_t shapes[kLinears][2] = {{H, (Hq + 2 * Hkv) * D}, {Hq * D, H}, {H, 2 * I}, {I, H}};  // K, N
  for (int64_t i = 0; i < L; ++i) {
    const at::Tensor* w = weights.data() + kPerLayer * i;
    if (!is_bf16_vector(w[0], H) || !is_bf16_vector(w[3], H)) return false;
    const at::Tensor* linears[kLinears] = {&w[1], &w[2], &w[4], &w[5]};
    for (int64_t j = 0; j < kLinears; ++j) {
      const int64_t f = formats[kLinears * i + j], K = i == 0 && j == 0 ? K0 : shapes[j][0], N = shapes[j][1];
      const at::Tensor& m = *linears[j];
      if ((f != kQ4_1 && f != kQ8_0) || m.dim() != 2 || m.scalar_type() != at::kByte || !m.is_contiguous() ||
          !m.device().is_cpu() || m.size(0) * kGroup != N || m.size(1) != quantized_row_bytes(f, K))
        return false;
    }
  }
  return is_bf16_vector(weights.back(), H);
}

// The stack over `hidden` (see decoder_layers) in one parallel region; -> the last layer's MLP output [T, H],
// not yet added to `hidden`.
at::Tensor one_region(at::Tensor& hidden, at::TensorList weights, at::IntArrayRef formats, double eps_d,
                      const at::Tensor& cos, const at::Tensor& sin, at::TensorList kv, const at::Tensor& slot_mapping,
                      const eagle::cpu::AttentionTasks& tasks, int64_t Hq, at::IntArrayRef capture,
                      const c10::optional<at::Tensor>& capture_into, const c10::optional<at::Tensor>& first_input) {
  using at::BFloat16;
  const int64_t L = static_cast<int64_t>(kv.size()) / 2, T = hidden.size(0), H = hidden.size(1);
  const int64_t Hkv = kv[0].size(2), D = kv[0].size(3), Nqkv = (Hq + 2 * Hkv) * D, I = weights[4].size(0) * kGroup / 2;
  const float eps = static_cast<float>(eps_d);
  // The step's temporaries, side by side in the calling thread's buffer (each 64-byte aligned): x, qkv, q, attn,
  // o, gate_up, act, delta.
  const int64_t sizes[] = {T * H, T * Nqkv, T * Hq * D, T * Hq * D, T * H, T * 2 * I, T * I, T * H};
  int64_t offsets[9] = {0};
  for (int k = 0; k < 8; ++k) offsets[k + 1] = offsets[k] + (sizes[k] + 31) / 32 * 32;
  // (Views of `scratch`, not raw pointers alone: past the buffers' cap it is a tensor of its own, and delta, returned,
  // must keep it alive.)
  const at::Tensor scratch = eagle::cpu::thread_buffer(eagle::cpu::Buffer::kStack, {offsets[8]}, at::kBFloat16);
  BFloat16* base = scratch.data_ptr<BFloat16>();
  BFloat16 *hp = hidden.data_ptr<BFloat16>(), *xp = base + offsets[0], *qkvp = base + offsets[1], *qp = base + offsets[2],
           *attnp = base + offsets[3], *op = base + offsets[4], *gup = base + offsets[5], *actp = base + offsets[6],
           *dp = base + offsets[7];
  const at::Tensor q = scratch.narrow(0, offsets[2], T * Hq * D).view({T, Hq, D}),
                   delta = scratch.narrow(0, offsets[7], T * H).view({T, H});
  at::Tensor attn = scratch.narrow(0, offsets[3], T * Hq * D).view({T, Hq, D});
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const BFloat16* x0 = first_input.has_value() ? first_input->data_ptr<BFloat16>() : nullptr;
  const int64_t K0 = first_input.has_value() ? first_input->size(1) : H;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  BFloat16* into = capture_into.has_value() ? capture_into->data_ptr<BFloat16>() : nullptr;
  const int64_t width = capture_into.has_value() ? capture_into->size(1) : 0;
  std::vector<const BFloat16*> norms;
  std::vector<const uint8_t*> mats;
  for (int64_t i = 0; i < L; ++i) {
    const at::Tensor* w = weights.data() + kPerLayer * i;
    norms.insert(norms.end(), {w[0].data_ptr<BFloat16>(), w[3].data_ptr<BFloat16>()});
    mats.insert(mats.end(), {w[1].data_ptr<uint8_t>(), w[2].data_ptr<uint8_t>(), w[4].data_ptr<uint8_t>(),
                             w[5].data_ptr<uint8_t>()});
  }
  const int64_t units = T * (Hq + Hkv);
  // The norms' outputs (the qkv and gate/up inputs) and SiLU's (the down input) are quantized once, by the threads
  // together, each the rows it normalised or the columns it computed, before the barrier the linear waits at
  // anyway (the o input, which attention tasks write in their own order, is quantized by each thread whole).
  // (The calling thread's buffers, reused from call to call; named by reference, since inside the parallel
  // region a thread_local's name would be each thread's own.)
  thread_local eagle::cpu::QuantX normed_buffer, activated_buffer;
  eagle::cpu::QuantX &normed = normed_buffer, &activated = activated_buffer;
  eagle::cpu::quantize_reserve(normed, T, H);
  eagle::cpu::quantize_reserve(activated, T, I);
  SpinBarrier barrier;
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const int n = omp_get_num_threads(), tid = omp_get_thread_num();
    // y [T, N] = x [T, K] @ linear j of layer i, this thread's output groups; x quantized here, or already in xq
    auto linear_from = [&](const eagle::cpu::QuantX* xq, int64_t i, int64_t j, int64_t N, BFloat16* y) {
      const auto [g0, g1] = share(N / kGroup, tid, n);
      eagle::cpu::linear_q_groups(mats[kLinears * i + j], formats[kLinears * i + j], T, N, g0, g1, y, xq);
    };
    auto linear = [&](const BFloat16* in, int64_t K, int64_t i, int64_t j, int64_t N, BFloat16* y) {
      eagle::cpu::quantize_activations(in, T, K);
      linear_from(nullptr, i, j, N, y);
    };
    const auto [r0, r1] = share(T, tid, n);                      // this thread's rows of the norms
    const auto [c0, c1] = share(I / kBlock, tid, n);             // its 32-column blocks of the MLP
    // rms_norm of this thread's rows of x into xp (x added into the residual stream hp first, if `add`), quantized
    auto norm_rows = [&](const BFloat16* x, const BFloat16* weight, bool add) {
      eagle::cpu::rms_norm_rows(x + r0 * H, weight, add ? hp + r0 * H : nullptr, xp + r0 * H, r1 - r0, H, eps);
      eagle::cpu::quantize_part(xp, r0, r1, 0, H / kBlock, normed);
    };
    for (int64_t i = 0; i < L; ++i) {
      const auto k = std::find(capture.begin(), capture.end(), i) - capture.begin();
      if (k < static_cast<int64_t>(capture.size()))
        capture_rows(hp + r0 * H, i ? dp + r0 * H : nullptr, r1 - r0, H, slots + r0, k, into, width);
      if (i || !x0) norm_rows(i ? dp : hp, norms[2 * i], i);
      barrier.wait(n);
      if (i == 0 && x0) {
        linear(x0, K0, i, 0, Nqkv, qkvp);
      } else {
        linear_from(&normed, i, 0, Nqkv, qkvp);
      }
      barrier.wait(n);
      const auto [u0, u1] = share(units, tid, n);
      eagle::cpu::rope_write_kv_units(qkvp, cp, sp, kv[2 * i].data_ptr<BFloat16>(), kv[2 * i + 1].data_ptr<BFloat16>(),
                                      slots, Hq, Hkv, D, qp, u0, u1);
      barrier.wait(n);
      const auto [a0, a1] = share(tasks.size(), tid, n);
      tasks.run(q, kv[2 * i], kv[2 * i + 1], attn, a0, a1);
      barrier.wait(n);
      linear(attnp, Hq * D, i, 1, H, op);
      barrier.wait(n);
      norm_rows(op, norms[2 * i + 1], true);
      barrier.wait(n);
      // gate rows of columns [32 c0, 32 c1) and the up rows of the same columns, SiLU over them, quantized
      const uint8_t* w = mats[kLinears * i + 2];
      const int64_t f = formats[kLinears * i + 2], g0 = c0 * kBlock / kGroup, g1 = c1 * kBlock / kGroup;
      eagle::cpu::linear_q_groups(w, f, T, 2 * I, g0, g1, gup, &normed);
      eagle::cpu::linear_q_groups(w, f, T, 2 * I, I / kGroup + g0, I / kGroup + g1, gup, &normed);
      eagle::cpu::silu_and_mul_columns(gup, T, I, c0 * kBlock, c1 * kBlock, actp);
      eagle::cpu::quantize_part(actp, 0, T, c0, c1, activated);
      barrier.wait(n);
      linear_from(&activated, i, 3, H, dp);
      barrier.wait(n);
    }
  }
  return delta;
}

}  // namespace

namespace eagle::cpu {

at::Tensor thread_buffer(Buffer slot, at::IntArrayRef sizes, at::ScalarType dtype) {
  constexpr int64_t kKept = 4 << 20;  // bytes a slot keeps at most: a long prompt's chunk gets a tensor of its own
  thread_local std::vector<at::Tensor> buffers(static_cast<size_t>(Buffer::kCount));
  at::Tensor& buffer = buffers[static_cast<size_t>(slot)];
  const int64_t bytes = c10::multiply_integers(sizes) * static_cast<int64_t>(c10::elementSize(dtype));
  if (bytes > kKept) return at::empty(sizes, at::TensorOptions().dtype(dtype));
  if (!buffer.defined() || buffer.numel() < bytes) buffer = at::empty({std::max<int64_t>(bytes, 64)}, at::kByte);
  return at::from_blob(buffer.data_ptr(), sizes, at::TensorOptions().dtype(dtype));
}

// -> (final_norm(hidden after the last layer) [T, H], the inputs of the layers in `capture`; none when
// `capture_into` [slots, capture.size() * H] is given: the inputs are written there instead, side by side,
// row slot_mapping[t] for token t, the same bf16 values). hidden [T, H]: the embeddings; it carries the
// residual stream and is updated in place.
std::tuple<at::Tensor, std::vector<at::Tensor>> decoder_layers(
    at::Tensor& hidden, at::TensorList weights, at::IntArrayRef formats, double eps, const at::Tensor& cos,
    const at::Tensor& sin, at::TensorList kv, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& cu_seqlens_q, const at::Tensor& prefix_lens, const c10::optional<at::Tensor>& tree_mask,
    int64_t num_q_heads, at::IntArrayRef capture, const c10::optional<at::Tensor>& capture_into,
    const c10::optional<at::Tensor>& first_input) {
  at::Tensor none;
  return decoder_layers_into(hidden, weights, formats, eps, cos, sin, kv, slot_mapping, block_tables, cu_seqlens_q,
                             prefix_lens, tree_mask, num_q_heads, capture, capture_into, first_input, none);
}

// final_out undefined: the final norm in a new tensor.
std::tuple<at::Tensor, std::vector<at::Tensor>> decoder_layers_into(
    at::Tensor& hidden, at::TensorList weights, at::IntArrayRef formats, double eps, const at::Tensor& cos,
    const at::Tensor& sin, at::TensorList kv, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& cu_seqlens_q, const at::Tensor& prefix_lens, const c10::optional<at::Tensor>& tree_mask,
    int64_t num_q_heads, at::IntArrayRef capture, const c10::optional<at::Tensor>& capture_into,
    const c10::optional<at::Tensor>& first_input, at::Tensor& final_out) {
  const int64_t L = static_cast<int64_t>(kv.size()) / 2;
  TORCH_CHECK_VALUE(static_cast<int64_t>(kv.size()) == 2 * L && L > 0, "decoder_layers: kv must hold k and v per layer");
  TORCH_CHECK_VALUE(static_cast<int64_t>(weights.size()) == kPerLayer * L + 1,
                    "decoder_layers: weights must hold 6 tensors per layer and the final norm, got ", weights.size(),
                    " for ", L, " layers");
  TORCH_CHECK_VALUE(static_cast<int64_t>(formats.size()) == kLinears * L,
                    "decoder_layers: formats must hold 4 per layer, got ", formats.size());
  TORCH_CHECK_VALUE(hidden.dim() == 2 && hidden.is_contiguous(), "decoder_layers: hidden must be a contiguous [T, H]");
  const int64_t T = hidden.size(0), H = hidden.size(1);
  const int64_t* slots = nullptr;
  if (capture_into.has_value()) {
    const at::Tensor& into = *capture_into;
    TORCH_CHECK_VALUE(into.dim() == 2 && into.scalar_type() == at::kBFloat16 && into.is_contiguous() &&
                          into.device().is_cpu() && into.size(1) == static_cast<int64_t>(capture.size()) * H,
                      "decoder_layers: capture_into must be a contiguous bf16 CPU [slots, ", capture.size(), " * ", H, "]");
    TORCH_CHECK_VALUE(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                          slot_mapping.numel() == T, "decoder_layers: capture_into needs int64 slot_mapping [T]");
    slots = slot_mapping.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; ++t) {
      TORCH_CHECK_VALUE(slots[t] >= 0 && slots[t] < into.size(0), "decoder_layers: slot_mapping[", t, "] = ", slots[t],
                        " is outside capture_into's ", into.size(0), " rows");
    }
  }
  if (first_input.has_value()) {
    TORCH_CHECK_VALUE(first_input->dim() == 2 && first_input->size(0) == T && first_input->scalar_type() == at::kBFloat16 &&
                          first_input->device().is_cpu(), "decoder_layers: first_input must be a bf16 CPU [", T, ", K0]");
  }
  std::vector<at::Tensor> captured;
  if (fits_one_region(hidden, weights, formats, cos, sin, kv, slot_mapping, num_q_heads, capture, slots != nullptr,
                      first_input)) {
    const at::Tensor q_shape = thread_buffer(Buffer::kStackQ, {T, num_q_heads, kv[0].size(3)}, at::kBFloat16);
    const eagle::cpu::AttentionTasks tasks(q_shape, kv[0], kv[1], block_tables, cu_seqlens_q, prefix_lens, tree_mask,
                                           c10::nullopt);
    const at::Tensor delta = one_region(hidden, weights, formats, eps, cos, sin, kv, slot_mapping, tasks, num_q_heads,
                                        capture, capture_into, first_input);
    if (!final_out.defined()) return {eagle::cpu::rms_norm(delta, weights.back(), eps, hidden), captured};
    TORCH_CHECK_VALUE(final_out.sizes() == hidden.sizes() && final_out.scalar_type() == at::kBFloat16 &&
                          final_out.is_contiguous(), "decoder_layers: final_out must be a contiguous bf16 [T, H]");
    eagle::cpu::rms_norm_rows(delta.data_ptr<at::BFloat16>(), weights.back().data_ptr<at::BFloat16>(),
                              hidden.data_ptr<at::BFloat16>(), final_out.data_ptr<at::BFloat16>(), T, H,
                              static_cast<float>(eps));
    return {final_out, captured};
  }
  at::Tensor delta;  // the previous layer's MLP output, not yet added to `hidden`
  for (int64_t i = 0; i < L; ++i) {
    const at::Tensor* w = weights.data() + kPerLayer * i;
    const int64_t* f = formats.data() + kLinears * i;
    const auto k = std::find(capture.begin(), capture.end(), i) - capture.begin();
    if (k < static_cast<int64_t>(capture.size()) && slots) {
      capture_rows(hidden.data_ptr<at::BFloat16>(), delta.defined() ? delta.data_ptr<at::BFloat16>() : nullptr, T, H,
                   slots, k, capture_into->data_ptr<at::BFloat16>(), capture_into->size(1));
    } else if (k < static_cast<int64_t>(capture.size())) {
      captured.push_back(delta.defined() ? hidden + delta : hidden.clone());
    }
    at::Tensor x = delta.defined()      ? eagle::cpu::rms_norm(delta, w[0], eps, hidden)
                   : first_input.has_value() ? first_input->contiguous()
                                             : eagle::cpu::rms_norm(hidden, w[0], eps, c10::nullopt);
    at::Tensor k_cache = kv[2 * i], v_cache = kv[2 * i + 1];
    const at::Tensor q = eagle::cpu::rope_write_kv(linear(x, w[1], f[0]), cos, sin, k_cache, v_cache, slot_mapping,
                                                   num_q_heads);
    const at::Tensor o = eagle::cpu::paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens,
                                                     tree_mask, c10::nullopt);
    x = eagle::cpu::rms_norm(linear(o.view({T, -1}), w[2], f[1]), w[3], eps, hidden);
    delta = linear(eagle::cpu::silu_and_mul(linear(x, w[4], f[2])), w[5], f[3]);
  }
  at::Tensor normed = eagle::cpu::rms_norm(delta, weights.back(), eps, hidden);
  if (final_out.defined()) final_out.copy_(normed);
  return {final_out.defined() ? final_out : normed, captured};
}

}  // namespace eagle::cpu

namespace {

// A model's decoder stack held once (eagle_kernels.decoder.bind): the layers' weights and formats, the KV caches,
// the embedding table (format 0: bf16 rows; 3 / 8: Q4_1 / Q8_0 blocks, rows dequantized to bf16) and the fp32
// rope tables [P, D]. A step passes this one object and its token ids and positions instead of ~240 tensors,
// whose boxing cost ~75 us a call with their Python objects cold after the weights' stream (SmolLM2's 30
// layers on the Zen 5 box), and the embedding and rope rows come without two more ops' dispatch.
struct DecoderStack : torch::CustomClassHolder {
  std::vector<at::Tensor> weights, kv;
  std::vector<int64_t> formats;
  at::Tensor embed, cos, sin;
  int64_t embed_format;
  DecoderStack(std::vector<at::Tensor> weights, std::vector<int64_t> formats, std::vector<at::Tensor> kv,
               at::Tensor embed, int64_t embed_format, at::Tensor cos, at::Tensor sin)
      : weights(std::move(weights)), kv(std::move(kv)), formats(std::move(formats)), embed(std::move(embed)),
        cos(std::move(cos)), sin(std::move(sin)), embed_format(embed_format) {}
};

// ids, positions [T] -> decoder_layers over embed[ids] with the rope rows of `positions`.
std::tuple<at::Tensor, std::vector<at::Tensor>> decoder_layers_bound(
    const at::Tensor& ids, const at::Tensor& positions, const c10::intrusive_ptr<DecoderStack>& stack, double eps,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q,
    const at::Tensor& prefix_lens, const c10::optional<at::Tensor>& tree_mask, int64_t num_q_heads,
    at::IntArrayRef capture, const c10::optional<at::Tensor>& capture_into) {
  TORCH_CHECK_VALUE(ids.dim() == 1 && positions.dim() == 1 && ids.numel() == positions.numel(),
                    "decoder_layers_bound: ids and positions must be [T] vectors of one length");
  at::Tensor hidden = stack->embed_format == 0
                          ? stack->embed.index_select(0, ids)
                          : eagle::cpu::embedding_q(ids, stack->embed, stack->embed_format, at::kBFloat16);
  return eagle::cpu::decoder_layers(hidden, stack->weights, stack->formats, eps, stack->cos.index_select(0, positions),
                                    stack->sin.index_select(0, positions), stack->kv, slot_mapping, block_tables,
                                    cu_seqlens_q, prefix_lens, tree_mask, num_q_heads, capture, capture_into,
                                    c10::nullopt);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(eagle, m) {
  m.def("decoder_layers(Tensor(a!) hidden, Tensor[] weights, int[] formats, float eps, Tensor cos, Tensor sin,"
        " Tensor(b!)[] kv, Tensor slot_mapping, Tensor block_tables, Tensor cu_seqlens_q, Tensor prefix_lens,"
        " Tensor? tree_mask, int num_q_heads, int[] capture, Tensor(c!)? capture_into, Tensor? first_input=None)"
        " -> (Tensor, Tensor[])");
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<at::Tensor>, at::Tensor, int64_t,
                       at::Tensor, at::Tensor>());
  // decoder_layers from token ids and positions over a bound stack (it writes the caches it holds)
  m.def("decoder_layers_bound(Tensor ids, Tensor positions, __torch__.torch.classes.eagle.DecoderStack stack,"
        " float eps, Tensor slot_mapping, Tensor block_tables, Tensor cu_seqlens_q, Tensor prefix_lens,"
        " Tensor? tree_mask, int num_q_heads, int[] capture, Tensor(c!)? capture_into) -> (Tensor, Tensor[])");
}

TORCH_LIBRARY_IMPL(eagle, CPU, m) {
  m.impl("decoder_layers", &eagle::cpu::decoder_layers);
  m.impl("decoder_layers_bound", &decoder_layers_bound);
}
