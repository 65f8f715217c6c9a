// Running (max, argmax, sum-exp) of a stream of logits, mergeable in any grouping: the
// reduction behind branch_argmax on both devices. Ties keep the lowest token id, so a
// merge of partial results in vocabulary order is deterministic.
#pragma once

#include <cmath>

#include "dblast/common.h"

namespace dblast {

struct ArgmaxLse {
  float max;     // largest logit seen (-inf when empty)
  int64_t index; // its token id (lowest on ties)
  double sum;    // sum of exp(logit - max) over the logits seen

  DBLAST_HD static ArgmaxLse empty() { return {-INFINITY, -1, 0.0}; }

  // Merges another partial result. Equal maxima keep the lower token id.
  DBLAST_HD void merge(const ArgmaxLse& other) {
    if (other.index < 0) return;
    if (index < 0) {
      *this = other;
      return;
    }
    if (other.max > max || (other.max == max && other.index < index)) {
      sum = sum * exp(static_cast<double>(max) - static_cast<double>(other.max)) + other.sum;
      max = other.max;
      index = other.index;
    } else {
      sum += other.sum * exp(static_cast<double>(other.max) - static_cast<double>(max));
    }
  }

  DBLAST_HD float logsumexp() const { return static_cast<float>(static_cast<double>(max) + log(sum)); }
};

}  // namespace dblast
