"""foreign_load: the cores other processes keep busy while something is timed."""
import subprocess
import sys
import time

import pytest

from dblast_ext.eval.contention import CONTENTION_LIMIT, contention_warning, is_contended
from dblast_ext.foreign_load import Stopwatch, machine_busy_seconds, timed

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


def test_the_load_is_the_machines_busy_time_less_this_processs_own(monkeypatch):
    import dblast_ext.foreign_load as foreign_load
    busy, own = iter([100.0, 103.0]), iter([50.0, 51.0])  # 3 s busy in all, 1 s of it this process's
    monkeypatch.setattr(foreign_load, "machine_busy_seconds", lambda: next(busy))
    monkeypatch.setattr(foreign_load, "own_cpu_seconds", lambda: next(own))
    watch = foreign_load.Stopwatch()
    time.sleep(0.2)
    wall, load = watch.stop()
    assert load == pytest.approx(2.0 / wall)


def quiet_machine() -> bool:
    """No other process kept a quarter core busy over a short look (a real measurement of
    this process's own load needs the rest of the machine quiet)."""
    watch = Stopwatch()
    time.sleep(0.3)
    return watch.stop()[1] < 0.25


@needs_proc_stat
def test_the_timed_process_own_work_is_not_counted():
    if not quiet_machine():
        pytest.skip("other processes are busy: this process's own load cannot be told apart now")
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


def test_timed_returns_the_call_result_with_its_wall_time():
    result, timing = timed(lambda seconds, tag: (time.sleep(seconds), tag)[1], 0.2, tag="done")
    assert result == "done"
    assert 0.2 <= timing.wall_time < 5.0
    assert timing.foreign_load is None or timing.foreign_load >= 0.0
