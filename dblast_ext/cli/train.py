"""`dblast train --config FILE`: trains a drafter (NLL or the accepted-length surrogate, from a
DFlash/DBLast checkpoint or from scratch, optionally expanding its block), resuming from the
newest checkpoint in the output directory. Flags override the config file's fields."""
import sys

from ..training.config import load_config
from ..training.trainer import train


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("train", help="train a drafter (nll / al objectives, block expansion, resume)",
                              description=__doc__)
    p.add_argument("--config", required=True, help="JSON training config (see dblast_ext/training/config.py)")
    p.add_argument("--out", default=None, help="output directory (checkpoints, logs, final/)")
    p.add_argument("--init-from", default=None, help="DFlash or DBLast checkpoint to start from")
    p.add_argument("--block-size", type=int, default=None, help="train at this block size (expansion: > checkpoint's)")
    p.add_argument("--new-position-weight", type=float, default=None,
                   help="loss weight of the positions a block expansion adds (DBloom: 3.0)")
    p.add_argument("--objective", choices=("nll", "al"), default=None)
    p.add_argument("--num-branches", type=int, default=None)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--no-progress", action="store_true")


def run(args) -> int:
    config = load_config(args.config, out=args.out, init_from=args.init_from, block_size=args.block_size,
                         new_position_weight=args.new_position_weight, objective=args.objective,
                         num_branches=args.num_branches, max_steps=args.max_steps, device=args.device)
    result = train(config, progress=not args.no_progress)
    last = result["history"][-1] if result["history"] else None
    if last:
        print(f"trained {result['steps']} / {result['total_steps']} steps: loss {last['loss']:.4f}, "
              f"acceptance proxy {last['accepted_proxy']:.3f}", file=sys.stderr)
    print(f"drafter: {result['final']}")
    return 0
