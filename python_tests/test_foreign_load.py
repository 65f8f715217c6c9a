"""foreign_load: the cores other processes keep busy while something is timed."""
import subprocess
import sys
import time

import pytest

from dblast_ext.foreign_load import CONTENTION_LIMIT, Stopwatch, contention_warning, is_contended, machine_busy_seconds

needs_proc_stat = pytest.mark.skipif(machine_busy_seconds() is None, reason="no /proc/stat: the load is unknown here")

SPIN = "import time\nend = time.perf_counter() + {seconds}\nwhile time.perf_counter() < end:\n    pass\n"


@needs_proc_stat
def test_a_busy_neighbour_is_seen():
    child = subprocess.Popen([sys.executable, "-c", SPIN.format(seconds=1.6)])
    try:
        time.sleep(0.3)  # the child is spinning by now
        watch = Stopwatch()
        time.sleep(1.0)  # this process idles while the child keeps one core busy
        wall, load = watch.stop()
    finally:
        child.wait()
    assert wall >= 1.0
    assert 0.6 < load < 2.5 and is_contended(load)  # about 1 core


@needs_proc_stat
def test_the_timed_process_own_work_is_not_counted():
    watch = Stopwatch()
    end = time.perf_counter() + 1.0
    while time.perf_counter() < end:  # one core of this process's own
        pass
    _, load = watch.stop()
    assert 0.0 <= load < 0.5


def test_the_warning_names_the_worst_contended_run():
    assert contention_warning([None, 0.01, CONTENTION_LIMIT]) == ""
    assert contention_warning([]) == "" and contention_warning([None]) == ""
    warning = contention_warning([0.02, 1.37, None])
    assert "1.37 cores" in warning and "not this machine's alone" in warning
