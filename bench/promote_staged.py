"""Promotes the staged CUDA kernels that passed a device run (docs/ops.md, "CUDA kernels:
verified and staged").

    python bench/promote_staged.py bench/device_runs/<run>            # promote what passed
    python bench/promote_staged.py bench/device_runs/<run> --dry-run  # only say what would be

A staged kernel is promoted when, on that run, every CUDA test of its op that ran the staged
kernel (a test id with "staged": the `cuda-staged` device, or a graph-capture test's staged
variant) passed, at least one ran, and compute-sanitizer's memcheck and racecheck found nothing in
its op's staged tests. bench/device_check.sh writes what this reads: tests.xml (pytest's JUnit
report of the CUDA tests) and sanitizer.txt (one line per op and tool: `<op> <tool> <exit code>`).
Promotion sets the op's constant in csrc/cuda/staged/promoted.h (the staged kernel then serves
the op by default) and its row of the table in docs/ops.md, each naming the run. Ops that did
not pass are listed with the reason and stay staged.
"""
import argparse
import os
import re
import sys
import xml.etree.ElementTree as ET
from typing import Dict, List

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


def staged_test_results(tests_xml: str) -> Dict[str, Dict[str, int]]:
    """Per op: how many of its staged test cases passed, failed and were skipped."""
    counts = {op: {"passed": 0, "failed": 0, "skipped": 0} for op in OPS}
    for case in ET.parse(tests_xml).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")[-1]
        if "staged" not in case.get("name", ""):
            continue
        for op, (test_module, _, _) in OPS.items():
            if module == test_module:
                if case.find("failure") is not None or case.find("error") is not None:
                    counts[op]["failed"] += 1
                elif case.find("skipped") is not None:
                    counts[op]["skipped"] += 1
                else:
                    counts[op]["passed"] += 1
    return counts


def sanitizer_results(sanitizer_txt: str) -> Dict[str, Dict[str, int]]:
    """Per op and tool, compute-sanitizer's exit code (a missing line: not run)."""
    results: Dict[str, Dict[str, int]] = {op: {} for op in OPS}
    if os.path.isfile(sanitizer_txt):
        for line in open(sanitizer_txt):
            parts = line.split()
            if len(parts) == 3 and parts[0] in OPS and parts[1] in SANITIZER_TOOLS:
                results[parts[0]][parts[1]] = int(parts[2])
    return results


def decide(run_dir: str) -> Dict[str, List[str]]:
    """Per op, the reasons it may not be promoted (empty: promote)."""
    tests = staged_test_results(os.path.join(run_dir, "tests.xml"))
    sanitizer = sanitizer_results(os.path.join(run_dir, "sanitizer.txt"))
    reasons = {}
    for op in OPS:
        why = []
        if tests[op]["failed"]:
            why.append(f"{tests[op]['failed']} staged tests failed")
        if not tests[op]["passed"]:
            why.append("no staged test passed (none ran)")
        for tool in SANITIZER_TOOLS:
            code = sanitizer[op].get(tool)
            if code is None:
                why.append(f"{tool} did not run")
            elif code != 0:
                why.append(f"{tool} exited {code}")
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a device run's folder (bench/device_runs/<run>)")
    parser.add_argument("--dry-run", action="store_true", help="say what would be promoted, change nothing")
    args = parser.parse_args()
    for name in ("tests.xml",):
        if not os.path.isfile(os.path.join(args.run_dir, name)):
            parser.error(f"{args.run_dir} has no {name}: bench/device_check.sh writes it")
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
