"""The slot walk under vmap: one custom op, ``fmoe::assign_slots``, whose vmap rule runs the
native counter walk once over the whole batch.

    fast = assign_slots_batched(expert_ids, num_experts)   # (slots, counts) or None

Under vmap :func:`fmoe._slots.assign_slots_fast` steps aside (its walk reads plain tensors) and
the route fell back to the pure-torch reference, a [B*k*T, E] membership matrix and its
cumulative sum: about 14 ms for a sweep of 8 gate settings at T=2048, k=4, E=16 (one thread),
against about 0.2 ms for the walk. The rule walks [k, B*T] with element b's expert e renamed
b*E + e: each renamed expert's pairs are one element's, visited slot-major in token order as
that element's own walk visits them, so slots and counts are each element's own, integer for
integer (tests/test_sweep_route.py).

Kept beside :mod:`fmoe._slots` (routing is plain data and never imports the ops).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _slots


@torch.library.custom_op("fmoe::assign_slots", mutates_args=())
def _assign_slots(expert_ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """(slots int64 [k, T], counts int64 [E]) of plain CPU ids [k, T] by the counter walk."""
    return _slots.assign_slots_fast(expert_ids, num_experts, None)


def _assign_slots_vmap(info, in_dims, expert_ids, num_experts):
    """One walk over the batch: ids [B, k, T] (batch dim moved first) as [k, B*T] over B*E
    experts, negative ids kept negative (no slot, not counted)."""
    d = in_dims[0]
    if d is None:
        return torch.ops.fmoe.assign_slots(expert_ids, num_experts), (None, None)
    ids = expert_ids.movedim(d, 0)
    B, k, T = ids.shape
    E = int(num_experts)
    if ids.numel() and int(ids.max()) >= E:
        # the walk over B*E experts would take an id >= E for another element's expert
        raise IndexError(f"assign_slots: an expert id is >= num_experts={E} (the largest is {int(ids.max())}); "
                         f"ids must lie in [0, num_experts), or be negative for no expert")
    renamed = torch.where(ids >= 0, ids + E * torch.arange(B, device=ids.device).view(B, 1, 1), -1)
    slots, counts = torch.ops.fmoe.assign_slots(renamed.transpose(0, 1).reshape(k, B * T), B * E)
    return (slots.view(k, B, T), counts.view(B, E)), (1, 0)


torch.library.register_vmap("fmoe::assign_slots", _assign_slots_vmap)


def _vmap_levels(t: Tensor) -> int:
    """How many vmap levels batch t (under any grad wrappers)."""
    F = torch._C._functorch
    n = 0
    while F.is_functorch_wrapped_tensor(t):
        n += F.is_batchedtensor(t)
        t = F.get_unwrapped(t)
    return n


def assign_slots_batched(expert_ids: Tensor, num_experts: int) -> Optional[tuple[Tensor, Tensor]]:
    """(slots int64 [k, T], counts int64 [E]) of vmapped CPU ids [k, T] (no visiting order) by the
    native walk, one call over the batch of one vmap level; None elsewhere (eager ids take
    :func:`fmoe._slots.assign_slots_fast` directly; compiled, device and doubly vmapped ids the
    torch reference, the rule's range check being a host read). IndexError where an id is >=
    num_experts."""
    if (torch.compiler.is_compiling() or expert_ids.device.type != "cpu" or expert_ids.dim() != 2
            or _vmap_levels(expert_ids) != 1):
        return None
    return torch.ops.fmoe.assign_slots(expert_ids, int(num_experts))
