// Argument and value checks of the verifier ops and sample_tokens (declared in
// dblast/verify_checks.h), compiled by the C++ compiler for both the CPU and CUDA bindings.
#include "dblast/verify_checks.h"

#include <ATen/Parallel.h>

#include <atomic>
#include <cmath>
#include <string>
#include <vector>

#include "dblast/common.h"

namespace dblast {
namespace {

void check_floating_logits(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16 ||
                  t.scalar_type() == at::kHalf,
              name, " must be float32, bfloat16 or float16, got ", t.scalar_type());
}

void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* name) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), name, " must be on ", ref.device(), " like target_logits, got ",
              t.device());
}

// the sampling settings' one rule, worded as dblast_ext/sampling.py words it (direct torch.ops
// calls skip the Python wrappers): a negative top_k or a top_p above 1 is a mistake, not "off"
void check_filter_args(double temperature, int64_t top_k, double top_p) {
  TORCH_CHECK_VALUE(std::isfinite(temperature) && temperature >= 0.0,
              "temperature must be a finite number >= 0 (0 = greedy), got ", temperature);
  TORCH_CHECK_VALUE(top_k >= 0, "top_k must be an integer >= 0 (0 = off), got ", top_k);
  TORCH_CHECK_VALUE(top_p > 0.0 && top_p <= 1.0, "top_p must be a number in (0, 1] (1 = off), got ", top_p);
}

void check_uniforms(const at::Tensor& uniforms, int64_t rows, int64_t num_draft, const at::Tensor& ref) {
  check_same_device(uniforms, ref, "uniforms");
  TORCH_CHECK_VALUE(uniforms.scalar_type() == at::kFloat || uniforms.scalar_type() == at::kDouble,
              "uniforms must be float32 or float64, got ", uniforms.scalar_type());
  TORCH_CHECK_VALUE(uniforms.dim() == 2 && uniforms.size(0) == rows && uniforms.size(1) == num_draft + 1,
              "uniforms must have shape [", rows, ", ", num_draft + 1, "], got ", uniforms.sizes());
}

void check_prior(const at::Tensor& prior, int64_t rows, int64_t num_branches, const at::Tensor& ref) {
  check_same_device(prior, ref, "branch_prior");
  TORCH_CHECK_VALUE(prior.scalar_type() == at::kFloat, "branch_prior must be float32, got ", prior.scalar_type());
  TORCH_CHECK_VALUE(prior.dim() == 2 && prior.size(0) == rows && prior.size(1) == num_branches,
              "branch_prior must have shape [", rows, ", ", num_branches, "] (K from the branch tensor), got ",
              prior.sizes());
  TORCH_CHECK_VALUE(num_branches >= 1 && num_branches <= kMaxBranches, "the number of branches K must be in [1, ",
              kMaxBranches, "], got ", num_branches);
}

void check_target_logits(const at::Tensor& target_logits) {
  check_floating_logits(target_logits, "target_logits");
  TORCH_CHECK_VALUE(target_logits.dim() == 3, "target_logits must be [N, b+1, V], got ", target_logits.sizes());
  TORCH_CHECK_VALUE(target_logits.size(1) >= 2, "target_logits must cover at least one draft and the bonus position "
              "(b+1 >= 2), got ", target_logits.size(1));
  TORCH_CHECK_VALUE(target_logits.size(2) >= 1, "target_logits must have a vocabulary of at least 1, got ",
              target_logits.size(2));
}

// Value checks, batched into one flag tensor so that a CUDA input costs a single sync.
struct ValueCheck {
  at::Tensor ok;  // bool scalar
  std::string message;
};

void run_value_checks(const std::vector<ValueCheck>& checks) {
  std::vector<at::Tensor> flags;
  for (const auto& c : checks) flags.push_back(c.ok.reshape({1}));
  const at::Tensor host = at::cat(flags).to(at::kCPU);
  const bool* ok = host.data_ptr<bool>();
  for (size_t i = 0; i < checks.size(); ++i) TORCH_CHECK_VALUE(ok[i], checks[i].message);
}

// True when no element has an all-ones exponent (NaN or inf). On the CPU this is an
// integer OR-reduction over the raw bits, ~20x cheaper than at::isfinite(t).all().
template <typename bits_t>
bool exponent_never_saturated(const at::Tensor& t, bits_t exponent_mask) {
  const at::Tensor c = t.contiguous();
  const bits_t* bits = reinterpret_cast<const bits_t*>(c.data_ptr());
  std::atomic<bool> saturated{false};
  at::parallel_for(0, c.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
    bits_t hit = 0;
    for (int64_t i = begin; i < end; ++i) hit |= static_cast<bits_t>((bits[i] & exponent_mask) == exponent_mask);
    if (hit) saturated = true;
  });
  return !saturated;
}

ValueCheck finite_check(const at::Tensor& t, const char* name) {
  const std::string message = std::string(name) + " contains NaN or infinite values";
  if (!t.is_cpu()) return {at::isfinite(t).all(), message};
  bool finite = true;
  switch (t.scalar_type()) {
    case at::kFloat: finite = exponent_never_saturated<uint32_t>(t, 0x7f800000u); break;
    case at::kBFloat16: finite = exponent_never_saturated<uint16_t>(t, 0x7f80u); break;
    case at::kHalf: finite = exponent_never_saturated<uint16_t>(t, 0x7c00u); break;
    default: finite = at::isfinite(t).all().item<bool>();
  }
  return {at::scalar_tensor(finite, at::kBool), message};
}

ValueCheck range_check(const at::Tensor& t, int64_t high, const char* name) {
  return {t.ge(0).logical_and(t.lt(high)).all(),
          std::string(name) + " has entries outside [0, " + std::to_string(high) + ")"};
}

std::vector<ValueCheck> common_value_checks(const at::Tensor& target_logits, const at::Tensor& prior,
                                            const at::Tensor& uniforms) {
  return {
      finite_check(target_logits, "target_logits"),
      {prior.ge(0).logical_and(at::isfinite(prior)).all(), "branch_prior must have finite entries >= 0"},
      {prior.sum(1).sub(1.0).abs().le(1e-4).all(), "branch_prior rows must sum to 1 (within 1e-4)"},
      {uniforms.ge(0).logical_and(uniforms.lt(1)).all(), "uniforms must lie in [0, 1)"},
  };
}

}  // namespace

void check_branch_verify_args(const at::Tensor& target_logits, const at::Tensor& branch_tokens,
                              const at::Tensor& branch_prior, const at::Tensor& branch,
                              const at::Tensor& uniforms, double temperature, int64_t top_k,
                              double top_p) {
  check_target_logits(target_logits);
  const int64_t rows = target_logits.size(0), num_draft = target_logits.size(1) - 1;
  check_same_device(branch_tokens, target_logits, "branch_tokens");
  TORCH_CHECK_VALUE(branch_tokens.scalar_type() == at::kLong, "branch_tokens must be int64, got ",
              branch_tokens.scalar_type());
  TORCH_CHECK_VALUE(branch_tokens.dim() == 3 && branch_tokens.size(0) == rows && branch_tokens.size(2) == num_draft,
              "branch_tokens must have shape [", rows, ", K, ", num_draft, "], got ", branch_tokens.sizes());
  check_prior(branch_prior, rows, branch_tokens.size(1), target_logits);
  check_same_device(branch, target_logits, "branch");
  TORCH_CHECK_VALUE(branch.scalar_type() == at::kLong, "branch must be int64, got ", branch.scalar_type());
  TORCH_CHECK_VALUE(branch.dim() == 1 && branch.size(0) == rows, "branch must have shape [", rows, "], got ",
              branch.sizes());
  check_uniforms(uniforms, rows, num_draft, target_logits);
  check_filter_args(temperature, top_k, top_p);
}

void check_mixture_verify_args(const at::Tensor& target_logits, const at::Tensor& draft_logits,
                               const at::Tensor& branch_prior, const at::Tensor& draft_tokens,
                               const at::Tensor& uniforms, double temperature, int64_t top_k,
                               double top_p, double draft_temperature) {
  check_target_logits(target_logits);
  const int64_t rows = target_logits.size(0), num_draft = target_logits.size(1) - 1;
  const int64_t vocab = target_logits.size(2);
  check_same_device(draft_logits, target_logits, "draft_logits");
  check_floating_logits(draft_logits, "draft_logits");
  TORCH_CHECK_VALUE(draft_logits.dim() == 4 && draft_logits.size(0) == rows && draft_logits.size(2) == num_draft &&
                  draft_logits.size(3) == vocab,
              "draft_logits must have shape [", rows, ", K, ", num_draft, ", ", vocab, "], got ",
              draft_logits.sizes());
  check_prior(branch_prior, rows, draft_logits.size(1), target_logits);
  check_same_device(draft_tokens, target_logits, "draft_tokens");
  TORCH_CHECK_VALUE(draft_tokens.scalar_type() == at::kLong, "draft_tokens must be int64, got ",
              draft_tokens.scalar_type());
  TORCH_CHECK_VALUE(draft_tokens.dim() == 2 && draft_tokens.size(0) == rows && draft_tokens.size(1) == num_draft,
              "draft_tokens must have shape [", rows, ", ", num_draft, "], got ", draft_tokens.sizes());
  check_uniforms(uniforms, rows, num_draft, target_logits);
  check_filter_args(temperature, top_k, top_p);
  TORCH_CHECK_VALUE(std::isfinite(draft_temperature) && draft_temperature > 0.0,
              "draft_temperature must be finite and > 0, got ", draft_temperature);
}

void check_sparse_verify_args(const at::Tensor& target_logits, const at::Tensor& draft_tokens,
                              const at::Tensor& proposal_tokens, const at::Tensor& proposal_probs,
                              const at::Tensor& uniforms, double temperature, int64_t top_k, double top_p) {
  check_target_logits(target_logits);
  const int64_t rows = target_logits.size(0), num_draft = target_logits.size(1) - 1;
  check_same_device(draft_tokens, target_logits, "draft_tokens");
  TORCH_CHECK_VALUE(draft_tokens.scalar_type() == at::kLong, "draft_tokens must be int64, got ",
              draft_tokens.scalar_type());
  TORCH_CHECK_VALUE(draft_tokens.dim() == 2 && draft_tokens.size(0) == rows && draft_tokens.size(1) == num_draft,
              "draft_tokens must have shape [", rows, ", ", num_draft, "], got ", draft_tokens.sizes());
  check_same_device(proposal_tokens, target_logits, "proposal_tokens");
  TORCH_CHECK_VALUE(proposal_tokens.scalar_type() == at::kLong, "proposal_tokens must be int64, got ",
              proposal_tokens.scalar_type());
  TORCH_CHECK_VALUE(proposal_tokens.dim() == 3 && proposal_tokens.size(0) == rows &&
                  proposal_tokens.size(1) == num_draft,
              "proposal_tokens must have shape [", rows, ", ", num_draft, ", C], got ", proposal_tokens.sizes());
  const int64_t candidates = proposal_tokens.size(2);
  TORCH_CHECK_VALUE(candidates >= 1 && candidates <= kMaxSparseEntries,
              "the number of candidates C (proposal_tokens.shape[2]) must be in [1, ", kMaxSparseEntries, "], got ",
              candidates);
  check_same_device(proposal_probs, target_logits, "proposal_probs");
  TORCH_CHECK_VALUE(proposal_probs.scalar_type() == at::kFloat, "proposal_probs must be float32, got ",
              proposal_probs.scalar_type());
  TORCH_CHECK_VALUE(proposal_probs.sizes() == proposal_tokens.sizes(), "proposal_probs must have shape [", rows,
              ", ", num_draft, ", ", candidates, "] like proposal_tokens, got ", proposal_probs.sizes());
  check_uniforms(uniforms, rows, num_draft, target_logits);
  check_filter_args(temperature, top_k, top_p);
}

void check_sample_tokens_args(const at::Tensor& logits, const at::Tensor& uniforms, double temperature,
                              int64_t top_k, double top_p, const at::Tensor& query_tokens) {
  check_floating_logits(logits, "logits");
  TORCH_CHECK_VALUE(logits.dim() == 2, "logits must be [R, V], got ", logits.sizes());
  TORCH_CHECK_VALUE(logits.size(1) >= 1, "logits must have a vocabulary of at least 1, got ", logits.size(1));
  const int64_t rows = logits.size(0);
  TORCH_CHECK_VALUE(uniforms.device() == logits.device(), "uniforms must be on ", logits.device(),
              " like logits, got ", uniforms.device());
  TORCH_CHECK_VALUE(uniforms.scalar_type() == at::kFloat || uniforms.scalar_type() == at::kDouble,
              "uniforms must be float32 or float64, got ", uniforms.scalar_type());
  TORCH_CHECK_VALUE(uniforms.dim() == 1 && uniforms.size(0) == rows, "uniforms must have shape [", rows, "], got ",
              uniforms.sizes());
  TORCH_CHECK_VALUE(query_tokens.device() == logits.device(), "query_tokens must be on ", logits.device(),
              " like logits, got ", query_tokens.device());
  TORCH_CHECK_VALUE(query_tokens.scalar_type() == at::kLong, "query_tokens must be int64, got ",
              query_tokens.scalar_type());
  TORCH_CHECK_VALUE(query_tokens.dim() == 2 && query_tokens.size(0) == rows, "query_tokens must have shape [", rows,
              ", C], got ", query_tokens.sizes());
  check_filter_args(temperature, top_k, top_p);
}

void check_sample_tokens_values(const at::Tensor& logits, const at::Tensor& uniforms,
                                const at::Tensor& query_tokens) {
  run_value_checks({
      finite_check(logits, "logits"),
      {uniforms.ge(0).logical_and(uniforms.lt(1)).all(), "uniforms must lie in [0, 1)"},
      {query_tokens.ge(-1).logical_and(query_tokens.lt(logits.size(1))).all(),
       "query_tokens has entries outside [-1, " + std::to_string(logits.size(1)) + ") (-1: no query)"},
  });
}

void check_branch_verify_values(const at::Tensor& target_logits, const at::Tensor& branch_tokens,
                                const at::Tensor& branch_prior, const at::Tensor& branch,
                                const at::Tensor& uniforms) {
  const int64_t num_branches = branch_prior.size(1);
  auto checks = common_value_checks(target_logits, branch_prior, uniforms);
  checks.push_back(range_check(branch_tokens, target_logits.size(2), "branch_tokens"));
  checks.push_back(range_check(branch, num_branches, "branch"));
  const at::Tensor chosen = branch_prior.gather(1, branch.clamp(0, num_branches - 1).unsqueeze(1));
  checks.push_back({chosen.gt(0).all(), "branch must select categories with branch_prior > 0"});
  run_value_checks(checks);
}

void check_sparse_verify_values(const at::Tensor& target_logits, const at::Tensor& draft_tokens,
                                const at::Tensor& proposal_tokens, const at::Tensor& proposal_probs,
                                const at::Tensor& uniforms) {
  const int64_t vocab = target_logits.size(2);
  run_value_checks({
      finite_check(target_logits, "target_logits"),
      range_check(draft_tokens, vocab, "draft_tokens"),
      range_check(proposal_tokens, vocab, "proposal_tokens"),
      {proposal_probs.ge(0).logical_and(at::isfinite(proposal_probs)).all(),
       "proposal_probs must have finite entries >= 0"},
      {proposal_probs.sum(2).sub(1.0).abs().le(1e-4).all(),
       "proposal_probs must sum to 1 (within 1e-4) at every row and position"},
      {uniforms.ge(0).logical_and(uniforms.lt(1)).all(), "uniforms must lie in [0, 1)"},
  });
}

void check_mixture_verify_values(const at::Tensor& target_logits, const at::Tensor& draft_logits,
                                 const at::Tensor& branch_prior, const at::Tensor& draft_tokens,
                                 const at::Tensor& uniforms) {
  auto checks = common_value_checks(target_logits, branch_prior, uniforms);
  checks.push_back(finite_check(draft_logits, "draft_logits"));
  checks.push_back(range_check(draft_tokens, target_logits.size(2), "draft_tokens"));
  run_value_checks(checks);
}

}  // namespace dblast
