"""The numba twins of the routing walks in fmoe/ops/csrc/walks.cpp: the fallback of
:mod:`fmoe._slots` where that extension is not built, and the reference its tests compare with.

Imported by :mod:`fmoe._slots` only when a walk first runs without the extension, so that
``import fmoe`` and inference never load numba's LLVM. Same contracts, arguments and status
codes as the C++ walks (integer results: equal by construction).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from . import _numba  # noqa: F401  (selects numba's threading layer before any kernel compiles)


@njit(cache=True, nogil=True)
def assign_slots_walk(ids, order, num_experts, slots, counts):
    """Slot-major slots (spec §6): walk j outer, tokens in ``order`` inner, one counter per expert.

    ``order`` of length 0 means token order, else a permutation of 0..T-1. Negative ids get slot
    -1 and are not counted. Serial on purpose: the walk is a running count, O(k*T), far below a
    millisecond. Returns 0, or a key of :data:`fmoe._slots.ASSIGN_ERRORS`: 1 where an id is >=
    num_experts (that pair gets -1), 2 / 3 where order holds a value outside [0, T) / repeats
    one (then slots is all -1 and nothing is counted).
    """
    k, T = ids.shape
    for e in range(num_experts):
        counts[e] = 0
    use_order = order.shape[0] > 0
    if use_order:   # every token exactly once, or slots would be left unwritten
        seen = np.zeros(T, np.uint8)
        status = 0
        for i in range(T):
            t = order[i]
            if t < 0 or t >= T:
                status = 2
                break
            if seen[t]:
                status = 3
                break
            seen[t] = 1
        if status:
            slots[:] = -1
            return status
    bad = 0
    for j in range(k):
        for i in range(T):
            t = order[i] if use_order else i
            e = ids[j, t]
            if e < 0:
                slots[j, t] = -1
            elif e >= num_experts:
                bad = 1
                slots[j, t] = -1
            else:
                slots[j, t] = counts[e]
                counts[e] += 1
    return bad


@njit(cache=True, nogil=True)
def kept_rows_walk(ids, slots, counts, capacity, out, pairs):
    """The kept pairs sorted by (expert, slot): the rows of the ragged layout, inverted.

    ids, slots: int64 [k, T]; counts: int64 [E]. ``out`` int64 [E + 2 + k*T] receives, in
    order: bounds [E + 1], the prefix sums of min(counts[e], capacity); dropped [1], the valid
    pairs at or past capacity; tokens [k*T]. ``pairs`` int64 [k*T] (its own buffer: autograd
    keeps it as the gate weights' gather index). The first N entries of tokens and pairs are
    ``t`` and ``j*T + t`` of the pair (j, t) in expert e's slot s, at ``bounds[e] + s``.
    Returns N = bounds[E], or a key of :data:`fmoe._slots.KEPT_ROWS_ERRORS` for a routing whose
    counts disagree with its slots (nothing is written past either buffer's end).
    """
    k, T = ids.shape
    E = counts.shape[0]
    kt = k * T
    if out.shape[0] < E + 2 + kt or pairs.shape[0] < kt:
        return -4
    if capacity < 0:
        return -5
    tokens0 = E + 2
    out[0] = 0
    for e in range(E):
        c = counts[e]
        if c < 0:
            return -5
        out[e + 1] = out[e] + (c if c < capacity else capacity)
        if out[e + 1] > kt:   # more rows than pairs (checked as it grows: no overflow)
            return -3
    N = out[E]
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
