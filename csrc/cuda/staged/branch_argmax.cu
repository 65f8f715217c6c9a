// Staged CUDA kernel of dblast::branch_argmax: the LM head on tensor cores through cuBLAS,
// vocabulary tile by vocabulary tile, with a fused running (max, argmax, sum-exp) per row.
//
// Design
// - Exact enough in 16 bits. The branch states are float32 (h + W_z h + b_z) and the head is
//   bf16/fp16; rounding the states to 16 bits before a tensor-core GEMM would move a logit by
//   ~1e-3 (too much for the float32 contract: the tests allow ~1e-4). So each state row s is
//   split into two 16-bit rows, hi = round(s * 2^e) and lo = round(s * 2^e - hi), with a
//   per-row power of two 2^e that puts max|s * 2^e| just under 2^14 (inside fp16's range,
//   harmless for bf16). hi + lo carries 16 (bf16) or 22 (fp16) significant bits of s; every
//   product of two 16-bit values is exact in float32 and the GEMM accumulates in float32, so
//   logit = (hi . w + lo . w) * 2^-e is within ~1e-5 relative of the float32 dot product. The
//   GEMM multiplies 2 N K rows instead of N K: for N K <= ~100 rows it stays bound by reading
//   the head once, which is the cost that matters.
// - The expander runs the same way: h is split, one GEMM [2N, H] x [H, K H] gives W h in
//   float32, and one kernel forms the states and splits them for the head.
// - The head: vocabulary tiles of `cols` rows (a multiple of 128, balanced so the last tile is
//   not a sliver), sized so the float32 logits of one tile, [2 N K, cols], fit a 16 MiB
//   workspace (at least 2048 columns). Per tile, one cuBLAS GEMM (at::mm_out with a float32
//   output; the head tile is read once, by the GEMM) writes the workspace, then
//   tile_partials_kernel, one block per (state row, 2048-column chunk), adds hi + lo, rescales,
//   and reduces the chunk to one (max, argmax, sum-exp) partial. The [N, K, V] logits never
//   exist: only one tile's, which stays mostly in L2 between its GEMM and its reduction.
// - Merge order: a thread walks its columns in increasing id and keeps the first of equal
//   maxima; partials merge through ArgmaxLse::merge (dblast/argmax_logsumexp.h, shared with the
//   CPU kernel), which keeps the lowest id on equal maxima whatever the grouping; the block
//   and final reductions are fixed trees, so results are deterministic and ties go to the
//   lowest token id.
// - float32 heads skip the split: the states stay float32 and the GEMM is cuBLAS's float32
//   GEMM (ATen's; it uses TF32 only if the caller allowed TF32 matmuls).
// - So do 16-bit states that are already exact: without an expander the branch state is the
//   16-bit hidden row itself, whose lo half would be all zeros. The GEMM then takes h as it is
//   ([N, H], half the rows), with the same float32 accumulation and output.
// - Graph-capturable: no host synchronisation; the workspaces are at::empty on the current
//   stream; the tile plan depends on shapes only.
// Host code here formats no error messages (the launcher's host checks ran before dispatch).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cmath>

#include "../block_primitives.cuh"
#include "dblast/argmax_logsumexp.h"
#include "staged_ops.h"

namespace dblast::cuda::staged {
namespace {

constexpr int kSplitExponent = 14;             // scaled rows satisfy max|s| < 2^14 (fp16 max 65504)
constexpr int64_t kWorkspaceBytes = 16 << 20;  // one tile of float32 logits, [GEMM rows, cols]
constexpr int64_t kMinTileColumns = 2048;      // below this the GEMMs get too small to fill the GPU
constexpr int64_t kColumnAlign = 128;          // tile starts stay 128-row aligned in the head
constexpr int kChunkColumns = 2048;            // columns per partial: 8 per thread

// Row r, column c of the float32 matrix to split: the hidden states, the expander's input.
template <typename scalar_t>
struct HiddenRows {
  const scalar_t* hidden;  // [rows, width]
  int64_t width;
  __device__ __forceinline__ float operator()(int64_t r, int64_t c) const {
    return static_cast<float>(hidden[r * width + c]);
  }
};

// Branch state r = n K + z at column c: h[n, c] + ((W h)[n, z H + c] + b[z H + c]), with W h
// rebuilt from the split GEMM's two halves (hi rows 0..N-1, lo rows N..2N-1) and h's scale.
template <typename scalar_t>
struct BranchStateRows {
  const scalar_t* hidden;       // [N, H]
  const float* expanded;        // [2N, K H]: hi . W^T, then lo . W^T
  const float* hidden_inverse;  // [N]: 2^-e of h's split
  const scalar_t* bias;         // [K H]
  int64_t rows, branches, width;
  __device__ __forceinline__ float operator()(int64_t r, int64_t c) const {
    const int64_t n = r / branches, j = (r % branches) * width + c, outputs = branches * width;
    const float product = (expanded[n * outputs + j] + expanded[(rows + n) * outputs + j]) * hidden_inverse[n];
    return static_cast<float>(hidden[n * width + c]) + (product + static_cast<float>(bias[j]));
  }
};

// One block per row r of `values`: out[r] = hi, out[rows + r] = lo with
// hi + lo = values(r, :) * 2^e (to 16 + 8 or 11 + 11 bits), inverse[r] = 2^-e. Two passes over
// the row (max first), recomputing the values: they are a few loads each, from L2.
template <typename scalar_t, typename Values>
__global__ void __launch_bounds__(kThreads)
    split_rows_kernel(Values values, int64_t rows, int64_t width, scalar_t* __restrict__ out,
                      float* __restrict__ inverse) {
  const int64_t r = blockIdx.x;
  float largest = 0.0f;
  for (int64_t c = threadIdx.x; c < width; c += blockDim.x) largest = fmaxf(largest, fabsf(values(r, c)));
  largest = block_max(largest);
  int exponent = 0;  // largest < 2^exponent
  if (largest > 0.0f && isfinite(largest)) frexpf(largest, &exponent);
  // clamped so that 2^shift and 2^-shift are normal floats
  const int shift = min(max(kSplitExponent - exponent, -100), 100);
  const float scale = ldexpf(1.0f, shift);
  for (int64_t c = threadIdx.x; c < width; c += blockDim.x) {
    const float u = values(r, c) * scale;
    const scalar_t hi = static_cast<scalar_t>(u);
    out[r * width + c] = hi;
    out[(rows + r) * width + c] = static_cast<scalar_t>(u - static_cast<float>(hi));  // exact difference
  }
  if (threadIdx.x == 0) inverse[r] = ldexpf(1.0f, -shift);
}

// One block per (state row r, chunk p) of one vocabulary tile: the partial (max, argmax,
// sum-exp) of logits [p * 2048, (p + 1) * 2048) of the tile, written to
// partials[r * stride + offset + p]; a chunk past the tile's end writes an empty partial, so
// every slot is written on every call.
template <bool kSplit>
__global__ void __launch_bounds__(kThreads)
    tile_partials_kernel(const float* __restrict__ logits, const float* __restrict__ inverse, int64_t state_rows,
                         int64_t count, int64_t first_token, int chunks, int64_t stride, int64_t offset,
                         ArgmaxLse* __restrict__ partials) {
  const int64_t r = blockIdx.x / chunks;
  const int p = static_cast<int>(blockIdx.x % chunks);
  const int64_t begin = static_cast<int64_t>(p) * kChunkColumns;
  const int64_t end = min(count, begin + kChunkColumns);
  const float* hi = logits + r * count;
  const float* lo = logits + (state_rows + r) * count;  // read only when kSplit
  const float unscale = kSplit ? inverse[r] : 1.0f;
  float best = -INFINITY, sum = 0.0f;
  int64_t best_column = -1;
  for (int64_t j = begin + threadIdx.x; j < end; j += blockDim.x) {  // increasing j per thread
    const float v = kSplit ? (hi[j] + lo[j]) * unscale : hi[j];
    if (v > best) {  // strictly: an equal later logit keeps the lower id
      sum = sum * __expf(best - v) + 1.0f;
      best = v;
      best_column = j;
    } else {
      sum += __expf(v - best);
    }
  }
  const ArgmaxLse local = best_column < 0 ? ArgmaxLse::empty()
                                          : ArgmaxLse{best, first_token + best_column, static_cast<double>(sum)};
  using Reduce = cub::BlockReduce<ArgmaxLse, kThreads>;
  __shared__ typename Reduce::TempStorage storage;
  const ArgmaxLse total = Reduce(storage).Reduce(local, [](ArgmaxLse a, const ArgmaxLse& b) {
    a.merge(b);
    return a;
  });
  if (threadIdx.x == 0) partials[r * stride + offset + p] = total;
}

// One block per state row: merges its partials (strided per thread, then a fixed tree).
__global__ void __launch_bounds__(kThreads)
    combine_kernel(const ArgmaxLse* __restrict__ partials, int64_t per_row, int64_t* __restrict__ tokens,
                   float* __restrict__ max_logits, float* __restrict__ logsumexp) {
  using Reduce = cub::BlockReduce<ArgmaxLse, kThreads>;
  __shared__ typename Reduce::TempStorage storage;
  const int64_t r = blockIdx.x;
  ArgmaxLse local = ArgmaxLse::empty();
  for (int64_t t = threadIdx.x; t < per_row; t += blockDim.x) local.merge(partials[r * per_row + t]);
  const ArgmaxLse total = Reduce(storage).Reduce(local, [](ArgmaxLse a, const ArgmaxLse& b) {
    a.merge(b);
    return a;
  });
  if (threadIdx.x == 0) {
    tokens[r] = total.index;
    max_logits[r] = total.max;
    logsumexp[r] = total.logsumexp();
  }
}

// The GEMM's left operand for 16-bit weights and an expander: [2 N K, H] in hidden's dtype (hi
// rows, then lo rows) and `inverse` [N K], the per-row 2^-e.
template <typename scalar_t>
at::Tensor split_states(const at::Tensor& hidden, const std::optional<at::Tensor>& expander_weight,
                        const std::optional<at::Tensor>& expander_bias, int64_t branches, at::Tensor& inverse,
                        cudaStream_t stream) {
  const int64_t rows = hidden.size(0), width = hidden.size(1), state_rows = rows * branches;
  const auto float_options = hidden.options().dtype(at::kFloat);
  const scalar_t* h = hidden.data_ptr<scalar_t>();
  at::Tensor operand = at::empty({2 * state_rows, width}, hidden.options());
  inverse = at::empty({state_rows}, float_options);
  const at::Tensor weight = expander_weight->contiguous(), bias = expander_bias->contiguous();
  at::Tensor hidden_split = at::empty({2 * rows, width}, hidden.options());
  at::Tensor hidden_inverse = at::empty({rows}, float_options);
  split_rows_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
      HiddenRows<scalar_t>{h, width}, rows, width, hidden_split.data_ptr<scalar_t>(),
      hidden_inverse.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const at::Tensor expanded = at::mm(hidden_split, weight.t(), at::kFloat);  // [2N, K H], float32 accumulation
  const BranchStateRows<scalar_t> states{h,     expanded.data_ptr<float>(), hidden_inverse.data_ptr<float>(),
                                         bias.data_ptr<scalar_t>(), rows, branches, width};
  split_rows_kernel<<<static_cast<unsigned>(state_rows), kThreads, 0, stream>>>(
      states, state_rows, width, operand.data_ptr<scalar_t>(), inverse.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return operand;
}

// float32 branch states [N K, H] for a float32 head (as the CPU kernel forms them).
at::Tensor float_states(const at::Tensor& hidden, const std::optional<at::Tensor>& expander_weight,
                        const std::optional<at::Tensor>& expander_bias, int64_t branches) {
  if (!expander_weight.has_value()) return hidden;
  const int64_t rows = hidden.size(0), width = hidden.size(1);
  at::Tensor expanded = at::addmm(*expander_bias, hidden, expander_weight->t());  // [N, K H]
  return expanded.view({rows, branches, width}).add_(hidden.unsqueeze(1)).view({rows * branches, width});
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> branch_argmax(const at::Tensor& hidden, const at::Tensor& lm_head_weight,
                                                             const std::optional<at::Tensor>& expander_weight,
                                                             const std::optional<at::Tensor>& expander_bias,
                                                             int64_t vocab_size) {
  const c10::cuda::CUDAGuard guard(hidden.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t rows = hidden.size(0), width = hidden.size(1);
  const int64_t branches = expander_weight.has_value() ? expander_weight->size(0) / width : 1;
  const int64_t state_rows = rows * branches;
  const auto float_options = hidden.options().dtype(at::kFloat);
  auto tokens = at::empty({rows, branches}, hidden.options().dtype(at::kLong));
  auto max_logits = at::empty({rows, branches}, float_options);
  auto logsumexp = at::empty({rows, branches}, float_options);
  if (rows == 0) return {tokens, max_logits, logsumexp};

  const bool sixteen_bit = hidden.scalar_type() != at::kFloat;
  const bool split = sixteen_bit && expander_weight.has_value();  // else the states are exact as they are
  const at::Tensor h = hidden.contiguous();
  const at::Tensor head = lm_head_weight.contiguous();
  at::Tensor inverse;  // [N K], split only
  at::Tensor operand;  // the GEMM's rows: [2 N K, H] 16-bit hi/lo, [N, H] 16-bit h, or [N K, H] float32
  if (!sixteen_bit) {
    operand = float_states(h, expander_weight, expander_bias, branches).contiguous();
  } else if (!split) {
    operand = h;
  } else if (h.scalar_type() == at::kBFloat16) {
    operand = split_states<at::BFloat16>(h, expander_weight, expander_bias, branches, inverse, stream);
  } else {
    operand = split_states<at::Half>(h, expander_weight, expander_bias, branches, inverse, stream);
  }
  const int64_t gemm_rows = operand.size(0);

  // Tile plan (shapes only): the widest 128-multiple whose logits fit the workspace, then
  // balanced over the tiles it takes.
  const int64_t widest = std::max(kMinTileColumns, kWorkspaceBytes / (gemm_rows * 4) / kColumnAlign * kColumnAlign);
  int64_t tiles = (vocab_size + widest - 1) / widest;
  const int64_t balanced = (vocab_size + tiles - 1) / tiles;
  const int64_t cols = std::min(vocab_size, (balanced + kColumnAlign - 1) / kColumnAlign * kColumnAlign);
  tiles = (vocab_size + cols - 1) / cols;
  const int chunks = static_cast<int>((cols + kChunkColumns - 1) / kChunkColumns);
  const int64_t per_row = tiles * chunks;

  at::Tensor workspace = at::empty({gemm_rows * cols}, float_options);
  at::Tensor partials = at::empty({state_rows * per_row * static_cast<int64_t>(sizeof(ArgmaxLse))},
                                  hidden.options().dtype(at::kByte));
  ArgmaxLse* partial_ptr = reinterpret_cast<ArgmaxLse*>(partials.data_ptr());
  const float* inverse_ptr = split ? inverse.data_ptr<float>() : nullptr;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t first = t * cols, count = std::min(cols, vocab_size - first);
    at::Tensor logits = workspace.narrow(0, 0, gemm_rows * count).view({gemm_rows, count});
    const at::Tensor head_tile = head.narrow(0, first, count).t();  // [H, count]
    if (sixteen_bit) {
      at::mm_out(logits, operand, head_tile, at::kFloat);  // 16-bit operands, float32 accumulation and output
    } else {
      at::mm_out(logits, operand, head_tile);
    }
    const unsigned blocks = static_cast<unsigned>(state_rows * chunks);
    if (split) {
      tile_partials_kernel<true><<<blocks, kThreads, 0, stream>>>(logits.data_ptr<float>(), inverse_ptr, state_rows,
                                                                  count, first, chunks, per_row, t * chunks,
                                                                  partial_ptr);
    } else {
      tile_partials_kernel<false><<<blocks, kThreads, 0, stream>>>(logits.data_ptr<float>(), inverse_ptr, state_rows,
                                                                   count, first, chunks, per_row, t * chunks,
                                                                   partial_ptr);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  combine_kernel<<<static_cast<unsigned>(state_rows), kThreads, 0, stream>>>(
      partial_ptr, per_row, tokens.data_ptr<int64_t>(), max_logits.data_ptr<float>(), logsumexp.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {tokens, max_logits, logsumexp};
}

}  // namespace dblast::cuda::staged
