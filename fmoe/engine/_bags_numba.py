"""The vmapped sweep's bag sums (:func:`fmoe.engine.traced._bags_into`) as one numba kernel that
writes each bag's row of the output in place: what ``F.embedding_bag`` computes, without its
fresh [bags, n] result and the copy of it into y (about half the bags' time on the CPU).

Imported when the fold first sums bags on the CPU, so ``import fmoe`` loads no numba.
"""
from __future__ import annotations

from .. import _numba   # noqa: F401  (first: it picks numba's threading layer)
from numba import njit, prange


@njit(parallel=True, cache=True, nogil=True)
def weighted_bags(out, src, rows, first, w):
    """out[i, :] = sum over p in [first[i], first[i+1]) of w[p] * src[rows[p], :], the terms added
    in p order to the first (an empty bag: zeros). out [n_bags, n], src [R, n], rows int64 [P],
    first int64 [n_bags + 1], w [P] in src's dtype; rows are checked by the caller."""
    n = out.shape[1]
    for i in prange(out.shape[0]):
        o = out[i]
        p0, p1 = first[i], first[i + 1]
        if p1 == p0:
            o[:] = 0
            continue
        r, s = src[rows[p0]], w[p0]
        for j in range(n):
            o[j] = s * r[j]
        for p in range(p0 + 1, p1):
            r, s = src[rows[p]], w[p]
            for j in range(n):
                o[j] += s * r[j]
