"""What the adaptive controller costs on a fresh machine (issue 61): every figure with an empty
cost cache, against the target alone generated the same way, in one process.

- batch: `generate_batch` of --batch prompts at --batch-tokens new tokens, cold (empty cache:
  the controller learns the costs from the cycles it runs) and warm (the same call again, from
  what the first one cached), each against `generate_autoregressive_batch` timed warm;
- single: `generate` of one prompt at --single-tokens (the demo's trie settings), cold then warm,
  and the seconds the cold call adds;
- full: for reference, how long measuring the whole table first (`prepare`, what every first
  call did before) takes at the batch size.
Run it on idle cores:

    OMP_NUM_THREADS=2 python recipes/smollm2/measure/cold_start.py --out results/smollm2/cold_start
"""
import argparse
import json
import os
import statistics
import tempfile
import time
from datetime import datetime, timezone

import torch

from dblast_ext import load_drafter
from dblast_ext.decoding.adaptive import machine_description
from dblast_ext.decoding.decoder import SamplingParams, SpeculativeDecoder
from dblast_ext.drafting.embedded_drafters import resolve_drafter
from dblast_ext.eval.datasets import load_dataset_list
from dblast_ext.decoding.fastest_settings import cpu_has_native_bf16, fastest_exact_settings
from dblast_ext.target.loading import encode_messages, load_target, stop_token_ids


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - start


def tokens(outs):
    return sum(len(o.token_ids) for o in outs)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", default="dblast-k4")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--batch-tokens", type=int, default=48)
    p.add_argument("--single-tokens", type=int, default=256)
    p.add_argument("--dtype", default="float32", help="the batch figures' dtype (the single figures use the "
                   "demo's fastest settings)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3, help="rounds, each from an empty cache (medians reported)")
    p.add_argument("--full", action="store_true", help="also time measuring the whole table (minutes)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    os.environ["DBLAST_COST_CACHE"] = tempfile.mkdtemp(prefix="dblast-costs-")  # a fresh machine's empty cache
    sampling = SamplingParams(args.temperature, 20, 0.95)
    prompts_text = load_dataset_list("gsm8k,mtbench", limit=args.batch)
    summary = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine_description(),
               "native_bf16": cpu_has_native_bf16(), "threads": torch.get_num_threads(), "args": vars(args)}

    # the batch
    target, tokenizer = load_target("default", device="cpu", dtype=args.dtype, progress=False)
    drafter = load_drafter(resolve_drafter(args.drafter), target=target).to(dtype=target.dtype).eval()
    decoder = SpeculativeDecoder(target, drafter)
    stops = stop_token_ids(target, tokenizer)
    prompts = [encode_messages(tokenizer, [{"role": "user", "content": q.turns[0]}]) for q in prompts_text]
    prompts = prompts[: args.batch]
    seeds = list(range(len(prompts)))
    kwargs = dict(max_new_tokens=args.batch_tokens, stop_token_ids=stops, seeds=seeds)
    decoder.generate_autoregressive_batch(prompts, sampling, **kwargs)  # warm the target alone's shapes
    drafting = lambda outs: sum(c.drafts > 0 for c in outs[0].cycles)  # noqa: E731 (cycles are the batch's)
    rounds = []
    for _ in range(args.repeats):  # each round from an empty cache, between two runs of the target alone
        os.environ["DBLAST_COST_CACHE"] = tempfile.mkdtemp(prefix="dblast-costs-")
        alone, t_alone = timed(decoder.generate_autoregressive_batch, prompts, sampling, **kwargs)
        cold, t_cold = timed(decoder.generate_batch, prompts, sampling, **kwargs)
        warm, t_warm = timed(decoder.generate_batch, prompts, sampling, **kwargs)
        alone2, t_alone2 = timed(decoder.generate_autoregressive_batch, prompts, sampling, **kwargs)
        rate_alone = (tokens(alone) + tokens(alone2)) / (t_alone + t_alone2)
        rounds.append({"target_alone_tok_s": rate_alone, "cold_speedup": tokens(cold) / t_cold / rate_alone,
                       "cold_seconds": t_cold, "cold_drafting_cycles": drafting(cold), "cold_cycles": len(cold[0].cycles),
                       "warm_speedup": tokens(warm) / t_warm / rate_alone, "warm_drafting_cycles": drafting(warm),
                       "warm_cycles": len(warm[0].cycles)})
        print(json.dumps(rounds[-1]), flush=True)
    summary["batch"] = {"rows": len(prompts), "rounds": rounds,
                        "cold_speedup_median": statistics.median(r["cold_speedup"] for r in rounds),
                        "warm_speedup_median": statistics.median(r["warm_speedup"] for r in rounds)}
    print(json.dumps({k: v for k, v in summary["batch"].items() if k != "rounds"}), flush=True)
    if args.full:
        os.environ["DBLAST_COST_CACHE"] = tempfile.mkdtemp(prefix="dblast-costs-")
        from dblast_ext.decoding import cost_calibration

        cost_calibration._LOADED.clear()
        _, t_full = timed(decoder.prepare, len(prompts))
        summary["batch"]["full_table_seconds"] = t_full
        print(f"measuring the whole table first: {t_full:.1f} s", flush=True)

    # one prompt at the demo's settings
    os.environ["DBLAST_COST_CACHE"] = tempfile.mkdtemp(prefix="dblast-costs-")
    settings = fastest_exact_settings("cpu", args.drafter)
    target, tokenizer = load_target("default", device="cpu", dtype=settings.dtype, progress=False)
    drafter = load_drafter(resolve_drafter(args.drafter), target=target).to(dtype=target.dtype).eval()
    drafter.config.block_size = settings.block_size or drafter.config.block_size
    decoder = SpeculativeDecoder(target, drafter, draft_vocab=settings.draft_vocab, verify=settings.verify,
                                 max_tree_nodes=settings.max_tree_nodes)
    prompt = prompts[0]
    one = dict(max_new_tokens=args.single_tokens, stop_token_ids=[], seed=0)
    decoder.generate_autoregressive(prompt, sampling, max_new_tokens=8)
    rounds = []
    for _ in range(args.repeats):
        os.environ["DBLAST_COST_CACHE"] = tempfile.mkdtemp(prefix="dblast-costs-")
        alone, t_alone = timed(decoder.generate_autoregressive, prompt, sampling, **one)
        cold, t_cold = timed(decoder.generate, prompt, sampling, **one)
        warm, t_warm = timed(decoder.generate, prompt, sampling, **one)
        rounds.append({
            "target_alone_s": t_alone, "cold_s": t_cold, "warm_s": t_warm, "cold_adds_s": t_cold - t_warm,
            "cold_speedup": t_alone / t_cold * len(cold.token_ids) / len(alone.token_ids),
            "warm_speedup": t_alone / t_warm * len(warm.token_ids) / len(alone.token_ids),
            "cold_drafting_cycles": sum(c.drafts > 0 for c in cold.cycles), "cold_cycles": len(cold.cycles),
            "warm_drafting_cycles": sum(c.drafts > 0 for c in warm.cycles), "warm_cycles": len(warm.cycles)})
        print(json.dumps(rounds[-1]), flush=True)
    summary["single"] = {"dtype": settings.dtype, "verify": settings.verify, "rounds": rounds,
                         "cold_adds_s_median": statistics.median(r["cold_adds_s"] for r in rounds),
                         "cold_speedup_median": statistics.median(r["cold_speedup"] for r in rounds),
                         "warm_speedup_median": statistics.median(r["warm_speedup"] for r in rounds)}
    print(json.dumps({k: v for k, v in summary["single"].items() if k != "rounds"}), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
