"""The DFlash2 candidate's evaluation (recipes/smollm2/evaluate/dflash2_eval.sh) against the embedded
dflash-k1 and dblast-k4: copies its runs' summaries, reports and records into
results/smollm2/dflash2/ and writes the results README's `dflash2` table (between its markers,
the text around it kept; appended under its heading the first time).

    python recipes/smollm2/evaluate/dflash2_results.py --runs runs/smollm2-dflash2-eval

Acceptance: tau (tokens committed per target pass, one chain or branch verified per pass,
float32) of each arm on the prompts both runs cover and both ended with EOS, and the paired 95%
bootstrap interval of the difference (prompts resampled within each dataset), against the
embedded drafters' kept records (results/smollm2/records/accept/). Speed: the candidate's own
speed runs (speed-up over the target alone timed in the same run) next to the embedded drafters'
from results/smollm2/ (an earlier sitting: each ratio is against its own sitting's target).
"""
import argparse
import os
import shutil

from checkpoint import RESULTS
from collect import DATASETS, fmt, load, markers, replace_block, speedup_text, write_text

from dblast_ext.eval.metrics import paired_macro_delta
from dblast_ext.eval.records import read_run_records

TEMPERATURES = ("0", "0.7", "1.0", "1.5")
BASELINES = ("dflash-k1", "dblast-k4")
CANDIDATE = "dflash2"
# the speed runs of dflash2_eval.sh: the candidate both ways and dflash-k1 at its own CPU defaults,
# in the same sitting, on the same prompts
SPEED_ARMS = (("dflash2", "DFlash2, its chain (sampled at T > 0, sparse_verify)"),
              ("dflash2-tree", "DFlash2, a trie of its chain and 3 best paths"),
              ("dflash-k1-now", "dflash-k1 (its defaults: a trie and 4 extra leaves)"))
HEADING = "## DFlash2: the selector against DBLast's branches"


def on_prompts(records, prompts):
    return [r for r in records if (r["dataset"], str(r["prompt_id"])) in prompts]


def paired(candidate, baseline):
    """tau of both and the paired difference candidate - baseline, on their shared prompts."""
    prompts = ({(r["dataset"], str(r["prompt_id"])) for r in candidate}
               & {(r["dataset"], str(r["prompt_id"])) for r in baseline})
    return paired_macro_delta(on_prompts(baseline, prompts), on_prompts(candidate, prompts), key="accepted")


def verdict(result, name) -> str:
    low, high = result["ci"]
    if low > 0:
        return "DFlash2's selector"
    if high < 0:
        return name
    return "neither"


def acceptance_table(runs, results):
    rows = ["| T | dflash2 tau | dflash-k1 tau | dflash2 - dflash-k1 [95%] | dflash2 tau | dblast-k4 tau | "
            "dflash2 - dblast-k4 [95%] | more per target pass | prompts (against dblast-k4) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    statements = []
    for t in TEMPERATURES:
        folder = os.path.join(runs, "accept", f"{CANDIDATE}-T{t}")
        if not os.path.isfile(os.path.join(folder, "summary.json")):
            rows.append(f"| {t} | pending |" + " |" * 8)
            continue
        candidate = read_run_records(folder)
        cells, n = [], None
        for arm in BASELINES:
            baseline = read_run_records(os.path.join(results, "records", "accept", f"{arm}-T{t}", "records.jsonl"))
            result = paired(candidate, baseline)
            low, high = result["ci"]
            cells += [fmt(1 + result["b"]), fmt(1 + result["a"]), f"{result['delta']:+.3f} [{low:+.3f}, {high:+.3f}]"]
            n = sum(result["n"].values())
            if arm == "dblast-k4":
                more = verdict(result, "DBLast's branches (dblast-k4)")
                statements.append(f"- T {t}: " + (
                    f"{more} commits more per target pass" if more != "neither" else
                    "neither commits more per target pass: the paired interval holds 0") +
                    f" (DFlash2 {fmt(1 + result['b'])}, dblast-k4 {fmt(1 + result['a'])}).")
        rows.append(f"| {t} | " + " | ".join(cells) + f" | {more} | {n} |")
    return "\n".join(rows), statements


def speed_table(runs, results):
    header = ("| T | " + " | ".join(label for _, label in SPEED_ARMS) +
              " | dflash-k1, main evaluation | dblast-k4, main evaluation |")
    rows = [header, "|" + " --- |" * (len(SPEED_ARMS) + 3)]
    for t in TEMPERATURES:
        cells = []
        for arm, _ in SPEED_ARMS:
            cells.append(speed_cell(load(os.path.join(runs, "speed", f"{arm}-T{t}", "summary.json"))))
        for arm in BASELINES:
            cells.append(speed_cell(load(os.path.join(results, f"{arm}-T{t}-speed", "summary.json"))))
        rows.append(f"| {t} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def speed_cell(summary) -> str:
    if summary is None:
        return "-"
    macro = summary["macro"]
    return f"{speedup_text(macro.get('speedup'))} (tau {fmt(macro['tau'])})"


def copy_runs(runs, results) -> None:
    """Each candidate run's summary, report and records into results/smollm2/dflash2/<run>
    (accept runs by name, speed runs with -speed): the paired intervals need the records."""
    for phase in ("accept", "speed"):
        folder = os.path.join(runs, phase)
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            mine = name.rsplit("-T", 1)[0] in {arm for arm, _ in SPEED_ARMS}
            if not mine or not os.path.isfile(os.path.join(folder, name, "summary.json")):
                continue
            out = os.path.join(results, "dflash2", name + ("-speed" if phase == "speed" else ""))
            os.makedirs(out, exist_ok=True)
            for file in ("summary.json", "report.md", "records.jsonl"):
                if os.path.isfile(os.path.join(folder, name, file)):
                    shutil.copyfile(os.path.join(folder, name, file), os.path.join(out, file))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default="runs/smollm2-dflash2-eval", help="dflash2_eval.sh's output folder")
    parser.add_argument("--results", default=RESULTS, help="the results folder (default: results/smollm2)")
    args = parser.parse_args()
    copy_runs(args.runs, args.results)
    acceptance, statements = acceptance_table(args.runs, args.results)
    block = "\n".join([
        "Acceptance, one chain or branch verified per target pass (float32; datasets: "
        f"{', '.join(DATASETS)}); tau and the paired 95% interval on the prompts both runs share:", "",
        acceptance, "", *statements, "",
        "Speed-up over the target alone at the CPU defaults (bfloat16, block 8, 8,192 draft ids, the adaptive "
        "controller), macro over the datasets, with tau there; the first three columns in one sitting on the "
        "same prompts, the last two from the main evaluation (10 prompts a dataset, an earlier sitting, "
        "before the controller):", "", speed_table(args.runs, args.results)])
    path = os.path.join(args.results, "README.md")
    with open(path) as f:
        text = f.read()
    begin, end = markers("dflash2")
    if begin not in text:
        text = text.rstrip("\n") + f"\n\n{HEADING}\n\n{begin}\n{end}\n"
    write_text(path, replace_block(text, begin, end, block, "the results README"))
    print(block)


if __name__ == "__main__":
    main()
