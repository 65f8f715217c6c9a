"""Would pausing drafting where it does not pay make the loop faster? A replay of the speed
phase's records (results/smollm2/records/speed/<drafter>-T<t>/records.jsonl) under a cost model:
a cycle costs `--cycle-cost` target-only steps (`dblast demo` prints it: 1.33-1.34 for dblast-k4
at the CPU defaults) and commits 1 + accepted tokens; a target-only step costs 1 and commits 1.

The rule replayed: a moving average (weight `--weight`) of each cycle's expected accepted
drafts; while it is below break-even (cycle cost - 1), `--pause` target-only steps replace the
cycles that committed as many tokens, then one cycle probes again. (Exact whatever the rule, as
long as it reads only the past; the replay ignores that the texts would differ.)

    python recipes/smollm2/measure/fallback_simulation.py results/smollm2/records/speed/dblast-k4-T1.5/records.jsonl

On 2026-12-05 (dblast-k4, cycle cost 1.34) it gave, per dataset, the mean over responses of the
modelled speed-up without / with the pause: T 1.5: GSM8K 1.121 / 1.094, MT-Bench 0.996 / 1.000,
HumanEval 1.120 / 1.073, MATH-500 1.061 / 1.060; T 1.0: 1.574 / 1.534, 1.103 / 1.043, 1.359 /
1.290, 1.367 / 1.312. Acceptance comes in bursts that a moving average cannot see coming, so
the pause loses more than it saves; it was not built.
"""
import argparse
import json
import statistics


def replay(accepted, expected, cycle_cost: float, weight: float, pause: int):
    """(tokens, time in target-only steps) of one response under the pause rule."""
    average, tokens, time, i = None, 0, 0.0, 0
    while i < len(accepted):
        if average is not None and average < cycle_cost - 1:
            paused = 0  # target-only steps, standing in for the cycles that committed as many tokens
            while i < len(accepted) and paused < pause:
                paused += 1 + accepted[i]
                i += 1
            tokens, time = tokens + paused, time + paused
            if i == len(accepted):
                break
        tokens, time = tokens + 1 + accepted[i], time + cycle_cost
        average = expected[i] if average is None else (1 - weight) * average + weight * expected[i]
        i += 1
    return tokens, time


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("records")
    p.add_argument("--cycle-cost", type=float, default=1.34)
    p.add_argument("--weight", type=float, default=0.25)
    p.add_argument("--pause", type=int, default=8)
    args = p.parse_args()
    by_dataset = {}
    with open(args.records) as f:
        for line in f:
            record = json.loads(line)
            accepted, expected = record["accepted"], record["expected_accepted"]
            plain = sum(1 + a for a in accepted) / (len(accepted) * args.cycle_cost)
            tokens, time = replay(accepted, expected, args.cycle_cost, args.weight, args.pause)
            by_dataset.setdefault(record["dataset"], []).append((plain, tokens / time))
    for dataset, rows in by_dataset.items():
        print(f"{dataset}: modelled speed-up {statistics.mean(r[0] for r in rows):.3f} drafting every cycle, "
              f"{statistics.mean(r[1] for r in rows):.3f} with the pause ({len(rows)} responses)")


if __name__ == "__main__":
    main()
