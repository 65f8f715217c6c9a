"""recipes/smollm2/checkpoint.py: records saved into the repository come back on a new machine
(complete lines only), runs finished there come back as finished, and nothing newer is overwritten."""
import json
import os
import subprocess
import sys

CHECKPOINT = os.path.join(os.path.dirname(__file__), "..", "recipes", "smollm2", "checkpoint.py")


def checkpoint(*args):
    result = subprocess.run([sys.executable, CHECKPOINT, *map(str, args)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout


def lines(n, start=0):
    return "".join(json.dumps({"prompt_id": str(i), "accepted": [i % 3, 1]}) + "\n" for i in range(start, start + n))


def test_records_round_trip_through_the_repository_without_a_line_being_written(tmp_path):
    runs, results = tmp_path / "runs", tmp_path / "results"
    run = runs / "accept" / "dblast-k4-T1.0"
    (run / "calibration").mkdir(parents=True)
    (run / "records.jsonl").write_text(lines(5) + '{"prompt_id": "5", "acc')  # the 6th is being written
    (run / "calibration" / "zt_0.5.jsonl").write_text(lines(3))
    checkpoint("save", "--runs", runs, "--results", results)
    store = results / "records" / "accept" / "dblast-k4-T1.0"
    assert (store / "records.jsonl").read_text() == lines(5)
    assert (store / "calibration" / "zt_0.5.jsonl").read_text() == lines(3)

    fresh = tmp_path / "new-machine"
    checkpoint("restore", "--runs", fresh, "--results", results)
    assert (fresh / "accept" / "dblast-k4-T1.0" / "records.jsonl").read_text() == lines(5)
    assert (fresh / "accept" / "dblast-k4-T1.0" / "calibration" / "zt_0.5.jsonl").read_text() == lines(3)

    # a runs folder ahead of the repository keeps its lines; a save brings the repository up to it
    (fresh / "accept" / "dblast-k4-T1.0" / "records.jsonl").write_text(lines(8))
    checkpoint("restore", "--runs", fresh, "--results", results)
    assert (fresh / "accept" / "dblast-k4-T1.0" / "records.jsonl").read_text() == lines(8)
    assert "0 records files saved" not in checkpoint("save", "--runs", fresh, "--results", results)
    assert (store / "records.jsonl").read_text() == lines(8)


def test_runs_collected_before_come_back_finished(tmp_path):
    results, runs = tmp_path / "results", tmp_path / "runs"
    files = {"dblast-k4-T0.7/summary.json": "accept/dblast-k4-T0.7/summary.json",
             "dblast-k4-T0.7/calibration_calibration.json": "accept/dblast-k4-T0.7/calibration/calibration.json",
             "dflash-k1-T1.5-speed/summary.json": "speed/dflash-k1-T1.5/summary.json",
             "dblast-k4-B8/summary.json": "blocks/dblast-k4-B8/summary.json",
             "dflash-k1-B4-V8192/summary.json": "blocks/dflash-k1-B4-V8192/summary.json",
             "oracle-T1.0/oracle.json": "oracle/T1.0/oracle.json",
             "determinism/determinism.json": "determinism/determinism.json"}
    for i, src in enumerate(files):
        (results / src).parent.mkdir(parents=True, exist_ok=True)
        (results / src).write_text(json.dumps({"which": i}))
    (results / "dblast-k4-T0.7" / "report.md").write_text("a report is not a finishing file")
    (runs / "accept" / "dflash-k1-T1.5").mkdir(parents=True)
    checkpoint("restore", "--runs", runs, "--results", results)
    for i, dst in enumerate(files.values()):
        assert json.loads((runs / dst).read_text()) == {"which": i}, dst
    restored = sorted(str(p.relative_to(runs)) for p in runs.rglob("*") if p.is_file())
    assert restored == sorted(files.values())

    # a finishing file already there is kept
    (runs / "oracle" / "T1.0" / "oracle.json").write_text('{"which": "newer"}')
    checkpoint("restore", "--runs", runs, "--results", results)
    assert json.loads((runs / "oracle" / "T1.0" / "oracle.json").read_text()) == {"which": "newer"}


def test_save_commits_only_the_records_folder(tmp_path):
    repo = tmp_path / "repo"
    runs = tmp_path / "runs"
    (runs / "oracle" / "T1.0").mkdir(parents=True)
    (runs / "oracle" / "T1.0" / "records.jsonl").write_text(lines(4))
    git = ["git", "-C", str(repo)]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(git + ["config", "user.email", "ci@example.com"], check=True)
    subprocess.run(git + ["config", "user.name", "ci"], check=True)
    (repo / "other.txt").write_text("staged, not the checkpoint's business")
    subprocess.run(git + ["add", "other.txt"], check=True)
    out = checkpoint("save", "--runs", runs, "--results", repo / "results", "--commit")
    assert "4 records saved" in out
    committed = subprocess.run(git + ["show", "--name-only", "--format=", "HEAD"], capture_output=True,
                               text=True, check=True).stdout.split()
    assert committed == ["results/records/oracle/T1.0/records.jsonl"]
    staged = subprocess.run(git + ["diff", "--cached", "--name-only"], capture_output=True, text=True).stdout.split()
    assert staged == ["other.txt"]
