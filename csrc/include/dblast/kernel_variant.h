// Which CUDA kernels serve the ops: the ones that last passed on a GPU ("verified", the
// default) or the ones written ahead of a device run ("staged"; docs/ops.md lists both per op).
// Set by the environment variable DBLAST_CUDA_KERNELS, read at the first CUDA call, or at any
// time by the op dblast::cuda_kernels (Python: dblast_ext.ops.cuda_kernels). CPU kernels have
// one variant and ignore it. Defined in csrc/kernel_variant.cpp, compiled by the C++ compiler
// only (errors formatted in nvcc-compiled host code have crashed a process before).
//
// A staged kernel also has to fit the device it would run on: the cluster kernels need
// sm_90's thread-block clusters and more shared memory per block than some newer GPUs give.
// cuda_kernel_for below is that rule, one pure function: the CUDA launchers call it with the
// device's properties, and the op dblast_rules::cuda_kernel_for exposes it to the CPU tests.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace dblast {

enum class KernelVariant { kVerified, kStaged };

// The variant in force (thread-safe; the environment variable is read once).
KernelVariant cuda_kernel_variant();

// Sets the variant when `variant` is given ("verified" or "staged"; anything else is a
// ValueError naming the argument); returns the name of the variant now in force.
std::string cuda_kernels(const std::optional<std::string>& variant);

// The ops that have a staged CUDA kernel (csrc/cuda/staged/).
enum class StagedOp { kBranchVerify, kMixtureVerify, kSampleTokens, kBranchArgmax, kDrafterAttention };

// Dynamic shared memory of one cluster block: its slice of the row (csrc/cuda/staged/cluster_row.cuh).
inline constexpr int64_t kClusterCacheBytes = 80 * 1024;
// Bound on a cluster kernel's static shared memory (27-30 KB on sm_90); .ci/cuda_compile_check
// fails any build whose ptxas report exceeds it, so the rule below never admits a launch that
// cannot fit.
inline constexpr int64_t kClusterStaticBytes = 32 * 1024;

// What a device offers a kernel: compute capability and opt-in shared memory per block.
struct CudaDevice {
  int major, minor;
  int64_t shared_per_block;
};

// What a staged kernel needs of the device.
struct StagedNeeds {
  int major, minor;
  int64_t shared_per_block;
};

constexpr StagedNeeds staged_needs(StagedOp op) {
  switch (op) {
    case StagedOp::kBranchVerify:
    case StagedOp::kMixtureVerify:
    case StagedOp::kSampleTokens:
      // thread-block clusters and distributed shared memory; the slice cache plus the reductions' state
      return {9, 0, kClusterCacheBytes + kClusterStaticBytes};
    case StagedOp::kBranchArgmax:
    case StagedOp::kDrafterAttention:
      // bf16 mma.sync and cp.async (drafter_attention's ring is at most 68 KB: every sm_80+ GPU fits it)
      return {8, 0, 0};
  }
  return {9, 0, 0};
}

constexpr bool device_runs_staged(StagedOp op, CudaDevice device) {
  const StagedNeeds need = staged_needs(op);
  const bool new_enough = device.major > need.major || (device.major == need.major && device.minor >= need.minor);
  return new_enough && device.shared_per_block >= need.shared_per_block;
}

enum class CudaKernel {
  kVerified,               // nothing asked for the staged kernel
  kStaged,                 // asked for (DBLAST_CUDA_KERNELS=staged, or promoted) and the device runs it
  kVerifiedOnThisDevice,   // asked for, but the device cannot run it: the verified kernel instead
};

// The rule: `staged_asked` is "the staged kernels are in force, or this op's was promoted".
constexpr CudaKernel cuda_kernel_for(StagedOp op, bool staged_asked, CudaDevice device) {
  if (!staged_asked) return CudaKernel::kVerified;
  return device_runs_staged(op, device) ? CudaKernel::kStaged : CudaKernel::kVerifiedOnThisDevice;
}

// The launchers' entry: cuda_kernel_for with the variant in force, saying once per op and
// process (a warning, one line) when DBLAST_CUDA_KERNELS=staged meets a device too old for it.
// A promoted kernel falls back silently: the default path must not warn on every older GPU.
bool staged_kernel_serves(StagedOp op, bool promoted, CudaDevice device);

// The op dblast_rules::cuda_kernel_for: "staged", "verified", or "verified (...)" naming what
// the device lacks, for op `name` (e.g. "branch_verify") on a device of the given compute
// capability and opt-in shared memory per block, with `variant` (default: the one in force).
std::string describe_cuda_kernel_for(const std::string& name, int64_t major, int64_t minor, int64_t shared_per_block,
                                     const std::optional<std::string>& variant);

}  // namespace dblast
