"""numba CPU backend for ``torch.ops.fmoe.{dispatch,combine,gate_grad}``.

Importing this module registers the kernels as the CPU implementation of the
three custom ops (``fmoe.ops`` imports it), so every caller — plain calls,
autograd, ``torch.func`` transforms (the vmap rule folds the batch into rows
and makes one kernel call), ``torch.compile(fullgraph=True)`` (the op is
opaque to Dynamo and runs this kernel) — gets it without opting in. numba
itself is imported when a kernel first runs, not by the registration.

The kernels see zero-copy numpy views of contiguous CPU tensors. float32 and
float64 run natively; float16/bfloat16 (no numpy dtype) are widened to
float32, computed, and rounded once by torch (round-to-nearest-even), which
is the reference's "compute in fp32, round once". Other dtypes use the
reference.

Extras:
    few_rows_mm(x, w, bounds, transposed): experts with few rows each in one call (the
        expert engine's measured decode candidate).
    disabled(): context manager that routes the ops back to the reference.
    warmup(progress): compile (or load from cache) every kernel signature.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator, Optional

import numpy as np
import torch
from torch import Tensor

from . import primitives, reference, tuning
from .memory_order import stored_transposed


NATIVE_DTYPES = (torch.float32, torch.float64)
_WIDENED = (torch.float16, torch.bfloat16)
_NP_ZERO = {torch.float32: np.float32(0), torch.float64: np.float64(0)}
_NO_WEIGHTS = {dt: np.empty((0, 0), dtype=z.dtype) for dt, z in _NP_ZERO.items()}

_LOADED = None   # (fmoe._numba, fmoe.ops._numba_kernels) once a kernel has run


def _numba_modules():
    """(fmoe._numba, fmoe.ops._numba_kernels), imported when a numba kernel first runs: registering
    the kernels imports no numba, so ``import fmoe`` (and inference, which runs none of them)
    never loads numba and its LLVM."""
    global _LOADED
    if _LOADED is None:
        from .. import _numba
        from . import _numba_kernels
        _LOADED = (_numba, _numba_kernels)
    return _LOADED


def threading_layer() -> str:
    """The numba threading layer fmoe's kernels use (:func:`fmoe._numba.threading_layer`)."""
    return _numba_modules()[0].threading_layer()


def _view(t: Tensor) -> np.ndarray:
    # detach: autograd-tracked tensors refuse .numpy(); the kernel is below autograd anyway.
    # DLPack, not .numpy(): .numpy() marks the storage non-resizable for good, and FSDP2 frees
    # its parameters' storage by resizing it ("Trying to resize storage that is not resizable").
    return np.from_dlpack(t.detach())


def _weights(weights: Optional[Tensor], acc: torch.dtype, pos: np.ndarray):
    if weights is None:
        return _NO_WEIGHTS[acc], None
    if tuple(weights.shape) != pos.shape:  # the kernels index w[j, t] for every (j, t) of pos
        raise ValueError(f"fmoe numba kernels: weights must have the positions' shape [k, T] = {list(pos.shape)}, "
                         f"got {list(weights.shape)}")
    w = weights.detach().to(acc).contiguous()  # keep the tensor alive while numba reads it
    return _view(w), w


def _pos(pos: Tensor) -> Tensor:
    if pos.dtype != torch.int64:
        raise TypeError(f"fmoe numba kernels: positions must be int64, got {pos.dtype}")
    if pos.dim() != 2:
        raise ValueError(f"fmoe numba kernels: positions must be [k, T], got shape {tuple(pos.shape)}")
    return pos.detach().contiguous()


def _check_rows(pos: np.ndarray, rows: int, what: str) -> None:
    if pos.size and _numba_modules()[1].max_position(pos) >= rows:
        raise IndexError(f"{what}: a position is >= the buffer's {rows} rows")


def _supported(*ts: Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype in NATIVE_DTYPES + _WIDENED for t in ts)


# --------------------------------------------------------------------------- kernels on tensors

def _dispatch_native(out: Tensor, x: Tensor, pos: Tensor, weights: Optional[Tensor]) -> None:
    _numba, K = _numba_modules()
    acc = x.dtype
    p = _view(pos)
    if x.shape[0] != p.shape[1]:  # the kernels read x[t] for every token t of pos
        raise ValueError(f"dispatch: x has {x.shape[0]} rows but the positions are for T={p.shape[1]} tokens")
    if (out.shape[0] + p.size) * out.shape[1] <= tuning.NUMBA_SERIAL_ELEMENTS:
        _numba.sync_threads()  # no parallel region, but numba's count still follows torch's
        w, keep = _weights(weights, acc, p)
        if K.dispatch_serial(_view(x), w, p, _NP_ZERO[acc], _view(out)):
            raise IndexError(f"dispatch: a position is >= num_rows={out.shape[0]}")
        del keep
        return
    inv = np.empty(out.shape[0], dtype=np.int64)
    w, keep = _weights(weights, acc, p)
    with _numba.kernel_call():
        if K.inverse_positions(p, out.shape[0], inv):
            raise IndexError(f"dispatch: a position is >= num_rows={out.shape[0]}")
        K.dispatch_rows(_view(x), w, inv, _NP_ZERO[acc], _view(out))
    del keep


def _combine_native(out: Tensor, y: Tensor, pos: Tensor, weights: Optional[Tensor]) -> None:
    _numba, K = _numba_modules()
    acc = y.dtype
    p = _view(pos)
    w, keep = _weights(weights, acc, p)
    if (p.size + out.shape[0]) * out.shape[1] <= tuning.NUMBA_SERIAL_ELEMENTS:
        _numba.sync_threads()
        if K.combine_serial(_view(y), p, w, _NP_ZERO[acc], _view(out)):
            raise IndexError(f"combine: a position is >= the buffer's {y.shape[0]} rows")
        del keep
        return
    with _numba.kernel_call():
        _check_rows(p, y.shape[0], "combine")
        K.combine_rows(_view(y), p, w, _NP_ZERO[acc], _view(out))
    del keep


def dispatch(x: Tensor, pos: Tensor, weights: Optional[Tensor], num_rows: int) -> Tensor:
    """CPU kernel of ``fmoe::dispatch``: [T, M] -> [num_rows, M] in x's dtype (see reference.dispatch)."""
    if not _supported(x):
        return reference.dispatch(x, pos, weights, num_rows)
    acc = reference.compute_dtype(x.dtype)
    xa = x.detach().to(acc).contiguous()
    # empty, not zeros: the kernel writes every row exactly once (empty rows as 0).
    out = torch.empty(num_rows, x.shape[1], dtype=acc)
    _dispatch_native(out, xa, _pos(pos), weights)
    return out.to(x.dtype)


def combine(y: Tensor, pos: Tensor, weights: Optional[Tensor]) -> Tensor:
    """CPU kernel of ``fmoe::combine``: [R, M] -> [T, M] in y's dtype (see reference.combine)."""
    if not _supported(y):
        return reference.combine(y, pos, weights)
    acc = reference.compute_dtype(y.dtype)
    ya = y.detach().to(acc).contiguous()
    p = _pos(pos)
    out = torch.empty(p.shape[1], y.shape[1], dtype=acc)
    _combine_native(out, ya, p, weights)
    return out.to(y.dtype)


def gate_grad(a: Tensor, b: Tensor, pos: Tensor) -> Tensor:
    """CPU kernel of ``fmoe::gate_grad``: ([T, M], [R, M]) -> [k, T] in a's dtype.

    A dot product per kept pair, vectorised (reassociated): equal to the
    reference within a few ulps of the row's magnitude, not bit for bit.
    """
    if not _supported(a, b):
        return reference.gate_grad(a, b, pos)
    acc = reference.compute_dtype(a.dtype)
    aa = a.detach().to(acc).contiguous()
    ba = b.detach().to(acc).contiguous()
    p = _pos(pos)
    if aa.dim() != 2 or ba.dim() != 2 or aa.shape[0] != p.shape[1] or aa.shape[1] != ba.shape[1]:
        # the kernel reads a[t, :M] and b[pos, :M] for every pair
        raise ValueError(f"gate_grad: need a [T, M] and b [R, M] with T={p.shape[1]} tokens of the positions, "
                         f"got a {list(aa.shape)} and b {list(ba.shape)}")
    out = torch.empty(p.shape, dtype=acc)
    _numba, K = _numba_modules()
    with _numba.kernel_call():
        _check_rows(_view(p), ba.shape[0], "gate_grad")
        K.gate_grad_rows(_view(aa), _view(ba), _view(p), _NP_ZERO[acc], _view(out))
    return out.to(a.dtype)


# --------------------------------------------------------------------------- few-row expert products

def few_rows_mm(x: Tensor, w: Tensor, bounds: list, transposed: bool) -> Tensor:
    """y [N, n] with y[rows of e] = x[rows of e] @ op(w[e]) in one numba call that streams each busy
    expert's weight once (:mod:`fmoe.ops._ragged_kernels`): the expert engine's few-row decode
    candidate (:mod:`fmoe.engine.wisdom` measures it against the native kernel). Forward only.

    Args:
        x: float32/64 CPU [N, K], expert e's rows at ``bounds[e]:bounds[e + 1]``, N = ``bounds[-1]``.
        w: [E, K, n] (or [E, n, K] with ``transposed``), x's dtype; a transposed view of
            contiguous storage is read as that storage.
        bounds: E + 1 non-decreasing python ints from 0 (checked by the caller's plan).
    Returns:
        [N, n] in x's dtype, equal to per-expert ``torch.mm`` within float rounding (the K
        reduction is vectorised like a BLAS GEMV).
    """
    _numba = _numba_modules()[0]   # first: it picks numba's threading layer
    from . import _ragged_kernels as RK
    if x.dtype not in NATIVE_DTYPES or w.dtype != x.dtype or x.device.type != "cpu" or w.device.type != "cpu":
        raise TypeError(f"few_rows_mm: float32/float64 CPU tensors of one dtype, got x {x.dtype} on {x.device}, "
                        f"w {w.dtype} on {w.device}")
    n = w.shape[1] if transposed else w.shape[2]
    if stored_transposed(w):
        w, transposed = w.transpose(1, 2), not transposed   # read the storage as it lies
    w = w.contiguous()
    tasks = np.asarray([(0, e, bounds[e], bounds[e + 1]) for e in range(len(bounds) - 1)
                        if bounds[e + 1] > bounds[e]], dtype=np.int64).reshape(-1, 4)
    y = x.new_empty((1, x.shape[0], n))
    if len(tasks):
        streamed = w.shape[1] * w.shape[2] * w.element_size() * len(tasks)
        kern = RK.small_groups_serial if streamed <= tuning.RAGGED_SERIAL_BYTES else RK.small_groups
        with _numba.kernel_call():
            kern(_view(x.contiguous())[None], _view(w)[None], tasks, transposed, _NP_ZERO[x.dtype], _view(y))
    return y[0]


# --------------------------------------------------------------------------- registration

_OPS = {
    "fmoe::dispatch": (primitives._dispatch_op, dispatch),
    "fmoe::combine": (primitives._combine_op, combine),
    "fmoe::gate_grad": (primitives._gate_grad_op, gate_grad),
}
for _name, (_op, _fn) in _OPS.items():
    torch.library.register_kernel(_name, "cpu", _fn)
    primitives.CPU_KERNELS[_name.split("::")[1]] = _fn  # the same kernel, for the no-grad direct path


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within this block the three ops run the pure-torch reference on CPU.

    Process-wide (not per thread): meant for benchmarks and tests that compare
    the two backends.
    """
    saved = dict(primitives.CPU_KERNELS)
    with contextlib.ExitStack() as stack:
        for op, _ in _OPS.values():
            stack.enter_context(op.set_kernel_enabled("cpu", False))
        primitives.CPU_KERNELS.clear()
        try:
            yield
        finally:
            primitives.CPU_KERNELS.update(saved)


# --------------------------------------------------------------------------- warm-up

def warmup(progress: Optional[Callable[[str], None]] = None) -> dict:
    """Compile, or load from numba's on-disk cache, every kernel signature.

    Args:
        progress: called with one line per kernel.
    Returns:
        {kernel name: seconds}.
    """
    from . import _ragged_kernels  # few_rows_mm's kernels

    _numba, K = _numba_modules()
    times = {}
    with _numba.kernel_call():
        for name, kernel, args in [*K.signatures(), *_ragged_kernels.signatures()]:
            t0 = time.perf_counter()
            kernel(*args)
            times[name] = time.perf_counter() - t0
            if progress is not None:
                progress(f"{name}: {times[name]:.2f} s")
    return times
