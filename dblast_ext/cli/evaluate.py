"""`dblast eval`: a drafter + target over offline benchmarks; writes records (resumable),
summary.json, a Markdown report and PNG plots into --out. With
`--category-temperature calibrate`, Z_T is first chosen on a 10% calibration split and
the report covers the other 90%."""
import os
import sys

from ..drafting.drafter_io import checkpoint_digest
from ..drafting.embedded_drafters import resolve_drafter
from ..eval.calibration import (CALIBRATION_FRACTION, DEFAULT_GRID, calibrate_category_temperature, calibrated_label,
                                parse_grid, split_prompts)
from ..eval.datasets import load_dataset_list
from ..eval.report import contention_lines, write_report
from ..eval.runner import RunSpec, evaluate
from .common import (add_model_args, add_sampling_args, check_args, check_tree_args, load_decoder, pick_fastest_settings,
                     sampling_of)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("eval", help="committed length, histograms and speed-up on benchmarks",
                              description="Evaluate a drafter on offline benchmarks (gsm8k, math500, humaneval, "
                                          "mtbench or JSONL files): records per response, summary.json, report.md, "
                                          "plots. Rerunning with the same --out resumes.")
    add_model_args(p)
    p.set_defaults(verify=None)  # branch, unless --fastest-settings picks the rule (run() decides)
    p.add_argument("--fastest-settings", action="store_true",
                   help="run at the settings `dblast demo` and `dblast generate` pick for this device and drafter: "
                        "the fastest measured that keep the output distribution (dblast_ext.decoding.fastest_settings: "
                        "dtype, inference block, draft vocabulary, verification rule and node budget); flags given "
                        "override them, as there. Without it --dtype auto means float32 on a CPU and --verify "
                        "branch")
    add_sampling_args(p)
    add_eval_args(p)
    p.add_argument("--category-temperature", default="1.0",
                   help="Z_T, or 'calibrate' to choose it on a 10%% split first (grid --grid; at least 2 prompts "
                        "per dataset) (default %(default)s)")
    p.add_argument("--grid", default=",".join(str(z) for z in DEFAULT_GRID),
                   help="Z_T grid for calibration (default %(default)s)")


def add_eval_args(p, *, measure_speedup: bool = True, all_responses: bool = True, batch_size: bool = True) -> None:
    """The prompt, output and progress flags of the subcommands that run benchmarks (each of
    them resumes a run left in its --out); each subcommand takes --measure-speedup /
    --all-responses / --batch-size only where it uses them."""
    p.add_argument("--datasets", default="gsm8k,mtbench,humaneval,math500",
                   help="comma-separated: gsm8k, math500, humaneval, mtbench, or .jsonl paths (default %(default)s)")
    p.add_argument("--num-prompts", type=int, default=None, help="the first N prompts of each dataset")
    if measure_speedup:
        p.add_argument("--measure-speedup", action="store_true",
                       help="also time target-only sampling of every prompt (same seed and filter)")
    if all_responses:
        p.add_argument("--all-responses", action="store_true",
                       help="acceptance statistics over every response, not only those that ended with EOS")
    if batch_size:
        p.add_argument("--batch-size", type=int, default=1,
                       help="responses generated at once (speculative sampling over a batch of prompts, each row "
                            "as it would be alone); acceptance figures only: --measure-speedup and --verify tree "
                            "need 1 (default %(default)s)")
    p.add_argument("--out", required=True, help="output directory (created; an existing one is resumed)")
    p.add_argument("--no-progress", action="store_true", help="no progress output")
    p.set_defaults(resumable=True)  # main's message on Ctrl-C


def load_all_prompts(args):
    if args.num_prompts is not None and args.num_prompts <= 0:
        raise ValueError(f"--num-prompts must be > 0, got {args.num_prompts}")
    try:
        return load_dataset_list(args.datasets, limit=args.num_prompts)
    except ValueError as e:
        raise ValueError(f"--datasets: {e}") from None


def check_calibration_split(args, prompts) -> None:
    """The calibration split needs prompts to spare in every dataset: checked on the prompts
    before any model loads, not when calibration starts."""
    try:
        split_prompts(prompts, CALIBRATION_FRACTION, args.seed)
    except ValueError as e:
        flag = f"--num-prompts {args.num_prompts}" if args.num_prompts is not None else "--datasets"
        raise ValueError(f"{flag}: {e}") from None


def model_name(path: str) -> str:
    """How a run names its target / drafter: the embedded ones by name, others by absolute path."""
    return path if path == "default" or resolve_drafter(path) != path else os.path.abspath(path)


def check_batch_size_arg(args) -> None:
    """--batch-size against --measure-speedup and --verify, before any model loads."""
    batch_size = getattr(args, "batch_size", 1)
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    if batch_size > 1 and getattr(args, "measure_speedup", False):
        raise ValueError(f"--batch-size {batch_size}: --measure-speedup times every response alone (--batch-size 1)")
    if batch_size > 1 and getattr(args, "verify", "branch") != "branch":
        picked = " (picked by --fastest-settings)" if getattr(args, "fastest_settings", False) else ""
        raise ValueError(f"--batch-size {batch_size}: --verify tree{picked} takes one prompt at a time (--batch-size 1)")


def run_spec(args) -> RunSpec:
    """The run's names, filter, limit, seed and batch size, from the flags."""
    return RunSpec(target=model_name(args.target), drafter=model_name(args.drafter),
                   drafter_digest=checkpoint_digest(args.drafter), sampling=sampling_of(args),
                   max_new_tokens=args.max_new_tokens, seed=args.seed, progress=not args.no_progress,
                   batch_size=getattr(args, "batch_size", 1))


def choose_settings(args) -> str:
    """With --fastest-settings, the settings `dblast demo` picks for the flags left out (returns
    the line saying which); without, the branch rule for --verify left out ("")."""
    if args.fastest_settings:
        return pick_fastest_settings(args)
    if args.verify is None:
        args.verify = "branch"
        check_tree_args(args, args.verify)
    return ""


def run(args) -> int:
    check_args(args)
    picked = choose_settings(args)
    if picked:
        print(picked, file=sys.stderr)
    check_batch_size_arg(args)
    calibrating = args.category_temperature == "calibrate"
    if not calibrating:
        try:
            z = float(args.category_temperature)
        except ValueError:
            raise ValueError(f"--category-temperature must be a number or 'calibrate', "
                             f"got {args.category_temperature!r}") from None
        if z < 0:
            raise ValueError(f"--category-temperature must be >= 0, got {z}")
    grid = parse_grid(args.grid)
    prompts = load_all_prompts(args)
    if calibrating:
        check_calibration_split(args, prompts)
    os.makedirs(args.out, exist_ok=True)
    decoder, tokenizer = load_decoder(args)
    calibration = None
    if calibrating:
        z, prompts, calibration = calibrate_category_temperature(decoder, tokenizer, prompts,
                                                                 os.path.join(args.out, "calibration"), grid,
                                                                 run_spec(args))
        if calibration:
            print(f"calibration: chose Z_T = {z} (macro expected accepted {max(calibration['scores']):.3f}); "
                  f"evaluating on the other {len(prompts)} prompts", file=sys.stderr)
    records, settings = evaluate(decoder, tokenizer, prompts, os.path.join(args.out, "records.jsonl"),
                                 run_spec(args), category_temperature=z, measure_speedup=args.measure_speedup)
    if calibrating:
        settings = dict(settings, category_temperature=calibrated_label(z, calibration is not None))
    summary = write_report(args.out, records, settings, eos_only=not args.all_responses)
    print_summary(summary, args.out)
    return 0


def print_summary(summary, out_dir) -> None:
    for name, s in summary["datasets"].items():
        speed = f", speed-up {s['speedup']:.2f}x" if s["speedup"] else ""
        print(f"{name:>12}: tau {s['tau']:.2f} [{s['tau_ci'][0]:.2f}, {s['tau_ci'][1]:.2f}], cycle mean "
              f"{s['cycle_mean']:.2f}, ceiling {100 * s['ceiling_fraction']:.1f}%, expected accepted "
              f"{s['expected_accepted']:.2f}{speed} ({s['n_prompts']} prompts, {s['n_cycles']} cycles)")
    for name, why in summary["skipped"].items():
        print(f"{name:>12}: not summarised (so no macro-average): {why}")
    m = summary["macro"]
    if m["tau"] is not None:
        print(f"{'macro':>12}: tau {m['tau']:.2f}, cycle mean {m['cycle_mean']:.2f}, expected accepted "
              f"{m['expected_accepted']:.2f}")
    for line in contention_lines(summary):
        print(f"warning: {line} (measure it again on idle cores, into another --out)", file=sys.stderr)
    if summary.get("plots_skipped"):
        print(summary["plots_skipped"], file=sys.stderr)
    print(f"report: {os.path.join(out_dir, 'report.md')}")
