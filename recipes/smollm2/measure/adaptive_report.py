"""The adaptive controller's results page (results/smollm2/adaptive/README.md) from the runs of
recipes/smollm2/measure/adaptive_speed.sh: the speed-up over the target alone of every dataset and
temperature with the controller on and off (side by side in one sitting), the batch table, a
plot of the speed-up per cell, and a plot of the depth the controller chose over responses; and
the README's adaptive rows (between its adaptive-results markers).

    python recipes/smollm2/measure/adaptive_report.py --runs runs/adaptive-speed --out results/smollm2/adaptive
"""
import argparse
import json
import os
import shutil

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from dblast_ext.jsonl import read_jsonl  # noqa: E402

DATASETS = ("gsm8k", "mtbench", "humaneval", "math500")
NAMES = {"gsm8k": "GSM8K", "mtbench": "MT-Bench", "humaneval": "HumanEval", "math500": "MATH-500"}
CONTROLLERS = ("adaptive", "off")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", required=True, help="adaptive_speed.sh's OUT")
    p.add_argument("--out", required=True)
    p.add_argument("--arm", default="dblast-k4")
    p.add_argument("--readme", default="README.md", help="the README whose adaptive rows are rewritten")
    p.add_argument("--note", default="", help="a paragraph under the speed table (which run each row comes from)")
    p.add_argument("--batch-note", default="", help="a paragraph under the batch table (reruns, causes)")
    return p.parse_args()


def speed_runs(runs: str, arm: str):
    """{(temperature, controller): summary} of the finished speed runs."""
    found = {}
    folder = os.path.join(runs, "speed")
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        path = os.path.join(folder, name, "summary.json")
        if not name.startswith(f"{arm}-T") or not os.path.isfile(path):
            continue
        temperature, controller = name[len(arm) + 2:].rsplit("-", 1)
        with open(path) as f:
            found[(temperature, controller)] = json.load(f)
    return found


def speedup_plot(runs, temperatures, path):
    fig, axes = plt.subplots(1, len(temperatures), figsize=(3.2 * len(temperatures), 3.2), sharey=True)
    axes = axes if len(temperatures) > 1 else [axes]
    for ax, t in zip(axes, temperatures):
        for j, controller in enumerate(CONTROLLERS):
            summary = runs.get((t, controller))
            if summary is None:
                continue
            values = [summary["datasets"][d]["speedup"] for d in DATASETS]
            ax.bar([i + 0.4 * j for i in range(len(DATASETS))], values, width=0.4,
                   label="adaptive" if controller == "adaptive" else "fixed (off)")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([i + 0.2 for i in range(len(DATASETS))], [NAMES[d] for d in DATASETS], rotation=30)
        ax.set_title(f"T {t}")
    axes[0].set_ylabel("speed-up over the target alone")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def depth_plot(runs_dir, arm, cells, path):
    """The drafts each cycle verified over one response of each (temperature, dataset) cell."""
    fig, axes = plt.subplots(len(cells), 1, figsize=(8, 1.8 * len(cells)), sharex=True)
    axes = axes if len(cells) > 1 else [axes]
    for ax, (t, dataset) in zip(axes, cells):
        records = os.path.join(runs_dir, "speed", f"{arm}-T{t}-adaptive", "records.jsonl")
        chosen = None
        for _, record in read_jsonl(records, "records") if os.path.isfile(records) else []:
            if record["dataset"] == dataset and (chosen is None or len(record["accepted"]) > len(chosen["accepted"])):
                chosen = record
        if chosen is None:
            continue
        block = chosen["block_size"]
        drafts = chosen.get("drafts") or [block - 1] * len(chosen["accepted"])
        ax.step(range(len(drafts)), drafts, where="post", label="drafts verified")
        ax.plot(range(len(drafts)), chosen["accepted"], ".", markersize=3, label="accepted")
        ax.set_ylim(-0.5, block - 0.5)
        ax.set_ylabel(f"{NAMES[dataset]}\nT {t}")
    axes[0].legend(fontsize=8, loc="upper right")
    axes[-1].set_xlabel("cycle (target pass) of the longest response")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    runs = speed_runs(args.runs, args.arm)
    temperatures = sorted({t for t, _ in runs}, key=float)
    lines = ["# Adaptive drafting on the embedded pair", ""]
    if runs:
        first = next(iter(runs.values()))
        settings = first["settings"]
        lines += [f"`{args.arm}` at the CPU defaults (`dblast eval --fastest-settings`: {settings.get('dtype', 'float32')}, "
                  f"block {settings['block_size']}, {settings.get('draft_vocab', 'all')} draft ids, "
                  f"{settings.get('verify', 'branch')} verification of {settings.get('max_tree_nodes')} branch nodes + "
                  f"{settings.get('extra_leaves', 0)} extra leaves), {first['datasets']['gsm8k']['n_prompts']} prompts per "
                  f"dataset, {settings['max_new_tokens']} new tokens, speed-up over the target alone on the same prompts "
                  "and seeds. `adaptive`: the controller on (dblast_ext.decoding.adaptive); `off`: every cycle verifies the "
                  "whole block (the loop before the controller). The two runs of a temperature ran back to back "
                  "(recipes/smollm2/measure/adaptive_speed.sh).", "",
                  "| T | controller | " + " | ".join(NAMES[d] for d in DATASETS) + " | mean | tau (mean) |",
                  "| ---: | --- |" + " ---: |" * (len(DATASETS) + 2)]
        for t in temperatures:
            for controller in CONTROLLERS:
                summary = runs.get((t, controller))
                if summary is None:
                    continue
                cells = [summary["datasets"][d]["speedup"] for d in DATASETS]
                taus = [summary["datasets"][d]["tau"] for d in DATASETS]
                lines.append(f"| {t} | {controller} | " + " | ".join(f"{c:.2f}x" for c in cells)
                             + f" | {sum(cells) / len(cells):.2f}x | {sum(taus) / len(taus):.2f} |")
        lines += ["", args.note] if args.note else []
        lines += ["", "tau counts every target pass, plain steps included (a plain step commits one token), so "
                  "with the controller on it says how many tokens a pass committed on average, not how far the "
                  "drafter is accepted (the acceptance phases of the evaluation run with the controller off).", ""]
        speedup_plot(runs, temperatures, os.path.join(args.out, "speedup.png"))
        lines += ["![speed-up per cell, adaptive and fixed](speedup.png)", ""]
        cells = [(t, d) for t, d in (("0.7", "gsm8k"), ("1.0", "humaneval"), ("1.5", "mtbench"))
                 if os.path.isfile(os.path.join(args.runs, "speed", f"{args.arm}-T{t}-adaptive", "records.jsonl"))]
        if cells:
            depth_plot(args.runs, args.arm, cells, os.path.join(args.out, "depth.png"))
            lines += ["The depth the controller chose, cycle by cycle, over the longest response of each cell "
                      "(0: a plain target step):", "", "![chosen depth over a response](depth.png)", ""]
        for (t, controller), summary in runs.items():  # the summaries travel with the page
            folder = os.path.join(args.out, f"{args.arm}-T{t}-{controller}")
            os.makedirs(folder, exist_ok=True)
            shutil.copy(os.path.join(args.runs, "speed", f"{args.arm}-T{t}-{controller}", "summary.json"), folder)
    batch = os.path.join(args.runs, "batch", "summary.json")
    data = None
    if os.path.isfile(batch):
        with open(batch) as f:
            data = json.load(f)
        names = [k for k in data["rows"][0] if k.startswith("speculative")]
        lines += [f"## Batches ({data['date']})", "",
                  f"Machine: {data['machine']}. `recipes/smollm2/measure/batch_speed.py`, settings "
                  f"`{json.dumps(data['settings'])}`; {data['prompts']} prompts in consecutive batches, each "
                  "generated twice by each engine and the second (warm) run timed; speed-up over the target alone "
                  "batched the same way.", "",
                  "| batch | " + " | ".join(f"{n} tok/s (speed-up; drafting cycles / cycles)" for n in names)
                  + " | target alone tok/s |", "| ---: |" + " ---: |" * (len(names) + 1)]
        for row in data["rows"]:
            lines.append(f"| {row['batch']} | " + " | ".join(
                f"{row[n]['tokens_per_second']:.1f} ({row[n]['speedup']:.2f}x; {row[n].get('drafting_cycles', '?')}"
                f" / {row[n]['cycles']})" for n in names) + f" | {row['target']['tokens_per_second']:.1f} |")
        shutil.copy(batch, os.path.join(args.out, "batch_summary.json"))
        lines += ["", args.batch_note, ""] if args.batch_note else [""]
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    if runs:
        readme_rows(runs, temperatures, data, args.readme, os.path.relpath(os.path.join(args.out, "README.md"),
                                                                              os.path.dirname(args.readme)))


def batch_sentence(data) -> str:
    """The batch run in one sentence: each size's speed-up with the controller on, then off."""
    rows = data["rows"]
    on = " / ".join(f"{row['speculative-adaptive']['speedup']:.2f}x" for row in rows)
    off = " / ".join(f"{row['speculative-off']['speedup']:.2f}x" for row in rows)
    sizes = " / ".join(str(row["batch"]) for row in rows)
    return f" Batches of {sizes} (T {data['settings']['temperature']}, {data['date']}): {on} (fixed {off})."


def readme_rows(runs, temperatures, batch, readme: str, page: str) -> None:
    """The README's table of the speed phase with the controller on and off, and the batch run's figures."""
    begin, end = "<!-- adaptive-results:begin -->", "<!-- adaptive-results:end -->"
    with open(readme) as f:
        text = f.read()
    if begin not in text or end not in text:
        raise SystemExit(f"{readme}: no {begin} ... {end} block to fill")
    rows = ["| temperature | adaptive: mean of 4 datasets (worst dataset) | fixed: mean (worst) |",
            "| --- | ---: | ---: |"]
    for t in temperatures:
        cells = []
        for controller in CONTROLLERS:
            summary = runs.get((t, controller))
            values = [summary["datasets"][d]["speedup"] for d in DATASETS] if summary else []
            cells.append(f"{sum(values) / len(values):.2f}x ({min(values):.2f}x)" if values else "")
        rows.append(f"| {t} | " + " | ".join(cells) + " |")
    rows.append("\nSpeed-up over SmolLM2 alone with `dblast-k4` at the CPU defaults, the adaptive controller "
                "(the default) against every pass verifying the whole block, run back to back."
                + (batch_sentence(batch) if batch and "speculative-adaptive" in batch["rows"][0] else "")
                + f" [{page}]({page})")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    with open(readme, "w") as f:
        f.write(head + begin + "\n" + "\n".join(rows) + "\n" + end + tail)


if __name__ == "__main__":
    main()
