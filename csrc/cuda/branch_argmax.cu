// CUDA kernels of dblast::branch_argmax. One skinny-GEMM kernel, Y = X W^T with X a few
// float32 rows (N*K <= a few hundred) and W a large weight matrix, serves both steps:
//   1. the expander, epilogue: states[n, z, :] = h[n] + (W h[n])[z-block] + b[z-block];
//   2. the LM head, epilogue: per row and 64-token tile, a partial (max, argmax, sum-exp);
// then a combine kernel merges the partials of each row in vocabulary order (lowest id on
// ties). W is read with 16-byte loads; each weight tile is loaded once per 16 R rows of X
// (R = 1, 2 or 4 rows per thread, the smallest that covers N*K up to 64), so for N*K <= 64 the
// LM head is read from device memory once per call and few padding rows are multiplied.
// Float32 FMAs. With the staged kernels switched on (dblast/kernel_variant.h) or this one
// promoted (staged/promoted.h) the checked arguments go to staged/branch_argmax.cu instead
// (tensor-core GEMMs over vocabulary tiles).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "block_primitives.cuh"
#include "dblast/argmax_logsumexp.h"
#include "dblast/branch_argmax_checks.h"
#include "dblast/verify_checks.h"
#include "staged/promoted.h"
#include "staged/staged_ops.h"

namespace dblast::cuda {
namespace {

constexpr int kTileCols = 64;  // rows of W (output columns) per block
constexpr int kTileK = 16;     // reduction chunk
constexpr int kGemmThreads = 256;  // 16 x 16 threads, each an R x 4 block of outputs

struct GemmShape {
  int64_t rows;   // R: rows of X
  int64_t cols;   // J: rows of W used
  int64_t width;  // H
  bool vector_loads;  // W rows are 16-byte aligned at every chunk
};

// Loads W[j0 : j0+64, k0 : k0+16] into shared memory as float, transposed to [k][j].
template <typename scalar_t>
__device__ __forceinline__ void load_weight_chunk(const scalar_t* __restrict__ w, const GemmShape& s, int64_t j0,
                                                  int64_t k0, float (*tile)[kTileCols + 1]) {
  constexpr int kVec = 16 / sizeof(scalar_t);
  if (s.vector_loads && k0 + kTileK <= s.width) {
    constexpr int kVecsPerRow = kTileK / kVec;
    for (int e = threadIdx.x; e < kTileCols * kVecsPerRow; e += blockDim.x) {
      const int j = e / kVecsPerRow, c = e % kVecsPerRow;
      if (j0 + j < s.cols) {
        const uint4 raw = __ldg(reinterpret_cast<const uint4*>(w + (j0 + j) * s.width + k0 + c * kVec));
        const scalar_t* values = reinterpret_cast<const scalar_t*>(&raw);
#pragma unroll
        for (int q = 0; q < kVec; ++q) tile[c * kVec + q][j] = static_cast<float>(values[q]);
      } else {
#pragma unroll
        for (int q = 0; q < kVec; ++q) tile[c * kVec + q][j] = 0.0f;
      }
    }
    return;
  }
  for (int e = threadIdx.x; e < kTileCols * kTileK; e += blockDim.x) {
    const int j = e / kTileK, k = e % kTileK;
    const bool inside = j0 + j < s.cols && k0 + k < s.width;
    tile[k][j] = inside ? static_cast<float>(w[(j0 + j) * s.width + k0 + k]) : 0.0f;
  }
}

// acc[i][jj] = Y[r0 + ty + 16 i, j0 + tx + 16 jj] for the block's column tile, then epi(...)
// for every pass over 16 R rows of X.
template <int R, typename scalar_t, typename Epilogue>
__global__ void __launch_bounds__(kGemmThreads)
    skinny_gemm_kernel(const float* __restrict__ x, const scalar_t* __restrict__ w, GemmShape s, Epilogue epi) {
  constexpr int kTileRows = 16 * R;
  __shared__ float x_tile[kTileK][kTileRows + 1];
  __shared__ float w_tile[kTileK][kTileCols + 1];
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * kTileCols;
  for (int64_t r0 = 0; r0 < s.rows; r0 += kTileRows) {
    float acc[R][4] = {};
    for (int64_t k0 = 0; k0 < s.width; k0 += kTileK) {
      for (int e = threadIdx.x; e < kTileRows * kTileK; e += blockDim.x) {
        const int r = e / kTileK, k = e % kTileK;
        const bool inside = r0 + r < s.rows && k0 + k < s.width;
        x_tile[k][r] = inside ? x[(r0 + r) * s.width + k0 + k] : 0.0f;
      }
      load_weight_chunk(w, s, j0, k0, w_tile);
      __syncthreads();
#pragma unroll
      for (int k = 0; k < kTileK; ++k) {
        float a[R], b[4];
#pragma unroll
        for (int i = 0; i < R; ++i) a[i] = x_tile[k][ty + 16 * i];
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) b[jj] = w_tile[k][tx + 16 * jj];
#pragma unroll
        for (int i = 0; i < R; ++i) {
#pragma unroll
          for (int jj = 0; jj < 4; ++jj) acc[i][jj] = fmaf(a[i], b[jj], acc[i][jj]);
        }
      }
      __syncthreads();
    }
    epi(acc, r0, j0, tx, ty);
  }
}

// Expander epilogue: states[(n*K + z)*H + c] = x[n, c] + y[n, z*H + c] + bias[z*H + c].
template <typename scalar_t>
struct ExpanderEpilogue {
  const float* x;
  const scalar_t* bias;
  float* states;
  int64_t rows, width, outputs;  // N, H, K*H

  template <int R>
  __device__ void operator()(const float (&acc)[R][4], int64_t r0, int64_t j0, int tx, int ty) const {
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int64_t n = r0 + ty + 16 * i;
      if (n >= rows) continue;
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const int64_t j = j0 + tx + 16 * jj;
        if (j >= outputs) continue;
        const int64_t z = j / width, c = j % width;
        states[(n * (outputs / width) + z) * width + c] = x[n * width + c] + acc[i][jj] + static_cast<float>(bias[j]);
      }
    }
  }
};

__device__ __forceinline__ ArgmaxLse shuffle_xor(const ArgmaxLse& p, int mask) {
  ArgmaxLse q;
  q.max = __shfl_xor_sync(0xffffffffu, p.max, mask);
  q.index = __shfl_xor_sync(0xffffffffu, p.index, mask);
  q.sum = __shfl_xor_sync(0xffffffffu, p.sum, mask);
  return q;
}

// LM-head epilogue: the 16 threads that share ty (16 consecutive lanes) hold one row's 64
// columns of this tile; reduce them to one partial per (row, tile).
struct LmHeadEpilogue {
  ArgmaxLse* partials;  // [R, tiles]
  int64_t rows, vocab, tiles;

  template <int R>
  __device__ void operator()(const float (&acc)[R][4], int64_t r0, int64_t j0, int tx, int ty) const {
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int64_t r = r0 + ty + 16 * i;
      ArgmaxLse part = ArgmaxLse::empty();
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {  // columns in increasing order
        const int64_t j = j0 + tx + 16 * jj;
        if (j < vocab) part.merge({acc[i][jj], j, 1.0});
      }
      for (int mask = 8; mask >= 1; mask >>= 1) part.merge(shuffle_xor(part, mask));
      if (tx == 0 && r < rows) partials[r * tiles + blockIdx.x] = part;
    }
  }
};

// One block per row: merges the row's tile partials (strided per thread, then a fixed tree:
// deterministic, and the lowest id wins ties whatever the order).
__global__ void __launch_bounds__(kThreads)
    combine_partials_kernel(const ArgmaxLse* __restrict__ partials, int64_t tiles, int64_t* tokens,
                            float* max_logits, float* logsumexp) {
  using Reduce = cub::BlockReduce<ArgmaxLse, kThreads>;
  __shared__ typename Reduce::TempStorage storage;
  const int64_t r = blockIdx.x;
  ArgmaxLse local = ArgmaxLse::empty();
  for (int64_t t = threadIdx.x; t < tiles; t += blockDim.x) local.merge(partials[r * tiles + t]);
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

// Rows per thread: the fewest that cover X's rows in one pass (at most 4, then several passes).
template <typename scalar_t, typename Epilogue>
void launch_skinny_gemm(const float* x, const scalar_t* w, const GemmShape& shape, const Epilogue& epi,
                        cudaStream_t stream) {
  const unsigned grid = static_cast<unsigned>((shape.cols + kTileCols - 1) / kTileCols);
  if (shape.rows <= 16) {
    skinny_gemm_kernel<1><<<grid, kGemmThreads, 0, stream>>>(x, w, shape, epi);
  } else if (shape.rows <= 32) {
    skinny_gemm_kernel<2><<<grid, kGemmThreads, 0, stream>>>(x, w, shape, epi);
  } else {
    skinny_gemm_kernel<4><<<grid, kGemmThreads, 0, stream>>>(x, w, shape, epi);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t>
bool rows_are_16_byte_aligned(const at::Tensor& w) {
  return reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0 && (w.size(1) * sizeof(scalar_t)) % 16 == 0;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> branch_argmax_cuda(
    const at::Tensor& hidden, const at::Tensor& lm_head_weight, const std::optional<at::Tensor>& expander_weight,
    const std::optional<at::Tensor>& expander_bias, int64_t vocab_size, int64_t tile_bytes) {
  (void)tile_bytes;  // the CPU's tiling knob; the GPU tiles in registers
  const int64_t num_branches =
      check_branch_argmax_args(hidden, lm_head_weight, expander_weight, expander_bias, vocab_size);
  if (staged::use_staged(staged::Op::kBranchArgmax, hidden)) {
    return staged::branch_argmax(hidden, lm_head_weight, expander_weight, expander_bias, vocab_size);
  }
  const c10::cuda::CUDAGuard guard(hidden.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t rows = hidden.size(0), width = hidden.size(1), state_rows = rows * num_branches;
  const at::Tensor x = hidden.to(at::kFloat).contiguous();
  const at::Tensor head = lm_head_weight.contiguous();
  auto tokens = at::empty({rows, num_branches}, x.options().dtype(at::kLong));
  auto max_logits = at::empty({rows, num_branches}, x.options());
  auto logsumexp = at::empty({rows, num_branches}, x.options());
  if (rows == 0) return {tokens, max_logits, logsumexp};

  DBLAST_DISPATCH_LOGITS(hidden.scalar_type(), "branch_argmax_cuda", [&] {
    at::Tensor states = x;
    if (expander_weight.has_value()) {
      const at::Tensor w = expander_weight->contiguous(), b = expander_bias->contiguous();
      const int64_t outputs = w.size(0);
      states = at::empty({state_rows, width}, x.options());
      const GemmShape shape{rows, outputs, width, rows_are_16_byte_aligned<scalar_t>(w)};
      const ExpanderEpilogue<scalar_t> epi{x.data_ptr<float>(), b.data_ptr<scalar_t>(), states.data_ptr<float>(),
                                           rows, width, outputs};
      launch_skinny_gemm(x.data_ptr<float>(), w.data_ptr<scalar_t>(), shape, epi, stream);
    }
    const int64_t tiles = (vocab_size + kTileCols - 1) / kTileCols;
    auto partials = at::empty({state_rows * tiles * static_cast<int64_t>(sizeof(ArgmaxLse))},
                              x.options().dtype(at::kByte));
    ArgmaxLse* partial_ptr = reinterpret_cast<ArgmaxLse*>(partials.data_ptr());
    const GemmShape shape{state_rows, vocab_size, width, rows_are_16_byte_aligned<scalar_t>(head)};
    launch_skinny_gemm(states.data_ptr<float>(), head.data_ptr<scalar_t>(), shape,
                       LmHeadEpilogue{partial_ptr, state_rows, vocab_size, tiles}, stream);
    combine_partials_kernel<<<static_cast<unsigned>(state_rows), kThreads, 0, stream>>>(
        partial_ptr, tiles, tokens.data_ptr<int64_t>(), max_logits.data_ptr<float>(), logsumexp.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {tokens, max_logits, logsumexp};
}

}  // namespace

TORCH_LIBRARY_IMPL(dblast, CUDA, m) { m.impl("branch_argmax", &branch_argmax_cuda); }

}  // namespace dblast::cuda
