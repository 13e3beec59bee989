"""Slot assignment as a numba counter walk (the fast path of :func:`fmoe.routing.assign_slots`),
and its inverse: the kept pairs listed by expert and slot (the fast path of
:func:`fmoe.engine.plan.make_plan`).

Kept apart from :mod:`fmoe.ops` so that routing (plain data) never imports the ops.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from numba import njit
from torch import Tensor

from . import _numba  # noqa: F401  (selects numba's threading layer before any kernel compiles)


@njit(cache=True, nogil=True)
def assign_slots_walk(ids, order, num_experts, slots, counts):
    """Slot-major slots (spec §6): walk j outer, tokens in ``order`` inner, one counter per expert.

    ``order`` of length 0 means token order. Negative ids get slot -1 and are not
    counted. Serial on purpose: the walk is a running count, O(k*T), far below
    a millisecond. Returns the number of ids >= num_experts (must be 0).
    """
    k, T = ids.shape
    for e in range(num_experts):
        counts[e] = 0
    bad = 0
    use_order = order.shape[0] > 0
    for j in range(k):
        for i in range(T):
            t = order[i] if use_order else i
            e = ids[j, t]
            if e < 0:
                slots[j, t] = -1
            elif e >= num_experts:
                bad += 1
                slots[j, t] = -1
            else:
                slots[j, t] = counts[e]
                counts[e] += 1
    return bad


# kept_rows_walk's negative returns
KEPT_ROWS_ERRORS = {
    -1: "a kept pair's expert id is >= E or its slot is outside [0, min(counts[e], capacity))",
    -2: "two kept pairs share an expert and a slot",
    -3: "an expert has fewer kept pairs than min(counts[e], capacity) rows",
    -4: "an output buffer is too short (E + 2 + k*T and k*T)",
}


@njit(cache=True, nogil=True)
def kept_rows_walk(ids, slots, counts, capacity, out, pairs):
    """The kept pairs sorted by (expert, slot): the rows of the ragged layout, inverted.

    ids, slots: int64 [k, T]; counts: int64 [E]. ``out`` int64 [E + 2 + k*T] receives, in
    order: bounds [E + 1], the prefix sums of min(counts[e], capacity); dropped [1], the valid
    pairs at or past capacity; tokens [k*T]. ``pairs`` int64 [k*T] (its own buffer: autograd
    keeps it as the gate weights' gather index). The first N entries of tokens and pairs are
    ``t`` and ``j*T + t`` of the pair (j, t) in expert e's slot s, at ``bounds[e] + s``.
    Returns N = bounds[E], or a key of :data:`KEPT_ROWS_ERRORS` for a routing whose counts
    disagree with its slots (nothing is written past either buffer's end).
    """
    k, T = ids.shape
    E = counts.shape[0]
    kt = k * T
    if out.shape[0] < E + 2 + kt or pairs.shape[0] < kt:
        return -4
    tokens0 = E + 2
    out[0] = 0
    for e in range(E):
        c = counts[e]
        out[e + 1] = out[e] + (c if c < capacity else capacity)
    N = out[E]
    if N > kt:   # more rows than pairs
        return -3
    for p in range(N):
        pairs[p] = -1
    lost = 0
    for j in range(k):
        for t in range(T):
            e = ids[j, t]
            s = slots[j, t]
            if e < 0:
                continue
            if s >= capacity:
                lost += 1
                continue
            if e >= E or s < 0 or s >= out[e + 1] - out[e]:
                return -1
            p = out[e] + s
            if pairs[p] >= 0:
                return -2
            pairs[p] = j * T + t
            out[tokens0 + p] = t
    for p in range(N):
        if pairs[p] < 0:
            return -3
    out[E + 1] = lost
    return N


def int64_array(t: Tensor) -> np.ndarray:
    """A plain CPU integer tensor as a C-contiguous int64 numpy array (no copy if it is one)."""
    return np.ascontiguousarray(t.numpy(), dtype=np.int64)


def _plain(t: Tensor) -> Optional[Tensor]:
    """t without functorch grad wrappers; None if a vmap batches it (caller falls back)."""
    F = torch._C._functorch
    while F.is_functorch_wrapped_tensor(t):
        if F.is_batchedtensor(t):
            return None
        t = F.get_unwrapped(t)
    return t


def assign_slots_fast(expert_ids: Tensor, num_experts: int, order: Optional[Tensor]
                      ) -> Optional[tuple[Tensor, Tensor]]:
    """(slots int64 [k, T], counts int64 [E]) by the counter walk, or None where it cannot run.

    None (the caller then uses the pure-torch reference) while compiling, under vmap and
    off CPU. The pure-torch version builds a [k*T, E] membership matrix and cumsums it
    (~160 ms at T=8192, k=8, E=64); this takes well under 1 ms.
    """
    if torch.compiler.is_compiling():  # Dynamo traces the pure-torch version
        return None
    ids = _plain(expert_ids)
    perm = None if order is None else _plain(order)
    if ids is None or (order is not None and perm is None) or ids.device.type != "cpu" or ids.dim() != 2:
        return None
    # Inside a torch.func transform every torch op (even .numpy()) would see the
    # transform's dispatch keys; the ids are plain integer data, so step outside.
    with torch._C._DisableFuncTorch():
        ids = int64_array(ids)
        perm = np.empty(0, np.int64) if perm is None else int64_array(perm)
        if perm.size not in (0, ids.shape[1]):
            raise ValueError(f"assign_slots: order must have T={ids.shape[1]} entries, got {perm.size}")
        slots = np.empty(ids.shape, np.int64)
        counts = np.empty(num_experts, np.int64)
        if assign_slots_walk(ids, perm, num_experts, slots, counts):
            raise IndexError(f"assign_slots: an expert id is >= num_experts={num_experts}")
        return torch.from_numpy(slots), torch.from_numpy(counts)
