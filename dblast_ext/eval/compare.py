"""Paired comparison of evaluation runs on the same prompts: delta tau of each later run
against the first, per dataset, with a Holm correction over the whole family, and the
ceiling-gain correlation (DBloom §6.1)."""
from .metrics import holm, paired_delta_tau, spearman, summarize
from .records import read_run_records


def compare_runs(runs, *, alpha=0.05, eos_only=True, n_boot=2000, seed=0):
    """Paired delta tau of every later run against the first (`runs`: run directories or
    records files), per dataset, with a bootstrap 95% interval and sign-flip p-value, Holm
    step-down over the whole family at `alpha`; each row also carries the baseline's ceiling
    fraction on its dataset."""
    if len(runs) < 2:
        raise ValueError("compare needs at least two runs: a baseline and one to compare with it")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha}")
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
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
