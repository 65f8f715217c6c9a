"""`dblast calibrate`: choose the category temperature Z_T on a 10% calibration split of the
given datasets (DBLast §4) and print the grid; `dblast eval --category-temperature calibrate`
does the same and then evaluates on the other 90%."""
from ..eval.calibration import DEFAULT_GRID, calibrate_category_temperature, parse_grid
from .common import add_model_args, add_sampling_args, check_args, load_decoder
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


def run(args) -> int:
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
