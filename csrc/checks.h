// Argument validation shared by the CPU ops and the CUDA bindings. Failures raise ValueError in
// Python (TORCH_CHECK_VALUE), matching the checks of the Python launchers.
#pragma once

#include <ATen/ATen.h>

#include <optional>

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

// Host-side structural checks (CPU ops only: a device check would need a synchronisation).
inline void check_tree_values(const int32_t* parents, const int32_t* sizes, int64_t B, int64_t N) {
  for (int64_t b = 0; b < B; ++b) {
    const int32_t n = sizes[b];
    TORCH_CHECK_VALUE(n >= 1 && n <= N, "sizes[", b, "] = ", n, " is outside [1, ", N, "]");
    const int32_t* par = parents + b * N;
    TORCH_CHECK_VALUE(par[0] == -1, "parents[", b, ", 0] must be -1 (root), got ", par[0]);
    for (int32_t i = 1; i < n; ++i) {
      TORCH_CHECK_VALUE(par[i] >= 0 && par[i] < i, "parents[", b, ", ", i, "] = ", par[i],
                        " breaks BFS order (0 <= parent < node)");
    }
  }
}

}  // namespace eagle
