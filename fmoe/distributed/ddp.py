"""``DistributedDataParallel`` for the dense parameters, an explicit all-reduce for the experts.

    m = fmoe.comm.mesh(ep=2, dp=2)
    model = CharLM(cfg, comm=m.ep_comm)
    ddp = fmoe.distributed.ddp.wrap(model, m)
    ddp(tokens) ... loss.backward()                 # DDP averages dense grads over dp x ep
    fmoe.distributed.ddp.reduce_expert_grads(ddp, m)  # experts: sum over dp, / (dp x ep)

DDP's all-reduce runs over the stage's dp x ep ranks (``m.dense_comm``) and skips the expert
parameters (they differ across the ep ranks, so averaging them there would be wrong); their
gradients, which the all-to-all backward has already summed over the ep ranks, are summed over
the dp replicas and divided by dp x ep: the gradient of the mean of all ranks' losses.
"""
from __future__ import annotations

import torch
from torch import nn

from ._params import expert_parameter_names, named_parameters_by_kind, scale_to_norm, unwrap

__all__ = ["wrap", "reduce_expert_grads", "reduce_grads", "clip_grad_norm_"]

_IGNORE = "_ddp_params_and_buffers_to_ignore"


def wrap(model: nn.Module, mesh, **ddp_kwargs) -> nn.Module:
    """``DistributedDataParallel(model)`` over ``mesh.dense_group`` ignoring the expert parameters.

    ``ddp_kwargs`` go to DDP (default ``broadcast_buffers=False``: replicas start equal).
    """
    from torch.nn.parallel import DistributedDataParallel as DDP
    if mesh.dense_group is None:
        raise ValueError("ddp.wrap needs a torch.distributed mesh (fmoe.comm.mesh), not an MPI one")
    names = sorted(expert_parameter_names(model))
    # DDP reads the ignore list from an attribute of the module, once, in its constructor
    # (DDP._set_params_and_buffers_to_ignore_for_model sets it); set it for that call only, so
    # nothing is left on the user's module.
    had = hasattr(model, _IGNORE)
    old = getattr(model, _IGNORE, None)
    DDP._set_params_and_buffers_to_ignore_for_model(model, names + (list(old) if had else []))
    try:
        ddp_kwargs.setdefault("broadcast_buffers", False)
        wrapped = DDP(model, process_group=mesh.dense_group, **ddp_kwargs)
    finally:
        if had:
            setattr(model, _IGNORE, old)
        else:
            delattr(model, _IGNORE)
    return wrapped


@torch.no_grad()
def reduce_expert_grads(model: nn.Module, mesh) -> None:
    """After backward: expert gradients summed over ``mesh.dp_comm``, divided by dp x ep (in place)."""
    grads = [p.grad for _, p, is_expert in named_parameters_by_kind(model) if is_expert and p.grad is not None]
    _sum_and_divide(mesh.dp_comm, grads, mesh.dp * mesh.ep)


def _sum_and_divide(comm, grads: list, factor: int) -> None:
    """``g <- sum over comm of g / factor`` for every tensor, in one all-reduce per dtype.

    One flat buffer instead of one collective per tensor: each fmoe collective also exchanges a
    header, so per-tensor calls cost two round trips each (measured: the per-tensor version made
    the step slower than DDP's bucketed all-reduce).
    """
    by_dtype = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in same])
        if comm.size > 1:
            flat = comm.all_reduce(flat, "sum")
        flat.div_(factor)
        offset = 0
        for g in same:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, mesh, max_norm: float) -> torch.Tensor:
    """Clip by the global norm after :func:`reduce_expert_grads`; returns the norm (float64 []).

    Dense gradients are replicated (counted once); expert gradients differ across the ep ranks
    (summed over ``mesh.ep_comm``), and across pipeline stages everything is summed.
    """
    dense = torch.zeros(1, dtype=torch.float64)
    expert = torch.zeros(1, dtype=torch.float64)
    grads = []
    for _, p, is_expert in named_parameters_by_kind(unwrap(model)):
        if p.grad is None:
            continue
        grads.append(p.grad)
        (expert if is_expert else dense).add_(p.grad.double().pow(2).sum())
    sq = dense + (mesh.ep_comm.all_reduce(expert, "sum") if mesh.ep > 1 else expert)
    return scale_to_norm(grads, sq, mesh, max_norm)


def reduce_grads(model: nn.Module, mesh) -> None:
    """Without DDP (e.g. inside a pipeline stage): dense grads averaged over dp x ep, experts as above."""
    dense, experts = [], []
    for _, p, is_expert in named_parameters_by_kind(model):
        if p.grad is not None:
            (experts if is_expert else dense).append(p.grad)
    with torch.no_grad():
        _sum_and_divide(mesh.dense_comm, dense, mesh.dp * mesh.ep)
        _sum_and_divide(mesh.dp_comm, experts, mesh.dp * mesh.ep)
