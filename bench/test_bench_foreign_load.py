"""foreign_load.Stopwatch on the real machine: the load it reads while a child process spins one
core and this process sleeps (about 1 core on an otherwise quiet machine), and while this process
spins alone (about 0). The figures go to extra_info; whether they are near 1 and 0 depends on
what else runs, so nothing here asserts a window (python_tests/test_foreign_load.py tests the
logic on an injected clock)."""
import subprocess
import sys
import time

import pytest

from dblast_ext.foreign_load import Stopwatch, machine_busy_seconds

pytestmark = pytest.mark.skipif(machine_busy_seconds() is None, reason="no /proc/stat: the load is unknown here")

SPIN = "import time\nend = time.perf_counter() + {seconds}\nwhile time.perf_counter() < end:\n    pass\n"


def neighbour_load(seconds=1.0):
    child = subprocess.Popen([sys.executable, "-c", SPIN.format(seconds=seconds + 0.6)])
    try:
        time.sleep(0.3)  # the child is spinning by now
        watch = Stopwatch()
        time.sleep(seconds)
        return watch.stop()[1]
    finally:
        child.wait()


def own_load(seconds=1.0):
    watch = Stopwatch()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
    return watch.stop()[1]


def test_stopwatch_reads_a_busy_neighbour(benchmark):
    benchmark.group = "foreign_load.Stopwatch cpu"
    load = benchmark.pedantic(neighbour_load, rounds=1, iterations=1)
    benchmark.extra_info["foreign_load_cores"] = load  # about 1 on a quiet machine
    assert load is not None and load >= 0.0


def test_stopwatch_leaves_out_its_own_work(benchmark):
    benchmark.group = "foreign_load.Stopwatch cpu"
    load = benchmark.pedantic(own_load, rounds=1, iterations=1)
    benchmark.extra_info["foreign_load_cores"] = load  # about 0 on a quiet machine
    assert load is not None and load >= 0.0
