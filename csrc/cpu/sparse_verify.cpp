// CPU kernel of dblast::sparse_verify: a sampled chain whose proposal at each position is C
// candidate ids with their probabilities (DFlash2's candidate selector at T > 0), verified with
// the shared sparse-proposal body (sparse_proposal_verify.h): accept min(1, p/q), correction from
// [p - q]+, bonus from p.
#include <torch/library.h>

#include <algorithm>

#include "dblast/verify_checks.h"
#include "sparse_proposal_verify.h"

namespace dblast::cpu {
namespace {

template <typename scalar_t, typename uniform_t>
void sparse_verify_impl(const at::Tensor& target_logits, const at::Tensor& draft_tokens,
                        const at::Tensor& proposal_tokens, const at::Tensor& proposal_probs,
                        const at::Tensor& uniforms, const FilterSpec& spec, at::Tensor& num_accepted,
                        at::Tensor& output_tokens, at::Tensor& accept_probs) {
  const int num_draft = static_cast<int>(target_logits.size(1) - 1);
  const int candidates = static_cast<int>(proposal_tokens.size(2));
  const int64_t* drafts = draft_tokens.data_ptr<int64_t>();
  const int64_t* tokens = proposal_tokens.data_ptr<int64_t>();
  const float* probs = proposal_probs.data_ptr<float>();
  auto draft_of = [=](int64_t n) { return drafts + n * num_draft; };
  auto support = [=](int64_t n, int i, int64_t* support_tokens, double* support_probs) {
    const int64_t offset = (n * num_draft + i) * candidates;
    std::copy(tokens + offset, tokens + offset + candidates, support_tokens);
    std::copy(probs + offset, probs + offset + candidates, support_probs);
    return candidates;
  };
  verify_sparse_proposal<scalar_t, uniform_t>(target_logits, uniforms, spec, draft_of, support, num_accepted,
                                              output_tokens, accept_probs);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> sparse_verify_cpu(
    const at::Tensor& target_logits, const at::Tensor& draft_tokens, const at::Tensor& proposal_tokens,
    const at::Tensor& proposal_probs, const at::Tensor& uniforms, double temperature, int64_t top_k, double top_p,
    bool validate) {
  check_sparse_verify_args(target_logits, draft_tokens, proposal_tokens, proposal_probs, uniforms, temperature,
                           top_k, top_p);
  if (validate) check_sparse_verify_values(target_logits, draft_tokens, proposal_tokens, proposal_probs, uniforms);
  const at::Tensor logits = target_logits.contiguous(), drafts = draft_tokens.contiguous();
  const at::Tensor tokens = proposal_tokens.contiguous(), probs = proposal_probs.contiguous();
  const at::Tensor u = uniforms.contiguous();
  const int64_t rows = logits.size(0), num_draft = logits.size(1) - 1;
  auto num_accepted = at::empty({rows}, logits.options().dtype(at::kInt));
  auto output_tokens = at::empty({rows, num_draft + 1}, logits.options().dtype(at::kLong));
  auto accept_probs = at::empty({rows, num_draft}, logits.options().dtype(at::kFloat));
  const FilterSpec spec{temperature, top_k, top_p};
  DBLAST_DISPATCH_LOGITS(logits.scalar_type(), "sparse_verify_cpu", [&] {
    using logit_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES(u.scalar_type(), "sparse_verify_cpu_uniforms", [&] {
      sparse_verify_impl<logit_t, scalar_t>(logits, drafts, tokens, probs, u, spec, num_accepted, output_tokens,
                                            accept_probs);
    });
  });
  return {num_accepted, output_tokens, accept_probs};
}

}  // namespace

TORCH_LIBRARY_IMPL(dblast, CPU, m) { m.impl("sparse_verify", &sparse_verify_cpu); }

}  // namespace dblast::cpu
