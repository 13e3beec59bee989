"""The expert-GEMM seam of the staged pipeline: :class:`GroupedGemm` over both layouts.

The staged pipeline (dispatch -> experts -> combine over a layout's buffers) is the expert
engine's kernel for a layout plan (:mod:`fmoe.engine.table`: forward-mode AD, a second
derivative or a transform inside a compiled call, custom experts on padded buffers, pre-scored
gates, transformers' grouped order and ``plan='layout'``); expert parallelism uses its dispatch
and combine. One implementation per
layout, no per-call kernel predicates:

* padded [E, C, K]: one ``torch.bmm`` over every row of every expert buffer (Tutel's
  computation, bit for bit). Rows dispatch leaves empty are zero and combine sends them zero
  gradient, so the rows combine reads are the per-expert products.
* ragged [R, K]: :func:`fmoe.ops.ragged.ragged_mm`, a custom op with vmap, jvp and compile
  rules whose kernel is one call into the native grouped GEMM (:mod:`fmoe.ops.native`).

Sparse eager calls (decode, few busy experts) belong to the engine (:mod:`fmoe.engine`), which
multiplies only the kept pairs.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch import Tensor

from ..layout import Layout
from ..routing import Routing
from . import dispatch as _dispatch
from . import ragged as _ragged
from .orders import combine_in_order
from .memory_order import grad_in_storage_order, weight_grad

__all__ = ["GroupedGemm"]


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


# --------------------------------------------------------------------------- the seam

@dataclasses.dataclass(frozen=True, eq=False)
class GroupedGemm:
    """The staged pipeline's expert-GEMM seam: per-expert matmuls over a :class:`~fmoe.Layout`'s buffer.

    Every built-in expert function multiplies through this object (:func:`fmoe.experts.apply_form`),
    so a quantized recipe or another layout is added here once for every router and architecture.
    Override it by subclassing and passing the instance to the expert function.

    Layouts:
        padded: x [E, C, K]; every row multiplied (one ``torch.bmm``, Tutel's arithmetic).
        ragged: x [R, K]; expert e multiplies rows ``offsets[e]:offsets[e+1]``
            (:func:`fmoe.ops.ragged.ragged_mm`, a custom op closed under differentiation).

    Weights: float [E, K, N], or [E, N, K] with ``transposed=True`` (nn.Linear's out x in);
    or a :class:`fmoe.quant.QuantizedTensor` of logical shape [E, N, K] (always out x in).
    ``precision`` (a :class:`fmoe.quant.training.TrainPrecision`) runs float master weights
    through the quantized-training recipe (forward and backward GEMMs on quantized operands,
    gradients on the master weights); ``generator`` feeds its stochastic rounding.

    Attributes:
        layout: the dispatch layout.
        precision: None (compute in x's dtype) or a quantized-training recipe.
        generator: RNG for the recipe's stochastic rounding / random Hadamard signs.
    """

    layout: Layout
    precision: Any = None
    generator: Optional[torch.Generator] = None

    name = "staged"
    why = "the layout's buffers: dispatch -> one op per projection over every buffer row -> combine (torch.func / compile rules)"

    # ---- tokens in and out of the layout's buffers
    def dispatch(self, x: Tensor, routing: Routing, *, weighted: bool = False) -> Tensor:
        """Tokens x [T, M] into the layout's buffer ([E, C, M] or [R, M]); ``weighted``: each
        copy times its gate (pre-scored gates)."""
        return _dispatch(x, routing, weighted=weighted, layout=self.layout)

    def combine(self, y: Tensor, routing: Routing, *, order: str = "fmoe", weighted: bool = True) -> Tensor:
        """The buffer y back to tokens [T, O] in y's dtype, summed in ``order``
        (:func:`fmoe.ops.orders.combine_in_order`)."""
        return combine_in_order(y, routing, self.layout, order, weighted=weighted)

    # ---- float kernels over the layout
    def _float_mm(self, x: Tensor, w: Tensor, transposed: bool) -> Tensor:
        if self.layout.kind == "ragged":
            return _ragged.ragged_mm(x, w, self.layout.offsets, transposed=transposed)
        if not transposed and torch.is_grad_enabled() and w.requires_grad and grad_in_storage_order(w):
            return _StorageOrderBmm.apply(x, w)
        return torch.bmm(x, w.transpose(1, 2) if transposed else w)

    def wgrad(self, a: Tensor, b: Tensor) -> Tensor:
        """Per-expert ``a_e^T b_e`` over the layout's rows: [E, P, Q] from a [.., P], b [.., Q].

        Padded buffers: rows past an expert's filled rows must be zero in a or b (they are in
        the pipeline: dispatch leaves them zero and combine sends them zero gradient)."""
        if self.layout.kind == "ragged":
            return _ragged.ragged_wgrad(a, b, self.layout.offsets)
        return torch.bmm(a.transpose(1, 2), b)

    def mm(self, x: Tensor, w, *, transposed: bool = False, bias: Optional[Tensor] = None) -> Tensor:
        """``x_e @ op(w[e]) (+ bias[e])`` for every expert e over the layout's rows; in x's dtype.

        Args:
            x: [E, C, K] (padded) or [R, K] (ragged).
            w: float [E, K, N] (``transposed=False``) or [E, N, K] (``transposed=True``),
                or a QuantizedTensor [E, N, K] (``transposed`` is then ignored).
            bias: [E, N] or None (:meth:`bias`).
        Returns:
            [E, C, N] or [R, N]; rows that hold no pair are 0 (or, with a bias, padded rows
            their expert's bias and ragged padding rows 0).
        """
        if not isinstance(w, Tensor):
            y = self._quantized_mm(x, w)
        elif self.precision is not None:
            from ..quant import training as _qt  # optional: quantized training recipes
            y = _qt.quantized_mm(x, w.to(x.dtype), self.precision, transposed=transposed, mm=self._float_mm,
                                 wgrad=self.wgrad, generator=self.generator)
        else:
            y = self._float_mm(x, w.to(x.dtype), transposed)
        return y if bias is None else y + self.bias(bias, y)

    def _quantized_mm(self, x: Tensor, w) -> Tensor:
        from .. import quant  # optional: low-precision weights
        lay = self.layout
        if lay.kind == "padded":
            return quant.expert_matmul(x, w).to(x.dtype)
        # Ragged rows: one fused low-precision call per busy expert on its row slice; on the CPU,
        # where the groups tile rows 0..end (the ragged layout's own starts), one native call for all.
        out = x.new_zeros(x.shape[0], w.logical_shape[1])
        starts, sizes = lay.starts.tolist(), lay.sizes.tolist()
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
