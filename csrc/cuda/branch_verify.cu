// CUDA kernel of dblast::branch_verify (greedy-branch verification, DBLast Eq 18-21).
// One launch; one thread block per (row, position) builds that position's filtered
// target distribution and the drafted token's acceptance probability; the block of a row
// that finishes last makes the row's accept/reject decisions and draws the correction
// (or bonus) token by inverse CDF.
// With the staged kernels switched on (dblast/kernel_variant.h) or this op's staged kernel
// promoted (staged/promoted.h), the checked arguments go to staged/branch_verify.cu instead (a
// thread-block cluster per row splits the vocabulary).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "block_primitives.cuh"
#include "dblast/acceptance.h"
#include "dblast/filtering.h"
#include "dblast/verify_checks.h"
#include "inverse_cdf.cuh"
#include "staged/promoted.h"
#include "staged/staged_ops.h"
#include "target_filter.cuh"

namespace dblast::cuda {
namespace {

struct BranchVerifyArgs {
  const int64_t* branch_tokens;  // [N, K, b]
  const float* prior;            // [N, K]
  const int64_t* branch;         // [N]
  FilterSpec spec;
  int num_draft, num_branches;
  int64_t vocab;
  FilteredDist* dists;  // workspace [N, b+1]
  double* accept;       // workspace [N, b]
  int* tickets;         // [N], zeroed
  int32_t* num_accepted;
  int64_t* output_tokens;
  float* accept_probs;
};

template <typename scalar_t, typename uniform_t>
__global__ void __launch_bounds__(kThreads)
    branch_verify_kernel(const scalar_t* __restrict__ logits, const uniform_t* __restrict__ uniforms,
                         BranchVerifyArgs a) {
  const int positions = a.num_draft + 1;
  const int64_t n = blockIdx.x / positions;
  const int i = static_cast<int>(blockIdx.x % positions);
  const int64_t* row_tokens = a.branch_tokens + n * a.num_branches * a.num_draft;
  const int64_t* draft = row_tokens + a.branch[n] * a.num_draft;
  const float* prior = a.prior + n * a.num_branches;
  __shared__ int64_t support_tokens[kMaxBranches];
  __shared__ double support_probs[kMaxBranches];
  __shared__ int support_count, accepted_shared;

  const scalar_t* row = logits + (n * positions + i) * a.vocab;
  const FilteredDist dist = build_filtered_dist(row, a.vocab, a.spec);
  if (threadIdx.x == 0) {
    a.dists[blockIdx.x] = dist;
    if (i < a.num_draft) {
      const int64_t x = draft[i];
      const int count = greedy_branch_support(row_tokens, draft, prior, a.num_branches, a.num_draft, i,
                                              support_tokens, support_probs);
      const double accept = acceptance_prob(dist.prob(static_cast<float>(row[x]), x),
                                            sparse_prob(support_tokens, support_probs, count, x));
      a.accept[n * a.num_draft + i] = accept;
      a.accept_probs[n * a.num_draft + i] = static_cast<float>(accept);
    }
  }
  if (!block_finished_last(a.tickets, n, positions)) return;

  // Last block of row n: decide, then draw the final token.
  const uniform_t* u = uniforms + n * positions;
  if (threadIdx.x == 0) {
    const int accepted = first_rejection(a.accept + n * a.num_draft, u, a.num_draft);
    int64_t* out = a.output_tokens + n * positions;
    for (int j = 0; j < positions; ++j) out[j] = j < accepted ? draft[j] : -1;
    a.num_accepted[n] = accepted;
    support_count = accepted < a.num_draft
                        ? greedy_branch_support(row_tokens, draft, prior, a.num_branches, a.num_draft, accepted,
                                                support_tokens, support_probs)
                        : 0;  // bonus position: sample p itself
    accepted_shared = accepted;
  }
  __syncthreads();
  const int accepted = accepted_shared;
  const int count = support_count;
  const FilteredDist final_dist = a.dists[n * positions + accepted];
  const scalar_t* final_row = logits + (n * positions + accepted) * a.vocab;
  const double uniform = static_cast<double>(u[a.num_draft]);
  const int64_t token = block_draw_final_token(final_row, a.vocab, uniform, final_dist, [&](int64_t v, float logit) {
    const double r = final_dist.prob(logit, v) - sparse_prob(support_tokens, support_probs, count, v);
    return r > 0.0 ? r : 0.0;
  });
  if (threadIdx.x == 0) a.output_tokens[n * positions + accepted] = token;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> branch_verify_cuda(
    const at::Tensor& target_logits, const at::Tensor& branch_tokens, const at::Tensor& branch_prior,
    const at::Tensor& branch, const at::Tensor& uniforms, double temperature, int64_t top_k, double top_p,
    bool validate) {
  check_branch_verify_args(target_logits, branch_tokens, branch_prior, branch, uniforms, temperature, top_k,
                           top_p);
  if (validate) check_branch_verify_values(target_logits, branch_tokens, branch_prior, branch, uniforms);
  if (staged::use_staged(staged::Op::kBranchVerify, target_logits)) {
    return staged::branch_verify(target_logits, branch_tokens, branch_prior, branch, uniforms, temperature, top_k,
                                 top_p);
  }
  const c10::cuda::CUDAGuard guard(target_logits.device());
  const at::Tensor logits = target_logits.contiguous(), tokens = branch_tokens.contiguous();
  const at::Tensor prior = branch_prior.contiguous(), selected = branch.contiguous(), u = uniforms.contiguous();
  const int64_t rows = logits.size(0), positions = logits.size(1), num_draft = positions - 1;
  auto num_accepted = at::empty({rows}, logits.options().dtype(at::kInt));
  auto output_tokens = at::empty({rows, positions}, logits.options().dtype(at::kLong));
  auto accept_probs = at::empty({rows, num_draft}, logits.options().dtype(at::kFloat));
  if (rows == 0) return {num_accepted, output_tokens, accept_probs};

  auto dists = at::empty({rows * positions * static_cast<int64_t>(sizeof(FilteredDist))},
                         logits.options().dtype(at::kByte));
  auto accept = at::empty({rows, num_draft}, logits.options().dtype(at::kDouble));
  auto tickets = at::zeros({rows}, logits.options().dtype(at::kInt));
  BranchVerifyArgs args{tokens.data_ptr<int64_t>(),
                        prior.data_ptr<float>(),
                        selected.data_ptr<int64_t>(),
                        FilterSpec{temperature, top_k, top_p},
                        static_cast<int>(num_draft),
                        static_cast<int>(tokens.size(1)),
                        logits.size(2),
                        reinterpret_cast<FilteredDist*>(dists.data_ptr()),
                        accept.data_ptr<double>(),
                        tickets.data_ptr<int>(),
                        num_accepted.data_ptr<int32_t>(),
                        output_tokens.data_ptr<int64_t>(),
                        accept_probs.data_ptr<float>()};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  DBLAST_DISPATCH_LOGITS(logits.scalar_type(), "branch_verify_cuda", [&] {
    using logit_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES(u.scalar_type(), "branch_verify_cuda_uniforms", [&] {
      branch_verify_kernel<logit_t, scalar_t><<<rows * positions, kThreads, 0, stream>>>(
          logits.data_ptr<logit_t>(), u.data_ptr<scalar_t>(), args);
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {num_accepted, output_tokens, accept_probs};
}

}  // namespace

TORCH_LIBRARY_IMPL(dblast, CUDA, m) { m.impl("branch_verify", &branch_verify_cuda); }

}  // namespace dblast::cuda
