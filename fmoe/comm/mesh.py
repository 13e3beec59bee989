"""Meshes: expert-parallel groups inside data-parallel replicas inside pipeline stages.

    m = fmoe.comm.mesh(ep=2, dp=2)          # under torchrun --nproc_per_node=4
    layer = MoELayer(..., comm=m.ep)        # experts spread over the 2 ranks of m.ep
    m.device_mesh["dp"]                     # the DeviceMesh FSDP2 / DDP recipes use

Rank layout (``init_device_mesh`` with dims ``("pp", "dp", "ep")``, ep innermost)::

    global rank = (pp_rank * dp + dp_rank) * ep + ep_rank

so the ranks of one expert group are consecutive (on one node when ep <= ranks per node,
where the all-to-alls are), the ``dp`` replicas of one expert group are ``ep`` apart, and
the pipeline stages are ``dp * ep`` apart.

Gradient groups (what the recipes of :mod:`fmoe.distributed` reduce over):

* dense (replicated) parameters: every rank of a stage holds a copy and sees its own
  tokens, so their gradients are averaged over the ``dp * ep`` ranks of the stage
  (:attr:`MoEMesh.dense`);
* expert parameters: rank ``ep_rank`` of every dp replica holds the same experts, and the
  all-to-all's backward has already summed the contributions of the ``ep`` ranks of its
  group, so they are summed over the ``dp`` replicas (:attr:`MoEMesh.dp`) and divided by
  ``dp * ep``.

MPI jobs (``mpiexec``, :class:`mpi_backend.MPIComm`) express the same shape with
``comm.split(color, key)``: the expert group of a rank is ``comm.split(pp_rank * dp +
dp_rank)``, its data-parallel group ``comm.split(pp_rank * ep + ep_rank)``, its stage
``comm.split(pp_rank)`` and its pipeline ``comm.split(dp_rank * ep + ep_rank)``, with the
coordinates computed from ``comm.rank`` by the layout above; :func:`mesh_from_comm` does
exactly that and returns the same :class:`MoEMesh` (without a ``DeviceMesh``, which only
torch.distributed has: the FSDP2 / DDP / pipelining recipes need :func:`mesh`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

__all__ = ["MoEMesh", "mesh", "mesh_comm", "mesh_from_comm", "parse_mesh", "check_mesh_sizes", "DIMS"]

DIMS = ("pp", "dp", "ep")  # outermost first: ep innermost keeps expert groups consecutive


@dataclasses.dataclass(frozen=True)
class MoEMesh:
    """One rank's view of a (pp, dp, ep) mesh.

    Attributes:
        pp, dp, ep: the mesh's sizes (pipeline stages, data-parallel replicas, expert-parallel
            ranks); pp * dp * ep == world size.
        pp_rank, dp_rank, ep_rank: this rank's coordinates.
        ep_comm: fmoe communicator of this rank's expert group (size ep): pass it as
            ``comm=`` to :class:`fmoe.nn.MoELayer` / :func:`fmoe.moe`.
        dp_comm: fmoe communicator of the ranks holding the same experts (size dp).
        dense_comm: fmoe communicator of this rank's stage (size dp * ep): the replicas of
            the dense parameters.
        pp_comm: fmoe communicator of this rank's pipeline (size pp, one rank per stage).
        device_mesh: the ``torch.distributed.device_mesh.DeviceMesh`` with dims
            ("pp", "dp", "ep"), or None for :func:`mesh_from_comm`.
        dense_mesh: 1-D DeviceMesh over the stage's dp * ep ranks (FSDP2 shards dense
            parameters over it), or None.
    """

    pp: int
    dp: int
    ep: int
    pp_rank: int
    dp_rank: int
    ep_rank: int
    ep_comm: Any
    dp_comm: Any
    dense_comm: Any
    pp_comm: Any
    device_mesh: Any = None
    dense_mesh: Any = None

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.ep

    @property
    def data_rank(self) -> int:
        """Index of this rank's data shard: dp_rank * ep + ep_rank (the stages of one pipeline share it)."""
        return self.dp_rank * self.ep + self.ep_rank

    @property
    def data_size(self) -> int:
        """Number of data shards, dp * ep."""
        return self.dp * self.ep

    @property
    def dp_group(self):
        """The torch.distributed group of :attr:`dp_comm` (None for an MPI mesh)."""
        return getattr(self.dp_comm, "group", None)

    @property
    def dense_group(self):
        """The torch.distributed group of :attr:`dense_comm` (None for an MPI mesh)."""
        return getattr(self.dense_comm, "group", None)

    def describe(self) -> str:
        return (f"mesh pp={self.pp} dp={self.dp} ep={self.ep}; this rank: pp_rank={self.pp_rank} "
                f"dp_rank={self.dp_rank} ep_rank={self.ep_rank}")


def check_mesh_sizes(world: int, *, ep: int = 1, dp: int = 1, pp: int = 1,
                     num_experts: Optional[int] = None) -> None:
    """Raise ``ValueError`` naming the counts unless (ep, dp, pp) tile ``world`` ranks (and E)."""
    for name, v in (("ep", ep), ("dp", dp), ("pp", pp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"mesh size {name}={v!r} must be a positive int")
    if ep * dp * pp != world:
        raise ValueError(f"mesh pp={pp} x dp={dp} x ep={ep} = {pp * dp * ep} ranks, but the job has {world}; "
                         f"choose sizes whose product is {world} (e.g. torchrun --nproc_per_node={pp * dp * ep})")
    if num_experts is not None and num_experts % ep:
        raise ValueError(f"{num_experts} experts cannot be spread over ep={ep} ranks: E % ep must be 0 "
                         f"(use an ep that divides {num_experts}, or {ep * -(-num_experts // ep)} experts)")


def _coords(rank: int, ep: int, dp: int) -> tuple[int, int, int]:
    return rank // (dp * ep), (rank // ep) % dp, rank % ep


def mesh(*, ep: int = 1, dp: int = 1, pp: int = 1, device_type: Optional[str] = None,
         num_experts: Optional[int] = None) -> MoEMesh:
    """A (pp, dp, ep) DeviceMesh over the initialised torch.distributed job, as a :class:`MoEMesh`.

    Collective: every rank calls it with the same sizes. Initialises the default process group
    from torchrun's variables (gloo on CPU, nccl for ``device_type="cuda"``) when it is not
    initialised yet.

    Args:
        ep, dp, pp: mesh sizes, positive, with pp * dp * ep == world size.
        device_type: "cpu" or "cuda" (default: "cuda" if the default group's backend is nccl).
        num_experts: if given, also checks that E % ep == 0.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from .torch_dist import TorchDistComm

    if not dist.is_initialized():
        TorchDistComm.from_env(backend="nccl" if device_type == "cuda" else "gloo")
    world = dist.get_world_size()
    check_mesh_sizes(world, ep=ep, dp=dp, pp=pp, num_experts=num_experts)
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    dm = init_device_mesh(device_type, (pp, dp, ep), mesh_dim_names=DIMS)
    # The stage's dp x ep ranks as one flat dimension: the dense parameters' replicas.
    dense = dm["dp", "ep"]._flatten("dp_ep")
    pp_rank, dp_rank, ep_rank = _coords(dist.get_rank(), ep, dp)
    return MoEMesh(pp=pp, dp=dp, ep=ep, pp_rank=pp_rank, dp_rank=dp_rank, ep_rank=ep_rank,
                   ep_comm=mesh_comm(dm, "ep"), dp_comm=mesh_comm(dm, "dp"),
                   dense_comm=TorchDistComm(dense.get_group()), pp_comm=mesh_comm(dm, "pp"),
                   device_mesh=dm, dense_mesh=dense)


def mesh_comm(device_mesh, dim: str):
    """:class:`~fmoe.comm.TorchDistComm` over one named dimension of a ``DeviceMesh``."""
    from .torch_dist import TorchDistComm
    names = tuple(device_mesh.mesh_dim_names or ())
    if dim not in names:
        raise ValueError(f"device mesh has dimensions {names}, no {dim!r}; build it with "
                         f"init_device_mesh(..., mesh_dim_names=(..., {dim!r}))")
    return TorchDistComm(device_mesh.get_group(dim))


def mesh_from_comm(comm, *, ep: int = 1, dp: int = 1, pp: int = 1,
                   num_experts: Optional[int] = None) -> MoEMesh:
    """The same :class:`MoEMesh` over any fmoe communicator (e.g. ``MPIComm``) by ``comm.split``.

    Collective over ``comm`` (four splits). ``device_mesh`` and ``dense_mesh`` are None.
    """
    check_mesh_sizes(comm.size, ep=ep, dp=dp, pp=pp, num_experts=num_experts)
    pp_rank, dp_rank, ep_rank = _coords(comm.rank, ep, dp)
    # Keys are the rank in comm, so each sub-group's order is the global order (TorchDistComm needs it).
    return MoEMesh(pp=pp, dp=dp, ep=ep, pp_rank=pp_rank, dp_rank=dp_rank, ep_rank=ep_rank,
                   ep_comm=comm.split(pp_rank * dp + dp_rank, comm.rank),
                   dp_comm=comm.split(pp_rank * ep + ep_rank, comm.rank),
                   dense_comm=comm.split(pp_rank, comm.rank),
                   pp_comm=comm.split(dp_rank * ep + ep_rank, comm.rank))


def parse_mesh(text: str) -> dict:
    """``"ep=2,dp=2"`` -> ``{"ep": 2, "dp": 2, "pp": 1}`` (the example's ``--mesh`` flag)."""
    sizes = {"ep": 1, "dp": 1, "pp": 1}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in sizes:
            raise ValueError(f"--mesh takes comma-separated name=size with names {DIMS}, got {text!r}")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise ValueError(f"--mesh size {part!r} is not an integer") from None
    return sizes
