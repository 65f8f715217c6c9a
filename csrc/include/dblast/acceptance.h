// Speculative acceptance math shared by CPU and CUDA verifiers: the greedy-branch
// proposal conditional (DBLast Eq 19-20), the acceptance probability (Eq 21) and the
// first-rejection rule. The soft-mixture pieces are in dblast/mixture.h.
#pragma once

#include <cmath>

#include "dblast/common.h"

namespace dblast {

// A = min(1, p / q). q = 0 cannot happen for a draft the proposal could have produced; it
// is defined as "accept iff the target can emit it" so the value stays finite.
DBLAST_HD double acceptance_prob(double p, double q) {
  if (q > 0.0) return p >= q ? 1.0 : p / q;
  return p > 0.0 ? 1.0 : 0.0;
}

// Branch z is consistent at `position` when its first `position` tokens equal the draft's
// (the set C_i of Eq 19). `branch_row` is branch z's [b] tokens.
DBLAST_HD bool branch_consistent(const int64_t* branch_row, const int64_t* draft, int position) {
  for (int j = 0; j < position; ++j) {
    if (branch_row[j] != draft[j]) return false;
  }
  return true;
}

// Greedy-branch proposal conditional q(. | x_<i) (Eq 19-20) as a sparse distribution:
// writes one (token, probability) entry per consistent branch (a token may repeat; its
// probability is the sum of its entries) and returns the number of entries.
// `branch_tokens` is one row's [K, b] table (row-major), `draft` the selected branch's
// tokens, `prior` the tempered category distribution.
DBLAST_HD int greedy_branch_support(const int64_t* branch_tokens, const int64_t* draft,
                                    const float* prior, int num_branches, int num_draft,
                                    int position, int64_t* tokens, double* probs) {
  int count = 0;
  double consistent_mass = 0.0;
  for (int z = 0; z < num_branches; ++z) {
    const int64_t* row = branch_tokens + static_cast<int64_t>(z) * num_draft;
    if (!branch_consistent(row, draft, position) || !(prior[z] > 0.0f)) continue;
    tokens[count] = row[position];
    probs[count] = prior[z];
    consistent_mass += prior[z];
    ++count;
  }
  for (int e = 0; e < count; ++e) probs[e] /= consistent_mass;
  return count;
}

// Probability of `token` under a sparse distribution from greedy_branch_support.
DBLAST_HD double sparse_prob(const int64_t* tokens, const double* probs, int count, int64_t token) {
  double total = 0.0;
  for (int e = 0; e < count; ++e) {
    if (tokens[e] == token) total += probs[e];
  }
  return total;
}

// Number of accepted drafts: the first position whose uniform is not below its
// acceptance probability (accept iff u < A), or num_draft when all pass.
template <typename AcceptT, typename UniformT>
DBLAST_HD int first_rejection(const AcceptT* accept_probs, const UniformT* uniforms,
                              int num_draft) {
  for (int i = 0; i < num_draft; ++i) {
    if (!(static_cast<double>(uniforms[i]) < static_cast<double>(accept_probs[i]))) return i;
  }
  return num_draft;
}

}  // namespace dblast
