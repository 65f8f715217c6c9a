"""`dblast compare RUN_A RUN_B [RUN_C ...]`: paired committed-length comparison of runs on
the same prompts (each later run against the first), per dataset, with a Holm correction
over the whole family of comparisons."""
from ..eval.compare import compare_runs, format_table


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("compare", help="paired delta-tau between runs on the same prompts (Holm-corrected)",
                              description="Compare `dblast eval` runs on the same prompts: for every later run and "
                                          "dataset, delta tau against the first run with a paired bootstrap 95% "
                                          "interval and p-value, Holm step-down over the family.")
    p.add_argument("runs", nargs="+", help="run directories (or records.jsonl files); the first is the baseline")
    p.add_argument("--alpha", type=float, default=0.05,
                   help="family-wise error rate for Holm (default %(default)s)")
    p.add_argument("--all-responses", action="store_true", help="also count responses that did not end with EOS")
    p.add_argument("--n-boot", type=int, default=2000,
                   help="bootstrap resamples for the 95%% intervals and sign flips for the p-values, >= 1 (the "
                        "smallest p-value is 1 / (N + 1)) (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the resampling (default %(default)s)")
    p.add_argument("--out", default=None, help="also write the table to this Markdown file")


def run(args) -> int:
    if not 0 < args.alpha < 1:
        raise ValueError(f"--alpha must lie in (0, 1), got {args.alpha}")
    if args.n_boot < 1:
        raise ValueError(f"--n-boot must be >= 1, got {args.n_boot}")
    rows = compare_runs(args.runs, alpha=args.alpha, eos_only=not args.all_responses, n_boot=args.n_boot,
                        seed=args.seed)
    table = format_table(rows, args.runs[0], args.alpha, eos_only=not args.all_responses)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    return 0
