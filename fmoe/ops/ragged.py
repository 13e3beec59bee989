"""Grouped matmuls over the ragged (dropless) layout, as custom ops closed under differentiation.

Ragged layout: the kept (token, expert) pairs sorted by expert into rows
``x [R, K]`` with int64 ``offsets [E + 1]``: expert e owns rows
``offsets[e]:offsets[e + 1]``; ``offsets[0] = 0``, non-decreasing,
``offsets[E] = N <= R``; rows ``N..R-1`` are padding (R is a static bound such
as k*T, so shapes stay fixed under vmap and torch.compile).

Public functions:
    ragged_mm(x, w, offsets, transposed=False)   y[rows of e] = x[rows of e] @ op(w[e]); padding rows 0
    ragged_wgrad(a, b, offsets)                  z[e] = a[rows of e]^T @ b[rows of e]
    ragged_mm_reference, ragged_wgrad_reference  the slow, obviously correct oracles

The set is closed under differentiation: the input gradient of ragged_mm is
ragged_mm with w read the other way round, its weight gradient is
ragged_wgrad (produced directly in w's layout), and both gradients of
ragged_wgrad are ragged_mm. So every derivative order runs the same kernels.

Layering as in :mod:`fmoe.ops.primitives` (its docstring says why):
``torch.ops.fmoe.ragged_mm`` / ``ragged_wgrad`` custom ops (fake kernel,
autograd formula, vmap rule) fronted by autograd Functions with ``jvp`` and
``generate_vmap_rule=True`` (a jvp-less twin while compiling).

Segments (the vmap fold). The custom ops take a leading *segment* axis:
x [Sx, R, K], w [Sw, E, ., .], offsets [So, E + 1], each count 1 or S, a
count of 1 shared by every segment; the result has S segments. A vmap of
batch B folds its batch into that axis (segment b*S + s), so batch b's groups
are groups (b, e) of one kernel call whatever mix of x, w and offsets is
batched, unbatched inputs are not copied, and each segment keeps its own
padding rows (a flat fold with offsets shifted by b*R would hand batch b's
padding rows to its last expert). The public functions are segment count 1.

Kernel (any device): one host sync (``offsets.tolist()``), then one
``torch.mm(out=...)`` per non-empty group on views — no copies, no per-group
allocation; empty groups are skipped and only the padding rows are zeroed.
Same BLAS call per group as the reference, so bit-identical to it. (One padded
batched GEMM over balanced groups, two row gathers and a bmm, took 1.28-1.50x
the per-group calls' time in training on a quiet machine: ``python -m
benchmarks.bench_ragged --only train``, 2026-12-01; removed.) On CPU,
float32/64 groups of at most ``tuning.RAGGED_SMALL_ROWS`` rows (decode) whose
weights add up to at most ``tuning.RAGGED_NUMBA_MAX_BYTES`` go instead to one
numba call that streams each busy expert's weight once
(:mod:`fmoe.ops._ragged_kernels`; equal within float rounding): a small
problem, where per-call overhead, not the weight read, is the time.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import Tensor
from torch.utils import _python_dispatch

from .. import _numba
from . import _ragged_kernels as _RK
from . import tuning
from .memory_order import grad_in_storage_order, stored_transposed, weight_grad
from .primitives import PLAIN_TENSORS, forward_only

__all__ = ["ragged_mm", "ragged_wgrad", "ragged_mm_reference", "ragged_wgrad_reference"]

_NUMBA_DTYPES = (torch.float32, torch.float64)
_NP_ZERO = {torch.float32: np.float32(0), torch.float64: np.float64(0)}


# --------------------------------------------------------------------------- references

def ragged_mm_reference(x: Tensor, w: Tensor, offsets: Tensor, *, transposed: bool = False) -> Tensor:
    """Slow, obviously correct :func:`ragged_mm`: a Python loop of torch.mm over experts.

    Args:
        x: float [R, K]. w: [E, K, N] (or [E, N, K] with ``transposed``). offsets: int64 [E + 1].
    Returns:
        [R, N] in x's dtype, rows outside every expert's range 0.
    """
    E = w.shape[0]
    N = w.shape[1] if transposed else w.shape[2]
    y = torch.zeros(x.shape[0], N, dtype=x.dtype, device=x.device)
    o = offsets.tolist()
    for e in range(E):
        lo, hi = o[e], o[e + 1]
        if hi > lo:
            y[lo:hi] = torch.mm(x[lo:hi], w[e].t() if transposed else w[e])
    return y


def ragged_wgrad_reference(a: Tensor, b: Tensor, offsets: Tensor) -> Tensor:
    """Slow, obviously correct :func:`ragged_wgrad`: ``z[e] = a[rows]^T @ b[rows]`` per expert.

    Args:
        a: float [R, P]. b: [R, Q]. offsets: int64 [E + 1].
    Returns:
        [E, P, Q] in a's dtype, zero for experts with no rows.
    """
    E = offsets.shape[0] - 1
    z = torch.zeros(E, a.shape[1], b.shape[1], dtype=a.dtype, device=a.device)
    o = offsets.tolist()
    for e in range(E):
        lo, hi = o[e], o[e + 1]
        if hi > lo:
            z[e] = torch.mm(a[lo:hi].t(), b[lo:hi])
    return z


# --------------------------------------------------------------------------- checks

def _check_offsets_meta(name: str, offsets: Tensor, E: int) -> None:
    if not isinstance(offsets, Tensor):
        raise TypeError(f"{name}: offsets must be an int64 tensor, got {type(offsets).__name__}")
    if offsets.dtype != torch.int64:
        raise TypeError(f"{name}: offsets must be int64, got {offsets.dtype}")
    if offsets.dim() != 1 or offsets.shape[0] != E + 1:
        raise ValueError(f"{name}: offsets must be [E + 1] = [{E + 1}] (E = {E} experts), "
                         f"got shape {tuple(offsets.shape)}")


def _check_float(name: str, what: str, t: Tensor) -> None:
    if not isinstance(t, Tensor) or not t.is_floating_point():
        raise TypeError(f"{name}: {what} must be a floating-point tensor, got "
                        f"{getattr(t, 'dtype', type(t).__name__)}")


def _segments(name: str, counts: dict) -> int:
    S = max(counts.values())
    for what, n in counts.items():
        if n not in (1, S):
            raise ValueError(f"{name}: segment counts must be 1 or {S}, {what} has {n}")
    return S


def _offset_lists(name: str, offsets: Tensor, R: int) -> list:
    """offsets [So, E + 1] -> nested list, after checking every row (the one host sync)."""
    rows = offsets.tolist()
    for s, o in enumerate(rows):
        where = f" (segment {s})" if len(rows) > 1 else ""
        if o[0] != 0:
            raise ValueError(f"{name}: offsets[0] must be 0, got {o[0]}{where}")
        for e in range(len(o) - 1):
            if o[e + 1] < o[e]:
                raise ValueError(f"{name}: offsets must be non-decreasing, got offsets[{e}] = {o[e]} > "
                                 f"offsets[{e + 1}] = {o[e + 1]}{where}")
        if o[-1] > R:
            raise ValueError(f"{name}: offsets[E] = {o[-1]} exceeds the {R} rows of the input{where}")
    return rows


def _check_mm_op(x: Tensor, w: Tensor, offsets: Tensor, transposed: bool) -> int:
    name = "ragged_mm"
    if x.dim() != 3 or w.dim() != 4 or offsets.dim() != 2:
        raise ValueError(f"{name} op: x, w, offsets must be [S, R, K], [S, E, ., .], [S, E + 1], got "
                         f"{tuple(x.shape)}, {tuple(w.shape)}, {tuple(offsets.shape)}")
    if offsets.dtype != torch.int64:
        raise TypeError(f"{name}: offsets must be int64, got {offsets.dtype}")
    if w.dtype != x.dtype:
        raise TypeError(f"{name}: w must have x's dtype {x.dtype}, got {w.dtype}")
    K = w.shape[3] if transposed else w.shape[2]
    if K != x.shape[2] or offsets.shape[1] != w.shape[1] + 1:
        raise ValueError(f"{name}: shapes do not match: x {tuple(x.shape)}, w {tuple(w.shape)} "
                         f"(transposed={transposed}), offsets {tuple(offsets.shape)}")
    return _segments(name, {"x": x.shape[0], "w": w.shape[0], "offsets": offsets.shape[0]})


def _check_wgrad_op(a: Tensor, b: Tensor, offsets: Tensor) -> int:
    name = "ragged_wgrad"
    if a.dim() != 3 or b.dim() != 3 or offsets.dim() != 2:
        raise ValueError(f"{name} op: a, b, offsets must be [S, R, P], [S, R, Q], [S, E + 1], got "
                         f"{tuple(a.shape)}, {tuple(b.shape)}, {tuple(offsets.shape)}")
    if offsets.dtype != torch.int64:
        raise TypeError(f"{name}: offsets must be int64, got {offsets.dtype}")
    if b.dtype != a.dtype:
        raise TypeError(f"{name}: b must have a's dtype {a.dtype}, got {b.dtype}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"{name}: a and b must have the same rows R, got {tuple(a.shape)} and {tuple(b.shape)}")
    return _segments(name, {"a": a.shape[0], "b": b.shape[0], "offsets": offsets.shape[0]})


# --------------------------------------------------------------------------- kernels

def _small_groups(x: Tensor, w: Tensor, tasks: list, transposed: bool, y: Tensor) -> None:
    """Rows of ``tasks`` (s, e, lo, hi) of y in one numba call (float32/64 CPU, w contiguous)."""
    xc = x.detach().contiguous()  # no copy for the usual contiguous x; a strided one is copied once
    t = np.asarray(tasks, dtype=np.int64)
    per_row = w.shape[2] * w.shape[3] * w.element_size()
    streamed = per_row * len(tasks)
    kern = _RK.small_groups_serial if streamed <= tuning.RAGGED_SERIAL_BYTES else _RK.small_groups
    with _numba.kernel_call():
        # the weights through DLPack: .numpy() would pin their storage's size (FSDP2 resizes it)
        kern(xc.numpy(), np.from_dlpack(w.detach()), t, transposed, _NP_ZERO[x.dtype], y.numpy())


def _group_mm(xs: Tensor, ws: Tensor, e: int, lo: int, hi: int, transposed: bool, ys: Tensor) -> None:
    """ys[lo:hi] = xs[lo:hi] @ op(ws[e]) in one BLAS call (the reference's own call)."""
    torch.mm(xs[lo:hi], ws[e].t() if transposed else ws[e], out=ys[lo:hi])


def _mm_impl(x: Tensor, w: Tensor, offsets: Tensor, transposed: bool) -> Tensor:
    S = _check_mm_op(x, w, offsets, transposed)
    R = x.shape[1]
    N = w.shape[2] if transposed else w.shape[3]
    y = torch.empty(S, R, N, dtype=x.dtype, device=x.device)
    _grouped_into(x, w, _offset_lists("ragged_mm", offsets, R), transposed, y)
    return y


def _grouped_into(x: Tensor, w: Tensor, offs: list, transposed: bool, y: Tensor) -> None:
    """y[s][rows of e] = x[s][rows of e] @ op(w[s][e]) for every segment s and busy expert e,
    padding rows zeroed: x [Sx, R, K], w [Sw, E, ., .], ``offs`` So lists of E + 1 checked
    ints, y [S, R, N]. The kernel choice: groups of at most ``tuning.RAGGED_SMALL_ROWS`` rows
    in one numba call while their weights add up to at most ``tuning.RAGGED_NUMBA_MAX_BYTES``,
    every other group one BLAS call."""
    S, R, E = y.shape[0], x.shape[1], w.shape[1]
    # The numba kernel reads contiguous weights. A transposed view of contiguous storage
    # (fmoe.nn.MoELayer's x @ W views of its out x in Parameters) is read as that storage,
    # the other order: no copy of the weights at every call.
    w_k, t_k = (w.transpose(2, 3), not transposed) if stored_transposed(w) else (w, transposed)
    numba_ok = (x.device.type == "cpu" and x.dtype in _NUMBA_DTYPES and w_k.is_contiguous()
                and w.device.type == "cpu")
    small = []
    for s in range(S):
        o = offs[s if len(offs) > 1 else 0]
        xs = x[s if x.shape[0] > 1 else 0]
        ws = w[s if w.shape[0] > 1 else 0]
        ys = y[s]
        for e in range(E):
            lo, hi = o[e], o[e + 1]
            if hi == lo:
                continue  # idle expert: its weight is never read
            if numba_ok and hi - lo <= tuning.RAGGED_SMALL_ROWS:
                small.append((s, e, lo, hi))
                continue
            _group_mm(xs, ws, e, lo, hi, transposed, ys)
        if o[E] < R:
            ys[o[E]:].zero_()
    if small and len(small) * w.shape[2] * w.shape[3] * w.element_size() <= tuning.RAGGED_NUMBA_MAX_BYTES:
        _small_groups(x, w_k, small, t_k, y)
    else:   # too many weight bytes for the numba kernel to win: one BLAS call per group
        for s, e, lo, hi in small:
            _group_mm(x[s if x.shape[0] > 1 else 0], w[s if w.shape[0] > 1 else 0], e, lo, hi, transposed, y[s])


def grouped_rows(x: Tensor, w: Tensor, bounds: list, transposed: bool = False) -> Tensor:
    """y [N, cols] with y[rows of e] = x[rows of e] @ op(w[e]): :func:`ragged_mm`'s kernels on
    rows sorted by expert, forward only (no autograd, no checks; the caller's rows).

    Args:
        x: [N, K] rows, expert e's at ``bounds[e]:bounds[e + 1]``, N = ``bounds[-1]``.
        w: [E, K, cols] (or [E, cols, K] with ``transposed``), x's dtype and device.
        bounds: E + 1 non-decreasing ints from 0 (python ints: no host sync).
    """
    y = x.new_empty((1, x.shape[0], w.shape[1] if transposed else w.shape[2]))
    _grouped_into(x[None], w[None], [bounds], transposed, y)
    return y[0]


def _wgrad_impl(a: Tensor, b: Tensor, offsets: Tensor) -> Tensor:
    S = _check_wgrad_op(a, b, offsets)
    E = offsets.shape[1] - 1
    offs = _offset_lists("ragged_wgrad", offsets, a.shape[1])
    empty = any(o[e] == o[e + 1] for o in offs for e in range(E))
    # One memset when some expert is idle, rather than a zero_() call per idle expert.
    alloc = torch.zeros if empty else torch.empty
    z = alloc(S, E, a.shape[2], b.shape[2], dtype=a.dtype, device=a.device)
    for s in range(S):
        o = offs[s if len(offs) > 1 else 0]
        as_ = a[s if a.shape[0] > 1 else 0]
        bs = b[s if b.shape[0] > 1 else 0]
        for e in range(E):
            lo, hi = o[e], o[e + 1]
            if hi > lo:
                torch.mm(as_[lo:hi].t(), bs[lo:hi], out=z[s, e])
    return z


# --------------------------------------------------------------------------- custom ops

@torch.library.custom_op("fmoe::ragged_mm", mutates_args=())
def _ragged_mm_op(x: Tensor, w: Tensor, offsets: Tensor, transposed: bool) -> Tensor:
    """x [Sx, R, K], w [Sw, E, K, N] (or [Sw, E, N, K]), offsets int64 [So, E + 1] -> [S, R, N]."""
    return _mm_impl(x, w, offsets, transposed)


@torch.library.custom_op("fmoe::ragged_wgrad", mutates_args=())
def _ragged_wgrad_op(a: Tensor, b: Tensor, offsets: Tensor) -> Tensor:
    """a [Sa, R, P], b [Sb, R, Q], offsets int64 [So, E + 1] -> [S, E, P, Q]."""
    return _wgrad_impl(a, b, offsets)


@_ragged_mm_op.register_fake
def _(x, w, offsets, transposed):
    S = max(x.shape[0], w.shape[0], offsets.shape[0])
    return x.new_empty(S, x.shape[1], w.shape[2] if transposed else w.shape[3])


@_ragged_wgrad_op.register_fake
def _(a, b, offsets):
    S = max(a.shape[0], b.shape[0], offsets.shape[0])
    return a.new_empty(S, offsets.shape[1] - 1, a.shape[2], b.shape[2])


def _sum_to(g: Optional[Tensor], n: int) -> Optional[Tensor]:
    """Gradient of an input broadcast over segments: sum the segment axis back to n (1 or S)."""
    if g is None or g.shape[0] == n:
        return g
    return g.sum(0, keepdim=True)


def _mm_setup(ctx, inputs, output):
    x, w, offsets, transposed = inputs
    ctx.save_for_backward(x, w, offsets)
    ctx.save_for_forward(x, w, offsets)
    ctx.transposed = transposed
    ctx.grad_in_storage = grad_in_storage_order(w)


def _mm_bwd(ctx, gy):
    x, w, offsets = ctx.saved_tensors
    gx = gw = None
    if ctx.needs_input_grad[0]:
        # y = x op(w)  =>  gx = gy op(w)^T, which is w read in the other orientation.
        gx = _sum_to(_mm(gy, w, offsets, not ctx.transposed), x.shape[0])
    if ctx.needs_input_grad[1]:
        # In the order of w's memory: no transposed copy of the weight gradient.
        gw = weight_grad(lambda a, b: _wg(a, b, offsets), x, gy, ctx.transposed, ctx.grad_in_storage)
        gw = _sum_to(gw, w.shape[0])
    return gx, gw, None, None


def _mm_jvp(ctx, tx, tw, toffsets, ttransposed):
    x, w, offsets = ctx.saved_tensors
    out = None
    if tx is not None:
        out = _mm(tx, w, offsets, ctx.transposed)
    if tw is not None:
        term = _mm(x, tw, offsets, ctx.transposed)
        out = term if out is None else out + term
    if out is None:
        S = max(x.shape[0], w.shape[0], offsets.shape[0])
        out = x.new_zeros(S, x.shape[1], w.shape[2] if ctx.transposed else w.shape[3])
    return out


def _wgrad_setup(ctx, inputs, output):
    a, b, offsets = inputs
    ctx.save_for_backward(a, b, offsets)
    ctx.save_for_forward(a, b, offsets)


def _wgrad_bwd(ctx, gz):
    a, b, offsets = ctx.saved_tensors
    # z[e] = a_e^T b_e  =>  ga_e = b_e gz[e]^T, gb_e = a_e gz[e]; padding rows get 0.
    ga = _sum_to(_mm(b, gz, offsets, True), a.shape[0]) if ctx.needs_input_grad[0] else None
    gb = _sum_to(_mm(a, gz, offsets, False), b.shape[0]) if ctx.needs_input_grad[1] else None
    return ga, gb, None


def _wgrad_jvp(ctx, ta, tb, toffsets):
    a, b, offsets = ctx.saved_tensors
    out = None
    if ta is not None:
        out = _wg(ta, b, offsets)
    if tb is not None:
        term = _wg(a, tb, offsets)
        out = term if out is None else out + term
    if out is None:
        S = max(a.shape[0], b.shape[0], offsets.shape[0])
        out = a.new_zeros(S, offsets.shape[1] - 1, a.shape[2], b.shape[2])
    return out


torch.library.register_autograd("fmoe::ragged_mm", _mm_bwd, setup_context=_mm_setup)
torch.library.register_autograd("fmoe::ragged_wgrad", _wgrad_bwd, setup_context=_wgrad_setup)


# --------------------------------------------------------------------------- vmap rules

def _logical_segments(t: Tensor, dim: Optional[int]) -> int:
    return t.shape[0] if dim is None else (t.shape[1] if dim == 0 else t.shape[0])


def _fold(t: Tensor, dim: Optional[int], B: int, S: int) -> Tensor:
    """Logical [S_t, ...] (batched at ``dim``) -> [B*S, ...], or left at 1 segment if shared."""
    if dim is None:
        if t.shape[0] == 1:
            return t  # one segment shared by all B*S: broadcast, no copy
        t = t.unsqueeze(0).expand(B, *t.shape)  # a nested vmap's inner segments: tile (copies)
    else:
        t = t.movedim(dim, 0)
        if t.shape[1] != S:
            t = t.expand(B, S, *t.shape[2:])
    return t.reshape(B * S, *t.shape[2:])


@torch.library.register_vmap("fmoe::ragged_mm")
def _ragged_mm_vmap(info, in_dims, x, w, offsets, transposed):
    B = info.batch_size
    S = max(_logical_segments(t, d) for t, d in zip((x, w, offsets), in_dims[:3]))
    y = torch.ops.fmoe.ragged_mm(_fold(x, in_dims[0], B, S), _fold(w, in_dims[1], B, S),
                                 _fold(offsets, in_dims[2], B, S), transposed)
    return y.reshape(B, S, *y.shape[1:]), 0


@torch.library.register_vmap("fmoe::ragged_wgrad")
def _ragged_wgrad_vmap(info, in_dims, a, b, offsets):
    B = info.batch_size
    S = max(_logical_segments(t, d) for t, d in zip((a, b, offsets), in_dims))
    z = torch.ops.fmoe.ragged_wgrad(_fold(a, in_dims[0], B, S), _fold(b, in_dims[1], B, S),
                                    _fold(offsets, in_dims[2], B, S))
    return z.reshape(B, S, *z.shape[1:]), 0


# --------------------------------------------------------------------------- fronts

class _RaggedMMBase(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x, w, offsets, transposed):
        return torch.ops.fmoe.ragged_mm(x, w, offsets, transposed)

    setup_context = staticmethod(_mm_setup)
    backward = staticmethod(_mm_bwd)


class _RaggedMM(_RaggedMMBase):
    jvp = staticmethod(_mm_jvp)


class _RaggedWGradBase(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(a, b, offsets):
        return torch.ops.fmoe.ragged_wgrad(a, b, offsets)

    setup_context = staticmethod(_wgrad_setup)
    backward = staticmethod(_wgrad_bwd)


class _RaggedWGrad(_RaggedWGradBase):
    jvp = staticmethod(_wgrad_jvp)


def _direct(*ts: Tensor) -> bool:
    """The op's kernel may be called without the dispatcher (~30 us saved): nothing but
    plain tensors, no transform, no autograd to record, no dispatch mode, no profiler."""
    return (forward_only(*ts) and all(type(t) in PLAIN_TENSORS for t in ts)
            and _python_dispatch._get_current_dispatch_mode() is None
            and not torch._C._autograd._profiler_enabled())


def _mm(x: Tensor, w: Tensor, offsets: Tensor, transposed: bool) -> Tensor:
    """Differentiable segment-form ragged_mm (x [Sx, R, K], w [Sw, E, ., .], offsets [So, E + 1])."""
    if _direct(x, w, offsets):
        return _mm_impl(x, w, offsets, transposed)
    fn = _RaggedMMBase if torch.compiler.is_compiling() else _RaggedMM
    return fn.apply(x, w, offsets, transposed)


def _wg(a: Tensor, b: Tensor, offsets: Tensor) -> Tensor:
    """Differentiable segment-form ragged_wgrad (a [Sa, R, P], b [Sb, R, Q], offsets [So, E + 1])."""
    if _direct(a, b, offsets):
        return _wgrad_impl(a, b, offsets)
    fn = _RaggedWGradBase if torch.compiler.is_compiling() else _RaggedWGrad
    return fn.apply(a, b, offsets)


# --------------------------------------------------------------------------- public

def ragged_mm(x: Tensor, w: Tensor, offsets: Tensor, *, transposed: bool = False) -> Tensor:
    """Per-expert matmul on the ragged layout: ``y[o[e]:o[e+1]] = x[o[e]:o[e+1]] @ op(w[e])``.

    Args:
        x: float [R, K], rows sorted by expert (rows ``offsets[E]..R-1`` are padding).
        w: [E, K, N] in x's dtype, or [E, N, K] with ``transposed=True`` (y = x w[e]^T,
            the nn.Linear layout).
        offsets: int64 [E + 1]; ``offsets[0] = 0``, non-decreasing, ``offsets[E] <= R``
            (checked when the kernel runs, with one host sync).
    Returns:
        [R, N] in x's dtype; padding rows 0. Differentiable in x and w to any order,
        under torch.func transforms (vmap is one kernel call) and torch.compile.
    """
    _check_float("ragged_mm", "x", x)
    _check_float("ragged_mm", "w", w)
    if x.dim() != 2:
        raise ValueError(f"ragged_mm: x must be [R, K], got shape {tuple(x.shape)}")
    if w.dim() != 3:
        raise ValueError(f"ragged_mm: w must be [E, {'N, K' if transposed else 'K, N'}], got shape "
                         f"{tuple(w.shape)}")
    if w.dtype != x.dtype:
        raise TypeError(f"ragged_mm: w must have x's dtype {x.dtype}, got {w.dtype}")
    K = w.shape[2] if transposed else w.shape[1]
    if K != x.shape[1]:
        layout = "[E, N, K]" if transposed else "[E, K, N]"
        raise ValueError(f"ragged_mm: w must be {layout} with K = x.shape[1] = {x.shape[1]}, got shape "
                         f"{tuple(w.shape)} (transposed={transposed})")
    _check_offsets_meta("ragged_mm", offsets, w.shape[0])
    return _mm(x.unsqueeze(0), w.unsqueeze(0), offsets.unsqueeze(0), bool(transposed)).squeeze(0)


def ragged_wgrad(a: Tensor, b: Tensor, offsets: Tensor) -> Tensor:
    """Per-expert ``z[e] = a[o[e]:o[e+1]]^T @ b[o[e]:o[e+1]]`` (the weight gradient of ragged_mm).

    Args:
        a: float [R, P]. b: [R, Q] in a's dtype. offsets: int64 [E + 1] as in
            :func:`ragged_mm`; rows ``offsets[E]..R-1`` are ignored.
    Returns:
        [E, P, Q] in a's dtype; zero for experts with no rows. Differentiable to any order.
    """
    _check_float("ragged_wgrad", "a", a)
    _check_float("ragged_wgrad", "b", b)
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[0]:
        raise ValueError(f"ragged_wgrad: a and b must be [R, P] and [R, Q] with the same R, got shapes "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")
    if b.dtype != a.dtype:
        raise TypeError(f"ragged_wgrad: b must have a's dtype {a.dtype}, got {b.dtype}")
    if not isinstance(offsets, Tensor) or offsets.dim() != 1:
        raise ValueError(f"ragged_wgrad: offsets must be int64 [E + 1], got "
                         f"{tuple(offsets.shape) if isinstance(offsets, Tensor) else type(offsets).__name__}")
    _check_offsets_meta("ragged_wgrad", offsets, offsets.shape[0] - 1)
    if offsets.shape[0] < 1:
        raise ValueError("ragged_wgrad: offsets must have at least 1 entry (E + 1 with E >= 0)")
    return _wg(a.unsqueeze(0), b.unsqueeze(0), offsets.unsqueeze(0)).squeeze(0)
