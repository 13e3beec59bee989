"""Import numba with the TBB threading layer.

The `tbb` wheel installs libtbb.so.12 into <sys.prefix>/lib, which the dynamic loader does not
search, so numba would report "No threading layer could be loaded". Loading the library with
RTLD_GLOBAL before numba first launches a parallel region fixes that. OpenMP is avoided
because it kills forked children; workqueue aborts on concurrent calls (DESIGN.md).

Self-contained on purpose: fmoe/_numba.py (dispatch kernels) may do the same independently;
loading the same library twice is harmless.
"""
from __future__ import annotations

import ctypes
import glob
import os
import sys

_TBB_LOADED = False


def _load_tbb() -> bool:
    candidates = []
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        candidates += sorted(glob.glob(os.path.join(prefix, "lib", "libtbb.so.12*")))
    for path in candidates:
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return True
        except OSError:
            continue
    return False


_TBB_LOADED = _load_tbb()

import numba  # noqa: E402  (must come after the library is loaded)

if _TBB_LOADED and numba.config.THREADING_LAYER == "default":
    numba.config.THREADING_LAYER = "tbb"


def threading_layer() -> str:
    """Name of the numba threading layer in use (valid after the first parallel kernel ran)."""
    try:
        return numba.threading_layer()
    except ValueError:
        return f"not initialised (requested: {numba.config.THREADING_LAYER})"


def sync_threads() -> None:
    """Match numba's worker count to torch's intra-op thread count on the calling thread."""
    import torch

    numba.set_num_threads(max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)))
