// The filtered target distribution p(v) (temperature, top-k, top-p), in the compact form
// every verifier kernel shares: p(v) = w(l_v) / norm if l_v >= threshold else 0, with
// w(l) = exp((l - max_logit) / temperature). T = 0 is greedy: a one-hot at `greedy_token`.
//
// Both filters keep a set of the form {v : l_v >= t} (top-k is tie-inclusive; top-p keeps
// {v : p(v) >= theta}, and p is monotone in l), so one logit threshold describes the
// result of applying both. How the threshold is found differs per device (selection on the
// CPU, radix search on the GPU); how a found threshold turns into probabilities lives here.
#pragma once

#include <cmath>

#include "dblast/common.h"

namespace dblast {

struct FilterSpec {
  double temperature;  // 0 = greedy
  int64_t top_k;       // <= 0 or >= V: disabled
  double top_p;        // >= 1: disabled

  DBLAST_HD bool greedy() const { return temperature == 0.0; }
  DBLAST_HD bool uses_top_k(int64_t vocab) const { return top_k > 0 && top_k < vocab; }
  DBLAST_HD bool uses_top_p() const { return top_p < 1.0; }
};

// Unnormalised softmax weight of a logit, in float64 so that masses summed in different
// orders on different devices agree to ~1e-15 and top-p boundaries are decided alike.
DBLAST_HD double softmax_weight(float logit, float max_logit, double temperature) {
  return exp((static_cast<double>(logit) - static_cast<double>(max_logit)) / temperature);
}

struct FilteredDist {
  float max_logit;
  float threshold;       // tokens with logit >= threshold are kept
  double norm;           // sum of softmax_weight over kept tokens
  double temperature;    // 0 = greedy
  int64_t greedy_token;  // argmax, lowest id on ties (used when temperature == 0)

  DBLAST_HD double prob(float logit, int64_t token) const {
    if (temperature == 0.0) return token == greedy_token ? 1.0 : 0.0;
    if (!(logit >= threshold)) return 0.0;
    return softmax_weight(logit, max_logit, temperature) / norm;
  }
};

}  // namespace dblast
