"""Receive buffers a communicator reuses across calls (large CPU exchanges only).

An expert-parallel step receives a few buffers of tens of MB (the dispatched rows, the expert
outputs coming back, their gradients). A fresh allocation that large is handed out by the C
library as new pages, and the kernel zero-fills each page on its first touch: on 2 ranks a
25 MB all-to-all-v into a fresh buffer took twice as long as into a reused one. So the
communicators take their receive buffers from a small pool per communicator: a buffer is reused
once nothing but the pool refers to its memory (no tensor, view or saved-for-backward tensor),
which is what a step leaves behind when it ends.

    out = recv_buffer(comm, (rows, M), torch.float32)   # a plain tensor, contents undefined

The returned tensor is not a view (``_base`` is None); it owns its storage together with the
pool, so its storage may be larger than ``out.nbytes``. Small buffers (< :data:`MIN_BYTES`) and
non-CPU devices are allocated plainly (the CUDA caching allocator already reuses memory). A pool
keeps at most :data:`MAX_BUFFERS` buffers (the latest it had to allocate, held between calls like
a caching allocator's); :func:`fmoe.comm.forget` drops a communicator's pool with the rest of its
bookkeeping.
"""
from __future__ import annotations

import math
import threading
from typing import Sequence

import torch
from torch import Tensor

from .registry import cache_of

__all__ = []   # the communicators' own bookkeeping (MPIComm, TorchDistComm): nothing here for users

MIN_BYTES = 1 << 20        # below this the C library's free lists serve allocations without page faults
MAX_BUFFERS = 8            # per communicator: a few MoE layers' exchanges in flight between forward and backward
_PAGE = 4096
_KEY = "fmoe.comm.buffers: receive pool"


def _use_count(storage: torch.UntypedStorage) -> int:
    # References to the storage's memory: the pool's storage object (one, however many Python names
    # point at it) plus every tensor on it (views and autograd's saved tensors included).
    return torch._C._storage_Use_Count(storage._cdata)


class BufferPool:
    """At most ``max_buffers`` CPU byte storages, each lent out again once no tensor uses it.

    ``take`` returns an uninitialised contiguous tensor of ``shape`` and ``dtype`` on a free
    pooled storage of at least its bytes (at most twice: a small request never pins a large
    buffer) or on a new one, which joins the pool while there is room or replaces the oldest free
    buffer. When every pooled buffer is in use and the pool is full, the tensor is a plain
    allocation. Thread-safe.
    """

    def __init__(self, max_buffers: int = MAX_BUFFERS, min_bytes: int = MIN_BYTES):
        if not isinstance(max_buffers, int) or max_buffers < 0:
            raise ValueError(f"max_buffers must be an int >= 0, got {max_buffers!r}")
        self.max_buffers = max_buffers
        self.min_bytes = min_bytes
        self._storages: list[torch.UntypedStorage] = []   # oldest first
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._storages)

    def take(self, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
        shape = tuple(int(s) for s in shape)
        need = math.prod(shape) * dtype.itemsize
        if need < self.min_bytes or self.max_buffers == 0:
            return torch.empty(shape, dtype=dtype)
        storage = self._free_storage(need)
        out = torch.empty(0, dtype=dtype)
        return out.set_(storage, 0, shape, torch.empty(shape, dtype=dtype, device="meta").stride())

    def _free_storage(self, need: int) -> torch.UntypedStorage:
        with self._lock:
            best, oldest_free = None, None
            for i, s in enumerate(self._storages):
                if _use_count(s) > 1:          # a tensor still uses it
                    continue
                if oldest_free is None:
                    oldest_free = i
                if need <= s.nbytes() <= 2 * need and (best is None or s.nbytes() < self._storages[best].nbytes()):
                    best = i
            if best is not None:
                return self._storages[best]
            # a little headroom: the rows received vary from step to step with the routing
            size = -(-(need + need // 16) // _PAGE) * _PAGE
            fresh = torch.UntypedStorage(size)
            if len(self._storages) < self.max_buffers:
                self._storages.append(fresh)
            elif oldest_free is not None:
                del self._storages[oldest_free]
                self._storages.append(fresh)
            return fresh


def recv_buffer(comm, shape: Sequence[int], dtype: torch.dtype, device=None) -> Tensor:
    """An uninitialised contiguous receive buffer for ``comm``: from ``comm``'s pool on the CPU
    (:class:`BufferPool`), a plain ``torch.empty`` elsewhere."""
    if device is not None and torch.device(device).type != "cpu":
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    cache = cache_of(comm)
    pool = cache.get(_KEY)
    if pool is None:
        pool = cache.setdefault(_KEY, BufferPool())
    return pool.take(shape, dtype)
