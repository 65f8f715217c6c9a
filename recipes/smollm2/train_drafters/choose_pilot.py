"""Chooses the drafter size and training block of the SmolLM2 recipe (train.sh) from its pilot
runs' held-out measurements, and says why in a table.

Each pilot is a base drafter (K = 1, NLL) trained for the same number of steps on the same data;
its eval_log.jsonl holds, per checkpoint, the top-1 agreement with the target's argmax at every
block position (teacher-forced, held-out split). Pilots of different blocks are compared on the
draft positions they all have (1 .. n, n = 7 when the smallest block is 8), by the greedy
accepted length those agreements imply if each position is accepted independently:

    estimated tau = sum_{k=1..n} prod_{j<=k} agreement_j

The pilot with the highest estimate at its best checkpoint wins; one within TIE (relative) of
it with fewer layers (a cheaper drafter pass) or, next, the smaller block is preferred.

    python recipes/smollm2/train_drafters/choose_pilot.py --pilot L2-B8=runs/smollm2/pilot-L2-B8 ... --out choice.json
"""
import argparse
import json
import os
import sys

TIE = 0.02    # a relative margin within which the cheaper pilot is preferred


def estimated_tau(agreement, positions: int) -> float:
    """sum over k of the product of the first k positions' agreements (a missing position counts 0)."""
    total, survive = 0.0, 1.0
    for k in range(positions):
        a = agreement[k] if k < len(agreement) and agreement[k] is not None else 0.0
        survive *= a
        total += survive
    return total


def read_pilot(folder: str) -> list:
    """The pilot's held-out checkpoints that logged top-1 agreement, in order."""
    path = os.path.join(folder, "eval_log.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder}: no eval_log.jsonl (did the pilot run with eval_data?)")
    with open(path) as f:
        entries = [json.loads(line) for line in f if line.strip()]
    entries = [e for e in entries if e.get("top1_agreement")]
    if not entries:
        raise ValueError(f"{path}: no checkpoint logged top1_agreement")
    return entries


def best_checkpoint(entries: list, positions: int) -> dict:
    """The checkpoint with the highest estimate: step, held-out loss, agreements, estimate."""
    best = max(entries, key=lambda e: estimated_tau(e["top1_agreement"], positions))
    return {"step": best["step"], "loss": best["loss"], "top1_agreement": best["top1_agreement"],
            "estimated_tau": estimated_tau(best["top1_agreement"], positions)}


def shared_positions(logs: dict) -> int:
    """The draft positions every pilot's checkpoints have."""
    return min(len(e["top1_agreement"]) for entries in logs.values() for e in entries)


def parse_name(name: str):
    """'L2-B8' -> (2 layers, block 8)."""
    try:
        layers, block = name.split("-")
        assert layers[0] == "L" and block[0] == "B"
        return int(layers[1:]), int(block[1:])
    except (ValueError, AssertionError, IndexError):
        raise ValueError(f"a pilot is named L<layers>-B<block> (e.g. L2-B8), got {name!r}") from None


def choose(pilots: dict) -> str:
    """The winning pilot's name: the highest estimate, cheaper pilots winning ties within TIE."""
    top = max(p["estimated_tau"] for p in pilots.values())
    close = [name for name, p in pilots.items() if p["estimated_tau"] >= top * (1 - TIE)]
    return min(close, key=lambda name: (*parse_name(name), -pilots[name]["estimated_tau"]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pilot", action="append", required=True, metavar="NAME=FOLDER",
                        help="a pilot run: L<layers>-B<block>=its output folder (repeat)")
    parser.add_argument("--out", required=True, help="JSON file for the choice (layers, block, the table)")
    args = parser.parse_args()
    logs = {}
    for spec in args.pilot:
        name, sep, folder = spec.partition("=")
        if not sep:
            parser.error(f"--pilot takes NAME=FOLDER, got {spec!r}")
        try:
            parse_name(name)
        except ValueError as e:
            parser.error(f"--pilot: {e}")
        logs[name] = read_pilot(folder)
    positions = shared_positions(logs)
    pilots = {name: best_checkpoint(entries, positions) for name, entries in logs.items()}
    winner = choose(pilots)
    print(f"| pilot | best step | held-out loss | top-1 agreement, positions 1-{positions} | estimated tau |")
    print("| --- | ---: | ---: | --- | ---: |")
    for name, p in sorted(pilots.items(), key=lambda item: parse_name(item[0])):
        shown = " ".join(f"{a:.2f}" for a in p["top1_agreement"][:positions])
        mark = " (chosen)" if name == winner else ""
        print(f"| {name}{mark} | {p['step']} | {p['loss']:.2f} | {shown} | {p['estimated_tau']:.3f} |")
    layers, block = parse_name(winner)
    with open(args.out, "w") as f:
        json.dump({"layers": layers, "block": block, "pilot": winner, "positions": positions, "pilots": pilots}, f,
                  indent=1)
    print(f"chosen: {layers} layers, block {block}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
