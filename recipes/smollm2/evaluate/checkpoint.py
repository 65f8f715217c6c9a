"""Keeps recipes/smollm2/evaluate/eval.sh's runs in the repository, so that the evaluation (many hours
on a 2-core CPU) survives the machine it runs on.

    python recipes/smollm2/evaluate/checkpoint.py save --runs runs/smollm2-eval      # while or after it runs
    python recipes/smollm2/evaluate/checkpoint.py restore --runs runs/smollm2-eval   # before eval.sh resumes
    while sleep 1200; do python recipes/smollm2/evaluate/checkpoint.py save --runs runs/smollm2-eval --commit; done

`save` mirrors the runs' records (every *.jsonl under the runs folder, complete lines only, so a
line being written is left for the next save) into results/smollm2/records/, the same relative
paths. `restore` does the reverse where the runs folder holds fewer lines, and also puts back
the finishing files of runs collect.py already copied into results/smollm2/ (summary.json,
calibration.json, oracle.json, determinism.json): eval.sh skips a run that has its finishing file, so a run
finished on an earlier machine is not run again even where its records were not kept.
`restore` leaves out what another drafter made: a records file, or a finished run whose own
settings or kept records name a drafter (`dblast-k4`, a path) whose checkpoint digest is no
longer the recorded one, e.g. after retraining, so the new drafter is evaluated anew rather
than reported with the old one's numbers; with `--oracle-block B`, also the oracle's runs and
records made at another block than B (its tau is read against the drafters' at their block).
"""
import argparse
import functools
import glob
import json
import os
import re
import shutil
import subprocess

RESULTS = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "results",
                                       "smollm2"))


def complete_lines(path):
    """The lines of `path` that end with a newline (a run appends one record per line)."""
    with open(path, encoding="utf-8") as f:
        return [line for line in f if line.endswith("\n")]


@functools.lru_cache(maxsize=None)
def current_digest(drafter: str):
    """The checkpoint digest of a drafter (an embedded name or a path) as it is now; None when
    it cannot be found here (its records are then kept as they are)."""
    try:
        from dblast_ext.drafting.drafter_io import checkpoint_digest
    except ImportError:
        raise SystemExit("checkpoint.py restore compares the recorded drafters with today's: it needs dblast_ext "
                         "(source .venv/bin/activate; scripts/setup.sh makes it)") from None
    try:
        return checkpoint_digest(drafter)
    except (FileNotFoundError, ValueError):
        return None


def recorded_settings(path):
    """The settings a run wrote into a finished file (its "settings") or a records file (those
    of its first complete line); {} when there are none."""
    try:
        if path.endswith(".jsonl"):
            with open(path, encoding="utf-8") as f:
                first = f.readline()   # the first line is enough: a run writes one settings for all
            value = json.loads(first) if first.endswith("\n") else {}
        else:
            with open(path, encoding="utf-8") as f:
                value = json.load(f)
    except (OSError, ValueError):
        return {}
    settings = value.get("settings") if isinstance(value, dict) else None
    return settings if isinstance(settings, dict) else {}


def another_drafter(settings):
    """Why a file with these recorded settings was made by another drafter than the one now
    under its name, or None."""
    drafter, digest = settings.get("drafter"), settings.get("drafter_digest")
    if not isinstance(drafter, str) or not isinstance(digest, str):
        return None
    now = current_digest(drafter)
    if now is None or now == digest:
        return None
    return f"made by {drafter} {digest}, which is now {now}"


def other_block(settings, block):
    """Why a file of the oracle (its settings name one) was made at another block than `block`
    (None: not the oracle's, the same block, no block recorded, or no block asked for)."""
    made = settings.get("block_size")
    if block is None or settings.get("oracle") is None or made is None or made == block:
        return None
    return f"the oracle at block {made}, which now runs at block {block}"


def made_elsewhere(path, oracle_block=None):
    """Why `path` should not come back: another drafter made it, or the oracle at another block."""
    settings = recorded_settings(path)
    return another_drafter(settings) or other_block(settings, oracle_block)


def mirror(src_root, dst_root, verb, check_drafter=False, oracle_block=None) -> int:
    """Copies every *.jsonl under src_root whose complete lines outnumber dst_root's copy, or
    whose settings differ from that copy's (a run of a retrained drafter replaces the old one's);
    `check_drafter`: not those made by another drafter than the one now under its name (nor
    the oracle's made at another block than `oracle_block`)."""
    copied = 0
    for src in sorted(glob.glob(os.path.join(src_root, "**", "*.jsonl"), recursive=True)):
        rel = os.path.relpath(src, src_root)
        dst = os.path.join(dst_root, rel)
        lines = complete_lines(src)
        # a copy with as many lines is kept, unless other settings (another drafter, say) made it
        if (os.path.exists(dst) and len(complete_lines(dst)) >= len(lines)
                and recorded_settings(dst) == recorded_settings(src)):
            continue
        why = made_elsewhere(src, oracle_block) if check_drafter else None
        if why:
            print(f"not restored {rel}: {why}")
            continue
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        tmp = dst + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(lines)
        os.replace(tmp, dst)  # a reader never sees half a file
        print(f"{verb} {rel}: {len(lines)} lines")
        copied += 1
    return copied


# the files that say a run finished: results/smollm2/<folder>/<file> -> <runs>/<where>, by the
# folder names collect.py gives (the oracle's first: "oracle-T0.7" would also read as an arm's)
FINISHED = [(r"determinism", [("determinism.json", "determinism/determinism.json")]),
            (r"oracle-T(?P<t>[0-9.]+)", [("oracle.json", "oracle/T{t}/oracle.json")]),
            (r"(?P<arm>[\w.-]+)-T(?P<t>[0-9.]+)-speed", [("summary.json", "speed/{arm}-T{t}/summary.json")]),
            (r"(?P<arm>[\w.-]+?)-B(?P<b>[0-9]+(-V[0-9]+)?)", [("summary.json", "blocks/{arm}-B{b}/summary.json")]),
            (r"(?P<arm>[\w.-]+)-T(?P<t>[0-9.]+)", [("summary.json", "accept/{arm}-T{t}/summary.json"),
                                                  ("calibration_calibration.json",
                                                   "accept/{arm}-T{t}/calibration/calibration.json")])]


def restore_finished(results, runs, store, oracle_block=None) -> int:
    """Puts back the finishing files of finished runs, but not those of a run that another
    drafter made (by the file's own settings or its run's kept records in `store`), nor the
    oracle's made at another block than `oracle_block`."""
    restored = 0
    for name in sorted(os.listdir(results)):
        for pattern, files in FINISHED:
            fields = re.fullmatch(pattern, name)
            if fields is None:
                continue
            for src_name, dst_pattern in files:
                src = os.path.join(results, name, src_name)
                dst = os.path.join(runs, dst_pattern.format(**fields.groupdict()))
                if os.path.isfile(src) and not os.path.exists(dst):
                    rel = os.path.relpath(dst, runs)
                    # the file, the other files collect.py kept of its run, and the run's kept records
                    evidence = [src, *sorted(glob.glob(os.path.join(results, name, "*.json"))),
                                *sorted(glob.glob(os.path.join(store, os.path.dirname(rel), "*.jsonl")))]
                    why = next(filter(None, (made_elsewhere(path, oracle_block) for path in evidence)), None)
                    if why:
                        print(f"not restored {rel} (a finished run): {why}")
                        continue
                    os.makedirs(os.path.dirname(dst), exist_ok=True)
                    shutil.copyfile(src, dst)
                    print(f"restored {os.path.relpath(dst, runs)} (a finished run)")
                    restored += 1
            break
    return restored


def commit(store) -> None:
    """Commits `store` alone (whatever else is staged stays staged), saying how far the runs got."""
    records = sum(len(complete_lines(p)) for p in glob.glob(os.path.join(store, "**", "*.jsonl"), recursive=True))
    git = ["git", "-C", store]
    subprocess.run(git + ["add", "."], check=True)
    message = f"Evaluation records checkpoint ({records} records saved in all)"
    result = subprocess.run(git + ["commit", "-q", "-m", message, "--", "."], capture_output=True, text=True)
    print(message if result.returncode == 0 else f"not committed: {result.stdout or result.stderr}".strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("save", "restore"))
    parser.add_argument("--runs", required=True, help="eval.sh's OUT")
    parser.add_argument("--results", default=RESULTS, help="the results folder (default: results/smollm2)")
    parser.add_argument("--commit", action="store_true",
                        help="save: also commit the records folder (only it) in the repository holding it")
    parser.add_argument("--oracle-block", type=int, default=None,
                        help="restore: leave out the oracle's runs and records made at another block")
    args = parser.parse_args()
    store = os.path.join(args.results, "records")
    if args.action == "save":
        if not os.path.isdir(args.runs):
            parser.error(f"--runs: no directory {args.runs}")
        n = mirror(args.runs, store, "saved")
        print(f"{n} records files saved into {os.path.relpath(store)}")
        if args.commit and n:
            commit(store)
    else:
        os.makedirs(args.runs, exist_ok=True)
        n = restore_finished(args.results, args.runs, store, args.oracle_block) if os.path.isdir(args.results) else 0
        n += (mirror(store, args.runs, "restored", check_drafter=True, oracle_block=args.oracle_block)
              if os.path.isdir(store) else 0)
        print(f"{n} files restored into {args.runs}")


if __name__ == "__main__":
    main()
