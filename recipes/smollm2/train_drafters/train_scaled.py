"""The scaled SmolLM2 training campaign (issue 58): capacity pilots, then the chosen drafter
trained to its plateau for both arms, on the 5x store's shards plus every kept shard of the
scaled store, in rounds that each fit a sitting on 2 CPU cores. Its own ledger
(recipes/smollm2/training/scaled.json); the 5x campaign's ledger.json is finished and untouched.

Data. At the start of every round the shards are listed again: the 5x store's
(data/responses/{math,code,chat}-NNN.jsonl.gz) and the scaled store's (data/scaled/responses/
NNNNN-kind.jsonl.gz, which appear only when whole), so shards made since the last round are
used. The held-out split is the 5x store's heldout.jsonl.gz for every run. A round trains on a
chunk of `round_shards` shards in the kinds' proportions (math, code, chat as among the shards
listed): of each kind those the campaign has trained on the fewest times (the pilots' chunk
counts once when the base grows from the chosen pilot), ties broken by a hash of the name (a
fixed pseudo-random order, so each chunk mixes the stores and new shards come in with the
unused ones). The chunk is written to the
round's work folder first, so a round resumed on the same machine keeps its data.

Features: cached, bounded. A round's runs all read its chunk: the arms round's two runs, two
epochs each at the defaults (1,600 steps x 4 sequences over 16 shards of ~200), read each
cached feature four times, and the pilots (each its own round, same chunk) read them three
times over: online features would pay the target's forward with the top-32 the distillation
needs at every read, and on this CPU that is most of a step (2 layers, K = 1, one busy thread:
1.99 s a step online against 0.37 s from the cache). The cache of a chunk takes about
6 KB a token (16 shards ~ 6 GB), so `feature_cache_gb` (12) holds a chunk and the held-out
set with room to spare; older rounds' shard caches are deleted least recently used first, so
the folder never outgrows a normal disk, however large the store gets. Each run measures the
target-feature RMS on its chunk's first `feature_scale_shards` shards only.

Stages:
  pilots  one round per depth in `layers_choices` (2, 3, 4): a K = 1 base drafter from scratch
          (NLL with distillation, block `block`), `pilot_steps` steps on the same chunk with the
          same seed; then its final drafter is measured alone on the held-out split with
          `eval_anchors` anchors per sequence (a zero-step run, seed 0: every pilot on the same
          anchors). The per-anchor accepted-length proxies (eval_anchors.jsonl, kept in the logs)
          are compared pair by pair (`paired_bootstrap`) and `choose_depth` picks the depth: the
          deepest pilot whose proxy gain over every shallower pilot has a bootstrap 95% interval
          above 0 AND pays for its extra cycle cost (`cycle_ms`: a cycle's time per depth from
          recipes/smollm2/measure/capacity_cost.py; speed ~ (1 + accepted) / cycle, so a deeper
          pilot pays when its mean gain exceeds (1 + the shallower's proxy) * (its cycle / the
          shallower's - 1)); else the shallowest. The table of why goes into the ledger and the log.
  base    K = 1 at the chosen depth, NLL with distillation, from the campaign's kept dflash-k1:
          first the chosen pilot, kept as it is (from scratch where this machine lacks it);
          `base_steps` steps; kept when its held-out `select_by` measure improved (the loss unless
          amended); done when a round gains less than `min_gain` or after `max_base_rounds` rounds.
          With `base_start` "shipped" the next base round restarts the lineage from the shipped
          dflash-k1 instead (once per amendment that sets it; the kept drafter it replaces is moved
          aside, and the rounds count anew): for when the shipped drafter has the chosen depth and
          is ahead of the kept base (against_shipped.py, evaluate/kept_vs_shipped.sh).
  arms    dflash-k1 (NLL with distillation) and dblast-k4 (K = 4 head, accepted-length surrogate)
          from that base, the same chunk and `arm_steps` steps each; each kept when it improved
          (dblast-k4 by its proxy), each to its own plateau (or `max_rounds`).
Kept drafters are written in bfloat16 into --keep-dir (default runs/smollm2-scaled/kept/<arm>/),
on the machine that trains them: model weights are committed only when they ship, and never
shipped into dblast_ext/drafters/ by this script (shipping waits for the evaluation against the
5x pair; a 4-layer drafter, about 30 MiB in bfloat16, fits package.py's 50 MB limit).

Costs on the recipe's 2-core CPU (recipes/smollm2/README.md has the measurements): a chunk's
feature pass is about 3 minutes a shard (16 shards, ~0.92M tokens: ~50 minutes, once per chunk
and machine); a step (cached features, batch 4 x 16 anchors, block 8, one thread beside two
busy processes) took 0.37 s at 2 layers, 0.56 s at 3 and 0.64 s at 4, so the three pilots'
7,200 steps in all take about 1.05 CPU-hours, and a pilot's measuring run
about 80 s. `pilot_steps` 2,400: the 5x pilots' 200 steps could not tell 2 layers from 3, and
the 5x base from scratch reached a proxy of 0.27 in 1,200 steps and 0.42 after 2,400 more; the
shipped pair measured this way gave an interval about +-0.02 wide (4,067 paired blocks), under
the ~0.03-0.06 gain a deeper drafter must show to pay for its cycle.

    python recipes/smollm2/train_drafters/train_scaled.py --plan      # the next round, as configs
    python recipes/smollm2/train_drafters/train_scaled.py             # the next round
    python recipes/smollm2/train_drafters/train_scaled.py --rounds 3  # the three pilots
    python recipes/smollm2/train_drafters/train_scaled.py --choose    # the pilots' table again
    python recipes/smollm2/train_drafters/train_scaled.py --amend '{"arm_steps": 2400}' --why "..."
    python recipes/smollm2/train_drafters/train_scaled.py --replay    # the kept base again, on a new machine
"""
import argparse
import datetime
import functools
import glob
import hashlib
import json
import os
import sys

import numpy as np

import train_round
from package import package
from train_round import read_json, write_json

RECIPE, ROOT = train_round.RECIPE, train_round.ROOT
ARMS = train_round.ARMS
SCALED_NAME = "[0-9][0-9][0-9][0-9][0-9]-*.jsonl.gz"   # data_scale.py's whole shards

# what a new ledger is made with; afterwards the ledger's own settings rule every round
DEFAULT_SETTINGS = {
    "round_shards": 16, "pilot_steps": 2400, "base_steps": 2400, "arm_steps": 1600,
    "layers_choices": [2, 3, 4], "block": 8, "eval_anchors": 64,
    "batch_size": 4, "num_anchors": 16, "distill_weight": 0.5, "decay": 7, "save_every": 200, "patience": 3,
    "target": "default", "mask_token_id": train_round.MASK, "target_layer_ids": [1, 8, 14, 21, 27],
    "lr_scratch": 1e-3, "lr_continue": 3e-4, "tau": 0.1, "min_gain": 0.01, "max_rounds": 16, "max_base_rounds": 8,
    "feature_cache_gb": 12, "feature_scale_shards": 2, "bootstrap_samples": 10000, "bootstrap_seed": 0,
    # the target's dtype in every run (dblast train's `dtype`): "auto" is float32 on a CPU; "bfloat16" on
    # one with native bfloat16 makes a chunk's feature pass about 2x as fast (its cache files are others);
    # "native" is bfloat16 there (and on a GPU) and float32 on a CPU that emulates it (target_dtype())
    "target_dtype": "auto",
    # where the base starts: "pilot" (the chosen pilot, grown from scratch) or "shipped" (the shipped
    # dflash-k1, of the chosen depth: the next base round restarts the lineage from it, once)
    "base_start": "pilot",
    # the held-out measure that picks a run's best checkpoint and its gain (the plateau): null is by objective
    # (the loss for NLL, the proxy for the surrogate); "greedy_accepted" is the greedy chain's accepted
    # length, what the decode loop's drafts commit (training/objective.py's greedy_chain_accepted)
    "select_by": None,
    # which sampling temperatures' shards a round's chunk takes (null: all); the scaled set alternates
    # T 0.7 and T 1.0 shards, the 5x store is T 0.7 (temperature_probe.py measures what each teaches)
    "temperatures": None,
    # a decoding cycle's time per drafter depth (ms): what capacity_cost.py measured, with where and when
    "cycle_ms": {"2": 43.85, "3": 44.8, "4": 45.9},
    "cycle_cost_source": "recipes/smollm2/measure/capacity_cost.py on idle cores, 2026-12-07 13:15 UTC, Intel Xeon "
                         "(native bfloat16: avx512_bf16, amx_bf16), 2 threads, bfloat16, dblast demo's fastest "
                         "exact CPU settings (block 8, trie of 10 branch nodes + 4 leaves), controller off: the "
                         "mean of two runs (recipes/smollm2/logs/capacity-cost-2026-12-07.log); a target-only "
                         "step 32-33 ms, each drafter layer 1.2 ms. On another CPU rerun it and --amend cycle_ms.",
}


# --- data ------------------------------------------------------------------------------------

def list_shards(store: str, scaled: str) -> list:
    """Every training shard there is now, as '5x/NAME' and 'scaled/NAME' (the held-out split is
    not among them): the 5x store's, then the scaled store's whole shards, each in name order."""
    grown = sorted(glob.glob(os.path.join(scaled, "responses", SCALED_NAME)))
    return [f"5x/{name}" for name in train_round.store_shards(store)] + [f"scaled/{os.path.basename(p)}" for p in grown]


def sampled_at(name: str) -> float:
    """The temperature a training shard was sampled at: the 5x store's at T 0.7 (make_data/data.sh),
    a scaled shard's by its index (make_data/data_scale.py's plan: T 0.7 and T 1.0 in turn)."""
    if name.startswith("5x/"):
        return 0.7
    return scaled_plan()(int(os.path.basename(name)[:5]))["temperature"]


@functools.lru_cache(maxsize=None)
def scaled_plan():
    """make_data/data_scale.py's plan, imported once (the data recipe is a sibling folder)."""
    sys.path.insert(0, os.path.join(RECIPE, "make_data"))
    from data_scale import plan

    return plan


def at_temperatures(names: list, temperatures) -> list:
    """The shards sampled at one of `temperatures` (None: every shard)."""
    return names if temperatures is None else [n for n in names if sampled_at(n) in temperatures]


def shard_path(name: str, store: str, scaled: str) -> str:
    where, _, file = name.partition("/")
    return os.path.join({"5x": store, "scaled": scaled}[where], "responses", file)


def shard_uses(ledger: dict, names: list, pilot_grown: bool = False, shipped_grown: bool = False) -> dict:
    """How many training rounds each shard has been in. The pilots' chunk counts once where the
    campaign's base grew from the chosen pilot (`pilot_grown`, or a round that says so), else
    not at all (a base from scratch then reads it first, its features cached already). Where
    the base restarts from the shipped drafter (`shipped_grown`, or a round that says so), every
    5x shard among `names` counts once more: the shipped pair trained on the 5x store."""
    uses = {}
    shipped_grown = shipped_grown or any(record.get("base_from_shipped") for record in ledger["rounds"])
    for name in names if shipped_grown else []:
        if name.startswith("5x/"):
            uses[name] = 1
    pilot_grown = pilot_grown or any(record.get("base_from_pilot") for record in ledger["rounds"])
    for name in (ledger["pilot_shards"] or []) if pilot_grown else []:
        uses[name] = uses.get(name, 0) + 1
    for record in ledger["rounds"]:
        if record["stage"] != "pilots":
            for name in record["shards"]:
                uses[name] = uses.get(name, 0) + 1
    return uses


def name_rank(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def shard_kind(name: str) -> str:
    """math, code or chat: '5x/math-000.jsonl.gz' and 'scaled/00003-math.jsonl.gz' alike."""
    stem = os.path.basename(name).split(".")[0]
    return stem.split("-")[0] if name.startswith("5x/") else stem.split("-")[-1]


def pick_chunk(names: list, uses: dict, count: int) -> list:
    """`count` shards in the kinds' proportions among `names` (largest remainder), within each
    kind those used least so far, ties in a fixed pseudo-random order (the name's hash). By use
    alone, round 6's chunk drew no math shard of 16, and the drafter lost GSM8K acceptance."""
    by_kind = {}
    for name in names:
        by_kind.setdefault(shard_kind(name), []).append(name)
    quota = {kind: count * len(group) / len(names) for kind, group in by_kind.items()} if names else {}
    take = {kind: int(q) for kind, q in quota.items()}
    least_used = {kind: min(uses.get(n, 0) for n in group) for kind, group in by_kind.items()}
    spare = min(count, len(names)) - sum(take.values())   # by the largest remainder; on a tie the kind
    for kind in sorted(quota, key=lambda k: (take[k] - quota[k], least_used[k], k))[:spare]:   # with fresher shards
        take[kind] += 1
    chunk = [name for kind, group in by_kind.items()
             for name in sorted(group, key=lambda n: (uses.get(n, 0), name_rank(n)))[:take[kind]]]
    return sorted(chunk, key=lambda name: (uses.get(name, 0), name_rank(name)))


# --- the paired comparison and the choice ----------------------------------------------------

def paired_anchors(first: dict, second: dict, measure: str = "accepted_proxy") -> tuple:
    """Two eval_anchors.jsonl entries on the same anchors -> (`measure` of first, of second:
    "accepted_proxy" or "greedy_accepted") as arrays aligned by (record, anchor); a ValueError
    when their anchors differ or an entry lacks the measure."""
    for entry in (first, second):
        if measure not in entry:
            raise ValueError(f"an eval_anchors entry has no {measure!r} (measured before it was logged): "
                             "measure that drafter again")
    def by_key(entry):
        return {(r, a): p for r, a, p in zip(entry["record"], entry["anchor"], entry[measure])}
    a, b = by_key(first), by_key(second)
    if a.keys() != b.keys():
        raise ValueError(f"the two measurements are not on the same anchors ({len(a)} and {len(b)} blocks, "
                         f"{len(a.keys() & b.keys())} shared): measure both with the same seed, num_anchors, "
                         "batch_size and held-out file")
    keys = sorted(a)
    return np.array([a[k] for k in keys], dtype=np.float64), np.array([b[k] for k in keys], dtype=np.float64)


def paired_bootstrap(first, second, samples: int = 10000, seed: int = 0) -> dict:
    """The mean of second - first over paired anchors and its percentile bootstrap 95% interval
    (anchors resampled with replacement, `samples` times, numpy's generator seeded `seed`)."""
    diff = np.asarray(second, dtype=np.float64) - np.asarray(first, dtype=np.float64)
    if diff.ndim != 1 or len(diff) == 0:
        raise ValueError("paired_bootstrap needs two equally long, non-empty lists of per-anchor values")
    rng = np.random.default_rng(seed)
    means = np.empty(samples)
    for start in range(0, samples, 1000):   # a thousand resamples at a time: bounded memory
        n = min(1000, samples - start)
        means[start:start + n] = diff[rng.integers(0, len(diff), size=(n, len(diff)))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return {"mean": float(diff.mean()), "low": float(low), "high": float(high), "anchors": int(len(diff))}


def choose_depth(proxies: dict, cycle_ms: dict, samples: int = 10000, seed: int = 0) -> dict:
    """The depth to train, from per-anchor proxies aligned across pilots ({layers: array}) and a
    cycle's time per depth ({layers: ms}; JSON keys may be strings): the deepest pilot that beats
    every shallower pilot with a paired 95% interval above 0 and a mean gain that pays for its
    longer cycle; else the shallowest. Returns {"layers", "pilots", "pairs"} (the table of why)."""
    cost = {int(k): float(v) for k, v in cycle_ms.items()}
    depths = sorted(int(k) for k in proxies)
    missing = [d for d in depths if d not in cost]
    if missing:
        raise ValueError(f"cycle_ms has no cycle time for {missing} layers (measure/capacity_cost.py --layers ...)")
    values = {int(k): np.asarray(v, dtype=np.float64) for k, v in proxies.items()}
    pairs = []
    for i, deep in enumerate(depths):
        for shallow in depths[:i]:
            ci = paired_bootstrap(values[shallow], values[deep], samples, seed)
            base = float(values[shallow].mean())
            break_even = (1 + base) * (cost[deep] / cost[shallow] - 1)
            pairs.append({"deeper": deep, "shallower": shallow, **{k: round(v, 5) if isinstance(v, float) else v
                                                                   for k, v in ci.items()},
                          "break_even": round(break_even, 5), "separated": ci["low"] > 0,
                          "pays": ci["mean"] > break_even})
    chosen = depths[0]
    for deep in reversed(depths[1:]):
        against = [p for p in pairs if p["deeper"] == deep]
        if all(p["separated"] and p["pays"] for p in against):
            chosen = deep
            break
    pilots = {str(d): {"proxy": round(float(values[d].mean()), 5), "cycle_ms": cost[d]} for d in depths}
    return {"layers": chosen, "pilots": pilots, "pairs": pairs}


def choice_table(choice: dict) -> str:
    """The choice as markdown: each pilot's mean proxy and cycle, each pair's gain and why."""
    lines = ["| pilot | held-out proxy (mean over anchors) | cycle ms |", "| --- | ---: | ---: |"]
    for depth, p in choice["pilots"].items():
        mark = " (chosen)" if int(depth) == choice["layers"] else ""
        lines.append(f"| L{depth}{mark} | {p['proxy']:.4f} | {p['cycle_ms']:.1f} |")
    lines += ["", "| deeper vs shallower | mean gain | 95% interval (paired bootstrap) | anchors | break-even gain "
              "| interval above 0 | pays |", "| --- | ---: | --- | ---: | ---: | --- | --- |"]
    for p in choice["pairs"]:
        lines.append(f"| L{p['deeper']} vs L{p['shallower']} | {p['mean']:+.4f} | [{p['low']:+.4f}, {p['high']:+.4f}] "
                     f"| {p['anchors']} | {p['break_even']:.4f} | {'yes' if p['separated'] else 'no'} "
                     f"| {'yes' if p['pays'] else 'no'} |")
    return "\n".join(lines)


# --- the ledger ------------------------------------------------------------------------------

def new_ledger(store: str, settings: dict) -> dict:
    if not os.path.isfile(os.path.join(store, "responses", "heldout.jsonl.gz")):
        sys.exit(f"{store}/responses/heldout.jsonl.gz is missing: the campaign holds out the 5x store's split")
    return {"campaign": "scaled (issue 58)", "settings": settings, "heldout": "5x/heldout.jsonl.gz",
            "stage": "pilots", "pilot_shards": None, "pilots": {}, "choice": None,
            "kept": {arm: None for arm in ARMS}, "arms_from_round": None, "done": [], "rounds": []}


def check_setting_names(settings: dict, flag: str) -> None:
    train_round.check_setting_names(settings, flag, DEFAULT_SETTINGS)


def amend_settings(ledger: dict, changes: dict, why: str) -> dict:
    """Changes the settings from the next round on; the ledger keeps old and new values and why."""
    record = train_round.change_settings(ledger, changes, why, check_setting_names)
    ledger.setdefault("amended", []).append(record)
    return record


def chosen_pilot(ledger: dict, work: str):
    """(the chosen depth's pilot drafter, the round that trained it), the drafter None where this
    machine's `work` folder does not have it (another machine ran the pilots)."""
    depth = ledger["choice"]["layers"]
    for record in ledger["rounds"]:
        if record["stage"] == "pilots" and f"pilot-L{depth}" in record["runs"]:
            final = os.path.join(work, f"round-{record['round']:02d}", f"pilot-L{depth}", "final")
            return (final if os.path.isdir(final) else None), record["round"]
    return None, None


def shipped_drafter(arm: str) -> str:
    """The folder of the package's shipped drafter of `arm` (SmolLM2's embedded pair)."""
    from dblast_ext.drafting.embedded_drafters import embedded_drafter_dir

    return embedded_drafter_dir(arm)


def restart_pending(ledger: dict) -> bool:
    """Whether the next base round restarts from the shipped dflash-k1: `base_start` "shipped", and
    no restart since the amendment that set it (each such amendment restarts the lineage once; a
    ledger made with it restarts once)."""
    if ledger["settings"].get("base_start", "pilot") != "shipped":
        return False
    since = max((record["from_round"] for record in ledger.get("amended", [])
                 if record["changes"].get("base_start", {}).get("new") == "shipped"), default=0)
    return not any(record.get("base_from_shipped") and record["round"] >= since for record in ledger["rounds"])


def round_plan(ledger: dict, names: list, keep_dir: str, work: str = None) -> dict:
    """The next round: its index, stage, shards and runs (name -> how; `init`: where a run starts,
    None from scratch). While no base is kept, the chosen depth's pilot (where `work`, the
    campaign's scratch folder, still has it) is kept as the first one (`keep_first`) and the base
    goes on from it on a chunk of its own: the pilot already trained that depth from scratch on
    its chunk (three epochs at the defaults), and a second run from scratch would repeat it."""
    s, stage, index = ledger["settings"], ledger["stage"], len(ledger["rounds"])
    runs = {}
    if stage == "pilots":
        layers = next(d for d in s["layers_choices"] if str(d) not in ledger["pilots"])
        shards = ledger["pilot_shards"] or pick_chunk(names, {}, s["round_shards"])
        runs[f"pilot-L{layers}"] = {"kind": "pilot", "layers": layers, "init": None}
        runs[f"measure-L{layers}"] = {"kind": "measure", "layers": layers, "of": f"pilot-L{layers}"}
    else:
        kept = ledger["kept"]["dflash-k1"] is not None
        pilot, pilot_round = (None, None)
        rebase = stage == "base" and restart_pending(ledger)
        if stage == "base" and not kept and work is not None and not rebase:
            pilot, pilot_round = chosen_pilot(ledger, work)
        uses = shard_uses(ledger, names, pilot_grown=pilot is not None, shipped_grown=rebase)
        shards = pick_chunk(names, uses, s["round_shards"])
        if stage == "base":
            runs["base"] = {"kind": "base", "init": os.path.join(keep_dir, "dflash-k1")
                            if kept or pilot or rebase else None}
            if pilot:
                runs["base"]["keep_first"] = {"drafter": pilot, "round": pilot_round}
            if rebase:
                runs["base"]["keep_first"] = {"drafter": shipped_drafter("dflash-k1"), "round": index,
                                              "shipped": True}
        elif stage == "arms":
            for arm in ARMS:
                if arm not in ledger["done"]:
                    own = ledger["kept"][arm] is not None and ledger["kept"][arm] >= ledger["arms_from_round"]
                    runs[arm] = {"kind": "arm", "init": os.path.join(keep_dir, arm if own else "dflash-k1")}
    return {"round": index, "stage": stage, "shards": shards, "runs": runs}


def target_dtype(settings: dict) -> str:
    """The runs' target dtype: the setting, where "native" is bfloat16 on a GPU or a CPU with bfloat16
    matmul instructions and float32 elsewhere (an AVX2-only AMD EPYC emulates a bfloat16 matmul at
    1.1 GFLOP/s against 71 in float32, one thread, 2026-12-08: a feature pass there would take days)."""
    dtype = settings.get("target_dtype", "auto")
    if dtype != "native":
        return dtype
    import torch

    from dblast_ext.decoding.fastest_settings import cpu_has_native_bf16

    return "bfloat16" if torch.cuda.is_available() or cpu_has_native_bf16() else "float32"


def run_config(ledger: dict, plan: dict, name: str, run: dict, paths: dict, work: str, features: str) -> dict:
    """The `dblast train` config of one run. paths: 'data' (the chunk's files), 'heldout'."""
    s, kind = ledger["settings"], run["kind"]
    objective = "al" if name == "dblast-k4" else "nll"
    common = {"target": s["target"], "eval_data": [paths["heldout"]], "out": os.path.join(work, name),
              "batch_size": s["batch_size"], "feature_cache": features, "features": "cached",
              "feature_cache_max_gb": s["feature_cache_gb"], "autocast": "auto", "recompute_logits": False,
              "eval_at_start": True, "log_every": 10, "dtype": target_dtype(s)}
    if kind == "measure":   # the pilot's final drafter alone on the held-out split: many anchors, seed 0
        return {**common, "data": [paths["heldout"]], "init_from": os.path.join(work, run["of"], "final"),
                "max_steps": 0, "num_anchors": s["eval_anchors"], "seed": 0, "feature_scaling": "none",
                "objective": "nll", "select_by": "accepted_proxy"}
    config = {**common, "data": paths["data"], "init_from": run["init"], "shard_window": None,
              "feature_scale_shards": s["feature_scale_shards"], "block_size": s["block"],
              "num_branches": 4 if name == "dblast-k4" else 1, "objective": objective, "tau": s["tau"],
              "distill_weight": s["distill_weight"] if objective == "nll" else 0.0, "decay": s["decay"],
              "feature_scaling": "rms", "num_anchors": s["num_anchors"], "warmup_ratio": 0.04,
              "patience": None if kind == "pilot" else s["patience"], "save_every": s["save_every"],
              "seed": plan["round"] if kind != "pilot" else 0,
              "select_by": s.get("select_by") or train_round.SELECT_BY[objective],
              "max_steps": s[{"pilot": "pilot_steps", "base": "base_steps", "arm": "arm_steps"}[kind]]}
    if run["init"] is None:
        layers = run.get("layers") or ledger["choice"]["layers"]
        config.update(drafter={"num_hidden_layers": layers, "mask_token_id": s["mask_token_id"],
                               "target_layer_ids": s["target_layer_ids"]}, lr=s["lr_scratch"])
    else:
        config.update(lr=s["lr_continue"])
    return config


def base_is_done(ledger: dict, gain: float) -> bool:
    s = ledger["settings"]
    restarts = [i for i, r in enumerate(ledger["rounds"]) if r.get("base_from_shipped")]
    since = restarts[-1] if restarts else 0   # a base restarted from the shipped drafter counts anew
    rounds = sum(1 for r in ledger["rounds"][since:] if r["stage"] == "base")
    return gain < s["min_gain"] or rounds >= min(s["max_rounds"], s["max_base_rounds"])


def conclude(ledger: dict, plan: dict, record: dict, pilot_logs: dict) -> list:
    """Updates the ledger from a finished round (appended to ledger['rounds'] first) and returns
    what to keep, as (run name, arm) pairs. pilot_logs: {layers: eval_anchors.jsonl entry} of
    every pilot measured so far (this round's included)."""
    s, stage, keep = ledger["settings"], plan["stage"], []
    ledger["rounds"].append(record)
    if stage == "pilots":
        if ledger["pilot_shards"] is None:
            ledger["pilot_shards"] = plan["shards"]
        for name, run in plan["runs"].items():
            if run["kind"] == "measure":
                ledger["pilots"][str(run["layers"])] = record["runs"][name]["measured"]
        if all(str(d) in ledger["pilots"] for d in s["layers_choices"]):
            ledger["choice"] = choose_from_logs(ledger, pilot_logs)
            ledger["stage"] = "base"
    elif stage == "base":
        run = record["runs"]["base"]
        first = plan["runs"]["base"]["init"] is None
        gain = 1.0 if first else train_round.relative_gain(run)
        run.update(gain=round(gain, 5), kept=gain > 0)
        if gain > 0:
            keep.append(("base", "dflash-k1"))
            ledger["kept"]["dflash-k1"] = plan["round"]
        if base_is_done(ledger, gain):
            ledger["stage"], ledger["arms_from_round"] = "arms", plan["round"] + 1
    elif stage == "arms":
        for arm in plan["runs"]:
            run = record["runs"][arm]
            gain = train_round.relative_gain(run)
            run.update(gain=round(gain, 5), kept=gain > 0)
            if gain > 0:
                keep.append((arm, arm))
                ledger["kept"][arm] = plan["round"]
            rounds = sum(1 for r in ledger["rounds"] if r["stage"] == "arms" and arm in r["runs"])
            if gain < s["min_gain"] or rounds >= s["max_rounds"]:
                ledger["done"].append(arm)
        if all(arm in ledger["done"] for arm in ARMS):
            ledger["stage"] = "done"
    return keep


def choose_from_logs(ledger: dict, pilot_logs: dict) -> dict:
    """choose_depth over the pilots' per-anchor measurements, all paired on the first one's anchors."""
    s = ledger["settings"]
    depths = sorted(pilot_logs)
    proxies, reference = {}, pilot_logs[depths[0]]
    for depth in depths:
        proxies[depth] = paired_anchors(reference, pilot_logs[depth])[1]
    choice = choose_depth(proxies, s["cycle_ms"], s["bootstrap_samples"], s["bootstrap_seed"])
    choice["table"] = choice_table(choice).splitlines()
    return choice


def read_pilot_logs(ledger: dict, logs: str) -> dict:
    """{layers: the measured pilot's eval_anchors.jsonl entry}, from the copies in `logs`."""
    out = {}
    for depth, measured in ledger["pilots"].items():
        with open(os.path.join(logs, measured["anchors_log"])) as f:
            out[int(depth)] = json.loads(f.readline())
    return out


# --- replaying a kept lineage on another machine -----------------------------------------------

def settings_at(ledger: dict, round_index: int) -> dict:
    """The settings round `round_index` ran with: today's, each later amendment undone."""
    settings = dict(ledger["settings"])
    for record in reversed(ledger.get("amended", [])):
        if record["from_round"] > round_index:
            for key, change in record["changes"].items():
                settings[key] = change["old"]
    return settings


def base_lineage(ledger: dict) -> list:
    """The kept base's rounds, oldest first, from its restart from the shipped dflash-k1: the
    rounds a replay runs again. A SystemExit where the lineage did not start from the shipped
    drafter (its first rounds, pilots grown from scratch, are not replayed)."""
    restarts = [r for r in ledger["rounds"] if r.get("base_from_shipped")]
    until = ledger["kept"]["dflash-k1"]
    if not restarts or until is None or until < restarts[-1]["round"]:
        sys.exit("--replay rebuilds a base restarted from the shipped dflash-k1 (base_start \"shipped\"); this "
                 "ledger's kept base grew from a pilot: run the campaign on the machine that has it")
    return [r for r in ledger["rounds"] if restarts[-1]["round"] <= r["round"] <= until
            and r["stage"] == "base" and "dflash-k1" in r.get("kept", [])]


def replay(args, log=print) -> None:
    """Trains the kept base's lineage again on this machine (it lacks the kept drafter: weights are
    not committed until they ship): each kept round on its own chunk, seed and settings, from the
    shipped dflash-k1, then kept where the campaign keeps it. The ledger's rounds are not touched;
    each replayed run's held-out start and best go to the log beside the recorded ones (a replay
    on another CPU and library may differ in the last digits)."""
    ledger = read_json(args.ledger)
    kept = os.path.join(args.keep_dir, "dflash-k1")
    if os.path.isdir(kept):
        sys.exit(f"{kept} is on this machine already: nothing to replay")
    lineage, init = base_lineage(ledger), os.path.join(args.work, "replay-shipped-dflash-k1")
    package(shipped_drafter("dflash-k1"), "dflash-k1", init, limit_bytes=None)   # in bfloat16, as the round kept it
    heldout = shard_path(ledger["heldout"], args.store, args.scaled)
    for record in lineage:
        settings = settings_at(ledger, record["round"])
        plan = {"round": record["round"], "stage": "base", "shards": record["shards"]}
        work = os.path.join(args.work, f"replay-round-{record['round']:02d}")
        paths = {"data": [shard_path(n, args.store, args.scaled) for n in record["shards"]], "heldout": heldout}
        config = run_config({**ledger, "settings": settings}, plan, "base", {"kind": "base", "init": init},
                            paths, work, os.path.join(args.work, "features"))
        config["select_by"] = record["runs"]["base"].get("select_by", config["select_by"])   # as it was kept
        log(f"== replaying round {record['round']} (base, {len(record['shards'])} shards) from "
            f"{'the shipped dflash-k1' if record.get('base_from_shipped') else 'the replayed base'}")
        os.makedirs(work, exist_ok=True)
        train(config, work, log)
        entries = [json.loads(line) for line in open(os.path.join(config["out"], "eval_log.jsonl")) if line.strip()]
        again = train_round.measured(entries, settings["block"] - 1, config["select_by"])
        train_round.copy_logs(config["out"], args.logs, f"replay-round-{record['round']:02d}-base")
        for when in ("start", "best"):
            was = record["runs"]["base"][when]
            log(f"   {when}: loss {again[when]['loss']} (recorded {was['loss']}), proxy {again[when]['accepted_proxy']} "
                f"(recorded {was['accepted_proxy']}), greedy chain {again[when]['greedy_accepted']}, "
                f"first-draft agreement {again[when]['top1_agreement'][0]} (recorded {was['top1_agreement'][0]})")
        init = os.path.join(config["out"], "final")
    package(init, "dflash-k1", kept, limit_bytes=None)
    log(f"== the replayed base is kept as {kept} (round {ledger['kept']['dflash-k1']}'s)")


# --- running a round -------------------------------------------------------------------------

train = train_round.train  # `dblast train` on a config, in a fresh process


def run_round(args, overrides: dict, log=print) -> bool:
    """The next round (its plan only, with --plan); False when the campaign is done."""
    ledger = read_json(args.ledger) or new_ledger(args.store, {**DEFAULT_SETTINGS, **overrides})
    if ledger["stage"] == "done":
        log("the campaign is done: both arms at their plateau or their max_rounds")
        return False
    names = at_temperatures(list_shards(args.store, args.scaled), ledger["settings"].get("temperatures"))
    plan = round_plan(ledger, names, args.keep_dir, args.work)
    work = os.path.join(args.work, f"round-{plan['round']:02d}")
    kept_plan = read_json(os.path.join(work, "plan.json"))
    if kept_plan is not None and not args.plan:   # an interrupted round goes on with its own data
        plan["shards"] = kept_plan["shards"]
    paths = {"data": [shard_path(n, args.store, args.scaled) for n in plan["shards"]],
             "heldout": shard_path(ledger["heldout"], args.store, args.scaled)}
    features = os.path.join(args.work, "features")
    configs = {name: run_config(ledger, plan, name, run, paths, work, features) for name, run in plan["runs"].items()}
    first = plan["runs"].get("base", {}).get("keep_first") or {}
    uses = shard_uses(ledger, names, pilot_grown=bool(first) and not first.get("shipped"),
                      shipped_grown=bool(first.get("shipped")))
    listing = {"shards": len(names), "5x": sum(n.startswith("5x/") for n in names),
               "scaled": sum(n.startswith("scaled/") for n in names),
               "never_trained_on": sum(1 for n in names if n not in uses)}
    if args.plan:
        print(json.dumps({"plan": plan, "listing": listing, "configs": configs}, indent=1))
        return True
    missing = [run for run in plan["runs"].values()
               if run.get("init") and not os.path.isdir(run["init"]) and "keep_first" not in run]
    if missing:
        sys.exit(f"the kept drafter {missing[0]['init']} that round {plan['round']} goes on from is not on this "
                 f"machine (the ledger kept it in round {ledger['kept'][os.path.basename(missing[0]['init'])]}; "
                 "kept drafters stay where they were trained): run the campaign there, copy that folder here, or "
                 "train it again with --replay (a base restarted from the shipped drafter)")
    os.makedirs(work, exist_ok=True)
    write_json(os.path.join(work, "plan.json"), plan)
    seqs, responses, total = train_round.chunk_size(paths["data"])
    log(f"== round {plan['round']} ({plan['stage']}): {len(plan['shards'])} shards of {listing['shards']} "
        f"({listing['5x']} 5x, {listing['scaled']} scaled, {listing['never_trained_on']} never trained on), "
        f"{seqs} sequences, {responses} response tokens, {total} tokens")
    record = {"round": plan["round"], "stage": plan["stage"], "shards": plan["shards"],
              "date": datetime.date.today().isoformat(), "listing": listing, "runs": {}}
    pilot = plan["runs"].get("base", {}).get("keep_first")
    if pilot and pilot.get("shipped"):   # the base's lineage restarts from the shipped dflash-k1
        kept = os.path.join(args.keep_dir, "dflash-k1")
        until = ledger["kept"]["dflash-k1"]
        earlier = None if until is None else f"{kept}-until-round-{until:02d}"
        if earlier and os.path.isdir(kept) and not os.path.isdir(earlier):   # the lineage it replaces stays
            os.replace(kept, earlier)   # on this machine, named by its round (a resumed round moved it already)
        if earlier and os.path.isdir(earlier):
            record["earlier_base"] = earlier
        package(pilot["drafter"], "dflash-k1", kept, limit_bytes=None)
        ledger["kept"]["dflash-k1"] = plan["round"]
        record["base_from_shipped"] = "dflash-k1"
        log("== the shipped dflash-k1 is kept as the base; this round goes on from it")
    elif pilot:   # the chosen pilot becomes the campaign's first kept base; this round goes on from it
        package(pilot["drafter"], "dflash-k1", os.path.join(args.keep_dir, "dflash-k1"), limit_bytes=None)
        ledger["kept"]["dflash-k1"] = pilot["round"]
        record["base_from_pilot"] = f"pilot-L{ledger['choice']['layers']} of round {pilot['round']}"
        log(f"== the chosen pilot ({record['base_from_pilot']}) is kept as the first dflash-k1")
    pilot_logs = {}
    for name, config in configs.items():
        seconds = train(config, work, log)
        entries = [json.loads(line) for line in open(os.path.join(config["out"], "eval_log.jsonl")) if line.strip()]
        prefix = f"round-{plan['round']:02d}-{name}"
        train_round.copy_logs(config["out"], args.logs, prefix)
        if plan["runs"][name]["kind"] == "measure":
            anchors_log = f"{prefix}-eval_anchors.jsonl"
            with open(os.path.join(config["out"], "eval_anchors.jsonl")) as f:
                first = f.readline()
            with open(os.path.join(args.logs, anchors_log), "w") as f:
                f.write(first)
            pilot = record["runs"][plan["runs"][name]["of"]]
            record["runs"][name] = {"seconds": seconds, "measured": {
                "anchors_log": anchors_log, "proxy": round(entries[0]["accepted_proxy"], 5),
                "blocks": len(json.loads(first)["record"]), "pilot_steps": pilot["steps"],
                "pilot_seconds": pilot["seconds"]}}
            pilot_logs[plan["runs"][name]["layers"]] = json.loads(first)
            continue
        positions = ledger["settings"]["block"] - 1
        record["runs"][name] = {"init": config["init_from"] and os.path.basename(config["init_from"]),
                                "steps": max(e["step"] for e in entries), "seconds": seconds,
                                **train_round.measured(entries, positions, config["select_by"])}
    if plan["stage"] == "pilots":
        pilot_logs = {**read_pilot_logs(ledger, args.logs), **pilot_logs}
    keep = conclude(ledger, plan, record, pilot_logs)
    for run_name, arm in keep:
        package(os.path.join(configs[run_name]["out"], "final"), arm, os.path.join(args.keep_dir, arm),
                limit_bytes=None)
    record["kept"] = [arm for _, arm in keep]
    write_json(args.ledger, ledger)
    if ledger.get("choice") and plan["stage"] == "pilots":
        log("== the pilots' choice:\n" + "\n".join(ledger["choice"]["table"]) +
            f"\n== chosen: {ledger['choice']['layers']} layers")
    log(f"== round {plan['round']} done: kept {record['kept'] or 'nothing'}; next stage {ledger['stage']}")
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    here = lambda *parts: os.path.relpath(os.path.join(*parts))  # noqa: E731  (configs name no machine's folders)
    parser.add_argument("--store", default=here(RECIPE, "data"), help="the 5x store (and its held-out split)")
    parser.add_argument("--scaled", default=here(RECIPE, "data", "scaled"), help="the scaled store (read only)")
    parser.add_argument("--ledger", default=here(RECIPE, "training", "scaled.json"))
    parser.add_argument("--logs", default=here(RECIPE, "logs", "scaled"), help="where the runs' logs are kept")
    parser.add_argument("--work", default=here(ROOT, "runs", "smollm2-scaled"), help="scratch: runs, features")
    parser.add_argument("--keep-dir", default=here(ROOT, "runs", "smollm2-scaled", "kept"),
                        help="where the campaign's improved drafters are kept (bfloat16), one folder per arm "
                             "(not committed: weights are committed only when they ship)")
    parser.add_argument("--settings", default="{}", help="JSON overrides of the settings of a NEW ledger")
    parser.add_argument("--plan", action="store_true", help="print the next round's plan and stop")
    parser.add_argument("--choose", action="store_true", help="print the pilots' choice table (from the logs)")
    parser.add_argument("--amend", metavar="JSON", help="change settings from the next round on (with --why)")
    parser.add_argument("--why", default="", help="the reason for --amend, kept in the ledger")
    parser.add_argument("--rounds", type=int, default=1, help="rounds to run (stops early once the campaign is done)")
    parser.add_argument("--replay", action="store_true",
                        help="train the kept base again on this machine, which lacks it: its rounds since the "
                             "restart from the shipped dflash-k1, each on its own chunk, seed and settings")
    args = parser.parse_args()
    if args.settings != "{}" and os.path.isfile(args.ledger):
        parser.error(f"--settings applies to a new ledger only; {args.ledger} has its own")
    if args.amend is not None or args.choose:
        ledger = read_json(args.ledger)
        if ledger is None:
            parser.error(f"{args.ledger} does not exist yet")
        if args.choose:
            choice = choose_from_logs(ledger, read_pilot_logs(ledger, args.logs))
            print("\n".join(choice["table"]) + f"\nchosen: {choice['layers']} layers")
            return 0
        return train_round.write_amendment(parser, args, ledger, amend_settings)
    if args.replay:
        if read_json(args.ledger) is None:
            parser.error(f"{args.ledger} does not exist yet: there is nothing to replay")
        replay(args, log=lambda m: print(m, flush=True))
        return 0
    return train_round.run_rounds(parser, args, check_setting_names,
                                  lambda args, overrides: run_round(args, overrides, log=lambda m: print(m, flush=True)))


if __name__ == "__main__":
    sys.exit(main())
