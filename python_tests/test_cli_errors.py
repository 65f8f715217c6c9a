"""The `dblast` command line's errors, help and interrupts: every bad flag is named in one
clean line before any model loads, each subcommand shows only the flags it honours, with
their defaults. No model is loaded here except the tiny random target of the progress test."""
import itertools
import json
import os
import re

import pytest
import torch

from dblast_ext.cli import main
from dblast_ext.drafting.embedded_drafters import EMBEDDED_DRAFTERS
from tiny_models import write_dflash_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ModelLoaded(Exception):
    """Raised in place of loading a model: a command that gets this far passed its checks."""


@pytest.fixture(autouse=True)
def no_model_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise ModelLoaded

    for module in ("common", "data", "diagnose"):
        monkeypatch.setattr(f"dblast_ext.cli.{module}.load_target", refuse)
    monkeypatch.setattr("dblast_ext.cli.train.train", refuse)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A target directory (never loaded here), a K = 1 drafter trained at block 6, a dataset
    of three prompts, a training config and two small runs' records."""
    root = tmp_path_factory.mktemp("cli-errors")
    target = root / "target"
    target.mkdir()
    drafter = write_dflash_checkpoint(root / "drafter", block_size=6)
    prompts = root / "alpha.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"t{i} t{i + 1}"}) + "\n" for i in range(5, 8)))
    data = root / "train.jsonl"
    data.write_text("")
    config = root / "config.json"
    config.write_text(json.dumps({"target": str(target), "data": str(data), "out": str(root / "train-out"),
                                  "init_from": drafter}))
    runs = []
    for name, accepted in (("run-a", [[1, 5], [0]]), ("run-b", [[2, 5], [3]])):
        path = root / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"dataset": "alpha", "prompt_id": str(i), "turn": 0, "accepted": a,
                                            "block_size": 6, "eos_terminated": True})
                                + "\n" for i, a in enumerate(accepted)))
        runs.append(str(path))
    return dict(root=root, target=str(target), drafter=drafter, prompts=str(prompts), config=str(config), runs=runs)


def model_flags(files):
    return ["--target", files["target"], "--drafter", files["drafter"]]


def eval_flags(files, out):
    return [*model_flags(files), "--datasets", files["prompts"], "--out", str(files["root"] / out)]


def every_model_subcommand(files):
    """(name, argv) of each subcommand that runs a model, with valid flags."""
    root = files["root"]
    return {
        "generate": ["generate", *model_flags(files), "--prompt", "t5"],
        "eval": ["eval", *eval_flags(files, "eval")],
        "demo": ["demo"],
        "diagnose expansion": ["diagnose", "expansion", *eval_flags(files, "exp"), "--block-size", "9"],
        "diagnose determinism": ["diagnose", "determinism", *eval_flags(files, "det")],
        "diagnose oracle": ["diagnose", "oracle", "--target", files["target"], "--datasets", files["prompts"],
                            "--out", str(root / "oracle")],
        "calibrate": ["calibrate", *eval_flags(files, "cal"), "--branches", "4"],
        "data generate": ["data", "generate", "--target", files["target"], "--prompts", files["prompts"],
                          "--out", str(root / "data.jsonl")],
        "train": ["train", "--config", files["config"]],
    }


SUBCOMMANDS = ["generate", "eval", "demo", "diagnose expansion", "diagnose determinism", "diagnose oracle",
               "calibrate", "data generate", "train"]


def fails_cleanly(capsys, argv, *needles):
    """The command exits with 2 and one error line holding every needle, no traceback."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dblast {argv[0]}: error:") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, err
    return err


def help_text(capsys, monkeypatch, argv):
    monkeypatch.setenv("COLUMNS", "250")  # no wrapping inside a flag's help
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def flag_help(text, flag):
    """The help of `flag` in a help text ("" when it has none): an option's entry is its
    invocation, then two or more spaces or a line break, then its help."""
    for entry in re.split(r"\n(?=  -)", text.split("options:")[1]):
        invocation, *rest = re.split(r"\s{2,}|\n", entry.strip(), maxsplit=1)
        if invocation == flag or invocation.startswith(flag + " "):
            return " ".join(" ".join(rest).split())
    raise AssertionError(f"{flag} is not in the help")


# 1. --device and --dtype


def test_the_valid_commands_reach_model_loading(files):
    """The baseline of the checks below: with good flags every subcommand gets to its model."""
    for argv in every_model_subcommand(files).values():
        with pytest.raises(ModelLoaded):
            main(argv)


@pytest.mark.parametrize("subcommand", SUBCOMMANDS)
def test_a_device_torch_does_not_know_is_named_before_loading(files, capsys, subcommand):
    fails_cleanly(capsys, [*every_model_subcommand(files)[subcommand], "--device", "foo"], "--device", "'foo'")


@pytest.mark.parametrize("subcommand", SUBCOMMANDS)
def test_cuda_on_a_machine_without_it_is_named_before_loading(files, capsys, monkeypatch, subcommand):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fails_cleanly(capsys, [*every_model_subcommand(files)[subcommand], "--device", "cuda"], "--device cuda",
                  "CUDA is not available")


def test_a_cuda_device_in_the_training_config_is_named_as_the_config_field(files, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = files["root"] / "cuda-config.json"
    config.write_text(json.dumps(dict(json.loads(open(files["config"]).read()), device="cuda")))
    fails_cleanly(capsys, ["train", "--config", str(config)], "training config: device cuda")


def test_a_bad_dtype_names_the_flag(files, capsys):
    fails_cleanly(capsys, [*every_model_subcommand(files)["generate"], "--dtype", "int8"], "--dtype", "'int8'")


# 2. compare --n-boot


@pytest.mark.parametrize("n_boot", ["0", "-3"])
def test_compare_needs_at_least_one_resample(files, capsys, n_boot):
    fails_cleanly(capsys, ["compare", *files["runs"], "--n-boot", n_boot], f"--n-boot must be >= 1, got {n_boot}")


def test_compare_explains_n_boot(capsys, monkeypatch):
    assert "bootstrap" in flag_help(help_text(capsys, monkeypatch, ["compare"]), "--n-boot")


# 3. errors that came only after the model had loaded


def test_eval_calibration_needs_two_prompts_per_dataset_before_loading(files, capsys):
    argv = ["eval", *eval_flags(files, "cal-one"), "--category-temperature", "calibrate", "--num-prompts", "1"]
    fails_cleanly(capsys, argv, "--num-prompts 1", "at least 2 per dataset")
    assert not (files["root"] / "cal-one").exists()


def test_calibrate_refuses_a_one_branch_drafter_before_loading(files, capsys):
    fails_cleanly(capsys, ["calibrate", *eval_flags(files, "cal-k1")], "one branch")
    fails_cleanly(capsys, ["calibrate", *eval_flags(files, "cal-k1"), "--branches", "1"], "one branch")


def test_calibrate_counts_the_branches_flag(files):
    with pytest.raises(ModelLoaded):  # K = 1 on disk, but --branches 4 gives it a head: checks pass
        main(["calibrate", *eval_flags(files, "cal-k4"), "--branches", "4"])


def test_branches_that_conflict_with_the_checkpoint_are_named_before_loading(files, capsys, tmp_path):
    k4 = write_dflash_checkpoint(tmp_path / "k4", block_size=6, dblast_config={"num_branches": 4})
    fails_cleanly(capsys, ["generate", "--target", files["target"], "--drafter", k4, "--prompt", "t5",
                           "--branches", "2"], "--branches 2", "already has 4 branches")


def test_expansion_needs_a_wider_block_before_loading_or_creating_out(files, capsys):
    argv = ["diagnose", "expansion", *eval_flags(files, "exp-narrow"), "--block-size", "5"]
    fails_cleanly(capsys, argv, "--block-size 5 must exceed", "trained block size 6")
    assert not (files["root"] / "exp-narrow").exists()


# 4. each subcommand takes only the flags it honours


@pytest.mark.parametrize("subcommand,flag", [
    ("diagnose determinism", "--measure-speedup"),
    ("diagnose determinism", "--all-responses"),
    ("diagnose expansion", "--measure-speedup"),
    ("calibrate", "--measure-speedup"),
    ("calibrate", "--all-responses"),
])
def test_flags_a_subcommand_would_ignore_are_refused(files, capsys, subcommand, flag):
    with pytest.raises(SystemExit) as exit_info:
        main([*every_model_subcommand(files)[subcommand], flag])
    assert exit_info.value.code == 2 and f"unrecognized arguments: {flag}" in capsys.readouterr().err


def test_expansion_block_size_is_required_and_explained(files, capsys, monkeypatch):
    text = help_text(capsys, monkeypatch, ["diagnose", "expansion"])
    assert "[--block-size" not in text and "wider" in flag_help(text, "--block-size")
    argv = every_model_subcommand(files)["diagnose expansion"][:-2]  # without --block-size
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and "--block-size" in capsys.readouterr().err


def test_determinism_out_help_says_it_resumes(capsys, monkeypatch):
    text = help_text(capsys, monkeypatch, ["diagnose", "determinism"])
    assert "is resumed" in flag_help(text, "--out") and "rerunning with the same --out resumes" in text


@pytest.fixture(scope="module")
def tiny_target(files):
    pytest.importorskip("transformers")
    from tiny_models import write_tiny_target_dir

    return write_tiny_target_dir(files["root"] / "tiny-target")


def test_determinism_no_progress_silences_its_progress_lines(files, tiny_target, capsys, monkeypatch):
    from dblast_ext.target.loading import load_target

    monkeypatch.setattr("dblast_ext.cli.common.load_target", load_target)  # the tiny target may load
    out = files["root"] / "det-quiet"
    argv = ["diagnose", "determinism", "--target", tiny_target, "--drafter", files["drafter"], "--datasets",
            files["prompts"], "--max-new-tokens", "4", "--truncations", "2", "--samples", "2", "--out", str(out)]
    assert main([*argv, "--no-progress"]) == 0
    assert "truncation points" not in capsys.readouterr().err
    assert main(argv) == 0
    assert "determinism: 2/2 truncation points" in capsys.readouterr().err


# 5-7. help: descriptions, file names, defaults


def test_calibrate_description_shows_a_plain_percent(capsys, monkeypatch):
    text = help_text(capsys, monkeypatch, ["calibrate"])
    assert "10% calibration" in text and "%%" not in text


@pytest.mark.parametrize("argv,names", [
    (["diagnose", "expansion"], ["records_block<B>.jsonl", "expansion.json", "expansion.md"]),
    (["diagnose", "determinism"], ["determinism.json", "determinism.md", "determinism.png", "responses.jsonl",
                                   "points.jsonl"]),
    (["diagnose", "oracle"], ["records.jsonl", "oracle.json", "oracle.md", "histogram_<dataset>.png"]),
    (["diagnose", "ceiling"], ["ceiling fraction"]),
    (["calibrate"], ["zt_<Z_T>.jsonl", "calibration.json", "calibration.png"]),
])
def test_help_describes_what_a_subcommand_computes_and_writes(capsys, monkeypatch, argv, names):
    description = help_text(capsys, monkeypatch, argv).split("options:")[0]
    for name in names:
        assert name in description


@pytest.mark.parametrize("argv,defaults", [
    (["demo"], {"--top-p": "0.95", "--top-k": "20", "--max-new-tokens": "128", "--temperature": "1.0"}),
    (["data", "generate"], {"--temperature": "0.7", "--top-p": "0.8", "--top-k": "20"}),
    (["diagnose", "expansion"], {"--temperature": "0.0"}),
    (["diagnose", "determinism"], {"--truncations": "200", "--samples": "20"}),
    (["compare"], {"--n-boot": "2000"}),
])
def test_help_shows_the_defaults(capsys, monkeypatch, argv, defaults):
    text = help_text(capsys, monkeypatch, argv)
    for flag, value in defaults.items():
        assert f"(default {value})" in flag_help(text, flag), flag


# 8. train


def test_train_starts_from_an_embedded_drafter(files, monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr("dblast_ext.cli.train.train",
                        lambda config, progress: seen.append(config) or {"history": [], "final": "final"})
    assert main(["train", "--config", files["config"], "--init-from", "dblast-k4", "--out", str(tmp_path)]) == 0
    assert seen[0].init_from == "dblast-k4"


@pytest.mark.parametrize("flag,value", [("--max-steps", "0"), ("--num-branches", "0"), ("--block-size", "1"),
                                        ("--new-position-weight", "0")])
def test_train_names_the_flag_that_set_a_bad_value(files, capsys, flag, value):
    err = fails_cleanly(capsys, ["train", "--config", files["config"], flag, value], f"{flag} must be")
    assert "training config" not in err


def test_train_names_the_config_field_when_the_file_set_it(files, capsys):
    config = files["root"] / "bad-steps.json"
    config.write_text(json.dumps(dict(json.loads(open(files["config"]).read()), max_steps=0)))
    fails_cleanly(capsys, ["train", "--config", str(config)], "training config: max_steps must be")


@pytest.mark.parametrize("flag", ["--objective", "--num-branches", "--max-steps", "--device", "--no-progress",
                                  "--init-from"])
def test_every_train_flag_has_help(capsys, monkeypatch, flag):
    assert flag_help(help_text(capsys, monkeypatch, ["train"]), flag)


# 9. the ceiling bin's notation


def test_the_ceiling_bin_is_labelled_with_the_number_of_drafts(files, capsys):
    assert main(["diagnose", "ceiling", *files["runs"][:1]]) == 0
    out = capsys.readouterr().out
    assert "ceiling fraction (n = b = B - 1)" in out
    assert re.search(r"n= 5 .*<- ceiling \(n = b = B - 1", out)  # block 6: five drafts


# 10. Ctrl-C


@pytest.mark.parametrize("subcommand,resumes", [("eval", True), ("data generate", True), ("train", True),
                                                ("diagnose oracle", True), ("diagnose determinism", True),
                                                ("generate", False)])
def test_ctrl_c_exits_130_and_says_whether_a_rerun_resumes(files, capsys, monkeypatch, subcommand, resumes):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    for module in ("common", "data", "diagnose"):
        monkeypatch.setattr(f"dblast_ext.cli.{module}.load_target", interrupt)
    monkeypatch.setattr("dblast_ext.cli.train.train", interrupt)
    argv = every_model_subcommand(files)[subcommand]
    try:
        code = main(argv)
    except KeyboardInterrupt:
        pytest.fail("the interrupt escaped main")
    err = capsys.readouterr().err
    assert code == 130 and "Traceback" not in err
    if subcommand == "generate":  # its first line says which settings it picked
        err = err.split("\n", 1)[1] if err.startswith("fastest exact settings here:") else err
    assert err.startswith(f"dblast {argv[0]}: interrupted")
    assert ("rerun the same command to resume" in err) == resumes


# 11. records files, embedded names, --datasets


def test_compare_names_a_file_that_is_not_a_records_file(files, capsys):
    other = files["root"] / "not-records.jsonl"
    other.write_text(json.dumps({"prompt": "t5"}) + "\n")
    fails_cleanly(capsys, ["compare", files["runs"][0], str(other)], "not-records.jsonl: line 1",
                  "not an evaluation records file")


def test_a_mistyped_embedded_drafter_lists_the_embedded_ones(files, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # no local directory of that name
    err = fails_cleanly(capsys, ["generate", "--target", files["target"], "--drafter", "dblast-k5", "--prompt", "t5"],
                        "--drafter", "'dblast-k5'")
    assert all(name in err for name in EMBEDDED_DRAFTERS)


@pytest.mark.parametrize("datasets", ["gsm9k", "alpha.jsonl,,", "missing.jsonl"])
def test_dataset_list_errors_name_the_flag(files, capsys, datasets):
    fails_cleanly(capsys, ["eval", *eval_flags(files, "bad-datasets"), "--datasets", datasets], "--datasets")


# 12. the recipe's environment


def test_the_eval_recipe_header_lists_every_variable_it_reads():
    with open(os.path.join(REPO, "recipes", "smollm2", "evaluate", "eval.sh")) as f:
        script = f.read()
    header = "".join(itertools.takewhile(lambda line: line.startswith("#"), script.splitlines(keepends=True)))
    read = set(re.findall(r"\$\{(\w+):-", script))
    assert read and not {name for name in read if name not in header}


DRAFTING_SUBCOMMANDS = ["generate", "eval", "demo", "diagnose expansion", "diagnose determinism", "calibrate"]


@pytest.mark.parametrize("subcommand", DRAFTING_SUBCOMMANDS)
def test_a_draft_vocabulary_below_one_is_named_before_loading(files, capsys, subcommand):
    fails_cleanly(capsys, [*every_model_subcommand(files)[subcommand], "--draft-vocab", "0"],
                  "--draft-vocab must be >= 1, got 0")


@pytest.mark.parametrize("subcommand", DRAFTING_SUBCOMMANDS)
def test_a_valid_draft_vocabulary_reaches_model_loading(files, subcommand):
    with pytest.raises(ModelLoaded):
        main([*every_model_subcommand(files)[subcommand], "--draft-vocab", "64"])


def fails_cleanly_unless_the_demo_picks_the_trie(capsys, files, subcommand, flags, message):
    """Trie flags without --verify: `dblast demo` on a CPU picks trie verification for its
    embedded drafter (on a GPU the branch rule) (dblast_ext.decoding.fastest_settings), so they are valid there; elsewhere (other
    subcommands, or `generate` with a drafter of its own) the branch rule stands and they fail."""
    from dblast_ext.decoding.fastest_settings import fastest_exact_settings
    from dblast_ext.target.loading import default_device

    command = [*every_model_subcommand(files)[subcommand], *flags]
    demo_picks_tree = fastest_exact_settings(torch.device(default_device()).type, "dblast-k4").verify == "tree"
    if subcommand == "demo" and "--verify" not in flags and demo_picks_tree:
        with pytest.raises(ModelLoaded):
            main(command)
    else:
        fails_cleanly(capsys, command, message)


@pytest.mark.parametrize("subcommand", DRAFTING_SUBCOMMANDS)
@pytest.mark.parametrize("flags", [["--max-tree-nodes", "4"], ["--verify", "branch", "--max-tree-nodes", "4"],
                                   ["--verify", "tree", "--max-tree-nodes", "0"]])
def test_a_tree_node_budget_without_tree_verification_or_below_one_is_named_before_loading(files, capsys,
                                                                                          subcommand, flags):
    fails_cleanly_unless_the_demo_picks_the_trie(capsys, files, subcommand, flags, "--max-tree-nodes must be >= 1")


@pytest.mark.parametrize("subcommand", DRAFTING_SUBCOMMANDS)
@pytest.mark.parametrize("flags", [["--extra-leaves", "2"], ["--verify", "branch", "--extra-leaves", "2"],
                                   ["--verify", "tree", "--extra-leaves", "-1"]])
def test_extra_leaves_without_tree_verification_or_below_zero_are_named_before_loading(files, capsys, subcommand,
                                                                                      flags):
    fails_cleanly_unless_the_demo_picks_the_trie(capsys, files, subcommand, flags, "--extra-leaves must be >= 0")


@pytest.mark.parametrize("subcommand", DRAFTING_SUBCOMMANDS)
def test_tree_verification_reaches_model_loading(files, subcommand):
    with pytest.raises(ModelLoaded):
        main([*every_model_subcommand(files)[subcommand], "--verify", "tree", "--max-tree-nodes", "8",
              "--extra-leaves", "2"])


# the adaptive controller's flags


def test_a_missing_or_damaged_cost_table_is_named_before_loading(files, capsys):
    missing = str(files["root"] / "no-costs.json")
    fails_cleanly(capsys, ["generate", *model_flags(files), "--prompt", "t5", "--cost-table", missing],
                  "--cost-table", "no-costs.json", "no such file")
    damaged = files["root"] / "damaged-costs.json"
    damaged.write_text("{not json")
    fails_cleanly(capsys, ["generate", *model_flags(files), "--prompt", "t5", "--cost-table", str(damaged)],
                  "damaged-costs.json", "not JSON")
    fails_cleanly(capsys, ["generate", *model_flags(files), "--prompt", "t5", "--controller", "off",
                           "--cost-table", str(damaged)], "--cost-table", "--controller off")


def test_calibrate_cost_names_bad_batch_sizes_before_loading(files, capsys):
    fails_cleanly(capsys, ["calibrate", "--cost", *model_flags(files), "--out", str(files["root"] / "costs"),
                           "--batch-sizes", "1,0"], "--batch-sizes", "'1,0'")


@pytest.mark.parametrize("argv,controller", [
    (["generate", "--prompt", "t5"], "adaptive"), (["eval", "--datasets", "x", "--out", "o"], "off"),
    (["eval", "--datasets", "x", "--out", "o", "--measure-speedup"], "adaptive"),
    (["generate", "--prompt", "t5", "--controller", "off"], "off"),
    (["calibrate", "--datasets", "x", "--out", "o"], "off"),
])
def test_the_controller_is_adaptive_where_speed_is_the_point(argv, controller):
    from dblast_ext.cli import build_parser
    from dblast_ext.cli.common import controller_of

    args = build_parser().parse_args([argv[0], "--drafter", "d", *argv[1:]])
    assert controller_of(args) == controller
