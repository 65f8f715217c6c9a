"""recipes/smollm2/evaluate/dflash2_results.py on synthetic runs: the DFlash2 candidate's acceptance
against the embedded drafters' kept records, paired on the prompts both cover, with the verdict
per temperature; its runs copied into results/smollm2/dflash2/; the README's text kept."""
import os
import subprocess
import sys

import pytest

from test_recipe_collect import ROOT, block, write_run

SCRIPT = os.path.join(ROOT, "recipes", "smollm2", "evaluate", "dflash2_results.py")


def run(runs, results):
    result = subprocess.run([sys.executable, SCRIPT, "--runs", str(runs), "--results", str(results)],
                            capture_output=True, text=True, cwd=str(runs.parent))
    assert result.returncode == 0, result.stderr
    return (results / "README.md").read_text()


@pytest.fixture
def results(tmp_path):
    out = tmp_path / "results"
    for t in ("0", "0.7", "1.0", "1.5"):
        write_run(out / "records" / "accept" / f"dflash-k1-T{t}", 1)
        write_run(out / "records" / "accept" / f"dblast-k4-T{t}", 2)
    (out / "README.md").write_text("# Results\n\nText written by people.\n")
    return out


def test_the_selector_against_the_branches_per_temperature(tmp_path, results):
    runs = tmp_path / "runs"
    write_run(runs / "accept" / "dflash2-T0.7", 3)     # commits more than both
    write_run(runs / "accept" / "dflash2-T1.0", 0)     # fewer than both
    write_run(runs / "speed" / "dflash2-tree-T1.0", 1, speedup=1.5)
    text = run(runs, results)
    assert text.startswith("# Results\n\nText written by people.\n")
    table = block(text, "dflash2")
    assert "- T 0.7: DFlash2's selector commits more per target pass (DFlash2 4.00, dblast-k4 3.00)." in table
    assert "- T 1.0: DBLast's branches (dblast-k4) commits more per target pass (DFlash2 1.00, dblast-k4 3.00)." in table
    acceptance, speed = (part.splitlines() for part in table.split("Speed-up", 1))
    rows = {line.split(" | ")[0]: line for line in acceptance if line.startswith("| ")}
    assert "pending" in rows["| 0"] and "pending" in rows["| 1.5"]
    assert "+2.000 [+2.000, +2.000]" in rows["| 0.7"] and "+1.000 [+1.000, +1.000]" in rows["| 0.7"]
    speed_row = next(line for line in speed if line.startswith("| 1.0 |"))
    assert speed_row.split(" | ")[2] == "1.50x (tau 2.00)"   # the trie's column
    for name in ("dflash2-T0.7", "dflash2-T1.0", "dflash2-tree-T1.0-speed"):
        assert (results / "dflash2" / name / "records.jsonl").is_file()
    assert block(run(runs, results), "dflash2") == table   # a rerun rewrites the same block in place


def test_a_candidate_on_fewer_prompts_is_compared_on_the_shared_ones(tmp_path, results):
    runs = tmp_path / "runs"
    write_run(runs / "accept" / "dflash2-T0", 1)
    records = (runs / "accept" / "dflash2-T0" / "records.jsonl").read_text().splitlines(keepends=True)
    (runs / "accept" / "dflash2-T0" / "records.jsonl").write_text("".join(records[::2]))  # prompt 0 only
    row = next(line for line in block(run(runs, results), "dflash2").splitlines() if line.startswith("| 0 |"))
    assert row.rstrip(" |").endswith("| 4")  # 4 datasets x 1 shared prompt
