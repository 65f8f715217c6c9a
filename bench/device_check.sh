#!/usr/bin/env bash
# The GPU check, run on a lent H200 machine (torch 2.11 + nvcc 13.0 there, no network):
#   bash bench/device_check.sh [OUT_DIR]          (default $OUT, else /tmp/dblast_device)
# Builds the extension in place for sm_90; runs the CUDA tests with the verified and the staged
# kernels (docs/ops.md: every `device` test runs as `cuda` and `cuda-staged`); compute-sanitizer
# (memcheck, racecheck) over the staged kernels' tests, per op when anything is found; the CUDA
# kernel benchmarks, verified and staged side by side next to their references; the decode
# cycle's figures at the Qwen3-8B shape (bench/gpu_cycle.py, eager and CUDA graphs). It writes
# the 8 files the device tool brings back: machine.txt, run.log (every stage's output),
# tests.xml (JUnit) and sanitizer.txt (`<op> <tool> <exit code>` lines), which
# bench/promote_staged.py reads to promote the staged kernels that passed, bench_kernels.json
# and results.md (the kernel table), gpu_cycle.json and gpu_cycle.md. Copy them into
# bench/device_runs/<date>-run<N>/ and the tables into bench/RESULTS.md.
# Each stage has its own time limit so that a hung kernel cannot eat the whole lease; the
# stages run in order of importance (build, correctness, memory checks, kernel speed, cycle
# figures) and together fit in about 9 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-/tmp/dblast_device}}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
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
status=0
LOG=$OUT/run.log
stamp() { echo "== $1 ($(date -u +%T))" | tee -a "$LOG"; }
{ nvidia-smi; "$PY" -c "import torch, transformers; print('torch', torch.__version__, torch.cuda.get_device_name(), 'transformers', transformers.__version__)"; } \
  > "$OUT/machine.txt" 2>&1

stamp build
if ! timeout 240 "$PY" setup.py build_ext --inplace >> "$LOG" 2>&1; then
  tail -40 "$LOG"
  exit 1
fi
"$PY" -c "import dblast_ext; print(dblast_ext.build_info())" | tee -a "$OUT/machine.txt"

stamp tests
# the CUDA variants only (test ids with "cuda", cuda-staged included, and the mixed-device error
# tests, whose ids name the argument instead): CI runs everything else on every submission.
# With pytest-xdist the tests run in worker processes, so a crashing test is reported as a
# failure instead of ending the whole run.
PARALLEL=()
if "$PY" -c "import xdist" 2>/dev/null; then PARALLEL=(-n 12); fi
timeout 170 "$PY" -m pytest python_tests -q -p no:cacheprovider -rfE --tb=short --durations=8 "${PARALLEL[@]}" \
  --continue-on-collection-errors -k "cuda or mixed_devices or staged" --junitxml="$OUT/tests.xml" >> "$LOG" 2>&1 \
  || status=1
grep -E "^(FAILED|ERROR)" "$LOG" | head -40
tail -4 "$LOG"

stamp "compute-sanitizer over the staged kernels"
# Each op's small staged cases (bench/promote_staged.py promotes an op only with both tools
# clean). All ops in one process per tool; where a tool finds something, once per op to say which.
declare -A STAGED_TESTS=(
  [branch_verify]="python_tests/test_branch_verify.py::test_matches_reference_across_dtypes"
  [mixture_verify]="python_tests/test_mixture_verify.py::test_matches_reference_across_dtypes"
  [sample_tokens]="python_tests/test_sample_tokens.py::test_greedy_ties_across_the_split_take_the_lowest_id python_tests/test_sample_tokens.py::test_ties_at_the_thresholds_across_the_split_are_all_kept"
  [branch_argmax]="python_tests/test_branch_argmax.py::test_planted_tie_resolves_to_the_lower_id"
  [drafter_attention]="python_tests/test_drafter_attention.py::test_split_and_tile_edges_match_the_reference"
)
sanitize() {  # sanitize TOOL SECONDS TEST...: the exit code of compute-sanitizer over those tests' staged cases
  local tool=$1 seconds=$2
  shift 2
  timeout "$seconds" compute-sanitizer --tool "$tool" --error-exitcode 1 "$PY" -m pytest "$@" -q -p no:cacheprovider \
    -k "staged" >> "$LOG" 2>&1
}
: > "$OUT/sanitizer.txt"
if command -v compute-sanitizer > /dev/null; then
  for tool in memcheck racecheck; do
    # shellcheck disable=SC2068  # a value may hold several test ids
    if sanitize "$tool" 90 ${STAGED_TESTS[@]}; then
      for op in "${!STAGED_TESTS[@]}"; do echo "$op $tool 0" >> "$OUT/sanitizer.txt"; done
    else
      for op in "${!STAGED_TESTS[@]}"; do
        # shellcheck disable=SC2086
        sanitize "$tool" 40 ${STAGED_TESTS[$op]}
        echo "$op $tool $?" >> "$OUT/sanitizer.txt"
      done
    fi
  done
  cat "$OUT/sanitizer.txt"
fi

stamp bandwidth
BANDWIDTH=$(timeout 60 "$PY" - 2>>"$LOG" <<'PY'
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
timeout 120 "$PY" -m pytest bench -q -p no:cacheprovider -k "cuda and not qwen3_8b_shape" \
  --benchmark-max-time=0.2 --benchmark-min-rounds=10 --benchmark-columns=mean,rounds \
  --benchmark-json="$OUT/bench_kernels.json" >> "$LOG" 2>&1 || status=1
tail -3 "$LOG"

stamp "decode cycle figures, Qwen3-8B shape, eager and CUDA graphs"
timeout 150 env PYTHONPATH=. "$PY" bench/gpu_cycle.py --out "$OUT" >> "$LOG" 2>&1 || status=1
grep -v Warning "$LOG" | tail -25

stamp summary
GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
JSONS=$(ls "$OUT"/bench_kernels.json 2>/dev/null)
if [[ -n $JSONS ]]; then
  # shellcheck disable=SC2086  # one argument per file
  "$PY" bench/summarize.py $JSONS ${BANDWIDTH:+--bandwidth "$BANDWIDTH"} \
    --machine "${GPU_NAME:-unknown GPU}" > "$OUT/results.md" || status=1
  cat "$OUT/results.md"
else
  status=1
fi
exit $status
