"""Gathers the embedded pair's evaluation (recipes/smollm2/evaluate/eval.sh) into a results folder:
each run's report.md, summary.json, calibration and plots, the top-token-oracle and determinism
diagnostics, and the folder's README.md, whose tables it writes.

    python recipes/smollm2/evaluate/collect.py --runs runs/smollm2-eval --out results/smollm2 --readme README.md
    python recipes/smollm2/evaluate/collect.py --runs runs/smollm2-eval --out /tmp/now --partial   # while it runs

The results README is a document people write around generated tables: every table sits
between a pair of marker lines (`<!-- smollm2-results:<name>:begin -->` and `...:end -->`), and
collect.py rewrites only what lies between them, so the discussion around the tables stays
as written. A README without a table's markers gets that table appended under its heading;
where there is no README yet, collect.py writes one with the headings and tables alone.

With --readme README.md it also rewrites the block between that README's
`<!-- smollm2-results:begin -->` and `<!-- smollm2-results:end -->` lines with a short table
(per temperature and drafter: tau on GSM8K with one branch per cycle and at the CPU defaults,
the speed-up there on GSM8K and its mean over the datasets) and a link to the results README,
so that the top-level README shows what the runs measured, not a copy.
"""
import argparse
import glob
import json
import os
import shutil

from dblast_ext.eval.metrics import first_draft_accepted, paired_macro_delta
from dblast_ext.eval.records import read_run_records
from dblast_ext.eval.report import pyplot, summarize_run

ARMS = ("dflash-k1", "dblast-k4")  # table order; the runs' own names say which exist
DATASETS = ("gsm8k", "mtbench", "humaneval", "math500")
DATASET_TITLES = {"gsm8k": "GSM8K", "mtbench": "MT-Bench", "humaneval": "HumanEval", "math500": "MATH-500"}


def load(path):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def temperatures_run(runs):
    """The temperatures eval.sh ran (from its run folders `accept/<arm>-T<t>`, `speed/<arm>-T<t>`,
    `oracle/T<t>`), lowest first, as written in the folder names."""
    names = [os.path.basename(p).rsplit("-T", 1)[-1] for phase in ("accept", "speed")
             for p in glob.glob(os.path.join(runs, phase, "*-T*"))]
    names += [os.path.basename(p)[1:] for p in glob.glob(os.path.join(runs, "oracle", "T*"))]
    return sorted(set(names), key=float)


def filter_label(settings):
    """How a run's target filter reads in a table ("greedy", "top-p 0.8"), from the settings it recorded."""
    if settings["temperature"] == 0:
        return "greedy"
    return f"top-p {settings['top_p']:g}" if settings.get("top_p", 1.0) < 1 else "no top-p"


def fmt(value, digits=2):
    return "-" if value is None else f"{value:.{digits}f}"


def speed_cell(s):
    """A dataset's speed-up, marked where some of its responses were timed on busy cores."""
    if s is None or s.get("speedup") is None:
        return "-"
    contended = s.get("contended_responses") or 0
    return f"{s['speedup']:.2f}x" + (f" ({contended} contended)" if contended else "")


def tau_cell(s):
    if s is None:
        return "-"
    return f"{s['tau']:.2f} [{s['tau_ci'][0]:.2f}, {s['tau_ci'][1]:.2f}]"


def zt_cell(calibration):
    """The calibrated Z_T; one that is the largest value of its grid says so, since a wider
    grid might have found a better one."""
    if calibration is None:
        return "-"
    edge = len(calibration["grid"]) > 1 and calibration["best"] == max(calibration["grid"])
    return fmt(calibration["best"], 1) + (" (grid top)" if edge else "")


def copy_run(src, dst, runs_root):
    """Copies a run's reports; text files name the runs folder as `runs`, not where it was."""
    os.makedirs(dst, exist_ok=True)
    for pattern in ("report.md", "summary.json", "*.png", "calibration/calibration.json", "calibration/*.png",
                    "determinism.*", "oracle.*"):
        for path in glob.glob(os.path.join(src, pattern)):
            target = os.path.join(dst, os.path.relpath(path, src).replace("/", "_"))
            if path.endswith((".json", ".md")):
                with open(path) as f:
                    text = f.read()
                for where in (os.path.abspath(runs_root), runs_root):
                    text = text.replace(where, "runs")
                with open(target, "w") as f:
                    f.write(text)
            else:
                shutil.copyfile(path, target)


HISTOGRAM_HEADER = ("| temperature | drafter | " + " | ".join(DATASET_TITLES[d] for d in DATASETS) + " |\n"
                    "| --- | --- |" + " --- |" * len(DATASETS))


def histogram_row(out, arm, t):
    """Links to the histogram plots that `dblast eval` drew for one acceptance run copied into `out`."""
    folder = f"{arm}-T{t}"
    cells = [f"[png]({folder}/histogram_{d}.png)" if os.path.isfile(os.path.join(out, folder, f"histogram_{d}.png"))
             else "-" for d in DATASETS]
    return f"| {t} | {arm} | " + " | ".join(cells) + " |"


def determinism_section(folder):
    """The binned table and plot of `dblast diagnose determinism` (DBLast Figure 1), as copied."""
    table = os.path.join(folder, "determinism.md")
    if not os.path.isfile(table):
        return "*(not run yet: the `determinism` phase of `bash recipes/smollm2/evaluate/eval.sh` makes it)*"
    with open(table) as f:
        text = f.read().strip()
    plot = "![accepted length by early determinism](determinism/determinism.png)\n\n"
    return (plot if os.path.isfile(os.path.join(folder, "determinism.png")) else "") + text


def plot_tau(path, shown, oracles, filters) -> bool:
    """tau [95% CI] per dataset, one panel per temperature: the drafters side by side and the
    top-token oracle as an outline (`filters`: T -> its filter's label). False (no file) without
    matplotlib or runs."""
    try:
        plt = pyplot()
    except ImportError:
        return False
    temperatures = [t for t in sorted(filters, key=float) if t in oracles or any(key[1] == t for key in shown)]
    if not temperatures:
        return False
    fig, axes = plt.subplots(1, len(temperatures), figsize=(4.2 * len(temperatures), 3.6), sharey=True,
                             squeeze=False)
    for ax, t in zip(axes[0], temperatures):
        series = [(label, per) for (label, temp), per in shown.items() if temp == t]
        if t in oracles:
            series.append(("top-token oracle", oracles[t]))
        width = 0.8 / len(series)
        for i, (label, per) in enumerate(series):
            xs = [j + (i - (len(series) - 1) / 2) * width for j, d in enumerate(DATASETS) if d in per]
            taus = [per[d]["tau"] for d in DATASETS if d in per]
            errors = [[per[d]["tau"] - per[d]["tau_ci"][0] for d in DATASETS if d in per],
                      [per[d]["tau_ci"][1] - per[d]["tau"] for d in DATASETS if d in per]]
            oracle = label == "top-token oracle"
            color = {"dflash-k1": "#4c72b0", "dblast-k4": "#dd8452"}.get(label.split()[0])  # same in every panel
            ax.bar(xs, taus, width, yerr=errors, capsize=2, label=label, fill=not oracle, color=color,
                   edgecolor="#555555" if oracle else None, hatch="//" if label.endswith("(partial)") else None)
        ax.set_xticks(range(len(DATASETS)), DATASETS)
        ax.set_title(f"T {t} ({filters[t]})")
        ax.axhline(1.0, color="#999999", linewidth=0.8)
    axes[0][0].set_ylabel("tau (tokens per target pass)")
    legend = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    fig.legend(legend.values(), legend.keys(), loc="upper center", ncol=len(legend), fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def target_rows(finished, speeds, runs) -> str:
    """The bars set for the pair (issue 22) against the finished runs: measured value, met or not
    (or pending while a run it needs is unfinished). tau on GSM8K at T 0.7 by the acceptance
    runs' branch rule and at the CPU defaults (the speed runs); dblast-k4 against dflash-k1 by a
    paired interval over the acceptance runs' shared prompts (runs in `runs`)."""
    def verdict(ok):
        return "pending" if ok is None else ("yes" if ok else "no")

    rows = ["| target | measured | met? |", "| --- | --- | --- |"]
    for label, run in (("one branch, float32", finished.get(("dblast-k4", "0.7"))),
                       ("the CPU defaults", speeds.get(("dblast-k4", "0.7")))):
        gsm = run["datasets"].get("gsm8k") if run else None
        rows.append(f"| `dblast-k4` tau >= 2.5 on GSM8K at T 0.7 ({label}) | {tau_cell(gsm) if gsm else 'pending'} | "
                    f"{verdict(gsm['tau'] >= 2.5 if gsm else None)} |")
    for t in ("1.0", "1.5"):
        measured, ok = "pending", None
        k4, k1 = finished.get(("dblast-k4", t)), finished.get(("dflash-k1", t))
        folders = [os.path.join(runs, "accept", f"{arm}-T{t}") for arm in ("dflash-k1", "dblast-k4")]
        if k4 and k1 and all(os.path.isfile(os.path.join(f, "records.jsonl")) for f in folders):
            paired = paired_macro_delta(*(read_run_records(f) for f in folders))
            low, high = paired["ci"]
            measured = f"{paired['b']:.2f} vs {paired['a']:.2f}: {paired['delta']:+.3f} [{low:+.3f}, {high:+.3f}]"
            ok = low > 0
        elif k4 and k1:  # finished on another machine, its records not kept (checkpoint.py save keeps them)
            measured = (f"{fmt(k4['macro']['expected_accepted'])} vs {fmt(k1['macro']['expected_accepted'])} "
                        "(records not kept: no paired interval)")
        rows.append(f"| `dblast-k4` above `dflash-k1` in macro expected accepted length at T {t}, paired 95% "
                    f"interval above 0 | {measured} | {verdict(ok)} |")
    return "\n".join(rows)


README_BEGIN, README_END = "<!-- smollm2-results:begin -->", "<!-- smollm2-results:end -->"  # --readme's block
RESULTS_TITLE = "# Results: SmolLM2-135M-Instruct with the embedded drafters"
# the results README's generated tables, in order: marker name, the heading a missing one is appended under
SECTIONS = (
    ("targets", "## The targets set for the pair"),
    ("acceptance", "## Acceptance (one branch per cycle, float32)"),
    ("speed", "## Speed-up at the CPU defaults (the settings `dblast demo` picks)"),
    ("per-dataset", "## Per dataset"),
    ("blocks", "## Inference block length and draft vocabulary on the CPU (GSM8K, temperature 0.7, top-p 0.8, top-k 20)"),
    ("oracle", "## Top-token oracle: a drafter that always drafts the target's most likely token (first turns)"),
    ("histograms", "## Acceptance histograms (accepted drafts per cycle; the ceiling bin n = B - 1 marked)"),
    ("determinism", "## Accepted length by target-block early determinism (dblast-k4 against dflash-k1, MT-Bench, "
                    "T 1.0, top-p 0.95)"),
)


def markers(name):
    """The marker lines around the results README's generated table `name`."""
    return f"<!-- smollm2-results:{name}:begin -->", f"<!-- smollm2-results:{name}:end -->"


def replace_block(text, begin, end, block, where) -> str:
    """`text` with what lies between its marker lines `begin` and `end` replaced by `block`;
    a ValueError naming `where` unless each marker occurs once, `begin` first."""
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ValueError(f"{where} needs one line {begin} followed by one line {end}")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return head + begin + "\n" + block.strip("\n") + "\n" + end + tail


def write_text(path, text) -> None:
    """Whole or not at all: a reader never sees half a file."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def rewrite_readme_block(path, block) -> None:
    """Replaces what lies between the README's two marker lines with `block`."""
    with open(path) as f:
        text = f.read()
    write_text(path, replace_block(text, README_BEGIN, README_END, block, f"--readme: {path}"))


def results_readme_text(text, blocks) -> str:
    """The results README `text` (None: there is none yet) with every generated table of
    `blocks` (name -> Markdown) between its markers; the text around them is kept as written,
    and a table without markers is appended under its heading."""
    if text is None:
        text = (RESULTS_TITLE + "\n\nEvery table below is written by `recipes/smollm2/evaluate/collect.py` from the "
                "runs of `recipes/smollm2/evaluate/eval.sh`.\n")
    for name, heading in SECTIONS:
        begin, end = markers(name)
        if begin not in text and end not in text:
            text = text.rstrip("\n") + f"\n\n{heading}\n\n{begin}\n{end}\n"
        text = replace_block(text, begin, end, blocks[name], "the results README")
    return text


def speedup_text(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def settings_cell(settings) -> str:
    """How a speed run ran, from its recorded settings: "bfloat16, block 8, 8192 ids, trie 10 + 4"."""
    vocab = settings.get("draft_vocab")
    if settings.get("verify") == "tree":
        nodes = settings.get("max_tree_nodes")
        rule = f"trie {'all' if nodes is None else nodes} + {settings.get('extra_leaves', 0)}"
    else:
        rule = "one branch"
    block = f"block {settings['block_size']}, " if "block_size" in settings else ""
    return f"{settings.get('dtype', 'float32')}, {block}{'all' if vocab is None else vocab} ids, {rule}"


def speed_row(t, filter_text, arm, speed) -> str:
    """A speed run's row: its own tau (at its settings) and speed-up per dataset."""
    per = speed["datasets"]
    return (f"| {t} ({filter_text}) | {arm} | {settings_cell(speed['settings'])} | {tau_cell(per.get('gsm8k'))} | "
            f"{fmt(speed['macro'].get('tau'))} | " + " | ".join(speed_cell(per.get(d)) for d in DATASETS)
            + f" | {speedup_text(speed['macro'].get('speedup'))} |")


def short_row(t, filter_text, label, accept_gsm8k, speed) -> str:
    """README's row: tau on GSM8K by the branch rule (acceptance run) and at the CPU defaults
    (speed run), and the speed-ups there."""
    gsm = speed["datasets"].get("gsm8k") if speed else None
    return (f"| {t} ({filter_text}) | {label} | {tau_cell(accept_gsm8k)} | {fmt(gsm['tau'] if gsm else None)} | "
            f"{speed_cell(gsm)} | {speedup_text(speed['macro'].get('speedup')) if speed else '-'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--readme", help="also rewrite this README's short results block (between its marker lines)")
    parser.add_argument("--partial", action="store_true",
                        help="also tabulate acceptance runs still in progress, from their records so far (marked "
                             "'partial'; their reports are not copied)")
    args = parser.parse_args()
    if not os.path.isdir(args.runs):
        parser.error(f"--runs: no directory {args.runs} (the OUT of eval.sh)")
    if args.readme and not os.path.isfile(args.readme):
        parser.error(f"--readme: no file {args.readme}")
    results_readme = os.path.join(args.out, "README.md")
    existing = None
    if os.path.isfile(results_readme):
        with open(results_readme) as f:
            existing = f.read()
        try:  # a README whose markers are broken is refused before anything is copied
            results_readme_text(existing, {name: "" for name, _ in SECTIONS})
        except ValueError as e:
            parser.error(f"--out: {results_readme}: {e}")
    os.makedirs(args.out, exist_ok=True)
    main_rows, short_rows, detail_rows, histogram_rows, speed_table_rows = [], [], [], [], []
    finished, speeds = {}, {}  # (arm, temperature) -> summary of a finished acceptance / speed run
    shown, oracles = {}, {}  # (label, temperature) -> per-dataset summaries in the table; T -> oracle's
    temperatures = temperatures_run(args.runs)
    filters = {}  # T -> its filter, as the runs recorded it
    for t in temperatures:
        for arm in ARMS:
            accept_dir = os.path.join(args.runs, "accept", f"{arm}-T{t}")
            speed_dir = os.path.join(args.runs, "speed", f"{arm}-T{t}")
            accept, speed = load(os.path.join(accept_dir, "summary.json")), load(os.path.join(speed_dir, "summary.json"))
            finished[arm, t], speeds[arm, t] = accept, speed
            if speed is not None:
                copy_run(speed_dir, os.path.join(args.out, f"{arm}-T{t}-speed"), args.runs)
                filters[t] = filter_label(speed["settings"])
                speed_table_rows.append(speed_row(t, filters[t], arm, speed))
            partial = accept is None and args.partial and os.path.exists(os.path.join(accept_dir, "records.jsonl"))
            if partial:
                records = read_run_records(accept_dir, live=True)
                if not records:
                    continue
                accept = dict(summarize_run(records), settings=records[0]["settings"])
            elif accept is None:
                if speed is not None:
                    short_rows.append(short_row(t, filters[t], arm, None, speed))
                continue
            else:
                copy_run(accept_dir, os.path.join(args.out, f"{arm}-T{t}"), args.runs)
                histogram_rows.append(histogram_row(args.out, arm, t))
            calibration = load(os.path.join(accept_dir, "calibration", "calibration.json"))
            zt = zt_cell(calibration)
            per = accept["datasets"]
            filters[t] = filter_label(accept["settings"])
            complete = set(DATASETS) <= set(per)  # means over fewer datasets would not compare
            ceiling = [per[d]["ceiling_fraction"] for d in DATASETS] if complete else []
            label = f"{arm} (partial)" if partial else arm
            shown[label, t] = per
            main_rows.append(
                f"| {t} ({filters[t]}) | {label} | {zt} | " + " | ".join(tau_cell(per.get(d)) for d in DATASETS)
                + f" | {fmt(accept['macro']['expected_accepted'] if complete else None)} | "
                + (f"{100 * sum(ceiling) / len(ceiling):.1f}% |" if ceiling else "- |"))
            short_rows.append(short_row(t, filters[t], label, per.get("gsm8k"), speed))
            for d in DATASETS:
                s = per.get(d)
                if s is None:
                    continue
                detail_rows.append(
                    f"| {t} | {label} | {d} | {tau_cell(s)} | {s['cycle_mean']:.2f} [{s['cycle_mean_ci'][0]:.2f}, "
                    f"{s['cycle_mean_ci'][1]:.2f}] | {100 * first_draft_accepted(s):.1f}% | "
                    f"{100 * s['ceiling_fraction']:.1f}% | {fmt(s['expected_accepted'])} | {s['n_prompts']} | "
                    f"{s['n_eos_terminated']}/{s['n_responses']} | {s['n_cycles']} |")
    header = ("| temperature | drafter | Z_T | " + " | ".join(f"tau {DATASET_TITLES[d]}" for d in DATASETS) + " | "
              "macro expected accepted | ceiling (mean) |\n"
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    short_header = ("| temperature | drafter | tau on GSM8K, one branch [95% CI] | tau on GSM8K, CPU defaults | "
                    "speed-up on GSM8K | speed-up, mean of 4 datasets |\n| --- | --- | ---: | ---: | ---: | ---: |")
    speed_header = ("| temperature | drafter | settings | tau GSM8K [95% CI] | macro tau | "
                    + " | ".join(f"speed-up {DATASET_TITLES[d]}" for d in DATASETS) + " | speed-up, mean |\n"
                    "| --- | --- | --- | ---: | ---: |" + " ---: |" * len(DATASETS) + " ---: |")
    detail_header = ("| T | drafter | dataset | tau [95% CI] | cycle mean [95% CI] | first draft accepted | ceiling | "
                     "expected accepted | prompts | EOS / responses | cycles |\n"
                     "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    block_rows = []
    for arm in ARMS:
        for b in (16, 8, 4):
            folders = glob.glob(os.path.join(args.runs, "blocks", f"{arm}-B{b}")) + sorted(
                glob.glob(os.path.join(args.runs, "blocks", f"{arm}-B{b}-V*")),
                key=lambda path: int(path.rsplit("-V", 1)[1]), reverse=True)
            for blocks_dir in folders:  # the whole vocabulary first, then shortlists, largest first
                s = load(os.path.join(blocks_dir, "summary.json"))
                if s is None or "gsm8k" not in s["datasets"]:
                    continue
                copy_run(blocks_dir, os.path.join(args.out, os.path.basename(blocks_dir)), args.runs)
                g = s["datasets"]["gsm8k"]
                vocab = s["settings"].get("draft_vocab")
                block_rows.append(f"| {arm} | {b} | {'all' if vocab is None else vocab} | {tau_cell(g)} | "
                                  f"{fmt(g['expected_accepted'])} | {speed_cell(g)} | {g['n_prompts']} |")
    block_header = ("| drafter | inference block | draft vocabulary | tau [95% CI] | expected accepted | speed-up | "
                    "prompts |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    oracle_rows, oracle_blocks = [], set()
    for t in temperatures:  # eval.sh runs no greedy oracle: greedy decoding always drafts the top token
        oracle_dir = os.path.join(args.runs, "oracle", f"T{t}")
        oracle = load(os.path.join(oracle_dir, "oracle.json"))
        if oracle is None:
            continue
        filters[t] = filter_label(oracle["settings"])
        oracle_blocks.add(oracle["settings"]["block_size"])
        copy_run(oracle_dir, os.path.join(args.out, f"oracle-T{t}"), args.runs)
        per = oracles[t] = oracle["datasets"]
        top = [per[d]["top_probability"] for d in DATASETS if per.get(d, {}).get("top_probability") is not None]
        oracle_rows.append(f"| {t} ({filters[t]}) | " + " | ".join(
                               tau_cell(per[d]) + f" ({100 * first_draft_accepted(per[d]):.0f}%)" if d in per else "-"
                               for d in DATASETS)
                           + f" | {fmt(sum(top) / len(top) if top else None, 3)} | "
                           + str(sum(per[d]["n_prompts"] for d in DATASETS if d in per)) + " |")
    oracle_header = (f"Block {', '.join(map(str, sorted(oracle_blocks))) or '-'} (the oracle drafts B - 1 tokens per "
                     "cycle). Each cell: tau [95% CI] (the share of cycles whose first draft is accepted).\n\n"
                     "| temperature | " + " | ".join(DATASET_TITLES[d] for d in DATASETS) + " | mean top-token probability | prompts ended with EOS |\n"
                     "| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    determinism = os.path.join(args.runs, "determinism")
    if os.path.isdir(determinism):
        copy_run(determinism, os.path.join(args.out, "determinism"), args.runs)
    missing = "\n*(no runs of this phase yet: `bash recipes/smollm2/evaluate/eval.sh` makes them)*"
    short_rows.sort(key=lambda row: float(row.split(" ", 2)[1]))  # rows of speed-only temperatures came in early
    main_rows, short_rows, detail_rows, histogram_rows, block_rows, oracle_rows, speed_table_rows = (
        rows or [missing] for rows in (main_rows, short_rows, detail_rows, histogram_rows, block_rows, oracle_rows,
                                       speed_table_rows))
    targets = target_rows(finished, speeds, args.runs)
    plotted = plot_tau(os.path.join(args.out, "tau.png"), shown, oracles, filters)
    speed_prompts = sorted({d["n_prompts"] for run in speeds.values() if run for d in run["datasets"].values()})
    speed_source = "the `speed` phase, " + ("/".join(map(str, speed_prompts)) + " prompts per dataset" if speed_prompts
                                            else "not run yet")
    legend = ("Each tau cell: tau [95% CI] over the reported prompts' EOS-terminated responses, one branch "
              "verified per cycle (DBLast's rule), float32; "
              "Z_T: the value of the calibration grid with the largest expected accepted length on the "
              "10% split, `(grid top)` where that is the grid's largest; "
              "`(partial)`: a run still going, from its records so far; `-`: not measured yet.")
    speed_legend = ("Runs of `dblast eval --fastest-settings --measure-speedup --all-responses` (" + speed_source
                    + "): the settings `dblast demo` and `dblast generate` pick on this CPU, Z_T 1; tau over every "
                    "response; speed-up: tokens per second against sampling with the target alone in the same "
                    "dtype, same prompts, seeds and filter; `(N contended)` where N of a dataset's responses were "
                    "timed while other processes kept cores busy.")
    blocks = {
        "targets": targets,
        "acceptance": ("![tau per dataset](tau.png)\n\n" if plotted else "") + header + "\n" + "\n".join(main_rows)
                      + "\n\n" + legend,
        "speed": speed_header + "\n" + "\n".join(speed_table_rows) + "\n\n" + speed_legend,
        "per-dataset": detail_header + "\n" + "\n".join(detail_rows),
        "blocks": block_header + "\n" + "\n".join(block_rows),
        "oracle": oracle_header + "\n" + "\n".join(oracle_rows),
        "histograms": HISTOGRAM_HEADER + "\n" + "\n".join(histogram_rows),
        "determinism": determinism_section(os.path.join(args.out, "determinism")),
    }
    write_text(results_readme, results_readme_text(existing, blocks))
    if args.readme:
        link = os.path.relpath(results_readme, os.path.dirname(os.path.abspath(args.readme))).replace(os.sep, "/")
        short_legend = ("tau: tokens committed per target forward pass (1.00 when no draft is ever accepted), the "
                        "mean over prompts, with its 95% bootstrap interval for one branch verified per cycle in "
                        "float32 (the acceptance runs); CPU defaults: the settings `dblast demo` picks here "
                        "(bfloat16, a trie of branch nodes, a draft vocabulary), where the speed-ups are measured: "
                        "tokens per second against sampling with the target alone in the same dtype, same prompts, "
                        "seeds and filter (" + speed_source + "). "
                        f"Written by `recipes/smollm2/evaluate/collect.py`; every table: [{link}]({link}).")
        try:
            rewrite_readme_block(args.readme, short_header + "\n" + "\n".join(short_rows) + "\n\n" + short_legend)
        except ValueError as e:
            parser.error(str(e))
    print(targets + "\n\n" + header + "\n" + "\n".join(main_rows) + "\n\n" + speed_header + "\n"
          + "\n".join(speed_table_rows) + "\n\n" + block_header + "\n" + "\n".join(block_rows)
          + "\n\n" + oracle_header + "\n" + "\n".join(oracle_rows))


if __name__ == "__main__":
    main()
