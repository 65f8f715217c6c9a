#!/usr/bin/env bash
# The SmolLM2-135M-Instruct drafters from the 5x data set that data.sh keeps in
# recipes/smollm2/data/ (about 2.0M response tokens, the target's own samples at T 0.7, top-p 0.8,
# top-k 20), trained in rounds that each fit one sitting on 2 CPU cores (train_round.py: the
# design, the stages and the ledger):
#   round 0       pilots: base drafters of 2 and 3 layers at blocks 8 and 16, chosen by held-out
#                 top-1 agreement (choose_pilot.py), beside the shipped dflash-k1 measured as it is;
#   base rounds   K = 1, NLL with distillation from the target's top-32, from scratch, then each
#                 from the last shipped one, until a round improves the held-out loss by < 1%;
#   arm rounds    dflash-k1 (NLL with distillation) and dblast-k4 (K = 4 head, accepted-length
#                 surrogate, tau 0.1) from that base, equal data and steps, each to its plateau.
# A round caches the target features of its chunk of the shards (every 8th shard) first, then
# trains; a drafter that improved is shipped into dblast_ext/drafters/ at the round's end. What
# a later sitting needs is committed: recipes/smollm2/training/ledger.json, the shipped drafters
# and the runs' logs (recipes/smollm2/logs/5x/). Commit them after each round.
#   bash recipes/smollm2/train_drafters/train.sh                    # the next round
#   ROUNDS=2 bash recipes/smollm2/train_drafters/train.sh           # the next two
#   python recipes/smollm2/train_drafters/train_round.py --plan     # what the next round would train
# A smoke run on a few sequences (a store of small shards, another ledger and ship folder):
#   bash recipes/smollm2/train_drafters/train.sh --store STORE --ledger runs/smoke/ledger.json --logs runs/smoke/logs \
#     --work runs/smoke/work --ship-dir runs/smoke/ship --settings '{"chunks": 2, "pilot_steps": 2,
#     "base_steps": 4, "arm_steps": 4, "layers_choices": [1], "block_choices": [4, 8], "batch_size": 2,
#     "num_anchors": 4, "save_every": 2, "patience": 1}'
# Environment: ROUNDS (rounds to run, default 1); the arguments go to train_round.py.
set -euo pipefail
cd "$(dirname "$0")/../../.."
command -v dblast > /dev/null || { echo "dblast is not on PATH: source .venv/bin/activate (scripts/setup.sh)"; exit 2; }
exec python recipes/smollm2/train_drafters/train_round.py --rounds "${ROUNDS:-1}" "$@"
