// CPU kernel of dblast::sample_tokens: for each row of logits, the filtered target
// distribution (the verifiers' construction, target_filter.h) built once, then
//   - a token drawn from it by inverse CDF on the row's uniform (the argmax at T = 0), and
//   - the filtered probability of each of the row's query tokens (-1: none, probability 0),
// which is what trie verification needs per node: the walk's draw and the chance of
// descending to each child. Rows are independent and run in parallel.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <utility>
#include <vector>

#include "dblast/filtering.h"
#include "dblast/verify_checks.h"
#include "target_filter.h"

namespace dblast::cpu {
namespace {

template <typename scalar_t, typename uniform_t>
void sample_tokens_impl(const at::Tensor& logits, const at::Tensor& uniforms, const at::Tensor& query_tokens,
                        const FilterSpec& spec, at::Tensor& tokens, at::Tensor& query_probs) {
  const int64_t rows = logits.size(0), vocab = logits.size(1), queries = query_tokens.size(1);
  const scalar_t* data = logits.data_ptr<scalar_t>();
  const uniform_t* u = uniforms.data_ptr<uniform_t>();
  const int64_t* query = query_tokens.data_ptr<int64_t>();
  int64_t* tokens_out = tokens.data_ptr<int64_t>();
  float* probs_out = query_probs.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    std::vector<std::pair<int64_t, double>> kept;
    for (int64_t n = begin; n < end; ++n) {
      const scalar_t* row = data + n * vocab;
      const FilteredDist dist = build_filtered_dist(row, vocab, spec, scratch);
      auto prob = [&](int64_t v) { return dist.prob(static_cast<float>(row[v]), v); };
      tokens_out[n] = spec.greedy() ? dist.greedy_token
                                    : draw_filtered(row, vocab, static_cast<double>(u[n]), dist, kept);
      for (int64_t c = 0; c < queries; ++c) {
        const int64_t x = query[n * queries + c];
        probs_out[n * queries + c] = x < 0 ? 0.0f : static_cast<float>(prob(x));
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> sample_tokens_cpu(const at::Tensor& logits, const at::Tensor& uniforms,
                                                     double temperature, int64_t top_k, double top_p,
                                                     const at::Tensor& query_tokens, bool validate) {
  check_sample_tokens_args(logits, uniforms, temperature, top_k, top_p, query_tokens);
  if (validate) check_sample_tokens_values(logits, uniforms, query_tokens);
  const at::Tensor rows = logits.contiguous(), u = uniforms.contiguous(), query = query_tokens.contiguous();
  auto tokens = at::empty({rows.size(0)}, rows.options().dtype(at::kLong));
  auto query_probs = at::empty(query.sizes(), rows.options().dtype(at::kFloat));
  const FilterSpec spec{temperature, top_k, top_p};
  DBLAST_DISPATCH_LOGITS(rows.scalar_type(), "sample_tokens_cpu", [&] {
    using logit_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES(u.scalar_type(), "sample_tokens_cpu_uniforms", [&] {
      sample_tokens_impl<logit_t, scalar_t>(rows, u, query, spec, tokens, query_probs);
    });
  });
  return {tokens, query_probs};
}

}  // namespace

TORCH_LIBRARY_IMPL(dblast, CPU, m) { m.impl("sample_tokens", &sample_tokens_cpu); }

}  // namespace dblast::cpu
