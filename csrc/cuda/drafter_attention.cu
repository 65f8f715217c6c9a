// CUDA kernels of dblast::drafter_attention, flash-decoding style. A block takes one
// (row, kv head, key split, 64-query tile): all query heads of the group and all block
// positions together, so each K/V tile is read once for the whole group. Keys are streamed
// through shared memory 32 at a time with an online softmax in float32; each split leaves an
// unnormalised partial (O, max, sum) and a combine kernel merges the splits.
// When the staged kernels are in force (dblast/kernel_variant.h) or this one is promoted
// (staged/promoted.h), bfloat16/float16 inputs with a head dim the staged tensor-core kernel
// covers go to it (csrc/cuda/staged/drafter_attention.cu) after the same argument checks, but
// without the value check of context_lens (a host synchronisation); the rest stays here.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "dblast/attention_checks.h"
#include "dblast/verify_checks.h"
#include "staged/drafter_attention.cuh"
#include "staged/promoted.h"
#include "staged/staged_ops.h"

namespace dblast::cuda {
namespace {

constexpr int kQueryTile = 64;   // query rows per block
constexpr int kKeyTile = 32;     // keys per shared-memory tile
constexpr int kAttnThreads = 256;  // 4 threads per query row

struct AttentionArgs {
  int64_t heads, kv_heads, block, max_len, splits, window;
  bool causal;  // causal order within the block (dblast/attention_window.h)
  int64_t query_rows;  // M = group * block
  float scale;
  const int32_t* lens;
  float* partial_out;  // [N*Hkv, splits, M, D]
  float* partial_max;  // [N*Hkv, splits, M]
  float* partial_sum;  // [N*Hkv, splits, M]
};

// Copies `count` rows of kDim values (row-major, contiguous) into shared memory as float,
// rows padded to kDim + 1 floats to keep bank accesses conflict-free.
template <typename scalar_t, int kDim>
__device__ __forceinline__ void load_rows(const scalar_t* __restrict__ src, int count, float* dst) {
  constexpr int kVec = 16 / sizeof(scalar_t);
  constexpr int kVecsPerRow = kDim / kVec;
  for (int e = threadIdx.x; e < count * kVecsPerRow; e += blockDim.x) {
    const int row = e / kVecsPerRow, c = e % kVecsPerRow;
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(src + static_cast<int64_t>(row) * kDim) + c);
    const scalar_t* values = reinterpret_cast<const scalar_t*>(&raw);
#pragma unroll
    for (int q = 0; q < kVec; ++q) dst[row * (kDim + 1) + c * kVec + q] = static_cast<float>(values[q]);
  }
}

template <typename scalar_t, int kDim>
__global__ void __launch_bounds__(kAttnThreads)
    attention_split_kernel(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k_cache,
                           const scalar_t* __restrict__ v_cache, const scalar_t* __restrict__ k_block,
                           const scalar_t* __restrict__ v_block, AttentionArgs a) {
  extern __shared__ float smem[];
  float* q_tile = smem;                                     // [64][kDim + 1]
  float* k_tile = q_tile + kQueryTile * (kDim + 1);         // [32][kDim + 1]
  float* v_tile = k_tile + kKeyTile * (kDim + 1);           // [32][kDim + 1]
  float* p_tile = v_tile + kKeyTile * (kDim + 1);           // [64][kKeyTile + 1]
  constexpr int kDimsPerThread = kDim / 4;

  const int64_t split = blockIdx.x, nh = blockIdx.y, m0 = static_cast<int64_t>(blockIdx.z) * kQueryTile;
  const int64_t n = nh / a.kv_heads, h = nh % a.kv_heads;
  const int64_t group = a.heads / a.kv_heads;
  const int row = threadIdx.x / 4, part = threadIdx.x % 4;
  const int64_t m = m0 + row;
  const bool active = m < a.query_rows;
  const int64_t rows_left = a.query_rows - m0;
  const int tile_rows = static_cast<int>(rows_left < kQueryTile ? rows_left : kQueryTile);

  // Keys of this split, in the combined order: cached context first, then the block.
  // clamped: under graph capture the host does not check the values (drafter_attention_cuda)
  const int64_t length = min(max(static_cast<int64_t>(a.lens[n]), int64_t{0}), a.max_len);
  const ContextRange context = context_range(length, a.window);
  const bool mask = needs_query_mask(a.block, a.window, a.causal);
  const int64_t query = m % a.block;  // this row's position in the block (rows are head-major)
  const int64_t cached = context.end - context.begin, total = cached + a.block;
  const int64_t per_split = (total + a.splits - 1) / a.splits;
  const int64_t first = split * per_split, last = min(total, first + per_split);

  const scalar_t* q_rows = q + ((n * a.heads + h * group) * a.block + m0) * kDim;
  load_rows<scalar_t, kDim>(q_rows, tile_rows, q_tile);
  __syncthreads();

  float acc[kDimsPerThread];
#pragma unroll
  for (int i = 0; i < kDimsPerThread; ++i) acc[i] = 0.0f;
  float running_max = -INFINITY, running_sum = 0.0f;
  const float* my_q = q_tile + row * (kDim + 1);

  for (int64_t j0 = first; j0 < last;) {
    // one tile never straddles the cache/block boundary
    const bool in_cache = j0 < cached;
    const int64_t stop = min(min(last, in_cache ? cached : total), j0 + kKeyTile);
    const int count = static_cast<int>(stop - j0);
    const int64_t kv_row = in_cache ? (nh * a.max_len + context.begin + j0) : (nh * a.block + (j0 - cached));
    load_rows<scalar_t, kDim>((in_cache ? k_cache : k_block) + kv_row * kDim, count, k_tile);
    load_rows<scalar_t, kDim>((in_cache ? v_cache : v_block) + kv_row * kDim, count, v_tile);
    __syncthreads();

    // scores of keys part, part + 4, ...: 8 per thread
    float scores[kKeyTile / 4];
    float tile_max = -INFINITY;
#pragma unroll
    for (int c = 0; c < kKeyTile / 4; ++c) {
      const int key = part + 4 * c;
      float s = -INFINITY;
      const int64_t j = j0 + key;  // context position context.begin + j, or block key j - cached
      const bool visible = !mask || (in_cache ? context_key_visible(length, context.begin + j, query, a.window)
                                              : block_key_visible(j - cached, query, a.window, a.causal));
      if (key < count && visible) {
        const float* k_row = k_tile + key * (kDim + 1);
        float dot = 0.0f;
#pragma unroll 16
        for (int d = 0; d < kDim; ++d) dot = fmaf(my_q[d], k_row[d], dot);
        s = dot * a.scale;
      }
      scores[c] = s;
      tile_max = fmaxf(tile_max, s);
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
    const float new_max = fmaxf(running_max, tile_max);
    const float rescale = running_max == -INFINITY ? 0.0f : __expf(running_max - new_max);
    float tile_sum = 0.0f;
#pragma unroll
    for (int c = 0; c < kKeyTile / 4; ++c) {
      const float p = scores[c] == -INFINITY ? 0.0f : __expf(scores[c] - new_max);
      p_tile[row * (kKeyTile + 1) + part + 4 * c] = p;
      tile_sum += p;
    }
    tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, 1);
    tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, 2);
    running_sum = running_sum * rescale + tile_sum;
    running_max = new_max;
    __syncwarp();  // a row's probabilities are written and read by its own 4 lanes

    // acc[i] holds output dim part + 4 i
#pragma unroll
    for (int i = 0; i < kDimsPerThread; ++i) acc[i] *= rescale;
    for (int key = 0; key < count; ++key) {
      const float p = p_tile[row * (kKeyTile + 1) + key];
      const float* v_row = v_tile + key * (kDim + 1);
#pragma unroll
      for (int i = 0; i < kDimsPerThread; ++i) acc[i] = fmaf(p, v_row[part + 4 * i], acc[i]);
    }
    __syncthreads();  // before the next tile overwrites K, V and P
    j0 = stop;
  }

  if (!active) return;
  const int64_t slot = (nh * a.splits + split) * a.query_rows + m;
#pragma unroll
  for (int i = 0; i < kDimsPerThread; ++i) a.partial_out[slot * kDim + part + 4 * i] = acc[i];
  if (part == 0) {
    a.partial_max[slot] = running_max;
    a.partial_sum[slot] = running_sum;
  }
}

// One block per (row * kv head, query row): merges the splits and normalises.
template <typename scalar_t, int kDim>
__global__ void __launch_bounds__(kDim)
    attention_combine_kernel(const AttentionArgs a, scalar_t* __restrict__ out) {
  const int64_t nh = blockIdx.x, m = blockIdx.y;
  const int d = threadIdx.x;
  const int64_t n = nh / a.kv_heads, h = nh % a.kv_heads, group = a.heads / a.kv_heads;
  float best = -INFINITY;
  for (int64_t s = 0; s < a.splits; ++s) best = fmaxf(best, a.partial_max[(nh * a.splits + s) * a.query_rows + m]);
  float numerator = 0.0f, denominator = 0.0f;
  for (int64_t s = 0; s < a.splits; ++s) {
    const int64_t slot = (nh * a.splits + s) * a.query_rows + m;
    const float sum = a.partial_sum[slot];
    if (sum == 0.0f) continue;  // a split with no keys
    const float w = __expf(a.partial_max[slot] - best);
    numerator = fmaf(w, a.partial_out[slot * kDim + d], numerator);
    denominator = fmaf(w, sum, denominator);
  }
  out[((n * a.heads + h * group) * a.block + m) * kDim + d] = static_cast<scalar_t>(numerator / denominator);
}

// Dynamic shared memory of attention_split_kernel: the query, key and value tiles (rows padded
// to D + 1 floats) and the probability tile.
constexpr int64_t split_kernel_shared_bytes(int64_t dim) {
  return static_cast<int64_t>(sizeof(float)) * ((kQueryTile + 2 * kKeyTile) * (dim + 1) + kQueryTile * (kKeyTile + 1));
}

// The kernels read rows with 16-byte loads: a contiguous input that starts inside its
// allocation (a storage offset) may be misaligned, so such an input is copied once.
at::Tensor contiguous_16_byte_aligned(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 == 0 ? c : c.clone();
}

template <typename scalar_t, int kDim>
void launch(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k_block,
            const at::Tensor& v_block, AttentionArgs args, int64_t rows, int64_t query_tiles, at::Tensor& out,
            cudaStream_t stream) {
  const size_t shared = static_cast<size_t>(split_kernel_shared_bytes(kDim));
  auto kernel = attention_split_kernel<scalar_t, kDim>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared));
  const dim3 grid(static_cast<unsigned>(args.splits), static_cast<unsigned>(rows * args.kv_heads),
                  static_cast<unsigned>(query_tiles));
  kernel<<<grid, kAttnThreads, shared, stream>>>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                                                 v_cache.data_ptr<scalar_t>(), k_block.data_ptr<scalar_t>(),
                                                 v_block.data_ptr<scalar_t>(), args);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const dim3 combine_grid(static_cast<unsigned>(rows * args.kv_heads), static_cast<unsigned>(args.query_rows));
  attention_combine_kernel<scalar_t, kDim><<<combine_grid, kDim, 0, stream>>>(args, out.data_ptr<scalar_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Calls f(std::integral_constant<int, D>{}) for the D of kCudaHeadDims equal to `dim`: one
// kernel instantiation per supported head dim (D/4 accumulators per thread), none elsewhere.
// Returns whether one matched.
template <typename F, size_t... I>
bool for_cuda_head_dim(int64_t dim, F&& f, std::index_sequence<I...>) {
  return ((dim == kCudaHeadDims[I] ? (f(std::integral_constant<int, static_cast<int>(kCudaHeadDims[I])>{}), true)
                                   : false) ||
          ...);
}

template <typename F>
bool for_cuda_head_dim(int64_t dim, F&& f) {
  return for_cuda_head_dim(dim, std::forward<F>(f), std::make_index_sequence<kCudaHeadDims.size()>{});
}

at::Tensor drafter_attention_cuda(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& k_block, const at::Tensor& v_block, const at::Tensor& context_lens,
                                  double scale, int64_t window, bool causal) {
  check_drafter_attention_args(q, k_cache, v_cache, k_block, v_block, context_lens, scale, window);
  const int64_t dim = q.size(3);
  check_cuda_head_dim(q);
  const c10::cuda::CUDAGuard guard(q.device());
  int device = 0, sms = 0, shared_limit = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&shared_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  check_cuda_attention_launch(q, k_cache, split_kernel_shared_bytes(dim), shared_limit);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // The value check of context_lens synchronises with the device, which a stream capturing a
  // CUDA graph must not do: while capturing it is skipped, and both kernels clamp the lengths
  // to [0, L_max] on the device, so their reads stay inside the cache whatever the values.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  const bool check_values = capture == cudaStreamCaptureStatusNone;
  if (staged::use_staged(staged::Op::kDrafterAttention, q) && staged::drafter_attention_covers(q.scalar_type(), dim)) {
    // The staged path never waits for the device: its kernels clamp the lengths as under capture.
    at::Tensor staged_out =
        staged::drafter_attention(q, k_cache, v_cache, k_block, v_block, context_lens, scale, window, causal);
    if (staged_out.defined()) return staged_out;  // undefined: shapes the staged kernel leaves to this one
  }
  if (check_values) check_context_lens(context_lens, k_cache.size(2));
  const at::Tensor qc = contiguous_16_byte_aligned(q), kc = contiguous_16_byte_aligned(k_cache);
  const at::Tensor vc = contiguous_16_byte_aligned(v_cache), kb = contiguous_16_byte_aligned(k_block);
  const at::Tensor vb = contiguous_16_byte_aligned(v_block), lens = context_lens.contiguous();
  at::Tensor out = at::empty_like(qc);
  const int64_t rows = q.size(0), heads = q.size(1), block = q.size(2), kv_heads = k_cache.size(1);
  const int64_t max_len = k_cache.size(2), query_rows = (heads / kv_heads) * block;
  if (q.numel() == 0) return out;

  // Splits over the keys: enough blocks for two waves over the GPU, none shorter than a tile.
  const int64_t query_tiles = (query_rows + kQueryTile - 1) / kQueryTile;
  const int64_t blocks_per_split = rows * kv_heads * query_tiles;
  const int64_t splits = std::clamp<int64_t>((2 * sms + blocks_per_split - 1) / blocks_per_split, 1,
                                             std::min<int64_t>(64, (max_len + block + kKeyTile - 1) / kKeyTile));
  const auto options = q.options().dtype(at::kFloat);
  at::Tensor partial_out = at::empty({rows * kv_heads * splits * query_rows * dim}, options);
  at::Tensor partial_max = at::empty({rows * kv_heads * splits * query_rows}, options);
  at::Tensor partial_sum = at::empty({rows * kv_heads * splits * query_rows}, options);
  AttentionArgs args{heads, kv_heads, block, max_len, splits, window, causal, query_rows, static_cast<float>(scale),
                     lens.data_ptr<int32_t>(), partial_out.data_ptr<float>(), partial_max.data_ptr<float>(),
                     partial_sum.data_ptr<float>()};
  DBLAST_DISPATCH_LOGITS(q.scalar_type(), "drafter_attention_cuda", [&] {
    const bool launched = for_cuda_head_dim(dim, [&](auto head_dim) {
      launch<scalar_t, decltype(head_dim)::value>(qc, kc, vc, kb, vb, args, rows, query_tiles, out, stream);
    });
    TORCH_INTERNAL_ASSERT(launched, "check_cuda_head_dim let through head dim ", dim);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dblast, CUDA, m) { m.impl("drafter_attention", &drafter_attention_cuda); }

}  // namespace dblast::cuda
