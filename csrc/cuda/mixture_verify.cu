// CUDA kernel of dblast::mixture_verify (soft-mixture verification, DBLast Eq 5, 10-12).
// One launch; one thread block per (row, position) builds that position's filtered target
// distribution and every branch's draft softmax statistics; the block of a row that
// finishes last runs the category posterior along the draft prefix, decides, and draws the
// correction (or bonus) token by inverse CDF over the dense residual.
// With the staged kernels switched on (dblast/kernel_variant.h) or this op's staged kernel
// promoted (staged/promoted.h), the checked arguments go to staged/mixture_verify.cu instead (a
// thread-block cluster per row splits the vocabulary).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "block_primitives.cuh"
#include "dblast/acceptance.h"
#include "dblast/filtering.h"
#include "dblast/mixture.h"
#include "dblast/verify_checks.h"
#include "inverse_cdf.cuh"
#include "staged/promoted.h"
#include "staged/staged_ops.h"
#include "target_filter.cuh"

namespace dblast::cuda {
namespace {

struct MixtureVerifyArgs {
  const float* prior;         // [N, K]
  const int64_t* draft;       // [N, b]
  FilterSpec spec;
  double draft_temperature;
  int num_draft, num_branches;
  int64_t vocab;
  FilteredDist* dists;        // workspace [N, b+1]
  DraftSoftmax* softmax;      // workspace [N, K, b]
  double* log_q_draft;        // workspace [N, K, b]: log q_i(x_i | z)
  double* p_draft;            // workspace [N, b]: p_i(x_i)
  double* accept;             // workspace [N, b]
  int* tickets;               // [N], zeroed
  int32_t* num_accepted;
  int64_t* output_tokens;
  float* accept_probs;
};

template <typename scalar_t, typename draft_t, typename uniform_t>
__global__ void __launch_bounds__(kThreads)
    mixture_verify_kernel(const scalar_t* __restrict__ logits, const draft_t* __restrict__ draft_logits,
                          const uniform_t* __restrict__ uniforms, MixtureVerifyArgs a) {
  const int positions = a.num_draft + 1;
  const int64_t n = blockIdx.x / positions;
  const int i = static_cast<int>(blockIdx.x % positions);
  const int64_t* draft = a.draft + n * a.num_draft;
  const float* prior = a.prior + n * a.num_branches;
  auto draft_row = [&](int z, int j) {
    return draft_logits + ((n * a.num_branches + z) * a.num_draft + j) * a.vocab;
  };
  auto stat = [&](int z, int j) { return (n * a.num_branches + z) * a.num_draft + j; };
  __shared__ double weights[kMaxBranches];
  __shared__ DraftSoftmax branch_softmax[kMaxBranches];
  __shared__ int accepted_shared;

  const scalar_t* row = logits + (n * positions + i) * a.vocab;
  const FilteredDist dist = build_filtered_dist(row, a.vocab, a.spec);
  if (threadIdx.x == 0) a.dists[blockIdx.x] = dist;
  if (i < a.num_draft) {
    const int64_t x = draft[i];
    if (threadIdx.x == 0) a.p_draft[n * a.num_draft + i] = dist.prob(static_cast<float>(row[x]), x);
    for (int z = 0; z < a.num_branches; ++z) {
      const DraftSoftmax sm = build_draft_softmax(draft_row(z, i), a.vocab, a.draft_temperature);
      if (threadIdx.x == 0) {
        a.softmax[stat(z, i)] = sm;
        a.log_q_draft[stat(z, i)] = sm.log_prob(static_cast<float>(draft_row(z, i)[x]));
      }
    }
  }
  if (!block_finished_last(a.tickets, n, positions)) return;

  // Last block of row n: posterior along the prefix, decisions, final draw.
  const uniform_t* u = uniforms + n * positions;
  if (threadIdx.x == 0) {
    const double* log_q = a.log_q_draft + stat(0, 0);
    double* accept = a.accept + n * a.num_draft;
    for (int j = 0; j < a.num_draft; ++j) {
      mixture_posterior(prior, log_q, a.num_branches, a.num_draft, j, weights);
      double q = 0.0;
      for (int z = 0; z < a.num_branches; ++z) q += weights[z] * exp(log_q[z * a.num_draft + j]);
      accept[j] = acceptance_prob(a.p_draft[n * a.num_draft + j], q);
      a.accept_probs[n * a.num_draft + j] = static_cast<float>(accept[j]);
    }
    const int accepted = first_rejection(accept, u, a.num_draft);
    int64_t* out = a.output_tokens + n * positions;
    for (int j = 0; j < positions; ++j) out[j] = j < accepted ? draft[j] : -1;
    a.num_accepted[n] = accepted;
    if (accepted < a.num_draft) {
      mixture_posterior(prior, log_q, a.num_branches, a.num_draft, accepted, weights);
      for (int z = 0; z < a.num_branches; ++z) branch_softmax[z] = a.softmax[stat(z, accepted)];
    } else {
      for (int z = 0; z < a.num_branches; ++z) weights[z] = 0.0;  // bonus position: sample p itself
    }
    accepted_shared = accepted;
  }
  __syncthreads();
  const int accepted = accepted_shared;
  const int branches = a.num_branches;
  const FilteredDist final_dist = a.dists[n * positions + accepted];
  const scalar_t* final_row = logits + (n * positions + accepted) * a.vocab;
  const double uniform = static_cast<double>(u[a.num_draft]);
  const int64_t token = block_draw_final_token(final_row, a.vocab, uniform, final_dist, [&](int64_t v, float logit) {
    double r = final_dist.prob(logit, v);
    for (int z = 0; z < branches; ++z) {
      if (weights[z] > 0.0) r -= weights[z] * branch_softmax[z].prob(static_cast<float>(draft_row(z, accepted)[v]));
    }
    return r > 0.0 ? r : 0.0;
  });
  if (threadIdx.x == 0) a.output_tokens[n * positions + accepted] = token;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> mixture_verify_cuda(
    const at::Tensor& target_logits, const at::Tensor& draft_logits, const at::Tensor& branch_prior,
    const at::Tensor& draft_tokens, const at::Tensor& uniforms, double temperature, int64_t top_k, double top_p,
    double draft_temperature, bool validate) {
  check_mixture_verify_args(target_logits, draft_logits, branch_prior, draft_tokens, uniforms, temperature, top_k,
                            top_p, draft_temperature);
  if (validate) check_mixture_verify_values(target_logits, draft_logits, branch_prior, draft_tokens, uniforms);
  if (staged::use_staged(staged::Op::kMixtureVerify, target_logits)) {
    return staged::mixture_verify(target_logits, draft_logits, branch_prior, draft_tokens, uniforms, temperature,
                                  top_k, top_p, draft_temperature);
  }
  const c10::cuda::CUDAGuard guard(target_logits.device());
  const at::Tensor logits = target_logits.contiguous(), dlogits = draft_logits.contiguous();
  const at::Tensor prior = branch_prior.contiguous(), tokens = draft_tokens.contiguous(), u = uniforms.contiguous();
  const int64_t rows = logits.size(0), positions = logits.size(1), num_draft = positions - 1;
  const int64_t num_branches = dlogits.size(1);
  auto num_accepted = at::empty({rows}, logits.options().dtype(at::kInt));
  auto output_tokens = at::empty({rows, positions}, logits.options().dtype(at::kLong));
  auto accept_probs = at::empty({rows, num_draft}, logits.options().dtype(at::kFloat));
  if (rows == 0) return {num_accepted, output_tokens, accept_probs};

  const auto bytes = logits.options().dtype(at::kByte);
  auto dists = at::empty({rows * positions * static_cast<int64_t>(sizeof(FilteredDist))}, bytes);
  auto softmax = at::empty({rows * num_branches * num_draft * static_cast<int64_t>(sizeof(DraftSoftmax))}, bytes);
  auto log_q_draft = at::empty({rows, num_branches, num_draft}, logits.options().dtype(at::kDouble));
  auto p_draft = at::empty({rows, num_draft}, logits.options().dtype(at::kDouble));
  auto accept = at::empty({rows, num_draft}, logits.options().dtype(at::kDouble));
  auto tickets = at::zeros({rows}, logits.options().dtype(at::kInt));
  MixtureVerifyArgs args{prior.data_ptr<float>(),
                         tokens.data_ptr<int64_t>(),
                         FilterSpec{temperature, top_k, top_p},
                         draft_temperature,
                         static_cast<int>(num_draft),
                         static_cast<int>(num_branches),
                         logits.size(2),
                         reinterpret_cast<FilteredDist*>(dists.data_ptr()),
                         reinterpret_cast<DraftSoftmax*>(softmax.data_ptr()),
                         log_q_draft.data_ptr<double>(),
                         p_draft.data_ptr<double>(),
                         accept.data_ptr<double>(),
                         tickets.data_ptr<int>(),
                         num_accepted.data_ptr<int32_t>(),
                         output_tokens.data_ptr<int64_t>(),
                         accept_probs.data_ptr<float>()};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  DBLAST_DISPATCH_LOGITS(logits.scalar_type(), "mixture_verify_cuda", [&] {
    using logit_t = scalar_t;
    DBLAST_DISPATCH_LOGITS(dlogits.scalar_type(), "mixture_verify_cuda_draft", [&] {
      using draft_t = scalar_t;
      AT_DISPATCH_FLOATING_TYPES(u.scalar_type(), "mixture_verify_cuda_uniforms", [&] {
        mixture_verify_kernel<logit_t, draft_t, scalar_t><<<rows * positions, kThreads, 0, stream>>>(
            logits.data_ptr<logit_t>(), dlogits.data_ptr<draft_t>(), u.data_ptr<scalar_t>(), args);
      });
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {num_accepted, output_tokens, accept_probs};
}

}  // namespace

TORCH_LIBRARY_IMPL(dblast, CUDA, m) { m.impl("mixture_verify", &mixture_verify_cuda); }

}  // namespace dblast::cuda
