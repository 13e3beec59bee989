"""Tutel's ``tutel.net`` over fmoe communicators.

``group`` arguments are torch.distributed process groups, ``None`` (the job's
world) or fmoe communicators (see :mod:`._groups`). Every function works with
one process (identity) and under torchrun (gloo) or mpiexec (mpi4py).

* Without backward: :func:`simple_all_reduce`, :func:`simple_all_to_all`,
  :func:`simple_split`, :func:`simple_reduce_scatter`, :func:`simple_all_gather`,
  :func:`simple_broadcast`.
* Differentiable: :func:`all_to_all`, :func:`all_gather`, :func:`zero_gather`,
  :func:`reduce_scatter`, :func:`spatial_split`.
* :func:`create_groups_from_world` (Tutel's data/model group split, cached per
  ``group_count`` as Tutel does), :func:`barrier`, :class:`TutelDistributedOptimizer`.
"""
from __future__ import annotations

import os
import types
from typing import Optional

import torch
from torch import Tensor

from ...comm import all_gather as _all_gather
from ...comm import all_to_all as _all_to_all
from ...comm import reduce_scatter as _reduce_scatter
from ._groups import OWNED, comm_of, session_local_size, set_world

__all__ = ["get_world_size", "get_world_rank", "barrier", "create_groups_from_world", "simple_broadcast",
           "simple_all_reduce", "simple_all_to_all", "simple_split", "simple_reduce_scatter", "simple_all_gather",
           "all_to_all", "all_gather", "zero_gather", "zero_scatter", "reduce_scatter", "spatial_split",
           "TutelDistributedOptimizer"]


def _op_name(op) -> str:
    if isinstance(op, str):
        return op
    import torch.distributed as dist
    names = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.MAX: "max", dist.ReduceOp.MIN: "min"}
    if op not in names:
        raise ValueError(f"reduce op {op!r} is not supported; use ReduceOp.SUM, MAX or MIN")
    return names[op]


def get_world_size(group=None) -> int:
    return comm_of(group).size


def get_world_rank(group=None) -> int:
    return comm_of(group).rank


def barrier(group=None) -> None:
    comm = comm_of(group)
    if comm.size > 1:
        comm.barrier()


# --------------------------------------------------------------------------- no backward

def simple_all_reduce(input: Tensor, group=None, op=None, inplace: bool = False) -> Tensor:
    """Sum (or max/min) of ``input`` over the group; a new tensor unless ``inplace``."""
    comm = comm_of(group)
    if comm.size == 1:
        return input
    out = comm.all_reduce(input.contiguous(), op="sum" if op is None else _op_name(op))
    if inplace:
        input.copy_(out)
        return input
    return out


def simple_all_to_all(input: Tensor, group=None, background: bool = False):
    """Chunk w of dim 0 goes to rank w; chunk u of the result came from rank u (all_to_all_single)."""
    comm = comm_of(group)
    out = input.contiguous() if comm.size == 1 else comm.all_to_all(input.contiguous(), 0, 0)
    return (out, lambda *args: None) if background else out


def simple_split(input: Tensor, group=None) -> Tensor:
    """This rank's chunk of dim 0."""
    comm = comm_of(group)
    if comm.size == 1:
        return input
    if input.size(0) % comm.size:
        raise ValueError(f"simple_split: dim 0 of size {input.size(0)} does not split into {comm.size} chunks")
    return input.contiguous().chunk(comm.size, 0)[comm.rank]


def simple_reduce_scatter(input: Tensor, group=None, op=None) -> Tensor:
    """This rank's dim-0 chunk of the group sum."""
    comm = comm_of(group)
    if comm.size == 1:
        return input
    return simple_split(simple_all_reduce(input, group, op=op), group)


def simple_all_gather(input: Tensor, group=None) -> Tensor:
    """Inputs of every rank concatenated along dim 0."""
    comm = comm_of(group)
    if comm.size == 1:
        return input
    return comm.all_gather(input.contiguous(), 0)


def simple_broadcast(input: Tensor, src: int = 0, group=None) -> Tensor:
    """Overwrite ``input`` with rank ``src``'s value (in place, as Tutel does)."""
    comm = comm_of(group)
    if comm.size == 1:
        return input
    rows = comm.all_gather(input.contiguous().unsqueeze(0), 0)
    input.copy_(rows[src])
    return input


# --------------------------------------------------------------------------- differentiable

def all_to_all(input: Tensor, input_dim: int, output_dim: int, use_2dh: bool = False, group=None,
               background: bool = False) -> Tensor:
    """Differentiable all-to-all: ``input_dim`` grows W times (concatenated), ``output_dim`` shrinks W times.

    ``use_2dh`` routes through fmoe's two-level exchange with the session's
    ``local_size`` (ranks per node); the bytes are the same as the flat path.
    """
    if background:
        raise ValueError("all_to_all(background=True) is a CUDA stream feature of Tutel; not available on CPU")
    comm = comm_of(group)
    if use_2dh and comm.size > 1:
        local = session_local_size()
        if 1 < local < comm.size:
            from ...comm import Hierarchical2DComm
            comm = Hierarchical2DComm(comm, local)
    return _all_to_all(input, comm, input_dim, output_dim)


class _GatherSplit(torch.autograd.Function):
    """All-gather whose backward keeps this rank's slice of the gradient (Tutel's unfused all_gather)."""

    @staticmethod
    def forward(ctx, x, comm, dim):
        ctx.comm, ctx.dim = comm, dim
        return comm.all_gather(x.contiguous(), dim)

    @staticmethod
    def backward(ctx, g):
        return g.chunk(ctx.comm.size, ctx.dim)[ctx.comm.rank].contiguous(), None, None


def all_gather(input: Tensor, dim: int, fused: bool = False, group=None) -> Tensor:
    """Differentiable all-gather along ``dim``. Backward: reduce-scatter if ``fused`` (gradients of
    a replicated use are summed), else this rank's slice (Tutel's two modes)."""
    comm = comm_of(group)
    if comm.size == 1:
        return input
    if fused:
        return _all_gather(input, comm, dim)
    return _GatherSplit.apply(input, comm, dim)


def zero_gather(input: Tensor, full_shape=None, group=None) -> Tensor:
    """ZeRO-style gather of a parameter stored in dim-0 (flat) shards; backward reduce-scatters.

    Args:
        input: this rank's shard.
        full_shape: shape of the gathered tensor (default: dim 0 times W); the
            gathered elements beyond its numel (padding) are dropped.
    """
    comm = comm_of(group)
    if not full_shape:
        full_shape = list(input.shape)
        full_shape[0] *= comm.size
    numel = 1
    for d in full_shape:
        numel *= int(d)
    gathered = input if comm.size == 1 else _all_gather(input, comm, 0)
    return gathered.reshape(-1)[:numel].view(full_shape)


def zero_scatter(input: Tensor, scatter_fn, group=None):
    """Flatten ``input``, zero-pad it to a multiple of W and apply ``scatter_fn`` (e.g. :func:`simple_split`).

    Returns ``(scatter_fn(flat, group=group), input.shape)``."""
    W = comm_of(group).size
    n = input.numel()
    if n % W == 0:
        data = input.reshape(-1)
    else:
        data = input.new_zeros(-(-n // W) * W)
        data[:n] = input.reshape(-1)
    return scatter_fn(data, group=group), input.shape


def reduce_scatter(input: Tensor, dim: int, group=None) -> Tensor:
    """Differentiable reduce-scatter (sum) along ``dim``; backward all-gathers."""
    comm = comm_of(group)
    return _reduce_scatter(input, comm, dim)


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, dim):
        ctx.comm, ctx.dim = comm, dim
        return x.chunk(comm.size, dim)[comm.rank].contiguous()

    @staticmethod
    def backward(ctx, g):
        return ctx.comm.all_gather(g.contiguous(), ctx.dim), None, None


def spatial_split(input: Tensor, dim: int, group=None) -> Tensor:
    """This rank's slice of ``dim``; backward all-gathers the slices' gradients."""
    comm = comm_of(group)
    if comm.size == 1:
        return input
    if input.size(dim) % comm.size:
        raise ValueError(f"spatial_split: dim {dim} of size {input.size(dim)} does not split into {comm.size}")
    return _Split.apply(input, comm, dim)


# --------------------------------------------------------------------------- groups

_GROUPING: dict = {}  # Tutel caches one grouping per group_count for the whole process


def _init_world(backend: str) -> str:
    """Start the job's world once (fmoe.comm.from_env picks the launcher): torch.distributed under torchrun,
    mpi4py under mpiexec, else one process. Returns 'torch', 'mpi' or 'local'."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return "torch"  # started by the script itself; it also shuts it down
    if backend == "mpi" and not _mpi_launched():
        return "local"
    from ...comm import LocalComm, from_env
    comm = from_env("mpi" if backend == "mpi" else "auto", backend="gloo" if backend == "mpi" else backend)
    if isinstance(comm, LocalComm):
        return "local"
    set_world(comm)
    if dist.is_available() and dist.is_initialized():
        OWNED[:] = [True]
        return "torch"
    return "mpi"


def _mpi_launched() -> bool:
    from mpi_backend.comm import mpi_launched
    return mpi_launched()


def create_groups_from_world(group_count: int, include_init: Optional[str] = None, parent_group=None):
    """Split the world into ``group_count`` model groups of consecutive ranks (and the strided data groups).

    A negative ``group_count`` -g means groups of g ranks (W / g groups). With
    ``include_init`` (a backend: 'gloo', 'nccl', 'mpi') the world is started
    first. Returns Tutel's session record: ``global_size``, ``global_rank``,
    ``local_rank``, ``local_size``, ``group_count``, ``data_rank``,
    ``model_size``, ``model_rank``, ``local_device``, ``data_group``,
    ``model_group``, ``global_group``, ``is_distributed``, ``dist_print``.
    Groups are fmoe communicators (for MPI) or torch process groups.
    """
    if parent_group is not None:
        parent = comm_of(parent_group).size
        if 1 < parent < comm_of(None).size:
            raise ValueError("create_groups_from_world: splitting a sub-group is not supported (as in Tutel)")
    if include_init == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("backend='nccl' needs CUDA, which this torch build or machine lacks; use "
                           "backend='gloo' (torchrun) or 'mpi' (mpiexec) on CPU")
    if include_init:
        if "" in _GROUPING and _GROUPING[""][0] != include_init:
            raise ValueError(f"create_groups_from_world: the session already uses backend "
                             f"{_GROUPING[''][0]!r}, got {include_init!r} (one backend per process, as in Tutel)")
        kind = _init_world(include_init)
        _GROUPING.setdefault("", (include_init, kind))
    if group_count in _GROUPING:
        return _GROUPING[group_count]
    backend, kind = _GROUPING.get("", (include_init, None))
    world = comm_of(None)
    W, rank = world.size, world.rank
    count = W // -group_count if group_count < 0 else group_count
    if count < 1 or W % count:
        raise ValueError(f"create_groups_from_world: cannot divide {W} ranks into {count} groups "
                         f"(group_count={group_count})")
    model_size = W // count
    model_rank, data_rank = rank % model_size, rank // model_size
    is_distributed = W > 1 or kind in ("torch", "mpi")
    if W == 1:
        model_group = data_group = global_group = None if kind != "mpi" else world
    elif kind == "mpi" or not _torch_group_backend():
        global_group = world
        model_group = world if model_size == W else world.split(data_rank, model_rank)
        data_group = world if count == W else world.split(model_rank, data_rank)
    else:
        import torch.distributed as dist
        global_group = model_group = data_group = dist.group.WORLD
        if model_size != W:
            groups = [dist.new_group(ranks=list(range(g * model_size, (g + 1) * model_size))) for g in range(count)]
            model_group = groups[data_rank]
        if count != W:
            groups = [dist.new_group(ranks=list(range(r, W, model_size))) for r in range(model_size)]
            data_group = groups[model_rank]
    s = types.SimpleNamespace()
    s.global_size, s.global_rank = W, rank
    s.local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)))
    s.local_size = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", 1)))
    s.group_count, s.data_rank = count, data_rank
    s.model_size, s.model_rank = model_size, model_rank
    if backend == "nccl":
        s.local_device = torch.device("cuda", s.local_rank)
        torch.cuda.set_device(s.local_device)
    else:
        s.local_device = torch.device("cpu") if backend is not None else None
    s.data_group, s.model_group, s.global_group = data_group, model_group, global_group
    s.is_distributed = is_distributed
    s.dist_print = (lambda *args: print(*args)) if rank == 0 else (lambda *args: None)
    _GROUPING[group_count] = s
    return s


def _torch_group_backend() -> bool:
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized()


# --------------------------------------------------------------------------- optimizer

class TutelDistributedOptimizer:
    """ZeRO-1 style wrapper: shared (non-expert) parameters are split into flat per-rank chunks.

    Parameters tagged ``_tutel_expert`` (every ``moe_layer`` expert parameter)
    stay whole and local. ``step()`` reduce-scatters the shared gradients
    (divided by W if ``average_shared``), runs the local optimizer on this
    rank's chunks and the expert parameters, and all-gathers the chunks back.

        opt = TutelDistributedOptimizer(model.parameters(), group=None,
                                        average_shared=True).warp_local(torch.optim.SGD, lr=1e-5)
    """

    def __init__(self, params, group=None, average_shared: bool = False):
        params = list(params)
        self.params = [p for p in params if not hasattr(p, "_tutel_expert")]
        self.expert_params = [p for p in params if hasattr(p, "_tutel_expert")]
        self.shapes = [p.shape for p in self.params]
        self.group = group
        self.average_shared = average_shared

    def chunk_param(self) -> None:
        self.virt_params = [torch.nn.Parameter(zero_scatter(p.data, simple_split, group=self.group)[0].clone())
                            for p in self.params]

    def chunk_grad(self) -> None:
        W = get_world_size(self.group)
        for i, p in enumerate(self.params):
            if p.grad is not None:
                grad = p.grad.reshape(-1) / W if self.average_shared else p.grad.reshape(-1)
                self.virt_params[i].grad = zero_scatter(grad, simple_reduce_scatter, group=self.group)[0]

    def restore(self) -> None:
        for i, v in enumerate(self.virt_params):
            data = simple_all_gather(v.data, group=self.group).reshape(-1)
            self.params[i].data = data[:self.shapes[i].numel()].view(self.shapes[i]).clone()

    def warp_local(self, local_optim, *args, **kwargs) -> "TutelDistributedOptimizer":
        """Build the local optimizer (Tutel's spelling) over this rank's chunks and the experts."""
        self.chunk_param()
        self.local_optim = local_optim(self.virt_params + self.expert_params, *args, **kwargs)
        return self

    wrap_local = warp_local

    def zero_grad(self) -> None:
        for p in self.params + self.expert_params:
            if p.grad is not None:
                p.grad.detach_()
                p.grad.zero_()

    def step(self) -> None:
        self.chunk_grad()
        self.local_optim.step()
        self.restore()
