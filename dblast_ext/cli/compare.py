"""`dblast compare RUN_A RUN_B [RUN_C ...]`: paired committed-length comparison of runs on
the same prompts (each later run against the first), per dataset, with a Holm correction
over the whole family of comparisons."""
from ..eval.metrics import holm, paired_delta_tau, spearman, summarize
from ..eval.records import read_run_records


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("compare", help="paired delta-tau between runs on the same prompts (Holm-corrected)",
                              description="Compare `dblast eval` runs on the same prompts: for every later run and "
                                          "dataset, delta tau against the first run with a paired bootstrap 95% "
                                          "interval and p-value, Holm step-down over the family.")
    p.add_argument("runs", nargs="+", help="run directories (or records.jsonl files); the first is the baseline")
    p.add_argument("--alpha", type=float, default=0.05,
                   help="family-wise error rate for Holm (default %(default)s)")
    p.add_argument("--all-responses", action="store_true", help="also count responses that did not end with EOS")
    p.add_argument("--n-boot", type=int, default=2000,
                   help="bootstrap resamples for the 95%% intervals and sign flips for the p-values, >= 1 (the "
                        "smallest p-value is 1 / (N + 1)) (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the resampling (default %(default)s)")
    p.add_argument("--out", default=None, help="also write the table to this Markdown file")


def compare_runs(runs, *, alpha=0.05, eos_only=True, n_boot=2000, seed=0):
    if len(runs) < 2:
        raise ValueError("compare needs at least two runs: a baseline and one to compare with it")
    if not 0 < alpha < 1:
        raise ValueError(f"--alpha must lie in (0, 1), got {alpha}")
    if n_boot < 1:
        raise ValueError(f"--n-boot must be >= 1, got {n_boot}")
    loaded = [read_run_records(r) for r in runs]
    datasets = sorted({r["dataset"] for r in loaded[0]})
    rows = []
    for run, records in zip(runs[1:], loaded[1:]):
        other = sorted({r["dataset"] for r in records})
        if other != datasets:
            raise ValueError(f"{run} covers datasets {other}, the baseline {runs[0]} covers {datasets}")
        for name in datasets:
            out = paired_delta_tau([r for r in loaded[0] if r["dataset"] == name],
                                   [r for r in records if r["dataset"] == name],
                                   eos_only=eos_only, n_boot=n_boot, seed=seed)
            rows.append(dict(run=run, dataset=name, **out))
    for row, rejected in zip(rows, holm([r["p_value"] for r in rows], alpha)):
        row["significant"] = rejected
        # the baseline's ceiling fraction on that dataset: the indicator of how much a change can gain
        row["baseline_ceiling"] = summarize([r for r in loaded[0] if r["dataset"] == row["dataset"]],
                                            eos_only=eos_only, n_boot=1)["ceiling_fraction"]
    return rows


def ceiling_gain_correlation(rows):
    """Spearman rho between the baseline's ceiling fraction and delta tau over the datasets
    of each compared run (DBloom §6.1: the ceiling bin predicts the gain); None where fewer
    than three datasets or a constant column make it undefined."""
    out = {}
    for run in dict.fromkeys(r["run"] for r in rows):
        mine = [r for r in rows if r["run"] == run]
        try:
            out[run] = spearman([r["baseline_ceiling"] for r in mine], [r["delta"] for r in mine]) \
                if len(mine) >= 3 else None
        except ValueError:
            out[run] = None
    return out


def format_table(rows, baseline: str, alpha: float, eos_only: bool = True) -> str:
    scope = "prompts that ended with EOS in both runs" if eos_only else "every shared prompt"
    lines = [f"Paired delta tau against {baseline} ({scope}); "
             f"Holm step-down over all {len(rows)} comparisons at alpha = {alpha}.", "",
             "| run | dataset | delta tau | 95% CI | p-value | prompts | Holm | baseline ceiling |",
             "| --- | --- | ---: | --- | ---: | ---: | --- | ---: |"]
    for r in rows:
        verdict = ("significant +" if r["delta"] > 0 else "significant -") if r["significant"] else "ns"
        lines.append(f"| {r['run']} | {r['dataset']} | {r['delta']:+.3f} | [{r['ci'][0]:+.3f}, {r['ci'][1]:+.3f}] | "
                     f"{r['p_value']:.4f} | {r['n']} | {verdict} | {100 * r['baseline_ceiling']:.1f}% |")
    for run, rho in ceiling_gain_correlation(rows).items():
        if rho is not None:
            lines.append(f"\nSpearman rho (baseline ceiling fraction vs delta tau over datasets) for {run}: {rho:+.2f}")
    return "\n".join(lines)


def run(args) -> int:
    rows = compare_runs(args.runs, alpha=args.alpha, eos_only=not args.all_responses, n_boot=args.n_boot,
                        seed=args.seed)
    table = format_table(rows, args.runs[0], args.alpha, eos_only=not args.all_responses)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    return 0
