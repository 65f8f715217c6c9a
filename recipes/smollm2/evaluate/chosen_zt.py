"""Prints the Z_T a calibrated `dblast eval` run chose (1.0 for a K = 1 run, which has none).

    python recipes/smollm2/evaluate/chosen_zt.py runs/smollm2-eval/accept/dblast-k4-T0.7
"""
import argparse
import json
import os
import sys

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("run", help="the output directory of a `dblast eval` run")
run = parser.parse_args().run
path = os.path.join(run, "calibration", "calibration.json")
if os.path.exists(path):
    with open(path) as f:
        print(json.load(f)["best"])
elif os.path.exists(os.path.join(run, "summary.json")):
    print(1.0)
else:
    sys.exit(f"{run} holds no finished `dblast eval` run")
