"""Peak extra host memory of a call (Linux): the rise of the process's peak resident set
over its resident set before the call.

glibc serves allocations above a fixed 128 KiB threshold with mmap, so every large tensor
an op allocates is mapped and unmapped and shows in the resident set; freed heap pages are
returned before the call (so none are returned during it), and the peak is reset through
/proc/self/clear_refs.
"""
import ctypes
import re
import sys

_M_MMAP_THRESHOLD = -3


def supported() -> bool:
    return sys.platform.startswith("linux")


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(key + r":\s+(\d+) kB", f.read()).group(1)) * 1024


def peak_extra_bytes(fn) -> int:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(_M_MMAP_THRESHOLD, 128 * 1024)
    fn()  # warm-up: one-off buffers (BLAS, allocator) are not the op's working set
    libc.malloc_trim(0)  # free heap pages now, not during the measured call
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS")
    fn()
    return max(0, _status("VmHWM") - before)
