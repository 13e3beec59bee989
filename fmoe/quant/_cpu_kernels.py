"""numba kernels: expert matmul y[e] = x[e] @ W[e].T decoding packed weights in registers.

No dequantized copy of W is made. FP4: each task owns a tile of rows of one expert; 4 rows and
a K chunk at a time are decoded (block scale folded in) into a small L1-resident buffer, and
all C tokens of the expert are dotted against it, so weight bytes are decoded once per call.
FP8: each row is decoded one block at a time and reused for all C tokens. All accumulation is
FP32; the summation order differs from dequantize-then-matmul, the value set does not (the
scaled FP4 weights 2*E2M1 * s are exact products).

Arrays are plain numpy (zero-copy views of torch tensors); shapes are documented per kernel.
The FP4 decode is float arithmetic (floor / min / max / fma on float32 codes): numba's integer
typing widened the int32 version to 8 x int64 lanes, about 1.6x slower per weight.
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

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


_F0, _F2, _F4, _F6, _F8, _F16, _F1_16 = (np.float32(v) for v in (0, 2, 4, 6, 8, 16, 1 / 16))


@njit(fastmath=_FM, inline="always", cache=True)
def _e2m1_twice_f(c):
    """2 * E2M1(c) for a float32 code c in 0..15, in float arithmetic (16 lanes per AVX-512
    op; numba's integer typing widened the int version to 8 x int64 lanes). Exact."""
    neg = c >= _F8
    u = c - _F8 if neg else c
    m = u + max(u - _F4, _F0) + _F2 * max(u - _F6, _F0)
    return -m if neg else m


@njit(fastmath=_FM, inline="always", cache=True)
def _fp4_pair(b):
    """Byte b (two codes) -> (2*E2M1(low nibble), 2*E2M1(high nibble)) as float32."""
    bf = _f32(b)
    hi = np.floor(bf * _F1_16)
    return _e2m1_twice_f(bf - _F16 * hi), _e2m1_twice_f(hi)


# 2 * E2M1 by code (the sign bit is bit 3); the decode tables below index it.
_E2M1_TWICE = [0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, -0.0, -1.0, -2.0, -3.0, -4.0, -6.0, -8.0, -12.0]


@intrinsic
def _fp4_decode16(typingctx, data, off, s0, s1, w, woff):
    """16 packed bytes at flat byte offset `off` of the C-contiguous uint8 array `data` ->
    32 floats w[woff:woff+32] in k order (low nibble first): 2*E2M1(code) * scale, with
    scale = s0 for bytes 0..7 and s1 for bytes 8..15.

    Written as LLVM vector IR: the 16-entry table lookup is a build_vector of variable-index
    extracts from a constant vector, which the x86 backend lowers to one vpermps per 16
    weights on AVX-512 (other targets get a correct generic lowering), and the two halves are
    interleaved back into k order with two shuffles. numba's loop form of this decode was
    10+ vector ops per 16 weights (measured 4x slower per weight). No bounds checks: callers
    pass in-range offsets. Exact (products of 2*E2M1 and a scale).
    """
    sig = types.void(data, off, s0, s1, w, woff)

    def codegen(context, builder, signature, args):
        data_v, off_v, s0_v, s1_v, w_v, woff_v = args
        da = context.make_array(signature.args[0])(context, builder, data_v)
        wa = context.make_array(signature.args[4])(context, builder, w_v)
        i32 = ir.IntType(32)
        v16i8 = ir.VectorType(ir.IntType(8), 16)
        v16i32 = ir.VectorType(i32, 16)
        v16f = ir.VectorType(ir.FloatType(), 16)
        undef = ir.Constant(v16f, ir.Undefined)
        p = builder.bitcast(builder.gep(da.data, [off_v]), v16i8.as_pointer())
        b = builder.zext(builder.load(p, align=1), v16i32)
        lo = builder.and_(b, ir.Constant(v16i32, [15] * 16))
        hi = builder.lshr(b, ir.Constant(v16i32, [4] * 16))
        table = ir.Constant(v16f, _E2M1_TWICE)
        sv = builder.insert_element(undef, s0_v, ir.Constant(i32, 0))
        sv = builder.insert_element(sv, s1_v, ir.Constant(i32, 1))
        sv = builder.shuffle_vector(sv, undef, ir.Constant(v16i32, [0] * 8 + [1] * 8))

        def lookup(idx):
            res = undef
            for i in range(16):
                lane = ir.Constant(i32, i)
                res = builder.insert_element(
                    res, builder.extract_element(table, builder.extract_element(idx, lane)), lane)
            return builder.fmul(res, sv)

        vlo, vhi = lookup(lo), lookup(hi)
        for half in range(2):
            mask = [v for i in range(8 * half, 8 * half + 8) for v in (i, 16 + i)]
            v = builder.shuffle_vector(vlo, vhi, ir.Constant(v16i32, mask))
            q = builder.gep(wa.data, [builder.add(woff_v, ir.Constant(woff_v.type, 16 * half))])
            builder.store(v, builder.bitcast(q, v16f.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(fastmath=_FM, inline="always", cache=True)
def _fp4_decode(data, scales, e, r, j0, j1, table, hb, w):
    """Decode bytes data[e, r, j0:j1] (whole blocks; data C-contiguous) into w[0:2*(j1-j0)] in
    k order, each value 2*E2M1 * its block scale. The block loops have constant trip counts
    (an 8-trip loop ran scalar, so NVFP4 decodes two 8-byte blocks per 16-byte step); the
    odd-block tail and other block sizes take a scalar path."""
    row0 = (e * data.shape[1] + r) * data.shape[2]
    if hb == 16:
        for kb in range(j0 // 16, j1 // 16):
            s = table[scales[e, r, kb]]
            _fp4_decode16(data, row0 + kb * 16, s, s, w, 2 * (kb * 16 - j0))
        return
    jv = j0  # bytes decoded by the vector path
    if hb == 8:
        b0 = j0 // 8
        nb = (j1 - j0) // 8
        for kp in range(nb // 2):
            kb = b0 + 2 * kp
            _fp4_decode16(data, row0 + kb * 8, table[scales[e, r, kb]],
                          table[scales[e, r, kb + 1]], w, 32 * kp)
        jv = j0 + 16 * (nb // 2)
    for j in range(jv, j1):
        s = table[scales[e, r, j // hb]]
        lo, hi = _fp4_pair(data[e, r, j])
        w[2 * (j - j0)] = lo * s
        w[2 * (j - j0) + 1] = hi * s


@njit(fastmath=_FM, inline="always", cache=True)
def _dot_rows4(x, e, k0, k1, c4, C, w0, w1, w2, w3, acc):
    """acc[c, i] += sum_k x[e, c, k0 + k] * w_i[k] for every token c of expert e and the 4 decoded
    rows w0..w3 (k < k1 - k0): 4 tokens per pass (8 vector loads per 16 FMAs), then the rest.
    Shared by the FP4 and FP8 kernels; inlined, so each compiles to its own loop nest."""
    for c in range(0, c4, 4):
        a0 = x[e, c, k0:k1]
        a1 = x[e, c + 1, k0:k1]
        a2 = x[e, c + 2, k0:k1]
        a3 = x[e, c + 3, k0:k1]
        t0 = _f32(0.0)
        t1 = _f32(0.0)
        t2 = _f32(0.0)
        t3 = _f32(0.0)
        u0 = _f32(0.0)
        u1 = _f32(0.0)
        u2 = _f32(0.0)
        u3 = _f32(0.0)
        v0 = _f32(0.0)
        v1 = _f32(0.0)
        v2 = _f32(0.0)
        v3 = _f32(0.0)
        z0 = _f32(0.0)
        z1 = _f32(0.0)
        z2 = _f32(0.0)
        z3 = _f32(0.0)
        for k in range(k1 - k0):
            m0 = w0[k]
            m1 = w1[k]
            m2 = w2[k]
            m3 = w3[k]
            xa = a0[k]
            t0 += m0 * xa
            t1 += m1 * xa
            t2 += m2 * xa
            t3 += m3 * xa
            xa = a1[k]
            u0 += m0 * xa
            u1 += m1 * xa
            u2 += m2 * xa
            u3 += m3 * xa
            xa = a2[k]
            v0 += m0 * xa
            v1 += m1 * xa
            v2 += m2 * xa
            v3 += m3 * xa
            xa = a3[k]
            z0 += m0 * xa
            z1 += m1 * xa
            z2 += m2 * xa
            z3 += m3 * xa
        acc[c + 0, 0] += t0
        acc[c + 0, 1] += t1
        acc[c + 0, 2] += t2
        acc[c + 0, 3] += t3
        acc[c + 1, 0] += u0
        acc[c + 1, 1] += u1
        acc[c + 1, 2] += u2
        acc[c + 1, 3] += u3
        acc[c + 2, 0] += v0
        acc[c + 2, 1] += v1
        acc[c + 2, 2] += v2
        acc[c + 2, 3] += v3
        acc[c + 3, 0] += z0
        acc[c + 3, 1] += z1
        acc[c + 3, 2] += z2
        acc[c + 3, 3] += z3
    for c in range(c4, C):
        a0 = x[e, c, k0:k1]
        t0 = _f32(0.0)
        t1 = _f32(0.0)
        t2 = _f32(0.0)
        t3 = _f32(0.0)
        for k in range(k1 - k0):
            m0 = w0[k]
            m1 = w1[k]
            m2 = w2[k]
            m3 = w3[k]
            xa = a0[k]
            t0 += m0 * xa
            t1 += m1 * xa
            t2 += m2 * xa
            t3 += m3 * xa
        acc[c + 0, 0] += t0
        acc[c + 0, 1] += t1
        acc[c + 0, 2] += t2
        acc[c + 0, 3] += t3


@njit(parallel=True, fastmath=_FM, cache=True)
def fp4_matmul(x, data, scales, scale_table, gscale, out, tile_n, chunk):
    """FP4 (MXFP4 / NVFP4) expert matmul.

    x       float32 [E, C, K]     C-contiguous
    data    uint8   [E, N, K/2]   packed E2M1, low nibble = even k; C-contiguous
    scales  uint8   [E, N, K/bk]  block scale bytes (E8M0 or UE4M3)
    scale_table float32 [256]     byte -> block scale value
    gscale  float32 [E]           per-expert second-level scale (1 for MXFP4)
    out     float32 [E, C, N]
    tile_n  rows per parallel task; chunk: packed bytes of K per pass (a multiple of bk/2)

    One task = tile_n rows of one expert. Within it, 4 rows and `chunk` bytes of K at a time
    are decoded (scale folded in: 2*E2M1 * s is exact) into an L1-resident buffer in k order,
    then every token of the expert is dotted against all 4 rows, 4 tokens per pass (8 vector
    loads per 16 FMAs), so each weight byte is decoded once per call, not once per token.
    """
    E, C, K = x.shape
    N = data.shape[1]
    KH = data.shape[2]
    KB = scales.shape[2]
    hb = KH // KB  # bytes per block
    ch = min(max(hb, chunk - chunk % hb), KH)
    nt = (N + tile_n - 1) // tile_n
    c4 = C - C % 4
    for job in prange(E * nt):
        e = job // nt
        n0 = (job - e * nt) * tile_n
        n1 = min(N, n0 + tile_n)
        w0 = np.empty(2 * ch, np.float32)
        w1 = np.empty(2 * ch, np.float32)
        w2 = np.empty(2 * ch, np.float32)
        w3 = np.empty(2 * ch, np.float32)
        acc = np.empty((C, 4), np.float32)
        g = gscale[e] * _f32(0.5)  # the decode produced 2 * E2M1
        for n in range(n0, n1, 4):
            r0 = n
            r1 = min(n + 1, n1 - 1)  # a short last group repeats its last row (same value)
            r2 = min(n + 2, n1 - 1)
            r3 = min(n + 3, n1 - 1)
            acc[:] = _f32(0.0)
            for j0 in range(0, KH, ch):
                j1 = min(j0 + ch, KH)
                k0 = 2 * j0
                k1 = 2 * j1
                _fp4_decode(data, scales, e, r0, j0, j1, scale_table, hb, w0)
                _fp4_decode(data, scales, e, r1, j0, j1, scale_table, hb, w1)
                _fp4_decode(data, scales, e, r2, j0, j1, scale_table, hb, w2)
                _fp4_decode(data, scales, e, r3, j0, j1, scale_table, hb, w3)
                _dot_rows4(x, e, k0, k1, c4, C, w0, w1, w2, w3, acc)
            for c in range(C):
                out[e, c, r0] = acc[c, 0] * g
                out[e, c, r1] = acc[c, 1] * g
                out[e, c, r2] = acc[c, 2] * g
                out[e, c, r3] = acc[c, 3] * g


@intrinsic
def _e4m3_decode16(typingctx, data, off, s, w, woff):
    """16 E4M3 bytes at flat byte offset `off` of the C-contiguous uint8 array `data` ->
    w[woff:woff+16] = value * s (float32; one rounding, as in dequantize()).

    LLVM vector IR, branch-free: normals by moving the exponent/mantissa bits into FP32
    position and rebiasing (e + 120), subnormals as m * 2^-9, 0x7F/0xFF -> NaN, sign ORed in.
    Replaces a 256-entry table gather per weight."""
    sig = types.void(data, off, s, w, woff)

    def codegen(context, builder, signature, args):
        data_v, off_v, s_v, w_v, woff_v = args
        da = context.make_array(signature.args[0])(context, builder, data_v)
        wa = context.make_array(signature.args[3])(context, builder, w_v)
        i32 = ir.IntType(32)
        v16i8 = ir.VectorType(ir.IntType(8), 16)
        v16i32 = ir.VectorType(i32, 16)
        v16f = ir.VectorType(ir.FloatType(), 16)
        undef = ir.Constant(v16f, ir.Undefined)

        def splat_i(v):
            return ir.Constant(v16i32, [v] * 16)

        p = builder.bitcast(builder.gep(da.data, [off_v]), v16i8.as_pointer())
        b = builder.zext(builder.load(p, align=1), v16i32)
        em = builder.and_(b, splat_i(0x7F))
        sign = builder.shl(builder.and_(b, splat_i(0x80)), splat_i(24))
        normal = builder.bitcast(builder.add(builder.shl(em, splat_i(20)), splat_i(120 << 23)), v16f)
        sub = builder.fmul(builder.uitofp(em, v16f), ir.Constant(v16f, [2.0 ** -9] * 16))
        mag = builder.select(builder.icmp_unsigned("<", em, splat_i(8)), sub, normal)
        mag = builder.select(builder.icmp_unsigned("==", em, splat_i(0x7F)),
                             ir.Constant(v16f, [float("nan")] * 16), mag)
        val = builder.bitcast(builder.or_(builder.bitcast(mag, v16i32), sign), v16f)
        sv = builder.insert_element(undef, s_v, ir.Constant(i32, 0))
        sv = builder.shuffle_vector(sv, undef, ir.Constant(v16i32, [0] * 16))
        q = builder.bitcast(builder.gep(wa.data, [woff_v]), v16f.as_pointer())
        builder.store(builder.fmul(val, sv), q, align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(fastmath=_FM, inline="always", cache=True)
def _fp8_decode(data, srow, bk, table, e, r, k0, k1, w):
    """Decode data[e, r, k0:k1] (C-contiguous uint8 E4M3) into w[0:k1-k0], each value times its
    block scale srow[k // bk]: 16 at a time through the intrinsic, ragged ends by table."""
    row0 = (e * data.shape[1] + r) * data.shape[2]
    ka = k0
    while ka < k1:
        kb = min(k1, (ka // bk + 1) * bk)  # end of this scale block within the chunk
        s = srow[ka // bk]
        kv = ka + (kb - ka) // 16 * 16
        for k in range(ka, kv, 16):
            _e4m3_decode16(data, row0 + k, s, w, k - k0)
        for k in range(kv, kb):
            w[k - k0] = table[data[e, r, k]] * s
        ka = kb


@njit(parallel=True, fastmath=_FM, cache=True)
def fp8_matmul(x, data, scales, bn, bk, table, out, tile_n, chunk):
    """FP8 E4M3 expert matmul with [bn, bk] block scales (fp8_block, fp8_row, mxfp8).

    x       float32 [E, C, K]      C-contiguous
    data    uint8   [E, N, K]      E4M3 bytes, C-contiguous
    scales  float32 [E, ceil(N/bn), ceil(K/bk)]
    table   float32 [256]          E4M3 byte -> value (ragged ends)
    out     float32 [E, C, N]
    tile_n  rows per parallel task; chunk: elements of K decoded per pass

    Same structure as fp4_matmul: 4 rows x `chunk` k decoded (scale applied, the same FP32
    product dequantize() forms) into an L1-resident buffer, then all tokens dotted against it,
    4 tokens per pass.
    """
    E, C, K = x.shape
    N = data.shape[1]
    ch = min(chunk, K)
    nt = (N + tile_n - 1) // tile_n
    c4 = C - C % 4
    for job in prange(E * nt):
        e = job // nt
        n0 = (job - e * nt) * tile_n
        n1 = min(N, n0 + tile_n)
        w0 = np.empty(ch, np.float32)
        w1 = np.empty(ch, np.float32)
        w2 = np.empty(ch, np.float32)
        w3 = np.empty(ch, np.float32)
        acc = np.empty((C, 4), np.float32)
        for n in range(n0, n1, 4):
            r0 = n
            r1 = min(n + 1, n1 - 1)  # a short last group repeats its last row (same value)
            r2 = min(n + 2, n1 - 1)
            r3 = min(n + 3, n1 - 1)
            acc[:] = _f32(0.0)
            for k0 in range(0, K, ch):
                k1 = min(k0 + ch, K)
                _fp8_decode(data, scales[e, r0 // bn], bk, table, e, r0, k0, k1, w0)
                _fp8_decode(data, scales[e, r1 // bn], bk, table, e, r1, k0, k1, w1)
                _fp8_decode(data, scales[e, r2 // bn], bk, table, e, r2, k0, k1, w2)
                _fp8_decode(data, scales[e, r3 // bn], bk, table, e, r3, k0, k1, w3)
                _dot_rows4(x, e, k0, k1, c4, C, w0, w1, w2, w3, acc)
            for c in range(C):
                out[e, c, r0] = acc[c, 0]
                out[e, c, r1] = acc[c, 1]
                out[e, c, r2] = acc[c, 2]
                out[e, c, r3] = acc[c, 3]


@njit(parallel=True, cache=True)
def table_decode(codes, table, out):
    """out[i] = table[codes[i]] for flat uint8 codes (E8M0 scale bytes -> float32 in numba:
    torch's gather ran on its OpenMP threads, which then fought numba's TBB threads)."""
    for i in prange(codes.shape[0]):
        out[i] = table[codes[i]]


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


# --- quantize-dequantize ("fake quantization") for quantized training ------------------------
# One pass per block: scale, element encode and decode, bit-exact with
# formats.dequantize(formats.quantize(...)) (tests/test_quant_training.py compares every
# format, including ties and subnormal codes). No fastmath anywhere: the pinned formulas use
# IEEE float32 division and a fixed order of products. Element rounding works on float64
# copies where that is exact (power-of-two scalings and np.rint, which rounds half to even).

_F448 = np.float32(448.0)
_FINF = np.float32(np.inf)
_F2688 = np.float32(6.0 * 448.0)
_F6f = np.float32(6.0)
_F1f = np.float32(1.0)
_E4M3_MIN_NORMAL = 2.0 ** -6
# E2M1 magnitudes by code 0..7 and the RNE thresholds between them (> strict when the lower
# code is even, >= when odd: ties go to the even code).
_E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)


@njit(inline="always", cache=True)
def _e4m3_rne(v):
    """float32 v (|v| <= 448, finite) -> the E4M3FN value it rounds to (RNE), as float32."""
    a = abs(np.float64(v))
    if a < _E4M3_MIN_NORMAL:
        q = np.rint(a * 512.0) / 512.0  # subnormal quantum 2^-9
    else:
        m, e = math.frexp(a)  # a = m 2^e, m in [0.5, 1): 3 mantissa bits -> quantum 2^(e-4)
        quantum = math.ldexp(1.0, e - 4)
        q = np.rint(a / quantum) * quantum
    return np.float32(math.copysign(q, v))


_U_MIN_NORMAL = np.uint32(0x3C800000)   # float32 bits of 2^-6, E4M3's smallest normal
_U_ABS = np.uint32(0x7FFFFFFF)
_U_SIGN = np.uint32(0x80000000)
_U_KEEP = np.uint32(0xFFF00000)           # sign, exponent and the top 3 mantissa bits
_U_HALF = np.uint32(0x7FFFF)
_F_SUB_MAGIC = np.float32(2.0 ** 14)       # ulp(2^14) = 2^-9, E4M3's subnormal quantum


@njit(inline="always", cache=True)
def _e4m3_round_span(vals, bits, k0, k1):
    """Round vals[k0:k1] (float32, |v| <= 448, finite) to E4M3 in place, RNE, sign of zero
    kept. bits is the same memory viewed as uint32. Normals drop 20 mantissa bits with a
    round-half-even carry on the bit pattern; subnormals (quantum 2^-9) round by adding and
    subtracting 2^14 in float32 (exact RNE at that ulp; no fastmath in this module)."""
    for k in range(k0, k1):
        b = bits[k]
        a = b & _U_ABS
        if a >= _U_MIN_NORMAL:
            a = (a + _U_HALF + ((a >> np.uint32(20)) & np.uint32(1))) & _U_KEEP
            bits[k] = a | (b & _U_SIGN)
    for k in range(k0, k1):
        if (bits[k] & _U_ABS) < _U_MIN_NORMAL:
            v = vals[k]
            r = (abs(v) + _F_SUB_MAGIC) - _F_SUB_MAGIC
            vals[k] = np.float32(math.copysign(np.float64(r), np.float64(v)))


@njit(inline="always", cache=True)
def _e2m1_rne(a):
    """|v| (float32 or float64, finite) -> E2M1 magnitude index 0..7 (RNE, saturating)."""
    i = 0
    if a > 0.25:
        i += 1
    if a >= 0.75:
        i += 1
    if a > 1.25:
        i += 1
    if a >= 1.75:
        i += 1
    if a > 2.5:
        i += 1
    if a >= 3.5:
        i += 1
    if a > 5.0:
        i += 1
    return i


@njit(inline="always", cache=True)
def _e2m1_sr(v, u, grid):
    """Stochastic E2M1 magnitude index of float32 v with uniform u in [0, 1) (as
    training._sr_e2m1): up with probability (|v| - lo) / (hi - lo)."""
    a = min(abs(v), _F6f)
    lo = 0
    for j in range(1, 8):
        if grid[j] <= a:
            lo = j
    hi = min(lo + 1, 7)
    gap = grid[hi] - grid[lo]
    p = (a - grid[lo]) / gap if gap > 0 else np.float32(0.0)
    return hi if u < p else lo


@njit(inline="always", cache=True)
def _signed(mag, v):
    return np.float32(math.copysign(np.float64(mag), np.float64(v)))


@njit(parallel=True, cache=True)
def fq_fp8_rows(x, out, bk, amax_floor):
    """FP8 E4M3 with one FP32 scale per bk-wide block of each row (bk = K: per row), the
    pinned s = max(amax, amax_floor) / 448 (s = 1 where that is 0). x, out float32 [R, K];
    ragged last block allowed. Returns the number of non-finite inputs (nothing is written
    for their rows' blocks beyond a NaN-free placeholder; the caller raises)."""
    R, K = x.shape
    nb = (K + bk - 1) // bk
    bad = 0
    for r in prange(R):
        for b in range(nb):
            k0 = b * bk
            k1 = min(K, k0 + bk)
            amax = np.float32(0.0)
            for k in range(k0, k1):
                a = abs(x[r, k])
                if not (a < _FINF):
                    bad += 1
                amax = max(amax, a)
            amax = max(amax, amax_floor)
            s = amax / _F448
            if s == 0:
                s = _F1f
            orow = out[r]
            for k in range(k0, k1):
                orow[k] = min(max(x[r, k] / s, -_F448), _F448)
            _e4m3_round_span(orow, orow.view(np.uint32), k0, k1)
            for k in range(k0, k1):
                orow[k] = orow[k] * s
    return bad


@njit(parallel=True, cache=True)
def fq_fp8_block2d(x, out, bn, bk):
    """DeepSeek 128x128-style FP8 weight blocks on x, out float32 [B, N, K]: s = amax/448
    (1 for a zero block), q = E4M3(clamp(x / s)), out = q * s. Returns the non-finite count."""
    B, N, K = x.shape
    nbn = (N + bn - 1) // bn
    nbk = (K + bk - 1) // bk
    bad = 0
    for t in prange(B * nbn):
        bb = t // nbn
        n0 = (t % nbn) * bn
        n1 = min(N, n0 + bn)
        for j in range(nbk):
            k0 = j * bk
            k1 = min(K, k0 + bk)
            amax = np.float32(0.0)
            for n in range(n0, n1):
                for k in range(k0, k1):
                    a = abs(x[bb, n, k])
                    if not (a < _FINF):
                        bad += 1
                    amax = max(amax, a)
            s = amax / _F448
            if amax == 0:
                s = _F1f
            for n in range(n0, n1):
                orow = out[bb, n]
                for k in range(k0, k1):
                    orow[k] = min(max(x[bb, n, k] / s, -_F448), _F448)
                _e4m3_round_span(orow, orow.view(np.uint32), k0, k1)
                for k in range(k0, k1):
                    orow[k] = orow[k] * s
    return bad


@njit(parallel=True, cache=True)
def fq_mx(x, out, fp4, u, use_sr):
    """OCP MX with FLOOR scales over 32-element blocks of each row: MXFP8 (fp4 False, E4M3,
    emax 8) or MXFP4 (fp4 True, E2M1, emax 2). x, out float32 [R, K], K % 32 == 0.
    u float32 [R, K] uniforms for stochastic E2M1 rounding when use_sr (else unused).
    Returns the non-finite count."""
    R, K = x.shape
    nb = K // 32
    emax = 2 if fp4 else 8
    grid = _E2M1_GRID
    bad = 0
    for r in prange(R):
        for b in range(nb):
            k0 = b * 32
            amax = np.float32(0.0)
            for k in range(k0, k0 + 32):
                a = abs(x[r, k])
                if not (a < _FINF):
                    bad += 1
                amax = max(amax, a)
            if amax > 0:
                m, e = math.frexp(np.float64(amax))
                se = max(e - 1 - emax, -127)
            else:
                se = -127
            inv = math.ldexp(1.0, -se)         # exact division by 2^se, in float64
            scale = np.float32(math.ldexp(1.0, se))  # the E8M0 value as float32 (2^-127 is subnormal)
            if fp4:
                for k in range(k0, k0 + 32):
                    q = np.float64(x[r, k]) * inv
                    if use_sr:
                        qf = np.float32(q)
                        mag = grid[_e2m1_sr(qf, u[r, k], grid)]
                        out[r, k] = _signed(mag, qf) * scale
                    else:
                        mag = grid[_e2m1_rne(abs(q))]
                        out[r, k] = _signed(mag, q) * scale
            else:
                orow = out[r]
                for k in range(k0, k0 + 32):
                    qf = np.float32(np.float64(x[r, k]) * inv)
                    orow[k] = min(max(qf, -_F448), _F448)
                _e4m3_round_span(orow, orow.view(np.uint32), k0, k0 + 32)
                for k in range(k0, k0 + 32):
                    orow[k] = orow[k] * scale
    return bad


@njit(parallel=True, cache=True)
def fq_nvfp4(x, out, u, use_sr):
    """NVFP4 in the ModelOpt form (formats.quantize_nvfp4) on x, out float32 [B, N, K]
    (K % 16 == 0): one FP32 global scale per [N, K] matrix, UE4M3 scales per 16 elements,
    decoded as (e2m1 * s_block) * s_global. u, use_sr: stochastic E2M1 rounding. Returns the
    non-finite count."""
    B, N, K = x.shape
    nb = K // 16
    grid = _E2M1_GRID
    bad = 0
    for bb in range(B):
        gmax = np.float32(0.0)
        for n in range(N):
            for k in range(K):
                a = abs(x[bb, n, k])
                if not (a < _FINF):
                    bad += 1
                gmax = max(gmax, a)
        sf2 = gmax / _F2688
        if not (sf2 > 0):
            sf2 = _F1f
        six_sf2 = _F6f * sf2
        for n in prange(N):
            for b in range(nb):
                k0 = b * 16
                amax = np.float32(0.0)
                for k in range(k0, k0 + 16):
                    amax = max(amax, abs(x[bb, n, k]))
                if amax == 0:
                    s = _F1f
                else:
                    s = max(amax / six_sf2, np.float32(2.0 ** -9))
                s8 = _e4m3_rne(min(s, _F448))
                divisor = s8 * sf2
                for k in range(k0, k0 + 16):
                    q = x[bb, n, k] / divisor
                    if use_sr:
                        mag = grid[_e2m1_sr(q, u[bb, n, k], grid)]
                    else:
                        mag = grid[_e2m1_rne(abs(q))]
                    out[bb, n, k] = (_signed(mag, q) * s8) * sf2
    return bad
