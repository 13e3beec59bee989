#!/usr/bin/env bash
# Install, then run the whole test suite: single-process tests, then the MPI
# tests under mpiexec with 2 and 4 ranks (oversubscribed on small machines).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=.venv/bin/python
export PATH="$PWD/.venv/bin:$PATH"
# Where this run ran, first: a result that differs by host (BLAS paths, ISA, threads) says so.
"$PY" - <<'PYEOF'
import os, platform, re
import torch
info = {}
try:
    for line in open("/proc/cpuinfo"):
        k, _, v = line.partition(":")
        info.setdefault(k.strip(), v.strip())
except OSError:
    pass
flags = set((info.get("flags") or info.get("Features") or "").split())
isa = next((n for n in ("avx512f", "avx2", "avx", "sve", "asimd") if n in flags), "baseline")
cfg = torch.__config__.show()
m = re.search(r"Math Kernel Library Version ([0-9.]+)", cfg)
blas = f"MKL {m.group(1)}" if m else (re.search(r"BLAS_INFO=(\w+)", cfg) or [None, "unknown"])[1]
mkl_env = " ".join(f"{k}={os.environ[k]}" for k in ("MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR") if k in os.environ)
import numba
from numba import njit, prange
from fmoe import _numba   # fmoe's layer preference, as its kernels launch with it


@njit(parallel=True, cache=False)
def _probe(n):
    s = 0
    for i in prange(n):
        s += i
    return s


_probe(4)   # the layer is only known after a parallel launch
print(f"[test] host: {info.get('model name') or platform.processor() or platform.machine()} "
      f"({info.get('vendor_id', platform.machine())}, {os.cpu_count()} CPUs); ISA {isa}, torch CPU capability "
      f"{torch.backends.cpu.get_cpu_capability()}; BLAS {blas}{' ' + mkl_env if mkl_env else ''}")
print(f"[test] torch {torch.__version__}, {torch.get_num_threads()} threads; numba {numba.__version__}, "
      f"threading layer {_numba.threading_layer()}; python {platform.python_version()}")
PYEOF
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
