"""Packages a trained drafter checkpoint as an embedded drafter: the weights in bf16 (the
decode loop casts them to the run's dtype), the config unchanged, at most 25 MB.

    python recipes/smollm2/train_drafters/package.py --checkpoint runs/smollm2/dblast-k4/final --name dblast-k4
    python recipes/smollm2/train_drafters/package.py --run-dir runs/smollm2      # both arms: RUN_DIR/ARM/final
"""
import argparse
import os
import shutil
from typing import Optional

import torch
from safetensors.torch import load_file, save_file

from dblast_ext.drafting.embedded_drafters import embedded_drafter_dir

# a shipped drafter file stays under 50 MB (issue 58: the wheel carries both drafters); bfloat16
# at 4 layers is about 30 MiB for dblast-k4
LIMIT_BYTES = 50 * 1000 * 1000


ARMS = ("dflash-k1", "dblast-k4")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", help="a drafter directory written by `dblast train`")
    parser.add_argument("--name", choices=ARMS, help="the embedded drafter's name")
    parser.add_argument("--run-dir", help="a recipe's output folder: packages RUN_DIR/ARM/final for both arms")
    args = parser.parse_args()
    if args.run_dir:
        if args.checkpoint or args.name:
            parser.error("--run-dir packages both arms: give it alone, or --checkpoint and --name")
        for arm in ARMS:
            package(os.path.join(args.run_dir, arm, "final"), arm)
    elif args.checkpoint and args.name:
        package(args.checkpoint, args.name)
    else:
        parser.error("give --checkpoint and --name, or --run-dir")


def package(checkpoint: str, name: str, out: Optional[str] = None, limit_bytes: Optional[int] = LIMIT_BYTES) -> None:
    """Writes the drafter at `checkpoint` in bf16 as the embedded drafter `name` (into `out`
    instead when given); `limit_bytes` None: no size limit (a drafter kept, not embedded)."""
    out = out or embedded_drafter_dir(name)
    state = load_file(os.path.join(checkpoint, "model.safetensors"))
    half = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous() for k, v in state.items()}
    os.makedirs(out, exist_ok=True)
    save_file(half, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    shutil.copyfile(os.path.join(checkpoint, "config.json"), os.path.join(out, "config.json"))
    size = os.path.getsize(os.path.join(out, "model.safetensors"))
    if limit_bytes is not None and size > limit_bytes:
        raise SystemExit(f"{name}: {size / 2**20:.1f} MB is over the 25 MB limit for an embedded drafter")
    params = sum(v.numel() for v in half.values())
    print(f"{name}: {params / 1e6:.2f} M parameters, {size / 2**20:.1f} MB -> {out}")


if __name__ == "__main__":
    main()
