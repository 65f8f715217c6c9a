"""bench/gpu_cycle.py (the device check's decode-cycle figures) in its dry-run mode: a tiny
random pair on the CPU, so the script a lent GPU runs cannot rot between device runs."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_dry_run_writes_the_figures(tmp_path):
    out = tmp_path / "figures"
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_cycle.py"), "--tiny", "--device", "cpu",
                    "--out", str(out), "--prompt-len", "24", "--new-tokens", "6", "--batches", "1,3",
                    "--batch-new-tokens", "4", "--repeats", "1", "--part-repeats", "2"],
                   check=True, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    figures = json.loads((out / "gpu_cycle.json").read_text())
    assert set(figures["cycles"]) == {"K=1", "K=4", "K=4 static"}
    for row in figures["cycles"].values():
        assert row["cycles"] >= 1 and row["cycle_ms"] > 0 and 0 < row["draft_ms"] < row["cycle_ms"]
    assert figures["target_forward_ms"] > 0
    assert figures["k4_overhead"] == pytest.approx(figures["cycles"]["K=4"]["cycle_ms"]
                                                   / figures["cycles"]["K=1"]["cycle_ms"] - 1)
    parts = figures["cycle_parts"]
    assert set(parts) == {"K=1", "K=4"} and all(v > 0 for row in parts.values() for v in row.values())
    assert figures["k4_parts_overhead"] == pytest.approx(
        (parts["K=4"]["total_ms"] - parts["K=1"]["total_ms"]) / figures["cycles"]["K=1"]["cycle_ms"])
    # every prompt of every batch gets its tokens, from both loops
    for size, row in figures["batches"].items():
        runs = ("speculative", "speculative, static cache", "target alone", "target alone, static cache")
        assert [row[run]["tokens"] for run in runs] == [4 * int(size)] * len(runs)
    assert all(len(row["tokens"]) == 6 for row in figures["cycles"].values())
    # the CUDA-graph rows need CUDA: marked n/a on a CPU, absent from the batches
    assert figures["graphs"] == "n/a (no CUDA)"
    assert not any("graphs_ratio" in row for row in figures["batches"].values())
    table = (out / "gpu_cycle.md").read_text()
    assert "| K = 4 overhead over K = 1 |" in table and "| 3 |" in table
    assert "| CUDA graphs | n/a (no CUDA) |" in table
