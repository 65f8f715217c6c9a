// One row of logits reduced by a thread-block cluster (sm_90): the building blocks of the
// staged verifier kernels (branch_verify, mixture_verify, sample_tokens).
//
// Why clusters. The filter needs several dependent reductions over the whole row (max, the
// top-k radix select: 4 rounds, the mass, the top-p radix select: 4 rounds, the norm, the
// inverse-CDF draw). Split over separate kernels, every round would cost a launch (several
// microseconds each, more than the whole budget); split over blocks that meet through a
// global ticket, every round would need a grid-wide wait. A cluster of up to 8 blocks meets
// at a hardware barrier (cluster.sync, well under a microsecond) and each block reads the
// others' partials straight from their shared memory (distributed shared memory), so the
// row is read from HBM once, into the shared memory of the cluster's blocks, and every
// later round runs on that copy.
//
// Layout. The row is cut into split_parts(V) slices (dblast/split_row.h); block `rank` of
// the cluster copies its slice into dynamic shared memory (`RowSlice`; slices larger than
// the cache keep their tail in global memory, read again through L2). Every reduction is
// block-local first (fixed thread order, cub's fixed tree), then combined by every block
// reading all blocks' partials in rank order, so all blocks hold the same bits and take the
// same branches. No floating-point atomics: histograms count integers (top-k) or fixed-point
// masses (top-p, dblast::to_fixed_point), whose sums do not depend on the order.
//
// Rules for callers: every block of the cluster calls the same functions in the same order
// (they contain cluster barriers), with cluster-uniform arguments; and a kernel calls
// `cluster_finish()` before it exits, so that no block leaves while another still reads its
// shared memory.
//
// Architectures. Clusters exist from sm_90 on: the device functions here are compiled for
// sm_90+ only (DBLAST_CLUSTER_CODE), and a kernel built on them wraps its body in
// `#if DBLAST_CLUSTER_CODE`, trapping on older architectures. Those kernels are never launched
// there: the launchers' rule (dblast/kernel_variant.h, cuda_kernel_for) sends a device below
// 9.0, or with less shared memory per block than kClusterCacheBytes + kClusterStaticBytes, to
// the verified kernel.
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <atomic>
#include <climits>
#include <cstdint>
#include <cub/block/block_scan.cuh>

#include "../block_primitives.cuh"
#include "dblast/filtering.h"
#include "dblast/kernel_variant.h"
#include "dblast/split_row.h"

// 1 in the host pass and in device passes for sm_90+, where cooperative_groups has clusters
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
#define DBLAST_CLUSTER_CODE 1
#else
#define DBLAST_CLUSTER_CODE 0
#endif

// Own namespace: other staged kernels' headers live in dblast::cuda::staged too.
namespace dblast::cuda::staged::cluster_row {

namespace cg = cooperative_groups;

// Largest slice copy kept in shared memory per block. With the ~28 KB of static shared
// memory below, two blocks fit on an sm_90 SM even for float32 slices of V = 151,936.
constexpr int kCacheBytes = static_cast<int>(kClusterCacheBytes);
// Blocks of a cluster kernel an SM holds: shared memory allows two (2 x ~108 KB of 228 KB).
// Given to __launch_bounds__, it lets ptxas use up to 128 registers a thread; left to itself,
// it aimed at an occupancy the shared memory never allows and spilled (sm_100).
constexpr int kClusterBlocksPerSm = 2;

// A cluster-wide exchange slot: each block writes its own, every block reads all of them.
struct Slot {
  double a, b;
  long long i, j;
};
constexpr int kSlots = 8;
enum SlotId { kSlotArgmax, kSlotMass, kSlotNorm, kSlotDrawTotals, kSlotDrawResult };

// Per-warp radix histograms (fewer atomic collisions): 32-bit token counts for the top-k
// select, 64-bit fixed-point masses for the top-p one.
union WarpHistograms {
  unsigned count[kThreads / 32][256];
  unsigned long long mass[kThreads / 32][256];
};

struct ClusterShared {
  Slot slots[kSlots];                                   // each used once per kernel: no reuse hazards
  WarpHistograms warp;
  unsigned long long hist[2][256];                      // the block's histogram, read by the cluster;
                                                        // double-buffered by pass parity
  unsigned long long merged[256];                       // the cluster's histogram
  int digit;
  unsigned long long before;
};

#if DBLAST_CLUSTER_CODE

__device__ __forceinline__ unsigned cluster_rank() { return cg::this_cluster().block_rank(); }
__device__ __forceinline__ unsigned cluster_blocks() { return cg::this_cluster().num_blocks(); }
__device__ __forceinline__ void cluster_sync() { cg::this_cluster().sync(); }
__device__ __forceinline__ void cluster_finish() { cg::this_cluster().sync(); }

template <typename T>
__device__ __forceinline__ const T& remote(const T& local, unsigned rank) {
  return *cg::this_cluster().map_shared_rank(&local, rank);
}

// Writes this block's slot and waits until every block has written its own.
__device__ __forceinline__ void publish(ClusterShared& sh, int slot, const Slot& value) {
  if (threadIdx.x == 0) sh.slots[slot] = value;
  cluster_sync();
}

// This block's share of the row: token ids [begin, begin + count), the first `cached` of
// them copied to shared memory.
template <typename scalar_t>
struct RowSlice {
  const scalar_t* global;  // the row's logits from `begin` on
  const scalar_t* cache;   // shared memory copy of global[0, cached)
  int64_t begin, count, cached;

  __device__ __forceinline__ float at(int64_t j) const {
    return static_cast<float>(j < cached ? cache[j] : global[j]);
  }
  // f(token id, logit) over the slice; thread t visits j = t, t + 256, ... (a fixed order).
  template <typename F>
  __device__ __forceinline__ void for_each(F&& f) const {
    for (int64_t j = threadIdx.x; j < cached; j += kThreads) f(begin + j, static_cast<float>(cache[j]));
    for (int64_t j = cached + threadIdx.x; j < count; j += kThreads) f(begin + j, static_cast<float>(global[j]));
  }
};

// Copies block `rank`'s slice of `row` into `cache` (16-byte loads when aligned, four in
// flight per thread). The one read of the row from HBM.
template <typename scalar_t>
__device__ RowSlice<scalar_t> load_slice(const scalar_t* row, int64_t vocab, int64_t slice, int64_t cache_capacity,
                                         scalar_t* cache) {
  const unsigned rank = cluster_rank();
  const int64_t begin = split_begin(vocab, slice, rank);
  const int64_t count = split_end(vocab, slice, rank) - begin;
  const int64_t cached = count < cache_capacity ? count : cache_capacity;
  const scalar_t* src = row + begin;
  int64_t done = 0;
  if ((reinterpret_cast<uintptr_t>(src) & 15) == 0) {
    constexpr int kVec = 16 / sizeof(scalar_t);
    constexpr int kUnroll = 4;
    const int64_t chunks = cached / kVec;
    const uint4* in = reinterpret_cast<const uint4*>(src);
    uint4* out = reinterpret_cast<uint4*>(cache);
    int64_t c = threadIdx.x;
    for (; c + (kUnroll - 1) * kThreads < chunks; c += kUnroll * kThreads) {
      uint4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) v[u] = __ldg(in + c + u * kThreads);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) out[c + u * kThreads] = v[u];
    }
    for (; c < chunks; c += kThreads) out[c] = __ldg(in + c);
    done = chunks * kVec;
  }
  for (int64_t j = done + threadIdx.x; j < cached; j += kThreads) cache[j] = src[j];
  __syncthreads();
  return {src, cache, begin, count, cached};
}

// Sum of one double per thread over the cluster: block tree, then the blocks' sums in rank
// order (every block computes the same bits).
__device__ __forceinline__ double cluster_sum(double local, ClusterShared& sh, int slot) {
  const double block = block_sum(local);
  publish(sh, slot, Slot{block, 0.0, 0, 0});
  double total = 0.0;
  for (unsigned r = 0; r < cluster_blocks(); ++r) total += remote(sh.slots[slot], r).a;
  return total;
}

// The row's argmax (lowest id on ties), in every block.
template <typename scalar_t>
__device__ ArgMax cluster_argmax(const RowSlice<scalar_t>& s, ClusterShared& sh) {
  ArgMax local{-INFINITY, INT64_MAX};
  s.for_each([&](int64_t v, float logit) { local = better(local, ArgMax{logit, v}); });
  const ArgMax block = block_argmax(local);
  publish(sh, kSlotArgmax, Slot{static_cast<double>(block.value), 0.0, block.index, 0});
  ArgMax best{-INFINITY, INT64_MAX};
  for (unsigned r = 0; r < cluster_blocks(); ++r) {
    const Slot& other = remote(sh.slots[kSlotArgmax], r);
    best = better(best, ArgMax{static_cast<float>(other.a), other.i});
  }
  return best;
}

// Run by warp 0 over the cluster's 256-bin histogram (integer weights): the first bin from
// the top with positive weight at which the running weight, starting from `above`, reaches
// `goal`; if it is never reached, the lowest bin with positive weight (keep everything).
// Lane l owns bins 255 - 8l .. 248 - 8l. Exact: integer sums.
__device__ __forceinline__ void choose_bin_from_top(ClusterShared& sh, unsigned long long above,
                                                    unsigned long long goal) {
  const int lane = threadIdx.x & 31;
  const int top = 255 - 8 * lane;
  unsigned long long local = 0;
#pragma unroll
  for (int e = 0; e < 8; ++e) local += sh.merged[top - e];
  unsigned long long inclusive = local;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const unsigned long long other = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  const unsigned long long exclusive = inclusive - local;
  const unsigned reached = __ballot_sync(0xffffffffu, local > 0 && above + inclusive >= goal);
  const unsigned positive = __ballot_sync(0xffffffffu, local > 0);
  // reached: the first lane holding the crossing; otherwise the last lane with any weight
  const int owner = reached ? __ffs(reached) - 1 : (positive ? 31 - __clz(positive) : 0);
  if (lane == owner) {
    unsigned long long running = above + exclusive;
    int digit = top;
    unsigned long long before = running;
    for (int e = 0; e < 8; ++e) {
      const unsigned long long w = sh.merged[top - e];
      if (w > 0) {
        digit = top - e;
        before = running;
        if (reached && running + w >= goal) break;
      }
      running += w;
    }
    sh.digit = digit;
    sh.before = before;
  }
}

// Radix select over the ordered keys of the logits that pass `keep`, 8 bits per round from
// the top, histogram weights `weight(logit)` (unsigned 64-bit fixed-point softmax mass for
// top-p), or with kCount a weight of 1 per token (top-k; `weight` unused). Returns the key of
// the largest value whose kept weight (that of all kept values >= it) reaches `goal`. Each
// round: per-warp histograms, summed into the block's, one cluster barrier, every block sums
// all blocks' histograms bin by bin (thread b owns bin b) and warp 0 picks the bin. Every
// block picks the same one.
//
// Counting uses 32-bit counters (a slice holds far fewer than 2^32 tokens), and in the first
// round the lanes of a warp that fall into the same bin add once, together: that round bins by
// the key's top byte, sign and exponent, where typical logits fill only 4-6 bins, so without
// grouping most of a warp's 32 atomics would queue on the same address.
template <bool kCount, typename scalar_t, typename Keep, typename Weight>
__device__ uint32_t cluster_radix_select(const RowSlice<scalar_t>& s, unsigned long long goal, Keep keep,
                                         Weight weight, ClusterShared& sh) {
  static_assert(kThreads == 256, "one thread per histogram bin");
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  uint32_t prefix = 0, mask = 0;
  unsigned long long above = 0;
  for (int round = 0; round < 4; ++round) {
    const int shift = 24 - 8 * round;
    unsigned long long* hist = sh.hist[round & 1];
    for (int w = 0; w < kThreads / 32; ++w) {
      if constexpr (kCount) {
        sh.warp.count[w][threadIdx.x] = 0;
      } else {
        sh.warp.mass[w][threadIdx.x] = 0;
      }
    }
    __syncthreads();
    if constexpr (kCount) {
      s.for_each([&](int64_t, float logit) {
        const uint32_t key = ordered_key(logit);
        const bool counted = keep(logit) && (key & mask) == prefix;
        if (round > 0) {  // one first-round bin spread over 256: few collisions, no grouping
          if (counted) atomicAdd(&sh.warp.count[warp][(key >> shift) & 255u], 1u);
          return;
        }
        const unsigned digit = counted ? (key >> shift) & 255u : 256u;  // 256: adds nothing
        // the lanes running this visit together (all 32 but at a slice's end), grouped by digit
        const unsigned peers = __match_any_sync(__activemask(), digit);
        if (counted && lane == __ffs(peers) - 1) atomicAdd(&sh.warp.count[warp][digit], __popc(peers));
      });
    } else {
      s.for_each([&](int64_t, float logit) {
        if (!keep(logit)) return;
        const uint32_t key = ordered_key(logit);
        if ((key & mask) == prefix) atomicAdd(&sh.warp.mass[warp][(key >> shift) & 255u], weight(logit));
      });
    }
    __syncthreads();
    unsigned long long bin = 0;
    for (int w = 0; w < kThreads / 32; ++w) {
      if constexpr (kCount) {
        bin += sh.warp.count[w][threadIdx.x];
      } else {
        bin += sh.warp.mass[w][threadIdx.x];
      }
    }
    // Safe to overwrite: this buffer was last read remotely two rounds ago, and every block
    // has passed a cluster barrier since (the one of the previous round).
    hist[threadIdx.x] = bin;
    cluster_sync();
    unsigned long long total = 0;
    for (unsigned r = 0; r < cluster_blocks(); ++r) total += remote(hist[threadIdx.x], r);
    sh.merged[threadIdx.x] = total;
    __syncthreads();
    if (threadIdx.x < 32) choose_bin_from_top(sh, above, goal);
    __syncthreads();
    prefix |= static_cast<uint32_t>(sh.digit) << shift;
    mask |= 255u << shift;
    above = sh.before;
    __syncthreads();  // sh.digit / sh.before are rewritten next round
  }
  return prefix;
}

// The filtered target distribution of the row (dblast/filtering.h), in every block of the
// cluster: the cluster version of target_filter.cuh's build_filtered_dist. The masses are
// float64 (softmax_weight) summed in a fixed order; the top-p round picks its threshold on
// fixed-point masses (scale = 2^fixed_point_bits(V)), the final norm is the float64 sum of
// the kept weights.
template <typename scalar_t>
__device__ FilteredDist cluster_filtered_dist(const RowSlice<scalar_t>& s, int64_t vocab, const FilterSpec& spec,
                                              double fixed_scale, ClusterShared& sh) {
  const ArgMax best = cluster_argmax(s, sh);
  FilteredDist dist;
  dist.max_logit = best.value;
  dist.greedy_token = best.index;
  dist.temperature = spec.temperature;
  dist.threshold = -INFINITY;
  dist.norm = 1.0;
  if (spec.greedy()) return dist;

  const float max_logit = best.value;
  const double temperature = spec.temperature;
  if (spec.uses_top_k(vocab)) {
    const uint32_t key = cluster_radix_select<true>(
        s, static_cast<unsigned long long>(spec.top_k), [](float) { return true; },
        [](float) { return 1ull; }, sh);
    dist.threshold = key_to_float(key);
  }
  const float lower = dist.threshold;
  double local = 0.0;
  s.for_each([&](int64_t, float logit) {
    if (logit >= lower) local += softmax_weight(logit, max_logit, temperature);
  });
  double mass = cluster_sum(local, sh, kSlotMass);
  if (spec.uses_top_p()) {
    const unsigned long long goal = to_fixed_point(spec.top_p * mass, fixed_scale);
    const uint32_t key = cluster_radix_select<false>(
        s, goal, [&](float logit) { return logit >= lower; },
        [&](float logit) { return to_fixed_point(softmax_weight(logit, max_logit, temperature), fixed_scale); }, sh);
    const float threshold = key_to_float(key);
    dist.threshold = threshold;
    local = 0.0;
    s.for_each([&](int64_t, float logit) {
      if (logit >= threshold) local += softmax_weight(logit, max_logit, temperature);
    });
    mass = cluster_sum(local, sh, kSlotNorm);
  }
  dist.norm = mass;
  return dist;
}

// Weights of one token for a draw: `primary` (the residual), and `fallback` (the filtered
// target itself) used when the primary weights have no mass at all.
struct DrawWeights {
  double primary, fallback;
};

// Inverse-CDF draw over token ids in increasing order (the rule of dblast::cpu::inverse_cdf_draw
// and inverse_cdf.cuh): the first id with positive weight whose running sum exceeds
// u * total; the last positive id if rounding leaves the target unreached; -1 when no weight
// is positive. Draws from the primary weights, or from the fallback weights (when
// `use_fallback`) if the primary ones have no mass: both totals come from one pass.
//
// Each block sums its slice; the blocks' totals, added in rank order, cut the running sum
// into consecutive intervals [start_r, start_{r+1}) that every block computes alike, so
// exactly one block owns the target. Only that block scans its slice (tiles of 256 x 8
// consecutive tokens, as inverse_cdf.cuh); if rounding inside the block leaves the target
// unreached there, the block's last positive token is the answer. The result travels to
// every block through the owner's slot.
template <typename scalar_t, typename Weights>
__device__ int64_t cluster_inverse_cdf(const RowSlice<scalar_t>& s, double uniform, Weights weights,
                                       bool use_fallback, ClusterShared& sh) {
  constexpr int kItems = 8;
  using Scan = cub::BlockScan<double, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ double ends[kThreads];
  __shared__ unsigned long long found;

  double total_p = 0.0, total_f = 0.0;
  long long last_p = -1, last_f = -1;
  s.for_each([&](int64_t v, float logit) {
    const DrawWeights w = weights(v, logit);
    if (w.primary > 0.0) {
      total_p += w.primary;
      last_p = v;  // ids increase along a thread's visits
    }
    if (use_fallback && w.fallback > 0.0) {
      total_f += w.fallback;
      last_f = v;
    }
  });
  total_p = block_sum(total_p);
  last_p = block_max(last_p);
  if (use_fallback) {
    total_f = block_sum(total_f);
    last_f = block_max(last_f);
  }
  publish(sh, kSlotDrawTotals, Slot{total_p, total_f, last_p, last_f});

  const unsigned blocks = cluster_blocks(), rank = cluster_rank();
  double total = 0.0;
  for (unsigned r = 0; r < blocks; ++r) total += remote(sh.slots[kSlotDrawTotals], r).a;
  bool primary = true;
  if (!(total > 0.0)) {
    primary = false;
    total = 0.0;
    if (use_fallback) {
      for (unsigned r = 0; r < blocks; ++r) total += remote(sh.slots[kSlotDrawTotals], r).b;
    }
  }
  // every block: the same intervals, the same owner
  int64_t result = -1;
  int owner = -1;
  double owner_start = 0.0;
  long long owner_last = -1;
  if (total > 0.0) {
    const double target = uniform * total;
    double start = 0.0;
    long long last = -1;
    for (unsigned r = 0; r < blocks; ++r) {
      const Slot& other = remote(sh.slots[kSlotDrawTotals], r);
      const double part = primary ? other.a : other.b;
      const long long part_last = primary ? other.i : other.j;
      const double end = start + part;
      if (owner < 0 && part > 0.0 && start <= target && target < end) {
        owner = static_cast<int>(r);
        owner_start = start;
        owner_last = part_last;
      }
      last = part_last > last ? part_last : last;
      start = end;
    }
    result = last;  // the target unreached: the row's last positive token
    if (owner == static_cast<int>(rank)) {
      if (threadIdx.x == 0) found = ULLONG_MAX;
      __syncthreads();
      double running = owner_start;
      for (int64_t tile = 0; tile < s.count; tile += static_cast<int64_t>(kThreads) * kItems) {
        const int64_t first = tile + static_cast<int64_t>(threadIdx.x) * kItems;
        double w[kItems];
        double mine = 0.0;
#pragma unroll
        for (int e = 0; e < kItems; ++e) {
          const int64_t j = first + e;
          w[e] = 0.0;
          if (j < s.count) {
            const DrawWeights both = weights(s.begin + j, s.at(j));
            const double x = primary ? both.primary : both.fallback;
            if (x > 0.0) w[e] = x;
          }
          mine += w[e];
        }
        double inclusive;
        Scan(scan_storage).InclusiveSum(mine, inclusive);
        ends[threadIdx.x] = inclusive;
        __syncthreads();
        const double interval_start = running + (threadIdx.x > 0 ? ends[threadIdx.x - 1] : 0.0);
        const double interval_end = running + inclusive;
        const double tile_total = ends[kThreads - 1];
        if (mine > 0.0 && interval_start <= target && interval_end > target) {
          double acc = interval_start;
          long long pick = -1;
          for (int e = 0; e < kItems; ++e) {
            if (w[e] <= 0.0) continue;
            acc += w[e];
            pick = s.begin + first + e;
            if (acc > target) break;
          }
          atomicMin(&found, static_cast<unsigned long long>(pick));
        }
        __syncthreads();
        if (found != ULLONG_MAX) break;
        running += tile_total;
      }
      const unsigned long long pick = found;
      result = pick != ULLONG_MAX ? static_cast<int64_t>(pick) : static_cast<int64_t>(owner_last);
    }
  }
  publish(sh, kSlotDrawResult, Slot{0.0, 0.0, result, 0});
  if (owner >= 0) result = remote(sh.slots[kSlotDrawResult], static_cast<unsigned>(owner)).i;
  return result;
}

#endif  // DBLAST_CLUSTER_CODE

// Launches `kKernel` on clusters of `parts` blocks of kThreads threads, `clusters` of them,
// with `smem` bytes of dynamic shared memory. Graph-capturable: no host synchronisation.
template <auto kKernel, typename... Args>
void launch_clusters(int64_t clusters, int parts, size_t smem, cudaStream_t stream, Args&&... args) {
  // The dynamic shared-memory limit is the kernel's attribute on each device: raised once per
  // (kernel, device), not by a driver call before every launch.
  static std::atomic<unsigned long long> raised{0};  // one bit per device
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const unsigned long long bit = device < 64 ? 1ull << device : 0ull;
  if (bit == 0 || (raised.load(std::memory_order_relaxed) & bit) == 0) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kCacheBytes));
    raised.fetch_or(bit, std::memory_order_relaxed);
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(clusters * parts), 1, 1);
  config.blockDim = dim3(kThreads, 1, 1);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = static_cast<unsigned>(parts);
  attribute[0].val.clusterDim.y = 1;
  attribute[0].val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kKernel, std::forward<Args>(args)...));
}

// Bytes of dynamic shared memory for one block's slice copy, and the copy's capacity.
inline int64_t cache_capacity(int64_t slice, size_t element_size) {
  const int64_t fit = static_cast<int64_t>(kCacheBytes / element_size) / 8 * 8;
  return slice < fit ? slice : fit;
}

}  // namespace dblast::cuda::staged::cluster_row
