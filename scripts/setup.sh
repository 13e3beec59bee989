#!/usr/bin/env bash
# Create .venv (if missing) and install fmoe with its test/example dependencies.
# Uses the CPU build of torch: the "+cpu" local version can never resolve to a
# multi-GB CUDA wheel. Pick the interpreter with PYTHON=... (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
if ! "$VPY" -c "import torch" 2>/dev/null; then
  echo "[setup] installing torch (CPU build)"
  "$VPY" -m pip install -q "torch==2.13.0+cpu" \
    || "$VPY" -m pip install -q "torch==2.13.0+cpu" --index-url https://download.pytorch.org/whl/cpu
fi
echo "[setup] installing fmoe and its dependencies"
"$VPY" -m pip install -q -e ".[test,examples]"
# The native CPU grouped GEMM (fmoe/ops/csrc): prints why and exits 0 without a C++
# compiler (fmoe then uses the torch fallback), non-zero when a present compiler fails.
"$VPY" -m fmoe build
"$VPY" -c "import torch, numba, fmoe; print(f'[setup] torch {torch.__version__}, numba {numba.__version__}, fmoe {fmoe.__version__}')"
