#!/usr/bin/env bash
# The GPU check, run on a lent H200 machine (torch 2.11 + nvcc 13.0 there, no network):
#   bash bench/device_check.sh [OUT_DIR]          (default $OUT, else /tmp/dblast_device)
# Builds the extension in place for sm_90, runs the CUDA variants of the test suite, the CUDA benchmarks next to their references, and writes logs plus a
# results table (results.md, with the decode-cycle overhead of K branches at Qwen3-8B
# shapes) into OUT_DIR. Copy results.md into bench/RESULTS.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-/tmp/dblast_device}}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
if [[ -z ${CUDA_HOME:-} ]]; then
  CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc)")")
  export CUDA_HOME
fi
status=0
{ nvidia-smi; "$PY" -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"; } > "$OUT/machine.txt" 2>&1

echo "== build ($(date -u +%T))"
# Every stage has a time limit, so that a hung kernel cannot eat the whole device lease.
if ! timeout 420 "$PY" setup.py build_ext --inplace > "$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"
  exit 1
fi

echo "== tests ($(date -u +%T))"
# the CUDA variants only (test ids with "cuda"): CI runs everything else on every submission
timeout 300 "$PY" -m pytest python_tests -q -p no:cacheprovider -rfE -k cuda > "$OUT/tests.log" 2>&1 || status=1
tail -15 "$OUT/tests.log"

echo "== bandwidth ($(date -u +%T))"
BANDWIDTH=$(timeout 60 "$PY" - 2>>"$OUT/bandwidth.log" <<'PY'
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

echo "== benchmarks ($(date -u +%T))"
timeout 300 "$PY" -m pytest bench -q -p no:cacheprovider -k "cuda or qwen3_8b_shape" --benchmark-json="$OUT/bench.json" \
  > "$OUT/bench.log" 2>&1 || status=1
tail -5 "$OUT/bench.log"
GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
"$PY" bench/summarize.py "$OUT/bench.json" ${BANDWIDTH:+--bandwidth "$BANDWIDTH"} \
  --machine "${GPU_NAME:-unknown GPU}" > "$OUT/results.md" || status=1
cat "$OUT/results.md"
exit $status
