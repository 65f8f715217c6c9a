// Which CUDA kernels serve the ops: the ones that last passed on a GPU ("verified", the
// default) or the ones written ahead of a device run ("staged"; docs/ops.md lists both per op).
// Set by the environment variable DBLAST_CUDA_KERNELS, read at the first CUDA call, or at any
// time by the op dblast::cuda_kernels (Python: dblast_ext.ops.cuda_kernels). CPU kernels have
// one variant and ignore it. Defined in csrc/kernel_variant.cpp, compiled by the C++ compiler
// only (errors formatted in nvcc-compiled host code have crashed a process before).
#pragma once

#include <optional>
#include <string>

namespace dblast {

enum class KernelVariant { kVerified, kStaged };

// The variant in force (thread-safe; the environment variable is read once).
KernelVariant cuda_kernel_variant();

// Sets the variant when `variant` is given ("verified" or "staged"; anything else is a
// ValueError naming the argument); returns the name of the variant now in force.
std::string cuda_kernels(const std::optional<std::string>& variant);

}  // namespace dblast
