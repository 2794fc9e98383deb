// The Llama decoder stack in one call, for CPU steps of a few tokens per sequence (decode, draft chains,
// tree verification). Each layer is what engine/model.py's DecoderLayer computes, with the same kernels in
// the same order, so the result is bit-identical to the per-op forward; what goes away is the host time
// between kernels (~9 Python launcher calls and dispatcher hops per layer, ~1.5 ms a token for a 30-layer
// model, a quarter of a quantized decode step).
//
// weights: per layer [input_norm [H], qkv, o, post_norm [H], gate_up, down], then the final norm [H];
// formats: per layer the four linears' formats, 0 = a bf16 [N, K] weight (linear_bf16), 3 / 8 = a Q4_1 / Q8_0
// weight in eagle_kernels.quant's layout (linear_q). kv: per layer its k and v caches.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "cpu_ops.h"

namespace {

constexpr int64_t kPerLayer = 6, kLinears = 4;

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, int64_t format) {
  return format == 0 ? eagle::cpu::linear_bf16(x, w) : eagle::cpu::linear_q(x, w, format);
}

// -> (final_norm(hidden after the last layer) [T, H], the inputs of the layers in `capture`; none when
// `capture_into` [slots, capture.size() * H] is given: the inputs are written there instead, side by side,
// row slot_mapping[t] for token t, the same bf16 values). hidden [T, H]: the embeddings; it carries the
// residual stream and is updated in place.
std::tuple<at::Tensor, std::vector<at::Tensor>> decoder_layers(
    at::Tensor& hidden, at::TensorList weights, at::IntArrayRef formats, double eps, const at::Tensor& cos,
    const at::Tensor& sin, at::TensorList kv, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& cu_seqlens_q, const at::Tensor& prefix_lens, const c10::optional<at::Tensor>& tree_mask,
    int64_t num_q_heads, at::IntArrayRef capture, const c10::optional<at::Tensor>& capture_into) {
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
  std::vector<at::Tensor> captured;
  at::Tensor delta;  // the previous layer's MLP output, not yet added to `hidden`
  for (int64_t i = 0; i < L; ++i) {
    const at::Tensor* w = weights.data() + kPerLayer * i;
    const int64_t* f = formats.data() + kLinears * i;
    const auto k = std::find(capture.begin(), capture.end(), i) - capture.begin();
    if (k < static_cast<int64_t>(capture.size()) && slots) {  // hidden + delta, rounded once, as at::add does
      const at::BFloat16* h = hidden.data_ptr<at::BFloat16>();
      const at::BFloat16* d = delta.defined() ? delta.data_ptr<at::BFloat16>() : nullptr;
      at::BFloat16* out = capture_into->data_ptr<at::BFloat16>();
      const int64_t width = capture_into->size(1);
      for (int64_t t = 0; t < T; ++t) {
        at::BFloat16* row = out + slots[t] * width + k * H;
        for (int64_t j = 0; j < H; ++j) {
          row[j] = d ? at::BFloat16(static_cast<float>(h[t * H + j]) + static_cast<float>(d[t * H + j])) : h[t * H + j];
        }
      }
    } else if (k < static_cast<int64_t>(capture.size())) {
      captured.push_back(delta.defined() ? hidden + delta : hidden.clone());
    }
    at::Tensor x = delta.defined() ? eagle::cpu::rms_norm(delta, w[0], eps, hidden)
                                   : eagle::cpu::rms_norm(hidden, w[0], eps, c10::nullopt);
    at::Tensor k_cache = kv[2 * i], v_cache = kv[2 * i + 1];
    const at::Tensor q = eagle::cpu::rope_write_kv(linear(x, w[1], f[0]), cos, sin, k_cache, v_cache, slot_mapping,
                                                   num_q_heads);
    const at::Tensor o = eagle::cpu::paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens,
                                                     tree_mask, c10::nullopt);
    x = eagle::cpu::rms_norm(linear(o.view({T, -1}), w[2], f[1]), w[3], eps, hidden);
    delta = linear(eagle::cpu::silu_and_mul(linear(x, w[4], f[2])), w[5], f[3]);
  }
  return {eagle::cpu::rms_norm(delta, weights.back(), eps, hidden), captured};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(eagle, m) {
  m.def("decoder_layers(Tensor(a!) hidden, Tensor[] weights, int[] formats, float eps, Tensor cos, Tensor sin,"
        " Tensor(b!)[] kv, Tensor slot_mapping, Tensor block_tables, Tensor cu_seqlens_q, Tensor prefix_lens,"
        " Tensor? tree_mask, int num_q_heads, int[] capture, Tensor(c!)? capture_into) -> (Tensor, Tensor[])");
}

TORCH_LIBRARY_IMPL(eagle, CPU, m) {
  m.impl("decoder_layers", &decoder_layers);
}
