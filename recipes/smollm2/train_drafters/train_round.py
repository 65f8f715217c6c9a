"""One round of the SmolLM2 drafters' training on the 5x data (train.sh runs it).

Training to a plateau takes many hours on 2 CPU cores, longer than one sitting, and a
machine may not keep its files from one sitting to the next: the target features alone (about
6 KB a token, 18 GB for the whole set) cannot be kept. So the training is cut into rounds that
each fit a sitting, and all that one round hands to the next is committed:
  - the ledger (--ledger, JSON): the fixed settings, the pilots' choice, the stage, and per
    round its data, its runs and their held-out measurements;
  - the drafters, shipped as the embedded dflash-k1 / dblast-k4 whenever a round improved them
    (they are the product's drafters, so shipping one is committing it);
  - the runs' logs, copied into --logs.
A round trains on one chunk of the shards (every `chunks`-th shard, so each chunk has math,
code and chat; the pilots and the first base round share the first), whose target features it
caches first (per shard, in WORK/features, timed on their own), with the round's index as the
seed. Its runs depend on the stage:
  pilots  (round 0) base drafters of each size x block for `pilot_steps` steps, chosen by
          choose_pilot.py's rule; the shipped dflash-k1 (the first recipe's) is measured on the
          held-out split beside them, for the base to beat before it replaces it;
  base    K = 1, NLL with distillation, from scratch (first base round) or from the shipped
          dflash-k1 (later ones), `base_steps` steps; shipped as dflash-k1 when it improved;
  arms    dflash-k1 (NLL with distillation) and dblast-k4 (K = 4 head, accepted-length
          surrogate), each from its shipped drafter (the first arm round from the base, i.e.
          the shipped dflash-k1 as the base stage left it), equal data and `arm_steps` steps.
A ledger's settings may be changed between rounds (--amend with --why: the change, the round it
takes effect from and the reason are kept in the ledger's `amended` list); a round reads them
when it starts.
Each run measures its start on the held-out split (step 0) and stops early after `patience`
checkpoints without a lower held-out loss; its final drafter is its best checkpoint. It
improved when that loss is lower than at its start; a stage (the base, or an arm) is done when
a round improves it by less than `min_gain` (relative), or after `max_rounds` rounds
(`max_base_rounds` for the base); amending `max_rounds` upward reopens an arm the cap stopped
while its last round still gained `min_gain` or more. The dflash-k1 arm goes on with the
base's objective, so ending the base early (an amended `max_base_rounds`, which takes effect
at once) costs dflash-k1 nothing and gives dblast-k4 its rounds sooner.

    python recipes/smollm2/train_drafters/train_round.py                 # the next round
    python recipes/smollm2/train_drafters/train_round.py --plan          # what the next round would do
    python recipes/smollm2/train_drafters/train_round.py --amend '{"base_steps": 3000}' --why "..."
"""
import argparse
import datetime
import glob
import gzip
import json
import os
import shutil
import subprocess
import sys
import time

import choose_pilot
from package import package

from dblast_ext.training.config import SELECTION_MEASURES
from dblast_ext.jsonl import read_jsonl

# recipes/smollm2, whose data/, training/ and logs/ lie beside this folder; and the repository
RECIPE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(os.path.dirname(RECIPE))
SHIP_DIR = os.path.join(ROOT, "dblast_ext", "drafters", "smollm2-135m-instruct")
ARMS = ("dflash-k1", "dblast-k4")
# the held-out measure that picks an objective's best checkpoint, stops it and decides shipping:
# the surrogate's loss sums over a prefix set that grows as the drafter improves (docs/training.md)
SELECT_BY = {"nll": "loss", "al": "accepted_proxy"}
KINDS = ("math", "code", "chat")
MASK = 16   # <empty_output>: a special token chat text never contains, used as the drafter's mask

# what a new ledger is made with; afterwards the ledger's own settings rule every round
DEFAULT_SETTINGS = {
    "chunks": 8, "pilot_steps": 200, "base_steps": 1200, "arm_steps": 800,
    "layers_choices": [2, 3], "block_choices": [8, 16],
    "batch_size": 4, "num_anchors": 16, "distill_weight": 0.5, "decay": 7, "save_every": 150, "patience": 3,
    "target_layer_ids": [1, 8, 14, 21, 27], "lr_scratch": 1e-3, "lr_continue": 3e-4, "tau": 0.1,
    "min_gain": 0.01, "max_rounds": 8, "max_base_rounds": 8,
}


def read_json(path):
    """The file's JSON, None when there is no file."""
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def write_json(path, value) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(value, f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)


def store_shards(store: str) -> list:
    """The response shards data.sh keeps, in its order (math, code, chat), as file names."""
    return [os.path.basename(p) for kind in KINDS
            for p in sorted(glob.glob(os.path.join(store, "responses", f"{kind}-[0-9][0-9][0-9].jsonl.gz")))]


def chunk_size(paths) -> tuple:
    """(sequences, response tokens, all tokens) of the shards, read once."""
    sequences = responses = tokens = 0
    for path in paths:
        with gzip.open(path, "rt") as f:
            for line in f:
                record = json.loads(line)
                sequences, responses = sequences + 1, responses + sum(record["loss_mask"])
                tokens += len(record["input_ids"])
    return sequences, responses, tokens


def new_ledger(store: str, settings: dict) -> dict:
    """A ledger over every shard data.sh makes (named from its prompt lists, made or not: a round
    needs only its own chunk's), or over the shards there are in a store without prompt lists."""
    if not os.path.isfile(os.path.join(store, "responses", "heldout.jsonl.gz")):
        sys.exit(f"{store}/responses/heldout.jsonl.gz is missing: data.sh writes it before the chat shards")
    shards = data_sh_shards(store) or store_shards(store)
    if not shards:
        sys.exit(f"no data shards in {store}/responses")
    return {"settings": settings, "shards": shards, "heldout": "heldout.jsonl.gz", "choice": None, "stage": "pilots",
            "baseline": None, "shipped": {arm: None for arm in ARMS}, "arms_from_round": None, "done": [],
            "rounds": []}


def check_setting_names(settings: dict, flag: str, known: dict = DEFAULT_SETTINGS) -> None:
    """A ValueError naming `flag` when `settings` has a key the campaign (`known`: its default
    settings; this recipe's unless given) does not know."""
    unknown = sorted(set(settings) - set(known))
    if unknown:
        raise ValueError(f"{flag}: unknown settings {unknown}; known: {sorted(known)}")


def change_settings(ledger: dict, changes: dict, why: str, check_names) -> dict:
    """A ledger's settings changed from its next round on (names checked by `check_names`, a
    reason required): the record of old and new values, from which round and why."""
    check_names(changes, "--amend")
    if not why.strip():
        raise ValueError("--amend needs --why: the ledger keeps the reason for every change")
    settings = ledger["settings"]
    record = {"from_round": len(ledger["rounds"]), "date": datetime.date.today().isoformat(), "why": why.strip(),
              "changes": {key: {"old": settings.get(key), "new": value} for key, value in sorted(changes.items())}}
    settings.update(changes)
    return record


def amend_settings(ledger: dict, changes: dict, why: str) -> dict:
    """Changes the settings of an existing ledger from its next round on, and records what
    changed (old and new values), from which round and why; returns that record."""
    record = change_settings(ledger, changes, why, check_setting_names)
    if ledger["stage"] == "base" and base_is_done(ledger):  # e.g. max_base_rounds cut to the rounds already run
        ledger["stage"], ledger["arms_from_round"] = "arms", len(ledger["rounds"])
        record["stage"] = {"old": "base", "new": "arms"}
    reopened = reopen_capped_arms(ledger)
    if reopened:
        record["reopened"] = reopened
    ledger.setdefault("amended", []).append(record)
    return record


def arm_rounds(ledger: dict, arm: str) -> list:
    """The runs of `arm` in the rounds so far, oldest first (as conclude counts an arm's rounds)."""
    return [r["runs"][arm] for r in ledger["rounds"] if arm in r.get("runs", {})]


def last_gain(ledger: dict, arm: str) -> float:
    """The relative gain of `arm`'s last round (0 before its first)."""
    runs = arm_rounds(ledger, arm)
    return runs[-1].get("gain", 0.0) if runs else 0.0


def how_the_arms_ended(ledger: dict) -> str:
    """Per arm: its plateau (the last round's gain under min_gain) or the max_rounds cap."""
    s, ends = ledger["settings"], []
    for arm in ARMS:
        gain = last_gain(ledger, arm)
        ends.append(f"{arm} at its plateau ({gain:.2%} in its last round)" if gain < s["min_gain"] else
                    f"{arm} at the cap of {s['max_rounds']} rounds, still gaining {gain:.2%} (--amend "
                    f"'{{\"max_rounds\": N}}' gives it more)")
    return "; ".join(ends)


def reopen_capped_arms(ledger: dict) -> list:
    """The arms that `max_rounds` stopped while their last round still gained `min_gain` or
    more, taken off the done list now that the (amended) cap leaves them rounds: a plateau is
    what ends an arm, the cap only bounds a sitting's plans. The stage goes back to the arms."""
    s, reopened = ledger["settings"], []
    for arm in list(ledger["done"]):
        if last_gain(ledger, arm) >= s["min_gain"] and len(arm_rounds(ledger, arm)) < s["max_rounds"]:
            ledger["done"].remove(arm)
            reopened.append(arm)
    if reopened and ledger["stage"] == "done":
        ledger["stage"] = "arms"
    return reopened


def base_rounds(ledger: dict) -> int:
    return sum(1 for r in ledger["rounds"] if r["stage"] == "base")


def base_is_done(ledger: dict, gain: float = None) -> bool:
    """Whether the base stage ends: a dflash-k1 of this recipe is shipped, and the last round
    gained less than min_gain (`gain`, when a round has just ended) or the base had its rounds."""
    s = ledger["settings"]
    limit = min(s["max_rounds"], s.get("max_base_rounds", s["max_rounds"]))
    return ledger["shipped"]["dflash-k1"] is not None and (
        (gain is not None and gain < s["min_gain"]) or base_rounds(ledger) >= limit)


def data_sh_shards(store: str) -> list:
    """The shards data.sh cuts its prompt lists into: about 200 sequences each (code: 3 a prompt)."""
    names = []
    for kind, samples in (("math", 1), ("code", 3), ("chat", 1)):
        path = os.path.join(store, "prompts", f"{kind}.jsonl")
        prompts = sum(1 for line in open(path) if line.strip()) if os.path.isfile(path) else 0
        names += [f"{kind}-{i:03d}.jsonl.gz" for i in range(-(-prompts // -(-200 // samples)))]
    return names


def round_plan(ledger: dict, ship_dir: str) -> dict:
    """The next round: its index, chunk, shards and the runs it makes (name -> how; `init`: the
    drafter a run starts from, None from scratch)."""
    s = ledger["settings"]
    index = len(ledger["rounds"])
    # the pilots' chunk is the first base round's too: run in one sitting, they share its features
    chunk = sum(1 for r in ledger["rounds"] if r["stage"] != "pilots") % s["chunks"]
    shards = [name for i, name in enumerate(ledger["shards"]) if i % s["chunks"] == chunk]
    runs = {}
    stage = ledger["stage"]
    if stage == "pilots":
        for layers in s["layers_choices"]:
            for block in s["block_choices"]:
                runs[f"pilot-L{layers}-B{block}"] = {"kind": "pilot", "layers": layers, "block": block}
        runs["baseline-dflash-k1"] = {"kind": "baseline"}
    elif stage == "base":
        shipped = ledger["shipped"]["dflash-k1"] is not None   # by this recipe: else from scratch
        runs["base"] = {"kind": "base", "init": os.path.join(ship_dir, "dflash-k1") if shipped else None}
    elif stage == "arms":
        for arm in ARMS:
            if arm not in ledger["done"]:
                # an arm's first round starts from the base: the shipped dflash-k1 as the base stage left it
                shipped = ledger["shipped"][arm]
                own = shipped is not None and shipped >= ledger["arms_from_round"]
                runs[arm] = {"kind": "arm", "init": os.path.join(ship_dir, arm if own else "dflash-k1")}
    return {"round": index, "chunk": chunk, "shards": shards, "stage": stage, "runs": runs}


def run_config(ledger, plan, name, run, work, store, features, ship_dir) -> dict:
    s = ledger["settings"]
    choice = ledger["choice"] or {}
    kind = run["kind"]
    objective = "al" if name == "dblast-k4" else "nll"
    config = {
        "target": "default",
        "data": [os.path.join(store, "responses", shard) for shard in plan["shards"]],
        "eval_data": [os.path.join(store, "responses", ledger["heldout"])],
        "out": os.path.join(work, name), "init_from": None,
        "num_branches": 4 if name == "dblast-k4" else 1, "objective": objective, "tau": s["tau"],
        "distill_weight": s["distill_weight"] if objective == "nll" else 0.0, "decay": s["decay"],
        "feature_scaling": "rms", "num_anchors": s["num_anchors"], "batch_size": s["batch_size"],
        "warmup_ratio": 0.04, "patience": s["patience"], "save_every": s["save_every"], "log_every": 10,
        "seed": plan["round"], "feature_cache": features, "autocast": "auto", "recompute_logits": False,
        "eval_at_start": True, "select_by": SELECT_BY[objective],
    }
    if kind == "baseline":   # the first recipe's dflash-k1, measured only (and at its own block)
        config.update(init_from=os.path.join(ship_dir, "dflash-k1"), max_steps=0, lr=s["lr_continue"],
                      patience=None)
        return config
    block = run.get("block", choice.get("block"))
    steps = {"pilot": "pilot_steps", "base": "base_steps", "arm": "arm_steps"}[kind]
    config.update(block_size=block, max_steps=s[steps])
    init = run.get("init")
    if init is None:
        layers = run.get("layers", choice.get("layers"))
        config.update(drafter={"num_hidden_layers": layers, "mask_token_id": MASK,
                               "target_layer_ids": s["target_layer_ids"]}, lr=s["lr_scratch"])
    else:
        config.update(init_from=init, lr=s["lr_continue"])
    if kind == "pilot":
        config["patience"] = None
        config["save_every"] = min(s["save_every"], s["pilot_steps"])
    return config


def conclude(ledger: dict, plan: dict, record: dict, pilots: dict) -> list:
    """Updates the ledger from a finished round's measurements (`record`; `pilots`: the pilot
    round's choose_pilot summaries by L<layers>-B<block> name) and returns what to ship, as
    (run name, embedded drafter name) pairs."""
    s, stage, ship = ledger["settings"], plan["stage"], []
    if stage == "pilots":
        winner = choose_pilot.choose(pilots)
        layers, block = choose_pilot.parse_name(winner)
        ledger["choice"] = {"layers": layers, "block": block, "pilot": winner, "pilots": pilots}
        ledger["baseline"] = record["runs"]["baseline-dflash-k1"]["start"]
        ledger["stage"] = "base"
    elif stage == "base":
        run = record["runs"]["base"]
        first = plan["runs"]["base"]["init"] is None
        gain = 1.0 if first else relative_gain(run)
        # from scratch, the base replaces the first recipe's dflash-k1 only where it beats it
        better = run["best"]["estimated_tau"] > ledger["baseline"]["estimated_tau"] if first else gain > 0
        run.update(gain=round(gain, 5), shipped=better)
        if better:
            ship.append(("base", "dflash-k1"))
            ledger["shipped"]["dflash-k1"] = plan["round"]
        rounds = base_rounds(ledger) + 1
        if ledger["shipped"]["dflash-k1"] is None:
            if rounds >= s["max_rounds"]:   # never beat the first recipe's drafter: nothing to build arms on
                ledger["stage"], ledger["note"] = "done", f"the base did not beat the baseline in {rounds} rounds"
        elif base_is_done({**ledger, "rounds": ledger["rounds"] + [record]}, gain):
            ledger["stage"], ledger["arms_from_round"] = "arms", plan["round"] + 1
    elif stage == "arms":
        for arm in plan["runs"]:
            run = record["runs"][arm]
            gain = relative_gain(run)
            run.update(gain=round(gain, 5), shipped=gain > 0)
            if gain > 0:
                ship.append((arm, arm))
                ledger["shipped"][arm] = plan["round"]
            rounds = len(arm_rounds(ledger, arm)) + 1
            if gain < s["min_gain"] or rounds >= s["max_rounds"]:
                ledger["done"].append(arm)
        if all(arm in ledger["done"] for arm in ARMS):
            ledger["stage"] = "done"
    return ship


def measured(entries: list, positions: int, select_by: str = "loss") -> dict:
    """A run's start (step 0) and best checkpoint (by its held-out `select_by`: the lowest loss,
    or the highest accepted-length proxy), with estimated tau."""
    def summary(e):
        return {"step": e["step"], "loss": round(e["loss"], 5), "accepted_proxy": round(e["accepted_proxy"], 5),
                "greedy_accepted": e.get("greedy_accepted") and round(e["greedy_accepted"], 5),
                "top1_agreement": e.get("top1_agreement"),
                "estimated_tau": round(choose_pilot.estimated_tau(e.get("top1_agreement") or [], positions), 4)}
    start = next(e for e in entries if e["step"] == 0)
    best = (max if SELECTION_MEASURES[select_by] else min)(entries, key=lambda e: e[select_by])
    return {"start": summary(start), "best": summary(best), "select_by": select_by}


def relative_gain(run: dict) -> float:
    """How much a run's best checkpoint improved on its start, relative, in its selection measure."""
    measure = run.get("select_by", "loss")
    start, best = run["start"][measure], run["best"][measure]
    return (best - start) / start * (1 if SELECTION_MEASURES[measure] else -1)


def dblast_command() -> list:
    """This environment's `dblast` (beside this interpreter, so none on PATH is needed). Not
    `python -m dblast_ext.cli` where the script exists: run from the repository's root, that
    imports the source tree, which has no compiled library unless it was built in place."""
    script = os.path.join(os.path.dirname(sys.executable), "dblast")
    return [script] if os.path.isfile(script) else [sys.executable, "-m", "dblast_ext.cli"]


def train(config: dict, work: str, log) -> float:
    """Runs `dblast train` on the config (written beside the run) in a fresh process; its seconds."""
    path = os.path.join(work, os.path.basename(config["out"]) + ".json")
    write_json(path, config)
    started = time.time()
    log(f"== train {os.path.basename(config['out'])} ({time.strftime('%H:%M:%S', time.gmtime())} UTC)")
    subprocess.run(dblast_command() + ["train", "--config", path, "--no-progress"], check=True)
    return round(time.time() - started, 1)


def copy_logs(out: str, logs: str, prefix: str) -> None:
    os.makedirs(logs, exist_ok=True)
    for name in ("train_log.jsonl", "eval_log.jsonl"):
        if os.path.isfile(os.path.join(out, name)):
            shutil.copyfile(os.path.join(out, name), os.path.join(logs, f"{prefix}-{name}"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # relative to where it runs, so the runs' configs and logs name no machine's folders
    here = lambda *parts: os.path.relpath(os.path.join(*parts))  # noqa: E731
    parser.add_argument("--store", default=here(RECIPE, "data"), help="data.sh's store")
    parser.add_argument("--ledger", default=here(RECIPE, "training", "ledger.json"))
    parser.add_argument("--logs", default=here(RECIPE, "logs", "5x"), help="where the runs' logs are kept")
    parser.add_argument("--work", default=here(ROOT, "runs", "smollm2-5x"), help="scratch: runs, features")
    parser.add_argument("--ship-dir", default=here(SHIP_DIR), help="where improved drafters are shipped")
    parser.add_argument("--settings", default="{}", help="JSON overrides of the settings of a NEW ledger")
    parser.add_argument("--plan", action="store_true", help="print the next round's plan and stop")
    parser.add_argument("--amend", metavar="JSON", help="change settings of the existing ledger from its next round "
                        "on (with --why), then stop")
    parser.add_argument("--why", default="", help="the reason for --amend, kept in the ledger")
    parser.add_argument("--rounds", type=int, default=1, help="rounds to run (stops early once training is done)")
    args = parser.parse_args()
    if args.settings != "{}" and os.path.isfile(args.ledger):
        parser.error(f"--settings applies to a new ledger only; {args.ledger} has its own")
    if args.amend is not None:
        ledger = read_json(args.ledger)
        if ledger is None:
            parser.error(f"--amend changes an existing ledger; {args.ledger} does not exist (use --settings)")
        return write_amendment(parser, args, ledger, amend_settings)
    return run_rounds(parser, args, check_setting_names, run_round)


# the end of a campaign's command (this one's, and train_scaled.py's)
def write_amendment(parser, args, ledger: dict, amend) -> int:
    """--amend: `amend(ledger, change, why)` records the change, which is written and printed."""
    try:
        record = amend(ledger, json.loads(args.amend), args.why)
    except ValueError as error:
        parser.error(str(error))
    write_json(args.ledger, ledger)
    print(json.dumps(record, indent=1))
    return 0


def run_rounds(parser, args, check_names, run) -> int:
    """Up to --rounds rounds of `run(args, overrides)` (one with --plan), stopping when it says
    the campaign is done; --settings' names checked by `check_names` first."""
    overrides = json.loads(args.settings)
    try:
        check_names(overrides, "--settings")
    except ValueError as error:
        parser.error(str(error))
    for _ in range(max(1, args.rounds)):
        if not run(args, overrides) or args.plan:
            break
    return 0


def run_round(args, overrides: dict) -> bool:
    """The next round (its plan only, with --plan); False when training is already done."""
    ledger = read_json(args.ledger)
    if ledger is None:
        ledger = new_ledger(args.store, {**DEFAULT_SETTINGS, **overrides})
    if ledger["stage"] == "done":
        print(f"training is done: {ledger.get('note') or how_the_arms_ended(ledger)}")
        return False
    plan = round_plan(ledger, args.ship_dir)
    missing = [name for name in plan["shards"] if not os.path.isfile(os.path.join(args.store, "responses", name))]
    if missing and not args.plan:
        sys.exit(f"round {plan['round']} trains on shards data.sh has not made yet ({', '.join(missing)}): "
                 "run recipes/smollm2/make_data/data.sh")
    work = os.path.join(args.work, f"round-{plan['round']:02d}")
    features = os.path.join(args.work, "features")  # per shard: a later round on this machine reuses them
    configs = {name: run_config(ledger, plan, name, run, work, args.store, features, args.ship_dir)
               for name, run in plan["runs"].items()}
    if args.plan:
        print(json.dumps({"plan": plan, "not_made_yet": missing, "configs": configs}, indent=1))
        return True
    os.makedirs(work, exist_ok=True)
    log = lambda message: print(message, flush=True)  # noqa: E731
    seqs, responses, total = chunk_size(configs[next(iter(configs))]["data"])
    log(f"== round {plan['round']} ({plan['stage']}): chunk {plan['chunk']} of {ledger['settings']['chunks']}, "
        f"{len(plan['shards'])} shards, {seqs} sequences, {responses} response tokens")
    # pilots of every block and the base are compared on the draft positions the smallest block has
    positions = min(ledger["settings"]["block_choices"]) - 1
    record = {"round": plan["round"], "chunk": plan["chunk"], "stage": plan["stage"], "shards": plan["shards"],
              "date": datetime.date.today().isoformat(), "runs": {}}
    # the round's target features first, timed on their own (a zero-step run of its first config)
    features_run = dict(next(iter(configs.values())), out=os.path.join(work, "feature-pass"), max_steps=0,
                        patience=None)
    record["feature_seconds"] = train(features_run, work, log)
    log(f"== features: {total} tokens in {record['feature_seconds']:.0f} s "
        f"({total / record['feature_seconds']:.0f} tokens/s with the target load and a held-out pass)")
    for name, config in configs.items():
        seconds = train(config, work, log)
        entries = [e for _, e in read_jsonl(os.path.join(config["out"], "eval_log.jsonl"), "held-out log")]
        record["runs"][name] = {"init": config["init_from"] and os.path.basename(config["init_from"]),
                                "steps": max(e["step"] for e in entries), "seconds": seconds,
                                **measured(entries, positions, config["select_by"])}
        copy_logs(config["out"], args.logs, f"round-{plan['round']:02d}-{name}")
    # every run of the round is done: only now are drafters shipped (the arms start from the same base)
    pilots = {name[len("pilot-"):]: choose_pilot.best_checkpoint(choose_pilot.read_pilot(configs[name]["out"]),
                                                                  positions)
              for name in plan["runs"] if name.startswith("pilot-")}
    shipped = conclude(ledger, plan, record, pilots)
    for run_name, arm in shipped:
        package(os.path.join(configs[run_name]["out"], "final"), arm, os.path.join(args.ship_dir, arm))
    if plan["stage"] == "pilots":
        log(f"== chosen: {ledger['choice']['layers']} layers, block {ledger['choice']['block']}")
    shipped = [arm for _, arm in shipped]
    record["shipped"] = shipped
    ledger["rounds"].append(record)
    write_json(args.ledger, ledger)
    log(f"== round {plan['round']} done: shipped {shipped or 'nothing'}; next stage {ledger['stage']}")
    return True


if __name__ == "__main__":
    sys.exit(main())
