"""Run summaries as files people read: summary.json, a Markdown report with a table per
dataset and the macro-average, and PNG plots (acceptance histograms with the ceiling bin
marked, committed length per dataset with intervals)."""
import json
import os
from typing import Dict, List, Optional, Sequence

from .contention import CONTENTION_LIMIT
from .metrics import macro_average, summarize

MACRO_KEYS = ("tau", "cycle_mean", "ceiling_fraction", "expected_accepted", "speedup")


def summarize_run(records: Sequence[dict], *, eos_only: bool = True, n_boot: int = 2000, seed: int = 0) -> Dict:
    """{"datasets": {name: summary}, "macro": {key: mean over datasets}}; a dataset none of
    whose responses ended with EOS is reported with its error instead of numbers, and then the
    run has no macro-average (it would be over fewer datasets than another run's)."""
    by_dataset: Dict[str, List[dict]] = {}
    for r in records:
        by_dataset.setdefault(r["dataset"], []).append(r)
    summaries, skipped = {}, {}
    for name, group in by_dataset.items():
        try:
            summaries[name] = summarize(group, eos_only=eos_only, n_boot=n_boot, seed=seed)
        except ValueError as e:
            skipped[name] = str(e)
    macro = {key: None if skipped else macro_average(summaries, key) for key in MACRO_KEYS}
    return {"datasets": summaries, "skipped": skipped, "macro": macro, "eos_only": eos_only}


def _fmt(value, digits=2, pct=False) -> str:
    if value is None:
        return "-"
    return f"{100 * value:.1f}%" if pct else f"{value:.{digits}f}"


def contention_lines(summary: Dict) -> List[str]:
    """One line per dataset whose speed-up pools responses timed on busy cores (summarize's
    contended_responses)."""
    return [f"{name}: {s['contended_responses']} of {s['n_responses']} timed responses ran while other processes "
            f"kept more than {CONTENTION_LIMIT} cores busy on average: its speed-up is not this machine's alone"
            for name, s in summary["datasets"].items() if s["speedup"] and s.get("contended_responses")]


def markdown_report(summary: Dict, settings: dict, title: str = "Evaluation") -> str:
    lines = [f"# {title}", "", "Settings: " + ", ".join(f"`{k}={v}`" for k, v in settings.items()), ""]
    scope = ("the responses that ended with end-of-sequence" if summary.get("eos_only", True)
             else "every response, including those cut at the length cap")
    lines += ["Committed length per target pass (accepted drafts + 1): tau is the prompt mean, the cycle mean",
              "weights every cycle equally; 95% bootstrap intervals over prompts; acceptance statistics over",
              f"{scope}. Expected accepted length excludes the bonus",
              "token. Speed-up: target-only time per token over speculative time per token.", ""]
    lines += ["| dataset | tau [95% CI] | cycle mean [95% CI] | ceiling | expected accepted | speed-up | "
              "prompts (EOS / responses) | cycles |", "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, s in summary["datasets"].items():
        lines.append(f"| {name} | {s['tau']:.2f} [{s['tau_ci'][0]:.2f}, {s['tau_ci'][1]:.2f}] | "
                     f"{s['cycle_mean']:.2f} [{s['cycle_mean_ci'][0]:.2f}, {s['cycle_mean_ci'][1]:.2f}] | "
                     f"{_fmt(s['ceiling_fraction'], pct=True)} | {_fmt(s['expected_accepted'])} | "
                     f"{_fmt(s['speedup'])}{'x' if s['speedup'] else ''} | "
                     f"{s['n_prompts']} ({s['n_eos_terminated']} / {s['n_responses']}) | {s['n_cycles']} |")
    m = summary["macro"]
    lines.append(f"| **macro-average** | {_fmt(m['tau'])} | {_fmt(m['cycle_mean'])} | "
                 f"{_fmt(m['ceiling_fraction'], pct=True)} | {_fmt(m['expected_accepted'])} | "
                 f"{_fmt(m['speedup'])}{'x' if m['speedup'] else ''} | | |")
    for name, why in summary.get("skipped", {}).items():
        lines.append(f"\n{name}: not summarised (so no macro-average): {why}")
    lines += ["\n" + line + "." for line in contention_lines(summary)]
    for name, s in summary["datasets"].items():
        lines += ["", f"## {name}: acceptance histogram (accepted drafts per cycle)", "",
                  f"![{name} histogram](histogram_{slug(name)}.png)", "", "| n | cycles | share |", "| ---: | ---: | ---: |"]
        total = sum(s["histogram"]) or 1
        for n, count in enumerate(s["histogram"]):
            mark = " (ceiling)" if n == len(s["histogram"]) - 1 else ""
            lines.append(f"| {n}{mark} | {count} | {100 * count / total:.1f}% |")
    lines += ["", "![committed length per dataset](committed_length.png)", ""]
    return "\n".join(lines)


def slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)


def pyplot():
    """matplotlib.pyplot drawing to files (no display needed); ImportError without matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_histogram(path: str, histogram: Sequence[int], title: str) -> None:
    plt = pyplot()

    total = sum(histogram) or 1
    shares = [100 * h / total for h in histogram]
    colors = ["#4c72b0"] * (len(histogram) - 1) + ["#c44e52"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(range(len(histogram)), shares, color=colors)
    ax.set_xlabel("accepted drafts n per cycle (ceiling bin n = b = B - 1 in red)")
    ax.set_ylabel("cycles (%)")
    ax.set_title(title)
    ax.set_xticks(range(len(histogram)))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_committed_length(path: str, summaries: Dict[str, Dict]) -> None:
    plt = pyplot()

    names = list(summaries)
    fig, ax = plt.subplots(figsize=(max(4, 1.6 * len(names) + 2), 3.5))
    width = 0.38
    for offset, key, label in ((-width / 2, "tau", "tau (prompt mean)"), (width / 2, "cycle_mean", "cycle mean")):
        values = [summaries[n][key] for n in names]
        errors = [[v - summaries[n][key + "_ci"][0] for n, v in zip(names, values)],
                  [summaries[n][key + "_ci"][1] - v for n, v in zip(names, values)]]
        ax.bar([i + offset for i in range(len(names))], values, width, yerr=errors, capsize=3, label=label)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names)
    ax.set_ylabel("committed tokens per target pass")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(out_dir: str, records: Sequence[dict], settings: dict, *, eos_only: bool = True,
                 title: str = "Evaluation") -> Dict:
    """Writes summary.json, report.md and the plots into out_dir; returns the summary."""
    summary = summarize_run(records, eos_only=eos_only)
    summary["settings"] = settings
    # the prompts summarised: records.jsonl can also hold those of an earlier run into the same
    # directory with other prompts (read_run_records keeps to these)
    summary["prompts"] = [list(key) for key in dict.fromkeys((r["dataset"], r["prompt_id"]) for r in records)]
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(markdown_report(summary, settings, title))
    plots_skipped: Optional[str] = None
    try:
        plot_histograms(out_dir, summary["datasets"])
        if summary["datasets"]:
            plot_committed_length(os.path.join(out_dir, "committed_length.png"), summary["datasets"])
    except ImportError:
        plots_skipped = PLOTS_SKIPPED
    summary["plots_skipped"] = plots_skipped
    return summary


PLOTS_SKIPPED = "matplotlib is not installed: plots skipped (pip install matplotlib)"


def plot_histograms(out_dir: str, summaries: Dict[str, Dict], label: str = "") -> None:
    """histogram_<dataset>.png per summarised dataset (ImportError without matplotlib)."""
    for name, s in summaries.items():
        plot_histogram(os.path.join(out_dir, f"histogram_{slug(name)}.png"), s["histogram"],
                       f"{name}{label}: ceiling {100 * s['ceiling_fraction']:.1f}%, tau {s['tau']:.2f}")


def plot_calibration(path: str, result: Dict) -> None:
    """Macro expected accepted length over the Z_T grid, the chosen Z_T marked (no plot
    without matplotlib)."""
    try:
        plt = pyplot()
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(result["grid"], result["scores"], marker="o")
    ax.axvline(result["best"], color="#c44e52", linestyle="--", label=f"chosen Z_T = {result['best']}")
    ax.set_xlabel("category temperature Z_T")
    ax.set_ylabel("macro expected accepted length")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_determinism(path, arms, gains=None) -> None:
    """Bars of mean expected accepted length (+- one standard error) per determinism bin, one
    bar per arm side by side; with a baseline, the first arm's relative gain above each pair."""
    try:
        plt = pyplot()
    except ImportError:
        return
    bins = arms[0][1]
    labels = [f"({b['bin'][0]:.1f}, {b['bin'][1]:.1f}]\nn={b['count']}" for b in bins]
    width = 0.8 / len(arms)
    colors = ["#4c72b0", "#dd8452"]
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for a, (name, arm_bins) in enumerate(arms):
        x = [k + (a - (len(arms) - 1) / 2) * width for k in range(len(bins))]
        ax.bar(x, [b["mean"] or 0.0 for b in arm_bins], width, yerr=[b["sem"] or 0.0 for b in arm_bins], capsize=3,
               color=colors[a % len(colors)], label=name)
    if gains is not None:
        for k, (gain, b, base) in enumerate(zip(gains, arms[0][1], arms[1][1])):
            if gain is not None:
                top = max(b["mean"] + (b["sem"] or 0.0), base["mean"] + (base["sem"] or 0.0))
                ax.annotate(f"{100 * gain:+.0f}%", (k, top), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(bins)), labels, fontsize=8)
    ax.set_xlabel("target-block early determinism (truncation points per bin)")
    ax.set_ylabel("expected accepted length")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
