"""`dblast calibrate`: choose the category temperature Z_T on a 10% calibration split of the
given datasets (DBLast §4) and print the grid; `dblast eval --category-temperature calibrate`
does the same and then evaluates on the other 90%. `dblast calibrate --cost` instead measures
the adaptive controller's cost table (dblast_ext.decoding.cost_calibration) for the pair and settings
`dblast generate` would run, writes it to --out and to the cache the decoder reads."""
import os
import sys

from ..eval.calibration import DEFAULT_GRID, calibrate_category_temperature, parse_grid
from .common import add_model_args, add_sampling_args, check_args, load_decoder, pick_fastest_settings
from .evaluate import add_eval_args, check_batch_size_arg, check_calibration_split, load_all_prompts, run_spec


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("calibrate", help="choose the category temperature Z_T on a 10%% split",
                              description="Choose Z_T for a K > 1 drafter from a grid by macro-average expected "
                                          "accepted length (over every response) on a disjoint 10% calibration "
                                          "split (at least 2 prompts per dataset); writes zt_<Z_T>.jsonl records "
                                          "per grid value (rerunning with the same --out resumes them), "
                                          "calibration.json and calibration.png into --out.")
    add_model_args(p)
    add_sampling_args(p)
    # no timing, and the score counts every response: no --measure-speedup or --all-responses
    add_eval_args(p, measure_speedup=False, all_responses=False)
    p.add_argument("--grid", default=",".join(str(z) for z in DEFAULT_GRID),
                   help="Z_T values to try (default %(default)s)")
    p.add_argument("--cost", action="store_true",
                   help="measure the adaptive controller's cost table instead (seconds per cycle at every depth, "
                        "docs/design.md) for the settings `dblast generate` would use (the fastest exact settings "
                        "fill the flags left out); writes <out>/costs.json and the cache `dblast generate` reads")
    p.add_argument("--batch-sizes", default="1", metavar="N,N,...",
                   help="with --cost: the batch sizes to time (default %(default)s; others are interpolated)")
    p.set_defaults(verify=None)  # Z_T: branch; --cost: as `dblast generate` picks


def batch_sizes_of(text: str):
    try:
        sizes = [int(n) for n in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--batch-sizes must be comma-separated integers >= 1, got {text!r}")
    return sizes


def run_cost(args) -> int:
    from ..decoding.cost_calibration import cached_table, calibrate_costs

    sizes = batch_sizes_of(args.batch_sizes)
    args.controller = "adaptive"
    check_args(args)
    picked = pick_fastest_settings(args)
    if picked:
        print(picked, file=sys.stderr)
    decoder, _ = load_decoder(args)
    tree = decoder.verify == "tree"
    table, cache_path = cached_table(decoder)  # the cached sizes stay; the ones asked for are measured again
    calibrate_costs(decoder, [] if tree else sizes, tree=tree, table=table, progress=not args.no_progress)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "costs.json")
    table.save(path)
    table.save(cache_path)
    curves = [("trie", table.tree)] if tree else [(f"batch {n}", table.chain[n]) for n in sorted(table.chain)]
    print("| cycle | " + " | ".join(f"d={d}" for d in range(len(curves[0][1]))) + " |")
    print("| --- |" + " ---: |" * len(curves[0][1]))
    for name, costs in curves:
        print(f"| {name} (ms) | " + " | ".join(f"{1000 * c:.1f}" for c in costs) + " |")
    print(f"cost table written to {path} and to the cache the decoder reads for these settings")
    return 0


def run(args) -> int:
    if args.cost:
        return run_cost(args)
    if args.verify is None:
        args.verify = "branch"
    drafter_config = check_args(args)
    check_batch_size_arg(args)
    if drafter_config.num_branches == 1:
        raise ValueError("the drafter has one branch, so Z_T changes nothing: nothing to calibrate "
                         "(give a K > 1 drafter, or --branches K for an untrained head)")
    grid = parse_grid(args.grid)
    prompts = load_all_prompts(args)
    check_calibration_split(args, prompts)
    decoder, tokenizer = load_decoder(args)
    best, _, result = calibrate_category_temperature(decoder, tokenizer, prompts, args.out, grid, run_spec(args))
    print("| Z_T | macro expected accepted |\n| ---: | ---: |")
    for z, score in zip(result["grid"], result["scores"]):
        print(f"| {z}{' (chosen)' if z == best else ''} | {score:.4f} |")
    print(f"chosen Z_T = {best}; calibration.json written to {args.out}")
    return 0
