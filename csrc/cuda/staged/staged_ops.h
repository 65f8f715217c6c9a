// Entry points of the staged CUDA kernels: written ahead of a GPU run, compiled in every CUDA
// build, and reached only when dblast::cuda_kernel_variant() is kStaged (dblast/kernel_variant.h).
// Each op's verified launcher (csrc/cuda/<op>.cu) runs the op's host checks, identical for both
// variants, and then hands its checked arguments to the function here when the switch says so.
// A kernel leaves this folder when a device run passed its tests and the sanitizer
// (bench/promote_staged.py); docs/ops.md lists the verified and the staged kernel of each op.
#pragma once

#include <torch/types.h>

#include <optional>
#include <tuple>

namespace dblast::cuda::staged {

std::tuple<at::Tensor, at::Tensor, at::Tensor> branch_verify(const at::Tensor& target_logits,
                                                             const at::Tensor& branch_tokens,
                                                             const at::Tensor& branch_prior, const at::Tensor& branch,
                                                             const at::Tensor& uniforms, double temperature,
                                                             int64_t top_k, double top_p);

std::tuple<at::Tensor, at::Tensor, at::Tensor> mixture_verify(const at::Tensor& target_logits,
                                                              const at::Tensor& draft_logits,
                                                              const at::Tensor& branch_prior,
                                                              const at::Tensor& draft_tokens, const at::Tensor& uniforms,
                                                              double temperature, int64_t top_k, double top_p,
                                                              double draft_temperature);

std::tuple<at::Tensor, at::Tensor> sample_tokens(const at::Tensor& logits, const at::Tensor& uniforms,
                                                 double temperature, int64_t top_k, double top_p,
                                                 const at::Tensor& query_tokens);

std::tuple<at::Tensor, at::Tensor, at::Tensor> branch_argmax(const at::Tensor& hidden, const at::Tensor& lm_head_weight,
                                                             const std::optional<at::Tensor>& expander_weight,
                                                             const std::optional<at::Tensor>& expander_bias,
                                                             int64_t vocab_size);

at::Tensor drafter_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& k_block, const at::Tensor& v_block, const at::Tensor& context_lens,
                             double scale, int64_t window, bool causal);

}  // namespace dblast::cuda::staged
