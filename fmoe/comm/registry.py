"""Integer handles for communicators.

``torch.library`` custom ops (needed so torch.compile can trace through a
collective without seeing MPI or gloo objects) take only tensors and plain
numbers, so each communicator gets an int handle here and the op looks it up.
Handles are process-local and never reused.
"""
from __future__ import annotations

import itertools
import threading

__all__ = ["handle_of", "lookup", "forget", "forget_all"]

_lock = threading.Lock()
_next = itertools.count(1)
_by_handle: dict[int, object] = {}


def handle_of(comm) -> int:
    """The handle of ``comm``, registering it on first use (keeps it alive until :func:`forget`)."""
    h = getattr(comm, "_fmoe_handle", None)
    if h is not None and _by_handle.get(h) is comm:
        return h
    with _lock:
        h = next(_next)
        _by_handle[h] = comm
    try:
        comm._fmoe_handle = h
    except AttributeError:  # e.g. __slots__: fall back to a scan on every call
        pass
    return h


def lookup(handle: int):
    try:
        return _by_handle[handle]
    except KeyError:
        raise KeyError(f"no communicator registered under handle {handle}; was it forgotten "
                       "or created in another process?") from None


def forget(comm) -> None:
    """Drop the registry's reference (call before freeing an MPI communicator)."""
    h = getattr(comm, "_fmoe_handle", None)
    with _lock:
        if h is not None and _by_handle.get(h) is comm:
            del _by_handle[h]


def forget_all() -> None:
    """Drop every registered communicator (end of job: lets their process groups be freed
    while the interpreter is still intact)."""
    with _lock:
        _by_handle.clear()
