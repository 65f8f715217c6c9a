"""recipes/smollm2/train_drafters/choose_pilot.py: the pilot whose held-out agreements imply the longest greedy
accepted length wins, at its best checkpoint; within the tie margin the cheaper pilot (fewer
layers, then the smaller block) wins; bad names and missing logs are refused."""
import json
import os
import subprocess
import sys

import pytest

CHOOSER = os.path.join(os.path.dirname(__file__), "..", "recipes", "smollm2", "train_drafters", "choose_pilot.py")
sys.path.insert(0, os.path.dirname(CHOOSER))
from choose_pilot import estimated_tau  # noqa: E402


def pilot(folder, *agreements):
    """A pilot folder whose checkpoints logged these per-position agreements, in order."""
    folder.mkdir()
    with open(folder / "eval_log.jsonl", "w") as f:
        for step, agreement in enumerate(agreements, 1):
            f.write(json.dumps({"step": 100 * step, "loss": 50.0 - step, "accepted_proxy": 0.1,
                                "top1_agreement": agreement}) + "\n")
    return folder


def choose(tmp_path, **pilots):
    out = tmp_path / "choice.json"
    args = [a for name, folder in pilots.items() for a in ("--pilot", f"{name.replace('_', '-')}={folder}")]
    result = subprocess.run([sys.executable, CHOOSER, *args, "--out", str(out)], capture_output=True, text=True)
    return result, (json.loads(out.read_text()) if result.returncode == 0 else None)


def test_estimated_tau_is_the_sum_of_running_products():
    assert estimated_tau([0.5, 0.5, 1.0, 0.0, 1, 1, 1], 7) == pytest.approx(0.5 + 0.25 + 0.25)
    assert estimated_tau([1.0] * 15, 7) == 7          # only the positions every pilot has
    assert estimated_tau([0.9, None, 1.0], 3) == pytest.approx(0.9)   # a position without counts stops the walk


def test_the_longest_estimate_wins_at_its_best_checkpoint(tmp_path):
    result, choice = choose(tmp_path,
                            L2_B8=pilot(tmp_path / "a", [0.3] * 7, [0.4] * 7),
                            L2_B16=pilot(tmp_path / "b", [0.6] * 15, [0.2] * 15),   # best at its first checkpoint
                            L3_B8=pilot(tmp_path / "c", [0.5] * 7))
    assert result.returncode == 0, result.stderr
    assert (choice["layers"], choice["block"]) == (2, 16)
    assert choice["pilots"]["L2-B16"]["step"] == 100
    assert "| L2-B16 (chosen) | 100 |" in result.stdout


def test_a_cheaper_pilot_within_the_margin_wins(tmp_path):
    better = [0.5] * 7
    near = [0.4975] * 7      # its estimate is within 2% of the best
    result, choice = choose(tmp_path, L3_B8=pilot(tmp_path / "a", better), L2_B16=pilot(tmp_path / "b", near),
                            L2_B8=pilot(tmp_path / "c", [0.3] * 7))
    assert result.returncode == 0, result.stderr
    assert (choice["layers"], choice["block"]) == (2, 16)
    result, choice = choose(tmp_path, L3_B8=pilot(tmp_path / "d", better), L2_B16=pilot(tmp_path / "e", [0.45] * 7))
    assert (choice["layers"], choice["block"]) == (3, 8)   # 0.45 is outside the margin


def test_pilots_are_compared_on_the_positions_they_all_have(tmp_path):
    # block 4 has 3 draft positions: block 8's later positions do not count against it
    result, choice = choose(tmp_path, L2_B4=pilot(tmp_path / "a", [0.6] * 3), L2_B8=pilot(tmp_path / "b", [0.5] * 7))
    assert result.returncode == 0, result.stderr
    assert (choice["layers"], choice["block"], choice["positions"]) == (2, 4, 3)
    assert "positions 1-3" in result.stdout


def test_bad_pilot_names_and_missing_logs_are_refused(tmp_path):
    result, _ = choose(tmp_path, two_layers=pilot(tmp_path / "a", [0.5] * 7))
    assert result.returncode != 0 and "L<layers>-B<block>" in result.stderr
    (tmp_path / "empty").mkdir()
    result, _ = choose(tmp_path, L2_B8=tmp_path / "empty")
    assert result.returncode != 0 and "no eval_log.jsonl" in result.stderr
