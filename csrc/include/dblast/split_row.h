// Math of a vocabulary row split into slices that separate workers reduce on their own and
// then combine (the staged CUDA kernels split a row over the thread blocks of a cluster; a
// CPU could split it over threads alike). Host and device share it so that the partition,
// the fixed-point masses and the merge rules are one definition.
#pragma once

#include <cmath>
#include <cstdint>

#include "dblast/common.h"

namespace dblast {

// A row is split into at most kSplitMaxParts slices of at least kSplitMinSlice tokens (below
// that, the combine costs more than the split saves). Slices hold a multiple of 8 tokens so
// that a 16-byte aligned row keeps every slice 16-byte aligned (8 bf16 / 4 fp32 per load).
constexpr int kSplitMaxParts = 8;
constexpr int64_t kSplitMinSlice = 4096;

DBLAST_HD int split_parts(int64_t vocab) {
  const int64_t parts = (vocab + kSplitMinSlice - 1) / kSplitMinSlice;
  return parts < 1 ? 1 : (parts > kSplitMaxParts ? kSplitMaxParts : static_cast<int>(parts));
}

DBLAST_HD int64_t split_slice(int64_t vocab, int parts) {
  const int64_t even = (vocab + parts - 1) / parts;
  return (even + 7) / 8 * 8;
}

// Token range [begin, end) of slice `part` (empty slices are possible only for tiny rows).
DBLAST_HD int64_t split_begin(int64_t vocab, int64_t slice, int part) {
  const int64_t begin = slice * part;
  return begin < vocab ? begin : vocab;
}
DBLAST_HD int64_t split_end(int64_t vocab, int64_t slice, int part) {
  const int64_t end = slice * (part + 1);
  return end < vocab ? end : vocab;
}

// Softmax masses as unsigned fixed-point integers: w in [0, 1] becomes round(w * 2^bits).
// Integer sums do not depend on the order of the additions, so histograms of masses built
// with atomics (or by any number of workers) are bit-for-bit reproducible. `bits` leaves
// room for a whole row: vocab * 2^bits < 2^62. For V = 151,936 a weight is kept to 2^-45
// (3e-14), far below the float64 rounding of the masses the CPU kernels sum.
DBLAST_HD int fixed_point_bits(int64_t vocab) {
  int length = 0;  // bit length of vocab
  for (int64_t v = vocab; v > 0; v >>= 1) ++length;
  const int bits = 62 - length;
  return bits > 52 ? 52 : bits;
}

DBLAST_HD uint64_t to_fixed_point(double weight, double scale) {  // scale = 2^bits
  const double scaled = weight * scale + 0.5;
  return scaled > 0.0 ? static_cast<uint64_t>(scaled) : 0;
}

// Running softmax statistics of a row reduced slice by slice: `max` the largest logit seen,
// `sum` = sum exp((x - max) / T) over the logits seen. Merging in a fixed order gives the
// same result on every run.
struct SoftmaxPartial {
  float max;
  double sum;
};

DBLAST_HD SoftmaxPartial merge_softmax(SoftmaxPartial a, SoftmaxPartial b, double temperature) {
  if (b.sum <= 0.0) return a;
  if (a.sum <= 0.0) return b;
  if (b.max > a.max) {
    return {b.max, a.sum * exp((static_cast<double>(a.max) - static_cast<double>(b.max)) / temperature) + b.sum};
  }
  return {a.max, a.sum + b.sum * exp((static_cast<double>(b.max) - static_cast<double>(a.max)) / temperature)};
}

}  // namespace dblast
