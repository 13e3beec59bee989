"""Grouped expert GEMMs: the :class:`GroupedGemm` seam over both layouts, and the padded
layout's filled-rows GEMMs (multiply only the filled rows of each expert buffer).

With capacity factor 2 about half of every [E, C, M] buffer is empty, yet a
batched matmul multiplies those zero rows anyway. Here expert e multiplies only
rows [0, n_e), n_e = min(rows[e], C); the other output rows are 0. Rows that
dispatch fills are exactly these (slots are handed out 0, 1, ... per expert),
so on every row that combine reads the result equals the padded computation.

Two autograd Functions, closed under differentiation (grad of grad, jvp):

    grouped_mm(x [E,C,K], w, rows)     y[e,:n] = x[e,:n] @ op(w[e])
        op(w) = w ([E,K,N]) or w^T ([E,N,K], ``transposed=True``)
    grouped_wgrad(a [E,C,P], b [E,C,Q], rows)    z[e] = a[e,:n]^T @ b[e,:n]   ([E,P,Q])

When most experts have rows, one ``torch.bmm`` over the longest filled prefix
does the work; when few do (decode), one ``torch.mm`` per busy expert on views,
so idle experts' weights are never read. Under ``torch.func.vmap`` and
``torch.compile`` the row counts cannot drive Python control flow, so
:func:`expert_mm` falls back to the padded ``torch.bmm`` there (same values on
the filled rows).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch import Tensor

from ..layout import Layout
from . import numba_cpu as _numba_cpu
from . import ragged as _ragged
from . import tuning
from .memory_order import grad_in_storage_order, weight_grad
from .primitives import forward_only

__all__ = ["GroupedGemm", "grouped_mm", "grouped_wgrad", "expert_mm", "filled_rows"]


def filled_rows(counts: Tensor, capacity: int) -> Tensor:
    """int64 [E] rows of each expert buffer that dispatch fills: ``min(counts, C)``."""
    return counts.clamp(max=capacity).to(torch.int64)


def _row_list(rows: Tensor, E: int, C: int) -> list[int]:
    if rows.dim() != 1 or rows.shape[0] != E:
        raise ValueError(f"rows must be int64 [E] = [{E}], got shape {tuple(rows.shape)}")
    if rows.dtype.is_floating_point or rows.dtype == torch.bool:
        raise TypeError(f"rows must be an integer tensor, got {rows.dtype}")
    return rows.clamp(0, C).tolist()


def _gemm_rows(n: int, C: int) -> int:
    """Rows to multiply so that rows [0, n) come out bit-identical to a C-row GEMM.

    MKL (torch 2.13's CPU BLAS) sends GEMMs with fewer than 12 rows that are
    not a multiple of 4 to a different kernel with a different summation order
    (measured on several shapes; tests/test_grouped.py checks it). So multiply
    at least enough rows to stay on the kernel the padded C-row GEMM uses:
    at most 3 extra rows per expert.
    """
    if n == 0 or C < 12:
        return C if n else 0
    if n < 12 and n % 4:
        n += 4 - n % 4
    return min(n, C)


def _dense(ns: list[int]) -> bool:
    # Many busy experts: one batched call over the longest filled prefix beats E
    # small calls (each a parallel region; on a shared machine every region start
    # waits for all threads). Few busy experts (decode): loop over those only,
    # so the idle experts' weights are never read.
    return 2 * sum(1 for n in ns if n) > len(ns)


_GEMV_DTYPES = (torch.float32, torch.float64)


def _mm_rows(x: Tensor, w: Tensor, ns: list[int], transposed: bool, exact: bool = False) -> Tensor:
    E, C, _ = x.shape
    wt = w.transpose(1, 2) if transposed else w
    ms = ns if exact else [_gemm_rows(n, C) for n in ns]
    if exact and x.device.type == "cpu":
        y = _numba_cpu.rows_matvec(x, w, ns, transposed)
        if y is not None:  # small problem: one serial numba call over the busy rows only
            return y
    # Many busy experts (exact or not): one batched call over the longest filled prefix
    # (measured faster than per-expert calls at decode_64: 128 experts, ~4 rows each).
    dense = _dense(ns)
    if dense and max(ms) == C:
        y = torch.bmm(x, wt)
    elif dense:
        y = torch.empty(E, C, wt.shape[2], dtype=x.dtype, device=x.device)
        m = max(ms)
        y[:, :m] = torch.bmm(x[:, :m], wt)
    else:
        # One memset instead of a zero_() per idle expert (most of them at decode).
        y = torch.zeros(E, C, wt.shape[2], dtype=x.dtype, device=x.device)
        gemv = exact and x.dtype in _GEMV_DTYPES and x.device.type == "cpu"
        if gemv:  # [E, N, K] matrices for mv; flat row views (fewer view ops per row)
            wmv = w if transposed else w.transpose(1, 2)
            xf, yf = x.reshape(E * C, x.shape[2]), y.view(E * C, y.shape[2])
        for e, m in enumerate(ms):
            if not m:
                continue  # idle expert: its weights are never read
            if gemv and m <= tuning.GEMV_ROWS:
                a = wmv[e]
                for r in range(e * C, e * C + m):
                    torch.mv(a, xf[r], out=yf[r])
            else:
                torch.mm(x[e, :m], wt[e], out=y[e, :m])
        if not exact:
            for e, (n, m) in enumerate(zip(ns, ms)):
                if n < m:
                    y[e, n:m].zero_()
        return y
    for e, n in enumerate(ns):
        if n < C:
            y[e, n:].zero_()
    return y


def _wgrad_rows(a: Tensor, b: Tensor, ns: list[int]) -> Tensor:
    E = a.shape[0]
    if _dense(ns):
        m = max(ns)
        bm = b[:, :m].clone()  # rows past n_e must not contribute
        for e, n in enumerate(ns):
            if n < m:
                bm[e, n:].zero_()
        return torch.bmm(a[:, :m].transpose(1, 2), bm)
    z = torch.empty(E, a.shape[2], b.shape[2], dtype=a.dtype, device=a.device)
    for e, n in enumerate(ns):
        if n:
            torch.mm(a[e, :n].t(), b[e, :n], out=z[e])
        else:
            z[e].zero_()
    return z


def _row_mask(rows: Tensor, C: int, dtype: torch.dtype) -> Tensor:
    """[E, C, 1]: 1 on rows [0, min(rows[e], C)), else 0 (pure torch, vmap-friendly)."""
    return (torch.arange(C, device=rows.device) < rows.clamp(0, C).unsqueeze(-1)).unsqueeze(-1).to(dtype)


def _mm(x: Tensor, w: Tensor, rows: Tensor, transposed: bool, exact: bool = False) -> Tensor:
    if forward_only(x, w, rows):  # no autograd, no transform: the forward itself
        return _mm_rows(x, w, _row_list(rows, x.shape[0], x.shape[1]), transposed, exact)
    # Inside a vmap (jacrev, vmap over cotangents) the row counts cannot drive
    # Python loops: the same function as padded, masked torch.
    if _batched_under_vmap(x, w, rows):
        y = torch.matmul(x, w.transpose(-1, -2) if transposed else w)
        return y * _row_mask(rows, x.shape[-2], y.dtype)
    return _GroupedMM.apply(x, w, rows, transposed, exact)


def _wg(a: Tensor, b: Tensor, rows: Tensor) -> Tensor:
    if _batched_under_vmap(a, b, rows):
        return torch.matmul(a.transpose(-1, -2), b * _row_mask(rows, b.shape[-2], b.dtype))
    return _GroupedWGrad.apply(a, b, rows)


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(x, w, rows, transposed, exact):
        return _mm_rows(x, w, _row_list(rows, x.shape[0], x.shape[1]), transposed, exact)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w, rows, transposed, exact = inputs
        ctx.save_for_backward(x, w, rows)
        ctx.save_for_forward(x, w, rows)
        ctx.transposed = transposed
        ctx.exact = exact
        ctx.grad_in_storage = grad_in_storage_order(w)

    @staticmethod
    def backward(ctx, gy):
        x, w, rows = ctx.saved_tensors
        gx = gw = None
        if ctx.needs_input_grad[0]:
            # y = x op(w)  =>  gx = gy op(w)^T; op(w)^T is w read the other way round.
            gx = _mm(gy, w, rows, not ctx.transposed, ctx.exact)
        if ctx.needs_input_grad[1]:
            # In the order of w's memory: no transposed copy of the weight gradient.
            gw = weight_grad(lambda a, b: _wg(a, b, rows), x, gy, ctx.transposed, ctx.grad_in_storage)
        return gx, gw, None, None, None

    @staticmethod
    def jvp(ctx, tx, tw, trows, ttransposed, texact):
        x, w, rows = ctx.saved_tensors
        out = None
        if tx is not None:
            out = _mm(tx, w, rows, ctx.transposed, ctx.exact)
        if tw is not None:
            term = _mm(x, tw, rows, ctx.transposed, ctx.exact)
            out = term if out is None else out + term
        return out


class _GroupedWGrad(torch.autograd.Function):
    @staticmethod
    def forward(a, b, rows):
        return _wgrad_rows(a, b, _row_list(rows, a.shape[0], a.shape[1]))

    @staticmethod
    def setup_context(ctx, inputs, output):
        a, b, rows = inputs
        ctx.save_for_backward(a, b, rows)
        ctx.save_for_forward(a, b, rows)

    @staticmethod
    def backward(ctx, gz):
        a, b, rows = ctx.saved_tensors
        # z = a^T b  =>  ga = b gz^T, gb = a gz (rows [0, n) only).
        ga = _mm(b, gz, rows, True) if ctx.needs_input_grad[0] else None
        gb = _mm(a, gz, rows, False) if ctx.needs_input_grad[1] else None
        return ga, gb, None

    @staticmethod
    def jvp(ctx, ta, tb, trows):
        a, b, rows = ctx.saved_tensors
        out = None
        if ta is not None:
            out = _wg(ta, b, rows)
        if tb is not None:
            term = _wg(a, tb, rows)
            out = term if out is None else out + term
        return out


def grouped_mm(x: Tensor, w: Tensor, rows: Tensor, *, transposed: bool = False, exact: bool = False) -> Tensor:
    """Per-expert ``x[e, :n_e] @ op(w[e])``, rows n_e.. of the output zero.

    Args:
        x: float [E, C, K].
        w: float [E, K, N], or [E, N, K] with ``transposed=True``; x's dtype.
        rows: int64 [E], filled rows per expert (clamped to [0, C]).
        exact: multiply exactly rows [0, n_e), never touching idle experts' weights
            (float32/64 on CPU: one serial numba call over all filled rows when that
            streams at most ``tuning.MATVEC_BYTES`` of weights, else one BLAS GEMV per
            row for experts with at most 4 rows and a GEMM on n_e rows above). Faster at
            decode, but rows [0, n_e) then equal the padded C-row GEMM only within float
            rounding (another summation order), not bit for bit as with the default
            ``exact=False``.
    Returns:
        [E, C, N] in x's dtype. Differentiable in x and w to any order.
    """
    return _mm(x, w, rows, transposed, exact)


def grouped_wgrad(a: Tensor, b: Tensor, rows: Tensor) -> Tensor:
    """Per-expert ``a[e, :n_e]^T @ b[e, :n_e]``: [E, C, P], [E, C, Q] -> [E, P, Q]."""
    return _wg(a, b, rows)


def _batched_under_vmap(*ts: Tensor) -> bool:
    # Peel functorch wrappers (grad levels) looking for a vmap BatchedTensor.
    F = torch._C._functorch
    for t in ts:
        while isinstance(t, Tensor):
            if F.is_batchedtensor(t):
                return True
            if not F.is_functorch_wrapped_tensor(t):
                break
            t = F.get_unwrapped(t)
    return False


class _StorageOrderBmm(torch.autograd.Function):
    """``torch.bmm(x, w)`` for w [E, K, N] a transposed view of contiguous [E, N, K] storage
    (fmoe.nn.MoELayer's x @ W views), whose weight gradient comes out in the storage's order.
    Autograd's bmm makes it contiguous in w's own shape, and the Parameter's AccumulateGrad
    then copies it into the storage's strides (21 of the 34 ms of such copies in a
    fine-grained staged training step, 2026-12-01). The forward and the data gradient are
    bmm's own calls; the backward is differentiable (bmm). (With ``transposed=True`` the
    product is ``bmm(x, storage)`` and autograd's gradient is already in the storage's order.)"""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.bmm(x, w)

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        gx = torch.bmm(gy, w.transpose(1, 2)) if ctx.needs_input_grad[0] else None
        gw = None
        if ctx.needs_input_grad[1]:   # gyᵀ x, the [E, N, K] storage's gradient, viewed back as w
            gw = weight_grad(lambda a, b: torch.bmm(a.transpose(1, 2), b), x, gy, False, True)
        return gx, gw


def expert_mm(x: Tensor, w: Tensor, *, transposed: bool, rows: Optional[Tensor] = None,
              exact: bool = False) -> Tensor:
    """``x[e] @ op(w[e])`` for all experts, on filled rows only when ``rows`` is given.

    Falls back to the padded batched matmul when ``rows`` is None, while
    compiling, and under vmap (row counts cannot steer Python loops there).
    """
    if rows is not None and (forward_only(x, w, rows) or (
            not torch.compiler.is_compiling() and not _batched_under_vmap(x, w, rows))):
        return grouped_mm(x, w, rows, transposed=transposed, exact=exact)
    return torch.bmm(x, w.transpose(1, 2) if transposed else w)


# --------------------------------------------------------------------------- the seam

@dataclasses.dataclass(frozen=True, eq=False)
class GroupedGemm:
    """The one expert-GEMM seam: per-expert matmuls over a :class:`~fmoe.Layout`'s row buffer.

    Every expert function (ffn, SwiGLU, GPT-OSS, fused layouts, custom ones that want it)
    multiplies through this object, so a faster kernel, a quantized recipe or another layout
    is added here once for every router and architecture. Override it by subclassing and
    passing the instance to the expert function.

    Layouts:
        padded: x [E, C, K]; expert e multiplies its filled rows ``[0, sizes[e])`` (the rest of
            the output is 0). ``exact=False`` keeps the C-row GEMM's summation order bit for
            bit; ``exact=True`` multiplies exactly the filled rows (faster at decode, equal
            within float rounding). Under vmap/compile: the padded ``bmm``.
        ragged: x [R, K]; expert e multiplies rows ``offsets[e]:offsets[e+1]``
            (:func:`fmoe.ops.ragged.ragged_mm`, a custom op closed under differentiation).

    Weights: float [E, K, N], or [E, N, K] with ``transposed=True`` (nn.Linear's out x in);
    or a :class:`fmoe.quant.QuantizedTensor` of logical shape [E, N, K] (always out x in).
    ``precision`` (a :class:`fmoe.quant.training.TrainPrecision`) runs float master weights
    through the quantized-training recipe (forward and backward GEMMs on quantized operands,
    gradients on the master weights); ``generator`` feeds its stochastic rounding.

    Attributes:
        layout: the dispatch layout.
        exact: padded layout only, see above.
        precision: None (compute in x's dtype) or a quantized-training recipe.
        generator: RNG for the recipe's stochastic rounding / random Hadamard signs.
    """

    layout: Layout
    exact: bool = False
    precision: Any = None
    generator: Optional[torch.Generator] = None

    # ---- float kernels over the layout
    def _full_buffers(self) -> bool:
        """Padded layout, bit-exact order, most experts busy: one batched GEMM over the whole
        [E, C, K] buffers (Tutel's computation) beats any row bookkeeping.

        The empty rows are zero in the dispatch buffer and get zero gradient from combine, so
        the rows combine reads are the same; one batched call is also one parallel region,
        where E per-expert calls (and E zero-fills of their empty tails) each wait for every
        thread — on a shared 2-core machine a fine-grained training step spent 2.2 s of 2.7 s
        in those fills (profile, 2026-12-01)."""
        lay = self.layout
        if lay.kind != "padded" or self.exact:
            return False
        if torch.compiler.is_compiling() or _batched_under_vmap(lay.sizes):
            return True   # expert_mm would fall back to the padded bmm there anyway
        return _dense(lay.sizes.tolist())

    def _float_mm(self, x: Tensor, w: Tensor, transposed: bool) -> Tensor:
        lay = self.layout
        if lay.kind == "ragged":
            return _ragged.ragged_mm(x, w, lay.offsets, transposed=transposed)
        if self._full_buffers():
            if not transposed and torch.is_grad_enabled() and w.requires_grad and grad_in_storage_order(w):
                return _StorageOrderBmm.apply(x, w)
            return torch.bmm(x, w.transpose(1, 2) if transposed else w)
        return expert_mm(x, w, transposed=transposed, rows=lay.sizes, exact=self.exact)

    def wgrad(self, a: Tensor, b: Tensor) -> Tensor:
        """Per-expert ``a_e^T b_e`` over the layout's rows: [E, P, Q] from a [.., P], b [.., Q].

        Padded buffers: rows past an expert's filled rows must be zero in a or b (they are in
        the pipeline: dispatch leaves them zero and combine sends them zero gradient)."""
        lay = self.layout
        if lay.kind == "ragged":
            return _ragged.ragged_wgrad(a, b, lay.offsets)
        if self._full_buffers():
            return torch.bmm(a.transpose(1, 2), b)
        return grouped_wgrad(a, b, lay.sizes)

    def mm(self, x: Tensor, w, *, transposed: bool = False) -> Tensor:
        """``x_e @ op(w[e])`` for every expert e over the layout's rows; result in x's dtype.

        Args:
            x: [E, C, K] (padded) or [R, K] (ragged).
            w: float [E, K, N] (``transposed=False``) or [E, N, K] (``transposed=True``),
                or a QuantizedTensor [E, N, K] (``transposed`` is then ignored).
        Returns:
            [E, C, N] or [R, N]; rows that hold no pair are 0.
        """
        if not isinstance(w, Tensor):
            return self._quantized_mm(x, w)
        w = w.to(x.dtype)
        if self.precision is not None:
            from ..quant import training as _qt  # optional: quantized training recipes
            return _qt.quantized_mm(x, w, self.precision, transposed=transposed, mm=self._float_mm,
                                    wgrad=self.wgrad, generator=self.generator)
        return self._float_mm(x, w, transposed)

    def _quantized_mm(self, x: Tensor, w) -> Tensor:
        from .. import quant  # optional: low-precision weights
        lay = self.layout
        if lay.kind == "padded":
            return quant.expert_matmul(x, w).to(x.dtype)
        # Ragged rows: one fused low-precision call per busy expert on its row slice.
        out = x.new_zeros(x.shape[0], w.logical_shape[1])
        starts, sizes = lay.starts.tolist(), lay.sizes.tolist()
        for e, (s, n) in enumerate(zip(starts, sizes)):
            if n:
                out[s:s + n] = quant.expert_matmul(x[s:s + n].unsqueeze(0), w[e:e + 1])[0].to(x.dtype)
        return out

    def bias(self, b: Tensor, like: Tensor) -> Tensor:
        """Per-expert bias b [E, N] shaped to add to a ``mm`` output ``like`` (in its dtype).

        Ragged rows get theirs as ``membership [R, E] @ b``: a K = E GEMM forward and backward
        (a gather + scatter-add of [R, N] was ~10x slower on CPU); rows past the last group get 0.
        """
        b = b.to(like.dtype)
        if self.layout.kind == "padded":
            return b.unsqueeze(1)
        return self.row_membership(like.dtype) @ b

    def row_membership(self, dtype: torch.dtype) -> Tensor:
        """[R, E] in ``dtype``: 1 where ragged row r belongs to expert e (pure torch, vmap-safe)."""
        lay = self.layout
        rows = torch.arange(lay.num_rows, device=lay.starts.device).unsqueeze(1)
        inside = (rows >= lay.starts) & (rows < lay.starts + lay.sizes)
        return inside.to(dtype)
