#!/usr/bin/env bash
# The GPU check, run on a lent H200 machine (torch 2.11 + nvcc 13.0 there, no network):
#   bash bench/device_check.sh [OUT_DIR]          (default $OUT, else /tmp/dblast_device)
# Builds the extension in place for sm_90, runs the CUDA variants of the test suite, the decode
# cycle's figures at the Qwen3-8B shape (bench/gpu_cycle.py: cycle vs target forward, K = 4 vs
# K = 1, host syncs per cycle, batches 1/8/32), the CUDA kernel benchmarks next to their
# references, and compute-sanitizer over sample_tokens' CUDA tests, and writes logs plus the
# tables (results.md, gpu_cycle.md) into OUT_DIR: at most 8 files, because the device tool
# brings back no more. Copy the tables into bench/RESULTS.md.
# Each stage has its own time limit so that a hung kernel cannot eat the whole lease; the
# stages run in order of importance (build, correctness, cycle figures, kernel speed, memory
# checks) and together fit in about 9 minutes.
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
stamp() { echo "== $1 ($(date -u +%T))"; }
{ nvidia-smi; "$PY" -c "import torch, transformers; print('torch', torch.__version__, torch.cuda.get_device_name(), 'transformers', transformers.__version__)"; } \
  > "$OUT/machine.txt" 2>&1

stamp build
if ! timeout 300 "$PY" setup.py build_ext --inplace > "$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"
  exit 1
fi
"$PY" -c "import dblast_ext; print(dblast_ext.build_info())" | tee -a "$OUT/machine.txt"

stamp tests
# the CUDA variants only (test ids with "cuda", and the mixed-device error tests, whose ids name
# the argument instead): CI runs everything else on every submission.
# With pytest-xdist the tests run in worker processes, so a crashing test is reported as a
# failure instead of ending the whole run.
PARALLEL=()
if "$PY" -c "import xdist" 2>/dev/null; then PARALLEL=(-n 12); fi
timeout 180 "$PY" -m pytest python_tests -q -p no:cacheprovider -rfE --tb=short --durations=8 "${PARALLEL[@]}" \
  --continue-on-collection-errors -k "cuda or mixed_devices" > "$OUT/tests.log" 2>&1 || status=1
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -40
tail -15 "$OUT/tests.log"

stamp "decode cycle figures, Qwen3-8B shape"
timeout 200 env PYTHONPATH=. "$PY" bench/gpu_cycle.py --out "$OUT" >> "$OUT/bench.log" 2>&1 || status=1
grep -v Warning "$OUT/bench.log" | tail -25

stamp bandwidth
BANDWIDTH=$(timeout 60 "$PY" - 2>>"$OUT/bench.log" <<'PY'
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
echo "copy bandwidth: $BANDWIDTH B/s"

stamp "kernel benchmarks"
# short rounds: the lease is minutes, and a GPU op's mean settles within a few hundred calls
timeout 150 "$PY" -m pytest bench -q -p no:cacheprovider -k "cuda and not qwen3_8b_shape" \
  --benchmark-max-time=0.25 --benchmark-min-rounds=10 --benchmark-columns=mean,rounds \
  --benchmark-json="$OUT/bench_kernels.json" >> "$OUT/bench.log" 2>&1 || status=1
tail -3 "$OUT/bench.log"

stamp "compute-sanitizer: sample_tokens on CUDA"
# memcheck over the newest kernel's tests at a few shapes (the whole suite would take far longer)
if command -v compute-sanitizer > /dev/null; then
  timeout 150 compute-sanitizer --tool memcheck --error-exitcode 1 "$PY" -m pytest python_tests/test_sample_tokens.py \
    -q -p no:cacheprovider -k "cuda and (vocab_sizes or lowest_id or (T1.0 and k20 and p0.95))" \
    >> "$OUT/tests.log" 2>&1 || status=1
  tail -6 "$OUT/tests.log"
fi

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
