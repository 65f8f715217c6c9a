"""Category-temperature calibration (DBLast §4): choose Z_T from a grid on a disjoint
calibration split (10% of each dataset's prompts) by macro-average expected accepted
length, then report on the other 90%."""
import json
import os
import random
import sys
import zlib
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..prompts import Prompt
from .report import plot_calibration
from .runner import evaluate

CALIBRATION_FRACTION = 0.1  # of each dataset's prompts, held out to choose Z_T on

DEFAULT_GRID = tuple(round(0.2 * i, 1) for i in range(8))  # 0.0, 0.2, ..., 1.4


def split_prompts(prompts: Sequence[Prompt], fraction: float = 0.1, seed: int = 0) -> Tuple[List[Prompt], List[Prompt]]:
    """(calibration, evaluation): a seeded random `fraction` of each dataset's prompts (at
    least one) and the rest, each in the original order; disjoint by construction."""
    if not 0 < fraction < 1:
        raise ValueError(f"the calibration fraction must lie in (0, 1), got {fraction}")
    by_dataset: Dict[str, List[Prompt]] = {}
    for p in prompts:
        by_dataset.setdefault(p.dataset, []).append(p)
    chosen = set()
    for name, group in by_dataset.items():
        if len(group) < 2:
            raise ValueError(f"dataset {name} has {len(group)} prompt: calibration needs at least 2 per dataset")
        rng = random.Random(zlib.crc32(f"{seed}/{name}".encode()))
        # Python rounds half to even: 10% of 45 prompts is 4 (not 5)
        count = min(len(group) - 1, max(1, round(fraction * len(group))))
        chosen.update((name, p.prompt_id) for p in rng.sample(group, count))
    calibration = [p for p in prompts if (p.dataset, p.prompt_id) in chosen]
    evaluation = [p for p in prompts if (p.dataset, p.prompt_id) not in chosen]
    return calibration, evaluation


def macro_expected_accepted(records: Sequence[dict]) -> float:
    """Mean over datasets of the per-dataset mean expected accepted length per cycle (every
    response: the quantity is a per-cycle expectation, not a count a runaway can inflate by
    running long)."""
    per_dataset: Dict[str, List[float]] = {}
    for r in records:
        per_dataset.setdefault(r["dataset"], []).extend(r["expected_accepted"])
    means = [np.mean(v) for v in per_dataset.values() if v]
    if not means:
        raise ValueError("the calibration records have no decode cycles")
    return float(np.mean(means))


def calibrate(run_at: Callable[[float], Sequence[dict]], grid: Sequence[float] = DEFAULT_GRID) -> Dict:
    """Runs `run_at(z)` (the calibration split's records at Z_T = z) for every z in the grid
    and picks the z with the highest macro-average expected accepted length (the smaller z
    on ties)."""
    if not grid or any(z < 0 for z in grid):
        raise ValueError(f"the Z_T grid must be non-empty and non-negative, got {list(grid)}")
    grid = sorted(grid)  # ascending, so that the first maximum is the smallest z
    scores = [macro_expected_accepted(run_at(z)) for z in grid]
    best = int(np.argmax(scores))  # the first maximum
    return {"grid": list(grid), "scores": scores, "best": grid[best]}


def parse_grid(spec: str) -> List[float]:
    try:
        grid = sorted(float(x) for x in spec.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--grid must be comma-separated numbers, got {spec!r}") from None
    if not grid:
        raise ValueError("--grid is empty")
    if grid[0] < 0:
        raise ValueError(f"--grid values are category temperatures, >= 0; got {grid[0]}")
    return grid


def calibrate_category_temperature(decoder, tokenizer, prompts: Sequence[Prompt], out_dir: str,
                                   grid: Sequence[float], spec, log: Callable[[str], None] = None
                                   ) -> Tuple[float, List[Prompt], Optional[Dict]]:
    """Runs the calibration split (`CALIBRATION_FRACTION` of each dataset, seeded by the run
    seed) at every grid value, its records kept under `out_dir` so that this resumes too, and
    returns (chosen Z_T, the evaluation split, the calibration result; None for a K = 1
    drafter, where Z_T changes nothing and nothing runs). `spec`: the run's eval.runner.RunSpec;
    `log`: progress lines (default: standard error)."""
    log = log or (lambda line: print(line, file=sys.stderr))
    calibration_prompts, evaluation_prompts = split_prompts(prompts, CALIBRATION_FRACTION, spec.seed)
    os.makedirs(out_dir, exist_ok=True)
    if decoder.proposer.num_branches == 1:
        # the split is still held out, so a K = 1 baseline reports on the same prompts as the
        # K > 1 drafters it is compared with
        log(f"calibration: K = 1, Z_T has no effect; {len(calibration_prompts)} prompts held out")
        return 1.0, evaluation_prompts, None

    def run_at(z):
        log(f"calibration: Z_T = {z} on {len(calibration_prompts)} prompts")
        return evaluate(decoder, tokenizer, calibration_prompts, os.path.join(out_dir, f"zt_{z}.jsonl"), spec,
                        category_temperature=z)[0]

    result = calibrate(run_at, grid)
    result["calibration_prompts"] = [[p.dataset, p.prompt_id] for p in calibration_prompts]
    with open(os.path.join(out_dir, "calibration.json"), "w") as f:
        json.dump(result, f, indent=2)
    plot_calibration(os.path.join(out_dir, "calibration.png"), result)
    return result["best"], evaluation_prompts, result


def calibrated_label(z: float, calibrated: bool) -> str:
    """How a report names a calibrated run's Z_T (`calibrated` False: a K = 1 drafter, which has none)."""
    share = f"{100 * CALIBRATION_FRACTION:.0f}%"
    return f"{z} (calibrated on a {share} split)" if calibrated else f"K = 1 (none; the {share} calibration split held out)"
