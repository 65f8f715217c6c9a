// CPU kernel of dblast::drafter_attention. Work items are (row, kv head, key segment): each
// takes all query heads of its group and all block positions together (so every K/V row
// is read once), runs an online softmax over chunks of its keys with the two products
// through BLAS, and leaves an unnormalised partial (O, max, sum); partials of a (row, kv
// head) are then merged. Segments split long contexts so that both cores stay busy even
// for one row with few kv heads.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "dblast/attention_checks.h"
#include "row_reductions.h"

namespace dblast::cpu {
namespace {

// Keys per BLAS product: about 64K scores per chunk, so that small groups still make
// products large enough to amortise each call.
int64_t keys_per_chunk(int64_t query_rows) { return std::clamp<int64_t>(65536 / query_rows, 256, 2048); }

struct Partial {
  std::vector<float> out;  // [M, D], unnormalised
  std::vector<float> max;  // [M]
  std::vector<float> sum;  // [M]
};

// Converts `count` rows of D values to float32 (a view for float32 input).
template <typename scalar_t>
const float* as_float(const scalar_t* rows, int64_t count, int64_t dim, std::vector<float>& buffer) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return rows;
  } else {
    buffer.resize(count * dim);
    for (int64_t i = 0; i < count * dim; ++i) buffer[i] = static_cast<float>(rows[i]);
    return buffer.data();
  }
}

// Folds `count` keys/values into the running softmax of all M query rows. `hide(r, row, value)`
// sets the entries of the keys query row r may not see to `value` and says whether there are
// any (false at once without causal or window masks).
template <typename Hide>
void attend_chunk(const at::Tensor& queries, const float* keys, const float* values, int64_t count, int64_t dim,
                  Partial& p, at::Tensor& scores, Hide&& hide) {
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  const int64_t m_rows = queries.size(0);
  const auto options = queries.options();
  at::Tensor k = at::from_blob(const_cast<float*>(keys), {count, dim}, options);
  at::Tensor v = at::from_blob(const_cast<float*>(values), {count, dim}, options);
  at::Tensor s = scores.narrow(0, 0, m_rows * count).view({m_rows, count});
  at::mm_out(s, queries, k.t());
  float* sp = s.data_ptr<float>();
  for (int64_t r = 0; r < m_rows; ++r) {
    float* row = sp + r * count;
    const bool masked = hide(r, row, kNone);
    const float chunk_max = row[first_argmax(row, count)];
    if (chunk_max == kNone) {  // every key of the chunk hidden from this query: it adds nothing
      std::fill(row, row + count, 0.0f);
      continue;
    }
    const float new_max = std::max(p.max[r], chunk_max);
    const float rescale = p.max[r] == kNone ? 0.0f : std::exp(p.max[r] - new_max);
    p.sum[r] = p.sum[r] * rescale + exp_shifted_inplace(row, count, new_max);  // a hidden key adds 1.6e-38, lost next to the maximum's 1
    if (masked) hide(r, row, 0.0f);  // exactly 0 for hidden keys in the product with V
    p.max[r] = new_max;
    float* o = p.out.data() + r * dim;
    for (int64_t d = 0; d < dim; ++d) o[d] *= rescale;
  }
  at::Tensor o = at::from_blob(p.out.data(), {m_rows, dim}, options);
  o.addmm_(s, v);
}

template <typename scalar_t>
void drafter_attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& k_block, const at::Tensor& v_block, const int32_t* lens, double scale,
                            int64_t window, bool causal, at::Tensor& out) {
  const int64_t rows = q.size(0), heads = q.size(1), block = q.size(2), dim = q.size(3);
  const bool mask = needs_query_mask(block, window, causal);
  const int64_t kv_heads = k_cache.size(1), max_len = k_cache.size(2), group = heads / kv_heads;
  const int64_t m_rows = group * block;
  const int64_t chunk = keys_per_chunk(m_rows);
  // Segments per (row, kv head): enough work items for every thread, none smaller than a chunk.
  const int64_t threads = at::get_num_threads();
  const int64_t longest = max_len + block;
  const int64_t segments = std::clamp<int64_t>((4 * threads + rows * kv_heads - 1) / (rows * kv_heads), 1,
                                               (longest + chunk - 1) / chunk);
  std::vector<Partial> partials(rows * kv_heads * segments);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kc = k_cache.data_ptr<scalar_t>();
  const scalar_t* vc = v_cache.data_ptr<scalar_t>();
  const scalar_t* kb = k_block.data_ptr<scalar_t>();
  const scalar_t* vb = v_block.data_ptr<scalar_t>();

  at::parallel_for(0, rows * kv_heads * segments, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> key_buffer, value_buffer;
    auto options = at::TensorOptions().dtype(at::kFloat);
    at::Tensor scores = at::empty({m_rows * chunk}, options);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / (kv_heads * segments), h = (item / segments) % kv_heads, seg = item % segments;
      const ContextRange context = context_range(lens[n], window);
      const int64_t cached = context.end - context.begin, total = cached + block;
      const int64_t per_segment = (total + segments - 1) / segments;
      const int64_t first = seg * per_segment, last = std::min(total, first + per_segment);
      Partial& p = partials[item];
      p.out.assign(m_rows * dim, 0.0f);
      p.max.assign(m_rows, -std::numeric_limits<float>::infinity());
      p.sum.assign(m_rows, 0.0f);
      if (first >= last) continue;
      // The group's queries, scaled: heads h*group .. h*group+group-1 are contiguous in q.
      at::Tensor queries = at::empty({m_rows, dim}, options);
      const scalar_t* qh = qp + (n * heads + h * group) * block * dim;
      float* qf = queries.data_ptr<float>();
      for (int64_t i = 0; i < m_rows * dim; ++i) qf[i] = static_cast<float>(qh[i]) * static_cast<float>(scale);
      for (int64_t j = first; j < last;) {
        // keys j < cached come from the cache (offset by the window start), the rest from the block
        const bool in_cache = j < cached;
        const int64_t stop = std::min({last, in_cache ? cached : total, j + chunk});
        const int64_t count = stop - j;
        const scalar_t* keys = in_cache ? kc + ((n * kv_heads + h) * max_len + context.begin + j) * dim
                                        : kb + ((n * kv_heads + h) * block + (j - cached)) * dim;
        const scalar_t* values = in_cache ? vc + ((n * kv_heads + h) * max_len + context.begin + j) * dim
                                          : vb + ((n * kv_heads + h) * block + (j - cached)) * dim;
        // chunk entry e is context position context.begin + j + e, or block key j + e - cached
        const int64_t length = lens[n], first_key = in_cache ? context.begin + j : j - cached;
        auto hide = [&](int64_t r, float* row, float value) {
          if (!mask) return false;
          const int64_t query = r % block;
          bool any = false;
          for (int64_t e = 0; e < count; ++e) {
            const bool visible = in_cache ? context_key_visible(length, first_key + e, query, window)
                                          : block_key_visible(first_key + e, query, window, causal);
            if (!visible) {
              row[e] = value;
              any = true;
            }
          }
          return any;
        };
        attend_chunk(queries, as_float(keys, count, dim, key_buffer), as_float(values, count, dim, value_buffer),
                     count, dim, p, scores, hide);
        j = stop;
      }
    }
  });

  // Merge the segments of every (row, kv head) and normalise.
  scalar_t* op = out.data_ptr<scalar_t>();
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / kv_heads, h = item % kv_heads;
      scalar_t* oh = op + (n * heads + h * group) * block * dim;
      for (int64_t r = 0; r < m_rows; ++r) {
        float best = -std::numeric_limits<float>::infinity();
        for (int64_t s = 0; s < segments; ++s) best = std::max(best, partials[item * segments + s].max[r]);
        std::fill(merged.begin(), merged.end(), 0.0f);
        double total = 0.0;
        for (int64_t s = 0; s < segments; ++s) {
          const Partial& p = partials[item * segments + s];
          if (p.max.empty() || p.sum[r] == 0.0f) continue;
          const float w = std::exp(p.max[r] - best);
          total += static_cast<double>(w) * p.sum[r];
          for (int64_t d = 0; d < dim; ++d) merged[d] += w * p.out[r * dim + d];
        }
        const float inverse = static_cast<float>(1.0 / total);
        for (int64_t d = 0; d < dim; ++d) oh[r * dim + d] = static_cast<scalar_t>(merged[d] * inverse);
      }
    }
  });
}

at::Tensor drafter_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& k_block, const at::Tensor& v_block, const at::Tensor& context_lens,
                                 double scale, int64_t window, bool causal) {
  check_drafter_attention_args(q, k_cache, v_cache, k_block, v_block, context_lens, scale, window);
  check_context_lens(context_lens, k_cache.size(2));
  const at::Tensor lens = context_lens.contiguous();
  const int32_t* lp = lens.data_ptr<int32_t>();
  const at::Tensor qc = q.contiguous(), kc = k_cache.contiguous(), vc = v_cache.contiguous();
  const at::Tensor kb = k_block.contiguous(), vb = v_block.contiguous();
  at::Tensor out = at::empty_like(qc);
  if (q.numel() == 0) return out;
  AT_DISPATCH_SWITCH(q.scalar_type(), "drafter_attention_cpu",
                     AT_DISPATCH_CASE(at::kFloat, [&] {
                       drafter_attention_impl<scalar_t>(qc, kc, vc, kb, vb, lp, scale, window, causal, out);
                     }) AT_DISPATCH_CASE(at::kBFloat16, [&] {
                       drafter_attention_impl<scalar_t>(qc, kc, vc, kb, vb, lp, scale, window, causal, out);
                     }) AT_DISPATCH_CASE(at::kHalf, [&] {
                       drafter_attention_impl<scalar_t>(qc, kc, vc, kb, vb, lp, scale, window, causal, out);
                     }));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dblast, CPU, m) { m.impl("drafter_attention", &drafter_attention_cpu); }

}  // namespace dblast::cpu
