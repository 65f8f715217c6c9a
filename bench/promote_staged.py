"""Promotes the staged CUDA kernels that passed a device run (docs/ops.md, "CUDA kernels:
verified and staged").

    python bench/promote_staged.py bench/device_runs/<run>            # promote what passed
    python bench/promote_staged.py bench/device_runs/<run> --dry-run  # only say what would be

It reads what `bench/device_check.sh part1` writes: tests-staged.xml (pytest's JUnit report of
every test that ran the staged kernels, stamped with the commit, a hash of csrc/, the GPU and
whether the stage hit its time limit) and sanitizer.txt (its first line the same stamp, then
one line per op and tool: `<op> <tool> exit=<code> errors=<n> passed=<n> failed=<n> cases=...`).
A staged kernel is promoted when, on that run:
  - the tests and the sanitizer name the same commit and csrc/ hash (and a commit at all), that
    hash is the one of the commit's csrc/ in this clone (the machine ran the committed
    kernels), and the staged tests finished inside their limit (else not every staged case ran);
  - no staged case failed that may have run the op's kernel: a case of the op's own test
    module, a case of another module whose id names the op, or a case of another module that
    names no op (it may have run any kernel: it blocks every op);
  - at least one staged case of the op's own module passed;
  - memcheck and racecheck each exited 0 with 0 errors over the op's multi-block cases, at
    least one of which passed and none failed.
Promotion sets the op's constant in csrc/cuda/staged/promoted.h (the staged kernel then serves
the op by default, on GPUs that can run it) and its row of the table in docs/ops.md, each
naming the run. Ops that did not pass are listed with the reasons and stay staged.

The device check writes both formats through this file too, so that writer and reader are one:
    python bench/promote_staged.py stamp-junit XML COMMIT CSRC_SHA GPU EXIT_CODE LIMIT_S
    python bench/promote_staged.py sanitizer-line OP TOOL EXIT_CODE SANITIZER_LOG JUNIT_XML
"""
import argparse
import hashlib
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from typing import Callable, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMOTED_H = os.path.join(ROOT, "csrc", "cuda", "staged", "promoted.h")
OPS_MD = os.path.join(ROOT, "docs", "ops.md")
# op -> (its test module, its constant in promoted.h, its staged source)
OPS = {
    "branch_verify": ("test_branch_verify", "kPromotedBranchVerify", "csrc/cuda/staged/branch_verify.cu"),
    "mixture_verify": ("test_mixture_verify", "kPromotedMixtureVerify", "csrc/cuda/staged/mixture_verify.cu"),
    "sample_tokens": ("test_sample_tokens", "kPromotedSampleTokens", "csrc/cuda/staged/sample_tokens.cu"),
    "branch_argmax": ("test_branch_argmax", "kPromotedBranchArgmax", "csrc/cuda/staged/branch_argmax.cu"),
    "drafter_attention": ("test_drafter_attention", "kPromotedDrafterAttention",
                          "csrc/cuda/staged/drafter_attention.cu"),
}
SANITIZER_TOOLS = ("memcheck", "racecheck")
TESTS_XML = "tests-staged.xml"
SANITIZER_TXT = "sanitizer.txt"


def is_staged(name: str) -> bool:
    """A case that ran the staged kernels: "staged" among its dash-separated parameters
    (`[cuda-staged-...]`, a graph test's `[staged-...]`)."""
    params = re.search(r"\[(.*)\]$", name)
    return params is not None and "staged" in params.group(1).split("-")


def ops_of(module: str, name: str) -> List[str]:
    """The ops whose staged kernels a case may have run."""
    own = [op for op, (test_module, _, _) in OPS.items() if module == test_module]
    if own:
        return own
    named = [op for op in OPS if op in name]
    return named or list(OPS)


def read_stamp(line: str) -> Dict[str, str]:
    """`# commit X csrc_sha Y gpu NAME WITH SPACES` -> {commit, csrc_sha, gpu}."""
    found = re.match(r"#\s*commit (\S+) csrc_sha (\S+) gpu (.+)$", line.strip())
    return dict(commit=found.group(1), csrc_sha=found.group(2), gpu=found.group(3)) if found else {}


def staged_tests(tests_xml: str) -> dict:
    """The staged cases' outcomes: per op, passed cases of its own module and failed cases that
    may have run its kernel; and the run's stamp (commit, csrc_sha, gpu, stopped_at_limit)."""
    root = ET.parse(tests_xml).getroot()
    stamp = {prop.get("name"): prop.get("value") for prop in root.iter("property")}
    passed = {op: 0 for op in OPS}
    failed: Dict[str, List[str]] = {op: [] for op in OPS}
    for case in root.iter("testcase"):
        name = case.get("name", "")
        if not is_staged(name):
            continue
        module = case.get("classname", "").split(".")[-1]
        if case.find("failure") is not None or case.find("error") is not None:
            for op in ops_of(module, name):
                failed[op].append(f"{module}::{name}")
        elif case.find("skipped") is None:
            for op, (test_module, _, _) in OPS.items():
                passed[op] += module == test_module
    return dict(stamp=stamp, passed=passed, failed=failed)


def sanitizer_results(sanitizer_txt: str) -> dict:
    """The stamp of sanitizer.txt, and per op and tool its fields (exit, errors, passed, failed,
    cases); a missing line: the tool did not run on that op."""
    results: Dict[str, Dict[str, Dict[str, str]]] = {op: {} for op in OPS}
    stamp: Dict[str, str] = {}
    if os.path.isfile(sanitizer_txt):
        for line in open(sanitizer_txt):
            if line.startswith("#"):
                stamp = stamp or read_stamp(line)
                continue
            parts = line.split()
            if len(parts) >= 3 and parts[0] in OPS and parts[1] in SANITIZER_TOOLS:
                results[parts[0]][parts[1]] = dict(field.split("=", 1) for field in parts[2:] if "=" in field)
    return dict(stamp=stamp, results=results)


def stamp_junit(path: str, commit: str, csrc_sha: str, gpu: str, exit_code: int, limit_s: int) -> None:
    """Writes the run's stamp into a JUnit report's <testsuite> properties: the commit, csrc/'s
    hash, the GPU, pytest's exit code and whether the stage hit its limit (exit code 124 from
    `timeout`). A report pytest never wrote becomes an empty one that says so."""
    try:
        tree = ET.parse(path)
    except (OSError, ET.ParseError):
        tree = ET.ElementTree(ET.fromstring('<testsuites><testsuite name="pytest" tests="0"/></testsuites>'))
    root = tree.getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    props = suite.find("properties")
    if props is None:
        props = ET.Element("properties")
        suite.insert(0, props)
    for name, value in (("commit", commit), ("csrc_sha", csrc_sha), ("gpu", gpu), ("exit_code", str(exit_code)),
                        ("stopped_at_limit", "true" if exit_code == 124 else "false"), ("limit_s", str(limit_s))):
        ET.SubElement(props, "property", name=name, value=value)
    tree.write(path, encoding="unicode")


def sanitizer_line(op: str, tool: str, exit_code: int, log: str, junit_xml: str) -> str:
    """sanitizer.txt's line for one op and tool, from compute-sanitizer's exit code, its output
    (the last "ERROR SUMMARY"; none when it never finished) and pytest's JUnit report of the
    cases it ran, which the line names."""
    text = open(log, errors="replace").read() if os.path.isfile(log) else ""
    summary = re.findall(r"ERROR SUMMARY: (\d+) error", text)
    passed, failed = [], 0
    try:
        for case in ET.parse(junit_xml).getroot().iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                failed += 1
            elif case.find("skipped") is None:
                passed.append(case.get("name", ""))
    except (OSError, ET.ParseError):
        pass
    return (f"{op} {tool} exit={exit_code} errors={summary[-1] if summary else 'none'} passed={len(passed)} "
            f"failed={failed} cases={';'.join(passed)}")


def commit_csrc_sha(commit: str) -> Optional[str]:
    """The hash device_check.sh computes over csrc/ (sha256sum of each file in byte order of the
    path, then of that listing; 16 hex digits), here of `commit`'s csrc/ in this clone; None
    when the clone does not have the commit."""
    def git(*args: str) -> bytes:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, check=True).stdout
    try:
        paths = sorted(git("ls-tree", "-r", "--name-only", "-z", commit, "csrc").split(b"\0"))
        listing = b"".join(hashlib.sha256(git("cat-file", "blob", f"{commit}:{path.decode()}")).hexdigest().encode()
                           + b"  " + path + b"\n" for path in paths if path)
    except (OSError, subprocess.CalledProcessError):
        return None
    return hashlib.sha256(listing).hexdigest()[:16] if listing else None


def run_problems(tests: dict, sanitizer: dict, csrc_of_commit: Callable[[str], Optional[str]]) -> List[str]:
    """What keeps every op of the run from promotion."""
    why = []
    stamp = tests["stamp"]
    commit: Optional[str] = stamp.get("commit")
    if not commit or commit == "unknown":
        why.append("the staged tests name no commit (set DBLAST_COMMIT on a machine without .git)")
    else:
        expected = csrc_of_commit(commit)
        if expected is None:
            why.append(f"commit {commit} is not in this clone: its csrc/ cannot be compared with the run's")
        elif expected != stamp.get("csrc_sha"):
            why.append(f"the machine's csrc/ ({stamp.get('csrc_sha')}) is not commit {commit[:12]}'s ({expected}): "
                       "uncommitted kernels ran")
    if stamp.get("stopped_at_limit") != "false":
        why.append("the staged tests stopped at their time limit (or say nothing of it): not every staged case ran")
    other = sanitizer["stamp"]
    if not other:
        why.append("sanitizer.txt names no commit")
    elif (other["commit"], other["csrc_sha"]) != (commit, stamp.get("csrc_sha")):
        why.append(f"tests and sanitizer ran different code (commit {commit} csrc {stamp.get('csrc_sha')} against "
                   f"commit {other['commit']} csrc {other['csrc_sha']})")
    return why


def decide(run_dir: str, csrc_of_commit: Callable[[str], Optional[str]] = commit_csrc_sha) -> Dict[str, List[str]]:
    """Per op, the reasons it may not be promoted (empty: promote)."""
    tests = staged_tests(os.path.join(run_dir, TESTS_XML))
    sanitizer = sanitizer_results(os.path.join(run_dir, SANITIZER_TXT))
    shared = run_problems(tests, sanitizer, csrc_of_commit)
    reasons = {}
    for op in OPS:
        why = list(shared)
        failed = tests["failed"][op]
        if failed:
            why.append(f"{len(failed)} staged cases that may run its kernel failed ({', '.join(failed[:3])}"
                       + (", ..." if len(failed) > 3 else "") + ")")
        if not tests["passed"][op]:
            why.append("no staged test of its own module passed (none ran)")
        for tool in SANITIZER_TOOLS:
            line = sanitizer["results"][op].get(tool)
            if line is None:
                why.append(f"{tool} did not run")
                continue
            if line.get("exit") != "0":
                why.append(f"{tool} exited {line.get('exit')}")
            if line.get("errors") == "none":
                why.append(f"{tool} did not finish (no error summary)")
            elif line.get("errors") != "0":
                why.append(f"{tool} reported {line.get('errors')} errors")
            if line.get("failed", "0") != "0":
                why.append(f"{line.get('failed')} of {tool}'s cases failed")
            if not int(line.get("passed", "0") or 0):
                why.append(f"{tool} passed no case")
        reasons[op] = why
    return reasons


def promote(op: str, run: str, promoted_h: str = PROMOTED_H, ops_md: str = OPS_MD) -> None:
    _, constant, source = OPS[op]
    text = open(promoted_h).read()
    line = re.compile(rf"^(inline constexpr bool {constant} = )(true|false);( *)// promoted by: .*$", re.M)
    if not line.search(text):
        raise SystemExit(f"{promoted_h} has no line for {constant}")
    text = line.sub(lambda m: f"{m.group(1)}true;{m.group(3)}// promoted by: {run}", text)
    with open(promoted_h, "w") as f:
        f.write(text)
    doc = open(ops_md).read()
    row = re.compile(rf"^\| `{op}` \|.*\|$", re.M)
    if not row.search(doc):
        raise SystemExit(f"{ops_md} has no table row for {op}")
    doc = row.sub(f"| `{op}` | `{source}` (promoted) | {run} | none |", doc)
    with open(ops_md, "w") as f:
        f.write(doc)


def main() -> int:
    if sys.argv[1:2] == ["stamp-junit"] and len(sys.argv) == 8:
        path, commit, csrc_sha, gpu, exit_code, limit_s = sys.argv[2:]
        stamp_junit(path, commit, csrc_sha, gpu, int(exit_code), int(limit_s))
        return 0
    if sys.argv[1:2] == ["sanitizer-line"] and len(sys.argv) == 7:
        op, tool, exit_code, log, junit_xml = sys.argv[2:]
        print(sanitizer_line(op, tool, int(exit_code), log, junit_xml))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a device run's folder (bench/device_runs/<run>)")
    parser.add_argument("--dry-run", action="store_true", help="say what would be promoted, change nothing")
    args = parser.parse_args()
    if not os.path.isfile(os.path.join(args.run_dir, TESTS_XML)):
        parser.error(f"{args.run_dir} has no {TESTS_XML}: `bench/device_check.sh part1` writes it")
    run = os.path.basename(os.path.normpath(args.run_dir))
    for op, why in decide(args.run_dir).items():
        if why:
            print(f"{op}: stays staged ({'; '.join(why)})")
            continue
        print(f"{op}: promoted by {run}" + (" (dry run)" if args.dry_run else ""))
        if not args.dry_run:
            promote(op, run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
