"""Which parameters are experts, and their logical (mesh-independent) form.

A model's parameters fall in two kinds (:mod:`fmoe.comm.mesh`):

* dense: replicated on every rank of a stage; logical form = the tensor itself;
* expert: the ``experts`` of an :class:`fmoe.nn.MoELayer`; rank ``ep_rank`` holds experts
  ``[ep_rank * n, (ep_rank + 1) * n)`` as ``[n, ...]``; logical form = the ``[E, ...]``
  tensor of all E experts (dim 0 = global expert index).

Either may be a plain tensor, or a DTensor once FSDP2 has sharded it (dense over the stage's
dp x ep ranks, experts over the dp replicas); :func:`local_full` undoes FSDP's sharding.
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch import Tensor, nn


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a DistributedDataParallel wrapper (FSDP2 does not wrap)."""
    from torch.nn.parallel import DistributedDataParallel
    return model.module if isinstance(model, DistributedDataParallel) else model


def _moe_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    from fmoe.nn import MoELayer
    for name, mod in model.named_modules():
        if isinstance(mod, MoELayer):
            yield name, mod


def expert_parameter_names(model: nn.Module) -> dict[str, int]:
    """{parameter name: E} for every expert parameter of every MoELayer in ``model``."""
    model = unwrap(model)
    out = {}
    for prefix, layer in _moe_layers(model):
        if layer.num_local_experts < 0:
            raise ValueError(f"{prefix}: experts shared by {-layer.num_local_experts} ranks (E < ep) are not "
                             "supported by the mesh recipes; use ep <= E with E % ep == 0")
        for name, _ in layer.experts.named_parameters():
            out[f"{prefix}.experts.{name}" if prefix else f"experts.{name}"] = layer.num_global_experts
    return out


def num_experts_of(model: nn.Module) -> dict[str, int]:
    """{MoELayer name: E}."""
    return {name: layer.num_global_experts for name, layer in _moe_layers(unwrap(model))}


def named_parameters_by_kind(model: nn.Module) -> Iterator[tuple[str, nn.Parameter, bool]]:
    """(name, parameter, is_expert) for every parameter of ``model`` (DDP wrapper removed)."""
    model = unwrap(model)
    experts = expert_parameter_names(model)
    for name, p in model.named_parameters():
        yield name, p, name in experts


def local_full(t: Tensor) -> Tensor:
    """This rank's unsharded tensor: a DTensor's ``full_tensor()`` (a collective over its mesh), else ``t``.

    For an FSDP-sharded expert parameter that is the ``[n, ...]`` experts of this ep rank.
    """
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def logical_tensors(model: nn.Module, mesh, *, grads: bool = False) -> dict[str, Tensor]:
    """{name: logical tensor} of this rank's stage: dense tensors whole, experts as ``[E, ...]``.

    Collective over the stage (FSDP gathers and one all-gather per expert tensor over
    ``mesh.ep_comm``); for tests and small models (every rank ends up holding everything).
    ``grads=True`` gives the gradients instead (None where a parameter has none).
    """
    out = {}
    for name, p, is_expert in named_parameters_by_kind(model):
        t = p.grad if grads else p
        if t is None:
            out[name] = None
            continue
        t = local_full(t.detach())
        out[name] = mesh.ep_comm.all_gather(t.contiguous(), 0) if is_expert and mesh.ep > 1 else t.clone()
    return out


def _assign(p: nn.Parameter, value: Tensor) -> None:
    """Copy this rank's unsharded value into ``p`` (a plain parameter or an FSDP DTensor shard)."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    with torch.no_grad():
        if isinstance(p, DTensor):
            # src_data_rank=None: every rank holds ``value`` and cuts its own shard (no scatter).
            piece = distribute_tensor(value.to(p.dtype), p.device_mesh, p.placements, src_data_rank=None)
            p.to_local().copy_(piece.to_local())
        else:
            p.copy_(value)


def load_logical(model: nn.Module, mesh, state: dict[str, Tensor]) -> None:
    """Set every parameter of ``model`` from logical tensors (dense whole, experts ``[E, ...]``).

    Each rank takes its own experts ``[ep_rank * n, (ep_rank + 1) * n)``; works before or after
    FSDP2 / DDP wrapping. Missing names and shape mismatches raise ``KeyError`` / ``ValueError``.
    """
    for name, p, is_expert in named_parameters_by_kind(model):
        if name not in state:
            raise KeyError(f"no tensor for parameter {name!r} in the logical state "
                           f"({len(state)} names, e.g. {sorted(state)[:3]})")
        v = state[name]
        if is_expert and mesh.ep > 1:
            E = v.shape[0]
            if E % mesh.ep:
                raise ValueError(f"{name}: {E} experts cannot be spread over ep={mesh.ep} ranks")
            n = E // mesh.ep
            v = v[mesh.ep_rank * n:(mesh.ep_rank + 1) * n]
        want = tuple(p.shape)  # a DTensor's shape is the unsharded one
        if tuple(v.shape) != want:
            raise ValueError(f"{name}: logical tensor has shape {tuple(v.shape)} for this rank, the model "
                             f"expects {want}")
        _assign(p, v)


def scale_to_norm(grads: list, sq: Tensor, mesh, max_norm: float) -> Tensor:
    """Clip ``grads`` in place to ``max_norm`` given this stage's squared norm ``sq`` (float64 [1],
    already summed over the stage's ranks): summed over pipeline stages, scaled once. Returns the
    global norm."""
    if mesh.pp > 1:
        sq = mesh.pp_comm.all_reduce(sq, "sum")
    norm = sq[0].sqrt()
    scale = max_norm / (float(norm) + 1e-6)
    if scale < 1.0:
        for g in grads:
            g.mul_(scale)
    return norm
