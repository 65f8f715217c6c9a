"""recipes/smollm2/evaluate/collect.py on a made-up runs folder (real `dblast eval` report files written
from synthetic records): the targets come out met, not met or pending from what the finished
runs measured, the tau figure is drawn, the results README's tables are rewritten between their
markers with the text around them kept, and the top-level README gets its short table. Last,
on the repository's own finished runs: the committed results README and README's block are
exactly what collect.py writes from them."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from dblast_ext.cli.common import read_checkpoint_config
from dblast_ext.eval.report import write_report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLLECT = os.path.join(ROOT, "recipes", "smollm2", "evaluate", "collect.py")
CHECKPOINT = os.path.join(ROOT, "recipes", "smollm2", "evaluate", "checkpoint.py")
RESULTS = os.path.join(ROOT, "results", "smollm2")
DATASETS = ("gsm8k", "mtbench", "humaneval", "math500")
SECTIONS = ("targets", "acceptance", "speed", "per-dataset", "blocks", "oracle", "histograms", "determinism")


def write_run(folder, accepted_per_cycle, *, expected=None, speedup=None, **extra_settings):
    """A finished run: two prompts per dataset, every cycle accepting `accepted_per_cycle`
    drafts (expected accepted `expected`); with `speedup`, target-only timings that give it.
    Its settings: the temperature in the folder name (`<arm>-T<t>`; else 0.7), top-p 0.8 at 0.7,
    else 0.95, and `extra_settings`."""
    temperature = float(folder.name.rsplit("-T", 1)[1]) if "-T" in folder.name else 0.7
    settings = dict(temperature=temperature, top_p=0.8 if temperature == 0.7 else 0.95, top_k=20, **extra_settings)
    records = []
    for dataset in DATASETS:
        for prompt in range(2):
            accepted = [accepted_per_cycle] * 5
            record = dict(dataset=dataset, prompt_id=str(prompt), turn=0, accepted=accepted,
                          expected_accepted=[expected if expected is not None else accepted_per_cycle] * 5,
                          block_size=16, eos_terminated=True, new_tokens=1 + 5 * (accepted_per_cycle + 1),
                          wall_time=1.0, text="", settings=settings)
            if speedup is not None:  # same tokens, the target alone takes `speedup` times as long
                record.update(ar_wall_time=speedup, ar_new_tokens=record["new_tokens"])
            records.append(record)
    os.makedirs(folder)
    with open(os.path.join(folder, "records.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    write_report(str(folder), records, settings=settings)


def block(text, name):
    """What lies between the results README's markers of table `name`."""
    begin, end = f"<!-- smollm2-results:{name}:begin -->\n", f"\n<!-- smollm2-results:{name}:end -->"
    assert text.count(begin) == 1 and text.count(end) == 1, name
    return text.split(begin, 1)[1].split(end, 1)[0]


def results_readme(out):
    return (out / "README.md").read_text()


def targets(out):
    rows = [line for line in block(results_readme(out), "targets").splitlines()
            if line.startswith("| `dblast-k4`") or line.startswith("| its")]
    return [row.rstrip(" |").rsplit("| ", 1)[1] for row in rows]


def collect(runs, out, *extra):
    return subprocess.run([sys.executable, COLLECT, "--runs", str(runs), "--out", str(out), *map(str, extra)],
                          capture_output=True, text=True)


def run_collect(runs, out, *extra):
    result = collect(runs, out, *extra)
    assert result.returncode == 0, result.stderr


def test_targets_are_met_not_met_or_pending_from_the_finished_runs(tmp_path):
    pytest.importorskip("matplotlib")
    runs, out = tmp_path / "runs", tmp_path / "results"
    write_run(runs / "accept" / "dblast-k4-T0.7", 1)              # one branch: tau 2.0 < 2.5
    write_run(runs / "speed" / "dblast-k4-T0.7", 2, speedup=1.3,  # CPU defaults: tau 3.0 >= 2.5
              dtype="bfloat16", block_size=8, draft_vocab=8192, verify="tree", max_tree_nodes=10, extra_leaves=4)
    write_run(runs / "accept" / "dblast-k4-T1.0", 1, expected=0.9)
    write_run(runs / "accept" / "dflash-k1-T1.0", 1, expected=0.5)
    write_run(runs / "accept" / "dblast-k4-T1.5", 1, expected=0.9)  # no dflash-k1 run at 1.5 yet
    run_collect(runs, out)
    assert targets(out) == ["no", "yes", "yes", "pending"]
    text = results_readme(out)
    assert text.startswith("# Results: SmolLM2-135M-Instruct with the embedded drafters\n")
    # the paired comparison: both runs' macros on the shared prompts, the difference and its interval
    assert "| 2.00 [2.00, 2.00] |" in text and "0.90 vs 0.50: +0.400 [+0.400, +0.400]" in text
    speed = block(text, "speed")
    assert ("| 0.7 (top-p 0.8) | dblast-k4 | bfloat16, block 8, 8192 ids, trie 10 + 4 | 3.00 [3.00, 3.00] | 3.00 | "
            + "1.30x | " * 4 + "1.30x |") in speed
    # each temperature's filter as its runs recorded it, temperatures in numeric order
    table = block(text, "acceptance")
    assert table.startswith("![tau per dataset](tau.png)\n")
    rows = [line.split(" | ")[0] for line in table.splitlines() if line.startswith(("| 0", "| 1"))]
    assert rows == ["| 0.7 (top-p 0.8)", "| 1.0 (top-p 0.95)", "| 1.0 (top-p 0.95)", "| 1.5 (top-p 0.95)"]
    assert (out / "tau.png").read_bytes().startswith(b"\x89PNG")

    write_run(runs / "accept" / "dflash-k1-T1.5", 1, expected=0.95)  # the baseline is ahead at 1.5
    run_collect(runs, out)
    assert targets(out)[3] == "no"


def test_a_paired_interval_that_straddles_zero_is_not_a_win(tmp_path):
    """dblast-k4 ahead on average but not on every prompt: the paired interval decides."""
    runs, out = tmp_path / "runs", tmp_path / "results"
    write_run(runs / "accept" / "dblast-k4-T1.0", 1)
    write_run(runs / "accept" / "dflash-k1-T1.0", 1)
    k4 = runs / "accept" / "dblast-k4-T1.0" / "records.jsonl"
    records = [json.loads(line) for line in k4.read_text().splitlines()]
    for i, r in enumerate(records):  # per prompt +1.5 or -1.0 about the baseline's 1.0: mean +0.25 per dataset
        r["expected_accepted"] = [2.5 if i % 2 else 0.0] * len(r["accepted"])
    k4.write_text("".join(json.dumps(r) + "\n" for r in records))
    run_collect(runs, out)
    row = next(line for line in block(results_readme(out), "targets").splitlines() if "at T 1.0" in line)
    assert "1.25 vs 1.00: +0.250 [" in row and row.endswith("| no |")


def test_a_missing_runs_folder_is_named(tmp_path):
    result = subprocess.run([sys.executable, COLLECT, "--runs", str(tmp_path / "nowhere"), "--out",
                             str(tmp_path / "out")], capture_output=True, text=True)
    assert result.returncode == 2 and "--runs: no directory" in result.stderr
    assert not (tmp_path / "out").exists()


def test_readme_block_is_rewritten_between_its_markers(tmp_path):
    runs, out, readme = tmp_path / "runs", tmp_path / "results" / "smollm2", tmp_path / "README.md"
    write_run(runs / "accept" / "dblast-k4-T0.7", 1)
    write_run(runs / "speed" / "dblast-k4-T0.7", 1, speedup=0.6)
    readme.write_text("intro\n<!-- smollm2-results:begin -->\nold table\n<!-- smollm2-results:end -->\noutro\n")
    run_collect(runs, out, "--readme", readme)
    text = readme.read_text()
    assert text.startswith("intro\n<!-- smollm2-results:begin -->\n| temperature | drafter | tau on GSM8K")
    assert text.endswith("<!-- smollm2-results:end -->\noutro\n") and "old table" not in text
    assert "| 0.7 (top-p 0.8) | dblast-k4 | 2.00 [2.00, 2.00] | 2.00 | 0.60x | 0.60x |" in text
    assert "[results/smollm2/README.md](results/smollm2/README.md)" in text  # relative to the README
    assert "(the `speed` phase, 2 prompts per dataset)" in text

    readme.write_text("no markers\n")
    result = collect(runs, out, "--readme", readme)
    assert result.returncode == 2 and "--readme" in result.stderr and readme.read_text() == "no markers\n"


def test_the_results_readme_keeps_its_text_and_gets_missing_tables_appended(tmp_path):
    runs, out = tmp_path / "runs", tmp_path / "results"
    write_run(runs / "accept" / "dblast-k4-T0.7", 1)
    out.mkdir()
    written = ["# My results\n\nIntro.\n\n## Targets\n\n", "\n\nWhy they are not met.\n"]
    targets_markers = "<!-- smollm2-results:targets:begin -->\nold\n<!-- smollm2-results:targets:end -->"
    (out / "README.md").write_text(written[0] + targets_markers + written[1])
    run_collect(runs, out)
    text = results_readme(out)
    assert text.startswith(written[0] + "<!-- smollm2-results:targets:begin -->\n| target | measured | met? |")
    assert (written[1] + "\n## Acceptance (one branch per cycle, float32)\n\n"
            "<!-- smollm2-results:acceptance:begin -->") in text
    assert "old" not in text and [block(text, name) for name in SECTIONS]  # every table once
    assert targets(out) == ["no", "pending", "pending", "pending"]
    run_collect(runs, out)
    assert results_readme(out) == text  # a second run changes nothing

    broken = written[0] + targets_markers + targets_markers + written[1]  # markers twice
    (out / "README.md").write_text(broken)
    shutil.rmtree(out / "dblast-k4-T0.7")
    result = collect(runs, out)
    assert result.returncode == 2 and "smollm2-results:targets:begin" in result.stderr
    assert results_readme(out) == broken and not (out / "dblast-k4-T0.7").exists()  # nothing written


def test_block_runs_are_tabulated_with_their_draft_vocabulary(tmp_path):
    runs, out = tmp_path / "runs", tmp_path / "results"
    write_run(runs / "accept" / "dblast-k4-T0.7", 1)
    write_run(runs / "blocks" / "dblast-k4-B4-V8192", 1, speedup=1.1, draft_vocab=8192)
    write_run(runs / "blocks" / "dblast-k4-B4", 2, speedup=0.9)
    write_run(runs / "blocks" / "dblast-k4-B16", 2, speedup=0.7)
    run_collect(runs, out)
    table = block(results_readme(out), "blocks")
    rows = [line.split(" | ")[1:3] + [line.split(" | ")[5]] for line in table.splitlines() if line.startswith("| dblast")]
    assert rows == [["16", "all", "0.70x"], ["4", "all", "0.90x"], ["4", "8192", "1.10x"]]
    assert (out / "dblast-k4-B4-V8192" / "summary.json").exists()  # copied, so checkpoint.py can restore it


def test_histograms_are_linked_and_the_determinism_table_and_plot_are_shown(tmp_path):
    pytest.importorskip("matplotlib")
    runs, out = tmp_path / "runs", tmp_path / "results"
    write_run(runs / "accept" / "dblast-k4-T1.0", 1)
    run_collect(runs, out)
    text = results_readme(out)
    histograms = block(text, "histograms")
    links = [line.split("(", 1)[1].split(")", 1)[0] for line in histograms.splitlines()
             for line in line.split(" | ") if line.startswith("[png](")]
    assert links == [f"dblast-k4-T1.0/histogram_{d}.png" for d in DATASETS]
    assert all((out / link).read_bytes().startswith(b"\x89PNG") for link in links)
    assert "not run yet" in block(text, "determinism")

    (runs / "determinism").mkdir()
    table = "| early determinism | truncation points | mean expected accepted | standard error |\n| (0.0, 0.2] | 3 | 0.5 | 0.1 |"
    (runs / "determinism" / "determinism.md").write_text(table + "\n")
    (runs / "determinism" / "determinism.png").write_bytes(b"\x89PNG stand-in")
    run_collect(runs, out)
    section = block(results_readme(out), "determinism")
    assert section == "![accepted length by early determinism](determinism/determinism.png)\n\n" + table
    assert (out / "determinism" / "determinism.png").exists()


def test_a_calibrated_zt_at_the_top_of_its_grid_says_so(tmp_path):
    runs, out = tmp_path / "runs", tmp_path / "results"
    for t, best in (("0.7", 0.5), ("1.0", 1.0)):
        folder = runs / "accept" / f"dblast-k4-T{t}"
        write_run(folder, 1)
        (folder / "calibration").mkdir()
        (folder / "calibration" / "calibration.json").write_text(
            json.dumps({"grid": [0.0, 0.5, 1.0], "scores": [0.1, 0.3, 0.2 if best == 0.5 else 0.4], "best": best}))
    run_collect(runs, out)
    table = block(results_readme(out), "acceptance")
    cells = [line.split(" | ")[2] for line in table.splitlines() if "| dblast-k4 |" in line]
    assert cells == ["0.5", "1.0 (grid top)"]


def test_the_committed_results_are_what_collect_writes_from_the_committed_runs(tmp_path):
    """results/smollm2/README.md and README.md's results block, regenerated from the finished
    runs and the records kept in results/smollm2/ (checkpoint.py restores them as eval.sh would;
    the paired intervals need the records), come out byte for byte as committed: the figures in
    both are the runs', not copies edited by hand."""
    pytest.importorskip("matplotlib")
    runs, out, readme = tmp_path / "runs", tmp_path / "results" / "smollm2", tmp_path / "README.md"
    shutil.copytree(RESULTS, out)  # the plots the tables link to, and the records
    shutil.copyfile(os.path.join(ROOT, "README.md"), readme)
    oracle_block = read_checkpoint_config("dblast-k4", "dblast-k4").block_size  # as eval.sh passes it
    restore = subprocess.run([sys.executable, CHECKPOINT, "restore", "--runs", str(runs), "--results", str(out),
                              "--oracle-block", str(oracle_block)], capture_output=True, text=True)
    assert restore.returncode == 0, restore.stderr
    run_collect(runs, out, "--readme", readme)
    with open(os.path.join(RESULTS, "README.md")) as f:
        assert results_readme(out) == f.read()
    with open(os.path.join(ROOT, "README.md")) as f:
        assert readme.read_text() == f.read()
