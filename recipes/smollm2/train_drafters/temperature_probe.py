"""Do the scaled set's T 1.0 responses teach the drafter what a T 0.7 user needs? (issue 58)

Half of the scaled shards were sampled at T 1.0 / top-p 0.95, half at T 0.7 / top-p 0.8
(make_data/data_scale.py), and a block drafter predicts positions 2..b without seeing the
tokens before them: it learns their distribution under the data's own sampling. At T 1.0 that
is flatter, and its most likely token can differ from the one a T 0.7 continuation makes
likeliest, which is what a greedy draft must hit.

Two runs from the same drafter (default: the shipped dflash-k1) with the campaign's base
settings (its ledger), the same steps and seed, one on the T 0.7 shards and one on the T 1.0
shards of a campaign round's chunk, matched kind by kind (as many of each kind from either
temperature). Each final drafter and the start are then measured as against_shipped.py
measures (zero steps, the 5x store's held-out split, sampled at T 0.7, `eval_anchors` anchors a
sequence), and the paired bootstrap gives each run's gain over the start and T 0.7 against
T 1.0, in the greedy chain's accepted length (what the decode loop's drafts commit) and in the
proxy. Both runs read the chunk's cached features, so after that round (or its --replay) on
this machine the probe costs only its steps.

    OMP_NUM_THREADS=2 python recipes/smollm2/train_drafters/temperature_probe.py --round 6 \\
        >> recipes/smollm2/logs/temperature-probe-<date>.log 2>&1
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from side_by_side import measure_finals, report, today, train_side_by_side  # noqa: E402
from train_scaled import read_json, run_config, sampled_at, settings_at, shard_kind, shard_path, \
    shipped_drafter, target_dtype  # noqa: E402

RECIPE = os.path.dirname(HERE)


def split_by_temperature(shards: list) -> dict:
    """{0.7: [...], 1.0: [...]}: a chunk's scaled shards by the temperature they were sampled at,
    matched kind by kind (the first n of each kind at either temperature, n the smaller count)."""
    by = {}
    for name in shards:
        if name.startswith("scaled/"):
            by.setdefault(shard_kind(name), {}).setdefault(sampled_at(name), []).append(name)
    out = {0.7: [], 1.0: []}
    for kind in sorted(by):
        n = min(len(by[kind].get(t, [])) for t in out)
        for t in out:
            out[t] += by[kind].get(t, [])[:n]
    if not out[0.7]:
        sys.exit("the chunk has no kind sampled at both temperatures: pick another round")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--round", type=int, required=True, help="the campaign round whose chunk to split")
    parser.add_argument("--steps", type=int, default=900, help="steps of each run (default 900: 3 epochs of 6 shards)")
    parser.add_argument("--init", help="the drafter both runs start from (default: the shipped dflash-k1)")
    parser.add_argument("--ledger", default=os.path.join(RECIPE, "training", "scaled.json"))
    parser.add_argument("--store", default=os.path.join(RECIPE, "data"))
    parser.add_argument("--scaled", default=os.path.join(RECIPE, "data", "scaled"))
    parser.add_argument("--work", default=os.path.join("runs", "smollm2-scaled", "temperature-probe"))
    parser.add_argument("--features", default=os.path.join("runs", "smollm2-scaled", "features"))
    args = parser.parse_args()
    ledger = read_json(args.ledger)
    if ledger is None or args.round >= len(ledger["rounds"]):
        parser.error(f"--round {args.round}: {args.ledger} has no such round")
    record = ledger["rounds"][args.round]
    split = split_by_temperature(record["shards"])
    init = args.init or shipped_drafter("dflash-k1")
    book = {**ledger, "settings": {**settings_at(ledger, args.round), "base_steps": args.steps,
                                   "select_by": "greedy_accepted"}}
    heldout = shard_path(ledger["heldout"], args.store, args.scaled)
    configs = {}
    for t, shards in split.items():
        paths = {"data": [shard_path(n, args.store, args.scaled) for n in shards], "heldout": heldout}
        plan = {"round": args.round, "stage": "base", "shards": shards}
        configs[f"T{t}"] = run_config(book, plan, f"T{t}", {"kind": "base", "init": init}, paths, args.work,
                                      args.features)
        print(f"== T {t}: {len(shards)} shards ({', '.join(os.path.basename(n)[:-9] for n in shards)})", flush=True)
    seconds = train_side_by_side(configs, args.work)
    measured = measure_finals(book, init, configs, heldout, args.work, args.features)
    labels = {name: f"trained on the T {name[1:]} shards ({seconds[name]:.0f} s)" for name in configs}
    gains = report(measured, labels, [("start", "T0.7"), ("start", "T1.0"), ("T1.0", "T0.7")], ledger["settings"])
    result = {"date": today(), "round": args.round, "steps": args.steps,
              "shards": {str(t): v for t, v in split.items()},
              "target_dtype": target_dtype(ledger["settings"]), "gains": gains}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
