"""The MoE data-movement primitives over a :class:`~fmoe.Routing`.

* ``dispatch(x, routing)``: tokens [T, M] -> expert buffers [E, C, M] (Tutel's encode)
* ``combine(y, routing)``: expert buffers [E, C, M] -> tokens [T, M] (Tutel's decode)
* ``gate_grad(a, b, routing)``: [k, T] inner products, the gate-weight gradient

Each is differentiable to any order and works under ``torch.func`` transforms
and ``torch.compile(fullgraph=True)``; see :mod:`fmoe.ops.primitives`.
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from ..routing import Routing
from . import reference
from .primitives import combine_raw, dispatch_raw, gate_grad_raw
from . import numba_cpu  # registers the numba kernels as the ops' CPU implementation

__all__ = ["dispatch", "combine", "gate_grad", "reference", "numba_cpu", "dispatch_raw", "combine_raw", "gate_grad_raw"]


def _check_tokens(name: str, x: Tensor, routing: Routing) -> None:
    if not isinstance(routing, Routing):
        raise TypeError(f"{name}: routing must be a fmoe.Routing, got {type(routing).__name__}")
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise TypeError(f"{name}: input must be a floating-point tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")


def dispatch(x: Tensor, routing: Routing, *, weighted: bool = False, positions: Optional[Tensor] = None) -> Tensor:
    """Scatter tokens into per-expert capacity buffers.

    Args:
        x: float [T, M] tokens.
        routing: from :func:`fmoe.top_k_routing` over the same T tokens.
        weighted: multiply each copy by its gate (pre-score mode).
        positions: ``routing.positions()`` if the caller already has it (saves recomputing it).

    Returns:
        [E, C, M] in x's dtype; row ``(e, c)`` holds the token at slot c of
        expert e, zero where the slot is empty. Dropped pairs are absent.
    """
    _check_tokens("dispatch", x, routing)
    if x.dim() != 2 or x.shape[0] != routing.num_tokens:
        raise ValueError(f"dispatch: x must be [T, M] with T={routing.num_tokens} (routing's tokens), "
                         f"got shape {tuple(x.shape)}")
    E, C = routing.num_experts, routing.capacity
    w = routing.weights if weighted else None
    out = dispatch_raw(x, routing.positions() if positions is None else positions, w, E * C)
    return out.reshape(E, C, x.shape[1])


def combine(y: Tensor, routing: Routing, *, weighted: bool = True, positions: Optional[Tensor] = None) -> Tensor:
    """Gather expert outputs back to tokens, summing the k slots in order.

    Args:
        y: float [E, C, M] expert outputs.
        routing: the routing that produced the buffers.
        weighted: multiply each slot by its gate (post-score mode).
        positions: ``routing.positions()`` if the caller already has it.

    Returns:
        [T, M] in y's dtype; tokens whose every slot was dropped are 0.
    """
    _check_tokens("combine", y, routing)
    E, C = routing.num_experts, routing.capacity
    if y.dim() != 3 or y.shape[0] != E or y.shape[1] != C:
        raise ValueError(f"combine: y must be [E, C, M] = [{E}, {C}, M], got shape {tuple(y.shape)}")
    w = routing.weights if weighted else None
    pos = routing.positions() if positions is None else positions
    return combine_raw(y.reshape(E * C, y.shape[2]), pos, w)


def gate_grad(a: Tensor, b: Tensor, routing: Routing) -> Tensor:
    """g[j, t] = <a[t], b[e_j(t), c_j(t)]> for kept pairs, 0 for dropped ones.

    Args:
        a: float [T, M]. b: float [E, C, M].
    Returns:
        [k, T] in a's dtype.
    """
    _check_tokens("gate_grad", a, routing)
    E, C = routing.num_experts, routing.capacity
    if b.dim() != 3 or b.shape[:2] != (E, C):
        raise ValueError(f"gate_grad: b must be [E, C, M] = [{E}, {C}, M], got shape {tuple(b.shape)}")
    return gate_grad_raw(a, b.reshape(E * C, b.shape[2]), routing.positions())
