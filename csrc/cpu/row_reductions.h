// Fast single-row reductions used by several CPU kernels: the first argmax, and a
// vectorisable exp for sums of exp(x - max).
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <limits>

namespace dblast::cpu {

// First index of the maximum (lowest id on ties). Eight independent running maxima keep
// the loop free of a serial dependency (a single running max costs ~4 cycles per logit).
template <typename scalar_t>
inline int64_t first_argmax(const scalar_t* logits, int64_t vocab) {
  constexpr int kLanes = 8;
  float best[kLanes];
  int64_t index[kLanes];
  for (int j = 0; j < kLanes; ++j) {
    best[j] = -std::numeric_limits<float>::infinity();
    index[j] = vocab;
  }
  int64_t v = 0;
  for (; v + kLanes <= vocab; v += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const float x = static_cast<float>(logits[v + j]);
      const bool greater = x > best[j];
      best[j] = greater ? x : best[j];
      index[j] = greater ? v + j : index[j];
    }
  }
  for (; v < vocab; ++v) {
    const float x = static_cast<float>(logits[v]);
    if (x > best[0]) {
      best[0] = x;
      index[0] = v;
    }
  }
  int64_t winner = index[0];
  float top = best[0];
  for (int j = 1; j < kLanes; ++j) {
    if (best[j] > top || (best[j] == top && index[j] < winner)) {
      top = best[j];
      winner = index[j];
    }
  }
  return winner < vocab ? winner : 0;  // all -inf cannot happen (logits are finite)
}

// Largest value of a row (no index): independent lanes, so the loop vectorises.
template <typename scalar_t>
inline float row_max(const scalar_t* row, int64_t count) {
  constexpr int kLanes = 16;
  float lanes[kLanes];
  for (int j = 0; j < kLanes; ++j) lanes[j] = -std::numeric_limits<float>::infinity();
  int64_t v = 0;
  for (; v + kLanes <= count; v += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const float x = static_cast<float>(row[v + j]);
      lanes[j] = lanes[j] > x ? lanes[j] : x;
    }
  }
  float best = -std::numeric_limits<float>::infinity();
  for (; v < count; ++v) best = std::max(best, static_cast<float>(row[v]));
  for (int j = 0; j < kLanes; ++j) best = std::max(best, lanes[j]);
  return best;
}

// exp(x) for x <= 0, relative error below 2e-7, written as straight-line float/int
// arithmetic so that loops over it vectorise (std::exp does not). Inputs below -87 are
// clamped (exp(-87) ~ 1.6e-38, negligible next to the 1 contributed by the maximum).
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const int n = static_cast<int>(x * 1.44269504f - 0.5f);  // round(x / ln 2) for x <= 0
  const float nf = static_cast<float>(n);
  const float r = (x - nf * 0.693145752f) - nf * 1.42860677e-6f;  // Cody-Waite: r in [-ln2/2, ln2/2]
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  return p * std::bit_cast<float>(static_cast<uint32_t>(n + 127) << 23);
}

// sum_v exp(row[v] - max) for max >= every row[v], float lanes folded into a double.
template <typename scalar_t>
inline double sum_exp_shifted(const scalar_t* row, int64_t count, float max) {
  constexpr int kLanes = 16;
  double total = 0.0;
  int64_t v = 0;
  for (; v + 1024 <= count; v += 1024) {  // float lanes over short spans keep rounding small
    float lanes[kLanes] = {};
    for (int64_t u = 0; u < 1024; u += kLanes) {
      for (int j = 0; j < kLanes; ++j) lanes[j] += exp_nonpositive(static_cast<float>(row[v + u + j]) - max);
    }
    for (int j = 0; j < kLanes; ++j) total += lanes[j];
  }
  for (; v < count; ++v) total += exp_nonpositive(static_cast<float>(row[v]) - max);
  return total;
}

// row[v] <- exp(row[v] - max) in place, returning the sum (max >= every row[v]); the two
// loops are kept apart so the exp loop vectorises and the sum runs on independent lanes.
inline float exp_shifted_inplace(float* row, int64_t count, float max) {
  for (int64_t v = 0; v < count; ++v) row[v] = exp_nonpositive(row[v] - max);
  constexpr int kLanes = 16;
  float lanes[kLanes] = {};
  int64_t v = 0;
  for (; v + kLanes <= count; v += kLanes) {
    for (int j = 0; j < kLanes; ++j) lanes[j] += row[v + j];
  }
  float total = 0.0f;
  for (; v < count; ++v) total += row[v];
  for (int j = 0; j < kLanes; ++j) total += lanes[j];
  return total;
}

}  // namespace dblast::cpu
