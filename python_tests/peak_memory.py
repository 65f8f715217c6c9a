"""Peak extra host memory of a call: the most bytes of CPU tensors alive at once during it,
beyond those alive before it.

Read from torch's own CPU allocator accounting (the profiler's memory events), not from the
process's resident set: freed heap pages stay resident and a large allocation may be served
from any of them, so the resident-set peak depends on what earlier code left in the heap
(it read 2.4 MB alone and up to 6.3 MB after the rest of a test file for the same call).
"""
import json
import os
import tempfile

from torch.profiler import ProfilerActivity, profile


def peak_extra_bytes(fn) -> int:
    fn()  # warm-up: one-off buffers (caches, lazily built tables) are not the op's working set
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(trace)
        with open(trace) as f:
            events = json.load(f)["traceEvents"]
    memory = [e for e in events if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0]
    if not memory:
        return 0
    # "Total Allocated" is the allocator's running count, taken under its lock, so its peak
    # needs no ordering; only the level before the call does: the earliest event's count
    # minus that event's own bytes
    first = min(memory, key=lambda e: float(e["ts"]))
    before = first["args"]["Total Allocated"] - first["args"]["Bytes"]
    return max(0, max(e["args"]["Total Allocated"] for e in memory) - before)
