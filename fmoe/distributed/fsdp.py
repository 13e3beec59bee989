"""FSDP2 (``torch.distributed.fsdp.fully_shard``) over an expert-parallel mesh.

    m = fmoe.comm.mesh(ep=2, dp=2)
    model = CharLM(cfg, comm=m.ep_comm)          # experts spread over m.ep_comm
    fmoe.distributed.fsdp.shard(model, m, units=model.blocks)
    loss.backward()                              # gradients reduced as below, as DTensor shards

Sharding: dense parameters are sharded (dim 0) over the stage's dp x ep ranks
(``m.dense_mesh``); expert parameters ``[n, ...]`` over the dp replicas of their own expert
group (``m.device_mesh["dp"]``), so experts are never gathered across the expert dimension:
the all-gather before forward rebuilds this rank's n experts only.

Gradients (the objective is the mean of every rank's local loss): dense gradients are
reduce-scattered with a sum over dp x ep and divided by dp x ep; expert gradients (whose
all-to-all backward already summed the ep ranks' contributions) with a sum over dp, divided
by dp x ep as well. One divide factor, dp x ep, therefore fits both. Reductions are sums
followed by that division: for a divide factor other than its group's size FSDP2 reduces with
ReduceOp.PREMUL_SUM, which gloo does not have ("Cannot use ReduceOp.PREMUL_SUM with Gloo"; gloo
in torch 2.13 does have AVG); see :func:`_sum_reductions` for the one-rank groups (experts when
dp = 1).

The two meshes go through FSDP2's per-parameter placement (``shard_placement_fn`` returning
a ``ShardPlacementResult`` with its own mesh, the MoE use the fully_shard docstring names),
one FSDP unit per ``units`` module plus the root. Works on CPU with gloo (torch 2.13).

The CPU kernels hand tensors to numba through DLPack, not ``Tensor.numpy()``: the latter marks
a storage non-resizable for good, and FSDP2 frees gathered parameters by resizing their
storage (the dropless router's few-row kernel failed so, "Trying to resize storage that is not
resizable", until it switched).
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from ._params import expert_parameter_names, scale_to_norm, unwrap

__all__ = ["shard", "clip_grad_norm_"]


def _placement_fn(model: nn.Module, mesh):
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
    except ImportError as e:  # pragma: no cover - older FSDP2 has no per-parameter meshes
        raise RuntimeError("fmoe.distributed.fsdp needs FSDP2 per-parameter meshes (ShardPlacementResult, "
                           f"present in torch 2.13); this torch is {torch.__version__}") from e
    from torch.distributed.tensor import Shard
    names = expert_parameter_names(model)
    expert_ids = {id(p) for n, p in model.named_parameters() if n in names}
    info = FSDPMeshInfo(mesh.device_mesh["dp"], shard_mesh_dim=0)

    def fn(p):
        return ShardPlacementResult(Shard(0), info) if id(p) in expert_ids else None  # None: dense mesh
    return fn


def shard(model: nn.Module, mesh, *, units: Optional[Iterable[nn.Module]] = None,
          reshard_after_forward: bool = True) -> nn.Module:
    """Apply FSDP2 to ``model`` in place (each of ``units``, e.g. the transformer blocks, then the root).

    Args:
        model: a module whose MoE layers are :class:`fmoe.nn.MoELayer` with ``comm=mesh.ep_comm``.
        mesh: a :class:`fmoe.comm.MoEMesh` from :func:`fmoe.comm.mesh` (it needs the DeviceMesh).
        units: submodules that become their own FSDP units (all-gathered just before their
            forward, resharded after); the rest belongs to the root unit.
        reshard_after_forward: FSDP2's setting for the units (the root keeps its parameters).

    Returns:
        ``model`` (now an FSDPModule); its parameters are DTensors (``.to_local()``: this rank's shard).
    """
    from torch.distributed.fsdp import fully_shard
    if mesh.device_mesh is None:
        raise ValueError("fsdp.shard needs a torch DeviceMesh: build the mesh with fmoe.comm.mesh(...), "
                         "not mesh_from_comm")
    model = unwrap(model)
    placement = _placement_fn(model, mesh)
    factor = float(mesh.dp * mesh.ep)
    mods = [*(units or ()), model]
    for i, m in enumerate(mods):
        fully_shard(m, mesh=mesh.dense_mesh, shard_placement_fn=placement,
                    reshard_after_forward=reshard_after_forward if i < len(mods) - 1 else False)
    for m in mods:
        m.set_gradient_divide_factor(factor)
        _sum_reductions(m)
    return model


def _sum_reductions(module) -> None:
    """Sums (then one division) on every param group of more than one rank; the default on 1-rank groups.

    gloo has no PREMUL_SUM (FSDP2's op for a custom divide factor), so groups of > 1 rank force
    sums (then divide once; the same arithmetic on nccl). On a
    1-rank group (the experts when dp = 1) FSDP 2.13 with forced sums divides twice (once in
    its 1-rank copy, once after), and its default path divides once: keep that one there.
    The setting is per param group (one per mesh), which FSDPModule's setter cannot address.
    """
    groups = getattr(module._get_fsdp_state(), "_fsdp_param_groups", None)
    if groups is None:  # pragma: no cover - another FSDP2 layout
        raise RuntimeError("fmoe.distributed.fsdp: cannot reach FSDP2's param groups in this torch "
                           f"({torch.__version__}); the per-group sum reduction needs them")
    for group in groups:
        group.force_sum_reduction_for_comms = group.mesh_info.shard_mesh_size > 1


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, mesh, max_norm: float) -> torch.Tensor:
    """Clip by the global gradient norm of an FSDP-sharded model; returns the norm (float64 []).

    Every dense element lives on exactly one rank of the stage (sharded over dp x ep) and every
    expert element on exactly one (experts differ across ep, are sharded across dp), so the
    squared norm is the sum of local shards' squares over the stage, and over the pipeline's
    stages.
    """
    grads = [p.grad.to_local() for p in unwrap(model).parameters() if p.grad is not None]
    sq = torch.zeros(1, dtype=torch.float64)
    for g in grads:
        sq += g.double().pow(2).sum()
    sq = mesh.dense_comm.all_reduce(sq, "sum")
    return scale_to_norm(grads, sq, mesh, max_norm)
