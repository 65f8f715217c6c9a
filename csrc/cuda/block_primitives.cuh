// Block-level building blocks of the verifier kernels: vectorised row traversal,
// reductions, and the order-preserving float key used by the radix searches.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

namespace dblast::cuda {

constexpr int kThreads = 256;  // every verifier kernel runs blocks of this size

// Calls f(v, logit_as_float) for every v in [0, vocab), spread over the block's threads.
// The aligned body is read with 16-byte loads; the unaligned head and the tail one by one.
template <typename scalar_t, typename F>
__device__ __forceinline__ void block_for_each_logit(const scalar_t* row, int64_t vocab, F&& f) {
  constexpr int kVec = 16 / sizeof(scalar_t);
  const uintptr_t address = reinterpret_cast<uintptr_t>(row);
  int64_t head = static_cast<int64_t>(((16 - (address & 15)) & 15) / sizeof(scalar_t));
  if (address % sizeof(scalar_t) != 0 || head > vocab) head = vocab;
  for (int64_t v = threadIdx.x; v < head; v += blockDim.x) f(v, static_cast<float>(row[v]));
  const int64_t chunks = (vocab - head) / kVec;
  const uint4* body = reinterpret_cast<const uint4*>(row + head);
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    const uint4 raw = __ldg(body + c);
    const scalar_t* values = reinterpret_cast<const scalar_t*>(&raw);
#pragma unroll
    for (int e = 0; e < kVec; ++e) f(head + c * kVec + e, static_cast<float>(values[e]));
  }
  for (int64_t v = head + chunks * kVec + threadIdx.x; v < vocab; v += blockDim.x) {
    f(v, static_cast<float>(row[v]));
  }
}

template <typename T>
__device__ __forceinline__ T block_sum(T value) {
  using Reduce = cub::BlockReduce<T, kThreads>;
  __shared__ typename Reduce::TempStorage storage;
  __shared__ T result;
  const T total = Reduce(storage).Sum(value);
  if (threadIdx.x == 0) result = total;
  __syncthreads();
  const T out = result;
  __syncthreads();
  return out;
}

template <typename T>
__device__ __forceinline__ T block_max(T value) {
  using Reduce = cub::BlockReduce<T, kThreads>;
  __shared__ typename Reduce::TempStorage storage;
  __shared__ T result;
  const T best = Reduce(storage).Reduce(value, [](T a, T b) { return a > b ? a : b; });
  if (threadIdx.x == 0) result = best;
  __syncthreads();
  const T out = result;
  __syncthreads();
  return out;
}

struct ArgMax {
  float value;
  int64_t index;
};

// Larger value wins; equal values keep the lower index (the greedy tie rule).
__device__ __forceinline__ ArgMax better(const ArgMax& a, const ArgMax& b) {
  if (a.value > b.value) return a;
  if (b.value > a.value) return b;
  return a.index <= b.index ? a : b;
}

__device__ __forceinline__ ArgMax block_argmax(ArgMax local) {
  using Reduce = cub::BlockReduce<ArgMax, kThreads>;
  __shared__ typename Reduce::TempStorage storage;
  __shared__ ArgMax result;
  const ArgMax best = Reduce(storage).Reduce(local, [](const ArgMax& a, const ArgMax& b) { return better(a, b); });
  if (threadIdx.x == 0) result = best;
  __syncthreads();
  const ArgMax out = result;
  __syncthreads();
  return out;
}

// Monotone map float -> uint32 (a < b  <=>  key(a) < key(b)); -0.0 is folded into +0.0 so
// that keys group values exactly as float comparison does.
__device__ __forceinline__ uint32_t ordered_key(float x) {
  if (x == 0.0f) x = 0.0f;
  const uint32_t bits = __float_as_uint(x);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

__device__ __forceinline__ float key_to_float(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// Announces that this block finished its part of row `row`; returns true in the one
// block that finished last (all blocks of the row have published their results, which
// the caller may now read). Classic threadfence + ticket pattern: one launch, no grid sync.
__device__ __forceinline__ bool block_finished_last(int* tickets, int64_t row, int blocks_per_row) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(tickets + row, 1) == blocks_per_row - 1;
  }
  __syncthreads();
  if (last) __threadfence();
  return last;
}

}  // namespace dblast::cuda
