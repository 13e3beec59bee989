"""Quantized CUDA GEMMs of the native library (W4A16 MXFP4/NVFP4 over padded experts or over rows
sorted by expert, FP8 block) via :mod:`fmoe._native`.

Nothing here touches CUDA or the library at import time; every check below runs on the
tensors' metadata before anything is launched: the reference's (:func:`fmoe.quant.matmul.
expert_matmul`: argument types, [E, C, K] against [E, N, K], x's dtype, with its error types),
then what the kernels need (formats, K multiple of 32, grid limits, one CUDA device, contiguous
weights, the 16-byte alignment of the W4A16 kernel's 128-bit loads). Build the library with
``native/build.sh``.
"""
from __future__ import annotations

import torch

from .. import _native as N
from .._native import lib  # noqa: F401  (fmoe.quant.training loads the library through this module)
from .tensor import FP4_FORMATS, QuantizedTensor

_FMT = {"mxfp4": 0, "nvfp4": 1}
_GRID_LIMIT = 65535   # the kernels put experts (and FP8 row tiles) on a grid axis of this size


def _quantized(what: str, name: str, w) -> tuple:
    if not isinstance(w, QuantizedTensor):
        raise TypeError(f"{what}: {name} must be a QuantizedTensor, got {type(w).__name__}")
    shape = w.logical_shape
    if len(shape) != 3:
        raise ValueError(f"{what}: {name} must be [E, N, K] (one matrix per expert), got logical shape {shape}")
    return shape


def _weight_leaves(what: str, name: str, w: QuantizedTensor) -> None:
    # A weight is read where it lies: a silent per-call copy would hide its cost.
    for leaf in ("data", "scales"):
        if not getattr(w, leaf).is_contiguous():
            raise ValueError(f"{what}: {name}.{leaf} must be contiguous (the kernel reads it in place); "
                             f"pass a QuantizedTensor with {leaf}=<tensor>.contiguous()")


def _grid(what: str, E: int, **sizes: int) -> None:
    if E > _GRID_LIMIT:
        raise ValueError(f"{what}: E = {E} experts exceeds the kernel's grid limit {_GRID_LIMIT}; "
                         f"call it on slices of at most {_GRID_LIMIT} experts")
    N.fits_int32(what, **sizes)


def _w4a16_operands(what: str, x, w) -> tuple[int, int, int]:
    """(E, N, K) of the W4A16 kernels' weight w (mxfp4/nvfp4), x checked to be a bf16 tensor."""
    E, Nn, K = _quantized(what, "w", w)
    if w.fmt not in _FMT:
        raise ValueError(f"{what}: needs mxfp4 or nvfp4 weights, got {w.fmt}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: x must be a tensor, got {type(x).__name__}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"{what}: x must be bfloat16 (the kernel's A16 operand), got {x.dtype}")
    return E, Nn, K


def _w4a16_aligned_weight(what: str, w: QuantizedTensor) -> None:
    _weight_leaves(what, "w", w)
    if not N.aligned16(w.data):
        raise ValueError(f"{what}: w.data starts at byte {N.address(w.data) % 16} of a 16-byte line; the "
                         f"kernel's 16-byte loads need it aligned: pass a QuantizedTensor whose data is a "
                         f"fresh tensor (data.clone())")


def _w4a16_launch_args(x: torch.Tensor, w: QuantizedTensor, E: int) -> tuple:
    """(x contiguous on a 16-byte boundary, byte scales, float32 global scale [E] or None)."""
    xc = x.contiguous()
    if not N.aligned16(xc):
        xc = xc.clone()   # a fresh allocation starts on a 16-byte boundary
    gs = None if w.global_scale is None else w.global_scale.float().reshape(E).contiguous()
    return xc, w.scales.view(torch.uint8), gs


def w4a16_matmul(x: torch.Tensor, w: QuantizedTensor) -> torch.Tensor:
    """y[e] = x[e] @ dequant(w[e]).T on CUDA. x bf16 [E, C, K]; w mxfp4/nvfp4 [E, N, K] with K a
    multiple of 32; returns bf16 [E, C, N].

    x is copied where it is not contiguous or not 16-byte aligned (the kernel reads it with
    16-byte loads); w.data must be both (ValueError otherwise: a weight is not copied per call).
    """
    what = "w4a16_matmul"
    E, Nn, K = _w4a16_operands(what, x, w)
    if x.dim() != 3 or x.shape[0] != E or x.shape[2] != K:
        raise ValueError(f"{what}: expected x [E, C, K] and w [E, N, K], got x {tuple(x.shape)} and w "
                         f"{(E, Nn, K)}")
    if K % 32:
        raise ValueError(f"{what}: K = {K} must be a multiple of 32 (one 16-byte load covers 32 weights); "
                         f"expert_matmul(path='reference') takes any K")
    C = x.shape[1]
    _grid(what, E, C=C, N=Nn, K=K)
    dev = N.same_cuda_device(what, ("x", x), ("w.data", w.data), ("w.scales", w.scales),
                             ("w.global_scale", w.global_scale))
    _w4a16_aligned_weight(what, w)
    if K == 0:
        return torch.zeros(E, C, Nn, dtype=torch.bfloat16, device=dev)
    y = torch.empty(E, C, Nn, dtype=torch.bfloat16, device=dev)
    if y.numel() == 0:
        return y
    xc, scales, gs = _w4a16_launch_args(x, w, E)
    s = N.stream(what, dev)
    rc = N.lib().fmoe_w4a16_grouped_matmul(N.ptr(xc), N.ptr(w.data), N.ptr(scales), N.ptr(gs), N.ptr(y),
                                           _FMT[w.fmt], E, C, Nn, K, s)
    N.check_rc(rc, what)
    return y


def _offsets(what: str, offsets, E: int) -> None:
    """offsets as the rows kernels take them: an int64 (or int32) tensor [E + 1]; their values are
    not read here (that would be a host sync per call)."""
    if not isinstance(offsets, torch.Tensor) or offsets.dtype not in (torch.int64, torch.int32) \
            or offsets.dim() != 1 or offsets.shape[0] != E + 1:
        got = (f"{offsets.dtype} {tuple(offsets.shape)}" if isinstance(offsets, torch.Tensor)
               else type(offsets).__name__)
        raise ValueError(f"{what}: offsets must be an int64 (or int32) tensor [E + 1] = [{E + 1}] (expert e owns "
                         f"rows offsets[e]:offsets[e + 1]), got {got}")


def w4a16_rows_matmul(x: torch.Tensor, w: QuantizedTensor, offsets: torch.Tensor) -> torch.Tensor:
    """y[r] = x[r] @ dequant(w[e]).T for the rows offsets[e] <= r < offsets[e + 1], on CUDA.

    x: bf16 [R, K], rows sorted by expert (a rows plan's rows); w: mxfp4/nvfp4 [E, N, K] with K a
    multiple of 32; offsets: int64 or int32 [E + 1] on x's device, from 0, never decreasing, ending
    at R. Returns bf16 [R, N]. One launch (``fmoe_w4a16_rows_matmul``) over (N tiles, experts):
    each block reads its expert's range from offsets on the device, so nothing waits for the GPU
    and Python does nothing per expert; an expert with no rows never reads its weights. The
    values of offsets are not checked (that would be a host sync): the kernel clamps every range
    to [0, R], so bad offsets give wrong rows but no access outside x and y; rows outside every
    range are zero. Per row the same arithmetic as :func:`w4a16_matmul`.

    x is copied where it is not contiguous or not 16-byte aligned; w.data must be both (ValueError).
    """
    what = "w4a16_rows_matmul"
    E, Nn, K = _w4a16_operands(what, x, w)
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"{what}: expected x [R, K] and w [E, N, K], got x {tuple(x.shape)} and w {(E, Nn, K)}")
    _offsets(what, offsets, E)
    if K % 32:
        raise ValueError(f"{what}: K = {K} must be a multiple of 32 (one 16-byte load covers 32 weights); "
                         f"fmoe.quant.matmul.rows_matmul(path='grouped') takes any K")
    R = x.shape[0]
    _grid(what, E, R=R, N=Nn, K=K)
    dev = N.same_cuda_device(what, ("x", x), ("offsets", offsets), ("w.data", w.data), ("w.scales", w.scales),
                             ("w.global_scale", w.global_scale))
    _w4a16_aligned_weight(what, w)
    y = torch.zeros(R, Nn, dtype=torch.bfloat16, device=dev)   # rows outside every range stay zero
    if y.numel() == 0 or E == 0 or K == 0:
        return y
    xc, scales, gs = _w4a16_launch_args(x, w, E)
    offs = offsets.to(torch.int64).contiguous()   # widened on the device: no host read
    s = N.stream(what, dev)
    rc = N.lib().fmoe_w4a16_rows_matmul(N.ptr(xc), N.ptr(offs), N.ptr(w.data), N.ptr(scales), N.ptr(gs), N.ptr(y),
                                        _FMT[w.fmt], E, R, Nn, K, s)
    N.check_rc(rc, what)
    return y


def fp8_block_matmul(a: QuantizedTensor, b: QuantizedTensor) -> torch.Tensor:
    """y[e] = dequant(a[e]) @ dequant(b[e]).T on CUDA with FP8 operands.
    a: fp8_block with block (1, 128) [E, M, K] (activations, e.g. quantize_fp8_act_tiles);
    b: fp8_block with block (128, 128) [E, N, K] (weights). Returns bf16 [E, M, N].

    a's leaves are copied where not contiguous; b's must be contiguous. Any alignment works (the
    kernel uses 16-byte loads only on aligned rows)."""
    what = "fp8_block_matmul"
    E, M, K = _quantized(what, "a", a)
    Eb, Nn, Kb = _quantized(what, "b", b)
    if a.fmt != "fp8_block" or tuple(a.block) != (1, 128):
        raise ValueError(f"{what}: a must be fp8_block (1, 128), got {a!r}")
    if b.fmt != "fp8_block" or tuple(b.block) != (128, 128):
        raise ValueError(f"{what}: b must be fp8_block (128, 128), got {b!r}")
    if (E, K) != (Eb, Kb):
        raise ValueError(f"{what}: a {a.logical_shape} and b {b.logical_shape} disagree")
    _grid(what, E, M=M, N=Nn, K=K)
    if -(-M // 64) > _GRID_LIMIT:
        raise ValueError(f"{what}: M = {M} rows exceeds the kernel's {_GRID_LIMIT * 64}-row limit; split the call")
    dev = N.same_cuda_device(what, ("a.data", a.data), ("a.scales", a.scales), ("b.data", b.data),
                             ("b.scales", b.scales))
    _weight_leaves(what, "b", b)
    if K == 0:
        return torch.zeros(E, M, Nn, dtype=torch.bfloat16, device=dev)
    y = torch.empty(E, M, Nn, dtype=torch.bfloat16, device=dev)
    if y.numel() == 0:
        return y
    ad, asc = a.data.contiguous(), a.scales.contiguous()
    s = N.stream(what, dev)
    rc = N.lib().fmoe_fp8_block_grouped_gemm(N.ptr(ad), N.ptr(asc), N.ptr(b.data), N.ptr(b.scales), N.ptr(y),
                                             E, M, Nn, K, s)
    N.check_rc(rc, what)
    return y
