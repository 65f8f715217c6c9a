// Soft-mixture proposal math shared by CPU and CUDA (DBLast Eq 5, 10-12): each branch's
// tempered softmax over the vocabulary, and the category posterior after a draft prefix.
#pragma once

#include <cmath>

#include "dblast/common.h"

namespace dblast {

// log q_i(v | z) = (d_v - max) / T - log sum_w exp((d_w - max) / T) for one branch row of
// draft logits d, in float64.
struct DraftSoftmax {
  float max_logit;
  double log_sum;
  double temperature;

  DBLAST_HD double log_prob(float logit) const {
    return (static_cast<double>(logit) - static_cast<double>(max_logit)) / temperature - log_sum;
  }
  DBLAST_HD double prob(float logit) const { return exp(log_prob(logit)); }
};

// Soft-mixture posterior over categories after the draft prefix x_<i (Eq 11), in log
// space: log_weight[z] = log pi_z + sum_{j<i} log q_j(x_j | z), normalised. `log_q_draft`
// is one row's [K, b] table of log q_j(x_j | z). Writes K weights summing to 1.
DBLAST_HD void mixture_posterior(const float* prior, const double* log_q_draft,
                                 int num_branches, int num_draft, int position,
                                 double* weights) {
  double best = -INFINITY;
  for (int z = 0; z < num_branches; ++z) {
    double lw = prior[z] > 0.0f ? log(static_cast<double>(prior[z])) : -INFINITY;
    for (int j = 0; j < position; ++j) lw += log_q_draft[z * num_draft + j];
    weights[z] = lw;
    if (lw > best) best = lw;
  }
  double total = 0.0;
  for (int z = 0; z < num_branches; ++z) {
    weights[z] = best == -INFINITY ? 0.0 : exp(weights[z] - best);
    total += weights[z];
  }
  for (int z = 0; z < num_branches; ++z) weights[z] = total > 0.0 ? weights[z] / total : 0.0;
}

}  // namespace dblast
