"""bench/promote_staged.py on synthetic device runs (passing, failing, interrupted, mixed
commits): a staged kernel is promoted only when its staged tests passed, no staged case of any
module that may have run it failed, the sanitizer found nothing on at least one of its
multi-block cases, and the tests and the sanitizer ran the same code; promotion rewrites
exactly its line of promoted.h and its row of docs/ops.md."""
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import promote_staged  # noqa: E402

STAMP = dict(commit="0123456789abcdef0123456789abcdef01234567", csrc_sha="feedfacecafe0001", gpu="NVIDIA H100 80GB HBM3")
# one passing staged case of each op's own module
OWN_PASSING = [(module, f"test_real[cuda-staged-V151936-{op}]", "passed")
               for op, (module, _, _) in promote_staged.OPS.items()]


def sanitizer_line(op, tool, exit_code=0, errors=0, passed=2, failed=0):
    cases = ";".join(f"test_real[cuda-staged-V151936-{i}]" for i in range(passed))
    return f"{op} {tool} exit={exit_code} errors={errors} passed={passed} failed={failed} cases={cases}"


CLEAN = [sanitizer_line(op, tool) for op in promote_staged.OPS for tool in ("memcheck", "racecheck")]


def decide(run):
    """promote_staged.decide, with STAMP's commit known to hold STAMP's csrc/."""
    return promote_staged.decide(run, lambda commit: STAMP["csrc_sha"] if commit == STAMP["commit"] else None)


def write_run(folder, cases, sanitizer_lines, tests_stamp=None, sanitizer_stamp=None, stopped_at_limit=False):
    """A run folder as `bench/device_check.sh part1` leaves it."""
    os.makedirs(folder, exist_ok=True)
    stamp = dict(STAMP, **(tests_stamp or {}))
    props = "".join(f'<property name="{k}" value="{v}"/>' for k, v in
                    dict(stamp, exit_code="124" if stopped_at_limit else "0",
                         stopped_at_limit="true" if stopped_at_limit else "false", limit_s="110").items())
    body = []
    for module, name, outcome in cases:
        inner = {"passed": "", "failed": "<failure message='x'/>", "error": "<error message='e'/>",
                 "skipped": "<skipped message='s'/>"}[outcome]
        body.append(f'<testcase classname="python_tests.{module}" name="{name}">{inner}</testcase>')
    with open(os.path.join(folder, "tests-staged.xml"), "w") as f:
        f.write(f'<testsuites><testsuite name="pytest"><properties>{props}</properties>{"".join(body)}'
                f'</testsuite></testsuites>')
    other = dict(STAMP, **(sanitizer_stamp or {}))
    with open(os.path.join(folder, "sanitizer.txt"), "w") as f:
        f.write(f"# commit {other['commit']} csrc_sha {other['csrc_sha']} gpu {other['gpu']}\n")
        f.write("".join(line + "\n" for line in sanitizer_lines))
    return str(folder)


def test_a_clean_run_promotes_every_op(tmp_path):
    run = write_run(tmp_path / "run", OWN_PASSING + [("test_branch_verify", "test_a[cuda-T1.0]", "failed")], CLEAN)
    assert decide(run) == {op: [] for op in promote_staged.OPS}  # a verified-kernel failure: not this


def test_own_failures_missing_runs_and_sanitizer_findings_block_their_op_only(tmp_path):
    sanitizer = [line for line in CLEAN if not line.startswith("branch_argmax racecheck")
                 and not line.startswith("drafter_attention memcheck") and not line.startswith("sample_tokens memcheck")]
    sanitizer += [sanitizer_line("drafter_attention", "memcheck", exit_code=99, errors=3),
                  sanitizer_line("sample_tokens", "memcheck", passed=0)]
    cases = [c for c in OWN_PASSING if c[0] != "test_sample_tokens"] + [
        ("test_mixture_verify", "test_c[cuda-staged]", "failed"),
        ("test_sample_tokens", "test_d[cuda-staged]", "skipped"),
        ("test_branch_argmax", "test_graph[staged-bf16]", "passed"),
    ]
    reasons = decide(write_run(tmp_path / "run", cases, sanitizer))
    assert reasons["branch_verify"] == []
    assert reasons["mixture_verify"] == [
        "1 staged cases that may run its kernel failed (test_mixture_verify::test_c[cuda-staged])"]
    assert reasons["sample_tokens"] == ["no staged test of its own module passed (none ran)",
                                        "memcheck passed no case"]
    assert reasons["branch_argmax"] == ["racecheck did not run"]
    assert reasons["drafter_attention"] == ["memcheck exited 99", "memcheck reported 3 errors"]


def test_a_staged_failure_in_another_module_blocks_the_ops_it_may_have_run(tmp_path):
    cases = OWN_PASSING + [
        ("test_ops_compile", "test_compiled[cuda-staged-sample_tokens]", "failed"),      # names its op
        ("test_tree_verification", "test_trie_walk[cuda-staged-T0.7]", "error"),          # names none: every op
        ("test_drafter", "test_block[cuda-bf16]", "failed"),                              # verified kernels
        ("test_slot_cache", "test_no_params", "failed"),                                  # not parametrised staged
    ]
    reasons = decide(write_run(tmp_path / "run", cases, CLEAN))
    everywhere = "test_tree_verification::test_trie_walk[cuda-staged-T0.7]"
    assert reasons["sample_tokens"] == [f"2 staged cases that may run its kernel failed "
                                        f"(test_ops_compile::test_compiled[cuda-staged-sample_tokens], {everywhere})"]
    for op in ("branch_verify", "mixture_verify", "branch_argmax", "drafter_attention"):
        assert reasons[op] == [f"1 staged cases that may run its kernel failed ({everywhere})"]


def test_an_interrupted_run_promotes_nothing(tmp_path):
    run = write_run(tmp_path / "run", OWN_PASSING, CLEAN, stopped_at_limit=True)
    for why in decide(run).values():
        assert why == ["the staged tests stopped at their time limit (or say nothing of it): not every staged "
                       "case ran"]


def test_tests_and_sanitizer_from_different_code_promote_nothing(tmp_path):
    other_commit = write_run(tmp_path / "commit", OWN_PASSING, CLEAN, sanitizer_stamp=dict(commit="1" * 40))
    other_tree = write_run(tmp_path / "tree", OWN_PASSING, CLEAN, sanitizer_stamp=dict(csrc_sha="0" * 16))
    for run in (other_commit, other_tree):
        for why in decide(run).values():
            assert len(why) == 1 and why[0].startswith("tests and sanitizer ran different code")
    unknown = write_run(tmp_path / "unknown", OWN_PASSING, CLEAN, tests_stamp=dict(commit="unknown"),
                        sanitizer_stamp=dict(commit="unknown"))
    assert all(why == ["the staged tests name no commit (set DBLAST_COMMIT on a machine without .git)"]
               for why in decide(unknown).values())


def test_a_run_of_other_kernels_than_its_commits_promotes_nothing(tmp_path):
    run = write_run(tmp_path / "run", OWN_PASSING, CLEAN)
    for why in promote_staged.decide(run, lambda commit: "0" * 16).values():
        assert why == [f"the machine's csrc/ ({STAMP['csrc_sha']}) is not commit {STAMP['commit'][:12]}'s "
                       f"({'0' * 16}): uncommitted kernels ran"]
    for why in promote_staged.decide(run, lambda commit: None).values():
        assert why == [f"commit {STAMP['commit']} is not in this clone: its csrc/ cannot be compared with the run's"]


def head_commit():
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("needs the git clone")


def test_the_commits_csrc_hash_is_the_one_the_device_computes(tmp_path):
    """device_check.sh hashes csrc/ on the machine (no .git there); promote_staged.py hashes the
    named commit's csrc/ from git: the same committed files give the same hash."""
    head = head_commit()
    command = re.search(r"^CSRC_SHA=\$\((.*)\)$", open(os.path.join(ROOT, "bench", "device_check.sh")).read(),
                        re.M).group(1)
    archive = subprocess.run(["git", "archive", head, "csrc"], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x"], input=archive, cwd=tmp_path, check=True)
    on_the_machine = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True,
                                    check=True).stdout.strip()
    assert promote_staged.commit_csrc_sha(head) == on_the_machine and len(on_the_machine) == 16
    assert promote_staged.commit_csrc_sha("0" * 40) is None


def test_a_report_without_a_stamp_or_sanitizer_promotes_nothing(tmp_path):
    folder = tmp_path / "bare"
    folder.mkdir()
    (folder / "tests-staged.xml").write_text(
        '<testsuites><testsuite name="pytest"><testcase classname="python_tests.test_sample_tokens" '
        'name="t[cuda-staged]"/></testsuite></testsuites>')
    reasons = decide(str(folder))["sample_tokens"]
    assert reasons[:3] == ["the staged tests name no commit (set DBLAST_COMMIT on a machine without .git)",
                           "the staged tests stopped at their time limit (or say nothing of it): not every staged "
                           "case ran", "sanitizer.txt names no commit"]
    assert "memcheck did not run" in reasons and "racecheck did not run" in reasons


def test_the_device_checks_writers_give_what_the_decision_reads(tmp_path):
    """device_check.sh stamps pytest's report and writes sanitizer.txt through promote_staged.py:
    a report as pytest writes it, stamped, and lines made from sanitizer output and JUnit."""
    run = tmp_path / "run"
    run.mkdir()
    report = run / "tests-staged.xml"
    report.write_text('<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests"><testsuite '
                      'name="pytest" errors="0" failures="0" skipped="0" tests="5">' + "".join(
                          f'<testcase classname="python_tests.{module}" name="{name}" time="0.1"/>'
                          for module, name, _ in OWN_PASSING) + "</testsuite></testsuites>")
    promote_staged.stamp_junit(str(report), STAMP["commit"], STAMP["csrc_sha"], STAMP["gpu"], 0, 110)
    lines = []
    for op in promote_staged.OPS:
        for tool in ("memcheck", "racecheck"):
            log, xml = tmp_path / f"{op}-{tool}.log", tmp_path / f"{op}-{tool}.xml"
            clean = not (op == "mixture_verify" and tool == "racecheck")  # this one ran out of time
            log.write_text("========= COMPUTE-SANITIZER\n2 passed, 1 deselected in 3.10s\n"
                           + ("========= ERROR SUMMARY: 0 errors\n" if clean else ""))
            xml.write_text('<testsuites><testsuite name="pytest">'
                           '<testcase classname="python_tests.m" name="test_real[cuda-staged-V151936-T0.7-k20-p0.9]"/>'
                           '<testcase classname="python_tests.m" name="test_ties[cuda-staged-k100]"/>'
                           '<testcase classname="python_tests.m" name="test_x[cuda-staged]"><skipped/></testcase>'
                           "</testsuite></testsuites>")
            lines.append(promote_staged.sanitizer_line(op, tool, 0 if clean else 124, str(log), str(xml)))
    assert lines[0] == ("branch_verify memcheck exit=0 errors=0 passed=2 failed=0 "
                        "cases=test_real[cuda-staged-V151936-T0.7-k20-p0.9];test_ties[cuda-staged-k100]")
    (run / "sanitizer.txt").write_text(f"# commit {STAMP['commit']} csrc_sha {STAMP['csrc_sha']} gpu {STAMP['gpu']}\n"
                                       + "".join(line + "\n" for line in lines))
    reasons = decide(str(run))
    assert reasons["mixture_verify"] == ["racecheck exited 124", "racecheck did not finish (no error summary)"]
    assert all(why == [] for op, why in reasons.items() if op != "mixture_verify")
    # pytest never wrote a report (killed): the stamped empty report promotes nothing
    report.unlink()
    promote_staged.stamp_junit(str(report), STAMP["commit"], STAMP["csrc_sha"], STAMP["gpu"], 124, 110)
    assert all("the staged tests stopped at their time limit (or say nothing of it): not every staged case ran"
               in why for why in decide(str(run)).values())


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
    head = head_commit()
    committed = dict(commit=head, csrc_sha=promote_staged.commit_csrc_sha(head))
    run = write_run(tmp_path / "run1", [("test_branch_verify", "t[cuda-staged]", "passed")], CLEAN,
                    tests_stamp=committed, sanitizer_stamp=committed)
    before = open(promote_staged.PROMOTED_H).read()
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "promote_staged.py"), run, "--dry-run"],
                         capture_output=True, text=True, check=True).stdout
    assert "branch_verify: promoted by run1 (dry run)" in out
    assert "mixture_verify: stays staged (no staged test of its own module passed (none ran))" in out
    assert open(promote_staged.PROMOTED_H).read() == before
    missing = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "promote_staged.py"), str(tmp_path)],
                             capture_output=True, text=True)
    assert missing.returncode == 2 and "has no tests-staged.xml" in missing.stderr
