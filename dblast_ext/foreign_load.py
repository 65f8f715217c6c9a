"""How much CPU other processes used while something was timed.

A speed-up measured on a shared machine is only as good as the cores the run had to itself:
on a 2-core CPU one stray process can slow a timed response several times over (PyTorch's
worker threads wait on each other when one is descheduled). `Stopwatch` measures a region's
wall time together with the cores the rest of the machine kept busy meanwhile: the machine's
busy time from /proc/stat (Linux; the cores this process may run on) minus this process's own
CPU time, over the wall time. Elsewhere the load is unknown (None). On a host shared through CPU
quotas rather than pinned cores it counts the other tenants on those cores too.

Timing stays outside the decode loop's outputs: callers that compare speeds wrap the call,
`output, timing = timed(decoder.generate, ids, ...)`. Whether a load is too high to trust a
timing is the evaluation's rule (`eval.contention`)."""
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional, Tuple, TypeVar

_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _busy_ticks(fields) -> int:
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    return user + nice + system + irq + softirq + steal  # guest time is already in user


def machine_busy_seconds() -> Optional[float]:
    """CPU seconds all processes spent so far on the cores this process may run on, summed over
    those cores (None without /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            lines = [line.split() for line in f if line.startswith("cpu")]
    except OSError:
        return None
    per_core = {int(fields[0][3:]): fields for fields in lines if fields[0] != "cpu" and len(fields) >= 9}
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(per_core)
    if per_core and allowed <= set(per_core):
        # only the cores this process may use: load pinned elsewhere does not slow it
        return sum(_busy_ticks(per_core[core]) for core in allowed) / _TICKS_PER_SECOND
    total = [fields for fields in lines if fields[0] == "cpu" and len(fields) >= 9]
    return _busy_ticks(total[0]) / _TICKS_PER_SECOND if total else None


def own_cpu_seconds() -> float:
    """CPU seconds of this process so far, all its threads."""
    t = os.times()
    return t.user + t.system


class Stopwatch:
    """Started when made; `stop()` returns (wall seconds, cores other processes kept busy on
    average meanwhile, or None where unknown)."""

    def __init__(self):
        self._busy, self._own, self._start = machine_busy_seconds(), own_cpu_seconds(), time.perf_counter()

    def stop(self) -> Tuple[float, Optional[float]]:
        wall = time.perf_counter() - self._start
        busy, own = machine_busy_seconds(), own_cpu_seconds()
        if self._busy is None or busy is None or wall <= 0:
            return wall, None
        # both counters tick at 1 / _TICKS_PER_SECOND: clamp the rounding below zero away
        return wall, max(0.0, ((busy - self._busy) - (own - self._own)) / wall)


@dataclass
class Timing:
    wall_time: float                # seconds
    foreign_load: Optional[float]   # cores other processes kept busy on average (None: unknown)


T = TypeVar("T")


def timed(fn: Callable[..., T], *args, **kwargs) -> Tuple[T, Timing]:
    """fn(*args, **kwargs) and how long it took, with the foreign load meanwhile."""
    watch = Stopwatch()
    result = fn(*args, **kwargs)
    return result, Timing(*watch.stop())
