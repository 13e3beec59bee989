"""Communicators: the object that carries every cross-process exchange.

fmoe never reaches for a global process group. Functions that need other ranks
take a ``comm`` argument implementing :class:`Communicator`; ``None`` or
:class:`LocalComm` means a single process.

* :class:`LocalComm` (one process), :class:`TorchDistComm` (torch.distributed),
  ``mpi_backend.MPIComm`` (mpi4py), :class:`Hierarchical2DComm` (2DH wrapper).
* Differentiable collectives for models: :func:`all_to_all`, :func:`all_gather`,
  :func:`reduce_scatter`, :func:`all_to_all_v` (torch.func and torch.compile safe).
* Meshes: :func:`mesh` (a (pp, dp, ep) DeviceMesh under torchrun), :func:`mesh_comm`,
  :func:`mesh_from_comm` (the same over MPIComm by splits); :class:`MoEMesh` (:mod:`.mesh`).
* Launch helpers: :func:`from_env`, :func:`abort_on_error`, :func:`install_excepthook`,
  :func:`get_logger`.
* Fault handling: every distributed call agrees on its step and settings first
  (:mod:`.agreement`; the record rides on the call's first exchange), and with
  ``checks="full"`` (the default) every collective of MPIComm/TorchDistComm is matched by a small
  control record (:mod:`.matching`; ``checks="step"`` / ``"off"`` trade that away); mismatches raise :class:`StepMismatchError` / :class:`CollectiveMismatchError`.
"""
from __future__ import annotations

from .agreement import CollectiveMismatchError, InconsistentRanksError, StepMismatchError
from .base import Communicator, LocalComm, resolve
from .collectives import all_gather, all_to_all, all_to_all_v, reduce_scatter
from .hierarchical import Hierarchical2DComm
from .launch import abort, abort_on_error, from_env, get_logger, install_excepthook
# The function ``mesh`` deliberately shadows its module's name on the package: ``fmoe.comm.mesh(ep=2)``
# builds a mesh; ``from fmoe.comm.mesh import MoEMesh`` still reaches the module (sys.modules).
from .mesh import MoEMesh, mesh, mesh_comm, mesh_from_comm
from .registry import forget, handle_of


def __getattr__(name):
    # torch.distributed is imported only when TorchDistComm is asked for.
    if name == "TorchDistComm":
        from .torch_dist import TorchDistComm
        return TorchDistComm
    raise AttributeError(name)


__all__ = ["Communicator", "LocalComm", "TorchDistComm", "Hierarchical2DComm", "resolve",
           "all_to_all", "all_gather", "reduce_scatter", "all_to_all_v",
           "from_env", "abort", "abort_on_error", "InconsistentRanksError", "StepMismatchError", "CollectiveMismatchError",
           "MoEMesh", "mesh", "mesh_comm", "mesh_from_comm"]
