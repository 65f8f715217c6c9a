"""Seconds per training step of a config, with the fused label log-softmax gradient
(losses._PickedLogSoftmax) and with autograd's gather + logsumexp it replaced, alternating in
one process on the same batches (every run starts from the same initialisation and seed).
    python recipes/smollm2/measure/train_step_speed.py --config runs/smollm2-5x/pilot-L2-B16.json --steps 3 --rounds 2
Prints one line per run and the median step time of each variant (the first step of a run,
which warms caches, is left out)."""
import argparse
import json
import shutil
import statistics
import tempfile
from unittest import mock

import torch

from dblast_ext.training import losses
from dblast_ext.training.config import TrainConfig, validate
from dblast_ext.training.trainer import train


def autograd_picked(logits, ids):
    return logits.gather(-1, ids) - torch.logsumexp(logits, dim=-1, keepdim=True)


VARIANTS = {"fused": losses._PickedLogSoftmax.apply, "autograd": autograd_picked}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="a training config (its out, eval and patience are ignored)")
    parser.add_argument("--steps", type=int, default=3, help="steps per run (the first is left out)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each variant, alternating")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=JSON", help="override a config field")
    args = parser.parse_args()
    fields = json.load(open(args.config))
    for item in args.set:
        key, _, value = item.partition("=")
        fields[key] = json.loads(value)
    times = {name: [] for name in VARIANTS}
    for round_ in range(args.rounds):
        for name, fn in VARIANTS.items():
            out = tempfile.mkdtemp()
            try:
                # the loss looks the Function's apply up at every call
                with mock.patch.object(losses._PickedLogSoftmax, "apply", fn):
                    config = validate(TrainConfig(**dict(fields, out=out, eval_data=None, patience=None,
                                                         max_steps=args.steps, save_every=10 ** 6)))
                    history = train(config, progress=False)["history"]
            finally:
                shutil.rmtree(out)
            steps = [h["seconds"] for h in history][1:]
            times[name] += steps
            print(f"round {round_} {name}: " + " ".join(f"{s:.2f}" for s in steps) + " s/step", flush=True)
    for name, values in times.items():
        print(f"{name}: median {statistics.median(values):.2f} s/step over {len(values)} steps")


if __name__ == "__main__":
    main()
