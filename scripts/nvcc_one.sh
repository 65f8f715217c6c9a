#!/usr/bin/env bash
# Compiles one CUDA source of csrc/ for one architecture (ARCH, default 90) with the extension's flags (csrc/build.json, and
# torch's own: no implicit half / bfloat16 conversions, csrc/include the only include path) and
# prints ptxas' resource usage per kernel (registers, shared memory, spill stores/loads): the
# quick gate for a kernel written without a GPU, seconds instead of the whole build.
#   scripts/nvcc_one.sh csrc/cuda/staged/<file>.cu
#   ARCH=80 scripts/nvcc_one.sh csrc/cuda/<file>.cu     # for an A100 (sm_90-only code compiles out)
# Environment: CUDA_HOME (default /usr/local/cuda-13.0), TORCH_PYTHON (a python with the CUDA
# build of torch; default the CI's cached venv).
set -euo pipefail
cd "$(dirname "$0")/.."
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda-13.0}
ARCH=${ARCH:-90}
[[ $ARCH =~ ^[0-9]+$ ]] || { echo "ARCH must be a compute capability without the dot (80, 86, 89, 90, 100, 120), got '$ARCH'" >&2; exit 2; }
TORCH_PYTHON=${TORCH_PYTHON:-${DBLAST_CACHE:-$HOME/.cache/dblast_ext}/ci-cuda-torch2.14.1/bin/python}
read -r TORCH_DIR PY_INCLUDE < <("$TORCH_PYTHON" -c "import os, sysconfig, torch; print(os.path.dirname(torch.__file__), sysconfig.get_paths()['include'])")
mapfile -t FLAGS < <("$TORCH_PYTHON" -c "import json; print('\n'.join(json.load(open('csrc/build.json'))['flags']['nvcc']))")
out=$(mktemp --suffix=.o)
trap 'rm -f "$out"' EXIT
"$CUDA_HOME/bin/nvcc" -c "$1" -o "$out" -Icsrc/include -I"$TORCH_DIR/include" \
  -I"$TORCH_DIR/include/torch/csrc/api/include" -I"$PY_INCLUDE" -DTORCH_API_INCLUDE_EXTENSION_H \
  -D_GLIBCXX_USE_CXX11_ABI=1 -DDBLAST_WITH_CUDA -gencode "arch=compute_${ARCH},code=sm_${ARCH}" "${FLAGS[@]}" \
  -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__ \
  -D__CUDA_NO_HALF2_OPERATORS__ \
  --compiler-options -fPIC -Xptxas -v 2>&1 | grep -E "error|warning|Compiling entry|Used [0-9]+ registers|spill" \
  | sed -E 's/^ptxas info *: //'
exit "${PIPESTATUS[0]}"
