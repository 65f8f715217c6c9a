"""`dblast generate` on a tiny random target saved as a local model directory (tokenizer and
chat template included) and a DFlash-format drafter checkpoint."""
import io
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from dblast_ext.cli import main  # noqa: E402
from tiny_models import tiny_tokenizer, write_dflash_checkpoint, write_tiny_target_dir  # noqa: E402

PROMPT = "t5 t17 t42 t8 t25"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return write_tiny_target_dir(root / "target"), write_dflash_checkpoint(root / "drafter", block_size=8)


def run_json(capsys, *argv):
    assert main(["generate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def hf_greedy(target_dir, ids, max_new_tokens, eos=None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir)
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new_tokens,
                         eos_token_id=eos, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("chat,branches,draft_vocab", [
    (False, None, None), (True, None, None), (False, 4, None), (True, 4, None),
    (True, 4, 40),  # drafting from the first 40 ids only: the output is still the target's
])
def test_greedy_generation_equals_the_targets_own(capsys, model_dirs, chat, branches, draft_vocab):
    target, drafter = model_dirs
    argv = ["--target", target, "--drafter", drafter, "--prompt", PROMPT, "--temperature", "0",
            "--max-new-tokens", "24", "--ignore-eos"]
    argv += ["--chat"] if chat else []
    argv += ["--branches", str(branches)] if branches else []
    argv += ["--draft-vocab", str(draft_vocab)] if draft_vocab else []
    out = run_json(capsys, *argv)
    assert out["draft_vocab"] == draft_vocab  # ids 0..39 (the end-of-sequence id, 1, among them)
    tokenizer = tiny_tokenizer()
    ids = (tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                                   add_generation_prompt=True), add_special_tokens=False)
           if chat else tokenizer(PROMPT))["input_ids"]
    assert out["token_ids"] == hf_greedy(target, ids, 24)
    assert out["text"] == tokenizer.decode(out["token_ids"], skip_special_tokens=True)
    assert out["num_branches"] == (branches or 1) and out["block_size"] == 8
    assert len(out["accepted"]) == out["cycles"] and all(0 <= n <= 7 for n in out["accepted"])


def test_generation_stops_at_the_targets_end_of_sequence_token(capsys, tmp_path, model_dirs):
    _, drafter = model_dirs
    ids = tiny_tokenizer()(PROMPT)["input_ids"]
    free_run = hf_greedy(write_tiny_target_dir(tmp_path / "probe"), ids, 12)
    eos = next(t for t in free_run[3:] if t not in (0, 2))  # a token greedy decoding reaches
    target = write_tiny_target_dir(tmp_path / "target", eos_id=eos)
    out = run_json(capsys, "--target", target, "--drafter", drafter, "--prompt", PROMPT, "--temperature", "0",
                   "--max-new-tokens", "12")
    assert out["stopped_by_eos"] and out["token_ids"][-1] == eos
    assert out["token_ids"] == hf_greedy(target, ids, 12, eos=eos)


def test_text_streams_to_stdout_and_figures_go_to_stderr(capsys, model_dirs):
    target, drafter = model_dirs
    argv = ["generate", "--target", target, "--drafter", drafter, "--prompt", PROMPT, "--temperature", "0.8",
            "--top-k", "20", "--top-p", "0.95", "--branches", "4", "--max-new-tokens", "20", "--ignore-eos",
            "--seed", "3", "--controller", "off"]  # the same depths in both runs, so the same tokens at T 0.8
    assert main(argv) == 0
    streamed = capsys.readouterr()
    ids = run_json(capsys, *argv[1:])["token_ids"]
    assert streamed.out == tiny_tokenizer().decode(ids, skip_special_tokens=True) + "\n"
    assert "20 tokens in" in streamed.err and "committed length" in streamed.err
    assert "n= 7" in streamed.err and "ceiling" in streamed.err


@pytest.mark.parametrize("dtype,temperature,said", [("bfloat16", "0", True), ("float32", "0", False),
                                                    ("bfloat16", "0.8", False)])
def test_greedy_in_16_bits_says_what_exact_means(capsys, model_dirs, dtype, temperature, said):
    target, drafter = model_dirs
    assert main(["generate", "--target", target, "--drafter", drafter, "--prompt", PROMPT, "--max-new-tokens", "4",
                 "--temperature", temperature, "--dtype", dtype]) == 0
    err = capsys.readouterr().err
    assert ("near-tie can resolve differently" in err and "--dtype float32" in err) == said, err


def test_the_exactness_line_is_precise_for_each_dtype():
    from dblast_ext.cli.display import exactness_line

    assert exactness_line(torch.float32, 0.0).endswith("greedy, it is the target's own greedy output token for token")
    assert "token for token" not in exactness_line(torch.float32, 0.7)
    assert "in bfloat16 a pass over a block rounds unlike a one-token step" in exactness_line(torch.bfloat16, 0.0)


def test_compare_ar_reports_a_speedup(capsys, model_dirs):
    target, drafter = model_dirs
    out = run_json(capsys, "--target", target, "--drafter", drafter, "--prompt", PROMPT, "--max-new-tokens", "16",
                   "--compare-ar", "--ignore-eos", "--no-kernels")
    assert out["ar_new_tokens"] == 16 and out["speedup"] > 0 and out["ar_wall_time"] > 0


def test_compare_ar_warns_when_timed_on_busy_cores(capsys, model_dirs, monkeypatch):
    import dblast_ext.foreign_load as foreign_load
    target, drafter = model_dirs
    argv = ["--target", target, "--drafter", drafter, "--prompt", PROMPT, "--max-new-tokens", "8", "--compare-ar",
            "--no-kernels"]
    for load, warned in ((0.0, False), (1.25, True)):
        monkeypatch.setattr(foreign_load, "Stopwatch", busy_stopwatch(foreign_load.Stopwatch, load))
        out = run_json(capsys, *argv)
        assert out["foreign_load"] == load and out["ar_foreign_load"] == load
        assert main(["generate", *argv]) == 0
        assert ("--- warning: other processes kept up to 1.25 cores busy" in capsys.readouterr().err) == warned


def busy_stopwatch(stopwatch, load):
    """A Stopwatch that reports `load` cores of other processes whatever the machine does."""
    class Busy(stopwatch):
        def stop(self):
            return super().stop()[0], load
    return Busy


@pytest.mark.parametrize("change,message", [
    ({"--target": "/nonexistent/target"}, "not a local directory"),
    ({"--drafter": "/nonexistent/drafter"}, "drafter checkpoint file missing"),
    ({"--temperature": "-1"}, "--temperature"),
    ({"--temperature": "nan"}, "--temperature"),
    ({"--temperature": "inf"}, "--temperature"),
    ({"--top-p": "nan"}, "--top-p"),
    ({"--top-p": "0"}, "--top-p"),
    ({"--max-new-tokens": "0"}, "--max-new-tokens"),
    ({"--prompt": ""}, "--prompt: the prompt is empty"),
    ({"--dtype": "int8"}, "dtype"),
    ({"--category-temperature": "-1"}, "--category-temperature"),
    ({"--system": "be brief"}, "--system needs --chat"),
])
def test_bad_arguments_fail_with_one_clear_line(capsys, model_dirs, change, message):
    target, drafter = model_dirs
    args = {"--target": target, "--drafter": drafter, "--prompt": PROMPT}
    args.update(change)
    assert main(["generate", *[x for kv in args.items() for x in kv]]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dblast generate: error:") and message in err and "Traceback" not in err


def test_an_empty_standard_input_names_the_prompt_flag(capsys, model_dirs, monkeypatch):
    target, drafter = model_dirs
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert main(["generate", "--target", target, "--drafter", drafter, "--prompt", "-"]) == 2
    assert "--prompt: the prompt is empty (nothing on standard input)" in capsys.readouterr().err


def test_the_installed_console_script_runs(model_dirs):
    script = os.path.join(os.path.dirname(sys.executable), "dblast")
    assert os.path.exists(script), "pip install should have created the `dblast` script next to python"
    target, drafter = model_dirs
    done = subprocess.run([script, "generate", "--target", target, "--drafter", drafter, "--prompt", PROMPT,
                           "--max-new-tokens", "8", "--temperature", "0", "--json"],
                          capture_output=True, text=True, timeout=300, cwd="/")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["new_tokens"] <= 8


def test_progress_false_silences_the_weight_loading_bar_and_restores_it(capfd, model_dirs):
    """A command's --no-progress reaches transformers' own weight-loading bar (transformers 5
    draws one for every load), and the bars are on again afterwards."""
    import transformers
    from transformers.utils import logging as hf_logging

    from dblast_ext.target.loading import load_target

    capfd.readouterr()
    if int(transformers.__version__.split(".")[0]) >= 5:
        load_target(model_dirs[0], device="cpu", progress=True)
        assert "Loading weights" in capfd.readouterr().err  # the bar this test is about
    load_target(model_dirs[0], device="cpu", progress=False)
    assert "Loading" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled()
