// Argument checks of dblast::branch_argmax shared by its CPU and CUDA bindings; each message
// names the offending argument (a ValueError in Python), raised before any kernel runs.
// Defined in csrc/checks/branch_argmax_checks.cpp, outside every nvcc translation unit (see
// dblast/verify_checks.h).
#pragma once

#include <torch/types.h>

#include <optional>

namespace dblast {

// Returns K (1 without an expander).
int64_t check_branch_argmax_args(const at::Tensor& hidden, const at::Tensor& lm_head_weight,
                                 const std::optional<at::Tensor>& expander_weight,
                                 const std::optional<at::Tensor>& expander_bias, int64_t vocab_size);

}  // namespace dblast
