"""Tutel's "critical data" tuple over :class:`fmoe.Routing`.

Tutel's ``extract_critical`` returns ``crit = (E, indices_s, locations_s,
gates_s, capacity, dispatch_count)`` with k-long lists of [T] tensors, and
``fast_encode`` / ``fast_decode`` / ``get_reversed_sample_ids`` read it. Here
the tuple is plain data: every function rebuilds the :class:`fmoe.Routing` it
describes and calls fmoe's primitives, so a tuple built by hand works too.
Gate gradients flow through ``gates_s`` (views of the routing weights).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ... import losses as _losses
from ...ops import combine, dispatch
from ...routing import Routing, top_k_routing
from ._groups import comm_of


def gshard_loss(scores: Tensor, topk_ids: Tensor) -> Tensor:
    """Tutel's default ``loss_fn(scores [T, E], topk_ids [T, k])``: GShard loss of the top-1 ids."""
    return _losses.gshard_loss(scores, topk_ids[:, 0])


def fast_cumsum_sub_one(data: Tensor, dim: int = 0) -> Tensor:
    """Inclusive cumulative sum along dim 0, minus one: the slot of each 1 in a one-hot mask column."""
    if dim != 0:
        raise ValueError(f"fast_cumsum_sub_one: only dim=0 is supported (as in Tutel), got {dim}")
    return torch.cumsum(data, dim=0) - 1


def critical_of(routing: Routing) -> tuple:
    """The Tutel tuple for a routing (indices/locations int32 as Tutel, gates differentiable)."""
    return (routing.num_experts, list(routing.expert_ids.to(torch.int32).unbind(0)),
            list(routing.slots.to(torch.int32).unbind(0)), list(routing.weights.unbind(0)),
            routing.capacity, routing.counts)


def routing_of(crit) -> Routing:
    """The :class:`fmoe.Routing` a Tutel tuple describes."""
    if not isinstance(crit, (tuple, list)) or len(crit) != 6:
        raise TypeError("expected Tutel's critical tuple (E, indices_s, locations_s, gates_s, capacity, "
                        f"dispatch_count), got {type(crit).__name__}")
    E, ids, locs, gates, capacity, counts = crit
    return Routing(torch.stack([t.reshape(-1) for t in ids]).to(torch.int64),
                   torch.stack([t.reshape(-1) for t in locs]).to(torch.int64),
                   torch.stack([t.reshape(-1) for t in gates]), counts.to(torch.int64), int(capacity), int(E))


def extract_critical(scores: Tensor, top_k: int, loss_fn=gshard_loss, capacity_factor: float = 1.0,
                     batch_prioritized_routing: bool = False, normalize_gate: bool = True, alignment: int = 1,
                     group=None, inequivalent_tokens: bool = False):
    """Top-k routing of scores [T, E] (Tutel's ``extract_critical`` / ``top_k_routing``).

    Returns ``(crit, l_loss)``; ``l_loss = loss_fn(scores, topk_ids [T, k])`` or None.
    Capacity inputs are always agreed across the group's ranks (fmoe never
    lets unequal token counts deadlock), so ``inequivalent_tokens`` changes
    nothing; dispatch counts are the true per-expert counts, also with
    ``batch_prioritized_routing`` (Tutel under-counts there).
    """
    del inequivalent_tokens  # always group-agreed
    comm = comm_of(group)
    routing = top_k_routing(scores, int(top_k), capacity_factor, normalize=normalize_gate,
                            batch_prioritized=batch_prioritized_routing, alignment=int(alignment),
                            comm=comm if comm.size > 1 else None)
    l_loss = None if loss_fn is None else loss_fn(scores, routing.expert_ids.t())
    return critical_of(routing), l_loss


def get_dispatch_count(crit) -> Tensor:
    """int64 [E] pairs routed to each expert (before capacity)."""
    return crit[-1]


def get_topk_selection(crit):
    """``(topk_ids [T, k] int64, dispatch_count [E])``."""
    return torch.stack([t.reshape(-1) for t in crit[1]], dim=1).to(torch.int64), crit[-1]


def get_reversed_sample_ids(crit, return_id_type: str = "sample_id") -> Tensor:
    """int32 [E, C]: the token ('sample_id') or top slot ('top_id') in each buffer row, -1 if empty."""
    if return_id_type not in ("sample_id", "top_id"):
        raise ValueError(f"return_id_type must be 'sample_id' or 'top_id', got {return_id_type!r}")
    return routing_of(crit).reversed_ids(return_id_type).to(torch.int32)


def fast_encode(data: Tensor, crit, is_postscore: bool = True) -> Tensor:
    """Tokens [T, M] -> expert buffers [E, C, M] (gate-weighted when not ``is_postscore``)."""
    return dispatch(data, routing_of(crit), weighted=not is_postscore)


def fast_decode(data: Tensor, crit, is_postscore: bool = True) -> Tensor:
    """Expert buffers [E, C, M] -> tokens [T, M] (gate-weighted when ``is_postscore``)."""
    return combine(data, routing_of(crit), weighted=is_postscore)
