"""foreign_load: the cores other processes keep busy while something is timed. The logic runs on
an injected clock and injected CPU counters, so no assertion depends on how busy this machine is
(bench/test_bench_foreign_load.py measures a real busy neighbour)."""
import pytest

import dblast_ext.foreign_load as foreign_load
from dblast_ext.eval.contention import CONTENTION_LIMIT, contention_warning, is_contended


class Clock:
    """Wall time, the machine's busy CPU seconds and this process's own, each advanced by hand."""

    def __init__(self):
        self.wall, self.busy, self.own = 100.0, 5000.0, 40.0

    def perf_counter(self):
        return self.wall

    def advance(self, wall, busy, own=0.0):
        self.wall, self.busy, self.own = self.wall + wall, self.busy + busy, self.own + own


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(foreign_load, "time", clock)  # the module's only use of `time` is perf_counter
    monkeypatch.setattr(foreign_load, "machine_busy_seconds", lambda: clock.busy)
    monkeypatch.setattr(foreign_load, "own_cpu_seconds", lambda: clock.own)
    return clock


def test_a_busy_neighbour_is_seen(clock):
    watch = foreign_load.Stopwatch()
    clock.advance(wall=2.0, busy=2.0)  # one core of another process's for 2 s, none of this one's
    wall, load = watch.stop()
    assert (wall, load) == (2.0, 1.0) and is_contended(load)


def test_the_load_is_the_machines_busy_time_less_this_processs_own(clock):
    watch = foreign_load.Stopwatch()
    clock.advance(wall=1.5, busy=3.0, own=1.0)
    assert watch.stop() == (1.5, pytest.approx(2.0 / 1.5))


def test_the_timed_process_own_work_is_not_counted(clock):
    watch = foreign_load.Stopwatch()
    clock.advance(wall=1.0, busy=1.0, own=1.0)  # one core of this process's own, nothing else
    assert watch.stop() == (1.0, 0.0) and not is_contended(0.0)
    watch = foreign_load.Stopwatch()
    clock.advance(wall=1.0, busy=0.99, own=1.0)  # the counters' tick rounding: clamped, not negative
    assert watch.stop()[1] == 0.0


def test_no_proc_stat_or_no_time_leaves_the_load_unknown(clock, monkeypatch):
    watch = foreign_load.Stopwatch()
    clock.advance(wall=0.0, busy=1.0)
    assert watch.stop() == (0.0, None)
    monkeypatch.setattr(foreign_load, "machine_busy_seconds", lambda: None)
    watch = foreign_load.Stopwatch()
    clock.advance(wall=1.0, busy=1.0)
    assert watch.stop() == (1.0, None)


def test_the_machines_busy_time_counts_only_this_processs_cores(tmp_path, monkeypatch):
    """/proc/stat's per-core lines, summed over the cores this process may run on (ticks of
    1 / SC_CLK_TCK s); without per-core lines, the total line."""
    stat = tmp_path / "stat"
    stat.write_text("cpu  30 0 30 900 0 0 0 0 0 0\n"
                    "cpu0 10 0 10 450 0 0 0 0 0 0\n"
                    "cpu1 20 1 20 450 7 2 3 4 0 0\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(stat if path == "/proc/stat" else path, *a, **k))
    monkeypatch.setattr(foreign_load, "_TICKS_PER_SECOND", 10)
    monkeypatch.setattr(foreign_load.os, "sched_getaffinity", lambda pid: {1}, raising=False)
    assert foreign_load.machine_busy_seconds() == pytest.approx((20 + 1 + 20 + 2 + 3 + 4) / 10)  # idle, iowait out
    stat.write_text("cpu  30 0 30 900 0 0 0 0 0 0\n")
    assert foreign_load.machine_busy_seconds() == pytest.approx(6.0)


def test_the_warning_names_the_worst_contended_run():
    assert contention_warning([None, 0.01, CONTENTION_LIMIT]) == ""
    assert contention_warning([]) == "" and contention_warning([None]) == ""
    warning = contention_warning([0.02, 1.37, None])
    assert "1.37 cores" in warning and "not this machine's alone" in warning


def test_timed_returns_the_call_result_with_its_wall_time(clock):
    def work(seconds, tag):
        clock.advance(wall=seconds, busy=0.5, own=0.2)
        return tag

    result, timing = foreign_load.timed(work, 0.2, tag="done")
    assert result == "done"
    assert timing.wall_time == pytest.approx(0.2) and timing.foreign_load == pytest.approx(0.3 / 0.2)
