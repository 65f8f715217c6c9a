#!/usr/bin/env bash
# `dblast demo` (its defaults: dblast-k4, T 1.0, top-p 0.95, top-k 20, 128 tokens, four prompts) with
# the adaptive controller and with `--controller off`, over several seeds, the two runs of each seed
# back to back: at T 1.0 a seed decides what the answers say, and with them how many drafts are
# accepted, so one seed's speed-up is one draw; the mean over seeds compares the controllers.
#   bash recipes/smollm2/measure/demo_seeds.sh > recipes/smollm2/logs/demo-seeds-DATE.log
# Environment (defaults): SEEDS (0 1 2 3). Run it on idle cores.
set -euo pipefail
cd "$(dirname "$0")/../../.."
SEEDS=${SEEDS:-0 1 2 3}
command -v dblast > /dev/null || { echo "dblast is not on PATH: source .venv/bin/activate (scripts/setup.sh)"; exit 2; }
echo "# dblast demo, adaptive controller against --controller off, seeds $SEEDS ($(date -u '+%F %T') UTC)"
for seed in $SEEDS; do
  for controller in adaptive off; do
    line=$(dblast demo --seed "$seed" --controller "$controller" 2> /dev/null | grep -E '^(speed-up|adaptive drafting|all prompts)' | tr '\n' ' ')
    echo "seed $seed controller $controller: $line"
  done
done
