// CUDA kernel of dblast::sample_tokens, the device twin of csrc/cpu/sample_tokens.cpp: one
// thread block per row builds the row's filtered target distribution (the verifiers'
// construction, target_filter.cuh), draws the row's token by inverse CDF on its uniform (the
// argmax at T = 0) and writes the filtered probability of each of the row's query tokens
// (-1: none, probability 0). Trie verification draws every node of a trie in one launch.
// With the staged kernels switched on (dblast/kernel_variant.h) or this op's staged kernel
// promoted (staged/promoted.h), the checked arguments go to staged/sample_tokens.cu instead (a
// thread-block cluster per row splits the vocabulary).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "block_primitives.cuh"
#include "dblast/filtering.h"
#include "dblast/verify_checks.h"
#include "inverse_cdf.cuh"
#include "staged/promoted.h"
#include "staged/staged_ops.h"
#include "target_filter.cuh"

namespace dblast::cuda {
namespace {

template <typename scalar_t, typename uniform_t>
__global__ void __launch_bounds__(kThreads)
    sample_tokens_kernel(const scalar_t* __restrict__ logits, const uniform_t* __restrict__ uniforms,
                         const int64_t* __restrict__ query_tokens, FilterSpec spec, int64_t vocab, int64_t queries,
                         int64_t* __restrict__ tokens, float* __restrict__ query_probs) {
  const int64_t n = blockIdx.x;
  const scalar_t* row = logits + n * vocab;
  const FilteredDist dist = build_filtered_dist(row, vocab, spec);
  // queries first: the draw below ends with barriers every thread reaches, these need none
  for (int64_t c = threadIdx.x; c < queries; c += blockDim.x) {
    const int64_t x = query_tokens[n * queries + c];
    query_probs[n * queries + c] = x < 0 ? 0.0f : static_cast<float>(dist.prob(static_cast<float>(row[x]), x));
  }
  if (spec.greedy()) {
    if (threadIdx.x == 0) tokens[n] = dist.greedy_token;
    return;
  }
  const int64_t token = block_inverse_cdf(row, vocab, static_cast<double>(uniforms[n]),
                                          [&](int64_t v, float logit) { return dist.prob(logit, v); });
  if (threadIdx.x == 0) tokens[n] = token;
}

std::tuple<at::Tensor, at::Tensor> sample_tokens_cuda(const at::Tensor& logits, const at::Tensor& uniforms,
                                                      double temperature, int64_t top_k, double top_p,
                                                      const at::Tensor& query_tokens, bool validate) {
  check_sample_tokens_args(logits, uniforms, temperature, top_k, top_p, query_tokens);
  if (validate) check_sample_tokens_values(logits, uniforms, query_tokens);
  if (staged::use_staged(staged::Op::kSampleTokens, logits)) {
    return staged::sample_tokens(logits, uniforms, temperature, top_k, top_p, query_tokens);
  }
  const c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor rows = logits.contiguous(), u = uniforms.contiguous(), query = query_tokens.contiguous();
  auto tokens = at::empty({rows.size(0)}, rows.options().dtype(at::kLong));
  auto query_probs = at::empty(query.sizes(), rows.options().dtype(at::kFloat));
  if (rows.size(0) == 0) return {tokens, query_probs};
  const FilterSpec spec{temperature, top_k, top_p};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  DBLAST_DISPATCH_LOGITS(rows.scalar_type(), "sample_tokens_cuda", [&] {
    using logit_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES(u.scalar_type(), "sample_tokens_cuda_uniforms", [&] {
      sample_tokens_kernel<logit_t, scalar_t><<<rows.size(0), kThreads, 0, stream>>>(
          rows.data_ptr<logit_t>(), u.data_ptr<scalar_t>(), query.data_ptr<int64_t>(), spec, rows.size(1),
          query.size(1), tokens.data_ptr<int64_t>(), query_probs.data_ptr<float>());
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {tokens, query_probs};
}

}  // namespace

TORCH_LIBRARY_IMPL(dblast, CUDA, m) { m.impl("sample_tokens", &sample_tokens_cuda); }

}  // namespace dblast::cuda
