"""bench/summarize.py: the op / reference table, with the staged kernels' column on a GPU run."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench(group, device, impl, mean):
    return {"group": group, "params": {"device": device, "impl": impl}, "extra_info": {"bytes": 4_000_000},
            "stats": {"mean": mean, "rounds": 10}}


def test_a_gpu_run_gets_the_staged_kernels_beside_the_verified_ones(tmp_path):
    group = "branch_verify cuda N=1 b=15 K=4 V=151936 bf16"
    data = {"datetime": "2027-01-01T00:00:00", "machine_info": {"torch": "2.11.0"}, "benchmarks": [
        bench(group, "cuda", "op", 1e-3), bench(group, "cuda", "reference", 5e-3),
        bench(group, "cuda-staged", "op", 2e-5), bench(group, "cuda-staged", "reference", 5e-3),
        bench("branch_verify cpu N=1", "cpu", "op", 4e-3), bench("branch_verify cpu N=1", "cpu", "reference", 8e-3)]}
    path = tmp_path / "b.json"
    path.write_text(json.dumps(data))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "summarize.py"), str(path), "--machine", "H200",
                          "--bandwidth", "4e12"], capture_output=True, text=True, check=True).stdout
    assert "| staged op mean (ms) | staged speed-up (op / staged) | staged HBM roofline |" in out
    assert f"| {group} | 1.000 | 5.000 | 5.0x | 10 | 0.1% | 0.020 | 50.0x | 5.0% |" in out
    assert "| branch_verify cpu N=1 | 4.000 | 8.000 | 2.0x | 10 | 0.0% | - | - | - |" in out
