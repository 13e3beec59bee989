"""The expert GEMMs over a layout's buffers: the engine's kernels for a layout plan.

A layout plan (:class:`fmoe.engine.LayoutPlan`: forward-mode AD, a second derivative or a
transform inside a compiled call, custom experts on padded buffers, pre-scored gates,
transformers' grouped order and ``plan='layout'``) multiplies whole buffers. These are its
GEMMs, one implementation per layout, wrapped by :mod:`fmoe.engine.table` into the same
``Kernel`` interface every other GEMM of the engine has:

* padded [E, C, K]: one ``torch.bmm`` over every row of every expert buffer (Tutel's
  computation, bit for bit). Rows dispatch leaves empty are zero and combine sends them zero
  gradient, so the rows combine reads are the per-expert products.
* ragged [R, K]: :func:`fmoe.ops.ragged.ragged_mm`, a custom op with vmap, jvp and compile
  rules whose kernel is one call into the native grouped GEMM (:mod:`fmoe.ops.native`).

Each differentiates by plain autograd (the ops carry their own torch.func and compile rules).
Sparse eager calls (decode, few busy experts) take a rows plan instead, which multiplies only
the kept pairs.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..layout import Layout
from . import ragged as _ragged
from .memory_order import grad_in_storage_order, weight_grad


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


# --------------------------------------------------------------------------- the layout GEMMs

def padded_mm(x: Tensor, w, *, transposed: bool) -> Tensor:
    """``x[e] @ op(w[e])`` over every row of padded buffers x [E, C, K] (Tutel's one ``torch.bmm``),
    in x's dtype. w: float [E, K, N] ([E, N, K] with ``transposed``), cast to x's dtype; or a packed
    :class:`fmoe.quant.QuantizedTensor` [E, N, K] (one fused low-precision call; ``transposed``
    does not apply). Returns [E, C, N]."""
    if not isinstance(w, Tensor):
        from .. import quant  # optional: low-precision weights
        return quant.expert_matmul(x, w).to(x.dtype)
    w = w.to(x.dtype)
    if not transposed and torch.is_grad_enabled() and w.requires_grad and grad_in_storage_order(w):
        return _StorageOrderBmm.apply(x, w)
    return torch.bmm(x, w.transpose(1, 2) if transposed else w)


def layout_mm(x: Tensor, w, layout: Layout, *, transposed: bool) -> Tensor:
    """``x_e @ op(w[e])`` for every expert e over the layout's rows, in x's dtype.

    Args:
        x: [E, C, K] (padded) or [R, K] (ragged).
        w: float [E, K, N], or [E, N, K] with ``transposed`` (nn.Linear's out x in), cast to x's
            dtype; or a packed weight [E, N, K] (:func:`_packed_layout_mm`).
    Returns:
        [E, C, N] or [R, N]; rows that hold no pair are 0.
    """
    if layout.kind == "padded":
        return padded_mm(x, w, transposed=transposed)
    if not isinstance(w, Tensor):
        return _packed_layout_mm(x, w, layout)
    return _ragged.ragged_mm(x, w.to(x.dtype), layout.offsets, transposed=transposed)


def layout_wgrad(a: Tensor, b: Tensor, layout: Layout) -> Tensor:
    """Per-expert ``a_e^T b_e`` over the layout's rows: [E, P, Q] from a [.., P], b [.., Q].

    Padded buffers: rows past an expert's filled rows must be zero in a or b (they are in
    the pipeline: dispatch leaves them zero and combine sends them zero gradient)."""
    if layout.kind == "ragged":
        return _ragged.ragged_wgrad(a, b, layout.offsets)
    return torch.bmm(a.transpose(1, 2), b)


def _packed_layout_mm(x: Tensor, w, layout: Layout) -> Tensor:
    """``x_e @ dequant(w[e])^T`` for a packed weight (:class:`fmoe.quant.QuantizedTensor` [E, N, K])
    over a ragged layout's rows [R, K], in x's dtype (differentiable in x): off the CPU
    :func:`fmoe.quant.matmul.rows_matmul` over the layout's offsets on the device (no Python per
    expert, no host read; the ragged layout's groups tile rows 0..end by construction, as the
    float path's ragged op takes them); on the CPU, where the groups tile rows 0..end, one native
    call for all experts (:func:`fmoe.quant.packed.grouped_matmul`), else one fused low-precision
    call (:func:`fmoe.quant.expert_matmul`) per busy expert on its row slice."""
    if x.device.type != "cpu":
        from ..quant import matmul as qmm  # optional: low-precision weights
        return qmm.rows_matmul(x, w, layout.offsets)
    from .. import quant  # optional: low-precision weights
    out = x.new_zeros(x.shape[0], w.logical_shape[1])
    starts, sizes = layout.starts.tolist(), layout.sizes.tolist()
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    if x.device.type == "cpu" and starts == bounds[:-1]:
        from ..quant import packed
        out[:bounds[-1]] = packed.grouped_matmul(x[:bounds[-1]], w, torch.tensor(bounds, dtype=torch.int64))
        return out
    for e, (s, n) in enumerate(zip(starts, sizes)):
        if n:
            out[s:s + n] = quant.expert_matmul(x[s:s + n].unsqueeze(0), w[e:e + 1])[0].to(x.dtype)
    return out


def layout_bias(b: Tensor, like: Tensor, layout: Layout) -> Tensor:
    """Per-expert bias b [E, N] shaped to add to a :func:`layout_mm` output ``like`` (in its dtype).

    Ragged rows get theirs as ``membership [R, E] @ b``: a K = E GEMM forward and backward
    (a gather + scatter-add of [R, N] was ~10x slower on CPU); rows past the last group get 0.
    """
    b = b.to(like.dtype)
    if layout.kind == "padded":
        return b.unsqueeze(1)
    return _row_membership(layout, like.dtype) @ b


def _row_membership(layout: Layout, dtype: torch.dtype) -> Tensor:
    """[R, E] in ``dtype``: 1 where ragged row r belongs to expert e (pure torch, vmap-safe)."""
    rows = torch.arange(layout.num_rows, device=layout.starts.device).unsqueeze(1)
    inside = (rows >= layout.starts) & (rows < layout.starts + layout.sizes)
    return inside.to(dtype)
