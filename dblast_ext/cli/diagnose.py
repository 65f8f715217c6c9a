"""`dblast diagnose`: the checks that tell where a drafter's acceptance is limited.

  ceiling RUN [RUN ...]      the preflight check: acceptance histogram and ceiling fraction
                             per dataset of finished `dblast eval` runs (DBloom §4.1)
  expansion                  naive block expansion: the drafter run at its trained block and
                             at --block-size, decomposed into uncapped gain G and front
                             erosion L (DBloom Eq 4-5, Table 10)
  determinism                expected accepted length at truncation points of target
                             responses, binned by target-block early determinism (DBLast
                             Eq 22-24, Figure 1)
  oracle                     the committed length of a drafter that always drafts the
                             target's most likely token: a drafter-free reference point for
                             one-branch greedy drafting on this target and filter
"""
import argparse
import json
import os
import sys

from ..target.adapter import TargetAdapter
from ..drafting.drafter_io import checkpoint_digest
from ..eval.determinism import Baseline, determinism_study, determinism_table
from ..eval.expansion import expansion_study, expansion_table
from ..eval.metrics import first_draft_accepted
from ..eval.oracle import oracle_records, summarize_oracle
from ..eval.records import read_run_records
from ..eval.report import PLOTS_SKIPPED, plot_histograms, summarize_run
from ..target.loading import default_device, load_target, stop_token_ids
from .common import (add_category_temperature_arg, add_model_args, add_sampling_args, add_target_args, check_args,
                     check_sampling_args, check_target_args, load_decoder, load_second_decoder, read_checkpoint_config,
                     sampling_of)
from .display import acceptance_histogram
from .evaluate import add_eval_args, check_batch_size_arg, load_all_prompts, model_name, run_spec


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("diagnose", help="ceiling bin, block expansion and early-determinism diagnostics",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    kinds = p.add_subparsers(dest="kind", metavar="KIND", required=True)
    c = kinds.add_parser("ceiling", help="histogram and ceiling fraction per dataset of eval runs",
                         description="Print, for each dataset of finished `dblast eval` runs, the acceptance "
                                     "histogram and the ceiling fraction (cycles that accepted every draft, "
                                     "n = b = B - 1): a large one means the block horizon clips acceptance "
                                     "(DBloom §4.1). Reads the runs only; writes nothing.")
    c.add_argument("runs", nargs="+", help="`dblast eval` output directories (or records.jsonl files)")
    c.add_argument("--all-responses", action="store_true", help="also count responses that did not end with EOS")
    e = kinds.add_parser("expansion", help="G / L decomposition of running a drafter at a larger block",
                         description="Run the drafter at its trained block and at the wider --block-size on the "
                                     "same prompts and decompose the change in mean accepted drafts into uncapped "
                                     "gain G and front erosion L (DBloom Eq 4-5, Table 10). Writes "
                                     "records_block<B>.jsonl for both blocks (rerunning with the same --out "
                                     "resumes them), expansion.json and expansion.md into --out.")
    add_model_args(e, block_size=False)
    e.add_argument("--block-size", type=int, required=True,
                   help="the wider block B to run the drafter at, larger than the block it was trained at (e.g. 24)")
    add_sampling_args(e, temperature=0.0)
    add_eval_args(e, measure_speedup=False)  # acceptance only, nothing timed
    add_category_temperature_arg(e)
    d = kinds.add_parser("determinism", help="accepted length binned by target-block early determinism",
                         description="Sample the target's own responses (first turns), truncate them at "
                                     "--truncations random points, and at each point measure the target block's "
                                     "early determinism (from --samples sampled target blocks) and the expected "
                                     "accepted length of the drafter's first cycle; report the mean per "
                                     "determinism bin (DBLast Eq 22-24, Figure 1). Writes determinism.json "
                                     "(settings, bins, points), determinism.md and determinism.png into --out, "
                                     "and keeps the target responses and each point as it is done "
                                     "(responses.jsonl, points.jsonl): rerunning with the same --out resumes, "
                                     "a larger --truncations adds points.")
    add_model_args(d)
    add_sampling_args(d)
    # the expected accepted length of one first cycle per point: nothing timed, no EOS filter
    add_eval_args(d, measure_speedup=False, all_responses=False, batch_size=False)
    add_category_temperature_arg(d)
    d.add_argument("--truncations", type=int, default=200,
                   help="truncation points sampled over the responses (default %(default)s)")
    d.add_argument("--samples", type=int, default=20,
                   help="M, target blocks sampled per truncation point (default %(default)s)")
    d.add_argument("--baseline", metavar="DRAFTER",
                   help="a second drafter (a checkpoint directory or an embedded name, e.g. dflash-k1) measured at "
                        "the same truncation points with the same random numbers, as DBLast Figure 1 compares its "
                        "arms: the table, plot and determinism.json show both per bin and the drafter's relative "
                        "gain; kept as baseline_points.jsonl (resumable, and added to a run made without it)")
    o = kinds.add_parser("oracle", help="committed length of an always-the-top-token drafter (no drafter needed)",
                         description="The committed length of a drafter that always drafts the target's most "
                                     "likely token, read off the target's own responses to the first turn of "
                                     "each prompt (no drafter needed): a drafter-free reference for one-branch "
                                     "greedy drafting on this target and filter. Writes records.jsonl (rerunning "
                                     "with the same --out resumes), oracle.json, oracle.md and "
                                     "histogram_<dataset>.png into --out.")
    add_target_args(o)
    o.add_argument("--block-size", type=int, default=16,
                   help="B: the oracle drafts B - 1 tokens per cycle (default %(default)s)")
    add_sampling_args(o)
    add_eval_args(o, measure_speedup=False, batch_size=False)  # the oracle is never timed


def run(args) -> int:
    return {"ceiling": run_ceiling, "expansion": run_expansion, "determinism": run_determinism,
            "oracle": run_oracle}[args.kind](args)


def run_ceiling(args) -> int:
    print("| run | dataset | block | cycles | mean n | ceiling fraction (n = b = B - 1) |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    histograms, skipped = [], []
    for run_dir in args.runs:
        result = summarize_run(read_run_records(run_dir), eos_only=not args.all_responses, n_boot=1)
        for name, s in sorted(result["datasets"].items()):
            print(f"| {run_dir} | {name} | {s['block_size']} | {s['n_cycles']} | {s['cycle_mean'] - 1:.2f} | "
                  f"{100 * s['ceiling_fraction']:.1f}% |")
            histograms.append((run_dir, name, s))
        skipped += [(run_dir, name, why) for name, why in sorted(result["skipped"].items())]
    for run_dir, name, why in skipped:
        print(f"\n{run_dir} / {name}: not summarised: {why}")
    for run_dir, name, s in histograms:
        print(f"\n{run_dir} / {name}:")
        print(acceptance_histogram(s["histogram"]))
    print("\nA large ceiling fraction means the block horizon clips acceptance: a drafter trained at a larger "
          "block can recover it (DBloom §4.1).")
    return 0


def run_expansion(args) -> int:
    trained = check_args(args).block_size
    check_batch_size_arg(args)
    wider = args.block_size
    if wider <= trained:
        raise ValueError(f"--block-size {wider} must exceed the drafter's trained block size {trained}")
    prompts = load_all_prompts(args)
    os.makedirs(args.out, exist_ok=True)
    args.block_size = None  # load the drafter at its trained block size
    decoder, tokenizer = load_decoder(args, args.category_temperature)
    result = expansion_study(decoder, tokenizer, prompts, args.out, run_spec(args),
                             category_temperature=args.category_temperature, trained=trained, wider=wider,
                             eos_only=not args.all_responses)
    table = expansion_table(result)
    with open(os.path.join(args.out, "expansion.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    return 0


def run_determinism(args) -> int:
    config = check_args(args)
    if args.truncations <= 0 or args.samples <= 0:
        raise ValueError("--truncations and --samples must be > 0")
    if args.baseline is not None and args.block_size is None:
        # the points' determinism is over the drafter's b tokens: both arms must draft b
        trained = read_checkpoint_config(args.baseline, "--baseline").block_size
        if trained != config.block_size:
            raise ValueError(f"--baseline: its block size {trained} differs from the drafter's {config.block_size} "
                             "(pass --block-size to run both at one)")
    prompts = load_all_prompts(args)
    os.makedirs(args.out, exist_ok=True)
    decoder, tokenizer = load_decoder(args, args.category_temperature)
    baseline = None
    if args.baseline is not None:
        baseline = Baseline(load_second_decoder(args, decoder, args.baseline, args.category_temperature),
                            drafter_label(args.baseline), model_name(args.baseline), checkpoint_digest(args.baseline))
    # what the responses and points depend on (not --truncations: a larger one extends a run)
    _, arms, gains = determinism_study(
        decoder, tokenizer, prompts, args.out, run_spec(args), category_temperature=args.category_temperature,
        truncations=args.truncations, samples=args.samples, label=drafter_label(args.drafter),
        settings_extra=dict(datasets=args.datasets, num_prompts=args.num_prompts, samples=args.samples),
        baseline=baseline, arguments=vars(args) | {"out": args.out})
    table = determinism_table(arms, gains)
    with open(os.path.join(args.out, "determinism.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    return 0


def drafter_label(path: str) -> str:
    """A drafter's name in tables and legends: the embedded name, or its directory's."""
    return os.path.basename(os.path.normpath(model_name(path)))


def run_oracle(args) -> int:
    check_sampling_args(args)
    if args.block_size < 2:
        raise ValueError(f"--block-size must be >= 2, got {args.block_size}")
    check_target_args(args)
    prompts = load_all_prompts(args)
    os.makedirs(args.out, exist_ok=True)
    model, tokenizer = load_target(args.target, device=args.device or default_device(), dtype=args.dtype,
                                   progress=not args.no_progress)
    settings = {"target": model_name(args.target), "oracle": "top token", "temperature": args.temperature,
                "top_p": args.top_p, "top_k": args.top_k, "block_size": args.block_size,
                "max_new_tokens": args.max_new_tokens, "seed": args.seed}
    records = oracle_records(TargetAdapter(model, []), tokenizer, prompts, os.path.join(args.out, "records.jsonl"),
                             sampling=sampling_of(args), block_size=args.block_size,
                             max_new_tokens=args.max_new_tokens, seed=args.seed,
                             stop_token_ids=stop_token_ids(model, tokenizer), settings=settings,
                             progress=not args.no_progress)
    result = summarize_oracle(records, eos_only=not args.all_responses)
    try:
        plot_histograms(args.out, result["datasets"], ", top-token oracle")
    except ImportError:
        print(PLOTS_SKIPPED, file=sys.stderr)
    with open(os.path.join(args.out, "oracle.json"), "w") as f:
        json.dump(dict(result, settings=settings), f, indent=2)
    lines = [f"Top-token oracle (a drafter that always drafts the target's most likely token), block "
             f"{args.block_size}, temperature {args.temperature}, top-p {args.top_p}, top-k {args.top_k}; "
             "first turns; the top-token probability is pooled over tokens.", "",
             "| dataset | tau [95% CI] | cycle mean | first draft accepted | ceiling | mean top-token probability | "
             "prompts (EOS / responses) |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, s in result["datasets"].items():
        top = "-" if s["top_probability"] is None else f"{s['top_probability']:.3f}"
        lines.append(f"| {name} | {s['tau']:.2f} [{s['tau_ci'][0]:.2f}, {s['tau_ci'][1]:.2f}] | {s['cycle_mean']:.2f} | "
                     f"{100 * first_draft_accepted(s):.1f}% | {100 * s['ceiling_fraction']:.1f}% | {top} | {s['n_prompts']} "
                     f"({s['n_eos_terminated']} / {s['n_responses']}) |")
    for name, reason in result["skipped"].items():
        lines.append(f"| {name} | not summarised: {reason} | | | | | |")
    table = "\n".join(lines)
    with open(os.path.join(args.out, "oracle.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    return 0
