// CPU kernel of dblast::branch_argmax: branch states h_z = h + W_z h + b_z (one GEMM), then
// the LM head in vocabulary tiles through ATen's BLAS, keeping a running (max, argmax,
// sum-exp) per row; never more than one tile of logits (and, for 16-bit weights, one
// upcast weight tile) alive. Everything is computed in float32.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "dblast/argmax_logsumexp.h"
#include "dblast/branch_argmax_checks.h"
#include "row_reductions.h"

namespace dblast::cpu {
namespace {

// Columns per tile: the explicit byte budget, or by default 1/16 of the full float32
// logits tensor, counting the tile of logits and any float32 copy of the weight tile; at
// least 64 (or the whole vocabulary when smaller). Zero rows need no tile: 1 column.
int64_t tile_columns(int64_t rows, int64_t width, int64_t vocab, bool weight_is_float, int64_t tile_bytes) {
  const int64_t per_column = 4 * (rows + (weight_is_float ? 0 : width));
  if (per_column == 0) return 1;
  const int64_t budget = tile_bytes > 0 ? tile_bytes : rows * vocab * 4 / 16;
  return std::min(vocab, std::max<int64_t>(64, budget / per_column));
}

// float32 branch states [N*K, H]: h + W h + b per branch, or h itself without an expander.
at::Tensor branch_states(const at::Tensor& x, const std::optional<at::Tensor>& expander_weight,
                         const std::optional<at::Tensor>& expander_bias, int64_t num_branches, int64_t tile_bytes) {
  if (!expander_weight.has_value()) return x;
  const int64_t rows = x.size(0), width = x.size(1), outputs = num_branches * width;
  const at::Tensor& w = *expander_weight;
  const at::Tensor bias = expander_bias->to(at::kFloat);
  at::Tensor expanded;
  if (w.scalar_type() == at::kFloat) {
    expanded = at::addmm(bias, x, w.t());
  } else {  // upcast the weight a tile of rows at a time
    expanded = at::empty({rows, outputs}, x.options());
    const int64_t step = tile_columns(rows, width, outputs, false, tile_bytes);
    for (int64_t r0 = 0; r0 < outputs; r0 += step) {
      const int64_t r1 = std::min(outputs, r0 + step);
      expanded.slice(1, r0, r1).copy_(at::addmm(bias.slice(0, r0, r1), x, w.slice(0, r0, r1).to(at::kFloat).t()));
    }
  }
  return expanded.view({rows, num_branches, width}).add_(x.unsqueeze(1)).view({rows * num_branches, width});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> branch_argmax_cpu(
    const at::Tensor& hidden, const at::Tensor& lm_head_weight, const std::optional<at::Tensor>& expander_weight,
    const std::optional<at::Tensor>& expander_bias, int64_t vocab_size, int64_t tile_bytes) {
  const int64_t num_branches =
      check_branch_argmax_args(hidden, lm_head_weight, expander_weight, expander_bias, vocab_size);
  const int64_t rows = hidden.size(0), width = hidden.size(1);
  const at::Tensor x = hidden.to(at::kFloat).contiguous();
  const at::Tensor states = branch_states(x, expander_weight, expander_bias, num_branches, tile_bytes).contiguous();
  const int64_t state_rows = rows * num_branches;

  const bool weight_is_float = lm_head_weight.scalar_type() == at::kFloat;
  const int64_t columns = tile_columns(state_rows, width, vocab_size, weight_is_float, tile_bytes);
  at::Tensor buffer = at::empty({state_rows * columns}, x.options());
  std::vector<ArgmaxLse> running(state_rows, ArgmaxLse::empty());
  for (int64_t v0 = 0; v0 < vocab_size && state_rows > 0; v0 += columns) {
    const int64_t count = std::min(columns, vocab_size - v0);
    at::Tensor weight_tile = lm_head_weight.slice(0, v0, v0 + count);
    if (!weight_is_float) weight_tile = weight_tile.to(at::kFloat);
    at::Tensor logits = buffer.narrow(0, 0, state_rows * count).view({state_rows, count});
    at::mm_out(logits, states, weight_tile.t());
    const float* data = logits.data_ptr<float>();
    at::parallel_for(0, state_rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float* row = data + r * count;
        const int64_t best = first_argmax(row, count);
        running[r].merge({row[best], v0 + best, sum_exp_shifted(row, count, row[best])});
      }
    });
  }

  auto tokens = at::empty({rows, num_branches}, x.options().dtype(at::kLong));
  auto max_logits = at::empty({rows, num_branches}, x.options());
  auto logsumexp = at::empty({rows, num_branches}, x.options());
  for (int64_t r = 0; r < state_rows; ++r) {
    tokens.data_ptr<int64_t>()[r] = running[r].index;
    max_logits.data_ptr<float>()[r] = running[r].max;
    logsumexp.data_ptr<float>()[r] = running[r].logsumexp();
  }
  return {tokens, max_logits, logsumexp};
}

}  // namespace

TORCH_LIBRARY_IMPL(dblast, CPU, m) { m.impl("branch_argmax", &branch_argmax_cpu); }

}  // namespace dblast::cpu
