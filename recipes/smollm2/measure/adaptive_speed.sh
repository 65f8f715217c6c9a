#!/usr/bin/env bash
# The adaptive drafting controller against fixed drafting (every cycle verifying the whole block),
# side by side in one sitting: eval.sh's speed phase (`dblast eval --fastest-settings
# --measure-speedup`, 4 datasets x SPEED_PROMPTS prompts, 256 new tokens, the four temperatures
# and their filters) once with `--controller adaptive` and once with `--controller off`, the two
# runs of each temperature back to back; then the batch speed run (recipes/smollm2/measure/batch_speed.py,
# batches 1 / 4 / 16, both controllers) and the report (recipes/smollm2/measure/adaptive_report.py:
# results/smollm2/adaptive/). One process at a time with every core; run it on idle cores.
#   bash recipes/smollm2/measure/adaptive_speed.sh      (resumable: a finished run is skipped)
# Environment (defaults): OUT (runs/adaptive-speed), ARMS (dblast-k4), TEMPERATURES (0.7 1.5 1.0 0),
# SPEED_PROMPTS (10), MAX_NEW_TOKENS (256), PHASES (speed batch report).
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-runs/adaptive-speed} ARMS=${ARMS:-dblast-k4} TEMPERATURES=${TEMPERATURES:-0.7 1.5 1.0 0}
SPEED_PROMPTS=${SPEED_PROMPTS:-10} MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-256} PHASES=${PHASES:-speed batch report}
DATASETS=gsm8k,mtbench,humaneval,math500
command -v dblast > /dev/null || { echo "dblast is not on PATH: source .venv/bin/activate (scripts/setup.sh)"; exit 2; }
mkdir -p "$OUT"

sampling() {  # the filter of each temperature setting (as eval.sh)
  case $1 in
    0) echo "--temperature 0 --top-k 20" ;;
    0.7) echo "--temperature 0.7 --top-p 0.8 --top-k 20" ;;
    *) echo "--temperature $1 --top-p 0.95 --top-k 20" ;;
  esac
}

for phase in $PHASES; do
  echo "== $phase ($(date -u +%T))"
  case $phase in
    speed)
      for t in $TEMPERATURES; do
        for arm in $ARMS; do
          for controller in adaptive off; do
            run=$OUT/speed/$arm-T$t-$controller
            if [[ -f $run/summary.json ]]; then echo "done: $run"; continue; fi
            echo "$arm T=$t controller=$controller ($(date -u +%T))"
            # shellcheck disable=SC2046  # one flag per word
            dblast eval --drafter "$arm" --fastest-settings --controller "$controller" --datasets "$DATASETS" \
              --num-prompts "$SPEED_PROMPTS" $(sampling "$t") --max-new-tokens "$MAX_NEW_TOKENS" --measure-speedup \
              --all-responses --no-progress --out "$run" | tail -2
          done
        done
      done ;;
    batch)
      if [[ -f $OUT/batch/summary.json ]]; then echo "done: $OUT/batch"; continue; fi
      python recipes/smollm2/measure/batch_speed.py --drafter dblast-k4 --block-size 8 --draft-vocab 8192 --dtype bfloat16 \
        --controllers adaptive,off --out "$OUT/batch" ;;
    report)
      python recipes/smollm2/measure/adaptive_report.py --runs "$OUT" --out results/smollm2/adaptive ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
done
