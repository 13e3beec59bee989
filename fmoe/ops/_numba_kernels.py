"""The numba kernels behind :mod:`fmoe.ops.numba_cpu` (numpy in, numpy out).

All arrays are C-contiguous. ``pos`` is int64 [k, T] (row of the [R, M] buffer
or negative to skip; kept rows are unique). ``w`` is [k, T] in the compute
dtype, or a [0, 0] array meaning "no weights" (one compiled signature covers
both cases). ``zero`` is a scalar 0 of the compute dtype, passed in so that no
float64 literal widens float32 arithmetic.

Numerics mirror :mod:`fmoe.ops.reference` bit for bit for dispatch and
combine: products are rounded to the compute dtype, dispatch adds its value to
a zero (so -0.0 becomes +0.0, as index_add_ into zeros does) and combine adds
the k slots to a zero accumulator in order j = 0, 1, .... numba leaves FMA
contraction off unless fastmath asks for it, which only gate_grad does.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .._slots_numba import assign_slots_walk, kept_rows_walk

_FLAGS = dict(cache=True, nogil=True)


@njit(parallel=True, **_FLAGS)
def inverse_positions(pos, num_rows, inv):
    """inv[r] = j * T + t for the pair that fills row r, else -1.

    Returns the number of positions >= num_rows (must be 0; checked by the caller).
    """
    k, T = pos.shape
    for r in prange(num_rows):
        inv[r] = -1
    bad = 0
    for i in prange(k * T):
        p = pos[i // T, i % T]
        if p >= num_rows:
            bad += 1
        elif p >= 0:
            inv[p] = i
    return bad


@njit(parallel=True, **_FLAGS)
def dispatch_rows(x, w, inv, zero, out):
    """out[r] = zero + w[j, t] * x[t] where inv[r] = j*T + t, else 0. Writes every row once."""
    R, M = out.shape
    T = x.shape[0]
    weighted = w.shape[0] > 0
    for r in prange(R):
        s = inv[r]
        if s < 0:
            for m in range(M):
                out[r, m] = zero
        else:
            t = s % T
            if weighted:
                a = w[s // T, t]
                for m in range(M):
                    out[r, m] = zero + a * x[t, m]
            else:
                for m in range(M):
                    out[r, m] = zero + x[t, m]


@njit(parallel=True, **_FLAGS)
def combine_rows(y, pos, w, zero, out):
    """out[t] = sum_j w[j, t] * y[pos[j, t]] over kept pairs, accumulated in order from 0."""
    k, T = pos.shape
    M = y.shape[1]
    weighted = w.shape[0] > 0
    for t in prange(T):
        for m in range(M):
            out[t, m] = zero
        for j in range(k):
            p = pos[j, t]
            if p < 0:
                continue
            if weighted:
                a = w[j, t]
                for m in range(M):
                    out[t, m] = out[t, m] + a * y[p, m]
            else:
                for m in range(M):
                    out[t, m] = out[t, m] + y[p, m]


# A reduction whose order the reference leaves to torch's vectorised sum anyway:
# let LLVM reassociate so it vectorises (results differ from the reference in the
# last bits, within a tolerance the tests state).
@njit(parallel=True, fastmath={"reassoc", "contract"}, **_FLAGS)
def gate_grad_rows(a, b, pos, zero, out):
    """out[j, t] = <a[t], b[pos[j, t]]> for kept pairs, else 0."""
    k, T = pos.shape
    M = a.shape[1]
    for t in prange(T):
        for j in range(k):
            p = pos[j, t]
            s = zero
            if p >= 0:
                for m in range(M):
                    s += a[t, m] * b[p, m]
            out[j, t] = s


@njit(parallel=True, **_FLAGS)
def max_position(pos):
    """Largest entry of pos (-1 when empty)."""
    k, T = pos.shape
    best = -1
    for i in prange(k * T):
        best = max(best, pos[i // T, i % T])
    return best


# Serial twins for small problems (decode): a TBB parallel region costs tens of
# microseconds, more than moving a few rows. Same arithmetic per element as the parallel
# kernels (the parallel loops only split independent rows), so the results are identical.
# Separate functions, not njit(parallel=False) of the same Python function: numba's
# on-disk cache key does not include the parallel flag.

@njit(**_FLAGS)
def dispatch_serial(x, w, pos, zero, out):
    """dispatch_rows(inverse_positions(pos)) in one serial pass; returns the number of
    positions >= out.shape[0] (then nothing is written)."""
    R, M = out.shape
    k, T = pos.shape
    for j in range(k):
        for t in range(T):
            if pos[j, t] >= R:
                return 1
    weighted = w.shape[0] > 0
    for r in range(R):
        for m in range(M):
            out[r, m] = zero
    for j in range(k):
        for t in range(T):
            p = pos[j, t]
            if p < 0:
                continue
            if weighted:
                a = w[j, t]
                for m in range(M):
                    out[p, m] = zero + a * x[t, m]
            else:
                for m in range(M):
                    out[p, m] = zero + x[t, m]
    return 0


@njit(**_FLAGS)
def combine_serial(y, pos, w, zero, out):
    """combine_rows, serial; returns the number of positions >= y.shape[0] (then nothing is written)."""
    k, T = pos.shape
    R, M = y.shape
    for j in range(k):
        for t in range(T):
            if pos[j, t] >= R:
                return 1
    weighted = w.shape[0] > 0
    for t in range(T):
        for m in range(M):
            out[t, m] = zero
        for j in range(k):
            p = pos[j, t]
            if p < 0:
                continue
            if weighted:
                a = w[j, t]
                for m in range(M):
                    out[t, m] = out[t, m] + a * y[p, m]
            else:
                for m in range(M):
                    out[t, m] = out[t, m] + y[p, m]
    return 0


def signatures():
    """(name, kernel, example args) for every compiled signature, used by warm-up."""
    out = []
    pos = np.array([[0, -1], [1, 2]], dtype=np.int64)
    inv = np.array([0, 2, -1], dtype=np.int64)  # a valid inverse of pos for 3 rows
    out.append(("inverse_positions", inverse_positions, (pos, 3, inv)))
    out.append(("max_position", max_position, (pos,)))
    out.append(("assign_slots_walk", assign_slots_walk,
                (pos, np.empty(0, np.int64), 3, np.empty((2, 2), np.int64), np.empty(3, np.int64))))
    ids, slots = np.array([[0, 1], [1, -1]], dtype=np.int64), np.array([[0, 0], [1, -1]], dtype=np.int64)
    out.append(("kept_rows_walk", kept_rows_walk,
                (ids, slots, np.array([1, 2], np.int64), 2, np.empty(8, np.int64), np.empty(4, np.int64))))
    for dt in (np.float32, np.float64):
        x = np.ones((2, 4), dtype=dt)
        y = np.ones((3, 4), dtype=dt)
        zero = dt(0)
        w = np.ones((2, 2), dtype=dt)
        name = np.dtype(dt).name
        out.append((f"dispatch_rows[{name}]", dispatch_rows, (x, w, inv, zero, np.empty((3, 4), dt))))
        out.append((f"combine_rows[{name}]", combine_rows, (y, pos, w, zero, np.empty((2, 4), dt))))
        out.append((f"gate_grad_rows[{name}]", gate_grad_rows, (x, y, pos, zero, np.empty((2, 2), dt))))
        out.append((f"dispatch_serial[{name}]", dispatch_serial, (x, w, pos, zero, np.empty((3, 4), dt))))
        out.append((f"combine_serial[{name}]", combine_serial, (y, pos, w, zero, np.empty((2, 4), dt))))
    return out
