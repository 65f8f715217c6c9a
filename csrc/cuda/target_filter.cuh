// Block-level construction of the filtered target distribution (see dblast/filtering.h)
// without sorting: the top-k threshold by a 4-pass radix select on counts, the top-p
// threshold by a 4-pass radix select on softmax mass (float64). Also the draft softmax
// statistics of the soft-mixture verifier. All threads of the block return the result.
#pragma once

#include <cmath>

#include "block_primitives.cuh"
#include "dblast/filtering.h"
#include "dblast/mixture.h"

namespace dblast::cuda {

struct BinChoice {
  int digit;
  double before;   // weight of the bins above the chosen one
  double through;  // ... plus the chosen bin
};

// Run by warp 0 over a 256-bin histogram: the highest-first bin at which the running
// weight (starting from `above`) reaches `goal`; if rounding leaves it unreached, the
// lowest bin with positive weight (i.e. keep everything). Lane l owns bins 255-8l..248-8l.
template <typename T>
__device__ __forceinline__ BinChoice choose_bin_from_top(const T* hist, double above, double goal) {
  const int lane = threadIdx.x & 31;
  const int top = 255 - 8 * lane;
  double local = 0.0;
#pragma unroll
  for (int e = 0; e < 8; ++e) local += static_cast<double>(hist[top - e]);
  double inclusive = local;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const double other = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  double exclusive = __shfl_up_sync(0xffffffffu, inclusive, 1);
  if (lane == 0) exclusive = 0.0;
  const unsigned reached = __ballot_sync(0xffffffffu, above + inclusive >= goal);
  BinChoice choice{-1, 0.0, 0.0};
  const int owner = reached ? __ffs(reached) - 1 : 0;
  if (lane == owner) {
    double running = above + exclusive;
    if (reached) {
      for (int e = 0; e < 8; ++e) {
        const double w = static_cast<double>(hist[top - e]);
        if (w > 0.0) choice = {top - e, running, running + w};
        if (running + w >= goal && w > 0.0) break;
        running += w;
      }
    } else {
      running = above;
      for (int d = 255; d >= 0; --d) {
        const double w = static_cast<double>(hist[d]);
        if (w > 0.0) choice = {d, running, running + w};
        running += w;
      }
    }
  }
  choice.digit = __shfl_sync(0xffffffffu, choice.digit, owner);
  choice.before = __shfl_sync(0xffffffffu, choice.before, owner);
  choice.through = __shfl_sync(0xffffffffu, choice.through, owner);
  return choice;
}

// Radix select over the keys of the logits that pass `keep`, 8 bits per pass, from the
// top. Histogram weights are counts (WeightT = unsigned) for top-k or softmax masses
// (WeightT = double) for top-p. Returns the selected value and the weight of all kept
// values >= it.
template <typename WeightT, typename scalar_t, typename Keep, typename Weight>
__device__ __forceinline__ BinChoice radix_select_from_top(const scalar_t* row, int64_t vocab, double goal,
                                                           Keep keep, Weight weight, uint32_t* selected_key) {
  __shared__ WeightT hist[256];
  __shared__ BinChoice chosen;
  uint32_t prefix = 0, mask = 0;
  double above = 0.0;
  BinChoice choice{};
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = WeightT(0);
    __syncthreads();
    block_for_each_logit(row, vocab, [&](int64_t, float logit) {
      if (!keep(logit)) return;
      const uint32_t key = ordered_key(logit);
      if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], weight(logit));
    });
    __syncthreads();
    if (threadIdx.x < 32) {
      const BinChoice c = choose_bin_from_top(hist, above, goal);
      if (threadIdx.x == 0) chosen = c;
    }
    __syncthreads();
    choice = chosen;
    __syncthreads();
    prefix |= static_cast<uint32_t>(choice.digit) << shift;
    mask |= 255u << shift;
    above = choice.before;
  }
  *selected_key = prefix;
  return choice;
}

template <typename scalar_t>
__device__ FilteredDist build_filtered_dist(const scalar_t* row, int64_t vocab, const FilterSpec& spec) {
  ArgMax local{-INFINITY, INT64_MAX};
  block_for_each_logit(row, vocab, [&](int64_t v, float logit) { local = better(local, ArgMax{logit, v}); });
  const ArgMax best = block_argmax(local);

  FilteredDist dist;
  dist.max_logit = best.value;
  dist.greedy_token = best.index;
  dist.temperature = spec.temperature;
  dist.threshold = -INFINITY;
  dist.norm = 1.0;
  if (spec.greedy()) return dist;

  const float max_logit = best.value;
  const double temperature = spec.temperature;
  uint32_t key = 0;
  if (spec.uses_top_k(vocab)) {
    radix_select_from_top<unsigned int>(
        row, vocab, static_cast<double>(spec.top_k), [](float) { return true; }, [](float) { return 1u; }, &key);
    dist.threshold = key_to_float(key);
  }
  const float lower = dist.threshold;
  double mass = 0.0;
  block_for_each_logit(row, vocab, [&](int64_t, float logit) {
    if (logit >= lower) mass += softmax_weight(logit, max_logit, temperature);
  });
  mass = block_sum(mass);
  if (spec.uses_top_p()) {
    const BinChoice top_p = radix_select_from_top<double>(
        row, vocab, spec.top_p * mass, [&](float logit) { return logit >= lower; },
        [&](float logit) { return softmax_weight(logit, max_logit, temperature); }, &key);
    dist.threshold = key_to_float(key);
    mass = top_p.through;
  }
  dist.norm = mass;
  return dist;
}

template <typename scalar_t>
__device__ DraftSoftmax build_draft_softmax(const scalar_t* row, int64_t vocab, double temperature) {
  float local = -INFINITY;
  block_for_each_logit(row, vocab, [&](int64_t, float logit) { local = fmaxf(local, logit); });
  const float max_logit = block_max(local);
  double sum = 0.0;
  block_for_each_logit(row, vocab, [&](int64_t, float logit) { sum += softmax_weight(logit, max_logit, temperature); });
  return {max_logit, log(block_sum(sum)), temperature};
}

}  // namespace dblast::cuda
