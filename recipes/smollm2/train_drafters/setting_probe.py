"""Which value of one campaign setting trains the next round best? (issue 58)

Runs from the next base round's start (the shipped dflash-k1 where the ledger restarts the base,
else the kept one) on the chunk the next round will train on, one run per value of one setting
(`--vary lr_continue 3e-4 1e-4`), with everything else the ledger's, the same steps and seed,
side by side on the cores. Each final drafter and the start are measured on the held-out split
as against_shipped.py measures, and the paired bootstrap gives each run's gain over the start and
each value's gain over the one listed before it, in the greedy chain's accepted length (what the
decode loop's drafts commit) and in the proxy. The chunk's target features go to the campaign's
own cache, so the round that follows reads them. A result is a reason to `train_scaled.py
--amend` the setting, with the probe's numbers as the reason.

    OMP_NUM_THREADS=2 python recipes/smollm2/train_drafters/setting_probe.py --vary lr_continue 3e-4 1e-4 \\
        >> recipes/smollm2/logs/setting-probe-<date>.log 2>&1
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from side_by_side import measure_finals, report, today, train_side_by_side  # noqa: E402
from train_scaled import (DEFAULT_SETTINGS, at_temperatures, list_shards, read_json, restart_pending,  # noqa: E402
                          round_plan, run_config, shard_path, shipped_drafter, target_dtype)

RECIPE = os.path.dirname(HERE)


def probe_values(setting: str, values: list) -> list:
    """The values as JSON (3e-4 a number, "shipped" a string), checked against the setting's type."""
    if setting not in DEFAULT_SETTINGS:
        raise SystemExit(f"--vary {setting}: not a campaign setting (one of {', '.join(sorted(DEFAULT_SETTINGS))})")
    if len(values) < 2:
        raise SystemExit(f"--vary {setting}: give at least two values to compare, got {values}")
    parsed = []
    for value in values:
        try:
            parsed.append(json.loads(value))
        except json.JSONDecodeError:
            parsed.append(value)
    default = DEFAULT_SETTINGS[setting]
    if default is not None and any(type(v) is not type(default) and not (isinstance(default, float) and
                                                                      isinstance(v, int)) for v in parsed):
        raise SystemExit(f"--vary {setting}: its values are {type(default).__name__}s, got {values}")
    if len(set(map(json.dumps, parsed))) < len(parsed):
        raise SystemExit(f"--vary {setting}: the values repeat, got {values}")
    return parsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vary", nargs="+", required=True, metavar=("SETTING", "VALUE"),
                        help="a campaign setting and two or more values")
    parser.add_argument("--steps", type=int, default=900, help="steps of each run (default 900)")
    parser.add_argument("--ledger", default=os.path.join(RECIPE, "training", "scaled.json"))
    parser.add_argument("--store", default=os.path.join(RECIPE, "data"))
    parser.add_argument("--scaled", default=os.path.join(RECIPE, "data", "scaled"))
    parser.add_argument("--work", default=os.path.join("runs", "smollm2-scaled"),
                        help="the campaign's scratch folder (its features cache and kept base)")
    args = parser.parse_args()
    setting, values = args.vary[0], probe_values(args.vary[0], args.vary[1:])
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    ledger = read_json(args.ledger)
    if ledger is None or ledger["stage"] != "base":
        parser.error(f"{args.ledger}: the probe starts a base round, and the campaign is not at one")
    names = at_temperatures(list_shards(args.store, args.scaled), ledger["settings"].get("temperatures"))
    plan = round_plan(ledger, names, os.path.join(args.work, "kept"))
    shipped = restart_pending(ledger)
    init = shipped_drafter("dflash-k1") if shipped else os.path.join(args.work, "kept", "dflash-k1")
    if not os.path.isdir(init):
        parser.error(f"the kept base {init} is not on this machine: train_scaled.py --replay first")
    heldout = shard_path(ledger["heldout"], args.store, args.scaled)
    paths = {"data": [shard_path(n, args.store, args.scaled) for n in plan["shards"]], "heldout": heldout}
    # one folder per round, setting and length: a run (and its measure) found there is this probe's own
    probe = os.path.join(args.work, f"setting-probe-round-{plan['round']:02d}-{setting}-{args.steps}-steps")
    features = os.path.join(args.work, "features")
    configs, books = {}, {}
    for value in values:
        name = f"{setting}={value}"
        books[name] = {**ledger, "settings": {**ledger["settings"], setting: value, "base_steps": args.steps}}
        configs[name] = run_config(books[name], plan, name, {"kind": "base", "init": init}, paths, probe, features)
    print(f"== round {plan['round']}'s chunk: {len(plan['shards'])} shards "
          f"({', '.join(os.path.basename(n).split('.')[0] for n in plan['shards'])}), from "
          f"{'the shipped' if shipped else 'the kept'} dflash-k1", flush=True)
    seconds = train_side_by_side(configs, probe)
    measured = measure_finals(books[next(iter(books))], init, configs, heldout, probe, features)
    labels = {name: f"{name} ({seconds[name]:.0f} s)" for name in configs}
    names_in_order = list(configs)
    pairs = [("start", name) for name in names_in_order] + list(zip(names_in_order, names_in_order[1:]))
    gains = report(measured, labels, pairs, ledger["settings"])
    print(json.dumps({"date": today(), "round": plan["round"], "setting": setting, "values": values,
                      "steps": args.steps, "shards": plan["shards"],
                      "start": "the shipped dflash-k1" if shipped else "the kept dflash-k1",
                      "target_dtype": target_dtype(ledger["settings"]), "gains": gains}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
