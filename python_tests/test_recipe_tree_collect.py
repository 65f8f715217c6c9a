"""recipes/smollm2/evaluate/tree_collect.py on a made-up runs folder: tokens per pass of each rule, the
gain, the same-context column from the tree runs' branch-rule figures, the drafter digest the
records carry, and the speed table from the timed runs."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLLECT = os.path.join(ROOT, "recipes", "smollm2", "evaluate", "tree_collect.py")


def write_records(folder, accepted, *, expected, branch_rule=None, nodes=None, ar_wall_time=None, settings=None):
    """Three prompts per dataset, five cycles each accepting `accepted` drafts."""
    os.makedirs(folder)
    with open(os.path.join(folder, "records.jsonl"), "w") as f:
        for dataset in ("gsm8k", "mtbench"):
            for prompt in range(3):
                record = dict(dataset=dataset, prompt_id=str(prompt), turn=0, accepted=[accepted] * 5,
                              expected_accepted=[expected] * 5, block_size=8, eos_terminated=False,
                              new_tokens=1 + 5 * (accepted + 1), wall_time=2.0, text="",
                              settings={"drafter_digest": "abc123", "temperature": 1.0, **(settings or {})})
                if branch_rule is not None:
                    record["branch_rule_expected"] = [branch_rule] * 5
                if nodes is not None:
                    record["tree_nodes"] = [nodes] * 5
                if ar_wall_time is not None:
                    record["ar_wall_time"], record["ar_new_tokens"] = ar_wall_time, record["new_tokens"]
                f.write(json.dumps(record) + "\n")


@pytest.fixture
def collected(tmp_path):
    runs = tmp_path / "runs"
    for t in ("0.7", "1.0", "1.5"):
        write_records(runs / f"branch-T{t}", 1, expected=0.8)
        write_records(runs / f"tree-T{t}", 2, expected=1.5, branch_rule=1.0, nodes=20,
                      settings={"verify": "tree", "extra_leaves": 4})
    write_records(runs / "speed-branch-B8-T1.0", 1, expected=0.8, ar_wall_time=3.0)
    write_records(runs / "speed-tree-B8-T1.0", 2, expected=1.5, nodes=20, ar_wall_time=5.0)
    out = tmp_path / "out"
    subprocess.run([sys.executable, COLLECT, "--runs", str(runs), "--out", str(out), "--machine", "test machine"],
                   check=True, capture_output=True, text=True, cwd=ROOT)
    return out


def test_the_table_gives_each_rules_tokens_per_pass_and_the_same_context_figures(collected):
    summary = json.loads((collected / "summary.json").read_text())
    assert summary["drafter_digests"] == ["abc123"]
    rows = summary["acceptance"]
    assert len(rows) == 6
    for row in rows:  # 1 + accepted per cycle; the gain 3 / 2
        assert row["branch_tau"] == pytest.approx(2.0) and row["tree_tau"] == pytest.approx(3.0)
        assert row["gain"] == pytest.approx(0.5) and row["prompts"] == 3
        assert row["same_context"] == pytest.approx([1.0, 1.5]) and row["nodes"] == pytest.approx(20)
    text = (collected / "README.md").read_text()
    assert "| 1.0 | gsm8k | 3 | 2.000 [2.00, 2.00] | 3.000 [3.00, 3.00] | +50.0% |" in text
    assert "| 1.000 -> 1.500 (+50%) | 20.0 |" in text and "digest abc123" in text
    assert "test machine; float32 target" in text  # dblast eval's default dtype: the settings name no other
    assert "Extra leaves per trie: 4." in text and summary["extra_leaves"] == ["4"]
    assert len(os.listdir(collected / "records")) == 8


def test_the_speed_table_gives_the_speedup_over_the_target_alone(collected):
    speed = {r["verify"]: r for r in json.loads((collected / "summary.json").read_text())["speed"]}
    assert sorted(speed) == ["branch", "tree"]  # the runs not made are left out
    assert speed["branch"]["speedup"] == pytest.approx(1.5) and speed["tree"]["speedup"] == pytest.approx(2.5)
    assert speed["tree"]["per_pass"] == pytest.approx(3.0) and speed["branch"]["seconds_per_pass"] == pytest.approx(0.4)
