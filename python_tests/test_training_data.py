"""`dblast data generate` / dblast_ext.training.data on tiny random targets: the stored
log-probabilities are the target's filtered ones, batching and resuming do not change the
records, the sampled tokens follow the filtered distribution, and bad flags fail clearly."""
import json
import re

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from dblast_ext import reference  # noqa: E402
from dblast_ext.cli import main  # noqa: E402
from dblast_ext.sampling import SamplingParams  # noqa: E402
from dblast_ext.eval.datasets import chat_messages, load_prompts  # noqa: E402
from dblast_ext.target.loading import encode_messages, load_target  # noqa: E402
from dblast_ext.training.data import generate_training_data, read_training_data  # noqa: E402
from losslessness import chi_square_pvalue  # noqa: E402
from tiny_models import write_tiny_target_dir  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models, one thread

EOS = 1
SAMPLING = SamplingParams(temperature=0.8, top_k=30, top_p=0.9)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    target = write_tiny_target_dir(root / "target", eos_id=EOS)
    prompts_file = root / "alpha.jsonl"
    lines = [{"prompt": "t5 t6 t7 t8"}, {"id": "q", "messages": [{"role": "user", "content": "t20 t21"},
                                                                  {"role": "assistant", "content": "t22"},
                                                                  {"role": "user", "content": "t23"}]},
             {"prompt": "t9"}]
    prompts_file.write_text("".join(json.dumps(line) + "\n" for line in lines))
    model, tokenizer = load_target(target, device="cpu", dtype="float32")
    return root, target, str(prompts_file), model, tokenizer


def generate(setup, out, *, sampling=SAMPLING, samples=2, max_new_tokens=10, batch_size=3, seed=0):
    _, _, prompts_file, model, tokenizer = setup
    return generate_training_data(model, tokenizer, load_prompts(prompts_file), str(out), sampling=sampling,
                                  samples_per_prompt=samples, max_new_tokens=max_new_tokens,
                                  batch_size=batch_size, seed=seed, progress=False)


def key(r):
    return (r["dataset"], r["prompt_id"], r["sample"], tuple(r["input_ids"]), r["eos_terminated"])


def test_records_hold_the_targets_filtered_logprobs(setup):
    root, _, prompts_file, model, tokenizer = setup
    out = root / "logprobs.jsonl"
    records = generate(setup, out, samples=2, max_new_tokens=10)
    assert read_training_data(str(out)) == records
    prompts = load_prompts(prompts_file)
    assert [(r["prompt_id"], r["sample"]) for r in records] == [(p.prompt_id, s) for p in prompts for s in (0, 1)]
    for r, prompt in zip(records, [p for p in prompts for _ in (0, 1)]):
        prompt_ids = encode_messages(tokenizer, chat_messages(prompt, 0))  # the first user turn only
        n = len(prompt_ids)
        ids = r["input_ids"]
        assert ids[:n] == prompt_ids and r["dataset"] == "alpha"
        assert len(ids) == len(r["loss_mask"]) == len(r["target_logprobs"])
        assert r["loss_mask"] == [0] * n + [1] * (len(ids) - n)
        assert r["target_logprobs"][:n] == [0.0] * n
        response = ids[n:]
        assert 1 <= len(response) <= 10
        assert r["eos_terminated"] == (response[-1] == EOS) and EOS not in response[:-1]
        assert r["eos_terminated"] or len(response) == 10
        assert r["sampling"] == {"temperature": 0.8, "top_k": 30, "top_p": 0.9, "max_new_tokens": 10, "seed": 0}
        # recomputed without padding or cache: logits[t - 1] of one causal forward is p(. | ids[:t])
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
        probs = reference.filter_target_probs(logits, **SAMPLING.kwargs())
        expected = [float(probs[t - 1, ids[t]].log()) for t in range(n, len(ids))]
        np.testing.assert_allclose(r["target_logprobs"][n:], expected, atol=1e-4)


def test_greedy_responses_equal_hf_generate(setup):
    root, _, prompts_file, model, tokenizer = setup
    records = generate(setup, root / "greedy.jsonl", sampling=SamplingParams(0.0, 0, 1.0), samples=1,
                       max_new_tokens=16)
    for r, prompt in zip(records, load_prompts(prompts_file)):
        prompt_ids = encode_messages(tokenizer, chat_messages(prompt, 0))
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids),
                                                                                       dtype=torch.int64),
                                 do_sample=False, max_new_tokens=16, eos_token_id=EOS, pad_token_id=0)
        response = out[0, len(prompt_ids):].tolist()
        if EOS in response:
            response = response[: response.index(EOS) + 1]
        assert r["input_ids"] == prompt_ids + response
        assert r["target_logprobs"] == [0.0] * len(r["input_ids"])  # greedy: every token has p = 1


def test_batch_size_seed_and_sample_index(setup):
    root = setup[0]
    by_one = generate(setup, root / "bs1.jsonl", batch_size=1)
    by_three = generate(setup, root / "bs3.jsonl", batch_size=3)
    again = generate(setup, root / "bs3-again.jsonl", batch_size=3)
    by_four = generate(setup, root / "bs4.jsonl", batch_size=4)  # a partial last batch
    assert [key(r) for r in by_one] == [key(r) for r in by_three] == [key(r) for r in again] \
        == [key(r) for r in by_four]
    for a, b in zip(by_one, by_three):
        np.testing.assert_allclose(a["target_logprobs"], b["target_logprobs"], atol=1e-5)
    assert (root / "bs3.jsonl").read_text() == (root / "bs3-again.jsonl").read_text()
    for first, second in zip(by_three[0::2], by_three[1::2]):  # samples 0 and 1 of each prompt
        assert first["prompt_id"] == second["prompt_id"] and first["input_ids"] != second["input_ids"]
    other_seed = generate(setup, root / "seed1.jsonl", seed=1)
    assert all(a["input_ids"] != b["input_ids"] for a, b in zip(by_three, other_seed))


def test_resume_settings_mismatch_and_cut_line(setup):
    root = setup[0]
    full_path, resumed_path = root / "full.jsonl", root / "resumed.jsonl"
    full = generate(setup, full_path)
    lines = full_path.read_text().splitlines(keepends=True)
    assert len(lines) == 6
    resumed_path.write_text("".join(lines[:2]))
    resumed = generate(setup, resumed_path, batch_size=2)
    assert [key(r) for r in resumed] == [key(r) for r in full]
    resumed_lines = resumed_path.read_text().splitlines(keepends=True)
    assert resumed_lines[:2] == lines[:2] and len(resumed_lines) == 6  # kept, not regenerated
    assert sorted(key(r) for r in read_training_data(str(resumed_path))) == sorted(key(r) for r in full)
    assert [key(r) for r in generate(setup, resumed_path)] == [key(r) for r in full]  # all done: no-op
    assert len(resumed_path.read_text().splitlines()) == 6

    with pytest.raises(ValueError, match="other sampling settings"):
        generate(setup, full_path, sampling=SamplingParams(0.5, 30, 0.9))
    with pytest.raises(ValueError, match="other sampling settings"):
        generate(setup, full_path, max_new_tokens=11)
    cut = root / "cut.jsonl"
    cut.write_text("".join(lines[:2]) + lines[2][:25])
    with pytest.raises(ValueError, match=r"cut\.jsonl: line 3 is not valid JSON.*cut short"):
        generate(setup, cut)


@pytest.mark.parametrize("change,message", [
    (lambda r: r.pop("target_logprobs"), "line 2: missing field(s) target_logprobs"),
    (lambda r: r["loss_mask"].pop(), "line 2: input_ids, loss_mask and target_logprobs must have equal lengths"),
    (lambda r: r["loss_mask"].__setitem__(0, 2), "line 2: 'loss_mask' must hold only 0 and 1"),
    (lambda r: r["target_logprobs"].__setitem__(0, -1.5), "line 2: target_logprobs[0] = -1.5 at a prompt"),
])
def test_read_training_data_names_file_and_line(setup, change, message):
    root = setup[0]
    source = root / "valid.jsonl"
    if not source.exists():
        generate(setup, source, samples=1, max_new_tokens=3)
    records = [json.loads(line) for line in source.read_text().splitlines()]
    change(records[1])
    bad = root / "invalid.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(ValueError, match=re.escape(f"invalid.jsonl: {message}")):
        read_training_data(str(bad))


def test_first_tokens_follow_the_filtered_distribution(tmp_path):
    """400 samples of one prompt on a 16-token target: the first response token's counts fit
    the filtered distribution (temperature, top-k and top-p all active) and not the unfiltered one."""
    target = write_tiny_target_dir(tmp_path / "small", vocab_size=16, eos_id=EOS)
    model, tokenizer = load_target(target, device="cpu", dtype="float32")
    prompts_file = tmp_path / "one.jsonl"
    prompts_file.write_text(json.dumps({"prompt": "t5 t6 t7"}) + "\n")
    sampling = SamplingParams(temperature=0.1, top_k=8, top_p=0.9)
    n = 400
    records = generate_training_data(model, tokenizer, load_prompts(str(prompts_file)), str(tmp_path / "d.jsonl"),
                                     sampling=sampling, samples_per_prompt=n, max_new_tokens=1, batch_size=100,
                                     seed=3, progress=False)
    prompt_ids = encode_messages(tokenizer, [{"role": "user", "content": "t5 t6 t7"}])
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids])).logits[0, -1]
    filtered = reference.filter_target_probs(logits, **sampling.kwargs()).numpy()
    unfiltered = reference.filter_target_probs(logits, 0.1).numpy()
    assert 4 <= (filtered > 0).sum() < 16  # a real filter, several tokens left
    firsts = np.array([r["input_ids"][len(prompt_ids)] for r in records])
    counts = np.bincount(firsts, minlength=16)
    assert counts[filtered == 0].sum() == 0
    for r, token in zip(records, firsts):
        assert r["target_logprobs"][-1] == pytest.approx(np.log(filtered[token]), abs=1e-5)
    assert chi_square_pvalue(counts, filtered * n) > 1e-3
    assert chi_square_pvalue(counts, unfiltered * n) < 1e-3  # the test can tell the filter apart


# ---------------------------------------------------------------------------------------------
# the command line


def cli_args(setup, out, *extra):
    _, target, prompts_file, _, _ = setup
    return ["data", "generate", "--target", target, "--prompts", prompts_file, "--out", str(out),
            "--max-new-tokens", "6", "--no-progress", *extra]


def test_cli_generates_and_resumes(setup, capsys):
    root = setup[0]
    out = root / "cli" / "train.jsonl"  # the parent is created
    assert main(cli_args(setup, out, "--samples-per-prompt", "2", "--batch-size", "4", "--seed", "7")) == 0
    records = read_training_data(str(out))
    assert len(records) == 6 and "6 sequences" in capsys.readouterr().out
    assert all(r["sampling"] == {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "max_new_tokens": 6, "seed": 7}
               for r in records)
    text = out.read_text()
    assert main(cli_args(setup, out, "--samples-per-prompt", "2", "--batch-size", "1", "--seed", "7")) == 0
    assert out.read_text() == text  # everything was there already
    assert main(cli_args(setup, out, "--samples-per-prompt", "3", "--seed", "7")) == 0
    assert len(read_training_data(str(out))) == 9 and out.read_text().startswith(text)
    limited = root / "cli" / "limited.jsonl"
    assert main(cli_args(setup, limited, "--num-prompts", "1", "--seed", "7")) == 0
    assert [key(r) for r in read_training_data(str(limited))] == [key(records[0])]


@pytest.mark.parametrize("change,message", [
    (["--samples-per-prompt", "0"], "--samples-per-prompt"),
    (["--batch-size", "0"], "--batch-size"),
    (["--max-new-tokens", "-1"], "--max-new-tokens"),
    (["--temperature", "-0.5"], "--temperature"),
    (["--top-p", "0"], "--top-p"),
    (["--top-p", "1.5"], "--top-p"),
    (["--num-prompts", "0"], "--num-prompts"),
    (["--dtype", "float8"], "--dtype"),
    (["--target", "/no/such/target"], "--target"),
    (["--prompts", "nosuch.jsonl"], "--prompts"),
    (["--seed", "1"], "other sampling settings"),
])
def test_bad_arguments_fail_before_loading_the_target(setup, capsys, monkeypatch, change, message):
    root = setup[0]
    existing = root / "existing.jsonl"
    if not existing.exists():
        assert main(cli_args(setup, existing, "--num-prompts", "1")) == 0
    capsys.readouterr()

    def no_loading(*args, **kwargs):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr("dblast_ext.cli.data.load_target", no_loading)
    assert main(cli_args(setup, existing, "--num-prompts", "1", *change)) == 2
    err = capsys.readouterr().err
    assert err.startswith("dblast data: error:") and message in err and err.count("\n") == 1


def test_cli_cut_line_is_named(setup, capsys):
    root = setup[0]
    out = root / "cut-cli.jsonl"
    assert main(cli_args(setup, out)) == 0
    lines = out.read_text().splitlines(keepends=True)
    out.write_text(lines[0] + lines[1][:30])
    capsys.readouterr()
    assert main(cli_args(setup, out)) == 2
    assert "line 2 is not valid JSON" in capsys.readouterr().err
