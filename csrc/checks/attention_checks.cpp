// Argument checks of dblast::drafter_attention (declared in dblast/attention_checks.h),
// compiled by the C++ compiler for both the CPU and CUDA bindings.
#include "dblast/attention_checks.h"

#include <c10/util/StringUtil.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <utility>
#include <vector>

namespace dblast {

void check_drafter_attention_args(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& k_block, const at::Tensor& v_block, const at::Tensor& context_lens,
                                  double scale, int64_t window) {
  TORCH_CHECK_VALUE(q.dim() == 4, "q must be [N, Hq, B, D], got ", q.sizes());
  TORCH_CHECK_VALUE(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
                    "q must be float32, bfloat16 or float16, got ", q.scalar_type());
  const int64_t rows = q.size(0), heads = q.size(1), block = q.size(2), dim = q.size(3);
  TORCH_CHECK_VALUE(block >= 1 && dim >= 1, "q must have B >= 1 and D >= 1, got ", q.sizes());
  TORCH_CHECK_VALUE(k_cache.dim() == 4 && k_cache.size(0) == rows && k_cache.size(3) == dim,
                    "k_cache must be [", rows, ", Hkv, L_max, ", dim, "], got ", k_cache.sizes());
  const int64_t kv_heads = k_cache.size(1);
  TORCH_CHECK_VALUE(kv_heads >= 1 && heads % kv_heads == 0, "q's heads (", heads,
                    ") must be a multiple of k_cache's heads (", kv_heads, ")");
  TORCH_CHECK_VALUE(v_cache.sizes() == k_cache.sizes(), "v_cache must have k_cache's shape ", k_cache.sizes(),
                    ", got ", v_cache.sizes());
  const std::vector<int64_t> block_shape{rows, kv_heads, block, dim};
  TORCH_CHECK_VALUE(k_block.sizes() == at::IntArrayRef(block_shape), "k_block must be ", at::IntArrayRef(block_shape),
                    ", got ", k_block.sizes());
  TORCH_CHECK_VALUE(v_block.sizes() == at::IntArrayRef(block_shape), "v_block must be ", at::IntArrayRef(block_shape),
                    ", got ", v_block.sizes());
  const std::pair<const at::Tensor*, const char*> same[] = {
      {&k_cache, "k_cache"}, {&v_cache, "v_cache"}, {&k_block, "k_block"}, {&v_block, "v_block"}};
  for (const auto& [t, name] : same) {
    TORCH_CHECK_VALUE(t->scalar_type() == q.scalar_type(), name, " must have q's dtype ", q.scalar_type(), ", got ",
                      t->scalar_type());
    TORCH_CHECK_VALUE(t->device() == q.device(), name, " must be on ", q.device(), " like q, got ", t->device());
  }
  TORCH_CHECK_VALUE(context_lens.dim() == 1 && context_lens.size(0) == rows, "context_lens must be [", rows,
                    "], got ", context_lens.sizes());
  TORCH_CHECK_VALUE(context_lens.scalar_type() == at::kInt, "context_lens must be int32, got ",
                    context_lens.scalar_type());
  TORCH_CHECK_VALUE(context_lens.device() == q.device(), "context_lens must be on ", q.device(), ", got ",
                    context_lens.device());
  TORCH_CHECK_VALUE(std::isfinite(scale) && scale > 0, "scale must be finite and > 0, got ", scale);
  TORCH_CHECK_VALUE(window != 0, "window must be -1 (off) or > 0, got 0");
  TORCH_CHECK_VALUE(window >= -1, "window must be -1 (off) or > 0, got ", window);
}

void check_context_lens(const at::Tensor& context_lens, int64_t max_len) {
  const at::Tensor bad = context_lens.lt(0).logical_or(context_lens.gt(max_len));
  if (!bad.any().item<bool>()) return;
  const int64_t row = bad.nonzero()[0][0].item<int64_t>();
  TORCH_CHECK_VALUE(false, "context_lens must lie in [0, L_max = ", max_len, "], got ",
                    context_lens[row].item<int>(), " at row ", row);
}

void check_cuda_head_dim(const at::Tensor& q) {
  const int64_t dim = q.size(3);
  const bool supported = std::find(kCudaHeadDims.begin(), kCudaHeadDims.end(), dim) != kCudaHeadDims.end();
  TORCH_CHECK_VALUE(supported, "q's head dim D must be one of ", c10::Join(", ", kCudaHeadDims), " on CUDA, got ", dim);
}

void check_cuda_attention_launch(const at::Tensor& q, const at::Tensor& k_cache, int64_t shared_bytes,
                                 int64_t device_shared_limit) {
  TORCH_CHECK_VALUE(shared_bytes <= device_shared_limit, "q's head dim D = ", q.size(3), " needs ", shared_bytes,
                    " bytes of shared memory per block on CUDA; this GPU allows ", device_shared_limit);
  const int64_t pairs = q.size(0) * k_cache.size(1);
  TORCH_CHECK_VALUE(pairs <= 65535, "q's N (", q.size(0), ") x k_cache's KV heads (", k_cache.size(1), ") = ", pairs,
                    " exceeds the 65,535 one CUDA launch takes; split the batch");
}

}  // namespace dblast
