"""Expert weights held as transposed views of contiguous storage.

``fmoe.nn.MoELayer`` keeps its gated weights out x in (nn.Linear's order) and hands out x @ W
views of them. The kernels recognise such a weight (:func:`stored_transposed`) and read the
storage as it lies. Their backward passes produce its gradient in the storage's order
(:func:`weight_grad`), so the Parameter's AccumulateGrad keeps that gradient without copying
it into the Parameter's strides. That copy cost 34-54 ms of a fine-grained staged training
step (2026-12-01).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from .primitives import PLAIN_TENSORS


def stored_transposed(w: Tensor) -> bool:
    """w [..., a, b] is a transposed view (last two dims) of a contiguous [..., b, a] tensor."""
    return not w.is_contiguous() and w.transpose(-1, -2).is_contiguous()


def grad_in_storage_order(w: Tensor) -> bool:
    """w is such a view, and its gradient is to come out in the storage's order.

    Only in eager reverse-mode autograd: functorch's wrapped tensors and torch.compile's fakes
    keep strides of their own, and no AccumulateGrad runs under transforms.
    """
    return (type(w) in PLAIN_TENSORS and not torch.compiler.is_compiling()
            and torch._C._functorch.maybe_current_level() is None
            and torch.autograd.forward_ad._current_level < 0 and stored_transposed(w))


def weight_grad(wgrad: Callable[[Tensor, Tensor], Tensor], x: Tensor, gy: Tensor, transposed: bool,
                in_storage_order: bool) -> Tensor:
    """Gradient of ``y = x @ op(w)`` w.r.t. w, from per-expert ``wgrad(a, b) = aᵀ b``.

    Without ``in_storage_order`` it is made contiguous in w's own shape: xᵀ gy for [.., K, N],
    gyᵀ x for [.., N, K] with ``transposed``. With it, w is a transposed view of contiguous
    storage: the storage's gradient is made (the other product) and viewed back as w.
    """
    gw = wgrad(gy, x) if transposed != in_storage_order else wgrad(x, gy)
    return gw.transpose(-1, -2) if in_storage_order else gw
