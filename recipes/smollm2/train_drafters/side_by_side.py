"""Probe runs of the scaled campaign side by side (issue 58): several `dblast train` runs from one
drafter trained at once with the cores split between them, each final drafter then measured as
against_shipped.py measures (zero steps, the held-out split, `eval_anchors` anchors a sequence),
and the paired bootstrap of each gain in the greedy chain's accepted length and in the proxy.
temperature_probe.py (which data) and setting_probe.py (which setting) are its two users."""
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import train_round  # noqa: E402
from against_shipped import MEASURES, measure  # noqa: E402
from train_scaled import paired_anchors, paired_bootstrap, target_dtype  # noqa: E402


def train_side_by_side(configs: dict, work: str) -> dict:
    """Train every config at once (OMP_NUM_THREADS split between them: torch leaves the GIL in its
    kernels); the seconds each took, by name. Runs on the same data get its target features cached
    first by a zero-step run on all the threads: side by side, one would build them on its share
    of the cores while the others wait on the cache's lock."""
    os.makedirs(work, exist_ok=True)
    datas = {json.dumps(config["data"]) for config in configs.values()}
    if len(configs) > 1 and len(datas) == 1:
        first = next(iter(configs.values()))
        # no bound: a zero-step run then builds every shard's cache up front (it measures the start too)
        features = {**first, "max_steps": 0, "feature_cache_max_gb": None, "out": os.path.join(work, "feature-pass")}
        print(f"== the shared chunk's target features: {train_round.train(features, work, print):.0f} s", flush=True)
    threads = max(1, int(os.environ.get("OMP_NUM_THREADS", "2")) // len(configs))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    with ThreadPoolExecutor(len(configs)) as pool:
        return dict(zip(configs, pool.map(
            lambda c: train_round.train(c, work, lambda m: print(m, flush=True)), configs.values())))


def measure_finals(book: dict, start: str, configs: dict, heldout: str, work: str, features: str) -> dict:
    """The start and each run's final drafter on the held-out split (`start` first)."""
    dtype = target_dtype(book["settings"])
    measured = {"start": measure(book, start, f"start-{dtype}", heldout, work, features)}
    for name, config in configs.items():
        measured[name] = measure(book, os.path.join(config["out"], "final"), f"final-{name}-{dtype}", heldout,
                                 work, features)
    return measured


def report(measured: dict, labels: dict, pairs: list, settings: dict) -> dict:
    """Print a table of each drafter's held-out measures and the paired gain of every (first, second)
    in `pairs` (second - first); the gains by '<second> - <first>, <measure>'."""
    print("| drafter | greedy chain accepted | proxy | first-draft agreement | top-1 agreement, positions 1-7 |")
    print("| --- | ---: | ---: | ---: | --- |")
    for name, m in measured.items():
        summary = m["summary"]
        print(f"| {labels.get(name, name)} | {summary['greedy_accepted']:.4f} | {summary['accepted_proxy']:.4f} | "
              f"{100 * summary['top1_agreement'][0]:.1f}% | {' '.join(f'{a:.3f}' for a in summary['top1_agreement'])} |")
    gains = {}
    for first, second in pairs:
        for key in MEASURES:
            a, b = paired_anchors(measured[first]["anchors"], measured[second]["anchors"], key)
            gain = paired_bootstrap(a, b, settings["bootstrap_samples"], settings["bootstrap_seed"])
            gains[f"{second} - {first}, {key}"] = gain
            print(f"{second} - {first}, {key}: {gain['mean']:+.4f} [{gain['low']:+.4f}, {gain['high']:+.4f}] "
                  f"over {gain['anchors']} paired blocks")
    return gains


def today() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
