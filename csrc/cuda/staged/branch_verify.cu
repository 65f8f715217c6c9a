// Staged CUDA kernel of dblast::branch_verify (greedy-branch verification, DBLast Eq 18-21;
// the verified kernel is csrc/cuda/branch_verify.cu, the contract docs/ops.md).
//
// Grid: one thread-block cluster per (row n, position i), split_parts(V) blocks per cluster
// (8 at V = 151,936: N = 1, b = 15 launches 128 blocks, N = 32 4,096). Each cluster:
//   1. copies position i's logits into its blocks' shared memory (one HBM read) and builds
//      the filtered target p_i there (cluster_row.cuh);
//   2. i < b: A_i = min(1, p_i(x_i) / q_i(x_i)) with the sparse greedy-branch proposal;
//   3. draws, on the row's final uniform, the token this position would emit if it were the
//      first rejection: from the residual [p_i - q_i]+ (from p_i when it has no mass), or
//      from p_b at the bonus position. All b + 1 candidates are drawn in parallel, so no
//      second pass over the logits waits for the decisions;
//   4. block 0 publishes A_i and the candidate, takes the row's ticket (an integer atomic),
//      and the cluster that finishes the row last makes the accept/reject decisions and
//      writes the outputs, picking the candidate at the first rejection.
// Deterministic: fixed-order float64 sums and integer histograms only.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cluster_row.cuh"
#include "dblast/acceptance.h"
#include "dblast/filtering.h"
#include "dblast/split_row.h"
#include "dblast/verify_checks.h"
#include "staged_ops.h"

namespace dblast::cuda::staged {
namespace {

using namespace cluster_row;

struct BranchArgs {
  const int64_t* branch_tokens;  // [N, K, b]
  const float* prior;            // [N, K]
  const int64_t* branch;         // [N]
  FilterSpec spec;
  int num_draft, num_branches;
  int64_t vocab, slice, cache_capacity;
  double fixed_scale;
  double* accept;         // workspace [N, b]: A_i in float64
  int64_t* candidates;    // workspace [N, b+1]: the final token if position i ends the block
  int* tickets;           // [N], zeroed
  int32_t* num_accepted;  // [N]
  int64_t* output_tokens; // [N, b+1]
  float* accept_probs;    // [N, b]
};

template <typename scalar_t, typename uniform_t>
__global__ void __launch_bounds__(kThreads, kClusterBlocksPerSm)
    branch_verify_kernel(const scalar_t* __restrict__ logits, const uniform_t* __restrict__ uniforms, BranchArgs a) {
#if DBLAST_CLUSTER_CODE
  extern __shared__ __align__(16) unsigned char cache_bytes[];
  __shared__ ClusterShared sh;
  __shared__ int64_t support_tokens[kMaxBranches];
  __shared__ double support_probs[kMaxBranches];
  __shared__ int support_count;

  const int positions = a.num_draft + 1;
  const int64_t cluster = blockIdx.x / cluster_blocks();
  const int64_t n = cluster / positions;
  const int i = static_cast<int>(cluster % positions);
  const int64_t* row_tokens = a.branch_tokens + n * a.num_branches * a.num_draft;
  const int64_t* draft = row_tokens + a.branch[n] * a.num_draft;
  const float* prior = a.prior + n * a.num_branches;
  const scalar_t* row = logits + (n * positions + i) * a.vocab;

  const RowSlice<scalar_t> s =
      load_slice(row, a.vocab, a.slice, a.cache_capacity, reinterpret_cast<scalar_t*>(cache_bytes));
  // q_i(. | x_<i) as a sparse table, in every block (the residual below needs it everywhere);
  // the bonus position draws from p itself (no entries)
  if (threadIdx.x == 0) {
    support_count = i < a.num_draft ? greedy_branch_support(row_tokens, draft, prior, a.num_branches, a.num_draft,
                                                            i, support_tokens, support_probs)
                                    : 0;
  }
  const FilteredDist dist = cluster_filtered_dist(s, a.vocab, a.spec, a.fixed_scale, sh);  // syncs the block
  const int count = support_count;

  int64_t candidate = dist.greedy_token;  // T = 0: p and every residual's support is the argmax
  if (!a.spec.greedy()) {
    candidate = cluster_inverse_cdf(
        s, static_cast<double>(uniforms[n * positions + a.num_draft]),
        [&](int64_t v, float logit) {
          const double p = dist.prob(logit, v);
          if (!(p > 0.0)) return DrawWeights{0.0, 0.0};  // no need to look up the proposal
          const double r = p - sparse_prob(support_tokens, support_probs, count, v);
          return DrawWeights{r > 0.0 ? r : 0.0, p};
        },
        true, sh);
  }
  cluster_finish();
  if (cluster_rank() != 0 || threadIdx.x != 0) return;

  if (i < a.num_draft) {
    const int64_t x = draft[i];
    const double accept = acceptance_prob(dist.prob(static_cast<float>(row[x]), x),
                                          sparse_prob(support_tokens, support_probs, count, x));
    a.accept[n * a.num_draft + i] = accept;
    a.accept_probs[n * a.num_draft + i] = static_cast<float>(accept);
  }
  a.candidates[n * positions + i] = candidate;
  __threadfence();
  if (atomicAdd(a.tickets + n, 1) != positions - 1) return;
  __threadfence();

  // The row's last cluster: decide with every position's A_i and pick the candidate.
  // volatile: the other clusters' values, never cached in this SM's L1
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

std::tuple<at::Tensor, at::Tensor, at::Tensor> branch_verify(const at::Tensor& target_logits,
                                                             const at::Tensor& branch_tokens,
                                                             const at::Tensor& branch_prior, const at::Tensor& branch,
                                                             const at::Tensor& uniforms, double temperature,
                                                             int64_t top_k, double top_p) {
  const c10::cuda::CUDAGuard guard(target_logits.device());
  const at::Tensor logits = target_logits.contiguous(), tokens = branch_tokens.contiguous();
  const at::Tensor prior = branch_prior.contiguous(), selected = branch.contiguous(), u = uniforms.contiguous();
  const int64_t rows = logits.size(0), positions = logits.size(1), num_draft = positions - 1;
  const int64_t vocab = logits.size(2);
  auto num_accepted = at::empty({rows}, logits.options().dtype(at::kInt));
  auto output_tokens = at::empty({rows, positions}, logits.options().dtype(at::kLong));
  auto accept_probs = at::empty({rows, num_draft}, logits.options().dtype(at::kFloat));
  if (rows == 0) return {num_accepted, output_tokens, accept_probs};

  auto accept = at::empty({rows, num_draft}, logits.options().dtype(at::kDouble));
  auto candidates = at::empty({rows, positions}, logits.options().dtype(at::kLong));
  auto tickets = at::zeros({rows}, logits.options().dtype(at::kInt));  // a fill kernel: stream-ordered
  const int parts = split_parts(vocab);
  const int64_t slice = split_slice(vocab, parts);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  DBLAST_DISPATCH_LOGITS(logits.scalar_type(), "staged_branch_verify", [&] {
    using logit_t = scalar_t;
    const int64_t capacity = cluster_row::cache_capacity(slice, sizeof(logit_t));
    const BranchArgs args{tokens.data_ptr<int64_t>(),
                          prior.data_ptr<float>(),
                          selected.data_ptr<int64_t>(),
                          FilterSpec{temperature, top_k, top_p},
                          static_cast<int>(num_draft),
                          static_cast<int>(tokens.size(1)),
                          vocab,
                          slice,
                          capacity,
                          std::ldexp(1.0, fixed_point_bits(vocab)),
                          accept.data_ptr<double>(),
                          candidates.data_ptr<int64_t>(),
                          tickets.data_ptr<int>(),
                          num_accepted.data_ptr<int32_t>(),
                          output_tokens.data_ptr<int64_t>(),
                          accept_probs.data_ptr<float>()};
    AT_DISPATCH_FLOATING_TYPES(u.scalar_type(), "staged_branch_verify_uniforms", [&] {
      cluster_row::launch_clusters<branch_verify_kernel<logit_t, scalar_t>>(rows * positions, parts,
                      static_cast<size_t>(capacity) * sizeof(logit_t), stream, logits.data_ptr<logit_t>(),
                      u.data_ptr<scalar_t>(), args);
    });
  });
  return {num_accepted, output_tokens, accept_probs};
}

}  // namespace dblast::cuda::staged
