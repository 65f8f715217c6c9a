"""The `dblast` command line: one module per subcommand, each with `add_parser(subparsers)`
(its flags) and `run(args) -> int` (its work).

May import: everything below it (the top of the layers, docs/design.md "Layout")."""
import argparse
import sys
from typing import List, Optional

from . import calibrate, compare, data, demo, diagnose, evaluate, generate, serve, train

SUBCOMMANDS = {"demo": demo, "generate": generate, "eval": evaluate, "calibrate": calibrate, "compare": compare,
               "diagnose": diagnose, "train": train, "data": data, "serve": serve}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dblast", description="Speculative decoding with dependent block drafters.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module in SUBCOMMANDS.items():
        module.add_parser(subparsers)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return SUBCOMMANDS[args.command].run(args)
    # user errors (missing files, bad values, an --out that is a file or not writable, a missing
    # package): one clear line, no traceback
    except (OSError, ValueError, ImportError) as e:
        print(f"dblast {args.command}: error: {e}", file=sys.stderr)
        return 2
    # Ctrl-C: no traceback; the commands that keep their finished work on disk say how to go on
    except KeyboardInterrupt:
        resume = "; rerun the same command to resume" if getattr(args, "resumable", False) else ""
        print(f"dblast {args.command}: interrupted{resume}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
