// CPU construction of the filtered target distribution (see dblast/filtering.h): finds the
// max, the top-k threshold (tie-inclusive k-th largest logit) and the top-p threshold
// (weighted selection, expected O(V), no full sort) of one row of logits; plus the draft
// softmax statistics and the inverse-CDF draw both CPU verifiers use.
#pragma once

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <utility>
#include <vector>

#include "dblast/filtering.h"
#include "dblast/mixture.h"
#include "row_reductions.h"

namespace dblast::cpu {

struct TopK {
  float kth;  // k-th largest value counting multiplicity
  float max;
};

// Small k keeps a sorted buffer in one pass, skipping 16-logit chunks that cannot enter
// it; large k uses nth_element on a copy.
template <typename scalar_t>
inline TopK kth_largest(const scalar_t* logits, int64_t vocab, int64_t k, std::vector<float>& scratch) {
  if (k <= 32) {
    float best[32];
    int64_t filled = 0;
    auto insert = [&](float x) {
      if (filled == k && !(x > best[k - 1])) return;
      int64_t pos = filled < k ? filled++ : k - 1;
      while (pos > 0 && best[pos - 1] < x) {
        best[pos] = best[pos - 1];
        --pos;
      }
      best[pos] = x;
    };
    int64_t v = 0;
    for (; v < vocab && filled < k; ++v) insert(static_cast<float>(logits[v]));
    for (; v + 16 <= vocab; v += 16) {
      const float floor = best[k - 1];
      bool any = false;
      for (int j = 0; j < 16; ++j) any |= static_cast<float>(logits[v + j]) > floor;
      if (!any) continue;
      for (int j = 0; j < 16; ++j) insert(static_cast<float>(logits[v + j]));
    }
    for (; v < vocab; ++v) insert(static_cast<float>(logits[v]));
    return {best[k - 1], best[0]};
  }
  scratch.resize(vocab);
  for (int64_t v = 0; v < vocab; ++v) scratch[v] = static_cast<float>(logits[v]);
  std::nth_element(scratch.begin(), scratch.begin() + (k - 1), scratch.end(), std::greater<float>());
  return {scratch[k - 1], *std::max_element(scratch.begin(), scratch.begin() + k)};
}

struct TopPResult {
  float threshold;
  double kept_mass;
};

// Largest value t among `values` whose kept mass sum_{x >= t} w(x) reaches `target`
// (the top-p rule), by three-way quickselect on mass. Reorders `values`.
inline TopPResult top_p_threshold(std::vector<float>& values, double target, float max_logit,
                                  double temperature) {
  auto weight = [&](float x) { return softmax_weight(x, max_logit, temperature); };
  double above = 0.0;  // mass of values already known to lie above the current range
  auto lo = values.begin(), hi = values.end();
  while (true) {
    if (hi - lo <= 64) {
      std::sort(lo, hi, std::greater<float>());
      for (auto it = lo; it != hi;) {
        const float value = *it;
        for (; it != hi && *it == value; ++it) above += weight(*it);
        if (above >= target || it == hi) return {value, above};
      }
      // Only reached when the range is empty, which the loop invariant excludes.
      return {*(hi - 1), above};
    }
    const float a = *lo, b = *(lo + (hi - lo) / 2), c = *(hi - 1);
    const float pivot = std::max(std::min(a, b), std::min(std::max(a, b), c));
    auto gt_end = std::partition(lo, hi, [&](float x) { return x > pivot; });
    auto eq_end = std::partition(gt_end, hi, [&](float x) { return x == pivot; });
    double gt_mass = 0.0, eq_mass = 0.0;
    for (auto it = lo; it != gt_end; ++it) gt_mass += weight(*it);
    if (above + gt_mass >= target) {
      hi = gt_end;
      continue;
    }
    for (auto it = gt_end; it != eq_end; ++it) eq_mass += weight(*it);
    above += gt_mass + eq_mass;
    if (above >= target || eq_end == hi) return {pivot, above};
    lo = eq_end;
  }
}

// Sum of softmax weights of the logits >= threshold, skipping 16-logit chunks that hold
// none (with a top-k threshold almost all of them).
template <typename scalar_t>
inline double kept_mass(const scalar_t* logits, int64_t vocab, float threshold, float max_logit,
                        double temperature) {
  double mass = 0.0;
  int64_t v = 0;
  for (; v + 16 <= vocab; v += 16) {
    bool any = false;
    for (int j = 0; j < 16; ++j) any |= static_cast<float>(logits[v + j]) >= threshold;
    if (!any) continue;
    for (int j = 0; j < 16; ++j) {
      const float x = static_cast<float>(logits[v + j]);
      if (x >= threshold) mass += softmax_weight(x, max_logit, temperature);
    }
  }
  for (; v < vocab; ++v) {
    const float x = static_cast<float>(logits[v]);
    if (x >= threshold) mass += softmax_weight(x, max_logit, temperature);
  }
  return mass;
}

// Builds the filtered distribution of one row of logits.
template <typename scalar_t>
inline FilteredDist build_filtered_dist(const scalar_t* logits, int64_t vocab, const FilterSpec& spec,
                                        std::vector<float>& scratch) {
  FilteredDist dist;
  dist.temperature = spec.temperature;
  dist.threshold = -std::numeric_limits<float>::infinity();
  dist.norm = 1.0;
  dist.greedy_token = -1;  // only meaningful when greedy
  if (spec.greedy()) {
    dist.greedy_token = first_argmax(logits, vocab);
    dist.max_logit = static_cast<float>(logits[dist.greedy_token]);
    return dist;
  }
  if (spec.uses_top_k(vocab)) {
    const TopK top = kth_largest(logits, vocab, spec.top_k, scratch);
    dist.threshold = top.kth;
    dist.max_logit = top.max;
  } else {
    dist.max_logit = row_max(logits, vocab);
  }
  double mass = kept_mass(logits, vocab, dist.threshold, dist.max_logit, spec.temperature);
  if (spec.uses_top_p()) {
    scratch.clear();
    for (int64_t v = 0; v < vocab; ++v) {
      const float x = static_cast<float>(logits[v]);
      if (x >= dist.threshold) scratch.push_back(x);
    }
    const TopPResult top_p = top_p_threshold(scratch, spec.top_p * mass, dist.max_logit, spec.temperature);
    dist.threshold = top_p.threshold;
    mass = top_p.kept_mass;
  }
  dist.norm = mass;
  return dist;
}

// Tempered softmax statistics of one row of draft logits (soft-mixture verification). The
// normaliser uses the vectorised float exp (relative error < 2e-7, far inside the 1e-5 the
// verifiers promise): it is the bulk of mixture_verify's work, K x b rows of V logits.
template <typename scalar_t>
inline DraftSoftmax build_draft_softmax(const scalar_t* logits, int64_t vocab, double temperature,
                                        std::vector<float>& scratch) {
  const float max_logit = row_max(logits, vocab);
  if (temperature == 1.0) return {max_logit, std::log(sum_exp_shifted(logits, vocab, max_logit)), temperature};
  scratch.resize(vocab);  // tempered, shifted copy: (x - max) / T <= 0
  const float inverse = static_cast<float>(1.0 / temperature);
  for (int64_t v = 0; v < vocab; ++v) scratch[v] = (static_cast<float>(logits[v]) - max_logit) * inverse;
  return {max_logit, std::log(sum_exp_shifted(scratch.data(), vocab, 0.0f)), temperature};
}

// Inverse-CDF draw over positions 0..count-1 from nonnegative weights r(i): the first i with
// r(i) > 0 whose running sum exceeds u * sum(r), reported as token(i); the last positive one
// if rounding leaves the target unreached. Returns -1 when all weights are zero.
template <typename WeightFn, typename TokenFn>
inline int64_t inverse_cdf_draw_indexed(int64_t count, double uniform, WeightFn weight, TokenFn token) {
  double total = 0.0;
  for (int64_t i = 0; i < count; ++i) total += weight(i);
  if (!(total > 0.0)) return -1;
  const double target = uniform * total;
  double running = 0.0;
  int64_t last_positive = -1;
  for (int64_t i = 0; i < count; ++i) {
    const double w = weight(i);
    if (!(w > 0.0)) continue;
    running += w;
    last_positive = i;
    if (running > target) return token(i);
  }
  return last_positive < 0 ? -1 : token(last_positive);
}

// The same draw over token ids in increasing order.
template <typename WeightFn>
inline int64_t inverse_cdf_draw(int64_t vocab, double uniform, WeightFn weight) {
  return inverse_cdf_draw_indexed(vocab, uniform, weight, [](int64_t v) { return v; });
}

// A draw from the filtered distribution itself: token for token what
// inverse_cdf_draw(vocab, uniform, dist.prob) returns (the same weights in the same order;
// tokens below the threshold weigh exactly 0 there), but each kept token's weight is
// computed once, and under a top-k / top-p threshold one pass that skips 16-logit chunks
// holding no kept token leaves only the few kept ones to visit.
template <typename scalar_t>
inline int64_t draw_filtered(const scalar_t* row, int64_t vocab, double uniform, const FilteredDist& dist,
                             std::vector<std::pair<int64_t, double>>& kept) {
  kept.clear();
  auto keep = [&](int64_t v) {
    const float x = static_cast<float>(row[v]);
    if (x >= dist.threshold) kept.emplace_back(v, dist.prob(x, v));
  };
  int64_t v = 0;
  for (; v + 16 <= vocab; v += 16) {
    bool any = false;
    for (int j = 0; j < 16; ++j) any |= static_cast<float>(row[v + j]) >= dist.threshold;
    if (!any) continue;
    for (int j = 0; j < 16; ++j) keep(v + j);
  }
  for (; v < vocab; ++v) keep(v);
  return inverse_cdf_draw_indexed(
      static_cast<int64_t>(kept.size()), uniform, [&](int64_t i) { return kept[i].second; },
      [&](int64_t i) { return kept[i].first; });
}

// The final token of a verification step: drawn from the nonnegative `residual` weights
// (the normalised [p - q]+ after a rejection, or p itself at the bonus position), or from
// the filtered target p when the residual has no mass.
template <typename scalar_t, typename ResidualFn>
inline int64_t draw_final_token(const scalar_t* row, int64_t vocab, double uniform, const FilteredDist& dist,
                                ResidualFn residual) {
  const int64_t token = inverse_cdf_draw(vocab, uniform, residual);
  if (token >= 0) return token;
  return inverse_cdf_draw(vocab, uniform, [&](int64_t v) { return dist.prob(static_cast<float>(row[v]), v); });
}

}  // namespace dblast::cpu
