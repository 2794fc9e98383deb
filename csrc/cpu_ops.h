// The CPU kernels behind the eagle ops, callable directly from C++ (the fused decoder stack calls them
// without the dispatcher). Contracts: DESIGN.md and the op files.
#pragma once

#include <ATen/ATen.h>

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
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w);
at::Tensor linear_q(const at::Tensor& x, const at::Tensor& w, int64_t qtype);

}  // namespace eagle::cpu
