"""ctypes front of native/build/libfmoe_native.so (CUDA kernels, C ABI in native/fmoe_native.h).

Nothing here touches CUDA or the library at import time: :func:`lib` loads it on first use,
which only happens when a CUDA tensor reaches a native kernel. Build the library with
``native/build.sh`` (``.ci/run`` does when nvcc is present); a CPU-only install never needs it.
The dispatch/combine kernels here are the CUDA implementation of the ``fmoe::dispatch`` /
``fmoe::combine`` ops (:mod:`fmoe.ops.cuda`); the quantized GEMMs are in :mod:`fmoe.quant.native`.
"""
from __future__ import annotations

import ctypes
import os

import torch

_LIB = None
_DTYPE = {torch.float32: 0, torch.bfloat16: 1}


def library_path() -> str:
    """Where native/build.sh puts the shared library (repository checkout layout)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(root, "native", "build", "libfmoe_native.so")


def lib() -> ctypes.CDLL:
    """Load (once) and return the native library; clear error if it was never built."""
    global _LIB
    if _LIB is None:
        path = library_path()
        if not os.path.exists(path):
            raise RuntimeError(f"fmoe native library not found at {path}; build it with "
                               f"native/build.sh (needs nvcc)")
        L = ctypes.CDLL(path)
        vp, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        L.fmoe_native_version.restype = ctypes.c_char_p
        L.fmoe_native_error_string.restype = ctypes.c_char_p
        L.fmoe_native_error_string.argtypes = [i32]
        L.fmoe_w4a16_grouped_matmul.argtypes = [vp, vp, vp, vp, vp, i32, i32, i32, i32, i32, vp]
        L.fmoe_fp8_block_grouped_gemm.argtypes = [vp, vp, vp, vp, vp, i32, i32, i32, i32, vp]
        L.fmoe_dispatch.argtypes = [vp, vp, vp, vp, i32, i32, i32, i32, i64, vp]
        L.fmoe_combine.argtypes = [vp, vp, vp, vp, i32, i32, i32, i32, i64, vp]
        for f in ("fmoe_w4a16_grouped_matmul", "fmoe_fp8_block_grouped_gemm", "fmoe_dispatch",
                  "fmoe_combine"):
            getattr(L, f).restype = i32
        _LIB = L
    return _LIB


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what}: {lib().fmoe_native_error_string(rc).decode()} (code {rc})")


def _cuda(*ts, what: str) -> None:
    for t in ts:
        if t is not None and (not t.is_cuda or not t.is_contiguous()):
            raise ValueError(f"{what}: every tensor must be a contiguous CUDA tensor")


def _ptr(t):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


def _stream(device) -> ctypes.c_void_p:
    return ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)


def built() -> bool:
    """Whether native/build.sh has produced the library (a file check: CUDA is not touched)."""
    return os.path.exists(library_path())


def dispatch(x: torch.Tensor, pos: torch.Tensor, w: torch.Tensor | None, rows: int) -> torch.Tensor:
    """D[pos[j,t]] = w[j,t] * x[t] into a zeroed D [rows, M]. x [T, M] fp32/bf16; pos int64 [k, T]
    (-1 = skip); w fp32 [k, T] or None."""
    T, M = x.shape
    k = pos.shape[0]
    if x.dtype not in _DTYPE or pos.dtype != torch.int64 or tuple(pos.shape) != (k, T):
        raise ValueError(f"dispatch: x fp32/bf16 [T, M] and pos int64 [k, T] expected, got "
                         f"{x.dtype} {tuple(x.shape)}, {pos.dtype} {tuple(pos.shape)}")
    wf = None if w is None else w.float().contiguous()
    _cuda(x, pos, wf, what="dispatch")
    D = torch.zeros(rows, M, dtype=x.dtype, device=x.device)
    rc = lib().fmoe_dispatch(_ptr(x), _ptr(pos), _ptr(wf), _ptr(D), _DTYPE[x.dtype], k, T, M,
                             rows, _stream(x.device))
    _check(rc, "dispatch")
    return D


def combine(Y: torch.Tensor, pos: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    """y[t] = sum_j w[j,t] * Y[pos[j,t]] (FP32 accumulation). Y [R, M]; pos int64 [k, T]."""
    R, M = Y.shape
    k, T = pos.shape
    if Y.dtype not in _DTYPE or pos.dtype != torch.int64:
        raise ValueError(f"combine: Y fp32/bf16 and pos int64 expected, got {Y.dtype}, {pos.dtype}")
    wf = None if w is None else w.float().contiguous()
    _cuda(Y, pos, wf, what="combine")
    y = torch.empty(T, M, dtype=Y.dtype, device=Y.device)
    rc = lib().fmoe_combine(_ptr(Y), _ptr(pos), _ptr(wf), _ptr(y), _DTYPE[Y.dtype], k, T, M, R,
                            _stream(Y.device))
    _check(rc, "combine")
    return y
