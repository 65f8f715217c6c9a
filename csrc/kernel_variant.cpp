// The staged/verified switch of the CUDA kernels and the rule that fits a staged kernel to a
// device (dblast/kernel_variant.h).
#include "dblast/kernel_variant.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>
#include <iterator>

#include "cuda/staged/promoted.h"

namespace dblast {
namespace {

constexpr int kUnset = -1;
std::atomic<int> current_variant{kUnset};

KernelVariant parse_variant(const std::string& name, const char* source) {
  if (name == "verified") return KernelVariant::kVerified;
  if (name == "staged") return KernelVariant::kStaged;
  TORCH_CHECK_VALUE(false, source, " must be \"verified\" or \"staged\", got \"", name, "\"");
}

const char* variant_name(KernelVariant variant) {
  return variant == KernelVariant::kStaged ? "staged" : "verified";
}

constexpr const char* kOpNames[] = {"branch_verify", "mixture_verify", "sample_tokens", "branch_argmax",
                                    "drafter_attention"};
static_assert(std::size(kOpNames) == static_cast<size_t>(StagedOp::kDrafterAttention) + 1, "one name per StagedOp");

StagedOp parse_op(const std::string& name) {
  for (int i = 0; i < static_cast<int>(std::size(kOpNames)); ++i) {
    if (name == kOpNames[i]) return static_cast<StagedOp>(i);
  }
  TORCH_CHECK_VALUE(false, "op must be one of branch_verify, mixture_verify, sample_tokens, branch_argmax, "
                    "drafter_attention, got \"", name, "\"");
}

// "compute capability 9.0 and 112 KB of shared memory per block" (the latter when it matters)
std::string lacking(StagedOp op, CudaDevice device) {
  const StagedNeeds need = staged_needs(op);
  std::string text = "its staged kernel needs compute capability " + std::to_string(need.major) + "." +
                     std::to_string(need.minor);
  if (need.shared_per_block > 0) {
    text += " and " + std::to_string(need.shared_per_block / 1024) + " KB of shared memory per block";
  }
  text += "; this GPU has " + std::to_string(device.major) + "." + std::to_string(device.minor);
  if (need.shared_per_block > 0) text += " and " + std::to_string(device.shared_per_block / 1024) + " KB";
  return text;
}

}  // namespace

KernelVariant cuda_kernel_variant() {
  int value = current_variant.load(std::memory_order_relaxed);
  if (value == kUnset) {
    const char* env = std::getenv("DBLAST_CUDA_KERNELS");
    const KernelVariant parsed =
        env == nullptr || *env == '\0' ? KernelVariant::kVerified : parse_variant(env, "DBLAST_CUDA_KERNELS");
    int expected = kUnset;
    current_variant.compare_exchange_strong(expected, static_cast<int>(parsed));
    value = current_variant.load(std::memory_order_relaxed);
  }
  return static_cast<KernelVariant>(value);
}

std::string cuda_kernels(const std::optional<std::string>& variant) {
  if (variant.has_value()) {
    current_variant.store(static_cast<int>(parse_variant(*variant, "variant")), std::memory_order_relaxed);
  }
  return variant_name(cuda_kernel_variant());
}

bool staged_kernel_serves(StagedOp op, bool promoted, CudaDevice device) {
  const bool asked = cuda_kernel_variant() == KernelVariant::kStaged;
  const CudaKernel kernel = cuda_kernel_for(op, promoted || asked, device);
  if (kernel == CudaKernel::kVerifiedOnThisDevice && asked) {
    static std::atomic<unsigned> warned{0};  // one bit per op: one line per op and process
    const unsigned bit = 1u << static_cast<int>(op);
    if ((warned.fetch_or(bit, std::memory_order_relaxed) & bit) == 0) {
      TORCH_WARN("dblast: staged CUDA kernels asked for, but ", kOpNames[static_cast<int>(op)], " runs its verified ",
                 "kernel: ", lacking(op, device));
    }
  }
  return kernel == CudaKernel::kStaged;
}

std::string describe_cuda_kernel_for(const std::string& name, int64_t major, int64_t minor, int64_t shared_per_block,
                                     const std::optional<std::string>& variant) {
  const StagedOp op = parse_op(name);
  const KernelVariant in_force = variant.has_value() ? parse_variant(*variant, "variant") : cuda_kernel_variant();
  const CudaDevice device{static_cast<int>(major), static_cast<int>(minor), shared_per_block};
  switch (cuda_kernel_for(op, cuda::staged::promoted(op) || in_force == KernelVariant::kStaged, device)) {
    case CudaKernel::kStaged: return "staged";
    case CudaKernel::kVerified: return "verified";
    case CudaKernel::kVerifiedOnThisDevice: return "verified (" + lacking(op, device) + ")";
  }
  return "verified";
}

}  // namespace dblast
