"""`dblast calibrate`: choose the category temperature Z_T on a 10% calibration split of the
given datasets (DBLast §4) and print the grid; `dblast eval --category-temperature calibrate`
does the same and then evaluates on the other 90%."""
from ..eval.calibration import DEFAULT_GRID, parse_grid
from .common import add_model_args, add_sampling_args, check_args, load_decoder
from .evaluate import add_eval_args, calibrate_category_temperature, load_all_prompts


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("calibrate", help="choose the category temperature Z_T on a 10%% split",
                              description="Choose Z_T from a grid by macro-average expected accepted length on a "
                                          "disjoint 10%% calibration split; writes calibration.json and a plot.")
    add_model_args(p)
    add_sampling_args(p)
    add_eval_args(p)
    p.add_argument("--grid", default=",".join(str(z) for z in DEFAULT_GRID), help="Z_T values to try")


def run(args) -> int:
    check_args(args)
    grid = parse_grid(args.grid)
    prompts = load_all_prompts(args)
    decoder, tokenizer = load_decoder(args)
    if decoder.drafter.num_branches == 1:
        raise ValueError("the drafter has one branch, so Z_T changes nothing: nothing to calibrate")
    best, _, result = calibrate_category_temperature(args, decoder, tokenizer, prompts, args.out, grid)
    print("| Z_T | macro expected accepted |\n| ---: | ---: |")
    for z, score in zip(result["grid"], result["scores"]):
        print(f"| {z}{' (chosen)' if z == best else ''} | {score:.4f} |")
    print(f"chosen Z_T = {best}; calibration.json written to {args.out}")
    return 0
