#!/usr/bin/env bash
# Before/after speed of a change on the embedded pair, side by side in one run: the training-data
# sampler (data_speed.py) and `dblast demo` (old settings and new defaults) in OLD (a checkout of
# the commit before, built in place) and this tree, alternating. Run on idle cores.
#   git worktree add /tmp/old HEAD~1 && cp dblast_ext/_C*.so /tmp/old/dblast_ext/
#   bash recipes/smollm2/measure/before_after.sh /tmp/old 2>&1 | tee recipes/smollm2/logs/before-after-DATE.log
set -euo pipefail
cd "$(dirname "$0")/../../.."
OLD=$(cd "$1" && pwd) NEW=$(pwd)
echo "== $(date -u '+%Y-%m-%d %H:%M') old $(git -C "$OLD" rev-parse --short HEAD), new $(git rev-parse --short HEAD) + working tree; $(nproc) cores"
echo "== data sampler: 32 math prompts in one batch, 128 new tokens, 1 thread"
python recipes/smollm2/measure/data_speed.py --tree "$OLD" --tree "$NEW" --rounds 2
demo() {  # demo TREE FLAGS...: the demo's summary lines
  local tree=$1
  shift
  echo "-- demo $* ($([[ $tree == "$OLD" ]] && echo old || echo new) tree)"
  (cd / && PYTHONPATH=$tree python -m dblast_ext.cli demo "$@" 2>/dev/null) |
    grep -E "^(target |fastest|all prompts|speculative sampling|target alone|speed-up|a cycle)"
}
echo "== dblast demo (4 prompts, 128 tokens, T 1.0, top-p 0.95, top-k 20)"
demo "$OLD"
demo "$NEW" --block-size 16 --draft-vocab all
demo "$OLD" --block-size 8 --draft-vocab 8192
demo "$NEW"
