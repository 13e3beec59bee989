"""Tutel's ``tutel.system``: start the job, reach its session record, time steps, name files per rank.

Kept Tutel conventions: one session per process (returned by
:func:`init_data_model_parallel`, read back by :func:`get_local_session`), and
an exit hook that shuts the world down. Unlike Tutel the hook does not force
exit status 0 (an uncaught error still fails the process), and the process
group is closed with fmoe's collective ``close()``, which keeps gloo from
aborting at interpreter exit.
"""
from __future__ import annotations

import atexit
import logging
import os
import re
import time

from . import net
from ._groups import SESSION as _SESSION
from ._groups import close_all

__all__ = ["init_data_model_parallel", "get_local_session", "record_time", "apply_rank_size_from_pattern",
           "cache", "LocalCache", "save", "load"]

_EXIT_HOOK: list = []


def init_data_model_parallel(group_count: int = 1, backend: str = "nccl"):
    """Start the world (torch.distributed under torchrun with ``backend`` 'gloo'/'nccl'; mpi4py under
    mpiexec or with ``backend='mpi'``; one process otherwise) and split it into ``group_count``
    model groups. Returns the session record of :func:`fmoe.compat.tutel.net.create_groups_from_world`
    with ``is_cuda`` added."""
    if backend not in ("gloo", "nccl", "mpi"):
        raise ValueError(f"init_data_model_parallel: backend must be 'gloo', 'nccl' or 'mpi', got {backend!r}")
    session = net.create_groups_from_world(group_count=group_count, include_init=backend)
    session.is_cuda = session.local_device is not None and session.local_device.type == "cuda"
    _SESSION[:] = [session]
    if not _EXIT_HOOK:
        _EXIT_HOOK.append(atexit.register(close_all))
    return session


def get_local_session():
    """The session of the last :func:`init_data_model_parallel` call."""
    if not _SESSION:
        raise RuntimeError("no session: call system.init_data_model_parallel() first "
                           "(or system.record_time(is_cuda=False) to time without one)")
    return _SESSION[0]


def record_time(is_cuda=None) -> float:
    """``time.perf_counter()`` after synchronising CUDA when the session (or ``is_cuda``) says so."""
    is_cuda = get_local_session().is_cuda if is_cuda is None else is_cuda
    if is_cuda:
        import torch
        torch.cuda.synchronize()
    return time.perf_counter()


def apply_rank_size_from_pattern(filename: str, rank: int, size: int, create_dir: bool = True) -> str:
    """Replace ``{rank}`` and ``{size}`` in ``filename``; create its folder if asked."""
    if not re.search(r"\{rank\}", filename):
        logging.warning("Keyword `{rank}` is not found in file pattern: %s, which may cause collision in "
                        "file access.", filename)
    filename = filename.replace("{size}", str(size)).replace("{rank}", str(rank))
    if create_dir and os.path.dirname(filename):
        os.makedirs(os.path.dirname(filename), exist_ok=True)
    return filename


class LocalCache:
    """Tutel's process-wide key/value cache."""

    _CACHE: dict = {}

    @staticmethod
    def reset():
        LocalCache._CACHE = {}

    @staticmethod
    def set(key, val):
        LocalCache._CACHE[key] = val

    @staticmethod
    def get(key=None):
        if key not in LocalCache._CACHE:
            return list(LocalCache._CACHE.values())
        return LocalCache._CACHE[key]


def cache():
    return LocalCache


def save(t, path) -> None:
    """Write a tensor as a .npy file."""
    import numpy as np
    np.save(path, t.detach().cpu().numpy())


def load(path, device=None):
    """Read a .npy file as a tensor."""
    import numpy as np
    import torch
    return torch.tensor(np.load(path), device=device)
