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

Kernel on the CPU: one host sync (``offsets.tolist()``, with the checks), then per segment one
call into the native grouped GEMM (:mod:`fmoe.ops.native`, serial regime: each group is the
reference's ``torch.mm`` on the same views, so bit-identical to it; the per-expert Python loop
where the extension is not built). Off the CPU (float32 / bfloat16 / float16 operands whose
strides ``torch._grouped_mm`` takes): one ``torch._grouped_mm`` per segment on the device's
offsets, no ``tolist`` and no Python per expert; the offsets are checked by one device-side
assertion (an error surfaces at the next synchronisation, as torch's own index checks do).
torch's CUDA kernel runs bf16 on sm90/sm100 with no host sync; float32 / float16 (and bf16 on
other GPUs) go through torch's fallback, which reads the offsets on the host once per call.
Other dtypes and layouts take the per-expert loop. Empty groups are skipped and only the padding rows
are zeroed. (One padded batched GEMM over balanced groups, two row gathers and a bmm, took
1.28-1.50x the per-group calls' time in training: ``python -m benchmarks.bench_ragged --only
train``, 2026-12-01; removed.) Sparse eager calls run on the expert engine instead, whose
decode kernels multiply only the kept pairs (:mod:`fmoe.engine.table`).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import native as _native
from .memory_order import grad_in_storage_order, weight_grad


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

# torch._grouped_mm's operand dtypes (on CPU and CUDA alike; float64 is refused).
_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INT32_MAX = 2 ** 31 - 1   # its offsets are int32


def _takes_grouped_mm(t: Tensor) -> bool:
    """Whether the kernels for operand t run torch._grouped_mm (off the CPU, its dtypes) rather
    than the native CPU grouped GEMM. The CPU keeps the native kernels: bit-identical to the
    reference there, and measured faster (benchmarks/bench_ragged.py)."""
    return t.device.type != "cpu" and t.dtype in _GROUPED_DTYPES


def _grouped_layout_ok(*ts: Tensor) -> bool:
    """torch._grouped_mm's layout rule for the [S, ...] operands' segments: each starts on a
    16-byte boundary (CUDA checks its data pointer), one of the last two strides is 1 and the
    other spans its dimension in a multiple of 16 bytes."""
    for t in ts:
        st, n, size = t.stride(), t.shape, t.element_size()
        align = 16 // size
        start = t.untyped_storage().data_ptr() + t.storage_offset() * size
        if start % 16 or (n[0] > 1 and st[0] % align):
            return False
        if not ((st[-1] == 1 and st[-2] >= max(1, n[-1]) and st[-2] % align == 0)
                or (st[-2] == 1 and st[-1] >= max(1, n[-2]) and st[-1] % align == 0)):
            return False
    return True


def _assert_offsets(name: str, offsets: Tensor, R: int) -> None:
    """:func:`_offset_lists`'s checks on every row of offsets [So, E + 1] as one assertion that
    does not synchronise: on CUDA a device-side assertion, on the CPU a RuntimeError at once."""
    E = offsets.shape[1] - 1
    first, last = offsets.narrow(1, 0, 1), offsets.narrow(1, E, 1)
    ok = (first == 0).all() & (offsets.narrow(1, 1, E) >= offsets.narrow(1, 0, E)).all() & (last <= R).all()
    torch._assert_async(ok, f"{name}: offsets must have offsets[0] = 0, be non-decreasing and have "
                            f"offsets[E] <= the {R} rows of the input")


def _mm_grouped(x: Tensor, w: Tensor, offsets: Tensor, transposed: bool, S: int) -> Tensor:
    """:func:`_mm_impl` as one ``torch._grouped_mm`` per segment (no host sync); the padding rows,
    which it leaves unwritten, are zeroed by a mask made on the device."""
    R, E = x.shape[1], w.shape[1]
    _assert_offsets("ragged_mm", offsets, R)
    if E == 0 or R == 0:
        return x.new_zeros(S, R, w.shape[2] if transposed else w.shape[3])
    rows = torch.arange(R, device=x.device)
    ys = []
    for s in range(S):
        o, ws = _seg(offsets, s), _seg(w, s)
        y = torch._grouped_mm(_seg(x, s), ws.transpose(1, 2) if transposed else ws,
                              offs=o.narrow(0, 1, E).to(torch.int32))
        ys.append(y.masked_fill_((rows >= o.narrow(0, E, 1)).unsqueeze(1), 0))
    # its output rows are padded to 16 bytes where N * itemsize is not: contiguous, as the fake kernel says
    return torch.stack(ys) if S > 1 else ys[0].unsqueeze(0).contiguous()


def _wgrad_grouped(a: Tensor, b: Tensor, offsets: Tensor, S: int) -> Tensor:
    """:func:`_wgrad_impl` as one ``torch._grouped_mm`` per segment (``a^T b`` grouped along the
    rows; rows past offsets[E] are in no group). Experts with no rows are zeroed by a mask: the
    kernel need not write their matrices."""
    E = offsets.shape[1] - 1
    _assert_offsets("ragged_wgrad", offsets, a.shape[1])
    if E == 0:
        return a.new_zeros(S, 0, a.shape[2], b.shape[2])
    zs = []
    for s in range(S):
        o = _seg(offsets, s)
        z = torch._grouped_mm(_seg(a, s).t(), _seg(b, s), offs=o.narrow(0, 1, E).to(torch.int32))
        zs.append(z.masked_fill_((o.narrow(0, 1, E) == o.narrow(0, 0, E)).view(E, 1, 1), 0))
    return torch.stack(zs) if S > 1 else zs[0].unsqueeze(0)


def _seg(t: Tensor, s: int) -> Tensor:
    """Segment s of a [S_t, ...] operand whose segment count is 1 (shared) or S (a view)."""
    return t.narrow(0, s if t.shape[0] > 1 else 0, 1).squeeze(0)


def _mm_impl(x: Tensor, w: Tensor, offsets: Tensor, transposed: bool) -> Tensor:
    """y [S, R, N]: each segment's groups in one native grouped-GEMM call (:func:`fmoe.ops.native.gather_mm`,
    serial regime: each group is the reference's ``torch.mm``, bit for bit), padding rows zeroed."""
    S = _check_mm_op(x, w, offsets, transposed)
    if _takes_grouped_mm(x) and x.shape[1] <= _INT32_MAX and _grouped_layout_ok(
            x, w.transpose(2, 3) if transposed else w):
        return _mm_grouped(x, w, offsets, transposed, S)
    R = x.shape[1]
    N = w.shape[2] if transposed else w.shape[3]
    y = torch.empty(S, R, N, dtype=x.dtype, device=x.device)
    offs = _offset_lists("ragged_mm", offsets, R)
    for s in range(S):
        n, ys = offs[s if len(offs) > 1 else 0][-1], y[s]
        if x.device.type == "cpu":
            _native.gather_mm(_seg(x, s)[:n], _seg(w, s), _seg(offsets, s), transposed=transposed, out=ys[:n],
                              regime="serial")
        else:
            _native.gather_mm_reference(_seg(x, s)[:n], _seg(w, s), _seg(offsets, s), transposed=transposed,
                                        out=ys[:n])
        if n < R:
            ys[n:].zero_()
    return y


def _wgrad_impl(a: Tensor, b: Tensor, offsets: Tensor) -> Tensor:
    """z [S, E, P, Q]: each segment's groups in one native call (:func:`fmoe.ops.native.gather_wgrad`,
    serial regime, the reference's ``torch.mm`` per group); experts with no rows get zeros."""
    S = _check_wgrad_op(a, b, offsets)
    if _takes_grouped_mm(a) and a.shape[1] <= _INT32_MAX and _grouped_layout_ok(a.transpose(1, 2), b):
        return _wgrad_grouped(a, b, offsets, S)
    E = offsets.shape[1] - 1
    offs = _offset_lists("ragged_wgrad", offsets, a.shape[1])
    z = torch.empty(S, E, a.shape[2], b.shape[2], dtype=a.dtype, device=a.device)
    cpu = a.device.type == "cpu"
    for s in range(S):
        n = offs[s if len(offs) > 1 else 0][-1]
        args = (_seg(a, s)[:n], _seg(b, s)[:n], _seg(offsets, s))
        if cpu:
            _native.gather_wgrad(*args, out=z[s], regime="serial")
        else:
            _native.gather_wgrad_reference(*args, out=z[s])
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


def _mm(x: Tensor, w: Tensor, offsets: Tensor, transposed: bool) -> Tensor:
    """Differentiable segment-form ragged_mm (x [Sx, R, K], w [Sw, E, ., .], offsets [So, E + 1])."""
    fn = _RaggedMMBase if torch.compiler.is_compiling() else _RaggedMM
    return fn.apply(x, w, offsets, transposed)


def _wg(a: Tensor, b: Tensor, offsets: Tensor) -> Tensor:
    """Differentiable segment-form ragged_wgrad (a [Sa, R, P], b [Sb, R, Q], offsets [So, E + 1])."""
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
