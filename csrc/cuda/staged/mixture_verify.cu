// Staged CUDA kernels of dblast::mixture_verify (soft-mixture verification, DBLast Eq 5,
// 10-12; the verified kernel is csrc/cuda/mixture_verify.cu, the contract docs/ops.md).
//
// Two launches on the stream, no host synchronisation between them:
//
// 1. draft_stats_kernel. The draft logits ([N, K, b, V], K x b times the target's bytes) are
//    the bulk of the op, and each branch row needs only its softmax statistics (max and
//    sum exp) plus the logit of the drafted token. Every row is cut into 4,096-token chunks,
//    one block each (2,280 blocks at N = 1, K = 4, b = 15, V = 151,936): the block reads its
//    chunk once into registers (16 logits a thread), reduces max and sum exp((d - max) / T)
//    (float32 exp as the CPU kernel, float64 sums), and writes the partial. The row's last
//    block (integer ticket) merges the partials in chunk order (dblast::merge_softmax) into
//    the row's DraftSoftmax and log q_i(x_i | z).
//
// 2. mixture_target_kernel. One cluster per (row n, position i) as in the staged
//    branch_verify: position i's target logits read once into shared memory, the filtered
//    p_i built there (cluster_row.cuh); the category posterior at i (mixture_posterior, from
//    launch 1's log q table) gives A_i and the residual [p_i - sum_z w_z q_i(. | z)]+, from
//    which the cluster draws the candidate final token on the row's last uniform (p_i at
//    the bonus position, and when the residual has no mass). The residual reads branch
//    logits only where p_i > 0 (the residual is 0 elsewhere): under top-k a few dozen
//    scattered reads, not K more passes over V. The row's last cluster decides and picks
//    the candidate at the first rejection.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cluster_row.cuh"
#include "dblast/acceptance.h"
#include "dblast/filtering.h"
#include "dblast/mixture.h"
#include "dblast/split_row.h"
#include "dblast/verify_checks.h"
#include "staged_ops.h"

namespace dblast::cuda::staged {
namespace {

using namespace cluster_row;

constexpr int kDraftItems = 16;                       // draft logits per thread
constexpr int64_t kDraftChunk = kThreads * kDraftItems;  // tokens per block of launch 1

struct DraftStatsArgs {
  const int64_t* draft;  // [N, b]
  int num_draft, num_branches;
  int64_t vocab;
  int chunks;  // per branch row
  double temperature;
  float inverse_temperature;
  float* part_max;       // workspace [N*K*b, chunks]
  double* part_sum;      // workspace [N*K*b, chunks]
  int* tickets;          // [N*K*b], zeroed
  DraftSoftmax* softmax; // workspace [N, K, b]
  double* log_q_draft;   // workspace [N, K, b]
};

template <typename draft_t>
__global__ void __launch_bounds__(kThreads)
    draft_stats_kernel(const draft_t* __restrict__ draft_logits, DraftStatsArgs a) {
  const int64_t stat = blockIdx.x / a.chunks;  // (n * K + z) * b + i
  const int chunk = static_cast<int>(blockIdx.x % a.chunks);
  const draft_t* row = draft_logits + stat * a.vocab;
  const int64_t begin = chunk * kDraftChunk;
  const int64_t end = begin + kDraftChunk < a.vocab ? begin + kDraftChunk : a.vocab;

  float x[kDraftItems];
  constexpr int kVec = 16 / sizeof(draft_t);
  if ((reinterpret_cast<uintptr_t>(row + begin) & 15) == 0) {
    // 16-byte loads: thread t reads tokens begin + (l * 256 + t) * kVec + [0, kVec)
#pragma unroll
    for (int l = 0; l < kDraftItems / kVec; ++l) {
      const int64_t base = begin + (static_cast<int64_t>(l) * kThreads + threadIdx.x) * kVec;
      if (base + kVec <= end) {
        const uint4 raw = __ldg(reinterpret_cast<const uint4*>(row + base));
        const draft_t* values = reinterpret_cast<const draft_t*>(&raw);
#pragma unroll
        for (int e = 0; e < kVec; ++e) x[l * kVec + e] = static_cast<float>(values[e]);
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) x[l * kVec + e] = base + e < end ? static_cast<float>(row[base + e]) : -INFINITY;
      }
    }
  } else {
#pragma unroll
    for (int e = 0; e < kDraftItems; ++e) {
      const int64_t v = begin + static_cast<int64_t>(e) * kThreads + threadIdx.x;
      x[e] = v < end ? static_cast<float>(row[v]) : -INFINITY;
    }
  }
  float local_max = -INFINITY;
#pragma unroll
  for (int e = 0; e < kDraftItems; ++e) local_max = fmaxf(local_max, x[e]);
  const float chunk_max = block_max(local_max);
  double local_sum = 0.0;
#pragma unroll
  for (int e = 0; e < kDraftItems; ++e) {
    if (x[e] > -INFINITY) local_sum += static_cast<double>(__expf((x[e] - chunk_max) * a.inverse_temperature));
  }
  const double chunk_sum = block_sum(local_sum);
  if (threadIdx.x != 0) return;
  a.part_max[blockIdx.x] = chunk_max;
  a.part_sum[blockIdx.x] = chunk_sum;
  __threadfence();
  if (atomicAdd(a.tickets + stat, 1) != a.chunks - 1) return;
  __threadfence();
  // the row's last block: merge the chunks in order (the same result whichever block is last)
  const volatile float* maxima = a.part_max + stat * a.chunks;
  const volatile double* sums = a.part_sum + stat * a.chunks;
  SoftmaxPartial total{-INFINITY, 0.0};
  for (int c = 0; c < a.chunks; ++c) total = merge_softmax(total, SoftmaxPartial{maxima[c], sums[c]}, a.temperature);
  const DraftSoftmax sm{total.max, log(total.sum), a.temperature};
  const int i = static_cast<int>(stat % a.num_draft);
  const int64_t n = stat / (static_cast<int64_t>(a.num_branches) * a.num_draft);
  const int64_t token = a.draft[n * a.num_draft + i];
  a.softmax[stat] = sm;
  a.log_q_draft[stat] = sm.log_prob(static_cast<float>(row[token]));
}

struct MixtureArgs {
  const float* prior;  // [N, K]
  const int64_t* draft;  // [N, b]
  FilterSpec spec;
  int num_draft, num_branches;
  int64_t vocab, slice, cache_capacity;
  double fixed_scale;
  const DraftSoftmax* softmax;  // [N, K, b], from draft_stats_kernel
  const double* log_q_draft;    // [N, K, b]
  double* accept;               // workspace [N, b]
  int64_t* candidates;          // workspace [N, b+1]
  int* tickets;                 // [N], zeroed
  int32_t* num_accepted;
  int64_t* output_tokens;
  float* accept_probs;
};

template <typename scalar_t, typename draft_t, typename uniform_t>
__global__ void __launch_bounds__(kThreads, kClusterBlocksPerSm)
    mixture_target_kernel(const scalar_t* __restrict__ logits, const draft_t* __restrict__ draft_logits,
                          const uniform_t* __restrict__ uniforms, MixtureArgs a) {
#if DBLAST_CLUSTER_CODE
  extern __shared__ __align__(16) unsigned char cache_bytes[];
  __shared__ ClusterShared sh;
  __shared__ double weights[kMaxBranches];
  __shared__ DraftSoftmax branch_softmax[kMaxBranches];

  const int positions = a.num_draft + 1;
  const int64_t cluster = blockIdx.x / cluster_blocks();
  const int64_t n = cluster / positions;
  const int i = static_cast<int>(cluster % positions);
  const int branches = a.num_branches;
  const int64_t* draft = a.draft + n * a.num_draft;
  const double* log_q = a.log_q_draft + n * branches * a.num_draft;  // this row's [K, b]
  const scalar_t* row = logits + (n * positions + i) * a.vocab;
  auto draft_row = [&](int z) { return draft_logits + ((n * branches + z) * a.num_draft + i) * a.vocab; };

  const RowSlice<scalar_t> s =
      load_slice(row, a.vocab, a.slice, a.cache_capacity, reinterpret_cast<scalar_t*>(cache_bytes));
  // the posterior q(z | x_<i) in every block (the residual needs it everywhere); zero
  // weights at the bonus position, whose final token is drawn from p itself
  if (threadIdx.x == 0) {
    if (i < a.num_draft) {
      mixture_posterior(a.prior + n * branches, log_q, branches, a.num_draft, i, weights);
      for (int z = 0; z < branches; ++z) branch_softmax[z] = a.softmax[(n * branches + z) * a.num_draft + i];
    } else {
      for (int z = 0; z < branches; ++z) weights[z] = 0.0;
    }
  }
  const FilteredDist dist = cluster_filtered_dist(s, a.vocab, a.spec, a.fixed_scale, sh);  // syncs the block

  int64_t candidate = dist.greedy_token;  // T = 0: p and every residual's support is the argmax
  if (!a.spec.greedy()) {
    const bool rejected = i < a.num_draft;
    candidate = cluster_inverse_cdf(
        s, static_cast<double>(uniforms[n * positions + a.num_draft]),
        [&](int64_t v, float logit) {
          const double p = dist.prob(logit, v);
          if (!(p > 0.0)) return DrawWeights{0.0, 0.0};  // where p = 0 the residual is 0 whatever q is
          double r = p;
          if (rejected) {
            for (int z = 0; z < branches; ++z) {
              if (weights[z] > 0.0) r -= weights[z] * branch_softmax[z].prob(static_cast<float>(draft_row(z)[v]));
            }
          }
          return DrawWeights{r > 0.0 ? r : 0.0, p};
        },
        true, sh);
  }
  cluster_finish();
  if (cluster_rank() != 0 || threadIdx.x != 0) return;

  if (i < a.num_draft) {
    const int64_t x = draft[i];
    double q = 0.0;
    for (int z = 0; z < branches; ++z) q += weights[z] * exp(log_q[z * a.num_draft + i]);
    const double accept = acceptance_prob(dist.prob(static_cast<float>(row[x]), x), q);
    a.accept[n * a.num_draft + i] = accept;
    a.accept_probs[n * a.num_draft + i] = static_cast<float>(accept);
  }
  a.candidates[n * positions + i] = candidate;
  __threadfence();
  if (atomicAdd(a.tickets + n, 1) != positions - 1) return;
  __threadfence();

  // The row's last cluster: decide with every position's A_i and pick the candidate.
  const volatile double* accept = a.accept + n * a.num_draft;
  const volatile int64_t* candidates = a.candidates + n * positions;
  const int accepted = first_rejection(accept, uniforms + n * positions, a.num_draft);
  int64_t* out = a.output_tokens + n * positions;
  for (int j = 0; j < positions; ++j) out[j] = j < accepted ? draft[j] : -1;
  out[accepted] = candidates[accepted];
  a.num_accepted[n] = accepted;
#else
  __trap();  // below sm_90: never launched (staged_ops.h's use_staged)
#endif
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> mixture_verify(const at::Tensor& target_logits,
                                                              const at::Tensor& draft_logits,
                                                              const at::Tensor& branch_prior,
                                                              const at::Tensor& draft_tokens, const at::Tensor& uniforms,
                                                              double temperature, int64_t top_k, double top_p,
                                                              double draft_temperature) {
  const c10::cuda::CUDAGuard guard(target_logits.device());
  const at::Tensor logits = target_logits.contiguous(), dlogits = draft_logits.contiguous();
  const at::Tensor prior = branch_prior.contiguous(), tokens = draft_tokens.contiguous(), u = uniforms.contiguous();
  const int64_t rows = logits.size(0), positions = logits.size(1), num_draft = positions - 1;
  const int64_t num_branches = dlogits.size(1), vocab = logits.size(2);
  auto num_accepted = at::empty({rows}, logits.options().dtype(at::kInt));
  auto output_tokens = at::empty({rows, positions}, logits.options().dtype(at::kLong));
  auto accept_probs = at::empty({rows, num_draft}, logits.options().dtype(at::kFloat));
  if (rows == 0) return {num_accepted, output_tokens, accept_probs};

  const int64_t stats = rows * num_branches * num_draft;
  const int64_t chunks = (vocab + kDraftChunk - 1) / kDraftChunk;
  const auto bytes = logits.options().dtype(at::kByte);
  auto part_max = at::empty({stats * chunks}, logits.options().dtype(at::kFloat));
  auto part_sum = at::empty({stats * chunks}, logits.options().dtype(at::kDouble));
  auto softmax = at::empty({stats * static_cast<int64_t>(sizeof(DraftSoftmax))}, bytes);
  auto log_q_draft = at::empty({stats}, logits.options().dtype(at::kDouble));
  auto accept = at::empty({rows, num_draft}, logits.options().dtype(at::kDouble));
  auto candidates = at::empty({rows, positions}, logits.options().dtype(at::kLong));
  auto tickets = at::zeros({stats + rows}, logits.options().dtype(at::kInt));  // launch 1's, then launch 2's
  const int parts = split_parts(vocab);
  const int64_t slice = split_slice(vocab, parts);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  DBLAST_DISPATCH_LOGITS(dlogits.scalar_type(), "staged_mixture_verify_draft", [&] {
    using draft_t = scalar_t;
    const DraftStatsArgs args{tokens.data_ptr<int64_t>(),
                              static_cast<int>(num_draft),
                              static_cast<int>(num_branches),
                              vocab,
                              static_cast<int>(chunks),
                              draft_temperature,
                              static_cast<float>(1.0 / draft_temperature),
                              part_max.data_ptr<float>(),
                              part_sum.data_ptr<double>(),
                              tickets.data_ptr<int>(),
                              reinterpret_cast<DraftSoftmax*>(softmax.data_ptr()),
                              log_q_draft.data_ptr<double>()};
    draft_stats_kernel<draft_t><<<stats * chunks, kThreads, 0, stream>>>(dlogits.data_ptr<draft_t>(), args);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });

  DBLAST_DISPATCH_LOGITS(logits.scalar_type(), "staged_mixture_verify", [&] {
    using logit_t = scalar_t;
    const int64_t capacity = cluster_row::cache_capacity(slice, sizeof(logit_t));
    const MixtureArgs args{prior.data_ptr<float>(),
                           tokens.data_ptr<int64_t>(),
                           FilterSpec{temperature, top_k, top_p},
                           static_cast<int>(num_draft),
                           static_cast<int>(num_branches),
                           vocab,
                           slice,
                           capacity,
                           std::ldexp(1.0, fixed_point_bits(vocab)),
                           reinterpret_cast<const DraftSoftmax*>(softmax.data_ptr()),
                           log_q_draft.data_ptr<double>(),
                           accept.data_ptr<double>(),
                           candidates.data_ptr<int64_t>(),
                           tickets.data_ptr<int>() + stats,
                           num_accepted.data_ptr<int32_t>(),
                           output_tokens.data_ptr<int64_t>(),
                           accept_probs.data_ptr<float>()};
    DBLAST_DISPATCH_LOGITS(dlogits.scalar_type(), "staged_mixture_verify_draft", [&] {
      using draft_t = scalar_t;
      AT_DISPATCH_FLOATING_TYPES(u.scalar_type(), "staged_mixture_verify_uniforms", [&] {
        cluster_row::launch_clusters<mixture_target_kernel<logit_t, draft_t, scalar_t>>(rows * positions, parts,
                        static_cast<size_t>(capacity) * sizeof(logit_t), stream, logits.data_ptr<logit_t>(),
                        dlogits.data_ptr<draft_t>(), u.data_ptr<scalar_t>(), args);
      });
    });
  });
  return {num_accepted, output_tokens, accept_probs};
}

}  // namespace dblast::cuda::staged
