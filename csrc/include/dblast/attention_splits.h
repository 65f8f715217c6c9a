// How a split-KV (flash-decoding) drafter_attention kernel divides one row's keys among the
// splits of its grid, shared by its host launcher, its split kernel and its combine kernel
// (csrc/cuda/staged/drafter_attention.cu). The host sizes the grid's `splits` from shapes
// alone (no device value is read back, so a CUDA graph can capture the launch); each row then
// cuts its own keys, from its real length, into `splits` pieces rounded up to whole key tiles
// and no shorter than `min_keys` (a split's fixed costs, its query load and its partial
// result, stay small next to the keys it reads). Splits past `active` hold no keys: the split
// kernel returns at once for them and the combine kernel reads only the first `active`.
#pragma once

#include "dblast/attention_window.h"
#include "dblast/common.h"

namespace dblast {

// The keys of a row in the order the kernels walk them: its visible context (context_range),
// then its block.
DBLAST_HD int64_t row_key_count(int64_t length, int64_t block, int64_t window) {
  const ContextRange context = context_range(length, window);
  return context.end - context.begin + block;
}

struct KeySplit {
  int64_t keys_per_split;  // a multiple of the key tile
  int64_t active;          // splits holding at least one key, <= splits
};

DBLAST_HD KeySplit split_keys(int64_t keys, int64_t splits, int64_t tile, int64_t min_keys) {
  int64_t per = (keys + splits - 1) / splits;
  per = (per + tile - 1) / tile * tile;
  per = per < min_keys ? min_keys : per;
  return {per, (keys + per - 1) / per};
}

}  // namespace dblast
