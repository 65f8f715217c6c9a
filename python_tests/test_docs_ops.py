"""docs/ops.md is right: each of its Python examples runs as written, on its own (a reader may
paste any one section), and its relative links resolve."""
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "ops.md")
OPS = ("branch_verify", "mixture_verify", "sample_tokens", "branch_argmax", "drafter_attention")


def read():
    with open(PAGE) as f:
        return f.read()


EXAMPLES = re.findall(r"```python\n(.*?)```", read(), flags=re.S)


def test_every_op_has_an_example():
    assert len(EXAMPLES) >= len(OPS)
    for op in OPS:
        assert any(f"ops.{op}(" in block for block in EXAMPLES), f"docs/ops.md has no example calling ops.{op}"


@pytest.mark.parametrize("index", range(len(EXAMPLES)))
def test_example_runs(index):
    block = EXAMPLES[index]
    exec(compile(block, f"{PAGE} (example {index + 1})", "exec"), {"__name__": "__doc_example__"})


def test_links_resolve():
    text = read()
    headings = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                for h in re.findall(r"^#+ (.*)$", text, flags=re.M)}
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        path, _, anchor = target.partition("#")
        if path:
            assert os.path.exists(os.path.join(os.path.dirname(PAGE), path)), f"link {target} leads nowhere"
        else:
            assert anchor in headings, f"docs/ops.md has no heading #{anchor}"
