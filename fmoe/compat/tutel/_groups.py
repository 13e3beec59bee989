"""Tutel ``group=`` arguments -> fmoe communicators.

Tutel passes torch.distributed process groups around, with ``None`` meaning
the default world group. fmoe's collectives take a communicator object. A
Tutel ``group`` here may be:

* ``None``: the job's world (the torch.distributed default group if one is
  initialised, else the MPI world set up by ``system.init_data_model_parallel``,
  else one process);
* a torch.distributed ``ProcessGroup``;
* any fmoe communicator (``LocalComm``, ``TorchDistComm``, ``MPIComm``):
  passed through unchanged.

One communicator is kept per process group (a cache, Tutel's convention), so a
group's collectives always go through the same registered handle.
"""
from __future__ import annotations

import sys

from ...comm import LocalComm


_BY_GROUP: dict = {}
_WORLD: list = []  # the MPI world communicator, when the session runs over MPI
SESSION: list = []  # Tutel's one session record per process (system.init_data_model_parallel)
OWNED: list = []  # True once this layer started torch.distributed itself (then it also shuts it down)


def session_local_size() -> int:
    """Ranks per node of the current session (for 2DH); 1 without a session."""
    return SESSION[0].local_size if SESSION else 1


def _dist():
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        import torch.distributed as dist
    return dist


def _torch_ready() -> bool:
    dist = _dist()
    return dist.is_available() and dist.is_initialized()


def set_world(comm) -> None:
    """Make ``comm`` (the world communicator the session started) the one ``group=None`` resolves to."""
    if _torch_ready() and comm.size == _dist().get_world_size():
        _BY_GROUP["WORLD"] = comm
    else:
        _WORLD[:] = [comm]


def _is_comm(obj) -> bool:
    return hasattr(obj, "all_to_all") and hasattr(obj, "size") and hasattr(obj, "rank")


def comm_of(group=None):
    """The fmoe communicator for a Tutel ``group`` argument (see the module docstring)."""
    if group is not None and _is_comm(group):
        return group
    if group is None and not _torch_ready():
        if _WORLD:
            return _WORLD[0]
        from ...comm.launch import launched_world
        launcher, size = launched_world()
        if size > 1:   # group=None is the job's world: never each rank alone, silently
            raise RuntimeError(
                f"group=None is the job's world, but this process is one of {size} ranks started by {launcher} "
                "and no world is set up: call fmoe.compat.tutel.system.init_data_model_parallel() first (as "
                "Tutel scripts do), or pass group=fmoe.comm.LocalComm() to run each rank on its own on purpose")
        return LocalComm()
    if not _torch_ready():
        raise ValueError(f"group={group!r} is a torch.distributed group, but torch.distributed is not initialised")
    key = "WORLD" if group is None or group is _dist().group.WORLD else group
    comm = _BY_GROUP.get(key)
    if comm is None:
        from ...comm import TorchDistComm
        comm = _BY_GROUP[key] = TorchDistComm(None if key == "WORLD" else group)
    return comm


def world_size_of(group=None) -> int:
    return comm_of(group).size


def close_all() -> None:
    """End of job: shut down what this layer started (collective) and drop the cache."""
    world = _BY_GROUP.pop("WORLD", None)
    _BY_GROUP.clear()
    if OWNED and _torch_ready():  # a job started elsewhere is shut down by whoever started it
        from ...comm import TorchDistComm
        (world or TorchDistComm()).close()
    OWNED.clear()
    for comm in _WORLD:
        if hasattr(comm, "close"):
            comm.close()
    _WORLD.clear()
