// Argument checks shared by the CPU and CUDA bindings of the verifier ops. Every message
// names the offending argument (a ValueError in Python); all run before the op's kernel.
// Shape, dtype and device checks are free; value checks (NaN logits, a prior that is not a
// distribution, ...) read the data, cost one device sync on CUDA, and can be skipped by
// a caller that guarantees them (validate=False). Defined in csrc/checks/verify_checks.cpp:
// the checks are compiled by the C++ compiler only, never inside an nvcc translation unit
// (on the first H200 run, ValueErrors whose messages were formatted in nvcc-compiled host
// code crashed the process).
#pragma once

#include <ATen/Dispatch.h>
#include <torch/types.h>

#include "dblast/common.h"

// Dispatch over the logit dtypes the ops accept (float32, bfloat16, float16).
#define DBLAST_DISPATCH_LOGITS(TYPE, NAME, ...)                     \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) \
                                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace dblast {

void check_branch_verify_args(const at::Tensor& target_logits, const at::Tensor& branch_tokens,
                              const at::Tensor& branch_prior, const at::Tensor& branch, const at::Tensor& uniforms,
                              double temperature, int64_t top_k, double top_p);

void check_mixture_verify_args(const at::Tensor& target_logits, const at::Tensor& draft_logits,
                               const at::Tensor& branch_prior, const at::Tensor& draft_tokens,
                               const at::Tensor& uniforms, double temperature, int64_t top_k, double top_p,
                               double draft_temperature);

// The sparse-proposal verifier (a sampled chain whose proposal at each position is C candidate
// ids and their probabilities; DFlash2's candidate selector).
void check_sparse_verify_args(const at::Tensor& target_logits, const at::Tensor& draft_tokens,
                              const at::Tensor& proposal_tokens, const at::Tensor& proposal_probs,
                              const at::Tensor& uniforms, double temperature, int64_t top_k, double top_p);

void check_sample_tokens_args(const at::Tensor& logits, const at::Tensor& uniforms, double temperature,
                              int64_t top_k, double top_p, const at::Tensor& query_tokens);

// Value checks (one device sync on CUDA); skipped when the caller passes validate=False.
void check_branch_verify_values(const at::Tensor& target_logits, const at::Tensor& branch_tokens,
                                const at::Tensor& branch_prior, const at::Tensor& branch, const at::Tensor& uniforms);

void check_mixture_verify_values(const at::Tensor& target_logits, const at::Tensor& draft_logits,
                                 const at::Tensor& branch_prior, const at::Tensor& draft_tokens,
                                 const at::Tensor& uniforms);

void check_sparse_verify_values(const at::Tensor& target_logits, const at::Tensor& draft_tokens,
                                const at::Tensor& proposal_tokens, const at::Tensor& proposal_probs,
                                const at::Tensor& uniforms);

void check_sample_tokens_values(const at::Tensor& logits, const at::Tensor& uniforms,
                                const at::Tensor& query_tokens);

}  // namespace dblast
