// The CPU verification body shared by every verifier whose proposal at a position is sparse (a
// list of (token, probability) entries): branch_verify (the greedy-branch mixture, Eq 19-21) and
// sparse_verify (C sampled candidates, DFlash2's selector). The callers differ only in the draft
// and in how a position's entries are found.
// Phase 1, parallel over (row, position): the filtered target distribution and the drafted
// token's acceptance probability. Phase 2, parallel over rows: accept/reject with the caller's
// uniforms and draw the correction token from [p - q]+ (or the bonus token from p) by inverse CDF.
#pragma once

#include <ATen/Parallel.h>
#include <torch/types.h>

#include <vector>

#include "dblast/acceptance.h"
#include "dblast/filtering.h"
#include "target_filter.h"

namespace dblast::cpu {

// Draft(n) -> const int64_t* (row n's b drafted tokens);
// Support(n, i, tokens, probs) -> int (writes position i's proposal entries, returns their count,
// at most kMaxSparseEntries).
template <typename scalar_t, typename uniform_t, typename Draft, typename Support>
void verify_sparse_proposal(const at::Tensor& target_logits, const at::Tensor& uniforms, const FilterSpec& spec,
                            Draft draft_of, Support support, at::Tensor& num_accepted, at::Tensor& output_tokens,
                            at::Tensor& accept_probs) {
  const int64_t rows = target_logits.size(0), positions = target_logits.size(1), vocab = target_logits.size(2);
  const int num_draft = static_cast<int>(positions - 1);
  const scalar_t* logits = target_logits.data_ptr<scalar_t>();
  const uniform_t* u = uniforms.data_ptr<uniform_t>();
  int32_t* accepted_out = num_accepted.data_ptr<int32_t>();
  int64_t* tokens_out = output_tokens.data_ptr<int64_t>();
  float* accept_out = accept_probs.data_ptr<float>();
  auto logits_of = [&](int64_t n, int64_t i) { return logits + (n * positions + i) * vocab; };

  std::vector<FilteredDist> dists(rows * positions);
  std::vector<double> accept(rows * num_draft);
  at::parallel_for(0, rows * positions, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    int64_t support_tokens[kMaxSparseEntries];
    double support_probs[kMaxSparseEntries];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / positions, i = task % positions;
      const scalar_t* row = logits_of(n, i);
      dists[task] = build_filtered_dist(row, vocab, spec, scratch);
      if (i == num_draft) continue;
      const int64_t x = draft_of(n)[i];
      const int count = support(n, static_cast<int>(i), support_tokens, support_probs);
      const double p = dists[task].prob(static_cast<float>(row[x]), x);
      const double q = sparse_prob(support_tokens, support_probs, count, x);
      accept[n * num_draft + i] = acceptance_prob(p, q);
      accept_out[n * num_draft + i] = static_cast<float>(accept[n * num_draft + i]);
    }
  });

  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    int64_t support_tokens[kMaxSparseEntries];
    double support_probs[kMaxSparseEntries];
    for (int64_t n = begin; n < end; ++n) {
      const int accepted = first_rejection(accept.data() + n * num_draft, u + n * positions, num_draft);
      const int64_t* draft = draft_of(n);
      int64_t* out = tokens_out + n * positions;
      for (int i = 0; i < accepted; ++i) out[i] = draft[i];
      for (int i = accepted + 1; i < positions; ++i) out[i] = -1;
      accepted_out[n] = accepted;

      const FilteredDist& dist = dists[n * positions + accepted];
      const scalar_t* row = logits_of(n, accepted);
      // bonus position: sample p itself
      const int count = accepted < num_draft ? support(n, accepted, support_tokens, support_probs) : 0;
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

}  // namespace dblast::cpu
