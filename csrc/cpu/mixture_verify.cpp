// CPU kernel of dblast::mixture_verify (soft-mixture verification, DBLast Eq 5, 10-12).
// Phase 1, parallel over (row, position): filtered target distribution and, per branch,
// the draft softmax statistics. Phase 2, parallel over rows: category posterior along the
// draft prefix, acceptance, and the correction (or bonus) draw by inverse CDF.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "dblast/acceptance.h"
#include "dblast/filtering.h"
#include "dblast/mixture.h"
#include "dblast/verify_checks.h"
#include "target_filter.h"

namespace dblast::cpu {
namespace {

template <typename scalar_t, typename draft_t, typename uniform_t>
void mixture_verify_impl(const at::Tensor& target_logits, const at::Tensor& draft_logits,
                         const at::Tensor& branch_prior, const at::Tensor& draft_tokens, const at::Tensor& uniforms,
                         const FilterSpec& spec, double draft_temperature, at::Tensor& num_accepted,
                         at::Tensor& output_tokens, at::Tensor& accept_probs) {
  const int64_t rows = target_logits.size(0), positions = target_logits.size(1), vocab = target_logits.size(2);
  const int num_draft = static_cast<int>(positions - 1);
  const int num_branches = static_cast<int>(draft_logits.size(1));
  const scalar_t* logits = target_logits.data_ptr<scalar_t>();
  const draft_t* dlogits = draft_logits.data_ptr<draft_t>();
  const float* prior = branch_prior.data_ptr<float>();
  const int64_t* draft = draft_tokens.data_ptr<int64_t>();
  const uniform_t* u = uniforms.data_ptr<uniform_t>();
  int32_t* accepted_out = num_accepted.data_ptr<int32_t>();
  int64_t* tokens_out = output_tokens.data_ptr<int64_t>();
  float* accept_out = accept_probs.data_ptr<float>();

  auto target_row = [&](int64_t n, int64_t i) { return logits + (n * positions + i) * vocab; };
  auto draft_row = [&](int64_t n, int64_t z, int64_t i) {
    return dlogits + ((n * num_branches + z) * num_draft + i) * vocab;
  };
  // Per (row, branch, draft position): softmax statistics and log q_i(x_i | z).
  auto stat_index = [&](int64_t n, int64_t z, int64_t i) { return (n * num_branches + z) * num_draft + i; };

  std::vector<FilteredDist> dists(rows * positions);
  std::vector<DraftSoftmax> softmax(rows * num_branches * num_draft);
  std::vector<double> log_q_draft(rows * num_branches * num_draft);
  std::vector<double> p_draft(rows * num_draft);
  at::parallel_for(0, rows * positions, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / positions, i = task % positions;
      const scalar_t* row = target_row(n, i);
      dists[task] = build_filtered_dist(row, vocab, spec, scratch);
      if (i == num_draft) continue;
      const int64_t x = draft[n * num_draft + i];
      p_draft[n * num_draft + i] = dists[task].prob(static_cast<float>(row[x]), x);
      for (int64_t z = 0; z < num_branches; ++z) {
        const draft_t* drow = draft_row(n, z, i);
        const int64_t s = stat_index(n, z, i);
        softmax[s] = build_draft_softmax(drow, vocab, draft_temperature, scratch);
        log_q_draft[s] = softmax[s].log_prob(static_cast<float>(drow[x]));
      }
    }
  });

  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<const draft_t*> branch_rows(num_branches);
    double weights[kMaxBranches];
    std::vector<double> accept(num_draft);
    for (int64_t n = begin; n < end; ++n) {
      const double* log_q = log_q_draft.data() + stat_index(n, 0, 0);
      for (int i = 0; i < num_draft; ++i) {
        mixture_posterior(prior + n * num_branches, log_q, num_branches, num_draft, i, weights);
        double q = 0.0;
        for (int z = 0; z < num_branches; ++z) q += weights[z] * std::exp(log_q[z * num_draft + i]);
        accept[i] = acceptance_prob(p_draft[n * num_draft + i], q);
        accept_out[n * num_draft + i] = static_cast<float>(accept[i]);
      }
      const int accepted = first_rejection(accept.data(), u + n * positions, num_draft);
      int64_t* out = tokens_out + n * positions;
      for (int i = 0; i < accepted; ++i) out[i] = draft[n * num_draft + i];
      for (int i = accepted + 1; i < positions; ++i) out[i] = -1;
      accepted_out[n] = accepted;

      const FilteredDist& dist = dists[n * positions + accepted];
      const scalar_t* row = target_row(n, accepted);
      const bool rejected = accepted < num_draft;
      if (rejected) {
        mixture_posterior(prior + n * num_branches, log_q, num_branches, num_draft, accepted, weights);
        for (int z = 0; z < num_branches; ++z) {
          branch_rows[z] = draft_row(n, z, accepted);
        }
      }
      const double uniform = static_cast<double>(u[n * positions + num_draft]);
      out[accepted] = draw_final_token(row, vocab, uniform, dist, [&](int64_t v) {
        double r = dist.prob(static_cast<float>(row[v]), v);
        if (rejected && r > 0.0) {  // where p(v) = 0 the residual is 0 whatever q is
          for (int z = 0; z < num_branches; ++z) {
            if (weights[z] > 0.0) {
              r -= weights[z] * softmax[stat_index(n, z, accepted)].prob(static_cast<float>(branch_rows[z][v]));
            }
          }
        }
        return r > 0.0 ? r : 0.0;
      });
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> mixture_verify_cpu(
    const at::Tensor& target_logits, const at::Tensor& draft_logits, const at::Tensor& branch_prior,
    const at::Tensor& draft_tokens, const at::Tensor& uniforms, double temperature, int64_t top_k, double top_p,
    double draft_temperature, bool validate) {
  check_mixture_verify_args(target_logits, draft_logits, branch_prior, draft_tokens, uniforms, temperature, top_k,
                            top_p, draft_temperature);
  if (validate) check_mixture_verify_values(target_logits, draft_logits, branch_prior, draft_tokens, uniforms);
  const at::Tensor logits = target_logits.contiguous(), dlogits = draft_logits.contiguous();
  const at::Tensor prior = branch_prior.contiguous(), tokens = draft_tokens.contiguous(), u = uniforms.contiguous();
  const int64_t rows = logits.size(0), num_draft = logits.size(1) - 1;
  auto num_accepted = at::empty({rows}, logits.options().dtype(at::kInt));
  auto output_tokens = at::empty({rows, num_draft + 1}, logits.options().dtype(at::kLong));
  auto accept_probs = at::empty({rows, num_draft}, logits.options().dtype(at::kFloat));
  const FilterSpec spec{temperature, top_k, top_p};
  DBLAST_DISPATCH_LOGITS(logits.scalar_type(), "mixture_verify_cpu", [&] {
    using logit_t = scalar_t;
    DBLAST_DISPATCH_LOGITS(dlogits.scalar_type(), "mixture_verify_cpu_draft", [&] {
      using draft_t = scalar_t;
      AT_DISPATCH_FLOATING_TYPES(u.scalar_type(), "mixture_verify_cpu_uniforms", [&] {
        mixture_verify_impl<logit_t, draft_t, scalar_t>(logits, dlogits, prior, tokens, u, spec, draft_temperature,
                                                        num_accepted, output_tokens, accept_probs);
      });
    });
  });
  return {num_accepted, output_tokens, accept_probs};
}

}  // namespace

TORCH_LIBRARY_IMPL(dblast, CPU, m) { m.impl("mixture_verify", &mixture_verify_cpu); }

}  // namespace dblast::cpu
