"""A differentiable grouped GEMM over a plan: the engine's kernels for custom experts.

    y = grouped_mm(x, w, plan, rows=plan.tokens)        # y[r] = x[tokens[r]] @ w[e]   [N, n]
    y = grouped_mm(h, w, plan, transposed=True)          # y[r] = h[r] @ w[e]^T          [N, n]

Forward and backward run the kernel table's entry for the plan (:func:`fmoe.engine.select`):
dgrad is the same grouped call on the transposed weights (scattered back into x's rows when
``rows`` gathered them), wgrad the table's grouped weight-gradient call. Eager mode only (the
plan's host bounds drive the kernel); its backward is not differentiable again.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .plan import ExpertPlan
from .table import Kernel, select

__all__ = ["grouped_mm"]


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
