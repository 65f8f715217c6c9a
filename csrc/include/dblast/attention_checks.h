// Argument checks of dblast::drafter_attention shared by its CPU and CUDA bindings; each
// message names the offending argument (a ValueError in Python), raised before any kernel.
// Defined in csrc/checks/attention_checks.cpp, outside every nvcc translation unit (see
// dblast/verify_checks.h).
#pragma once

#include <torch/types.h>

#include <array>

#include "dblast/attention_window.h"

namespace dblast {

void check_drafter_attention_args(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& k_block, const at::Tensor& v_block, const at::Tensor& context_lens,
                                  double scale, int64_t window);

// context_lens values in [0, L_max]; reads the lengths (one sync on CUDA).
void check_context_lens(const at::Tensor& context_lens, int64_t max_len);

// The head dims the CUDA kernel is instantiated for: csrc/cuda/drafter_attention.cu makes one
// instantiation per entry, and the error message lists them.
inline constexpr auto kCudaHeadDims = std::to_array<int64_t>({16, 32, 64, 96, 128, 256});
void check_cuda_head_dim(const at::Tensor& q);

// What one CUDA launch can take: `shared_bytes` of shared memory per block (from q's head dim)
// within the device's opt-in limit, and at most 65,535 (row, KV head) pairs (a grid dimension).
void check_cuda_attention_launch(const at::Tensor& q, const at::Tensor& k_cache, int64_t shared_bytes,
                                 int64_t device_shared_limit);

}  // namespace dblast
