#!/usr/bin/env bash
# `dblast demo` (temperature 1.0, top-p 0.95, top-k 20, the 4 built-in prompts, 128 tokens) with
# the trained block and shorter ones, the whole vocabulary and a draft vocabulary, a float32 and
# a bfloat16 target: what a cycle costs on this machine in target-only steps and the speed-up it
# gives. Needs the CPU to itself. Each argument is one configuration (extra demo flags; default:
# the list below).
#   bash recipes/smollm2/measure/demo_sweep.sh > recipes/smollm2/logs/demo-sweep-<date>.log
#   bash recipes/smollm2/measure/demo_sweep.sh "--block-size 8 --draft-vocab 8192"
set -euo pipefail
DRAFTER=${DRAFTER:-dblast-k4}
if (( $# == 0 )); then
  set -- "" "--draft-vocab 8192" "--block-size 8" "--block-size 8 --draft-vocab 8192" "--block-size 4" \
    "--block-size 4 --draft-vocab 8192" "--dtype bfloat16" "--dtype bfloat16 --draft-vocab 8192" \
    "--dtype bfloat16 --draft-vocab 8192 --block-size 8" \
    "--dtype bfloat16 --draft-vocab 8192 --block-size 8 --temperature 0.7 --top-p 0.8"
fi
for config in "$@"; do
  echo "== dblast demo --drafter $DRAFTER $config ($(date -u +%FT%TZ), $(nproc) cores)"
  dblast demo --drafter "$DRAFTER" $config 2>/dev/null | grep -E "^(target SmolLM2|all prompts|speculative|target alone|speed-up|a cycle)"
done
