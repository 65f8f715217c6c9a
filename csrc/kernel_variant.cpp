// The staged/verified switch of the CUDA kernels (dblast/kernel_variant.h).
#include "dblast/kernel_variant.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>

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

}  // namespace dblast
