"""Packages a trained drafter checkpoint as an embedded drafter: the weights in bf16 (the
decode loop casts them to the run's dtype), the config unchanged, at most 25 MB.

    python recipes/smollm2/package.py --checkpoint runs/smollm2/dblast-k4/final --name dblast-k4
"""
import argparse
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

from dblast_ext.embedded_drafters import embedded_drafter_dir

LIMIT_BYTES = 25 * 1024 * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a drafter directory written by `dblast train`")
    parser.add_argument("--name", required=True, help="the embedded drafter's name (dflash-k1 or dblast-k4)")
    args = parser.parse_args()
    out = embedded_drafter_dir(args.name)
    state = load_file(os.path.join(args.checkpoint, "model.safetensors"))
    half = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous() for k, v in state.items()}
    os.makedirs(out, exist_ok=True)
    save_file(half, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    shutil.copyfile(os.path.join(args.checkpoint, "config.json"), os.path.join(out, "config.json"))
    size = os.path.getsize(os.path.join(out, "model.safetensors"))
    if size > LIMIT_BYTES:
        raise SystemExit(f"{args.name}: {size / 2**20:.1f} MB is over the 25 MB limit for an embedded drafter")
    params = sum(v.numel() for v in half.values())
    print(f"{args.name}: {params / 1e6:.2f} M parameters, {size / 2**20:.1f} MB -> {out}")


if __name__ == "__main__":
    main()
