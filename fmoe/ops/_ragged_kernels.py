"""numba kernels for experts with few rows each (decode; :func:`fmoe.ops.numba_cpu.few_rows_mm`): numpy in, numpy out.

A group of n <= a few rows times one expert matrix is a matrix-vector product
and memory bound: the time is reading the expert's weight. BLAS runs one GEMM
(or GEMV) call per group, each with its own threading region; here one call
handles every small group and streams each busy expert's weight once for all
of that group's rows (the rows are blocked 4 at a time inside the loop over
weight rows, so a weight row is re-read from L1, not from memory).

Arrays (all C-contiguous):
    x: [Sx, R, K] rows, Sx in {1, S} (1 = shared by every segment).
    w: [Sw, E, N, K] (``*_nk``: y = x w^T, nn.Linear layout) or [Sw, E, K, N]
       (``*_kn``: y = x w), Sw in {1, S}.
    tasks: int64 [G, 4] of (segment s, expert e, first row, end row); rows
       index x[sx] and y[s]; validated by the caller (0 <= first < end <= R).
    y: [S, R, N]; exactly the tasks' rows are written.

The K reduction is reassociated (vectorised, FMA-contracted), like a BLAS
GEMV: equal to torch.mm within float rounding, not bit for bit.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

_FLAGS = dict(cache=True, nogil=True)
_FAST = {"reassoc", "contract"}

# Output columns per parallel work item: enough work to amortise a task's start,
# small enough that several threads share one expert's matrix. The nn.Linear layout
# reads NK_CHUNK whole (contiguous) weight rows per task. The x w layout reads a
# [K, chunk] column block, contiguous only along a row, so it takes whole rows up to
# KN_CHUNK: 32 experts x 1-16 rows, K = N = 768, 2 threads took 16-77 ms at 768 wide
# against 18-82 ms at 256 and 29-127 ms at 64 (bench run 2026-12-01, shared machine).
NK_CHUNK = 128
KN_CHUNK = 1024


@njit(fastmath=_FAST, **_FLAGS)
def _nk_task(x, w, lo, hi, n0, n1, zero, y):
    """y[r, n] = <w[n, :], x[r, :]> for r in [lo, hi), n in [n0, n1); x [R, K], w [N, K]."""
    K = w.shape[1]
    for n in range(n0, n1):
        r = lo
        while r + 4 <= hi:
            s0 = zero
            s1 = zero
            s2 = zero
            s3 = zero
            for k in range(K):
                a = w[n, k]
                s0 += a * x[r, k]
                s1 += a * x[r + 1, k]
                s2 += a * x[r + 2, k]
                s3 += a * x[r + 3, k]
            y[r, n] = s0
            y[r + 1, n] = s1
            y[r + 2, n] = s2
            y[r + 3, n] = s3
            r += 4
        while r < hi:
            s0 = zero
            for k in range(K):
                s0 += w[n, k] * x[r, k]
            y[r, n] = s0
            r += 1


@njit(fastmath=_FAST, **_FLAGS)
def _kn_task(x, w, lo, hi, n0, n1, zero, y):
    """y[r, n] = sum_k x[r, k] w[k, n] for r in [lo, hi), n in [n0, n1); x [R, K], w [K, N].

    Four weight rows per pass: each output row is loaded and stored once per 4 k, and
    the 4 weight-row chunks are re-read from L1 for every row of the group. 1-D row
    views keep LLVM's alias checks few enough that the n loop vectorises (indexing
    y[r, n] on the 2-D arrays measured 4-6x slower).
    """
    K = w.shape[0]
    m = n1 - n0
    for r in range(lo, hi):
        y[r, n0:n1] = zero
    k = 0
    while k + 4 <= K:
        w0 = w[k, n0:n1]
        w1 = w[k + 1, n0:n1]
        w2 = w[k + 2, n0:n1]
        w3 = w[k + 3, n0:n1]
        for r in range(lo, hi):
            a0 = x[r, k]
            a1 = x[r, k + 1]
            a2 = x[r, k + 2]
            a3 = x[r, k + 3]
            yr = y[r, n0:n1]
            for n in range(m):
                yr[n] += a0 * w0[n] + a1 * w1[n] + a2 * w2[n] + a3 * w3[n]
        k += 4
    while k < K:
        wk = w[k, n0:n1]
        for r in range(lo, hi):
            a = x[r, k]
            yr = y[r, n0:n1]
            for n in range(m):
                yr[n] += a * wk[n]
        k += 1


@njit(**_FLAGS)
def _run(x, w, tasks, t, nblk, chunk, N, transposed, zero, y):
    g = t // nblk
    n0 = (t % nblk) * chunk
    n1 = min(N, n0 + chunk)
    s = tasks[g, 0]
    e = tasks[g, 1]
    sx = s if x.shape[0] > 1 else 0
    sw = s if w.shape[0] > 1 else 0
    if transposed:
        _nk_task(x[sx], w[sw, e], tasks[g, 2], tasks[g, 3], n0, n1, zero, y[s])
    else:
        _kn_task(x[sx], w[sw, e], tasks[g, 2], tasks[g, 3], n0, n1, zero, y[s])


@njit(parallel=True, **_FLAGS)
def small_groups(x, w, tasks, transposed, zero, y):
    """Every task's rows of y = x op(w[e]); parallel over (task, chunk of output columns)."""
    N = y.shape[2]
    chunk = NK_CHUNK if transposed else KN_CHUNK
    nblk = (N + chunk - 1) // chunk
    for t in prange(tasks.shape[0] * nblk):
        _run(x, w, tasks, t, nblk, chunk, N, transposed, zero, y)


# Serial twin for tiny problems (a TBB region costs tens of microseconds). A separate
# function, not njit(parallel=False) of the same one: numba's cache key ignores the flag.
@njit(**_FLAGS)
def small_groups_serial(x, w, tasks, transposed, zero, y):
    """small_groups on the calling thread only (same arithmetic per element)."""
    N = y.shape[2]
    chunk = NK_CHUNK if transposed else KN_CHUNK
    nblk = (N + chunk - 1) // chunk
    for t in range(tasks.shape[0] * nblk):
        _run(x, w, tasks, t, nblk, chunk, N, transposed, zero, y)


def signatures():
    """(name, kernel, example args) for every compiled signature, used by warm-up."""
    out = []
    tasks = np.array([[0, 1, 0, 5], [0, 0, 5, 6]], dtype=np.int64)
    for dt in (np.float32, np.float64):
        name = np.dtype(dt).name
        x = np.ones((1, 6, 4), dtype=dt)
        w = np.ones((1, 2, 4, 4), dtype=dt)
        for kern in (small_groups, small_groups_serial):
            for transposed in (True, False):
                label = f"ragged_{kern.__name__}_{'nk' if transposed else 'kn'}[{name}]"
                out.append((label, kern, (x, w, tasks, transposed, dt(0), np.empty((1, 6, 4), dt))))
    return out
