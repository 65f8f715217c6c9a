"""The scaled campaign's kept drafter against the shipped one of the same arm, paired on the
same held-out anchors: is it worth the full evaluation (`evaluate/eval.sh`) yet?

Both are measured as the capacity pilots are (train_scaled.py's `measure` runs: zero training
steps, the held-out split, `eval_anchors` anchors a sequence, seed 0, the ledger's target
dtype), so their per-anchor measures pair, and the paired bootstrap gives the kept drafter's
gain in each with a 95% interval:
- the accepted-length proxy: drafts sampled from the drafter's q, verified against the target;
- the greedy chain's accepted length: the drafts the decode loop makes (each position's
  argmax), as the target's own sampled continuation accepts them (training/objective.py's
  greedy_chain_accepted). This is the one the evaluation's tau follows.
One line of JSON per arm goes to stdout, after a table; append both to a dated log in
recipes/smollm2/logs/.

    python recipes/smollm2/train_drafters/against_shipped.py                 # dflash-k1
    python recipes/smollm2/train_drafters/against_shipped.py --arm dblast-k4

The held-out proxy is the training's estimate (one branch, teacher-forced on the target's own
samples): a gain here is a reason to run the evaluation, not a result of it.
"""
import argparse
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import train_round  # noqa: E402
from train_scaled import ARMS, paired_anchors, paired_bootstrap, read_json, run_config, target_dtype  # noqa: E402

RECIPE = os.path.dirname(HERE)
MEASURES = {"greedy_accepted": "greedy chain accepted", "accepted_proxy": "proxy"}


def measure(ledger: dict, drafter: str, name: str, heldout: str, work: str, features: str) -> dict:
    """A zero-step run of `drafter` on the held-out split: its eval_log and eval_anchors entries."""
    plan = {"round": 0}
    config = run_config(ledger, plan, name, {"kind": "measure", "of": "unused"}, {"heldout": heldout},
                        work, features)
    config["init_from"] = drafter
    out = config["out"]
    anchors_file = os.path.join(out, "eval_anchors.jsonl")
    if os.path.isfile(anchors_file) and "greedy_accepted" not in open(anchors_file).readline():
        shutil.rmtree(out)   # measured before the greedy chain was logged: measure again
    if not os.path.isfile(anchors_file):
        train_round.train(config, work, lambda message: print(message, flush=True))
    with open(os.path.join(out, "eval_log.jsonl")) as f:
        summary = json.loads(f.readline())
    with open(os.path.join(out, "eval_anchors.jsonl")) as f:
        anchors = json.loads(f.readline())
    return {"summary": summary, "anchors": anchors}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arm", default="dflash-k1", choices=ARMS)
    parser.add_argument("--ledger", default=os.path.join(RECIPE, "training", "scaled.json"))
    parser.add_argument("--store", default=os.path.join(RECIPE, "data"), help="the 5x store (its held-out split)")
    parser.add_argument("--keep-dir", default=os.path.join("runs", "smollm2-scaled", "kept"))
    parser.add_argument("--shipped", help="the drafter to compare with (default: the shipped one of --arm, by name)")
    parser.add_argument("--features", default=os.path.join("runs", "smollm2-scaled", "features"),
                        help="the campaign's feature cache (the held-out split's features are read from it)")
    parser.add_argument("--work", default=os.path.join("runs", "smollm2-scaled", "against-shipped"),
                        help="scratch: one folder per measured drafter (a kept drafter's is named by its round)")
    args = parser.parse_args()
    ledger = read_json(args.ledger)
    if ledger is None:
        parser.error(f"{args.ledger} does not exist: the campaign has not started")
    kept_round = ledger["kept"].get(args.arm)
    kept = os.path.join(args.keep_dir, args.arm)
    if kept_round is None or not os.path.isfile(os.path.join(kept, "config.json")):
        parser.error(f"no kept {args.arm} on this machine ({kept}; the ledger says round {kept_round})")
    heldout = os.path.join(args.store, "responses", "heldout.jsonl.gz")
    dtype = target_dtype(ledger["settings"])   # measured again when it changes
    shipped = measure(ledger, args.shipped or args.arm, f"shipped-{args.arm}-{dtype}", heldout, args.work,
                      args.features)
    mine = measure(ledger, kept, f"kept-{args.arm}-round-{kept_round:02d}-{dtype}", heldout, args.work,
                   args.features)
    s = ledger["settings"]
    gains = {}
    for key in MEASURES:
        first, second = paired_anchors(shipped["anchors"], mine["anchors"], key)
        gains[key] = paired_bootstrap(first, second, s["bootstrap_samples"], s["bootstrap_seed"])
    rows = [("shipped " + args.arm, shipped["summary"]), (f"kept {args.arm} (round {kept_round})", mine["summary"])]
    print("| drafter | greedy chain accepted | held-out proxy | first-draft agreement | held-out loss |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for label, summary in rows:
        print(f"| {label} | {summary['greedy_accepted']:.4f} | {summary['accepted_proxy']:.4f} | "
              f"{100 * summary['top1_agreement'][0]:.1f}% | {summary['loss']:.3f} |")
    for key, gain in gains.items():
        print(f"kept - shipped, {MEASURES[key]}: {gain['mean']:+.4f} [{gain['low']:+.4f}, {gain['high']:+.4f}] "
              f"over {gain['anchors']} paired blocks (95% bootstrap interval)")
    print(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "arm": args.arm,
                      "kept_round": kept_round, "target_dtype": dtype,
                      "shipped": {k: shipped["summary"][k] for k in ("greedy_accepted", "accepted_proxy", "loss")},
                      "kept": {k: mine["summary"][k] for k in ("greedy_accepted", "accepted_proxy", "loss")},
                      "first_draft": [shipped["summary"]["top1_agreement"][0], mine["summary"]["top1_agreement"][0]],
                      "gain": gains["accepted_proxy"], "greedy_gain": gains["greedy_accepted"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
