// CPU kernel of dblast::branch_verify (greedy-branch verification, DBLast Eq 18-21): the
// shared sparse-proposal body (sparse_proposal_verify.h) with the greedy-branch mixture's
// entries at each position (dblast/acceptance.h).
#include <torch/library.h>

#include "dblast/acceptance.h"
#include "dblast/verify_checks.h"
#include "sparse_proposal_verify.h"

namespace dblast::cpu {
namespace {

template <typename scalar_t, typename uniform_t>
void branch_verify_impl(const at::Tensor& target_logits, const at::Tensor& branch_tokens,
                        const at::Tensor& branch_prior, const at::Tensor& branch, const at::Tensor& uniforms,
                        const FilterSpec& spec, at::Tensor& num_accepted, at::Tensor& output_tokens,
                        at::Tensor& accept_probs) {
  const int num_draft = static_cast<int>(target_logits.size(1) - 1);
  const int num_branches = static_cast<int>(branch_tokens.size(1));
  const int64_t* tokens = branch_tokens.data_ptr<int64_t>();
  const float* prior = branch_prior.data_ptr<float>();
  const int64_t* selected = branch.data_ptr<int64_t>();
  auto row_tokens = [=](int64_t n) { return tokens + n * num_branches * num_draft; };
  auto draft_of = [=](int64_t n) { return row_tokens(n) + selected[n] * num_draft; };
  auto support = [=](int64_t n, int i, int64_t* support_tokens, double* support_probs) {
    return greedy_branch_support(row_tokens(n), draft_of(n), prior + n * num_branches, num_branches, num_draft, i,
                                 support_tokens, support_probs);
  };
  verify_sparse_proposal<scalar_t, uniform_t>(target_logits, uniforms, spec, draft_of, support, num_accepted,
                                              output_tokens, accept_probs);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> branch_verify_cpu(
    const at::Tensor& target_logits, const at::Tensor& branch_tokens, const at::Tensor& branch_prior,
    const at::Tensor& branch, const at::Tensor& uniforms, double temperature, int64_t top_k, double top_p, bool validate) {
  check_branch_verify_args(target_logits, branch_tokens, branch_prior, branch, uniforms, temperature, top_k,
                           top_p);
  if (validate) check_branch_verify_values(target_logits, branch_tokens, branch_prior, branch, uniforms);
  const at::Tensor logits = target_logits.contiguous(), tokens = branch_tokens.contiguous();
  const at::Tensor prior = branch_prior.contiguous(), selected = branch.contiguous(), u = uniforms.contiguous();
  const int64_t rows = logits.size(0), num_draft = logits.size(1) - 1;
  auto num_accepted = at::empty({rows}, logits.options().dtype(at::kInt));
  auto output_tokens = at::empty({rows, num_draft + 1}, logits.options().dtype(at::kLong));
  auto accept_probs = at::empty({rows, num_draft}, logits.options().dtype(at::kFloat));
  const FilterSpec spec{temperature, top_k, top_p};
  DBLAST_DISPATCH_LOGITS(logits.scalar_type(), "branch_verify_cpu", [&] {
    using logit_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES(u.scalar_type(), "branch_verify_cpu_uniforms", [&] {
      branch_verify_impl<logit_t, scalar_t>(logits, tokens, prior, selected, u, spec, num_accepted,
                                            output_tokens, accept_probs);
    });
  });
  return {num_accepted, output_tokens, accept_probs};
}

}  // namespace

TORCH_LIBRARY_IMPL(dblast, CPU, m) { m.impl("branch_verify", &branch_verify_cpu); }

}  // namespace dblast::cpu
