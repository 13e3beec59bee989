"""The grouped GEMM that expert functions multiply through, on either plan.

    gemm = GroupedGemm(plan, select(plan))              # the table's kernel bound to one call's plan
    y = gemm.mm(x, w, transposed=True, bias=b)          # x_e @ op(w[e]) + b[e] for every expert
    y = grouped_mm(x, w, plan, rows=plan.tokens)        # rows plan: y[r] = x[tokens[r]] @ w[e]  [N, n]

:class:`GroupedGemm` is the seam of the built-in expert functions (:mod:`fmoe.experts`): on a
layout plan x is the layout's buffer and the layout kernel's ops differentiate by plain
autograd; on a rows plan it is :func:`grouped_mm`. Forward and backward of :func:`grouped_mm`
run the kernel table's entry for the plan: dgrad is the same grouped call on the transposed
weights (scattered back into x's rows when ``rows`` gathered them), wgrad the table's grouped
weight-gradient call. Eager mode only (the plan's host bounds drive the kernel); its backward
is not differentiable again.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch
from torch import Tensor

from ..layout import Layout
from .plan import ExpertPlan, LayoutPlan
from .table import Kernel, select


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kern, plan, transposed, x, w, rows):
        ctx.kern, ctx.plan, ctx.transposed = kern, plan, transposed
        ctx.save_for_backward(x, w, rows)
        return kern.mm(x, w, plan, rows=rows, transposed=transposed)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy):
        kern, plan, t = ctx.kern, ctx.plan, ctx.transposed
        x, w, rows = ctx.saved_tensors
        gy = gy.contiguous()
        gx = gw = None
        if ctx.needs_input_grad[3]:
            g_rows = kern.mm(gy, w, plan, transposed=not t)
            gx = g_rows if rows is None else torch.zeros_like(x).index_add_(0, rows, g_rows)
        if ctx.needs_input_grad[4]:
            if t:   # w [E, n, k]: gw[e] = gy_e^T x_e
                gw = kern.wgrad(gy, x, plan, rows_b=rows)
            else:   # w [E, k, n]: gw[e] = x_e^T gy_e, x's rows gathered by the kernel
                gw = kern.wgrad(x, gy, plan, rows=rows)
        return None, None, None, gx, gw, None


def grouped_mm(x: Tensor, w: Tensor, plan: ExpertPlan, *, rows: Optional[Tensor] = None, transposed: bool = False,
               kernel: Optional[Kernel] = None) -> Tensor:
    """``y[r] = x[rows[r]] @ op(w[e])`` for every row r of expert e in the plan, differentiable in x and w.

    Args:
        x: float [T, k] (with ``rows``, e.g. ``plan.tokens``) or [N, k] in plan order.
        w: float [E, k, n], or [E, n, k] with ``transposed``; x's dtype.
        plan: the :class:`~fmoe.engine.ExpertPlan`.
        kernel: the table entry (default :func:`~fmoe.engine.select` of the plan).
    Returns:
        [N, n] in x's dtype.
    """
    if x.dim() != 2 or w.dim() != 3 or w.shape[0] != plan.num_experts:
        raise ValueError(f"grouped_mm: x must be 2-D and w [E, ., .] with E={plan.num_experts}; got x "
                         f"{tuple(x.shape)}, w {tuple(w.shape)}")
    if rows is None and x.shape[0] != plan.num_rows:
        raise ValueError(f"grouped_mm: without rows x must be [N, k] with N={plan.num_rows} (the plan's rows), "
                         f"got {tuple(x.shape)}")
    if x.dtype != w.dtype:
        raise TypeError(f"grouped_mm: x and w must share a dtype, got {x.dtype} and {w.dtype}")
    kern = select(plan) if kernel is None else kernel
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return _GroupedMM.apply(kern, plan, transposed, x, w, rows)
    return kern.mm(x, w, plan, rows=rows, transposed=transposed)


@dataclasses.dataclass(frozen=True, eq=False)
class GroupedGemm:
    """The kernel table's entry bound to one call's plan: what every built-in expert function
    multiplies through (:func:`fmoe.experts.apply_form`), so a recipe or a kernel added to the table
    reaches every router and architecture. Override it by subclassing (``mm``) and passing the
    instance to the expert function.

    Attributes:
        plan: a :class:`~fmoe.engine.LayoutPlan` (x is its buffer, [E, C, K] padded or [R, K]
            ragged) or an :class:`~fmoe.engine.ExpertPlan` (x is [N, K] in plan order, or gathered
            through ``rows``).
        kernel: the table entry (:func:`~fmoe.engine.select` of the plan).
    """

    plan: Union[ExpertPlan, LayoutPlan]
    kernel: Kernel

    @classmethod
    def over(cls, layout: Layout, *, precision=None, generator: Optional[torch.Generator] = None,
             dtype: torch.dtype = torch.float32) -> "GroupedGemm":
        """The seam over a layout's buffers alone (no routing: the GEMMs read only the layout),
        with a quantized-training recipe (``precision``, ``generator`` for its randomness)."""
        plan = LayoutPlan(None, layout, dtype, precision)
        return cls(plan, select(plan, generator=generator))

    @property
    def layout(self) -> Layout:
        """A layout plan's :class:`~fmoe.Layout` (ValueError on a rows plan)."""
        if not isinstance(self.plan, LayoutPlan):
            raise ValueError("a rows plan has no layout (its rows are the kept pairs sorted by expert)")
        return self.plan.layout

    def mm(self, x: Tensor, w, *, transposed: bool = False, bias: Optional[Tensor] = None,
           rows: Optional[Tensor] = None) -> Tensor:
        """``x_e @ op(w[e]) (+ bias[e])`` for every expert e over the plan's rows; in x's dtype.

        Args:
            x: layout plan: [E, C, K] (padded) or [R, K] (ragged). Rows plan: [N, K] in plan
                order, or [T, K] with ``rows`` (e.g. ``plan.tokens``) gathering them.
            w: float [E, K, N] (``transposed=False``) or [E, N, K] (``transposed=True``), or a
                packed :class:`fmoe.quant.QuantizedTensor` [E, N, K] (``transposed`` then ignored).
            bias: [E, N] or None.
        Returns:
            [E, C, N], [R, N] or [N, n]; layout rows that hold no pair are 0 (or, with a bias,
            padded rows their expert's bias and ragged padding rows 0).
        """
        if isinstance(self.plan, LayoutPlan):
            if rows is not None:
                raise ValueError("GroupedGemm.mm: a layout plan multiplies its buffer as it is; rows must be None")
            return self.kernel.mm(x, w, self.plan, transposed=transposed, bias=bias)
        if not isinstance(w, Tensor):   # packed: the table's packed kernel (differentiable in x)
            return select(self.plan, packed=True).mm(x, w, self.plan, rows=rows, bias=bias)
        y = grouped_mm(x, w, self.plan, rows=rows, transposed=transposed, kernel=self.kernel)
        return y if bias is None else y + bias.to(y.dtype).index_select(0, self.plan.experts)

    def wgrad(self, a: Tensor, b: Tensor) -> Tensor:
        """Per-expert ``a_e^T b_e`` over the plan's rows: [E, P, Q] from a [.., P], b [.., Q]
        (padded buffers: rows past an expert's fill must be zero in a or b)."""
        if self.kernel.wgrad is None:
            raise TypeError(f"GroupedGemm.wgrad: the kernel {self.kernel.name!r} takes no weight gradient (packed "
                            f"weights are frozen)")
        return self.kernel.wgrad(a, b, self.plan)
