"""numba runtime set-up: the TBB threading layer, thread counts, and call safety.

Import this module before any numba ``parallel=True`` kernel runs: numba picks
its threading layer once, at the first parallel launch, and TBB is the only
layer that is both fork-safe (DataLoader workers) and safe for concurrent
calls from several Python threads (OpenMP aborts forked children; workqueue
aborts on concurrent launches).

The ``tbb`` wheel installs ``libtbb.so.12`` into ``<sys.prefix>/lib``, which
the dynamic loader does not search, so numba's TBB pool extension fails to
load unless the library is already in the process. We load it with
``RTLD_GLOBAL`` here. When that fails we fall back to numba's ``workqueue``
layer (fork-safe) and serialise kernel launches with a lock, because
workqueue is not thread-safe; :func:`threading_layer` says which is active.
"""
from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import sys
import threading
from typing import Iterator, Optional

import numba


TBB_ERROR: Optional[str] = None  # why TBB could not be loaded (None when it was)
_TBB_PATH: Optional[str] = None
_TBB_HANDLE = None


def _tbb_candidates() -> list[str]:
    # Every prefix a pip install may have used; the first hit wins.
    prefixes = []
    for p in (sys.prefix, sys.exec_prefix, getattr(sys, "base_prefix", None)):
        if p and p not in prefixes:
            prefixes.append(p)
    found = []
    for p in prefixes:
        found += sorted(glob.glob(os.path.join(p, "lib", "libtbb.so.12*")))
    return found


def _load_tbb() -> None:
    global TBB_ERROR, _TBB_PATH, _TBB_HANDLE
    errors = []
    # The loader may already find it (LD_LIBRARY_PATH, system package): try the soname first.
    for path in ["libtbb.so.12", *_tbb_candidates()]:
        try:
            _TBB_HANDLE = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            _TBB_PATH = path
            break
        except OSError as exc:
            errors.append(f"{path}: {exc}")
    if _TBB_HANDLE is None:
        TBB_ERROR = "libtbb.so.12 not found (" + "; ".join(errors) + "); is the 'tbb' wheel installed?"
        return
    try:
        from numba.np.ufunc import tbbpool  # noqa: F401  (the extension that needs libtbb)
    except Exception as exc:  # a broken or too old TBB: numba would refuse it later anyway
        TBB_ERROR = f"numba's TBB pool did not load with {_TBB_PATH}: {exc}"


_load_tbb()
if TBB_ERROR is None:
    numba.config.THREADING_LAYER = "tbb"
else:
    numba.config.THREADING_LAYER = "workqueue"

# Only needed for workqueue, which aborts when two threads launch at once.
_LAUNCH_LOCK: Optional[threading.Lock] = threading.Lock() if TBB_ERROR is not None else None


def tbb_library() -> Optional[str]:
    """Path (or soname) of the libtbb that was loaded, or None."""
    return _TBB_PATH


def threading_layer() -> str:
    """The numba threading layer fmoe's kernels use: 'tbb' or 'workqueue'.

    Reports the layer numba actually launched when a parallel kernel has run,
    otherwise the layer that will be requested at the first launch.
    """
    try:
        return numba.threading_layer()
    except ValueError:  # no parallel kernel has run yet in this process
        return numba.config.THREADING_LAYER


def sync_threads() -> int:
    """Make numba's thread count on this thread follow ``torch.get_num_threads()``.

    numba's count is per calling thread, so this is called before every kernel.
    Returns the count set.
    """
    import torch  # local: keep this module importable without torch for warm-up tooling

    n = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    if numba.get_num_threads() != n:
        numba.set_num_threads(n)
    return n


@contextlib.contextmanager
def kernel_call() -> Iterator[None]:
    """Context for one kernel launch: thread count synced, serialised if needed."""
    sync_threads()
    if _LAUNCH_LOCK is None:
        yield
    else:
        with _LAUNCH_LOCK:
            yield
