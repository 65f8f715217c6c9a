"""recipes/smollm2/evaluate/checkpoint.py: records saved into the repository come back on a new machine
(complete lines only), runs finished there come back as finished, and nothing newer is overwritten."""
import json
import os
import subprocess
import sys

CHECKPOINT = os.path.join(os.path.dirname(__file__), "..", "recipes", "smollm2", "evaluate", "checkpoint.py")


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


# --- records of another drafter -------------------------------------------------------------
def drafter_dir(path, seed=0):
    from tiny_models import write_dflash_checkpoint

    return write_dflash_checkpoint(str(path), seed=seed)


def test_the_digest_follows_what_the_drafter_computes_not_the_file_bytes(tmp_path):
    from safetensors.torch import load_file, save_file

    from dblast_ext.drafting.drafter_io import checkpoint_digest

    path = drafter_dir(tmp_path / "d")
    before = checkpoint_digest(path)
    config_file = os.path.join(path, "config.json")
    config = json.load(open(config_file))
    json.dump(dict(config, architectures=["DFlashDraftModel"], note="for a server"), open(config_file, "w"), indent=4)
    assert checkpoint_digest(path) == before          # fields the loader does not read
    json.dump(dict(config, block_size=config["block_size"] * 2), open(config_file, "w"))
    assert checkpoint_digest(path) != before          # a field that changes what it computes
    json.dump(config, open(config_file, "w"))
    assert checkpoint_digest(path) == before
    json.dump(dict(config, input_embedding_scale=1.0), open(config_file, "w"))
    assert checkpoint_digest(path) == before          # an optional field at its default counts as absent
    json.dump(dict(config, input_embedding_scale=2.0), open(config_file, "w"))
    assert checkpoint_digest(path) != before
    json.dump(config, open(config_file, "w"))
    weights = os.path.join(path, "model.safetensors")
    state = load_file(weights)
    name = sorted(state)[0]
    state[name] = state[name].clone()
    state[name].view(-1)[0] += 1e-3
    save_file(state, weights)
    assert checkpoint_digest(path) != before          # one weight


def run_records(drafter, digest, n=3):
    settings = {"drafter": drafter, "drafter_digest": digest, "temperature": 1.0}
    return "".join(json.dumps({"prompt_id": str(i), "accepted": [1], "settings": settings}) + "\n" for i in range(n))


def test_restore_leaves_out_what_another_drafter_made(tmp_path):
    from dblast_ext.drafting.drafter_io import checkpoint_digest

    drafter = drafter_dir(tmp_path / "drafter")
    now, old = checkpoint_digest(drafter), "0123456789abcdef"
    results = tmp_path / "results"
    store = results / "records" / "accept"
    for run, digest in (("mine-T1.0", now), ("old-T1.0", old), ("plain-T1.0", None)):
        (store / run).mkdir(parents=True)
        text = run_records(drafter, digest) if digest else lines(3)
        (store / run / "records.jsonl").write_text(text)
        (results / run).mkdir()
        (results / run / "summary.json").write_text(json.dumps({"settings": {"drafter": drafter, "drafter_digest": digest}
                                                                if digest else {}}))
    # calibration: its own file has no digest, the summary collect.py kept beside it has the old one
    (results / "old-T1.0" / "calibration_calibration.json").write_text(json.dumps({"best": 0.5}))
    # a finished run whose kept files carry no digest, but whose kept records show the old drafter
    (results / "kept-T1.0").mkdir()
    (results / "kept-T1.0" / "summary.json").write_text(json.dumps({"settings": {"temperature": 1.0}}))
    (store / "kept-T1.0").mkdir()
    (store / "kept-T1.0" / "records.jsonl").write_text(run_records(drafter, old))
    out = checkpoint("restore", "--runs", tmp_path / "runs", "--results", results)
    runs = tmp_path / "runs" / "accept"
    assert not (runs / "kept-T1.0").exists()
    assert "not restored accept/kept-T1.0/summary.json (a finished run)" in out
    assert (runs / "mine-T1.0" / "records.jsonl").read_text() == run_records(drafter, now)
    assert (runs / "mine-T1.0" / "summary.json").exists()
    assert (runs / "plain-T1.0" / "records.jsonl").read_text() == lines(3)   # no digest: kept as it was
    assert not (runs / "old-T1.0").exists()
    assert f"made by {drafter} {old}, which is now {now}" in out
    assert "not restored accept/old-T1.0/calibration/calibration.json (a finished run)" in out


def test_restore_leaves_out_the_oracle_made_at_another_block(tmp_path):
    results, runs = tmp_path / "results", tmp_path / "runs"
    for t, block in (("0.7", 16), ("1.0", 8)):  # a finished oracle run at each block
        (results / f"oracle-T{t}").mkdir(parents=True)
        (results / f"oracle-T{t}" / "oracle.json").write_text(json.dumps({"settings": {"oracle": "top token",
                                                                                "block_size": block}}))
    store = results / "records" / "oracle" / "T1.5"  # kept records of an unfinished one at block 16
    store.mkdir(parents=True)
    (store / "records.jsonl").write_text(json.dumps({"prompt_id": "0", "settings": {"oracle": "top token",
                                                                                 "block_size": 16}}) + "\n")
    arm = results / "records" / "blocks" / "dflash-k1-B16"  # a drafter's run at block 16 is not the oracle's
    arm.mkdir(parents=True)
    (arm / "records.jsonl").write_text(json.dumps({"prompt_id": "0", "settings": {"block_size": 16}}) + "\n")

    out = checkpoint("restore", "--runs", runs, "--results", results, "--oracle-block", 8)
    assert (runs / "blocks" / "dflash-k1-B16" / "records.jsonl").exists()
    assert not (runs / "oracle" / "T0.7" / "oracle.json").exists()
    assert "the oracle at block 16, which now runs at block 8" in out
    assert (runs / "oracle" / "T1.0" / "oracle.json").exists()
    assert not (runs / "oracle" / "T1.5" / "records.jsonl").exists()

    # without --oracle-block every oracle run comes back, as before
    checkpoint("restore", "--runs", tmp_path / "other", "--results", results)
    assert (tmp_path / "other" / "oracle" / "T0.7" / "oracle.json").exists()
    assert (tmp_path / "other" / "oracle" / "T1.5" / "records.jsonl").exists()


def test_save_replaces_a_longer_copy_that_another_drafter_made(tmp_path):
    """A retrained drafter's run starts again at the old run's path: its first save replaces the
    old drafter's records even while they are the longer file, and then grows as usual."""
    runs, results = tmp_path / "runs", tmp_path / "results"
    store = results / "records" / "accept" / "dflash-k1-T1.0"
    store.mkdir(parents=True)
    old = "".join(json.dumps({"prompt_id": str(i), "settings": {"drafter_digest": "old"}}) + "\n" for i in range(9))
    (store / "records.jsonl").write_text(old)
    run = runs / "accept" / "dflash-k1-T1.0"
    run.mkdir(parents=True)
    new = "".join(json.dumps({"prompt_id": str(i), "settings": {"drafter_digest": "new"}}) + "\n" for i in range(3))
    (run / "records.jsonl").write_text(new)
    checkpoint("save", "--runs", runs, "--results", results)
    assert (store / "records.jsonl").read_text() == new
    assert "0 records files saved" in checkpoint("save", "--runs", runs, "--results", results)  # nothing new
