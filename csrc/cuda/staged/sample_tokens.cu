// Staged CUDA kernel of dblast::sample_tokens (see csrc/cuda/sample_tokens.cu for the verified
// one and docs/ops.md for the contract).
//
// Grid: one thread-block cluster per row, split_parts(V) blocks per cluster (8 for
// V >= 28,673; 1 for a vocabulary of at most 4,096 tokens). Each block copies its slice of
// the row into shared memory once (cluster_row.cuh); the cluster then builds the filtered
// distribution on those copies (argmax, top-k and top-p radix selects, float64 masses,
// combined through distributed shared memory), block 0 writes the query probabilities, and
// the row's token is drawn by a cluster-wide inverse CDF on the row's uniform. The verified
// kernel walks the row ~10 times with one block; here HBM is read once, by 8 blocks.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cluster_row.cuh"
#include "dblast/filtering.h"
#include "dblast/split_row.h"
#include "dblast/verify_checks.h"
#include "staged_ops.h"

namespace dblast::cuda::staged {
namespace {

using namespace cluster_row;

struct SampleArgs {
  const int64_t* query_tokens;  // [R, C]
  FilterSpec spec;
  int64_t vocab, queries, slice, cache_capacity;
  double fixed_scale;
  int64_t* tokens;     // [R]
  float* query_probs;  // [R, C]
};

template <typename scalar_t, typename uniform_t>
__global__ void __launch_bounds__(kThreads, kClusterBlocksPerSm)
    sample_tokens_kernel(const scalar_t* __restrict__ logits, const uniform_t* __restrict__ uniforms, SampleArgs a) {
#if DBLAST_CLUSTER_CODE
  extern __shared__ __align__(16) unsigned char cache_bytes[];
  __shared__ ClusterShared sh;
  const int64_t n = blockIdx.x / cluster_blocks();
  const scalar_t* row = logits + n * a.vocab;
  const RowSlice<scalar_t> s =
      load_slice(row, a.vocab, a.slice, a.cache_capacity, reinterpret_cast<scalar_t*>(cache_bytes));
  const FilteredDist dist = cluster_filtered_dist(s, a.vocab, a.spec, a.fixed_scale, sh);
  if (cluster_rank() == 0) {
    for (int64_t c = threadIdx.x; c < a.queries; c += kThreads) {
      const int64_t x = a.query_tokens[n * a.queries + c];
      a.query_probs[n * a.queries + c] = x < 0 ? 0.0f : static_cast<float>(dist.prob(static_cast<float>(row[x]), x));
    }
  }
  int64_t token = dist.greedy_token;  // T = 0: the argmax, lowest id on ties
  if (!a.spec.greedy()) {
    token = cluster_inverse_cdf(
        s, static_cast<double>(uniforms[n]),
        [&](int64_t v, float logit) { return DrawWeights{dist.prob(logit, v), 0.0}; }, false, sh);
  }
  if (cluster_rank() == 0 && threadIdx.x == 0) a.tokens[n] = token;
  cluster_finish();
#else
  __trap();  // below sm_90: never launched (staged_ops.h's use_staged)
#endif
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> sample_tokens(const at::Tensor& logits, const at::Tensor& uniforms,
                                                 double temperature, int64_t top_k, double top_p,
                                                 const at::Tensor& query_tokens) {
  const c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor rows = logits.contiguous(), u = uniforms.contiguous(), query = query_tokens.contiguous();
  auto tokens = at::empty({rows.size(0)}, rows.options().dtype(at::kLong));
  auto query_probs = at::empty(query.sizes(), rows.options().dtype(at::kFloat));
  if (rows.size(0) == 0) return {tokens, query_probs};
  const int64_t vocab = rows.size(1);
  const int parts = split_parts(vocab);
  const int64_t slice = split_slice(vocab, parts);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  DBLAST_DISPATCH_LOGITS(rows.scalar_type(), "staged_sample_tokens", [&] {
    using logit_t = scalar_t;
    const int64_t capacity = cluster_row::cache_capacity(slice, sizeof(logit_t));
    const SampleArgs args{query.data_ptr<int64_t>(),
                          FilterSpec{temperature, top_k, top_p},
                          vocab,
                          query.size(1),
                          slice,
                          capacity,
                          std::ldexp(1.0, fixed_point_bits(vocab)),
                          tokens.data_ptr<int64_t>(),
                          query_probs.data_ptr<float>()};
    AT_DISPATCH_FLOATING_TYPES(u.scalar_type(), "staged_sample_tokens_uniforms", [&] {
      cluster_row::launch_clusters<sample_tokens_kernel<logit_t, scalar_t>>(rows.size(0), parts,
                      static_cast<size_t>(capacity) * sizeof(logit_t), stream, rows.data_ptr<logit_t>(),
                      u.data_ptr<scalar_t>(), args);
    });
  });
  return {tokens, query_probs};
}

}  // namespace dblast::cuda::staged
