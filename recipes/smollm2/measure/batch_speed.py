"""Tokens per second of batched speculative sampling on the embedded pair against the target
alone batched the same way (`SpeculativeDecoder.generate_batch` against
`generate_autoregressive_batch`: the same left-padded cache, the same per-prompt seeds and
filter), at several batch sizes, with each of the loop's target caches (`--target-caches`:
"dynamic", compacted after each cycle, and "static", fixed slots; dblast_ext.target.slot_cache) and each
drafting controller (`--controllers`: "adaptive", the default, and "off", every cycle verifying
the whole block; dblast_ext.decoding.adaptive), side by side in one process. Every batch is generated
twice by each engine and the second, warm run timed. Run it on idle cores.

    OMP_NUM_THREADS=2 python recipes/smollm2/measure/batch_speed.py --out results/smollm2/batch

Writes summary.json and README.md (the table, the machine and the date) under --out.
"""
import argparse
import json
import os
import platform
import time
from datetime import datetime, timezone

import torch

from dblast_ext import load_drafter
from dblast_ext.decoding.adaptive import CONTROLLERS
from dblast_ext.decoding.decoder import TARGET_CACHES, SamplingParams, SpeculativeDecoder
from dblast_ext.drafting.embedded_drafters import resolve_drafter
from dblast_ext.eval.datasets import load_dataset_list
from dblast_ext.target.loading import encode_messages, load_target, stop_token_ids


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", default="dblast-k4")
    p.add_argument("--datasets", default="gsm8k,mtbench", help="the first turns of these prompts")
    p.add_argument("--num-prompts", type=int, default=8, help="per dataset")
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=20)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--block-size", type=int, default=None, help="inference block (default: the drafter's)")
    p.add_argument("--draft-vocab", type=int, default=None, help="draft from the first N token ids")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--target-caches", default="dynamic", help="comma-separated: dynamic, static")
    p.add_argument("--controllers", default="adaptive", help="comma-separated: adaptive, off")
    p.add_argument("--out", required=True)
    return p.parse_args()


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    outs = fn(*args, **kwargs)
    return outs, time.perf_counter() - start


def main():
    args = parse_args()
    if set(args.target_caches.split(",")) - set(TARGET_CACHES):
        raise SystemExit(f"--target-caches: comma-separated {', '.join(TARGET_CACHES)}; got {args.target_caches!r}")
    target, tokenizer = load_target("default", device="cpu", dtype=args.dtype, progress=False)
    drafter = load_drafter(resolve_drafter(args.drafter), target=target).to(dtype=target.dtype).eval()
    if args.block_size:
        drafter.config.block_size = args.block_size
    decoder = SpeculativeDecoder(target, drafter, draft_vocab=args.draft_vocab)
    caches = args.target_caches.split(",")
    controllers = args.controllers.split(",")
    if set(controllers) - set(CONTROLLERS):
        raise SystemExit(f"--controllers: comma-separated {', '.join(CONTROLLERS)}; got {args.controllers!r}")
    batches = [int(b) for b in args.batches.split(",")]
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
    stops = stop_token_ids(target, tokenizer)
    prompts = [encode_messages(tokenizer, [{"role": "user", "content": p.turns[0]}])
               for p in load_dataset_list(args.datasets, limit=args.num_prompts)]
    seeds = list(range(len(prompts)))
    for cache in caches:
        decoder.target_cache = cache
        for controller in controllers:
            decoder.controller = controller
            decoder.prepare(max(batches))  # the adaptive controller's cost table: measured now, not in a timed run
            decoder.warm_up(prompts[0], sampling, stop_token_ids=stops, target_only=cache == caches[0])
    runs = [("-".join(["speculative"] + ([cache] if len(caches) > 1 else []) + ([controller] if len(controllers) > 1
                                                                                else [])), (cache, controller))
            for cache in caches for controller in controllers]
    runs.append(("target", None))
    rows = []
    for batch in batches:
        figures = {"batch": batch}
        for name, cache in runs:
            decoder.target_cache = cache[0] if cache else "dynamic"
            decoder.controller = cache[1] if cache else "off"
            run = decoder.generate_batch if cache else decoder.generate_autoregressive_batch
            tokens = seconds = passes = drafted = 0
            for first in range(0, len(prompts), batch):
                chunk = (prompts[first:first + batch], sampling, args.max_new_tokens, stops)
                # each batch is generated twice and the second run timed: a CPU builds its kernels once
                # for every new (rows, cache length) shape, and whichever engine ran a batch first would
                # pay for shapes the others reuse (2026-12-05: a cold pass at batch 16 took 1.6x a warm
                # one); with the same seeds the second run repeats the first token for token
                run(*chunk, seeds=seeds[first:first + batch])
                outs, wall = timed(run, *chunk, seeds=seeds[first:first + batch])
                tokens += sum(len(o.token_ids) for o in outs)
                seconds += wall
                passes += max(len(o.cycles) for o in outs) if cache else 0
                drafted += max(sum(1 for c in o.cycles if c.drafts) for o in outs) if cache else 0
            figures[name] = {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_second": tokens / seconds}
            if cache:
                figures[name]["cycles"] = passes
                figures[name]["drafting_cycles"] = drafted
        for name, cache in runs[:-1]:
            figures[name]["speedup"] = figures[name]["tokens_per_second"] / figures["target"]["tokens_per_second"]
        print(json.dumps(figures), flush=True)
        rows.append(figures)
    machine = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"machine": machine, "date": date, "settings": settings, "prompts": len(prompts), "rows": rows},
                  f, indent=2)
    lines = [f"# Batched speculative sampling on the embedded pair ({date})", "",
             f"Machine: {machine}. Settings: {json.dumps(settings)}; {len(prompts)} prompts, seeds 0..{len(prompts) - 1}, "
             "each batch size running the same prompts in consecutive batches. Produced by "
             "`recipes/smollm2/measure/batch_speed.py`.", "",
             "| batch | " + " | ".join(f"{name} tok/s (speed-up)" for name, _ in runs[:-1]) + " | target alone tok/s |",
             "| ---: |" + " ---: |" * len(runs)]
    lines += [f"| {r['batch']} | " + " | ".join(f"{r[name]['tokens_per_second']:.1f} ({r[name]['speedup']:.2f}x)"
                                                for name, _ in runs[:-1])
              + f" | {r['target']['tokens_per_second']:.1f} |" for r in rows]
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
