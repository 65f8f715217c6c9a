"""bench/promote_staged.py: a staged kernel is promoted only when its staged tests passed and the
sanitizer found nothing, and promotion rewrites exactly its line of promoted.h and its row of
docs/ops.md."""
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import promote_staged  # noqa: E402


def write_run(folder, cases, sanitizer_lines):
    os.makedirs(folder, exist_ok=True)
    body = []
    for module, name, outcome in cases:
        inner = {"passed": "", "failed": "<failure message='x'/>", "skipped": "<skipped message='s'/>"}[outcome]
        body.append(f'<testcase classname="python_tests.{module}" name="{name}">{inner}</testcase>')
    with open(os.path.join(folder, "tests.xml"), "w") as f:
        f.write(f'<testsuites><testsuite name="pytest">{"".join(body)}</testsuite></testsuites>')
    with open(os.path.join(folder, "sanitizer.txt"), "w") as f:
        f.write("".join(line + "\n" for line in sanitizer_lines))
    return str(folder)


CLEAN = [f"{op} {tool} 0" for op in promote_staged.OPS for tool in ("memcheck", "racecheck")]


def test_only_ops_whose_staged_tests_and_sanitizer_passed_are_promoted(tmp_path):
    run = write_run(tmp_path / "2027-01-01-run1", [
        ("test_branch_verify", "test_a[cuda-staged-T1.0]", "passed"),
        ("test_branch_verify", "test_a[cuda-T1.0]", "failed"),          # the verified kernel: not this decision
        ("test_mixture_verify", "test_b[cuda-staged]", "passed"),
        ("test_mixture_verify", "test_c[cuda-staged]", "failed"),
        ("test_sample_tokens", "test_d[cuda-staged]", "skipped"),       # nothing ran
        ("test_branch_argmax", "test_graph[staged-bf16]", "passed"),
        ("test_drafter_attention", "test_e[cuda-staged]", "passed"),
    ], [line for line in CLEAN if line != "branch_argmax racecheck 0"] + ["drafter_attention memcheck 1"])
    reasons = promote_staged.decide(run)
    assert reasons["branch_verify"] == []
    assert reasons["mixture_verify"] == ["1 staged tests failed"]
    assert reasons["sample_tokens"] == ["no staged test passed (none ran)"]
    assert reasons["branch_argmax"] == ["racecheck did not run"]
    assert reasons["drafter_attention"] == ["memcheck exited 1"]


def test_promotion_rewrites_the_ops_line_and_row_only(tmp_path):
    header = shutil.copy(promote_staged.PROMOTED_H, tmp_path / "promoted.h")
    doc = shutil.copy(promote_staged.OPS_MD, tmp_path / "ops.md")
    before_h, before_doc = open(header).read(), open(doc).read()
    promote_staged.promote("sample_tokens", "2027-01-01-run1", header, doc)
    after_h, after_doc = open(header).read(), open(doc).read()
    changed = [(a, b) for a, b in zip(before_h.splitlines(), after_h.splitlines()) if a != b]
    assert changed == [("inline constexpr bool kPromotedSampleTokens = false;      // promoted by: none",
                        "inline constexpr bool kPromotedSampleTokens = true;      // promoted by: 2027-01-01-run1")]
    rows = [(a, b) for a, b in zip(before_doc.splitlines(), after_doc.splitlines()) if a != b]
    assert len(rows) == 1 and rows[0][1] == \
        "| `sample_tokens` | `csrc/cuda/staged/sample_tokens.cu` (promoted) | 2027-01-01-run1 | none |"


def test_the_command_reports_and_a_dry_run_changes_nothing(tmp_path):
    run = write_run(tmp_path / "run1", [("test_branch_verify", "t[cuda-staged]", "passed")], CLEAN)
    before = open(promote_staged.PROMOTED_H).read()
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "promote_staged.py"), run, "--dry-run"],
                         capture_output=True, text=True, check=True).stdout
    assert "branch_verify: promoted by run1 (dry run)" in out
    assert "mixture_verify: stays staged (no staged test passed (none ran))" in out
    assert open(promote_staged.PROMOTED_H).read() == before
    missing = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "promote_staged.py"), str(tmp_path)],
                             capture_output=True, text=True)
    assert missing.returncode == 2 and "has no tests.xml" in missing.stderr
