// Argument validation shared by the CPU ops and the CUDA bindings. Failures raise ValueError in
// Python (TORCH_CHECK_VALUE), matching the checks of the Python launchers, which run first: these are
// the backstop for direct torch.ops.eagle calls.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>

namespace eagle {

inline void check_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype,
                         at::IntArrayRef shape) {
  TORCH_CHECK_VALUE(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.sizes() == shape, name, " must have shape ", shape, ", got ", t.sizes());
}

inline void check_device(const at::Tensor& ref, const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), name, " is on ", t.device(),
                    " but parents is on ", ref.device());
}

// parents: int32 [B, N], sizes: int32 [B].
inline void check_tree_args(const at::Tensor& parents, const at::Tensor& sizes) {
  TORCH_CHECK_VALUE(parents.dim() == 2 && parents.size(1) >= 1,
                    "parents must be [B, N] with N >= 1, got shape ", parents.sizes());
  check_tensor(parents, "parents", at::kInt, parents.sizes());
  check_tensor(sizes, "sizes", at::kInt, {parents.size(0)});
  check_device(parents, sizes, "sizes");
}

// tokens: int64 [B, N]; the tree arguments as above.
inline void check_accept_args(const at::Tensor& parents, const at::Tensor& tokens,
                              const at::Tensor& sizes) {
  check_tree_args(parents, sizes);
  check_tensor(tokens, "tokens", at::kLong, parents.sizes());
  check_device(parents, tokens, "tokens");
}

// probs: fp32 [B, N, V] with V >= 1.
inline void check_probs(const at::Tensor& parents, const at::Tensor& probs, const char* name) {
  TORCH_CHECK_VALUE(probs.dim() == 3 && probs.size(2) >= 1, name,
                    " must be [B, N, V] with V >= 1, got shape ", probs.sizes());
  check_tensor(probs, name, at::kFloat, {parents.size(0), parents.size(1), probs.size(2)});
  check_device(parents, probs, name);
}

// The arguments of tree_accept_sample (CPU and CUDA): the tree, target_probs [B, N, V], uniforms fp32
// [B, N + 1] and optional draft_probs of the same shape as target_probs.
inline void check_sample_args(const at::Tensor& parents, const at::Tensor& tokens, const at::Tensor& sizes,
                              const at::Tensor& probs, const at::Tensor& uniforms,
                              const std::optional<at::Tensor>& draft) {
  check_accept_args(parents, tokens, sizes);
  check_probs(parents, probs, "target_probs");
  check_tensor(uniforms, "uniforms", at::kFloat, {parents.size(0), parents.size(1) + 1});
  check_device(parents, uniforms, "uniforms");
  if (draft) {
    check_probs(parents, *draft, "draft_probs");
    TORCH_CHECK_VALUE(draft->size(2) == probs.size(2), "draft_probs has vocabulary ", draft->size(2),
                      " but target_probs has ", probs.size(2));
  }
}

// Host-side value checks (CPU tensors only: on a device they would need a synchronisation). Each
// returns the first problem as a message, or "" when the values are valid; they never throw, so the
// non-throwing `tree_errors` op and the throwing checks of the ops share them.
inline std::string tree_value_error(const int32_t* parents, const int32_t* sizes, int64_t B, int64_t N) {
  for (int64_t b = 0; b < B; ++b) {
    const int32_t n = sizes[b];
    if (n < 1 || n > N) return c10::str("sizes[", b, "] = ", n, " is outside [1, ", N, "]");
    const int32_t* par = parents + b * N;
    if (par[0] != -1) return c10::str("parents[", b, ", 0] must be -1 (root), got ", par[0]);
    for (int32_t i = 1; i < n; ++i) {
      if (par[i] < 0 || par[i] >= i) {
        return c10::str("parents[", b, ", ", i, "] = ", par[i], " breaks BFS order (0 <= parent < node)");
      }
    }
  }
  return {};
}

// Draft tokens of the valid non-root nodes must index the vocabulary [0, V); sizes already valid.
inline std::string token_value_error(const int64_t* tokens, const int32_t* sizes, int64_t B, int64_t N,
                                     int64_t V) {
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 1; i < sizes[b]; ++i) {
      const int64_t x = tokens[b * N + i];
      if (x < 0 || x >= V) {
        return c10::str("tokens[", b, ", ", i, "] = ", x, " is outside the vocabulary [0, ", V, ")");
      }
    }
  }
  return {};
}

inline void check_tree_values(const int32_t* parents, const int32_t* sizes, int64_t B, int64_t N) {
  const std::string err = tree_value_error(parents, sizes, B, N);
  TORCH_CHECK_VALUE(err.empty(), err);
}

}  // namespace eagle
