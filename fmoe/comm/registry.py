"""What fmoe keeps per communicator: an int handle and the agreement call counter.

``torch.library`` custom ops (needed so torch.compile can trace through a
collective without seeing MPI or gloo objects) take only tensors and plain
numbers, so each communicator gets an int handle here and the op looks it up.
The step-agreement check (:mod:`.agreement`) numbers every agreement call per
communicator. Both live in this module, keyed by the communicator's identity:
nothing is ever set on the user's communicator object.

Handles are process-local and never reused. A communicator with a handle is
kept alive by the registry until :func:`forget` (a compiled graph may still
name the handle); one that only has a call counter is held weakly when it can
be (entries vanish with the object), strongly otherwise (until :func:`forget`).
"""
from __future__ import annotations

import itertools
import threading
import weakref
from typing import Optional


_lock = threading.Lock()
_next = itertools.count(1)


class _Entry:
    __slots__ = ("handle", "calls", "closed", "ref", "strong", "cache")

    def __init__(self):
        self.cache: dict = {}
        self.handle: Optional[int] = None
        self.calls = 0
        self.closed = False
        self.ref = None      # weakref to the communicator, when it supports one
        self.strong = None   # the communicator itself, while it has a handle or cannot be weakly held


_by_id: dict[int, _Entry] = {}
_by_handle: dict[int, object] = {}
_handle_by_id: dict[int, int] = {}  # id(comm) -> handle, for the lock-free path of handle_of


def _drop(key: int, ref) -> None:
    with _lock:
        e = _by_id.get(key)
        if e is not None and e.ref is ref:
            del _by_id[key]


def _entry(comm) -> _Entry:
    """The entry of ``comm`` (created on first use). Caller holds ``_lock``."""
    key = id(comm)
    e = _by_id.get(key)
    if e is not None and (e.strong is comm or (e.ref is not None and e.ref() is comm)):
        return e
    e = _Entry()
    try:
        e.ref = weakref.ref(comm, lambda r, key=key: _drop(key, r))
    except TypeError:  # no __weakref__ slot: hold it until forget()
        e.strong = comm
    _by_id[key] = e
    return e


def handle_of(comm) -> int:
    """The handle of ``comm``, registering it on first use (keeps it alive until :func:`forget`)."""
    # Lock-free lookup first: torch.compile traces this call and cannot enter a lock.
    h = _handle_by_id.get(id(comm))
    if h is not None and _by_handle.get(h) is comm:
        return h
    with _lock:
        e = _entry(comm)
        if e.handle is None:
            e.handle = next(_next)
            _by_handle[e.handle] = comm
            _handle_by_id[id(comm)] = e.handle
            e.strong = comm
        return e.handle


def lookup(handle: int):
    try:
        return _by_handle[handle]
    except KeyError:
        raise KeyError(f"no communicator registered under handle {handle}; was it forgotten "
                       "or created in another process?") from None


def next_call(comm) -> int:
    """Number this agreement call on ``comm``: 1, 2, 3, ... (per communicator object)."""
    with _lock:
        e = _entry(comm)
        e.calls += 1
        return e.calls


def calls_of(comm) -> int:
    """How many agreement calls ``comm`` has made so far (0 if none)."""
    with _lock:
        e = _by_id.get(id(comm))
        if e is None or not (e.strong is comm or (e.ref is not None and e.ref() is comm)):
            return 0
        return e.calls


def cache_of(comm) -> dict:
    """A dict fmoe may memoise per-communicator objects in (e.g. sub-communicators from split)."""
    with _lock:
        return _entry(comm).cache


def mark_closed(comm) -> None:
    """Record that ``comm`` was shut down (its end-of-job check is done)."""
    with _lock:
        _entry(comm).closed = True


def is_closed(comm) -> bool:
    with _lock:
        e = _by_id.get(id(comm))
        return bool(e is not None and e.closed and (e.strong is comm or (e.ref is not None and e.ref() is comm)))


def forget(comm) -> None:
    """Drop everything kept for ``comm`` (call before freeing an MPI communicator)."""
    with _lock:
        e = _by_id.get(id(comm))
        if e is None or not (e.strong is comm or (e.ref is not None and e.ref() is comm)):
            return
        del _by_id[id(comm)]
        if e.handle is not None:
            _by_handle.pop(e.handle, None)
            _handle_by_id.pop(id(comm), None)


def forget_all() -> None:
    """Drop every registered communicator (end of job: lets their process groups be freed
    while the interpreter is still intact)."""
    with _lock:
        _by_handle.clear()
        _handle_by_id.clear()
        _by_id.clear()
