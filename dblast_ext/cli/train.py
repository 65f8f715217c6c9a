"""`dblast train --config FILE`: trains a drafter (NLL or the accepted-length surrogate, from a
DFlash/DBLast checkpoint or from scratch, optionally expanding its block), resuming from the
newest checkpoint in the output directory (or from --resume-from, e.g. a checkpoint copied from
another machine). Flags override the config file's fields."""
import sys

from ..training.config import load_config
from ..training.trainer import train
from .common import check_device

# config field -> the flag that overrides it (each flag's dest is its field)
OVERRIDE_FLAGS = {"out": "--out", "init_from": "--init-from", "block_size": "--block-size",
                  "new_position_weight": "--new-position-weight", "objective": "--objective",
                  "num_branches": "--num-branches", "max_steps": "--max-steps", "device": "--device",
                  "data": "--data", "shard_window": "--shard-window", "features": "--features",
                  "feature_cache": "--feature-cache", "feature_cache_max_gb": "--feature-cache-max-gb"}


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("train", help="train a drafter (nll / al objectives, block expansion, resume)",
                              description=__doc__)
    p.add_argument("--config", required=True, help="JSON training config (see dblast_ext/training/config.py)")
    p.add_argument("--out", default=None, help="output directory (checkpoints, logs, final/); rerunning resumes")
    p.add_argument("--init-from", default=None,
                   help="DFlash or DBLast checkpoint directory to start from, or an embedded drafter "
                        "(dblast-k4, dflash-k1)")
    p.add_argument("--block-size", type=int, default=None, help="train at this block size (expansion: > checkpoint's)")
    p.add_argument("--new-position-weight", type=float, default=None,
                   help="loss weight of the positions a block expansion adds (DBloom: 3.0)")
    p.add_argument("--objective", choices=("nll", "al"), default=None,
                   help="nll: next-token cross-entropy; al: the accepted-length surrogate (DBLast)")
    p.add_argument("--num-branches", type=int, default=None,
                   help="K: branches of the drafter (adds a K-branch head to a K = 1 --init-from checkpoint)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps (else epochs)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: the config's, else cuda when "
                                                  "available)")
    p.add_argument("--data", default=None,
                   help="training data: a data file, a folder of .jsonl / .jsonl.gz shards, or a quoted glob")
    p.add_argument("--shard-window", type=int, default=None,
                   help="shards in memory at once, and the span of the shuffle (default: all)")
    p.add_argument("--features", choices=("auto", "online", "cached"), default=None,
                   help="the target's features: online (a target forward per step, no disk), cached (computed "
                        "once into --feature-cache), auto (online on CUDA, cached elsewhere when a cache is set)")
    p.add_argument("--feature-cache", default=None, help="folder of the target-feature cache")
    p.add_argument("--feature-cache-max-gb", type=float, default=None,
                   help="bound on the feature cache's folder: least recently used shards are evicted")
    p.add_argument("--resume-from", default=None,
                   help="a checkpoint-NNNNNNN folder to resume from (e.g. copied from another machine); default: "
                        "the newest checkpoint in --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(resumable=True)  # main's message on Ctrl-C


def run(args) -> int:
    config = load_config(args.config, flag_names=OVERRIDE_FLAGS,
                         **{field: getattr(args, field) for field in OVERRIDE_FLAGS})
    check_device(config.device, "--device" if args.device is not None else "training config: device")
    resume = {"resume_from": args.resume_from} if args.resume_from is not None else {}
    result = train(config, progress=not args.no_progress, **resume)
    last = result["history"][-1] if result["history"] else None
    if last:
        print(f"trained {result['steps']} / {result['total_steps']} steps: loss {last['loss']:.4f}, "
              f"acceptance proxy {last['accepted_proxy']:.3f}", file=sys.stderr)
    print(f"drafter: {result['final']}")
    return 0
