"""How often greedy speculative decoding on the embedded pair gives exactly the target's own greedy
output (transformers' `generate(do_sample=False)`, one token per step), in each dtype, at the CPU
defaults (dblast-k4, trie verification, block 8, 8,192 draft ids, the adaptive controller): the
share of prompts whose responses are identical, of tokens before the first difference, and the
logit gap of the two tokens at each first difference (recomputed with one-token steps, in the
run's dtype). Also what float32 (the equality mode) costs: tokens per second of each dtype,
speculative and target alone, timed in turn in one process.

    OMP_NUM_THREADS=2 python recipes/smollm2/measure/greedy_equality.py --out results/smollm2/greedy_equality

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
from dblast_ext.decoding.decoder import SamplingParams, SpeculativeDecoder
from dblast_ext.drafting.embedded_drafters import resolve_drafter
from dblast_ext.eval.datasets import load_dataset_list
from dblast_ext.decoding.fastest_settings import fastest_exact_settings
from dblast_ext.target.loading import encode_messages, load_target, stop_token_ids


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", default="dblast-k4")
    p.add_argument("--datasets", default="mtbench", help="the first turns of these prompts (chat)")
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--out", required=True)
    return p.parse_args()


def first_difference(a, b):
    """The first position where two responses differ (None: identical)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def logit_gap(model, prompt, response, position, ours, theirs):
    """|logit(ours) - logit(theirs)| at `position` of `response`, from one-token steps (the
    target's own greedy computation)."""
    ids = torch.tensor([prompt + response[:position]])
    with torch.inference_mode():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, -1].float()
    return abs(float(logits[ours] - logits[theirs]))


def main():
    args = parse_args()
    settings = fastest_exact_settings("cpu", args.drafter)
    greedy = SamplingParams(temperature=0.0)
    rows, speed = [], {}
    for dtype in args.dtypes.split(","):
        target, tokenizer = load_target("default", device="cpu", dtype=dtype, progress=False)
        drafter = load_drafter(resolve_drafter(args.drafter), target=target).to(dtype=target.dtype).eval()
        drafter.config.block_size = settings.block_size or drafter.config.block_size
        decoder = SpeculativeDecoder(target, drafter, draft_vocab=settings.draft_vocab, verify=settings.verify,
                                     max_tree_nodes=settings.max_tree_nodes)
        stops = stop_token_ids(target, tokenizer)
        prompts = [encode_messages(tokenizer, [{"role": "user", "content": p.turns[0]}])
                   for p in load_dataset_list(args.datasets, limit=args.num_prompts)]
        decoder.prepare(1)
        decoder.warm_up(prompts[0], greedy, stop_token_ids=stops)
        seconds = {"speculative": 0.0, "target": 0.0}
        tokens = {"speculative": 0, "target": 0}
        for index, prompt in enumerate(prompts):
            start = time.perf_counter()
            ours = decoder.generate(prompt, greedy, args.max_new_tokens, stops).token_ids
            seconds["speculative"] += time.perf_counter() - start
            tokens["speculative"] += len(ours)
            ids = torch.tensor([prompt])
            start = time.perf_counter()
            with torch.inference_mode():
                out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=args.max_new_tokens, eos_token_id=stops, pad_token_id=stops[0])
            seconds["target"] += time.perf_counter() - start
            theirs = out[0, len(prompt):].tolist()
            tokens["target"] += len(theirs)
            at = first_difference(ours, theirs)
            gap = None
            if at is not None and at < min(len(ours), len(theirs)):
                gap = logit_gap(target, prompt, theirs, at, ours[at], theirs[at])
            rows.append({"dtype": dtype, "prompt": index, "identical": at is None, "first_difference": at,
                         "tokens": len(theirs), "logit_gap": gap})
            print(json.dumps(rows[-1]), flush=True)
        speed[dtype] = {name: tokens[name] / seconds[name] for name in seconds}
        print(json.dumps({"dtype": dtype, "tokens_per_second": speed[dtype]}), flush=True)
    machine = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    summary = {}
    for dtype in args.dtypes.split(","):
        mine = [r for r in rows if r["dtype"] == dtype]
        same = sum(r["tokens"] if r["identical"] else r["first_difference"] for r in mine)
        gaps = [r["logit_gap"] for r in mine if r["logit_gap"] is not None]
        summary[dtype] = {"prompts": len(mine), "identical_prompts": sum(r["identical"] for r in mine),
                          "tokens": sum(r["tokens"] for r in mine), "tokens_before_first_difference": same,
                          "largest_logit_gap": max(gaps) if gaps else None, "tokens_per_second": speed[dtype]}
    os.makedirs(args.out, exist_ok=True)
    settings_out = {k: v for k, v in vars(args).items() if k != "out"}
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"machine": machine, "date": date, "settings": settings_out, "summary": summary, "rows": rows}, f,
                  indent=1)
    lines = [f"# Greedy output against the target's own greedy output ({date})", "",
             f"Machine: {machine}. {args.num_prompts} {args.datasets} first turns, {args.max_new_tokens} new tokens, "
             f"the CPU defaults ({args.drafter}, {settings.verify} verification, block {settings.block_size}, "
             f"{settings.draft_vocab} draft ids, the adaptive controller) against transformers' "
             "`generate(do_sample=False)` with the same model and dtype. Produced by "
             "`recipes/smollm2/measure/greedy_equality.py`.", "",
             "| dtype | identical responses | tokens before the first difference | largest logit gap at a "
             "difference | speculative tok/s | target alone tok/s |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for dtype, s in summary.items():
        gap = "-" if s["largest_logit_gap"] is None else f"{s['largest_logit_gap']:.3f}"
        lines.append(f"| {dtype} | {s['identical_prompts']} / {s['prompts']} | {s['tokens_before_first_difference']} / "
                     f"{s['tokens']} ({100 * s['tokens_before_first_difference'] / s['tokens']:.0f}%) | {gap} | "
                     f"{s['tokens_per_second']['speculative']:.1f} | {s['tokens_per_second']['target']:.1f} |")
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
