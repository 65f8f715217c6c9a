// Which cached keys a row attends to: all of its context, or with a sliding window only the
// last `window` of them. Shared by the CPU and CUDA attention kernels.
#pragma once

#include "dblast/common.h"

namespace dblast {

struct ContextRange {
  int64_t begin, end;  // [begin, end) of the row's cache
};

DBLAST_HD ContextRange context_range(int64_t length, int64_t window) {
  return {window > 0 && length > window ? length - window : 0, length};
}

}  // namespace dblast
