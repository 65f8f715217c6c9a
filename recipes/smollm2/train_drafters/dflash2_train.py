"""The embedded DFlash2 drafter for SmolLM2-135M-Instruct (issue 46): DFlash2's convolutions (as the
identity) and candidate selector added to the shipped dflash-k1, trained on one chunk of the 5x
data (train_round.py's shards and held-out split), in stages a sitting can stop between:

  features   the chunk's target features, cached (a zero-step run; about 20 minutes on 2 cores);
  baseline   dflash-k1 measured on the held-out split as shipped (zero steps);
  pilots     frozen backbone (only the convolutions and the selector train, at lr_new), a fine-tuned
             one (everything trains, at lr_continue) and the selector alone (convolutions kept as the
             identity, at lr_new), `pilot_steps` each, same data; the one with the highest
             held-out estimated tau of the selector's greedy chain wins, where taus within TIE of
             the highest count as equal and the mode training the fewest parts wins among them;
  main       the winning mode for `steps` steps from dflash-k1 (patience 3), packaged into
             --candidate: the drafter recipes/smollm2/evaluate/eval.sh measures next to dflash-k1 and
             dblast-k4 before it may ship as `dflash2`.
Each stage's result goes into the ledger (--ledger) at once; a rerun skips the stages it holds.
Selector rank 32 keeps the packaged drafter under package.py's 25 MB (its two codebooks are
V x rank); kernel 2 and group 16 and top-k 16 are the published settings.

    python recipes/smollm2/train_drafters/dflash2_train.py                 # every stage not yet in the ledger
    python recipes/smollm2/train_drafters/dflash2_train.py --plan          # what it would run
"""
import argparse
import datetime
import json
import os
import sys

from package import package
from train_round import RECIPE, ROOT, copy_logs, measured, read_json, train, write_json

from dblast_ext.jsonl import read_jsonl

SETTINGS = {"chunk": 0, "pilot_steps": 300, "steps": 1600, "batch_size": 4, "num_anchors": 16,
            "distill_weight": 0.5, "decay": 7, "save_every": 150, "patience": 3, "lr_continue": 3e-4,
            "lr_new": 1e-3, "selector_weight": 1.0,
            "dflash2": {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 32, "selector_top_k": 16}}
# what each pilot trains; a tie goes to the earlier of these, which trains fewer parts
MODES = {"selector": dict(selector_only=True), "frozen": dict(freeze_backbone=True), "finetuned": {}}
# estimated taus this close are a tie: well under the held-out split's standard error of a
# position's agreement (about 0.016 at 0.5 over its 1,024 anchors: 64 responses x 16)
TIE = 0.005
POSITIONS = 7   # draft positions of block 8, on which the tau estimates compare


def base_config(ledger: dict, store: str, work: str, name: str) -> dict:
    s = ledger["settings"]
    return {
        "target": "default",
        "data": [os.path.join(store, "responses", shard) for shard in ledger["shards"]],
        "eval_data": [os.path.join(store, "responses", "heldout.jsonl.gz")],
        "out": os.path.join(work, name), "init_from": "dflash-k1",   # the embedded drafter, by name
        "objective": "nll", "distill_weight": s["distill_weight"], "decay": s["decay"], "feature_scaling": "rms",
        "num_anchors": s["num_anchors"], "batch_size": s["batch_size"], "warmup_ratio": 0.04,
        "save_every": s["save_every"], "log_every": 10, "seed": 0, "feature_cache": os.path.join(work, "features"),
        "autocast": "auto", "recompute_logits": False, "eval_at_start": True, "select_by": "loss",
    }


def stage_configs(ledger: dict, store: str, work: str) -> dict:
    s = ledger["settings"]
    dflash2 = dict(dflash2=s["dflash2"], selector_weight=s["selector_weight"])
    configs = {
        "features": dict(base_config(ledger, store, work, "feature-pass"), max_steps=0, lr=s["lr_continue"]),
        "baseline": dict(base_config(ledger, store, work, "baseline-dflash-k1"), max_steps=0, lr=s["lr_continue"]),
        "pilot-frozen": dict(base_config(ledger, store, work, "pilot-frozen"), **dflash2, freeze_backbone=True,
                             max_steps=s["pilot_steps"], lr=s["lr_new"], save_every=min(150, s["pilot_steps"])),
        "pilot-finetuned": dict(base_config(ledger, store, work, "pilot-finetuned"), **dflash2,
                                max_steps=s["pilot_steps"], lr=s["lr_continue"], save_every=min(150, s["pilot_steps"])),
    }
    configs["pilot-selector"] = dict(base_config(ledger, store, work, "pilot-selector"), **dflash2, selector_only=True,
                                     max_steps=s["pilot_steps"], lr=s["lr_new"], save_every=min(150, s["pilot_steps"]))
    if ledger.get("choice"):
        mode = ledger["choice"]
        configs["main"] = dict(base_config(ledger, store, work, "main"), **dflash2, **MODES[mode],
                               max_steps=s["steps"], patience=s["patience"],
                               lr=s["lr_continue"] if mode == "finetuned" else s["lr_new"])
    return configs


def summary(config: dict, seconds: float) -> dict:
    entries = [e for _, e in read_jsonl(os.path.join(config["out"], "eval_log.jsonl"), "held-out log")]
    result = {"steps": max(e["step"] for e in entries), "seconds": seconds, **measured(entries, POSITIONS)}
    for key in ("start", "best"):   # the selector's own loss, where there is a selector
        step = result[key]["step"]
        entry = next(e for e in entries if e["step"] == step)
        if "selector_loss" in entry:
            result[key]["selector_loss"] = round(entry["selector_loss"], 5)
    return result


def choose(ledger: dict, log) -> None:
    """The main stage's mode, once every pilot is in the ledger (kept once chosen)."""
    if ledger.get("choice") or not all(f"pilot-{mode}" in ledger["stages"] for mode in MODES):
        return
    taus = {mode: ledger["stages"][f"pilot-{mode}"]["best"]["estimated_tau"] for mode in MODES}
    ledger["choice"] = next(mode for mode in MODES if taus[mode] >= max(taus.values()) - TIE)
    log(f"== pilots: estimated tau {taus}; chosen {ledger['choice']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    here = lambda *parts: os.path.relpath(os.path.join(*parts))  # noqa: E731
    parser.add_argument("--store", default=here(RECIPE, "data"), help="data.sh's store")
    parser.add_argument("--ledger", default=here(RECIPE, "training", "dflash2.json"))
    parser.add_argument("--logs", default=here(RECIPE, "logs", "dflash2"))
    parser.add_argument("--work", default=here(ROOT, "runs", "smollm2-dflash2"))
    parser.add_argument("--candidate", default=here(ROOT, "runs", "smollm2-dflash2", "candidate"),
                        help="where the trained drafter is packaged for evaluation")
    parser.add_argument("--settings", default="{}", help="JSON overrides of the settings of a NEW ledger (also "
                        "\"shards\": a list of shard names instead of the chunk's)")
    parser.add_argument("--plan", action="store_true")
    args = parser.parse_args()
    ledger = read_json(args.ledger)
    if ledger is None:
        five_x = read_json(os.path.join(RECIPE, "training", "ledger.json"))
        settings = {**SETTINGS, **json.loads(args.settings)}
        shards = settings.pop("shards", None) or [name for i, name in enumerate(five_x["shards"])
                                                  if i % five_x["settings"]["chunks"] == settings["chunk"]]
        ledger = {"settings": settings, "shards": shards, "stages": {}, "choice": None,
                  "date": datetime.date.today().isoformat()}
    elif args.settings != "{}":
        parser.error(f"--settings applies to a new ledger only; {args.ledger} has its own")
    os.makedirs(args.work, exist_ok=True)
    log = lambda message: print(message, flush=True)  # noqa: E731
    choose(ledger, log)
    for stage in ("features", "baseline", "pilot-frozen", "pilot-finetuned", "pilot-selector", "main"):
        configs = stage_configs(ledger, args.store, args.work)
        if stage in ledger["stages"]:
            continue
        if args.plan:
            print(json.dumps({stage: configs.get(stage, "after the pilots")}, indent=1))
            continue
        seconds = train(configs[stage], args.work, log)
        ledger["stages"][stage] = {"seconds": seconds} if stage == "features" else summary(configs[stage], seconds)
        if stage != "features":
            copy_logs(configs[stage]["out"], args.logs, stage)
        choose(ledger, log)
        if stage == "main":
            package(os.path.join(configs["main"]["out"], "final"), "dflash2", args.candidate)
            log(f"== packaged {args.candidate}")
        write_json(args.ledger, ledger)
    return 0


if __name__ == "__main__":
    sys.exit(main())
