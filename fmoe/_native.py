"""ctypes front of native/build/libfmoe_native.so (CUDA kernels, C ABI in native/fmoe_native.h).

Nothing here touches CUDA or the library at import time: :func:`lib` loads it on first use,
which only happens when a CUDA tensor reaches a native kernel. Build the library with
``native/build.sh`` (``scripts/test.sh`` does when nvcc is present); a CPU-only install never needs it.
The dispatch/combine kernels here are the CUDA implementation of the ``fmoe::dispatch`` /
``fmoe::combine`` ops (:mod:`fmoe.ops.cuda`); the quantized GEMMs are in :mod:`fmoe.quant.native`.

Every wrapper checks, before anything is launched, what the ops' CPU kernels check (error
types and messages as :mod:`fmoe.ops.numba_cpu` raises them): argument types, shapes, dtypes,
devices (every tensor on the first one's CUDA device), the int32 sizes of the C ABI, and the
alignment the kernels' 16-byte loads need. Then :func:`stream` reports a missing CUDA driver
as a clear error, and the C side validates again (the ``ERR_*`` codes).
"""
from __future__ import annotations

import ctypes
import os
from typing import Optional

import torch
from torch import Tensor

_LIB = None
_DTYPE = {torch.float32: 0, torch.bfloat16: 1}
# The C ABI this module calls (fmoe_native_version()'s prefix): a library built from older
# sources takes other arguments or lacks an entry point, so it is refused rather than called.
ABI = "fmoe_native 0.3."
# Return codes of the C functions besides cudaError_t values (native/fmoe_native.h).
ERR_BAD_SHAPE, ERR_BAD_DTYPE, ERR_BAD_FORMAT, ERR_BAD_ARGUMENT, ERR_MISALIGNED = -1, -2, -3, -4, -5
INT32_MAX = 2 ** 31 - 1


def library_path() -> str:
    """Where native/build.sh puts the shared library (repository checkout layout)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(root, "native", "build", "libfmoe_native.so")


def lib() -> ctypes.CDLL:
    """Load (once) and return the native library; clear error if it was never built or is stale."""
    global _LIB
    if _LIB is None:
        path = library_path()
        if not os.path.exists(path):
            raise RuntimeError(f"fmoe native library not found at {path}; build it with "
                               f"native/build.sh (needs nvcc)")
        L = ctypes.CDLL(path)
        vp, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        L.fmoe_native_version.restype = ctypes.c_char_p
        version = L.fmoe_native_version().decode()
        if not version.startswith(ABI):
            raise RuntimeError(f"fmoe native library at {path} is {version!r}, but this fmoe calls the "
                               f"{ABI}x ABI; rebuild it with native/build.sh")
        L.fmoe_native_error_string.restype = ctypes.c_char_p
        L.fmoe_native_error_string.argtypes = [i32]
        L.fmoe_w4a16_grouped_matmul.argtypes = [vp, vp, vp, vp, vp, i32, i32, i32, i32, i32, vp]
        L.fmoe_w4a16_rows_matmul.argtypes = [vp, vp, vp, vp, vp, vp, i32, i32, i32, i32, i32, vp]
        L.fmoe_fp8_block_grouped_gemm.argtypes = [vp, vp, vp, vp, vp, i32, i32, i32, i32, vp]
        L.fmoe_dispatch.argtypes = [vp, vp, vp, vp, i32, i32, i32, i32, i64, vp, vp]
        L.fmoe_combine.argtypes = [vp, vp, vp, vp, i32, i32, i32, i32, i64, vp, vp]
        for f in ("fmoe_w4a16_grouped_matmul", "fmoe_w4a16_rows_matmul", "fmoe_fp8_block_grouped_gemm",
                  "fmoe_dispatch", "fmoe_combine"):
            getattr(L, f).restype = i32
        _LIB = L
    return _LIB


def built() -> bool:
    """Whether native/build.sh has produced the library (a file check: CUDA is not touched)."""
    return os.path.exists(library_path())


# --------------------------------------------------------------------------- shared checks

def check_rc(rc: int, what: str) -> None:
    """Raise the C function's error (``what``: the wrapper's name) where ``rc`` is not 0."""
    if rc != 0:
        raise RuntimeError(f"{what}: {lib().fmoe_native_error_string(rc).decode()} (code {rc})")


def same_cuda_device(what: str, first: tuple, *others: tuple) -> torch.device:
    """Every (name, tensor) on the first tensor's CUDA device; that device.

    ValueError where the first is not on CUDA (these kernels have no CPU twin here), RuntimeError
    (torch's own type for mixed devices) where another tensor is elsewhere. None is skipped.
    """
    name, t = first
    if t.device.type != "cuda":
        raise ValueError(f"{what}: {name} must be a CUDA tensor, got one on {t.device} (the native "
                         f"kernels run on CUDA; CPU tensors take the ops' CPU kernels)")
    for other, u in others:
        if u is not None and u.device != t.device:
            raise RuntimeError(f"{what}: {other} is on {u.device} but {name} is on {t.device}; every "
                               f"tensor must be on {name}'s device (move it with .to({name}.device))")
    return t.device


def fits_int32(what: str, **sizes: int) -> None:
    """The C ABI takes these sizes as int32: ValueError naming the one that does not fit."""
    for name, n in sizes.items():
        if n > INT32_MAX:
            raise ValueError(f"{what}: {name} = {n} exceeds the native kernels' int32 limit {INT32_MAX}; "
                             f"split the call")


def address(t: Tensor) -> int:
    """The byte address of t's first element: its storage's base plus its offset."""
    return t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()


def aligned16(t: Tensor) -> bool:
    """Whether t starts on a 16-byte boundary (what the kernels' 128-bit loads need)."""
    return address(t) % 16 == 0


def stream(what: str, device: torch.device) -> ctypes.c_void_p:
    """The current CUDA stream of ``device`` for a launch, or a clear error where this process has
    no CUDA driver or device (the point where a launch would fail)."""
    if not torch.cuda.is_available():
        built_for = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA (a CPU-only build)"
        raise RuntimeError(f"{what}: cannot launch the CUDA kernel on {device}: no CUDA driver or device "
                           f"is available to this process (torch.cuda.is_available() is False; torch "
                           f"{torch.__version__} is built for {built_for})")
    return ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)


def ptr(t: Optional[Tensor]) -> Optional[ctypes.c_void_p]:
    return None if t is None else ctypes.c_void_p(address(t))


def _positions(what: str, pos) -> Tensor:
    """pos as the kernels read it: int64 [k, T], contiguous (int32 is widened, as the reference
    accepts it)."""
    if not isinstance(pos, Tensor):
        raise TypeError(f"{what}: positions must be an int64 (or int32) tensor [k, T], got {type(pos).__name__}")
    if pos.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{what}: positions must be int64 (or int32), got {pos.dtype}")
    if pos.dim() != 2:
        raise ValueError(f"{what}: positions must be [k, T], got shape {tuple(pos.shape)}")
    return pos.to(torch.int64).contiguous()


def _weights(what: str, weights, pos: Tensor) -> Optional[Tensor]:
    """weights as the kernels read them: fp32 [k, T] (pos's shape), contiguous; or None."""
    if weights is None:
        return None
    if not isinstance(weights, Tensor) or weights.is_complex() or weights.dtype == torch.bool:
        raise TypeError(f"{what}: weights must be a real tensor [k, T] or None, got "
                        f"{getattr(weights, 'dtype', type(weights).__name__)}")
    if tuple(weights.shape) != tuple(pos.shape):   # a [T, k] tensor would pair tokens with other gates
        raise ValueError(f"{what}: weights must have the positions' shape [k, T] = {list(pos.shape)}, "
                         f"got {list(weights.shape)}")
    return weights.float().contiguous()


def _rows(what: str, name: str, t) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{what}: {name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in _DTYPE:
        raise TypeError(f"{what}: {name} must be float32 or bfloat16 for the CUDA kernel, got {t.dtype} "
                        f"(fmoe.ops.cuda runs the reference for other dtypes)")
    if t.dim() != 2:
        raise ValueError(f"{what}: {name} must be 2-D [rows, M], got shape {tuple(t.shape)}")


def _raise_if_flagged(bad: Tensor, exc: type, message: str) -> None:
    """Raise where the kernel flagged a position >= the buffer's rows.

    Eager calls read the 4-byte flag (one device->host copy: the call waits for the kernel) and
    raise ``exc`` like the CPU kernels. During CUDA graph capture nothing may wait, so a device-side
    assertion is queued instead: a bad position then fails the graph's replay, not the capture.
    """
    if bad.is_cuda and torch.cuda.is_current_stream_capturing():
        torch._assert_async(bad == 0, message)
    elif bool(bad.item()):
        raise exc(message)


# --------------------------------------------------------------------------- kernels

def dispatch(x: Tensor, pos: Tensor, w: Optional[Tensor], rows: int) -> Tensor:
    """D[pos[j,t]] = w[j,t] * x[t] into a zeroed D [rows, M] (the reference's ``dispatch``).

    x: float32/bfloat16 [T, M] on CUDA; pos: int64 or int32 [k, T] (negative = skip); w: real
    [k, T] (computed in fp32) or None; rows: R >= 0. Returns D [R, M] in x's dtype. A position
    >= R raises IndexError (after the kernel: see :func:`_raise_if_flagged`).
    """
    what = "dispatch"
    _rows(what, "x", x)
    p = _positions(what, pos)
    k, T = p.shape
    if x.shape[0] != T:   # the kernel reads x[t] for every token t of pos
        raise ValueError(f"{what}: x has {x.shape[0]} rows but the positions are for T={T} tokens")
    wf = _weights(what, w, p)
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 0:
        raise ValueError(f"{what}: num_rows must be an int >= 0, got {rows!r}")
    dev = same_cuda_device(what, ("x", x), ("pos", pos), ("weights", w))
    M = x.shape[1]
    fits_int32(what, **{"k*T": k * T, "M": M})
    D = torch.zeros(rows, M, dtype=x.dtype, device=dev)
    if k * T == 0:
        return D
    xc = x.contiguous()
    bad = torch.zeros(1, dtype=torch.int32, device=dev)
    s = stream(what, dev)
    rc = lib().fmoe_dispatch(ptr(xc), ptr(p), ptr(wf), ptr(D), _DTYPE[x.dtype], k, T, M, rows, ptr(bad), s)
    check_rc(rc, what)
    _raise_if_flagged(bad, IndexError, f"{what}: a position is >= num_rows={rows}")
    return D


def combine(Y: Tensor, pos: Tensor, w: Optional[Tensor]) -> Tensor:
    """y[t] = sum_j w[j,t] * Y[pos[j,t]] (the reference's ``combine``, FP32 accumulation).

    Y: float32/bfloat16 [R, M] on CUDA; pos: int64 or int32 [k, T] (negative = skip); w: real
    [k, T] or None. Returns y [T, M] in Y's dtype. A position >= R raises IndexError.
    """
    what = "combine"
    _rows(what, "y", Y)
    p = _positions(what, pos)
    k, T = p.shape
    wf = _weights(what, w, p)
    dev = same_cuda_device(what, ("y", Y), ("pos", pos), ("weights", w))
    R, M = Y.shape
    fits_int32(what, k=k, T=T, M=M)
    if k * T == 0:
        return torch.zeros(T, M, dtype=Y.dtype, device=dev)
    Yc = Y.contiguous()
    y = torch.empty(T, M, dtype=Y.dtype, device=dev)
    bad = torch.zeros(1, dtype=torch.int32, device=dev)
    s = stream(what, dev)
    rc = lib().fmoe_combine(ptr(Yc), ptr(p), ptr(wf), ptr(y), _DTYPE[Y.dtype], k, T, M, R, ptr(bad), s)
    check_rc(rc, what)
    _raise_if_flagged(bad, IndexError, f"{what}: a position is >= the buffer's {R} rows")
    return y
