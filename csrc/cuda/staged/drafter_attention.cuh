// What the staged tensor-core drafter_attention (csrc/cuda/staged/drafter_attention.cu) takes:
// bfloat16 and float16 inputs with a head dim in kStagedAttentionHeadDims (mma.sync has no
// float32 inputs at float32 precision, and these dims keep the accumulators in registers
// without spilling). The verified launcher (csrc/cuda/drafter_attention.cu) sends everything
// else (float32, D = 16 or 256) to the verified kernel even when the staged kernels are in force.
#pragma once

#include <torch/types.h>

#include <array>
#include <cstdint>

namespace dblast::cuda::staged {

inline constexpr auto kStagedAttentionHeadDims = std::to_array<int64_t>({32, 64, 96, 128});

inline bool drafter_attention_covers(at::ScalarType dtype, int64_t dim) {
  if (dtype != at::kBFloat16 && dtype != at::kHalf) return false;
  for (const int64_t d : kStagedAttentionHeadDims) {
    if (d == dim) return true;
  }
  return false;
}

}  // namespace dblast::cuda::staged
