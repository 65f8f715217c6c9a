"""Collects recipes/smollm2/evaluate/tree_eval.sh's runs into results/smollm2/tree/: tokens per target
pass of greedy-branch and trie verification per dataset and temperature (every response, cut
or not: both rules see the same prompts, seeds and length limit), the paired difference with
its bootstrap interval and sign-flip p-value, the trie's nodes per pass, the speed-ups, the
README table and the runs' records.

    python recipes/smollm2/evaluate/tree_collect.py --runs runs/smollm2-tree --out results/smollm2/tree
"""
import argparse
import json
import os
import platform
import shutil
from datetime import datetime, timezone

import numpy as np

from dblast_ext.eval.metrics import paired_delta_tau, speedup, summarize
from dblast_ext.eval.records import read_records

TEMPERATURES = ("0.7", "1.0", "1.5")
DATASETS = ("gsm8k", "mtbench")


def by_dataset(records):
    out = {}
    for r in records:
        out.setdefault(r["dataset"], []).append(r)
    return out


def nodes_per_pass(records):
    nodes = [n for r in records for n in r.get("tree_nodes", [])]
    return float(np.mean(nodes)) if nodes else None


def same_context(records):
    """Over the tree run's cycles: the mean expected accepted drafts of the branch rule and of the
    trie on the same proposals and target distributions (None for records without the figure)."""
    pairs = [(b, e) for r in records for b, e in zip(r.get("branch_rule_expected", []), r["expected_accepted"])]
    if not pairs:
        return None
    branch, tree = np.mean(pairs, axis=0)
    return float(branch), float(tree)


def record_files(runs):
    """(run name, records path) of every run in `runs` that has records."""
    for name in sorted(os.listdir(runs)):
        path = os.path.join(runs, name, "records.jsonl")
        if os.path.isfile(path):
            yield name, path


def run_settings(runs):
    """Every record's settings, over all runs."""
    return [r["settings"] for _, path in record_files(runs) for r in read_records(path)]


def setting_values(settings, key, default):
    """The distinct values of settings[key] (one, when every run shares it)."""
    return sorted({str(s.get(key, default)) for s in settings})


def acceptance_rows(runs):
    rows = []
    for t in TEMPERATURES:
        paths = [os.path.join(runs, f"{rule}-T{t}", "records.jsonl") for rule in ("branch", "tree")]
        if not all(os.path.isfile(path) for path in paths):  # a temperature not run (tree_eval.sh TEMPS)
            continue
        branch, tree = (by_dataset(read_records(path)) for path in paths)
        for name in DATASETS:
            a = summarize(branch[name], eos_only=False)
            b = summarize(tree[name], eos_only=False)
            delta = paired_delta_tau(branch[name], tree[name], eos_only=False)
            rows.append(dict(temperature=float(t), dataset=name, branch_tau=a["tau"], branch_ci=a["tau_ci"],
                             tree_tau=b["tau"], tree_ci=b["tau_ci"], gain=b["tau"] / a["tau"] - 1,
                             delta=delta["delta"], delta_ci=delta["ci"], p_value=delta["p_value"],
                             prompts=delta["n"], cycles=(a["n_cycles"], b["n_cycles"]),
                             expected=(a["expected_accepted"], b["expected_accepted"]),
                             nodes=nodes_per_pass(tree[name]), same_context=same_context(tree[name])))
    return rows


SPEED_RUNS = [  # (run directory, setting, rule)
    ("speed-branch-B8-T1.0", "block 8, full vocabulary", "branch"),
    ("speed-tree-B8-T1.0", "block 8, full vocabulary", "tree"),
    ("speed-branch-B8-V8192-T1.0", "block 8, draft vocabulary 8192", "branch"),
    ("speed-tree-B8-V8192-T1.0", "block 8, draft vocabulary 8192", "tree"),
    ("speed-tree12-B8-V8192-T1.0", "block 8, draft vocabulary 8192", "tree, at most 12 nodes"),
]


def speed_rows(runs):
    rows = []
    for name, setting, verify in SPEED_RUNS:
        path = os.path.join(runs, name, "records.jsonl")
        if not os.path.isfile(path):
            continue
        records = read_records(path)
        passes = sum(len(r["accepted"]) for r in records)
        committed = sum(n + 1 for r in records for n in r["accepted"])
        rows.append(dict(setting=setting, verify=verify, speedup=speedup(records), per_pass=committed / passes,
                         nodes=nodes_per_pass(records),
                         seconds_per_pass=sum(r["wall_time"] for r in records) / passes))
    return rows


def fmt_ci(ci):
    return f"[{ci[0]:.2f}, {ci[1]:.2f}]"


def readme(acceptance, speed, machine, drafter, dtype, leaves):
    lines = [
        "# Trie verification against greedy-branch verification (embedded pair)",
        "",
        "`recipes/smollm2/evaluate/tree_eval.sh`: the embedded `dblast-k4` drafting for SmolLM2-135M-Instruct, the",
        "same prompts and seeds verified by one branch drawn from the prior (`--verify branch`) and by",
        "the trie of all four branches in one target pass (`--verify tree`), with its extra leaves (the",
        "drafter's likeliest tokens that no branch drafted, docs/design.md). Tokens per target pass =",
        "1 + accepted drafts per cycle, averaged per prompt then over prompts (tau), every response",
        "counted (the length limit cuts both rules alike); 95% prompt-level bootstrap intervals; the",
        "paired difference uses the same prompts, p from a sign-flip test. top-k 20; top-p 0.8 at",
        "T 0.7, 0.95 otherwise. Expected accepted: the mean over cycles of each cycle's expected",
        "accepted drafts given its proposal (sum over draft positions, or trie nodes, of the chance",
        "of reaching them), each rule on its own responses. Same contexts: over the tree run's cycles,",
        "the branch rule's expected accepted drafts on the very proposals and target distributions the",
        "trie was scored with, against the trie's (free of the two runs' diverging texts; the trie's",
        "is never below, node by node). Generated by `recipes/smollm2/evaluate/tree_collect.py`.",
        "",
        f"Machine: {machine}; {', '.join(dtype)} target. Drafter: the embedded dblast-k4, digest "
        f"{', '.join(drafter)}. Extra leaves per trie: {', '.join(leaves)}.",
        "",
        "| T | dataset | prompts | branch tau | tree tau | gain | paired delta [95% CI] | p "
        "| expected accepted, branch -> tree | same contexts, branch -> tree | nodes per pass |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in acceptance:
        same = r.get("same_context")
        same_text = f"{same[0]:.3f} -> {same[1]:.3f} ({100 * (same[1] / same[0] - 1):+.0f}%)" if same else "-"
        lines.append(f"| {r['temperature']} | {r['dataset']} | {r['prompts']} | "
                     f"{r['branch_tau']:.3f} {fmt_ci(r['branch_ci'])} | "
                     f"{r['tree_tau']:.3f} {fmt_ci(r['tree_ci'])} | {100 * r['gain']:+.1f}% | "
                     f"{r['delta']:+.3f} {fmt_ci(r['delta_ci'])} | {r['p_value']:.3g} | "
                     f"{r['expected'][0]:.3f} -> {r['expected'][1]:.3f} | {same_text} | {r['nodes']:.1f} |")
    if speed:
        lines += [
            "",
            "Speed at T 1.0 (`--measure-speedup`: each response timed against the target alone, same seed",
            "and filter, one process with both cores):",
            "",
            "| setting | rule | tokens per pass | seconds per pass | speed-up vs target alone |",
            "| --- | --- | --- | --- | --- |",
        ]
        for r in speed:
            lines.append(f"| {r['setting']} | {r['verify']} | {r['per_pass']:.3f} | {r['seconds_per_pass']:.3f} | "
                         f"{r['speedup']:.2f}x |")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default="runs/smollm2-tree")
    p.add_argument("--out", default="results/smollm2/tree")
    p.add_argument("--machine", default=f"{platform.machine()}, {os.cpu_count()} cores, "
                                        f"{datetime.now(timezone.utc):%Y-%m-%d}")
    args = p.parse_args()
    acceptance, speed = acceptance_rows(args.runs), speed_rows(args.runs)
    settings = run_settings(args.runs)
    # dblast eval runs the target in float32 unless --dtype says otherwise (then its settings record it)
    drafter, dtype = setting_values(settings, "drafter_digest", "unrecorded"), setting_values(settings, "dtype", "float32")
    # runs made before extra leaves existed had none (their settings do not name them)
    leaves = setting_values([s for s in settings if s.get("verify") == "tree"], "extra_leaves", "0")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"acceptance": acceptance, "speed": speed, "machine": args.machine, "drafter_digests": drafter,
                   "dtype": dtype, "extra_leaves": leaves}, f, indent=1)
    text = readme(acceptance, speed, args.machine, drafter, dtype, leaves)
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write(text)
    for name, src in record_files(args.runs):
        os.makedirs(os.path.join(args.out, "records"), exist_ok=True)
        shutil.copyfile(src, os.path.join(args.out, "records", f"{name}.jsonl"))
    print(text)


if __name__ == "__main__":
    main()
