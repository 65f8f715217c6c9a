"""Committed-length metrics over evaluation records (DBloom §5.2, Eq 1-2, Appendix E-F).

A record is one generated response (a dict, one JSONL line; see records.py): `dataset`,
`prompt_id`, `accepted` (n per cycle, 0..b), `expected_accepted` (per cycle), `block_size`,
`eos_terminated`, `new_tokens`, `wall_time`, optionally `ar_wall_time` / `ar_new_tokens`.

The statistical unit is the prompt, keyed by (dataset, prompt_id); a prompt with several
responses (repeats, MT-Bench turns under one id) pools their cycles. With c_p cycles and
per-prompt mean accepted count n̄_p over P prompts:
    tau = 1 + mean_p n̄_p                      (prompt-mean committed length)
    cycle_mean = 1 + sum_p sum_i n_pi / sum_p c_p   (cycle-mean committed length, E[n] + 1)
Intervals are 95% percentile bootstraps resampled over prompts: a per-prompt-mean
bootstrap for tau, a cluster (ratio) bootstrap for the cycle mean.
"""
from collections import OrderedDict
from typing import Dict, Iterable, List, Optional, Sequence

import numpy as np

from .contention import is_contended

CI_LEVEL = 0.95


def _by_prompt(records: Iterable[dict]) -> "OrderedDict[tuple, List[dict]]":
    groups: "OrderedDict[tuple, List[dict]]" = OrderedDict()
    for r in records:
        groups.setdefault((r["dataset"], str(r["prompt_id"])), []).append(r)
    return groups


def block_size_of(records: Sequence[dict]) -> int:
    sizes = {int(r["block_size"]) for r in records}
    if len(sizes) != 1:
        raise ValueError(f"records mix block sizes {sorted(sizes)}: summarise each block size separately")
    return sizes.pop()


def _check(records: Sequence[dict]) -> None:
    if not records:
        raise ValueError("no records: the run is empty")
    for i, r in enumerate(records):
        missing = [k for k in ("dataset", "prompt_id", "accepted", "block_size", "eos_terminated") if k not in r]
        if missing:
            raise ValueError(f"record {i} lacks {missing}")
        b = int(r["block_size"]) - 1
        bad = [n for n in r["accepted"] if not 0 <= n <= b]
        if bad:
            raise ValueError(f"record {i} ({r['dataset']}/{r['prompt_id']}) has accepted counts {bad} outside 0..{b}")


def _interval(samples: np.ndarray) -> List[float]:
    tail = (1 - CI_LEVEL) / 2 * 100
    return [float(np.percentile(samples, tail)), float(np.percentile(samples, 100 - tail))]


def per_prompt_counts(records: Sequence[dict]):
    """(keys, cycle sums S_p, cycle counts c_p) per prompt, prompts without cycles dropped
    (a response of one token is committed by the prefill alone and has no cycle)."""
    keys, sums, counts = [], [], []
    for key, group in _by_prompt(records).items():
        accepted = [n for r in group for n in r["accepted"]]
        if accepted:
            keys.append(key)
            sums.append(float(sum(accepted)))
            counts.append(float(len(accepted)))
    return keys, np.array(sums), np.array(counts)


def bootstrap_indices(n: int, n_boot: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n, size=(n_boot, n))


def kept_records(records: Sequence[dict], eos_only: bool) -> List[dict]:
    """The responses acceptance statistics use: those that ended with EOS, or all of them."""
    return [r for r in records if r["eos_terminated"] or not eos_only]


def summarize(records: Sequence[dict], *, eos_only: bool = True, n_boot: int = 2000, seed: int = 0) -> Dict:
    """tau, cycle_mean (each with a 95% prompt-level bootstrap interval), the histogram of n
    over 0..b, the ceiling fraction (n = b), the mean expected accepted length, the measured
    speed-up (when target-only timings exist), and counts. Acceptance statistics use the
    EOS-terminated responses only unless eos_only=False (runaways that hit the length cap
    inflate acceptance); the speed-up, a timing, uses every response."""
    _check(records)
    block = block_size_of(records)
    kept = kept_records(records, eos_only)
    if not kept:
        raise ValueError(f"none of the {len(records)} responses ended with an end-of-sequence token; "
                         "raise max_new_tokens or summarise with eos_only=False")
    keys, sums, counts = per_prompt_counts(kept)
    if not keys:
        raise ValueError("the kept responses have no decode cycles (every one ended at its first token)")
    means = sums / counts
    idx = bootstrap_indices(len(keys), n_boot, seed)
    tau_boot = 1 + means[idx].mean(axis=1)
    cycle_boot = 1 + sums[idx].sum(axis=1) / counts[idx].sum(axis=1)
    accepted = np.array([n for r in kept for n in r["accepted"]])
    histogram = np.bincount(accepted, minlength=block).tolist()
    expected = [e for r in kept for e in r.get("expected_accepted", [])]
    out = {
        "tau": float(1 + means.mean()), "tau_ci": _interval(tau_boot),
        "cycle_mean": float(1 + sums.sum() / counts.sum()), "cycle_mean_ci": _interval(cycle_boot),
        "histogram": histogram, "ceiling_fraction": histogram[-1] / len(accepted),
        "expected_accepted": float(np.mean(expected)) if expected else None,
        "block_size": block, "n_prompts": len(keys), "n_cycles": int(len(accepted)),
        "n_responses": len(records), "n_eos_terminated": sum(bool(r["eos_terminated"]) for r in records),
        "eos_only": eos_only, "speedup": speedup(records), "contended_responses": contended_responses(records),
    }
    return out


def first_draft_accepted(summary: Dict) -> float:
    """P(n >= 1) of a summary: the share of cycles whose first draft was accepted."""
    return 1 - summary["histogram"][0] / summary["n_cycles"]


def speedup_ratio(ar_tokens: int, ar_seconds: float, spec_tokens: int, spec_seconds: float) -> float:
    """Target-only time per token over speculative time per token."""
    return (ar_seconds / ar_tokens) / (spec_seconds / spec_tokens)


def speedup(records: Sequence[dict]) -> Optional[float]:
    """speedup_ratio pooled over the responses that carry both timings; None when none does."""
    timed = [r for r in records if r.get("ar_wall_time") and r.get("ar_new_tokens") and r.get("wall_time")]
    if not timed:
        return None
    return float(speedup_ratio(sum(r["ar_new_tokens"] for r in timed), sum(r["ar_wall_time"] for r in timed),
                               sum(r["new_tokens"] for r in timed), sum(r["wall_time"] for r in timed)))


def contended_responses(records: Sequence[dict]) -> int:
    """How many responses had a timed run (speculative or target-only) during which other
    processes kept more than CONTENTION_LIMIT cores busy: their timings, and the
    speed-up pooled over them, are not the machine's alone."""
    return sum(is_contended(r.get("foreign_load")) or is_contended(r.get("ar_foreign_load"))
               for r in records if r.get("ar_wall_time"))


def macro_average(summaries: Dict[str, Dict], key: str) -> Optional[float]:
    """The mean of `key` over datasets; None unless every dataset has it (a mean over some of
    them would compare runs on different datasets)."""
    values = [s.get(key) for s in summaries.values()]
    return float(np.mean(values)) if values and None not in values else None


def _prompt_means(records: Sequence[dict], eos_only: bool) -> Dict[tuple, float]:
    kept = kept_records(records, eos_only)
    keys, sums, counts = per_prompt_counts(kept)
    return dict(zip(keys, sums / counts))


def _check_same_prompts(records_a: Sequence[dict], records_b: Sequence[dict]) -> None:
    _check(records_a)
    _check(records_b)
    prompts_a = {(r["dataset"], str(r["prompt_id"])) for r in records_a}
    prompts_b = {(r["dataset"], str(r["prompt_id"])) for r in records_b}
    if prompts_a != prompts_b:
        raise ValueError(f"the runs cover different prompts ({len(prompts_a - prompts_b)} only in A, "
                         f"{len(prompts_b - prompts_a)} only in B): a paired comparison needs the same prompt set")


def paired_delta_tau(records_a: Sequence[dict], records_b: Sequence[dict], *, eos_only: bool = True,
                     n_boot: int = 2000, seed: int = 0) -> Dict:
    """tau(B) - tau(A) on the prompts both runs cover and (by default) both ended with EOS:
    the mean paired difference of per-prompt mean accepted counts, a paired bootstrap 95%
    interval, and a two-sided p-value from a sign-flip randomisation test (exact in
    distribution under the null that the paired differences are symmetric about zero)."""
    _check_same_prompts(records_a, records_b)
    a, b = _prompt_means(records_a, eos_only), _prompt_means(records_b, eos_only)
    shared = [k for k in a if k in b]
    if not shared:
        raise ValueError("no prompt has decode cycles and an end-of-sequence ending in both runs")
    diff = np.array([b[k] - a[k] for k in shared])
    idx = bootstrap_indices(len(diff), n_boot, seed)
    boot = diff[idx].mean(axis=1)
    signs = np.random.default_rng(seed + 1).choice([-1.0, 1.0], size=(n_boot, len(diff)))
    null = np.abs((signs * diff).mean(axis=1))
    p_value = (1 + np.sum(null >= abs(diff.mean()) - 1e-12)) / (n_boot + 1)
    return {"delta": float(diff.mean()), "ci": _interval(boot), "p_value": float(p_value), "n": len(diff)}


def paired_macro_delta(records_a: Sequence[dict], records_b: Sequence[dict], *, key: str = "expected_accepted",
                       eos_only: bool = True, n_boot: int = 2000, seed: int = 0) -> Dict:
    """macro(B) - macro(A) of a per-cycle quantity (`key`: a list per record, one value per cycle,
    such as expected_accepted): per dataset the mean over the cycles of the prompts both runs
    have cycles for (and, by default, both ended with EOS), then the mean over datasets. With a
    paired bootstrap 95% interval that resamples prompts within each dataset, the same prompts
    for both runs. Returns delta, ci, each run's macro (a, b) on those prompts, and the prompts
    per dataset (n). The runs' own summaries average over each run's kept prompts, so their
    macros may differ slightly from a and b."""
    _check_same_prompts(records_a, records_b)
    totals = []
    for records in (records_a, records_b):
        per_prompt = {}
        for prompt, group in _by_prompt(kept_records(records, eos_only)).items():
            values = [v for r in group for v in r.get(key, [])]
            if values:
                per_prompt[prompt] = (float(sum(values)), float(len(values)))
        totals.append(per_prompt)
    datasets = sorted({r["dataset"] for r in records_a})
    rng = np.random.default_rng(seed)
    delta_boot, macros, counts = np.zeros(n_boot), [0.0, 0.0], {}
    for name in datasets:
        shared = [k for k in totals[0] if k[0] == name and k in totals[1]]
        if not shared:
            raise ValueError(f"dataset {name}: no prompt has {key} values"
                             + (" and an end-of-sequence ending" if eos_only else "") + " in both runs")
        counts[name] = len(shared)
        idx = rng.integers(0, len(shared), size=(n_boot, len(shared)))
        means = []
        for i, per_prompt in enumerate(totals):
            sums = np.array([per_prompt[k][0] for k in shared])
            cycles = np.array([per_prompt[k][1] for k in shared])
            macros[i] += sums.sum() / cycles.sum() / len(datasets)
            means.append(sums[idx].sum(axis=1) / cycles[idx].sum(axis=1))
        delta_boot += (means[1] - means[0]) / len(datasets)
    return {"delta": float(macros[1] - macros[0]), "ci": _interval(delta_boot), "a": float(macros[0]),
            "b": float(macros[1]), "n": counts}


def holm(p_values: Sequence[float], alpha: float = 0.05) -> List[bool]:
    """Holm's step-down procedure: which hypotheses are rejected at family-wise level alpha
    (in the input order)."""
    p = np.asarray(p_values, dtype=float)
    if p.size and (np.any(p < 0) or np.any(p > 1) or np.any(np.isnan(p))):
        raise ValueError(f"p-values must lie in [0, 1], got {p_values}")
    reject = [False] * len(p)
    for rank, i in enumerate(np.argsort(p, kind="stable")):
        if p[i] > alpha / (len(p) - rank):
            break
        reject[i] = True
    return reject


def _ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n with ties given their average rank."""
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    sorted_x = x[order]
    start = 0
    while start < len(x):
        end = start
        while end + 1 < len(x) and sorted_x[end + 1] == sorted_x[start]:
            end += 1
        ranks[order[start:end + 1]] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman rank correlation (Pearson correlation of average ranks)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if x.shape != y.shape or x.ndim != 1 or len(x) < 2:
        raise ValueError(f"spearman needs two sequences of the same length >= 2, got {x.shape} and {y.shape}")
    rx, ry = _ranks(x), _ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        raise ValueError("spearman is undefined for a constant sequence")
    return float(np.corrcoef(rx, ry)[0, 1])


def survival(histogram: Sequence[float]) -> np.ndarray:
    """P(n >= k) for k = 0..len-1 from a histogram of n over 0..b."""
    h = np.asarray(histogram, dtype=float)
    if h.ndim != 1 or h.sum() <= 0 or np.any(h < 0):
        raise ValueError("a histogram must be non-negative counts with a positive total")
    return np.cumsum((h / h.sum())[::-1])[::-1]


def expansion_decomposition(hist_trained: Sequence[float], hist_wider: Sequence[float],
                            trained_block_size: int) -> Dict:
    """Naive block expansion, DBloom Eq 4-5: with P_B(k) = Pr[n >= k],
    E_B[n] - E_Btr[n] = G - L, G = sum_{k=Btr}^{B-1} P_B(k) (uncapped gain),
    L = sum_{k=1}^{Btr-1} [P_Btr(k) - P_B(k)] (front erosion); survival = P_B(Btr)."""
    if len(hist_trained) != trained_block_size:
        raise ValueError(f"hist_trained must have {trained_block_size} bins (n = 0..{trained_block_size - 1}), "
                         f"got {len(hist_trained)}")
    if len(hist_wider) <= trained_block_size:
        raise ValueError(f"hist_wider must cover a block wider than {trained_block_size}, got {len(hist_wider)} bins")
    p_tr, p_b = survival(hist_trained), survival(hist_wider)
    gain = float(p_b[trained_block_size:].sum())
    erosion = float((p_tr[1:] - p_b[1:trained_block_size]).sum())
    return {"G": gain, "L": erosion, "survival": float(p_b[trained_block_size]),
            "mean_trained": float(p_tr[1:].sum()), "mean_wider": float(p_b[1:].sum()),
            "gain_bound": float((len(hist_wider) - trained_block_size) * p_b[trained_block_size]),
            "ceiling_trained": float(hist_trained[-1] / np.sum(hist_trained)),
            "ceiling_wider": float(hist_wider[-1] / np.sum(hist_wider))}
