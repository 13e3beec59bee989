"""Quantized CUDA GEMMs of the native library (W4A16 MXFP4/NVFP4, FP8 block) via :mod:`fmoe._native`.

Nothing here touches CUDA or the library at import time; a CPU tensor is rejected before any
load. Build the library with ``native/build.sh``.
"""
from __future__ import annotations

import torch

from .._native import _DTYPE, _check, _cuda, _ptr, _stream, lib  # noqa: F401
from .tensor import QuantizedTensor

_FMT = {"mxfp4": 0, "nvfp4": 1}


def w4a16_matmul(x: torch.Tensor, w: QuantizedTensor) -> torch.Tensor:
    """y[e] = x[e] @ dequant(w[e]).T on CUDA. x bf16 [E, C, K]; w mxfp4/nvfp4 [E, N, K];
    returns bf16 [E, C, N]."""
    if w.fmt not in _FMT:
        raise ValueError(f"w4a16_matmul: needs mxfp4 or nvfp4 weights, got {w.fmt}")
    E, N, K = w.logical_shape
    if x.dtype != torch.bfloat16 or x.dim() != 3 or x.shape[0] != E or x.shape[2] != K:
        raise ValueError(f"w4a16_matmul: x must be bf16 [{E}, C, {K}], got {x.dtype} "
                         f"{tuple(x.shape)}")
    scales = w.scales.view(torch.uint8)
    gs = None if w.global_scale is None else w.global_scale.float().reshape(E).contiguous()
    _cuda(x, w.data, scales, gs, what="w4a16_matmul")
    y = torch.empty(E, x.shape[1], N, dtype=torch.bfloat16, device=x.device)
    rc = lib().fmoe_w4a16_grouped_matmul(_ptr(x), _ptr(w.data), _ptr(scales), _ptr(gs), _ptr(y),
                                         _FMT[w.fmt], E, x.shape[1], N, K, _stream(x.device))
    _check(rc, "w4a16_matmul")
    return y


def fp8_block_matmul(a: QuantizedTensor, b: QuantizedTensor) -> torch.Tensor:
    """y[e] = dequant(a[e]) @ dequant(b[e]).T on CUDA with FP8 operands.
    a: fp8_block with block (1, 128) [E, M, K] (activations, e.g. quantize_fp8_act_tiles);
    b: fp8_block with block (128, 128) [E, N, K] (weights). Returns bf16 [E, M, N]."""
    if a.fmt != "fp8_block" or tuple(a.block) != (1, 128):
        raise ValueError(f"fp8_block_matmul: a must be fp8_block (1, 128), got {a!r}")
    if b.fmt != "fp8_block" or tuple(b.block) != (128, 128):
        raise ValueError(f"fp8_block_matmul: b must be fp8_block (128, 128), got {b!r}")
    E, M, K = a.logical_shape
    Eb, N, Kb = b.logical_shape
    if (E, K) != (Eb, Kb):
        raise ValueError(f"fp8_block_matmul: a {a.logical_shape} and b {b.logical_shape} disagree")
    _cuda(a.data, a.scales, b.data, b.scales, what="fp8_block_matmul")
    y = torch.empty(E, M, N, dtype=torch.bfloat16, device=a.device)
    rc = lib().fmoe_fp8_block_grouped_gemm(_ptr(a.data), _ptr(a.scales), _ptr(b.data),
                                           _ptr(b.scales), _ptr(y), E, M, N, K,
                                           _stream(a.device))
    _check(rc, "fp8_block_matmul")
    return y
