#!/usr/bin/env bash
# The scaled training set (recipes/smollm2/make_data/data_scale.py) until TOKENS response tokens are kept,
# in a fresh process every 4 shards (one process grew past 7 GB over a few shards), one thread a
# copy: start one copy per free core. Stops when the set is whole (exit 3 from the script).
#   bash recipes/smollm2/make_data/data_scale.sh >> recipes/smollm2/logs/data-scale-$(date -u +%F).log 2>&1 &
set -uo pipefail
cd "$(dirname "$0")/../../.."
PY=${PYTHON:-.venv/bin/python}
TOKENS=${TOKENS:-10000000}
while true; do
  OMP_NUM_THREADS=1 "$PY" recipes/smollm2/make_data/data_scale.py --tokens "$TOKENS" --max-shards 4 --no-progress "$@"
  code=$?
  [[ $code == 3 ]] && { echo "== $TOKENS response tokens kept ($(date -u +%T))"; exit 0; }
  [[ $code != 0 ]] && { echo "== data_scale.py failed ($code)"; exit "$code"; }
done
