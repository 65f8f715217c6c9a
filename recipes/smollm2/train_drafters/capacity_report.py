"""The capacity pilots' results page (results/smollm2/capacity/README.md) from the scaled
campaign's ledger (training/scaled.json) and its logs (logs/scaled/): each depth's pilot (steps,
training time, the held-out accepted-length proxy and first-draft agreement as measured alone on
the held-out anchors), what a decoding cycle costs at that depth (capacity_cost.py, from the
ledger's settings), the expected speed that follows, the paired comparisons that chose the
depth, and two plots: the held-out proxy over the pilots' training steps, and each pair's gain
with its 95% interval against the gain that would pay for the deeper drafter's longer cycle.

Written at any point of the pilot stage: with two or more pilots measured the comparisons are
shown (marked provisional until every depth of `layers_choices` is in); the choice itself is the
campaign's (train_scaled.choose_depth), never made here.

    python recipes/smollm2/train_drafters/capacity_report.py --out results/smollm2/capacity
"""
import argparse
import datetime
import json
import os
import sys

from train_scaled import RECIPE, choose_from_logs, read_pilot_logs

from dblast_ext.eval.report import pyplot
from dblast_ext.jsonl import read_jsonl


def pilot_rounds(ledger: dict) -> dict:
    """{layers: the index of the round that trained and measured that pilot}."""
    found = {}
    for record in ledger["rounds"]:
        if record["stage"] != "pilots":
            continue
        for name in record["runs"]:
            if name.startswith("pilot-L"):
                found[int(name[len("pilot-L"):])] = record["round"]
    return found


def run_log(logs: str, run: str, kind: str = "eval") -> list:
    """A run's held-out evaluations ("eval") or training steps ("train"), as train_scaled.py
    copied them into the logs."""
    path = os.path.join(logs, f"{run}-{kind}_log.jsonl")
    return [entry for _, entry in read_jsonl(path, f"{run} {kind} log")]


def pilot_rows(ledger: dict, logs: str) -> list:
    """One row per measured pilot, shallowest first: its training and its measurement alone."""
    rounds, cycle = pilot_rounds(ledger), {int(k): float(v) for k, v in ledger["settings"]["cycle_ms"].items()}
    rows = []
    for depth in sorted(int(d) for d in ledger["pilots"]):
        measured, prefix = ledger["pilots"][str(depth)], f"round-{rounds[depth]:02d}"
        alone = run_log(logs, f"{prefix}-measure-L{depth}")[0]
        curve = run_log(logs, f"{prefix}-pilot-L{depth}")
        steps = sorted(e["seconds"] for e in run_log(logs, f"{prefix}-pilot-L{depth}", "train") if "seconds" in e)
        rows.append({"layers": depth, "round": rounds[depth], "steps": measured["pilot_steps"],
                     "seconds": measured["pilot_seconds"], "blocks": measured["blocks"],
                     "step_seconds": steps[len(steps) // 2] if steps else None,
                     "proxy": alone["accepted_proxy"], "first_draft": alone["top1_agreement"][0],
                     "cycle_ms": cycle.get(depth), "curve": [(e["step"], e["accepted_proxy"]) for e in curve]})
    shallowest = rows[0] if rows and rows[0]["cycle_ms"] else None
    for row in rows:   # speed ~ tokens a cycle commits (1 + accepted drafts) / the cycle's time
        if shallowest and row["cycle_ms"]:
            row["speed"] = ((1 + row["proxy"]) / row["cycle_ms"]) / ((1 + shallowest["proxy"]) / shallowest["cycle_ms"])
    return rows


def plot_curves(rows: list, path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for row in rows:
        steps, proxies = zip(*row["curve"])
        line, = ax.plot(steps, proxies, marker="o", markersize=3, label=f"{row['layers']} layer{'' if row['layers'] == 1 else 's'}")
        ax.plot([row["steps"]], [row["proxy"]], marker="*", markersize=12, color=line.get_color())
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out accepted-length proxy")
    ax.set_title("Capacity pilots on the held-out split\n(line: while training; star: measured alone, more anchors)",
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_pairs(pairs: list, path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 1.9 + 0.5 * len(pairs)))
    for y, p in enumerate(pairs):
        ax.errorbar([p["mean"]], [y], xerr=[[p["mean"] - p["low"]], [p["high"] - p["mean"]]], fmt="o", capsize=4,
                    color="tab:blue", label="mean gain, 95% interval" if y == 0 else None)
        ax.plot([p["break_even"]], [y], marker="|", markersize=18, color="tab:red",
                label="gain that pays for the longer cycle" if y == 0 else None)
    ax.axvline(0, color="grey", linewidth=0.8)
    ax.set_yticks(range(len(pairs)), [f"L{p['deeper']} vs L{p['shallower']}" for p in pairs])
    ax.set_xlabel("held-out accepted-length proxy: deeper minus shallower (paired anchors)")
    ax.set_ylim(-0.6, len(pairs) - 0.4)
    ax.grid(axis="x", alpha=0.3)
    fig.legend(fontsize=8, loc="upper center", ncol=2)   # above the axes: never over an interval
    fig.tight_layout(rect=(0, 0, 1, 0.88))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def page(ledger: dict, rows: list, choice, final: bool, note: str) -> str:
    s = ledger["settings"]
    shards = ledger["pilot_shards"] or []
    lines = [
        "# Capacity pilots: how deep the scaled drafters should be (issue 58)", "",
        f"Written by `recipes/smollm2/train_drafters/capacity_report.py` on {datetime.date.today().isoformat()} from the "
        "scaled campaign's ledger (`recipes/smollm2/training/scaled.json`) and logs (`recipes/smollm2/logs/scaled/`).", "",
        f"Each pilot is a K = 1 drafter trained from scratch (NLL with distillation to the target's top-32, block "
        f"{s['block']}) for {s['pilot_steps']} steps of {s['batch_size']} sequences x {s['num_anchors']} anchors, "
        f"seed 0, on the same {len(shards)} shards; then measured alone on the held-out split with {s['eval_anchors']} "
        "anchors a sequence, the same anchors for every depth, so their per-anchor proxies pair. The proxy is the "
        "expected number of drafts a verify accepts (one branch); a cycle commits about 1 + proxy tokens.", "",
        "| layers | steps | a step (median) | run | held-out proxy | first-draft agreement | cycle | speed vs the shallowest |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        cycle = f"{r['cycle_ms']:.1f} ms" if r["cycle_ms"] else "not measured"
        speed = f"{r['speed']:.3f}x" if "speed" in r else "-"
        step = f"{r['step_seconds']:.2f} s" if r["step_seconds"] else "-"
        lines.append(f"| {r['layers']} | {r['steps']} | {step} | {duration(r['seconds'])} | {r['proxy']:.4f} "
                     f"| {100 * r['first_draft']:.1f}% | {cycle} | {speed} |")
    lines += ["", "A step's time is the median of the logged steps (cached features); a run's time includes its "
              "start-up and held-out evaluations, and the first pilot's the chunk's feature pass as well. "
              f"Cycle times: {s.get('cycle_cost_source', 'the ledger settings cycle_ms')}", "",
              "![held-out proxy over training steps](proxy_over_steps.png)", ""]
    if choice is not None:
        status = ("The campaign's choice" if final else
                  f"Provisional: {len(rows)} of {len(s['layers_choices'])} depths measured, so no depth is chosen yet")
        lines += [f"## {status}", "",
                  "A deeper drafter is chosen when its gain over every shallower pilot has a paired bootstrap 95% "
                  f"interval above 0 ({s['bootstrap_samples']} resamples of the anchors) and a mean above the gain that "
                  "pays for its longer cycle, (1 + the shallower's proxy) x (its cycle / the shallower's - 1); else the "
                  "shallowest.", "", *choice["table"], "",
                  "![paired gains against their break-even](pair_gains.png)", ""]
        if final:
            n = choice["layers"]
            lines += [f"**Chosen: {n} layer{'' if n == 1 else 's'}.**", ""]
    if note:
        lines += [note, ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ledger", default=os.path.relpath(os.path.join(RECIPE, "training", "scaled.json")))
    parser.add_argument("--logs", default=os.path.relpath(os.path.join(RECIPE, "logs", "scaled")))
    parser.add_argument("--out", default="results/smollm2/capacity")
    parser.add_argument("--note", default="", help="a closing paragraph (the machine of the pilots, what is next)")
    args = parser.parse_args()
    if not os.path.isfile(args.ledger):
        parser.error(f"--ledger {args.ledger} does not exist: run train_scaled.py's pilots first")
    with open(args.ledger) as f:
        ledger = json.load(f)
    if not ledger["pilots"]:
        parser.error(f"--ledger {args.ledger} has no measured pilot yet")
    rows = pilot_rows(ledger, args.logs)
    final = ledger["choice"] is not None
    choice = ledger["choice"] if final else (choose_from_logs(ledger, read_pilot_logs(ledger, args.logs))
                                             if len(rows) > 1 else None)
    os.makedirs(args.out, exist_ok=True)
    plot_curves(rows, os.path.join(args.out, "proxy_over_steps.png"))
    if choice is not None:
        plot_pairs(choice["pairs"], os.path.join(args.out, "pair_gains.png"))
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write(page(ledger, rows, choice, final, args.note))
    print(f"wrote {os.path.join(args.out, 'README.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
