// Argument checks of dblast::branch_argmax (declared in dblast/branch_argmax_checks.h),
// compiled by the C++ compiler for both the CPU and CUDA bindings.
#include "dblast/branch_argmax_checks.h"

namespace dblast {
namespace {

bool is_supported_float(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf;
}

}  // namespace

// Returns K (1 without an expander).
int64_t check_branch_argmax_args(const at::Tensor& hidden, const at::Tensor& lm_head_weight,
                                 const std::optional<at::Tensor>& expander_weight,
                                 const std::optional<at::Tensor>& expander_bias, int64_t vocab_size) {
  TORCH_CHECK_VALUE(hidden.dim() == 2, "hidden must be [N, H], got ", hidden.sizes());
  TORCH_CHECK_VALUE(is_supported_float(hidden), "hidden must be float32, bfloat16 or float16, got ",
                    hidden.scalar_type());
  const int64_t width = hidden.size(1);
  TORCH_CHECK_VALUE(width >= 1, "hidden must have H >= 1, got ", hidden.sizes());
  TORCH_CHECK_VALUE(lm_head_weight.dim() == 2 && lm_head_weight.size(1) == width,
                    "lm_head_weight must be [V, ", width, "] (H from hidden), got ", lm_head_weight.sizes());
  TORCH_CHECK_VALUE(lm_head_weight.scalar_type() == hidden.scalar_type(), "lm_head_weight must have hidden's dtype ",
                    hidden.scalar_type(), ", got ", lm_head_weight.scalar_type());
  TORCH_CHECK_VALUE(lm_head_weight.device() == hidden.device(), "lm_head_weight must be on ", hidden.device(),
                    " like hidden, got ", lm_head_weight.device());
  TORCH_CHECK_VALUE(vocab_size >= 1 && vocab_size <= lm_head_weight.size(0), "vocab_size must be in [1, ",
                    lm_head_weight.size(0), "] (the LM head's rows), got ", vocab_size);
  TORCH_CHECK_VALUE(expander_weight.has_value() == expander_bias.has_value(),
                    "expander_weight and expander_bias must be given together");
  if (!expander_weight.has_value()) return 1;
  const at::Tensor& w = *expander_weight;
  const at::Tensor& b = *expander_bias;
  TORCH_CHECK_VALUE(w.dim() == 2 && w.size(1) == width, "expander_weight must be [K*H, ", width, "], got ",
                    w.sizes());
  TORCH_CHECK_VALUE(w.size(0) % width == 0 && w.size(0) >= width,
                    "expander_weight rows must be a multiple K*H of H = ", width, ", got ", w.size(0));
  TORCH_CHECK_VALUE(b.dim() == 1 && b.size(0) == w.size(0), "expander_bias must be [", w.size(0), "], got ",
                    b.sizes());
  TORCH_CHECK_VALUE(w.scalar_type() == hidden.scalar_type(), "expander_weight must have hidden's dtype ",
                    hidden.scalar_type(), ", got ", w.scalar_type());
  TORCH_CHECK_VALUE(b.scalar_type() == hidden.scalar_type(), "expander_bias must have hidden's dtype ",
                    hidden.scalar_type(), ", got ", b.scalar_type());
  TORCH_CHECK_VALUE(w.device() == hidden.device(), "expander_weight must be on ", hidden.device(), ", got ",
                    w.device());
  TORCH_CHECK_VALUE(b.device() == hidden.device(), "expander_bias must be on ", hidden.device(), ", got ",
                    b.device());
  return w.size(0) / width;
}

}  // namespace dblast
