// Entry points of the staged CUDA kernels: written ahead of a GPU run, compiled in every CUDA
// build (device code that needs sm_90 only for sm_90+), and reached only when use_staged below
// says so: the staged kernels in force (dblast/kernel_variant.h) or the op's promoted, on a
// device that can run it.
// Each op's verified launcher (csrc/cuda/<op>.cu) runs the op's host checks, identical for both
// variants, and then hands its checked arguments to the function here when the switch says so.
// A kernel leaves this folder when a device run passed its tests and the sanitizer
// (bench/promote_staged.py); docs/ops.md lists the verified and the staged kernel of each op.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>
#include <torch/types.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <optional>
#include <tuple>

#include "promoted.h"

namespace dblast::cuda::staged {

// Compute capability and opt-in shared memory per block of CUDA device `index`, read from the
// runtime once per device (ATen's cached properties come with ATen/cuda/CUDAContext.h, which
// needs the cuSPARSE headers that a bare nvcc toolkit, as on CI, does not have).
inline CudaDevice cuda_device(int index) {
  static std::array<std::atomic<uint64_t>, 64> known{};  // major << 48 | minor << 40 | bytes; 0: not read
  std::atomic<uint64_t>* slot = index >= 0 && index < 64 ? &known[index] : nullptr;
  uint64_t packed = slot != nullptr ? slot->load(std::memory_order_relaxed) : 0;
  if (packed == 0) {
    int major = 0, minor = 0, shared = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, index));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, index));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&shared, cudaDevAttrMaxSharedMemoryPerBlockOptin, index));
    packed = static_cast<uint64_t>(major) << 48 | static_cast<uint64_t>(minor) << 40 | static_cast<uint32_t>(shared);
    if (slot != nullptr) slot->store(packed, std::memory_order_relaxed);
  }
  return {static_cast<int>(packed >> 48), static_cast<int>((packed >> 40) & 0xff),
          static_cast<int64_t>(packed & 0xffffffffu)};
}

// Whether `op`'s call on the device of `on` goes to its staged kernel; the device is looked at
// only when a staged kernel was asked for.
inline bool use_staged(Op op, const at::Tensor& on) {
  if (!promoted(op) && cuda_kernel_variant() != KernelVariant::kStaged) return false;
  return staged_kernel_serves(op, promoted(op), cuda_device(on.device().index()));
}

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
