// Which keys a drafter query sees, shared by the CPU and CUDA attention kernels (the same rule
// as dblast_ext.reference.key_visible). A row has `length` cached context tokens at positions
// [0, length) and its block at length + i; block query i sees
//   - a context key at position p        if the window allows it,
//   - block key j                        if (not causal or j <= i) and the window allows it,
// where a window W > 0 allows a key at distance |query - key| < W (W counts the query itself, as
// in DFlash's sliding layers) and W = -1 allows every key.
#pragma once

#include "dblast/common.h"

namespace dblast {

DBLAST_HD bool within_window(int64_t distance, int64_t window) { return window <= 0 || distance < window; }

// Context positions [begin, end) that any block query may see: the anchor query (i = 0) sees the
// most, W - 1 context keys before itself; later queries see fewer (`context_key_visible`).
struct ContextRange {
  int64_t begin, end;
};

DBLAST_HD ContextRange context_range(int64_t length, int64_t window) {
  return {window > 0 && length > window - 1 ? length - (window - 1) : 0, length};
}

DBLAST_HD bool context_key_visible(int64_t length, int64_t position, int64_t query, int64_t window) {
  return within_window(length + query - position, window);
}

DBLAST_HD bool block_key_visible(int64_t key, int64_t query, int64_t window, bool causal) {
  if (causal && key > query) return false;
  return within_window(key > query ? key - query : query - key, window);
}

// The first context position that every query of a block of `block` tokens sees (every
// position at or after it is visible to all of them, as context_key_visible says: the last
// query, length + block - 1, is the farthest from a context key). Kernels skip the per-query
// rule on key tiles that start at or after it; 0 without a window.
DBLAST_HD int64_t context_visible_to_all_from(int64_t length, int64_t block, int64_t window) {
  return window > 0 ? length + block - window : 0;
}

// Whether any query of a block of `block` tokens is denied a key the full (non-causal,
// unwindowed) pattern would show it, beyond the context range: if not, no per-query mask is needed.
DBLAST_HD bool needs_query_mask(int64_t block, int64_t window, bool causal) {
  return (causal && block > 1) || window > 0;
}

}  // namespace dblast
