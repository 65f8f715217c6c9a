"""Every bad value named (issue 47): the sampling settings by one rule wherever they enter (the API,
the CLI, the ops' wrappers, the C++ host checks, a vLLM run's spec), prompts and stop ids checked
against the target's vocabulary before any model runs, and damaged checkpoint files named with
what is wrong with them. Each case asserts the error names the argument (or file) and the value."""
import json
import os
import shutil

import numpy
import pytest
import torch

import dblast_ext  # noqa: F401  (registers the ops)
from dblast_ext import load_drafter, ops
from dblast_ext.cli import main
from dblast_ext.drafting.drafter_io import checkpoint_digest
from dblast_ext.sampling import SamplingParams, check_top_k
from dblast_ext.target.loading import load_target
from dblast_ext.vllm.offline import check_spec_sampling
from decoding_cases import PROMPT, make_decoder
from tiny_models import VOCAB, write_dflash_checkpoint, write_tiny_target_dir

# ------------------------------------------------------------------------------------------------
# sampling settings: one rule, every entry point

BAD_SETTINGS = [
    (dict(top_p=1.5), "top_p", "1.5"), (dict(top_p=0.0), "top_p", "0.0"), (dict(top_p=float("nan")), "top_p", "nan"),
    (dict(top_k=-3), "top_k", "-3"), (dict(top_k=-1), "top_k", "-1"), (dict(top_k=2.5), "top_k", "2.5"),
    (dict(top_k=True), "top_k", "True"), (dict(temperature=-0.5), "temperature", "-0.5"),
    (dict(temperature=float("inf")), "temperature", "inf"), (dict(temperature="0.7"), "temperature", "'0.7'"),
]


@pytest.mark.parametrize("kwargs,name,value", BAD_SETTINGS)
def test_sampling_params_name_the_setting_and_the_value(kwargs, name, value):
    with pytest.raises(ValueError, match=rf"^{name} must .*got {value}$"):
        SamplingParams(**kwargs)


def test_the_documented_off_values_are_accepted():
    params = SamplingParams(temperature=0, top_k=0, top_p=1)
    assert (params.temperature, params.top_k, params.top_p) == (0.0, 0, 1.0)
    assert check_top_k(numpy.int64(5)) == 5  # a numpy integer is an integer


@pytest.mark.parametrize("kwargs,name,value", [s for s in BAD_SETTINGS if s[1] != "temperature" or "'" not in s[2]])
def test_the_ops_wrappers_refuse_before_a_kernel_runs(kwargs, name, value):
    logits = torch.randn(3, 50)
    with pytest.raises(ValueError, match=rf"{name} must .*got {value}"):
        ops.sample_tokens(logits, torch.rand(3, dtype=torch.float64), **kwargs)
    verify = {**dict(temperature=1.0, top_k=0, top_p=1.0), **kwargs}
    with pytest.raises(ValueError, match=rf"{name} must .*got {value}"):
        ops.branch_verify(torch.randn(2, 4, 50), torch.zeros(2, 1, 3, dtype=torch.int64), torch.ones(2, 1),
                          torch.zeros(2, dtype=torch.int64), **verify)


@pytest.mark.parametrize("top_k,top_p,message", [(-1, 1.0, "top_k must be an integer >= 0 (0 = off), got -1"),
                                                  (0, 1.5, "top_p must be a number in (0, 1] (1 = off), got 1.5")])
def test_the_host_checks_of_a_direct_op_call_say_the_same(top_k, top_p, message):
    logits = torch.randn(3, 50)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        torch.ops.dblast.sample_tokens(logits, torch.rand(3, dtype=torch.float64), 1.0, top_k, top_p,
                                       torch.empty(3, 0, dtype=torch.int64), True)


@pytest.mark.parametrize("spec,name", [(dict(temperature=0.7, top_k=-3), "spec top_k"),
                                       (dict(temperature=0.7, top_p=1.5), "spec top_p"),
                                       (dict(temperature=-1), "spec temperature"), (dict(), "spec temperature")])
def test_a_vllm_run_spec_is_checked_before_an_engine_starts(spec, name):
    with pytest.raises(ValueError, match=rf"^{name} must"):
        check_spec_sampling(spec)


# ------------------------------------------------------------------------------------------------
# prompts and stop ids


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    decoder = make_decoder(tmp_path_factory.mktemp("bad-values"), branches=2)
    calls = []
    decoder.target.model.register_forward_pre_hook(lambda module, args: calls.append(1))
    decoder.forward_calls = calls
    return decoder


def entry_points(decoder):
    """(name, call(prompt, stops)) of every generation entry point, one prompt each."""
    return {
        "generate": lambda p, s: decoder.generate(p, max_new_tokens=4, stop_token_ids=s),
        "generate_batch": lambda p, s: decoder.generate_batch([PROMPT, p], max_new_tokens=4, stop_token_ids=s),
        "generate_autoregressive": lambda p, s: decoder.generate_autoregressive(p, max_new_tokens=4, stop_token_ids=s),
        "generate_autoregressive_batch": lambda p, s: decoder.generate_autoregressive_batch(
            [PROMPT, p], max_new_tokens=4, stop_token_ids=s),
    }


ENTRY_POINTS = ["generate", "generate_batch", "generate_autoregressive", "generate_autoregressive_batch"]
BAD_PROMPTS = [
    (torch.tensor([1.5, 2.0]), r"must hold integer token ids, got float32 values"),
    ([3, 2.5, 4], r"must hold integer token ids, got (float32 values|2.5 at position 1)"),
    (torch.tensor([True, False]), r"must hold integer token ids, got bool values"),
    ([3, 17, VOCAB + 5, 8], rf"token id {VOCAB + 5} at position 2 is outside the target's vocabulary \[0, {VOCAB}\)"),
    (torch.tensor([3, -1]), rf"token id -1 at position 1 is outside the target's vocabulary \[0, {VOCAB}\)"),
    ("hello", r"must be token ids"),
]


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("prompt,message", BAD_PROMPTS)
def test_a_bad_prompt_is_named_before_any_model_runs(decoder, entry, prompt, message):
    decoder.forward_calls.clear()
    where = r"prompts\[1\]: input_ids" if entry.endswith("batch") else "input_ids"
    with pytest.raises(ValueError, match=rf"^{where}.*{message}"):
        entry_points(decoder)[entry](prompt, None)
    assert not decoder.forward_calls


def test_trie_verification_checks_the_prompt_too(tmp_path):
    decoder = make_decoder(tmp_path, branches=2, verify="tree")
    with pytest.raises(ValueError, match=rf"^input_ids: token id {VOCAB} at position 0 is outside"):
        decoder.generate([VOCAB, 3], max_new_tokens=4)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("stops,message", [
    ([1, VOCAB], rf"stop_token_ids\[1\] = {VOCAB} is outside the target's vocabulary \[0, {VOCAB}\)"),
    ([-2], r"stop_token_ids\[0\] = -2 is outside"), ([1.5], "stop_token_ids must hold integer token ids"),
    (7, "stop_token_ids must be a list of token ids, got 7"),
])
def test_a_bad_stop_id_is_named_before_any_model_runs(decoder, entry, stops, message):
    decoder.forward_calls.clear()
    with pytest.raises(ValueError, match=rf"^{message}"):
        entry_points(decoder)[entry](PROMPT, stops)
    assert not decoder.forward_calls


def test_good_prompts_and_stops_still_generate(decoder):
    out = decoder.generate(torch.tensor(PROMPT, dtype=torch.int32), max_new_tokens=4, stop_token_ids=(VOCAB - 1,))
    assert 1 <= len(out.token_ids) <= 4


# ------------------------------------------------------------------------------------------------
# damaged checkpoints


def damaged_drafter(tmp_path, damage):
    path = write_dflash_checkpoint(tmp_path / "drafter")
    damage(path)
    return path


def truncate(file, keep=0.5):
    data = open(file, "rb").read()
    with open(file, "wb") as f:
        f.write(data[:int(len(data) * keep)])


def rewrite_config(path, **fields):
    file = os.path.join(path, "config.json")
    config = json.load(open(file))
    config.update(fields)
    json.dump(config, open(file, "w"))


DRAFTER_DAMAGE = {
    "config not JSON": (lambda p: open(os.path.join(p, "config.json"), "w").write("{'hidden_size': 64"),
                        "config.json: not valid JSON"),
    "config a list": (lambda p: open(os.path.join(p, "config.json"), "w").write("[1, 2]"),
                      "config.json: must hold a JSON object, got list"),
    "hidden size a string": (lambda p: rewrite_config(p, hidden_size="64"),
                             "config.json: drafter config.json hidden_size must be a positive integer, got '64'"),
    "mask outside the vocabulary": (lambda p: rewrite_config(p, dflash_config={"mask_token_id": 500,
                                                                               "target_layer_ids": [1, 4]}),
                                    "mask_token_id must be a token id in [0, 100), got 500"),
    "layer ids not a list": (lambda p: rewrite_config(p, dflash_config={"mask_token_id": 97, "target_layer_ids": 3}),
                             "target_layer_ids must be a non-empty list of layer indices >= 0, got 3"),
    "truncated weights": (lambda p: truncate(os.path.join(p, "model.safetensors")),
                          "model.safetensors: not a readable safetensors file"),
    "weights not safetensors": (lambda p: open(os.path.join(p, "model.safetensors"), "wb").write(b"PK\x03\x04zip"),
                                "model.safetensors: not a readable safetensors file"),
    "weights of another size": (lambda p: rewrite_config(p, intermediate_size=96),
                                "model.safetensors does not match"),
}


@pytest.mark.parametrize("case", sorted(DRAFTER_DAMAGE))
def test_a_damaged_drafter_checkpoint_names_the_file(tmp_path, case):
    damage, message = DRAFTER_DAMAGE[case]
    path = damaged_drafter(tmp_path, damage)
    with pytest.raises(ValueError) as error:
        load_drafter(path)
    assert message in str(error.value) and str(tmp_path) in str(error.value), str(error.value)
    if "size" not in case:  # the digest reads the same files
        with pytest.raises(ValueError, match="config.json|model.safetensors"):
            checkpoint_digest(path)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return write_tiny_target_dir(tmp_path_factory.mktemp("bad-target") / "target")


@pytest.mark.parametrize("file,damage,message", [
    ("config.json", "not json", "config.json: not valid JSON"),
    ("model.safetensors", "truncate", "model.safetensors: not a readable safetensors file"),
    ("tokenizer.json", "not json", "tokenizer.json: not valid JSON"),
    ("tokenizer_config.json", "not json", "tokenizer_config.json: not valid JSON"),
    ("generation_config.json", "list", "generation_config.json: must hold a JSON object"),
])
def test_a_damaged_target_directory_names_the_file(target_dir, tmp_path, file, damage, message):
    copy = shutil.copytree(target_dir, tmp_path / "target")
    if damage == "truncate":
        truncate(copy / file, 0.3)
    else:
        (copy / file).write_text("[1]" if damage == "list" else '{"model_type": ')
    with pytest.raises(ValueError) as error:
        load_target(str(copy), device="cpu", progress=False)
    assert message in str(error.value) and str(copy) in str(error.value), str(error.value)


# ------------------------------------------------------------------------------------------------
# the command line: exit 2, one line

def one_error_line(capsys, needle):
    """The one `dblast ...: error:` line of stderr (other lines are progress and notes), holding
    `needle`."""
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("dblast ") and ": error: " in line]
    assert len(errors) == 1 and needle in errors[0], err
    return errors[0]


@pytest.mark.parametrize("flags,needle", [
    (["--top-k", "-1"], "--top-k must be an integer >= 0 (0 = off), got -1"),
    (["--top-p", "1.5"], "--top-p must be a number in (0, 1] (1 = off), got 1.5"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0 (0 = greedy), got nan"),
])
@pytest.mark.parametrize("subcommand", [["generate", "--prompt", "t5"], ["demo"], ["eval", "--datasets", "gsm8k"]])
def test_the_cli_names_a_bad_sampling_flag_in_one_line(target_dir, tmp_path, capsys, flags, needle, subcommand):
    drafter = write_dflash_checkpoint(tmp_path / "drafter")
    model = [] if subcommand == ["demo"] else ["--target", target_dir, "--drafter", drafter]
    extra = ["--out", str(tmp_path / "out")] if subcommand[0] == "eval" else []
    assert main([*subcommand, *model, *extra, *flags]) == 2
    assert one_error_line(capsys, needle)


@pytest.mark.parametrize("case", ["config not JSON", "truncated weights"])
def test_the_cli_names_a_damaged_drafter_in_one_line(target_dir, tmp_path, capsys, case):
    damage, message = DRAFTER_DAMAGE[case]
    drafter = damaged_drafter(tmp_path, damage)
    assert main(["generate", "--target", target_dir, "--drafter", drafter, "--prompt", "t5", "--max-new-tokens", "2",
                 "--device", "cpu"]) == 2
    assert drafter in one_error_line(capsys, message)


def test_the_cli_names_a_damaged_target_in_one_line(target_dir, tmp_path, capsys):
    copy = shutil.copytree(target_dir, tmp_path / "target")
    (copy / "tokenizer.json").write_text("{")
    drafter = write_dflash_checkpoint(tmp_path / "drafter")
    assert main(["generate", "--target", str(copy), "--drafter", drafter, "--prompt", "t5", "--device", "cpu"]) == 2
    assert one_error_line(capsys, "tokenizer.json: not valid JSON")
