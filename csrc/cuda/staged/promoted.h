// Which staged CUDA kernels a device run has promoted: written by bench/promote_staged.py, only
// for an op whose staged kernel passed its CUDA tests and compute-sanitizer on that run (the run
// is named beside it). A promoted kernel serves the op by default ("verified" means the kernels
// that passed on a GPU); DBLAST_CUDA_KERNELS=staged selects every staged kernel, promoted or not.
// Either way only on a device that can run it (dblast/kernel_variant.h's cuda_kernel_for).
// Plain C++: csrc/kernel_variant.cpp reads it too.
#pragma once

#include "dblast/kernel_variant.h"

namespace dblast::cuda::staged {

using Op = StagedOp;

// promote_staged.py rewrites the values (and the comments naming the run) of these lines only
inline constexpr bool kPromotedBranchVerify = false;      // promoted by: none
inline constexpr bool kPromotedMixtureVerify = false;     // promoted by: none
inline constexpr bool kPromotedSampleTokens = false;      // promoted by: none
inline constexpr bool kPromotedBranchArgmax = false;      // promoted by: none
inline constexpr bool kPromotedDrafterAttention = false;  // promoted by: none

constexpr bool promoted(Op op) {
  switch (op) {
    case Op::kBranchVerify: return kPromotedBranchVerify;
    case Op::kMixtureVerify: return kPromotedMixtureVerify;
    case Op::kSampleTokens: return kPromotedSampleTokens;
    case Op::kBranchArgmax: return kPromotedBranchArgmax;
    case Op::kDrafterAttention: return kPromotedDrafterAttention;
  }
  return false;
}

}  // namespace dblast::cuda::staged
