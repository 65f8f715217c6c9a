"""`dblast eval | compare | calibrate | diagnose` end to end on a tiny random target (local
model directory with tokenizer and chat template) and a DFlash-format drafter."""
import json

import pytest

pytest.importorskip("transformers")

from dblast_ext.cli import main  # noqa: E402
from dblast_ext.decoding.decoder import TREE_EXTRA_LEAVES  # noqa: E402
from dblast_ext.eval.metrics import summarize  # noqa: E402
from dblast_ext.eval.records import read_records  # noqa: E402
from tiny_models import write_dflash_checkpoint, write_tiny_target_dir  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    target = write_tiny_target_dir(root / "target")
    drafter = write_dflash_checkpoint(root / "drafter", block_size=6)
    files = {}
    for name, lines in {
        "alpha": [{"prompt": "t5 t6 t7 t8"}, {"prompt": "t9 t10"}, {"prompt": "t11 t12 t13"}, {"prompt": "t3"}],
        "beta": [{"id": "q1", "messages": [{"role": "user", "content": "t20 t21"}]},
                 {"id": "q2", "messages": [{"role": "user", "content": "t22"},
                                           {"role": "assistant", "content": "t23"},
                                           {"role": "user", "content": "t24 t25"}]},
                 {"id": "q3", "prompt": "t30 t31 t32"}],
    }.items():
        path = root / f"{name}.jsonl"
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        files[name] = str(path)
    return root, target, drafter, files


def model_args(setup, *extra):
    _, target, drafter, files = setup
    return ["--target", target, "--drafter", drafter, "--datasets", f"{files['alpha']},{files['beta']}",
            "--max-new-tokens", "12", "--no-progress", *extra]


def run_eval(setup, out, *extra):
    assert main(["eval", *model_args(setup, "--out", str(out), *extra)]) == 0


def test_eval_writes_records_summary_report_and_plots(setup, capsys):
    out = setup[0] / "run"
    run_eval(setup, out, "--branches", "4", "--measure-speedup", "--all-responses", "--top-k", "20")
    records = read_records(str(out / "records.jsonl"))
    assert len(records) == 4 + 4  # beta's q2 has two user turns
    assert sorted(r["turn"] for r in records if r["prompt_id"] == "q2") == [0, 1]
    for r in records:
        assert len(r["accepted"]) == len(r["expected_accepted"]) and r["block_size"] == 6
        assert r["new_tokens"] <= 12 and r["ar_wall_time"] > 0 and r["settings"]["branches"] == 4
    summary = json.loads((out / "summary.json").read_text())
    for name in ("alpha", "beta"):
        again = summarize([r for r in records if r["dataset"] == name], eos_only=False)
        assert summary["datasets"][name]["tau"] == pytest.approx(again["tau"])
        assert summary["datasets"][name]["histogram"] == again["histogram"]
        assert summary["datasets"][name]["speedup"] > 0
        assert (out / f"histogram_{name}.png").read_bytes().startswith(PNG)
    assert (out / "committed_length.png").read_bytes().startswith(PNG)
    report = (out / "report.md").read_text()
    assert "| alpha |" in report and "| beta |" in report and "**macro-average**" in report
    assert "(ceiling)" in report and "every response" in report
    assert "macro" in capsys.readouterr().out


def test_tree_eval_records_the_nodes_and_the_branch_rules_same_context_figure(setup):
    """Trie verification's records: the nodes of each pass, the extra leaves in the settings and,
    without a node budget, the branch rule's expected accepted drafts on the same proposals, never
    above the trie's own (extra leaves only add to the trie's)."""
    run_eval(setup, setup[0] / "tree", "--branches", "4", "--verify", "tree", "--temperature", "1.0")
    for r in read_records(str(setup[0] / "tree" / "records.jsonl")):
        assert r["settings"]["verify"] == "tree" and r["settings"]["extra_leaves"] == TREE_EXTRA_LEAVES
        assert len(r.get("tree_nodes", [])) == len(r.get("branch_rule_expected", [])) == len(r["expected_accepted"])
        assert all(b <= e + 1e-5 for b, e in zip(r["branch_rule_expected"], r["expected_accepted"]))
    run_eval(setup, setup[0] / "tree-cut", "--branches", "4", "--verify", "tree", "--max-tree-nodes", "3",
             "--extra-leaves", "0")
    for r in read_records(str(setup[0] / "tree-cut" / "records.jsonl")):
        assert max(r["tree_nodes"]) <= 3 and "branch_rule_expected" not in r
        assert "extra_leaves" not in r["settings"]


def test_eval_is_reproducible_and_resumes_where_it_stopped(setup):
    first, second = setup[0] / "repro-a", setup[0] / "repro-b"
    run_eval(setup, first)
    run_eval(setup, second)
    key = lambda r: (r["dataset"], r["prompt_id"], r["turn"], r["accepted"], r["text"])  # noqa: E731
    full = [key(r) for r in read_records(str(first / "records.jsonl"))]
    assert full == [key(r) for r in read_records(str(second / "records.jsonl"))]
    # a run killed after three responses, resumed
    lines = (first / "records.jsonl").read_text().splitlines(keepends=True)
    (second / "records.jsonl").write_text("".join(lines[:3]))
    run_eval(setup, second)
    assert [key(r) for r in read_records(str(second / "records.jsonl"))] == full
    # a line cut short by the kill is named
    (second / "records.jsonl").write_text("".join(lines[:3]) + lines[3][:20])
    assert main(["eval", *model_args(setup, "--out", str(second))]) == 2


def test_eval_refuses_to_mix_settings_in_one_directory(setup, capsys):
    out = setup[0] / "mixed"
    run_eval(setup, out)
    capsys.readouterr()
    assert main(["eval", *model_args(setup, "--out", str(out), "--temperature", "0.5")]) == 2
    assert "other settings" in capsys.readouterr().err
    # another target dtype: other timings and numerics, not pooled with the float32 records
    assert main(["eval", *model_args(setup, "--out", str(out), "--dtype", "bfloat16")]) == 2
    assert "'dtype': 'bfloat16'" in capsys.readouterr().err
    # the float32 run itself resumes: its records name no dtype, as those of earlier versions
    assert main(["eval", *model_args(setup, "--out", str(out), "--dtype", "float32")]) == 0
    assert "dtype" not in read_records(str(out / "records.jsonl"))[0]["settings"]


def test_eval_refuses_records_of_a_retrained_drafter(setup, capsys):
    root, target, _, files = setup
    drafter = write_dflash_checkpoint(root / "retrained", block_size=6, seed=1)
    args = ["eval", "--target", target, "--drafter", drafter, "--datasets", files["alpha"], "--max-new-tokens", "6",
            "--no-progress", "--out", str(root / "retrained-run")]
    assert main(args) == 0
    write_dflash_checkpoint(root / "retrained", block_size=6, seed=2)  # same path and name, new weights
    capsys.readouterr()
    assert main(args) == 2
    assert "other settings" in capsys.readouterr().err


def test_batched_eval_gives_every_response_it_gets_alone_and_resumes(setup, capsys):
    key = lambda r: (r["dataset"], r["prompt_id"], r["turn"], r["accepted"], r["text"])  # noqa: E731
    alone, batched = setup[0] / "greedy-alone", setup[0] / "greedy-batched"
    run_eval(setup, alone, "--temperature", "0", "--branches", "2")
    run_eval(setup, batched, "--temperature", "0", "--branches", "2", "--batch-size", "3")
    want = sorted(key(r) for r in read_records(str(alone / "records.jsonl")))
    records = read_records(str(batched / "records.jsonl"))
    assert sorted(key(r) for r in records) == want  # q2's second turn saw its own first answer
    assert all(r["settings"]["batch_size"] == 3 and r["wall_time"] > 0 for r in records)
    assert "batch_size" not in read_records(str(alone / "records.jsonl"))[0]["settings"]
    # killed after four responses, resumed in batches again
    lines = (batched / "records.jsonl").read_text().splitlines(keepends=True)
    (batched / "records.jsonl").write_text("".join(lines[:4]))
    run_eval(setup, batched, "--temperature", "0", "--branches", "2", "--batch-size", "3")
    assert sorted(key(r) for r in read_records(str(batched / "records.jsonl"))) == want
    # batched records are not pooled with records made one response at a time
    capsys.readouterr()
    assert main(["eval", *model_args(setup, "--out", str(alone), "--temperature", "0", "--branches", "2",
                                     "--batch-size", "2")]) == 2
    assert "other settings" in capsys.readouterr().err


@pytest.mark.parametrize("change,message", [
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--batch-size", "2", "--measure-speedup"], "--measure-speedup times every response alone"),
    (["--batch-size", "2", "--branches", "2", "--verify", "tree"], "--verify tree takes one prompt at a time"),
    (["--datasets", "gsm9k"], "gsm9k"),
    (["--num-prompts", "0"], "--num-prompts"),
    (["--category-temperature", "warm"], "--category-temperature"),
    (["--grid", "0,x"], "--grid"),
    (["--grid=-1,0"], "--grid"),
])
def test_bad_eval_arguments_fail_clearly(setup, capsys, change, message):
    assert main(["eval", *model_args(setup, "--out", str(setup[0] / "bad")), *change]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dblast eval: error:") and message in err


def test_an_out_that_is_a_file_fails_clearly(setup, capsys):
    taken = setup[0] / "taken.txt"
    taken.write_text("not a directory")
    assert main(["eval", *model_args(setup, "--out", str(taken))]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dblast eval: error:") and "taken.txt" in err and "Traceback" not in err


def test_compare_pairs_prompts_and_rejects_other_prompt_sets(setup, capsys):
    a, b, short = setup[0] / "cmp-a", setup[0] / "cmp-b", setup[0] / "cmp-short"
    run_eval(setup, a, "--all-responses")
    run_eval(setup, b, "--all-responses", "--temperature", "0.5")
    run_eval(setup, short, "--num-prompts", "2")
    capsys.readouterr()
    assert main(["compare", str(a), str(b), "--all-responses", "--out", str(setup[0] / "cmp.md")]) == 0
    table = capsys.readouterr().out
    assert table.count(f"| {b} |") == 2 and "Holm" in table
    assert (setup[0] / "cmp.md").read_text().strip() == table.strip()
    assert main(["compare", str(a), str(short)]) == 2
    assert "different prompts" in capsys.readouterr().err
    assert main(["compare", str(a)]) == 2


def test_a_run_directory_reads_as_the_prompts_its_last_run_summarised(setup):
    from dblast_ext.eval.records import read_run_records
    out = setup[0] / "rerun-fewer"
    run_eval(setup, out, "--all-responses")
    run_eval(setup, out, "--all-responses", "--num-prompts", "2")  # same directory, fewer prompts
    assert len(read_records(str(out / "records.jsonl"))) > 4  # the first run's records are still there
    summary = json.loads((out / "summary.json").read_text())
    records = read_run_records(str(out))
    assert {(r["dataset"], r["prompt_id"]) for r in records} == {tuple(p) for p in summary["prompts"]}
    assert len(summary["prompts"]) == 4
    assert sum(len(r["accepted"]) for r in records) == sum(s["n_cycles"] for s in summary["datasets"].values())


def test_diagnose_ceiling_reads_finished_runs(setup, capsys):
    out = setup[0] / "ceil"
    run_eval(setup, out, "--all-responses")
    capsys.readouterr()
    assert main(["diagnose", "ceiling", str(out), "--all-responses"]) == 0
    text = capsys.readouterr().out
    assert "ceiling fraction" in text and "<- ceiling" in text and "| alpha |" in text
    # the tiny target never ends a response: over EOS-terminated responses every dataset is
    # reported as not summarised instead of stopping the command
    assert not any(r["eos_terminated"] for r in read_records(str(out / "records.jsonl")))
    assert main(["diagnose", "ceiling", str(out)]) == 0
    text = capsys.readouterr().out
    assert "alpha: not summarised" in text and "beta: not summarised" in text


def test_diagnose_expansion_decomposes_the_change_in_mean_accepted(setup, capsys):
    out = setup[0] / "expand"
    assert main(["diagnose", "expansion", *model_args(setup, "--out", str(out), "--block-size", "9",
                                                      "--all-responses")]) == 0
    result = json.loads((out / "expansion.json").read_text())
    assert result["trained_block_size"] == 6 and result["block_size"] == 9
    for row in result["datasets"]:
        assert row["G"] - row["L"] == pytest.approx(row["mean_wider"] - row["mean_trained"])
    assert {r["block_size"] for r in read_records(str(out / "records_block9.jsonl"))} == {9}
    # over EOS-terminated responses only (the tiny target never ends one): reported, not fatal
    capsys.readouterr()
    assert main(["diagnose", "expansion", *model_args(setup, "--out", str(out), "--block-size", "9")]) == 0
    assert "alpha not summarised" in capsys.readouterr().err
    assert json.loads((out / "expansion.json").read_text())["datasets"] == []
    assert main(["diagnose", "expansion", *model_args(setup, "--out", str(out), "--block-size", "4")]) == 2


@pytest.mark.parametrize("load,contended", [(0.0, False), (1.5, True)])
def test_eval_says_when_a_speedup_was_timed_on_busy_cores(setup, capsys, monkeypatch, load, contended):
    import dblast_ext.foreign_load as foreign_load

    class Busy(foreign_load.Stopwatch):
        def stop(self):
            return super().stop()[0], load
    monkeypatch.setattr(foreign_load, "Stopwatch", Busy)
    out = setup[0] / f"busy-{load}"
    run_eval(setup, out, "--measure-speedup", "--all-responses")
    records = read_records(str(out / "records.jsonl"))
    assert all(r["foreign_load"] == load and r["ar_foreign_load"] == load for r in records)
    summary = json.loads((out / "summary.json").read_text())
    for s in summary["datasets"].values():
        assert s["contended_responses"] == (s["n_responses"] if contended else 0)
    warned = "timed responses ran while other processes kept more than 0.25 cores busy"
    assert (warned in capsys.readouterr().err) == contended
    assert ("not this machine's alone" in (out / "report.md").read_text()) == contended


def test_diagnose_determinism_bins_truncation_points(setup):
    out = setup[0] / "determinism"
    assert main(["diagnose", "determinism", *model_args(setup, "--out", str(out), "--truncations", "6",
                                                        "--samples", "4")]) == 0
    result = json.loads((out / "determinism.json").read_text())
    assert sum(b["count"] for b in result["bins"]) == 6 and len(result["points"]) == 6
    assert all(0 < p["determinism"] <= 1 for p in result["points"])
    assert (out / "determinism.png").read_bytes().startswith(PNG)


def test_diagnose_determinism_resumes_to_the_points_of_an_uninterrupted_run(setup, monkeypatch, capsys):
    import dblast_ext.eval.determinism as determinism
    args = lambda out, n: ["diagnose", "determinism", *model_args(setup, "--out", str(out), "--truncations", str(n),  # noqa: E731
                                                                  "--samples", "3")]
    whole, resumed = setup[0] / "determinism-whole", setup[0] / "determinism-resumed"
    assert main(args(whole, 6)) == 0
    expected = json.loads((whole / "determinism.json").read_text())
    assert [p["index"] for p in expected["points"]] == list(range(6))
    # killed after two target responses and two points, then resumed: only the rest is computed
    assert main(args(resumed, 6)) == 0
    for name, keep in (("responses.jsonl", 2), ("points.jsonl", 2)):
        lines = (resumed / name).read_text().splitlines(keepends=True)
        (resumed / name).write_text("".join(lines[:keep]))
    computed = []
    first_cycle = determinism.SpeculativeDecoder.first_cycle
    monkeypatch.setattr(determinism.SpeculativeDecoder, "first_cycle",
                        lambda self, *a, **k: computed.append(1) or first_cycle(self, *a, **k))
    assert main(args(resumed, 6)) == 0
    assert len(computed) == 4
    assert json.loads((resumed / "determinism.json").read_text())["points"] == expected["points"]
    assert (resumed / "determinism.md").read_text() == (whole / "determinism.md").read_text()
    # a larger --truncations extends the run with new points, the first six unchanged
    assert main(args(resumed, 8)) == 0
    assert len(computed) == 6
    assert json.loads((resumed / "determinism.json").read_text())["points"][:6] == expected["points"]
    # other settings: refused, naming the file
    capsys.readouterr()
    assert main(args(resumed, 8)[:-1] + ["4"]) == 2
    assert "responses.jsonl holds records made with other settings" in capsys.readouterr().err


def test_diagnose_determinism_measures_a_baseline_on_the_same_points(setup, monkeypatch):
    import dblast_ext.eval.determinism as determinism
    root = setup[0]
    other = write_dflash_checkpoint(root / "other-drafter", block_size=6, seed=1)
    args = lambda out, *extra: ["diagnose", "determinism", *model_args(setup, "--out", str(out), "--truncations", "5",  # noqa: E731
                                                                       "--samples", "3", *extra)]
    # the baseline alone, as the drafter of its own run
    alone = root / "determinism-other-alone"
    assert main(["diagnose", "determinism", "--target", setup[1], "--drafter", other, "--datasets",
                 f"{setup[3]['alpha']},{setup[3]['beta']}", "--max-new-tokens", "12", "--no-progress",
                 "--out", str(alone), "--truncations", "5", "--samples", "3"]) == 0
    expected = json.loads((alone / "determinism.json").read_text())
    # made without a baseline, then resumed with one: only the baseline's cycles are computed
    both = root / "determinism-with-baseline"
    assert main(args(both, "--branches", "4")) == 0
    drafter_points = json.loads((both / "determinism.json").read_text())["points"]
    computed = []
    first_cycle = determinism.SpeculativeDecoder.first_cycle
    monkeypatch.setattr(determinism.SpeculativeDecoder, "first_cycle",
                        lambda self, *a, **k: computed.append(self.drafter.num_branches) or first_cycle(self, *a, **k))
    assert main(args(both, "--branches", "4", "--baseline", other)) == 0
    assert computed == [1] * 5
    result = json.loads((both / "determinism.json").read_text())
    assert result["points"] == drafter_points
    # the same prefixes and random numbers as the baseline's own run: the same cycles
    assert [p["expected_accepted"] for p in result["baseline"]["points"]] == \
        [p["expected_accepted"] for p in expected["points"]]
    assert [p["determinism"] for p in result["points"]] == [p["determinism"] for p in expected["points"]]
    assert result["baseline"]["bins"] == expected["bins"]
    for gain, a, b in zip(result["baseline"]["gains"], result["bins"], expected["bins"]):
        assert gain is None if not (a["mean"] and b["mean"]) else gain == pytest.approx(a["mean"] / b["mean"] - 1)
    table = (both / "determinism.md").read_text()
    assert "other-drafter: mean expected accepted" in table and "gain of drafter" in table
    assert (both / "determinism.png").read_bytes().startswith(PNG)
    # a finished run with its baseline resumes computing nothing
    assert main(args(both, "--branches", "4", "--baseline", other)) == 0
    assert computed == [1] * 5


def test_diagnose_determinism_refuses_a_baseline_of_another_block_size(setup, capsys):
    other = write_dflash_checkpoint(setup[0] / "block8-drafter", block_size=8, seed=1)
    argv = ["diagnose", "determinism", *model_args(setup, "--out", str(setup[0] / "determinism-b8"), "--baseline", other)]
    assert main(argv) == 2
    assert "--baseline: its block size 8 differs from the drafter's 6" in capsys.readouterr().err
    assert main(argv[:-1] + [str(setup[0] / "missing")]) == 2
    assert "--baseline" in capsys.readouterr().err


def test_diagnose_determinism_truncates_responses_before_their_stop_token(setup, monkeypatch):
    import dblast_ext.eval.determinism as determinism
    from dblast_ext.decoding.decoder import SpeculativeDecoder
    stops = list(range(0, 100, 2))  # even ids stop a response: most end within a few tokens
    monkeypatch.setattr(determinism, "stop_token_ids", lambda model, tokenizer: stops)
    anchors, first_cycle = [], SpeculativeDecoder.first_cycle
    monkeypatch.setattr(SpeculativeDecoder, "first_cycle",
                        lambda self, prefix, *a, **k: anchors.append(prefix[-1]) or first_cycle(self, prefix, *a, **k))
    out = setup[0] / "determinism-stops"
    assert main(["diagnose", "determinism", *model_args(setup, "--out", str(out), "--truncations", "8",
                                                        "--samples", "2", "--max-new-tokens", "40")]) == 0
    assert len(anchors) == 8 and all(a % 2 == 1 for a in anchors)


@pytest.mark.parametrize("temperature", ["0", "1.0"])
def test_diagnose_oracle_reads_cycles_off_target_responses(setup, capsys, temperature):
    root, target, _, files = setup
    out = root / f"oracle-T{temperature}"
    argv = ["diagnose", "oracle", "--target", target, "--datasets", f"{files['alpha']},{files['beta']}",
            "--max-new-tokens", "12", "--block-size", "4", "--temperature", temperature, "--all-responses",
            "--no-progress", "--out", str(out)]
    assert main(argv) == 0
    records = read_records(str(out / "records.jsonl"))
    assert len(records) == 4 + 3  # first turns only
    for r in records:
        # every token after the first is an accepted draft or closes a cycle
        assert sum(n + 1 for n in r["accepted"]) == r["new_tokens"] - 1
        assert len(r["top_probability"]) == r["new_tokens"] - 1
        if temperature == "0":  # greedy: every cycle but the last at the ceiling
            assert all(n == 3 for n in r["accepted"][:-1]) and set(r["top_probability"]) <= {1.0}
    result = json.loads((out / "oracle.json").read_text())
    for name in ("alpha", "beta"):
        assert result["datasets"][name]["tau"] == pytest.approx(
            summarize([r for r in records if r["dataset"] == name], eos_only=False)["tau"])
        assert (out / f"histogram_{name}.png").read_bytes().startswith(PNG)
    assert "top-token oracle" in (out / "oracle.md").read_text().lower()
    # resumed: nothing is generated again, the same table comes out
    first = (out / "oracle.md").read_text()
    assert main(argv) == 0 and (out / "oracle.md").read_text() == first
    assert len(read_records(str(out / "records.jsonl"))) == 7


def test_diagnose_oracle_reports_datasets_it_cannot_summarise(setup, capsys):
    root, target, _, files = setup
    out = root / "oracle-one-token"
    # one-token responses: no cycle anywhere, and EOS-only statistics have nothing to count
    assert main(["diagnose", "oracle", "--target", target, "--datasets", f"{files['alpha']},{files['beta']}",
                 "--max-new-tokens", "1", "--no-progress", "--out", str(out)]) == 0
    table = (out / "oracle.md").read_text()
    assert table.count("not summarised") == 2
    assert set(json.loads((out / "oracle.json").read_text())["skipped"]) == {"alpha", "beta"}


def test_diagnose_oracle_rejects_a_bad_block_size(setup, capsys):
    root, target, _, files = setup
    assert main(["diagnose", "oracle", "--target", target, "--datasets", files["alpha"], "--block-size", "1",
                 "--out", str(root / "oracle-bad")]) == 2
    assert "--block-size must be >= 2" in capsys.readouterr().err


def test_calibration_chooses_z_on_a_split_and_eval_reports_the_rest(setup, capsys):
    out = setup[0] / "calibrated"
    assert main(["eval", *model_args(setup, "--out", str(out), "--branches", "4", "--category-temperature",
                                     "calibrate", "--grid", "0,1", "--all-responses")]) == 0
    calibration = json.loads((out / "calibration" / "calibration.json").read_text())
    assert calibration["grid"] == [0.0, 1.0] and calibration["best"] in (0.0, 1.0)
    held_out = {tuple(k) for k in calibration["calibration_prompts"]}
    assert len(held_out) == 2  # one per dataset (10%, at least one)
    evaluated = {(r["dataset"], r["prompt_id"]) for r in read_records(str(out / "records.jsonl"))}
    assert not evaluated & held_out and len(evaluated) == 7 - 2
    assert "calibrated" in (out / "report.md").read_text()
    assert main(["calibrate", *model_args(setup, "--out", str(setup[0] / "cal"), "--grid", "0.5",
                                          "--branches", "4")]) == 0
    assert "chosen Z_T = 0.5" in capsys.readouterr().out
    assert main(["calibrate", *model_args(setup, "--out", str(setup[0] / "cal1"), "--grid", "0.5")]) == 2
    assert "one branch" in capsys.readouterr().err


def test_calibration_with_one_branch_runs_nothing_but_holds_out_the_same_split(setup):
    k4, k1 = setup[0] / "calibrated", setup[0] / "calibrated-k1"
    if not (k4 / "records.jsonl").exists():
        run_eval(setup, k4, "--branches", "4", "--category-temperature", "calibrate", "--grid", "0,1",
                 "--all-responses")
    run_eval(setup, k1, "--category-temperature", "calibrate", "--grid", "0,1", "--all-responses")
    assert not (k1 / "calibration" / "calibration.json").exists()   # no Z_T runs for K = 1
    prompts = lambda out: {(r["dataset"], r["prompt_id"]) for r in read_records(str(out / "records.jsonl"))}  # noqa
    assert prompts(k1) == prompts(k4) and len(prompts(k1)) == 5
    assert "K = 1" in (k1 / "report.md").read_text()
