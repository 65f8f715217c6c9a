// Block-level inverse-CDF draw over token ids in increasing order, the device twin of
// dblast::cpu::inverse_cdf_draw: the first v with weight(v) > 0 whose running sum exceeds
// u * total; the last positive token if rounding leaves the target unreached; -1 when all
// weights are zero. One pass for the total, then a tiled block scan that stops at the tile
// holding the crossing. Each thread's interval [start, end) of the running sum is cut from
// the same inclusive sums as its neighbours' (start = the previous thread's end, bit for
// bit), so the intervals tile the line and a target inside it always has one owner.
#pragma once

#include <climits>

#include "block_primitives.cuh"
#include "dblast/filtering.h"

namespace dblast::cuda {

template <typename scalar_t, typename Weight>
__device__ int64_t block_inverse_cdf(const scalar_t* row, int64_t vocab, double uniform, Weight weight) {
  constexpr int kItems = 8;  // consecutive tokens per thread within a tile
  using Scan = cub::BlockScan<double, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ double ends[kThreads];  // inclusive sums of the tile, thread by thread
  __shared__ unsigned long long found;

  double local_total = 0.0;
  long long local_last = -1;
  block_for_each_logit(row, vocab, [&](int64_t v, float logit) {
    const double w = weight(v, logit);
    if (w > 0.0) {
      local_total += w;
      local_last = v > local_last ? v : local_last;
    }
  });
  const double total = block_sum(local_total);
  const long long last_positive = block_max(local_last);
  if (!(total > 0.0)) return -1;
  const double target = uniform * total;

  if (threadIdx.x == 0) found = ULLONG_MAX;
  __syncthreads();
  double running = 0.0;
  for (int64_t start = 0; start < vocab; start += static_cast<int64_t>(kThreads) * kItems) {
    const int64_t first = start + static_cast<int64_t>(threadIdx.x) * kItems;
    double w[kItems];
    double mine = 0.0;
#pragma unroll
    for (int e = 0; e < kItems; ++e) {
      const int64_t v = first + e;
      w[e] = v < vocab ? weight(v, static_cast<float>(row[v])) : 0.0;
      if (w[e] > 0.0) mine += w[e];
      else w[e] = 0.0;
    }
    double inclusive;
    Scan(scan_storage).InclusiveSum(mine, inclusive);
    ends[threadIdx.x] = inclusive;
    __syncthreads();
    const double interval_start = running + (threadIdx.x > 0 ? ends[threadIdx.x - 1] : 0.0);
    const double interval_end = running + inclusive;
    const double tile_total = ends[kThreads - 1];  // read before the barrier below frees `ends`
    if (mine > 0.0 && interval_start <= target && interval_end > target) {
      double acc = interval_start;  // if rounding keeps acc short of target: the thread's last positive token
      long long pick = -1;
      for (int e = 0; e < kItems; ++e) {
        if (w[e] <= 0.0) continue;
        acc += w[e];
        pick = first + e;
        if (acc > target) break;
      }
      atomicMin(&found, static_cast<unsigned long long>(pick));
    }
    __syncthreads();
    if (found != ULLONG_MAX) break;
    running += tile_total;  // the next tile's first interval starts where this tile's last ended
  }
  const unsigned long long result = found;
  __syncthreads();
  return result != ULLONG_MAX ? static_cast<int64_t>(result) : static_cast<int64_t>(last_positive);
}

// The final token of a verification step (device twin of dblast::cpu::draw_final_token):
// from the `residual` weights, or from the filtered target when they have no mass.
template <typename scalar_t, typename Residual>
__device__ int64_t block_draw_final_token(const scalar_t* row, int64_t vocab, double uniform,
                                          const FilteredDist& dist, Residual residual) {
  const int64_t token = block_inverse_cdf(row, vocab, uniform, residual);
  if (token >= 0) return token;
  return block_inverse_cdf(row, vocab, uniform, [&](int64_t v, float logit) { return dist.prob(logit, v); });
}

}  // namespace dblast::cuda
