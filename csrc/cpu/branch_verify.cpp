// CPU kernel of dblast::branch_verify (greedy-branch verification, DBLast Eq 18-21).
// Phase 1, parallel over (row, position): filtered target distribution and acceptance
// probability of the drafted token. Phase 2, parallel over rows: accept/reject with the
// caller's uniforms and draw the correction (or bonus) token by inverse CDF.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "dblast/acceptance.h"
#include "dblast/filtering.h"
#include "dblast/verify_checks.h"
#include "target_filter.h"

namespace dblast::cpu {
namespace {

template <typename scalar_t, typename uniform_t>
void branch_verify_impl(const at::Tensor& target_logits, const at::Tensor& branch_tokens,
                        const at::Tensor& branch_prior, const at::Tensor& branch, const at::Tensor& uniforms,
                        const FilterSpec& spec, at::Tensor& num_accepted, at::Tensor& output_tokens,
                        at::Tensor& accept_probs) {
  const int64_t rows = target_logits.size(0), positions = target_logits.size(1), vocab = target_logits.size(2);
  const int num_draft = static_cast<int>(positions - 1);
  const int num_branches = static_cast<int>(branch_tokens.size(1));
  const scalar_t* logits = target_logits.data_ptr<scalar_t>();
  const int64_t* tokens = branch_tokens.data_ptr<int64_t>();
  const float* prior = branch_prior.data_ptr<float>();
  const int64_t* selected = branch.data_ptr<int64_t>();
  const uniform_t* u = uniforms.data_ptr<uniform_t>();
  int32_t* accepted_out = num_accepted.data_ptr<int32_t>();
  int64_t* tokens_out = output_tokens.data_ptr<int64_t>();
  float* accept_out = accept_probs.data_ptr<float>();

  auto row_tokens = [&](int64_t n) { return tokens + n * num_branches * num_draft; };
  auto draft_of = [&](int64_t n) { return row_tokens(n) + selected[n] * num_draft; };
  auto logits_of = [&](int64_t n, int64_t i) { return logits + (n * positions + i) * vocab; };

  std::vector<FilteredDist> dists(rows * positions);
  std::vector<double> accept(rows * num_draft);
  at::parallel_for(0, rows * positions, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    int64_t support_tokens[kMaxBranches];
    double support_probs[kMaxBranches];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / positions, i = task % positions;
      const scalar_t* row = logits_of(n, i);
      dists[task] = build_filtered_dist(row, vocab, spec, scratch);
      if (i == num_draft) continue;
      const int64_t x = draft_of(n)[i];
      const int count = greedy_branch_support(row_tokens(n), draft_of(n), prior + n * num_branches,
                                              num_branches, num_draft, static_cast<int>(i), support_tokens,
                                              support_probs);
      const double p = dists[task].prob(static_cast<float>(row[x]), x);
      const double q = sparse_prob(support_tokens, support_probs, count, x);
      accept[n * num_draft + i] = acceptance_prob(p, q);
      accept_out[n * num_draft + i] = static_cast<float>(accept[n * num_draft + i]);
    }
  });

  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    int64_t support_tokens[kMaxBranches];
    double support_probs[kMaxBranches];
    for (int64_t n = begin; n < end; ++n) {
      const int accepted = first_rejection(accept.data() + n * num_draft, u + n * positions, num_draft);
      const int64_t* draft = draft_of(n);
      int64_t* out = tokens_out + n * positions;
      for (int i = 0; i < accepted; ++i) out[i] = draft[i];
      for (int i = accepted + 1; i < positions; ++i) out[i] = -1;
      accepted_out[n] = accepted;

      const FilteredDist& dist = dists[n * positions + accepted];
      const scalar_t* row = logits_of(n, accepted);
      const int count = accepted < num_draft
                            ? greedy_branch_support(row_tokens(n), draft, prior + n * num_branches, num_branches,
                                                    num_draft, accepted, support_tokens, support_probs)
                            : 0;  // bonus position: sample p itself
      const double uniform = static_cast<double>(u[n * positions + num_draft]);
      out[accepted] = draw_final_token(row, vocab, uniform, dist, [&](int64_t v) {
        const double p = dist.prob(static_cast<float>(row[v]), v);
        if (!(p > 0.0)) return 0.0;  // most tokens: no need to look up the sparse proposal
        const double r = p - sparse_prob(support_tokens, support_probs, count, v);
        return r > 0.0 ? r : 0.0;
      });
    }
  });
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
