// Staged CUDA kernels of dblast::drafter_attention: tensor-core flash-decoding for the
// block-diffusion drafter, written ahead of a GPU run (see staged_ops.h for how it is reached).
//
// Work: the block's B queries of the `group = Hq / Hkv` query heads that share one KV head
// read the same keys, so they form one query tile of M = group * B rows (rows head-major, as
// q stores them: row m is head h * group + m / B, block position m % B); 64 rows per tile
// (4 q heads x 16 positions at the Qwen3-8B shape), more tiles when M > 64.
//
// Split kernel: one CTA of 4 warps per (row n, KV head h, key split, query tile); each warp
// owns 16 query rows. Q is loaded once into registers as mma A fragments. Keys and values
// stream through shared memory 32 keys at a time in a 4-stage cp.async ring (3 tiles in flight
// while one is computed: 48 KB per CTA at D = 128, where 2 CTAs fit an SM (215 registers,
// 68 KB of shared memory each): ~96 KB in flight per SM, enough to keep HBM busy). Per tile,
// each warp computes S = Q K^T with mma.sync m16n8k16 (bf16/fp16 in, fp32 accumulate; K
// fragments by ldmatrix), masks it, runs the online softmax
// in fp32 (base-2 exponent, the scale folded into log2(e)), rounds P to the input type in
// registers (the accumulator layout of S is the A layout of P V, so P never touches shared
// memory) and adds P V with mma.sync (V fragments by ldmatrix.trans). Shared rows are padded by
// 16 bytes, which makes both ldmatrix patterns free of bank conflicts for every D that is a
// multiple of 16. Q's staging buffer is the ring's last stage, free until the first refill.
//
// Keys of a row, in walking order: its visible context (dblast::context_range) from k_cache,
// then its B block keys from k_block; each smem row picks its own source, so a tile may
// straddle the two. Which keys a query sees is dblast/attention_window.h's rule, applied per
// element only on tiles that need it (a split's last tile, block keys when needs_query_mask,
// the first context tiles of a window); other tiles skip it.
//
// Splits: the grid's split count comes from shapes alone (enough CTAs to fill every SM once,
// at most one split per 256 keys of the longest possible row); each row then cuts its real
// keys into that many pieces of whole tiles (dblast/attention_splits.h), so N = 1 at 32k fills
// the GPU and a short row in a large cache does not launch idle work. Each split writes an
// unnormalised fp32 partial (O, max, sum); a combine kernel merges a row's splits in split
// order (deterministic) and writes q's dtype. With one split per row (large batches) the split
// kernel normalises and writes the output itself, no combine launch.
//
// Covers bfloat16/float16 with D in {32, 64, 96, 128} (drafter_attention.cuh); float32 and
// D = 16, 256 stay on the verified kernel.
//
// No host synchronisation (graph capture included): nothing here reads a device value on the
// host (no .item(), no copies back); the lengths are read on the device and clamped to
// [0, L_max], so reads stay inside the cache whatever they hold (the verified launcher skips
// its value check of context_lens, and its sync, for this kernel).
// Host code here formats no error message (csrc/checks/ does; see kernel_variant.h).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "dblast/attention_splits.h"
#include "dblast/attention_window.h"
#include "drafter_attention.cuh"
#include "staged_ops.h"

namespace dblast::cuda::staged {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kQueryTile = kWarps * 16;  // query rows per CTA: 16 per warp (the mma's M)
constexpr int kKeyTile = 32;             // keys per pipeline stage
constexpr int kStages = 4;               // cp.async ring depth
constexpr int kPad = 8;                  // elements (16 bytes) of padding per shared row
constexpr int kMinKeysPerSplit = 256;    // a multiple of kKeyTile (attention_splits.h)
constexpr int kMaxSplits = 256;
static_assert(kMinKeysPerSplit % kKeyTile == 0);

template <int kDim>
struct Layout {
  static constexpr int kStride = kDim + kPad;                 // elements per shared row
  static constexpr int kTile = kKeyTile * kStride;            // one K or V tile
  static constexpr int kStage = 2 * kTile;                    // K tile, then V tile
  static constexpr int kBytes = kStages * kStage * 2;         // 2-byte elements
  static_assert(kQueryTile * kStride <= kStage, "Q is staged in one ring stage");
  static_assert(kDim % 16 == 0, "mma k-steps and ldmatrix pairs of 8-dim tiles");
};

struct Params {
  const void* q;
  const void* k_cache;
  const void* v_cache;
  const void* k_block;
  const void* v_block;
  const int32_t* lens;
  void* out;            // [N, Hq, B, D], contiguous
  float* partial_o;     // [N * Hkv, splits, query_tiles, kQueryTile, D]; unused with one split
  float2* partial_ml;   // [N * Hkv, splits, query_tiles, kQueryTile]: (max, sum)
  int64_t q_stride[3];  // element strides of dims n, head, position (the last dim is contiguous)
  int64_t kc_stride[3];
  int64_t vc_stride[3];
  int64_t kb_stride[3];
  int64_t vb_stride[3];
  int64_t window;
  int max_len, heads, kv_heads, block, query_rows, query_tiles, splits;
  bool causal;
  float scale_log2;  // scale * log2(e): scores in the base-2 exponent domain
};

// ---- PTX wrappers ------------------------------------------------------------------------

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, bypassing L1 (streamed once); zero-filled when !valid, so rows
// past a split's keys hold zeros, never stale data (0 * NaN would poison P V).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// c += a (16x16, row) * b (16x8, col), fp32 accumulators.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two floats rounded to T, packed as one 32-bit register (the lower index in the low half).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(lo))) |
           (static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(hi))) << 16);
  } else {
    return static_cast<uint32_t>(__half_as_ushort(__float2half_rn(lo))) |
           (static_cast<uint32_t>(__half_as_ushort(__float2half_rn(hi))) << 16);
  }
}

// ---- split kernel --------------------------------------------------------------------------

template <typename T, int kDim>
__global__ void __launch_bounds__(kThreads, 2) attention_split_kernel(const Params p) {
  using L = Layout<kDim>;
  constexpr int kChunks = kDim / 8;  // 16-byte chunks per row
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* const smem = reinterpret_cast<T*>(smem_raw);

  const int query_tile = static_cast<int>(blockIdx.x % p.query_tiles);  // query tiles of a split are adjacent
  const int split = static_cast<int>(blockIdx.x / p.query_tiles);       // CTAs: they share K/V through L2
  const int nh = blockIdx.y;
  const int n = nh / p.kv_heads, h = nh % p.kv_heads, group = p.heads / p.kv_heads;

  // This split's keys [first, last) among the row's walking order (context, then block).
  // Positions fit in 32 bits (the launcher sends L_max + B >= 2^30 to the verified kernel);
  // 32-bit indices keep the register count down.
  const int length = min(max(p.lens[n], 0), p.max_len);
  const ContextRange context = context_range(length, p.window);
  const int begin = static_cast<int>(context.begin);
  const int cached = static_cast<int>(context.end - context.begin);
  const int keys = cached + p.block;
  const int per_split = static_cast<int>(split_keys(keys, p.splits, kKeyTile, kMinKeysPerSplit).keys_per_split);
  const int first = split * per_split;
  if (first >= keys) return;  // an idle split (short row): the combine kernel skips it
  const int last = min(keys, first + per_split);
  const int tiles = (last - first + kKeyTile - 1) / kKeyTile;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int m0 = query_tile * kQueryTile;
  const int tile_rows = min(kQueryTile, p.query_rows - m0);

  // Q -> the ring's last stage (rows past M zero-filled: their scores are 0, finite).
  {
    const T* q = static_cast<const T*>(p.q) + n * p.q_stride[0];
    T* q_smem = smem + (kStages - 1) * L::kStage;
    for (int e = tid; e < kQueryTile * kChunks; e += kThreads) {
      const int r = e / kChunks, c = e % kChunks;
      const bool valid = r < tile_rows;
      const int m = valid ? m0 + r : 0;
      const T* src = q + (h * group + m / p.block) * p.q_stride[1] + (m % p.block) * p.q_stride[2] + c * 8;
      cp_async_16(shared_address(q_smem + r * L::kStride + c * 8), src, valid);
    }
    cp_async_commit();
  }

  const T* kc = static_cast<const T*>(p.k_cache) + n * p.kc_stride[0] + h * p.kc_stride[1];
  const T* vc = static_cast<const T*>(p.v_cache) + n * p.vc_stride[0] + h * p.vc_stride[1];
  const T* kb = static_cast<const T*>(p.k_block) + n * p.kb_stride[0] + h * p.kb_stride[1];
  const T* vb = static_cast<const T*>(p.v_block) + n * p.vb_stride[0] + h * p.vb_stride[1];
  auto load_tile = [&](int tile) {
    const int j0 = first + tile * kKeyTile;
    T* k_smem = smem + (tile % kStages) * L::kStage;
    T* v_smem = k_smem + L::kTile;
    for (int e = tid; e < kKeyTile * kChunks; e += kThreads) {
      const int r = e / kChunks, c = e % kChunks;
      const int j = j0 + r;
      const bool valid = j < last;
      const T* k_src;
      const T* v_src;
      if (j < cached) {  // context position context.begin + j (< L_max even when !valid)
        const int64_t position = begin + j;
        k_src = kc + position * p.kc_stride[2];
        v_src = vc + position * p.vc_stride[2];
      } else {  // block key j - cached (row 0 stands in when !valid: a valid address, not read)
        const int64_t position = valid ? j - cached : 0;
        k_src = kb + position * p.kb_stride[2];
        v_src = vb + position * p.vb_stride[2];
      }
      cp_async_16(shared_address(k_smem + r * L::kStride + c * 8), k_src + c * 8, valid);
      cp_async_16(shared_address(v_smem + r * L::kStride + c * 8), v_src + c * 8, valid);
    }
  };

  // Prologue: tiles 0 .. kStages - 2 (one commit group each, empty past the last tile, so the
  // group count stays uniform); stage kStages - 1 holds Q until the first refill.
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < tiles) load_tile(s);
    cp_async_commit();
  }
  cp_async_wait<kStages - 1>();  // Q's group (the oldest) has landed
  __syncthreads();

  // A fragments of this warp's 16 query rows, all of D (lanes 0-15 rows 0-15 at k 0-7,
  // lanes 16-31 the same rows at k 8-15).
  uint32_t q_frag[kDim / 16][4];
  {
    const T* q_smem = smem + (kStages - 1) * L::kStage;
    const T* row = q_smem + (warp * 16 + lane % 16) * L::kStride + (lane / 16) * 8;
#pragma unroll
    for (int kk = 0; kk < kDim / 16; ++kk) ldmatrix_x4(q_frag[kk], shared_address(row + kk * 16));
  }

  // This thread's two accumulator rows: r (lane / 4) and r + 8 of the warp's 16.
  const bool warp_active = warp * 16 < tile_rows;  // warps wholly past M skip the math
  const int row_lo = m0 + warp * 16 + lane / 4;
  const int query_position[2] = {row_lo % p.block, (row_lo + 8) % p.block};  // position in the block
  const bool mask = needs_query_mask(p.block, p.window, p.causal);
  // (clamped at 0: compared with context positions only)
  const int visible_from = static_cast<int>(max(context_visible_to_all_from(length, p.block, p.window), int64_t{0}));

  float o[kDim / 8][4];
#pragma unroll
  for (int d = 0; d < kDim / 8; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.0f, 0.0f};  // this thread's share; the quad's shares are added at the end

  for (int t = 0; t < tiles; ++t) {
    cp_async_wait<kStages - 2>();  // tile t has landed (this thread's copies) ...
    __syncthreads();               // ... everyone's, and every warp is done with tile t - 1's stage
    if (t + kStages - 1 < tiles) load_tile(t + kStages - 1);  // refills tile t - 1's stage
    cp_async_commit();
    if (!warp_active) continue;

    const T* k_smem = smem + (t % kStages) * L::kStage;
    const T* v_smem = k_smem + L::kTile;

    // S = Q K^T: 4 n-tiles of 8 keys. K rows are the col-major B operand as stored; one
    // ldmatrix.x4 gives two n-tiles at one k-step (lanes: key = 8 * (lane / 16) + lane % 8,
    // dims + 8 for odd lane / 8).
    float s[kKeyTile / 8][4];
#pragma unroll
    for (int nt = 0; nt < kKeyTile / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
    {
      const T* k_row = k_smem + ((lane / 16) * 8 + lane % 8) * L::kStride + ((lane / 8) % 2) * 8;
#pragma unroll
      for (int kk = 0; kk < kDim / 16; ++kk) {
#pragma unroll
        for (int np = 0; np < kKeyTile / 16; ++np) {
          uint32_t b[4];
          ldmatrix_x4(b, shared_address(k_row + np * 16 * L::kStride + kk * 16));
          mma_16816<T>(s[2 * np], q_frag[kk], b[0], b[1]);
          mma_16816<T>(s[2 * np + 1], q_frag[kk], b[2], b[3]);
        }
      }
    }

    // Scale; hide what the rule hides. Element (nt, e) is key j0 + 8 nt + 2 (lane % 4) + e % 2
    // of row lane / 4 (+ 8 when e >= 2).
    const int j0 = first + t * kKeyTile;
    const bool every_key_visible =
        j0 + kKeyTile <= last && (!mask || (j0 + kKeyTile <= cached && begin + j0 >= visible_from));
#pragma unroll
    for (int nt = 0; nt < kKeyTile / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[nt][e] *= p.scale_log2;
        if (!every_key_visible) {
          const int j = j0 + nt * 8 + (lane % 4) * 2 + (e % 2);
          const int query = query_position[e / 2];
          bool visible = j < last;
          if (visible && mask) {
            visible = j < cached ? context_key_visible(length, begin + j, query, p.window)
                                 : block_key_visible(j - cached, query, p.window, p.causal);
          }
          if (!visible) s[nt][e] = -INFINITY;
        }
      }
    }

    // Online softmax, fp32. A row's 32 scores live in the 4 lanes of a quad.
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < kKeyTile / 8; ++nt) {
      tile_max[0] = fmaxf(tile_max[0], fmaxf(s[nt][0], s[nt][1]));
      tile_max[1] = fmaxf(tile_max[1], fmaxf(s[nt][2], s[nt][3]));
    }
    float base[2], rescale[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 1));
      tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 2));
      const float new_max = fmaxf(row_max[i], tile_max[i]);
      base[i] = new_max == -INFINITY ? 0.0f : new_max;  // nothing seen yet: exp2(-inf - 0) = 0, no NaN
      rescale[i] = exp2f(row_max[i] - base[i]);          // 0 while row_max is -inf
      row_max[i] = new_max;
    }

    // P = exp2(S - max), rounded to T as the A fragments of P V: k-step ks (keys 16 ks ..)
    // takes n-tiles 2 ks (a0, a1) and 2 ks + 1 (a2, a3).
    uint32_t p_frag[kKeyTile / 16][4];
    float tile_sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int nt = 0; nt < kKeyTile / 8; ++nt) {
      const float p0 = exp2f(s[nt][0] - base[0]), p1 = exp2f(s[nt][1] - base[0]);
      const float p2 = exp2f(s[nt][2] - base[1]), p3 = exp2f(s[nt][3] - base[1]);
      tile_sum[0] += p0 + p1;
      tile_sum[1] += p2 + p3;
      p_frag[nt / 2][(nt % 2) * 2] = pack2<T>(p0, p1);
      p_frag[nt / 2][(nt % 2) * 2 + 1] = pack2<T>(p2, p3);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) row_sum[i] = row_sum[i] * rescale[i] + tile_sum[i];
#pragma unroll
    for (int d = 0; d < kDim / 8; ++d) {
      o[d][0] *= rescale[0];
      o[d][1] *= rescale[0];
      o[d][2] *= rescale[1];
      o[d][3] *= rescale[1];
    }

    // O += P V. V rows (keys) x dims is the B operand transposed: ldmatrix.trans, two 8-dim
    // n-tiles per call (lanes: key = 8 * ((lane / 8) % 2) + lane % 8, dims + 8 for lane >= 16).
    {
      const T* v_row = v_smem + (((lane / 8) % 2) * 8 + lane % 8) * L::kStride + (lane / 16) * 8;
#pragma unroll
      for (int ks = 0; ks < kKeyTile / 16; ++ks) {
#pragma unroll
        for (int dp = 0; dp < kDim / 16; ++dp) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, shared_address(v_row + ks * 16 * L::kStride + dp * 16));
          mma_16816<T>(o[2 * dp], p_frag[ks], b[0], b[1]);
          mma_16816<T>(o[2 * dp + 1], p_frag[ks], b[2], b[3]);
        }
      }
    }
  }
  cp_async_wait<0>();  // no copy may still target shared memory when the CTA exits
  if (!warp_active) return;

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    row_sum[i] += __shfl_xor_sync(0xffffffffu, row_sum[i], 1);
    row_sum[i] += __shfl_xor_sync(0xffffffffu, row_sum[i], 2);
  }
  const int col = (lane % 4) * 2;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = warp * 16 + lane / 4 + 8 * i;  // row within the query tile
    if (r >= tile_rows) continue;
    const int m = m0 + r;
    if (p.splits == 1) {
      // The only split: normalise and write q's dtype (every query sees its own block key,
      // so row_sum > 0).
      const float inverse = 1.0f / row_sum[i];
      T* out = static_cast<T*>(p.out) + ((static_cast<int64_t>(n) * p.heads + h * group) * p.block + m) * kDim;
#pragma unroll
      for (int d = 0; d < kDim / 8; ++d) {
        *reinterpret_cast<uint32_t*>(out + d * 8 + col) = pack2<T>(o[d][2 * i] * inverse, o[d][2 * i + 1] * inverse);
      }
    } else {
      const int64_t slot = ((static_cast<int64_t>(nh) * p.splits + split) * p.query_tiles + query_tile) * kQueryTile + r;
      float* partial = p.partial_o + slot * kDim;
#pragma unroll
      for (int d = 0; d < kDim / 8; ++d) {
        *reinterpret_cast<float2*>(partial + d * 8 + col) = make_float2(o[d][2 * i], o[d][2 * i + 1]);
      }
      if (lane % 4 == 0) p.partial_ml[slot] = make_float2(row_max[i], row_sum[i]);
    }
  }
}

// ---- combine kernel ------------------------------------------------------------------------

// D / 4 threads per query row, 4 dims (one float4) each; rows of one (n, h) per CTA. Splits
// are merged in order 0, 1, ... whatever the timing: the result is deterministic.
// At least 4 blocks of 128 threads an SM: up to 128 registers, where ptxas aiming at full
// occupancy kept 32 and spilled (sm_80, sm_120; with 8 blocks, 64 and D = 96 still spilled on sm_100).
template <typename T, int kDim>
__global__ void __launch_bounds__(kThreads, 4) attention_combine_kernel(const Params p) {
  constexpr int kLanes = kDim / 4;
  constexpr int kRows = kThreads / kLanes;
  const int nh = blockIdx.x;
  const int m = blockIdx.y * kRows + threadIdx.x / kLanes;
  if (threadIdx.x >= kRows * kLanes || m >= p.query_rows) return;
  const int d = (threadIdx.x % kLanes) * 4;
  const int n = nh / p.kv_heads, h = nh % p.kv_heads, group = p.heads / p.kv_heads;
  const int length = min(max(p.lens[n], 0), p.max_len);
  const int active = static_cast<int>(
      split_keys(row_key_count(length, p.block, p.window), p.splits, kKeyTile, kMinKeysPerSplit).active);
  // slot of split s: first_slot + s * split_stride (the split kernel's layout)
  const int64_t split_stride = static_cast<int64_t>(p.query_tiles) * kQueryTile;
  const int64_t first_slot = static_cast<int64_t>(nh) * p.splits * split_stride + m;  // m = tile * 64 + row
  const float2* ml_row = p.partial_ml + first_slot;
  const float* o_row = p.partial_o + first_slot * kDim + d;

  float best = -INFINITY;
  for (int s = 0; s < active; ++s) {
    const float2 ml = ml_row[s * split_stride];
    if (ml.y > 0.0f) best = fmaxf(best, ml.x);
  }
  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  float denominator = 0.0f;
  for (int s = 0; s < active; ++s) {
    const float2 ml = ml_row[s * split_stride];
    if (!(ml.y > 0.0f)) continue;  // no key of this split visible to this query
    const float w = exp2f(ml.x - best);
    const float4 v = *reinterpret_cast<const float4*>(o_row + s * split_stride * kDim);
    acc.x = fmaf(w, v.x, acc.x);
    acc.y = fmaf(w, v.y, acc.y);
    acc.z = fmaf(w, v.z, acc.z);
    acc.w = fmaf(w, v.w, acc.w);
    denominator = fmaf(w, ml.y, denominator);
  }
  const float inverse = 1.0f / denominator;
  T* out = static_cast<T*>(p.out) + ((static_cast<int64_t>(n) * p.heads + h * group) * p.block + m) * kDim + d;
  uint2 packed;
  packed.x = pack2<T>(acc.x * inverse, acc.y * inverse);
  packed.y = pack2<T>(acc.z * inverse, acc.w * inverse);
  *reinterpret_cast<uint2*>(out) = packed;
}

// ---- host ----------------------------------------------------------------------------------

// Whether the kernels can read t's rows in place: 16-byte aligned start, contiguous last dim,
// the other strides whole 16-byte chunks (the drafter's transposed q and block views pass).
bool rows_readable(const at::Tensor& t) {
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
  if (t.size(3) > 1 && t.stride(3) != 1) return false;
  const int64_t chunk = 16 / t.element_size();
  for (int d = 0; d < 3; ++d) {
    if (t.size(d) > 1 && t.stride(d) % chunk != 0) return false;
  }
  return true;
}

// t itself when readable, else a contiguous copy (a second one when the first starts inside
// its allocation, off a 16-byte boundary).
at::Tensor readable(const at::Tensor& t) {
  if (rows_readable(t)) return t;
  at::Tensor c = t.contiguous();
  return rows_readable(c) ? c : c.clone();
}

void strides_of(const at::Tensor& t, int64_t (&stride)[3]) {
  for (int d = 0; d < 3; ++d) stride[d] = t.size(d) > 1 ? t.stride(d) : 0;
}

// CTAs of the split kernel resident per SM, once per device (cudaFuncSetAttribute raises the
// dynamic shared-memory limit at the same time); a host computation, safe while capturing.
template <typename T, int kDim>
int resident_ctas(int device) {
  static std::array<std::atomic<int>, 64> cache{};
  std::atomic<int>* entry = device >= 0 && device < 64 ? &cache[device] : nullptr;
  if (entry != nullptr) {
    const int known = entry->load(std::memory_order_relaxed);
    if (known > 0) return known;
  }
  auto kernel = attention_split_kernel<T, kDim>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Layout<kDim>::kBytes));
  int ctas = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, kernel, kThreads, Layout<kDim>::kBytes));
  ctas = std::max(ctas, 1);
  if (entry != nullptr) entry->store(ctas, std::memory_order_relaxed);
  return ctas;
}

template <typename T, int kDim>
void launch(Params p, int64_t rows, int64_t max_len, int64_t window, const at::TensorOptions& float_options,
            at::Tensor& partial_o, at::Tensor& partial_ml, cudaStream_t stream) {
  int device = 0, sms = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t slots = static_cast<int64_t>(sms) * resident_ctas<T, kDim>(device);

  // Splits: as many as fill the GPU's resident CTAs once (no second, partial wave), none for
  // less than kMinKeysPerSplit keys of the longest row the shapes allow.
  const int64_t ctas_per_split = rows * p.kv_heads * p.query_tiles;
  const int64_t longest = (window > 0 ? std::min(max_len, window - 1) : max_len) + p.block;
  const int64_t most = std::min<int64_t>(kMaxSplits, (longest + kMinKeysPerSplit - 1) / kMinKeysPerSplit);
  const int64_t splits = std::clamp<int64_t>(slots / ctas_per_split, 1, std::max<int64_t>(most, 1));
  p.splits = static_cast<int>(splits);
  if (splits > 1) {
    const int64_t slots_total = rows * p.kv_heads * splits * p.query_tiles * kQueryTile;
    partial_o = at::empty({slots_total * kDim}, float_options);
    partial_ml = at::empty({slots_total * 2}, float_options);
    p.partial_o = partial_o.data_ptr<float>();
    p.partial_ml = reinterpret_cast<float2*>(partial_ml.data_ptr<float>());
  }

  const dim3 grid(static_cast<unsigned>(splits * p.query_tiles), static_cast<unsigned>(rows * p.kv_heads));
  attention_split_kernel<T, kDim><<<grid, kThreads, Layout<kDim>::kBytes, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (splits > 1) {
    constexpr int kRows = kThreads / (kDim / 4);
    const dim3 combine_grid(static_cast<unsigned>(rows * p.kv_heads),
                            static_cast<unsigned>((p.query_rows + kRows - 1) / kRows));
    attention_combine_kernel<T, kDim><<<combine_grid, kThreads, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// Calls f(std::integral_constant<int, D>{}) for the D of kStagedAttentionHeadDims equal to dim.
template <typename F, size_t... I>
bool for_head_dim(int64_t dim, F&& f, std::index_sequence<I...>) {
  return ((dim == kStagedAttentionHeadDims[I]
               ? (f(std::integral_constant<int, static_cast<int>(kStagedAttentionHeadDims[I])>{}), true)
               : false) ||
          ...);
}

}  // namespace

// Called by the verified launcher after its host checks, for the dtypes and head dims that
// drafter_attention_covers accepts; returns an undefined tensor for anything else, and for
// positions past 32 bits (L_max + B >= 2^30): the launcher then runs the verified kernel.
// Reads no device value on the host.
at::Tensor drafter_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& k_block, const at::Tensor& v_block, const at::Tensor& context_lens,
                             double scale, int64_t window, bool causal) {
  const int64_t dim = q.size(3);
  if (!drafter_attention_covers(q.scalar_type(), dim)) return at::Tensor();
  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t rows = q.size(0), heads = q.size(1), block = q.size(2);
  const int64_t kv_heads = k_cache.size(1), max_len = k_cache.size(2);
  if (max_len + block >= (int64_t{1} << 30) || heads * block >= (int64_t{1} << 30)) return at::Tensor();  // 32-bit indices
  at::Tensor out = at::empty({rows, heads, block, dim}, q.options());
  if (out.numel() == 0) return out;

  const at::Tensor qr = readable(q), kcr = readable(k_cache), vcr = readable(v_cache);
  const at::Tensor kbr = readable(k_block), vbr = readable(v_block), lens = context_lens.contiguous();
  Params p{};
  p.q = qr.data_ptr();
  p.k_cache = kcr.data_ptr();
  p.v_cache = vcr.data_ptr();
  p.k_block = kbr.data_ptr();
  p.v_block = vbr.data_ptr();
  p.lens = lens.data_ptr<int32_t>();
  p.out = out.data_ptr();
  strides_of(qr, p.q_stride);
  strides_of(kcr, p.kc_stride);
  strides_of(vcr, p.vc_stride);
  strides_of(kbr, p.kb_stride);
  strides_of(vbr, p.vb_stride);
  p.max_len = static_cast<int>(max_len);
  p.window = window;
  p.heads = static_cast<int>(heads);
  p.kv_heads = static_cast<int>(kv_heads);
  p.block = static_cast<int>(block);
  p.query_rows = static_cast<int>((heads / kv_heads) * block);
  p.query_tiles = (p.query_rows + kQueryTile - 1) / kQueryTile;
  p.causal = causal;
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto float_options = q.options().dtype(at::kFloat);
  at::Tensor partial_o, partial_ml;  // kept alive until the launches are queued
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  for_head_dim(
      dim,
      [&](auto head_dim) {
        constexpr int kDim = decltype(head_dim)::value;
        if (bf16) {
          launch<__nv_bfloat16, kDim>(p, rows, max_len, window, float_options, partial_o, partial_ml, stream);
        } else {
          launch<__half, kDim>(p, rows, max_len, window, float_options, partial_o, partial_ml, stream);
        }
      },
      std::make_index_sequence<kStagedAttentionHeadDims.size()>{});
  return out;
}

}  // namespace dblast::cuda::staged
