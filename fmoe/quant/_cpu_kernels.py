"""numba kernels: expert matmul y[e] = x[e] @ W[e].T decoding packed weights in registers.

No dequantized copy of W is made: each weight row is decoded one block at a time into a
small local buffer that is reused for all C tokens of that expert. All accumulation is FP32;
a block's partial dot product is multiplied by its scale once (exact for power-of-two MX
scales), which is a different summation order than dequantize-then-matmul, not a different
value set.

Arrays are plain numpy (zero-copy views of torch tensors); shapes are documented per kernel.
Staging a decoded block in a 16-float buffer and then running a separate dot loop measured
about 2x faster than decoding straight into the dot product, even at C = 1 (both vectorise
better apart). Integer arithmetic is kept in int32 on purpose: numba promotes int32 op int-literal to int64,
which stops LLVM from vectorising the decode.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .. import _numba  # noqa: F401  (configures numba's TBB threading layer before any kernel)

# reassoc lets LLVM vectorise the reductions; no nnan/ninf, so inf/NaN scales propagate.
_FM = {"reassoc", "contract", "nsz", "arcp"}
_i32 = np.int32
_f32 = np.float32
_I0, _I1, _I2, _I3, _I4, _I6, _I7, _I15 = (np.int32(v) for v in (0, 1, 2, 3, 4, 6, 7, 15))


@njit(fastmath=_FM, inline="always", cache=True)
def _e2m1_twice(code):
    """2 * E2M1(code) as int32 (values -12..12), branch-free so the loop vectorises.

    Magnitudes x2 for codes 0..7 are 0,1,2,3,4,6,8,12 = u + relu(u-4) + 2*relu(u-6).
    """
    u = code & _I7
    m = u + max(u - _I4, _I0) + _I2 * max(u - _I6, _I0)
    s = -(code >> _I3)  # 0 or -1
    return (m ^ s) - s


@njit(parallel=True, fastmath=_FM, cache=True)
def fp4_matmul(xe, xo, data, scales, scale_table, gscale, out):
    """FP4 (MXFP4 / NVFP4) expert matmul.

    xe, xo  float32 [E, C, K/2]   even / odd columns of x (matching the low / high nibbles)
    data    uint8   [E, N, K/2]   packed E2M1, low nibble = even k
    scales  uint8   [E, N, K/bk]  block scale bytes (E8M0 or UE4M3)
    scale_table float32 [256]     byte -> block scale value
    gscale  float32 [E]           per-expert second-level scale (1 for MXFP4)
    out     float32 [E, C, N]
    The block size bk is 2 * (K/2) / scales.shape[2]; bk/2 bytes per block.
    """
    E, C, KH = xe.shape
    N = data.shape[1]
    KB = scales.shape[2]
    hb = KH // KB  # bytes per block
    for job in prange(E * N):
        e = job // N
        n = job - e * N
        row = data[e, n]
        srow = scales[e, n]
        wl = np.empty(hb, np.float32)
        wh = np.empty(hb, np.float32)
        acc = np.zeros(C, np.float32)
        for kb in range(KB):
            base = kb * hb
            for j in range(hb):
                b = _i32(row[base + j])
                wl[j] = _f32(_e2m1_twice(b & _I15))
                wh[j] = _f32(_e2m1_twice(b >> _I4))
            s = scale_table[srow[kb]]
            for c in range(C):
                a = xe[e, c]
                o = xo[e, c]
                t = _f32(0.0)
                for j in range(hb):
                    t += wl[j] * a[base + j] + wh[j] * o[base + j]
                acc[c] += t * s
        g = gscale[e] * _f32(0.5)  # the decode produced 2 * E2M1
        for c in range(C):
            out[e, c, n] = acc[c] * g


@njit(parallel=True, fastmath=_FM, cache=True)
def fp8_matmul(x, data, scales, bn, bk, table, out):
    """FP8 E4M3 expert matmul with [bn, bk] block scales (fp8_block, fp8_row, mxfp8).

    x       float32 [E, C, K]
    data    uint8   [E, N, K]      E4M3 bytes
    scales  float32 [E, ceil(N/bn), ceil(K/bk)]
    table   float32 [256]          E4M3 byte -> value
    out     float32 [E, C, N]
    """
    E, C, K = x.shape
    N = data.shape[1]
    KB = scales.shape[2]
    for job in prange(E * N):
        e = job // N
        n = job - e * N
        row = data[e, n]
        srow = scales[e, n // bn]
        w = np.empty(bk, np.float32)
        acc = np.zeros(C, np.float32)
        for kb in range(KB):
            k0 = kb * bk
            k1 = min(k0 + bk, K)
            for j in range(k1 - k0):
                w[j] = table[row[k0 + j]]
            s = srow[kb]
            for c in range(C):
                a = x[e, c]
                t = _f32(0.0)
                for j in range(k1 - k0):
                    t += w[j] * a[k0 + j]
                acc[c] += t * s
        for c in range(C):
            out[e, c, n] = acc[c]


# No fastmath here: reassociating (v * s) * g into v * (s * g) would change the rounding.
@njit(parallel=True, cache=True)
def fp4_dequant(data, scales, scale_table, gscale, out):
    """Decode one FP4 matrix to FP32 (bit-exact with formats.dequantize).

    data uint8 [N, K/2]; scales uint8 [N, K/bk]; scale_table float32 [256]; gscale float32
    (1 for MXFP4); out float32 [N, K]. The products are exact (E2M1 has 2 significant bits),
    except for the NVFP4 global-scale multiply, which rounds once as in the reference.
    """
    N, KH = data.shape
    KB = scales.shape[1]
    hb = KH // KB
    for n in prange(N):
        row = data[n]
        orow = out[n]
        for kb in range(KB):
            s = scale_table[scales[n, kb]] * _f32(0.5)
            for j in range(kb * hb, kb * hb + hb):
                b = _i32(row[j])
                orow[2 * j] = _f32(_e2m1_twice(b & _I15)) * s * gscale
                orow[2 * j + 1] = _f32(_e2m1_twice(b >> _I4)) * s * gscale
