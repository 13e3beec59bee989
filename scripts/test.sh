#!/usr/bin/env bash
# Install, then run the whole test suite: single-process tests, then the MPI
# tests under mpiexec with 2 and 4 ranks (oversubscribed on small machines).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=.venv/bin/python
export PATH="$PWD/.venv/bin:$PATH"
if command -v nvcc >/dev/null 2>&1; then
  echo "[test] building native/ (CUDA kernels) with $(nvcc --version | tail -1)"
  bash native/build.sh
fi
echo "[test] single-process suite"
"$PY" -m pytest -q tests "$@"
if [ -d tests/mpi ] && ls tests/mpi/test_*.py >/dev/null 2>&1; then
  for n in 2 4; do
    echo "[test] MPI suite on $n ranks"
    timeout 900 mpiexec -n "$n" "$PY" -m pytest -q -p no:cacheprovider tests/mpi
  done
fi
echo "[test] all suites passed"
