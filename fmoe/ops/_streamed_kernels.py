"""numba kernels for :mod:`fmoe.ops.streamed`'s SiLU-gated activation: numpy in, numpy out.

Between an expert's GEMMs the activation and its gradient are elementwise chains over [n, H]
(sigmoid, products, the gate-weight scaling, a row sum): as torch ops each is one pass over
memory (about fourteen in backward). Here each is one pass, parallel over rows. Arrays may be
strided views (gate and up are the two halves of one [n, 2H] projection; their gradients go
into the halves of one [n, 2H] buffer); float32 and float64 only.

The row sum is reassociated (fastmath), and exp is numba's: equal to the torch composition
within float rounding, not bit for bit.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

_FLAGS = dict(cache=True, nogil=True)
_FAST = {"reassoc", "contract", "nsz", "arcp"}


@njit(parallel=True, fastmath=_FAST, **_FLAGS)
def silu_forward(g, u, h):
    """h = silu(g) * u, all [n, H]."""
    n, H = g.shape
    for r in prange(n):
        for c in range(H):
            gv = g[r, c]
            h[r, c] = gv / (1.0 + np.exp(-gv)) * u[r, c]


@njit(parallel=True, fastmath=_FAST, **_FLAGS)
def silu_backward(g, u, gh, w, dg, du, hw, dw):
    """One pass of the SiLU-gated activation's backward for rows of one expert.

    Args:
        g, u: [n, H] gate and up pre-activations.
        gh: [n, H] dy D_eᵀ (the unscaled hidden gradient).
        w: [n] gate weight of each row.
    Writes:
        dg, du: [n, H] dL/dg, dL/du with dL/dh = w * gh.
        hw: [n, H] w * silu(g) * u (the down GEMM's weight-gradient operand).
        dw: [n] <gh, silu(g) * u> per row (the gate-weight gradient).
    """
    n, H = g.shape
    for r in prange(n):
        wr = w[r]
        acc = 0.0
        for c in range(H):
            gv = g[r, c]
            uv = u[r, c]
            s = 1.0 / (1.0 + np.exp(-gv))
            a = gv * s
            h = a * uv
            ghv = gh[r, c]
            acc += ghv * h
            t = ghv * wr
            du[r, c] = t * a
            dg[r, c] = t * uv * (s * (1.0 + gv * (1.0 - s)))
            hw[r, c] = h * wr
        dw[r] = acc


def signatures():
    """(name, kernel, example args) for every compiled signature, used by warm-up.

    Both contiguous and strided (half of a [n, 2H] buffer) operands are compiled."""
    out = []
    for dt in (np.float32, np.float64):
        name = np.dtype(dt).name
        z = np.ones((3, 8), dtype=dt)
        half = (z[:, :4], z[:, 4:])
        full = np.ones((3, 4), dtype=dt)
        for tag, (g, u) in (("strided", half), ("contiguous", (full, full.copy()))):
            out.append((f"streamed_silu_forward_{tag}[{name}]", silu_forward, (g, u, np.empty((3, 4), dt))))
            d = np.empty((3, 8), dtype=dt)
            for dtag, (dg, du) in (("strided", (d[:, :4], d[:, 4:])),):
                out.append((f"streamed_silu_backward_{tag}_{dtag}[{name}]", silu_backward,
                            (g, u, np.ones((3, 4), dt), np.ones(3, dt), dg, du, np.empty((3, 4), dt),
                             np.empty(3, dt))))
    return out
