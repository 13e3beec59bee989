"""The MoE data-movement primitives over a :class:`~fmoe.Routing`.

* ``dispatch(x, routing, layout=)``: tokens [T, M] -> expert buffers, padded [E, C, M]
  (Tutel's encode) or ragged [R, M] (pairs sorted by expert)
* ``combine(y, routing, layout=)``: expert buffers -> tokens [T, M] (Tutel's decode)
* ``gate_grad(a, b, routing, layout=)``: [k, T] inner products, the gate-weight gradient

All three are one op over flat rows and a position map (:mod:`fmoe.layout`), so both layouts
share the same kernels, references and derivative rules.

Each is differentiable to any order and works under ``torch.func`` transforms
and ``torch.compile(fullgraph=True)``; see :mod:`fmoe.ops.primitives`.
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from ..layout import Layout, padded_layout
from ..routing import Routing
from . import reference
from .primitives import combine_raw, dispatch_raw, gate_grad_raw
from . import numba_cpu  # registers the numba kernels as the ops' CPU implementation
from . import cuda  # registers the native kernels as the ops' CUDA implementation


def _check_tokens(name: str, x: Tensor, routing: Routing) -> None:
    if not isinstance(routing, Routing):
        raise TypeError(f"{name}: routing must be a fmoe.Routing, got {type(routing).__name__}")
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise TypeError(f"{name}: input must be a floating-point tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")


def check_dispatch_input(x: Tensor, routing: Routing) -> None:
    """:func:`dispatch`'s checks of its tokens x [T, M] against the routing (also run by the
    expert-parallel exchange that reads x's rows without dispatching them)."""
    _check_tokens("dispatch", x, routing)
    if x.dim() != 2 or x.shape[0] != routing.num_tokens:
        raise ValueError(f"dispatch: x must be [T, M] with T={routing.num_tokens} (routing's tokens), "
                         f"got shape {tuple(x.shape)}")


def _layout(routing: Routing, layout: Optional[Layout]) -> Layout:
    if layout is None:
        return padded_layout(routing)
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a fmoe.Layout (fmoe.make_layout(routing, kind)), got {type(layout).__name__}")
    if layout.num_experts != routing.num_experts or tuple(layout.positions.shape) != tuple(routing.expert_ids.shape):
        raise ValueError(f"layout is for E={layout.num_experts}, pairs {tuple(layout.positions.shape)}; routing has "
                         f"E={routing.num_experts}, pairs {tuple(routing.expert_ids.shape)}")
    return layout


def dispatch(x: Tensor, routing: Routing, *, weighted: bool = False, layout: Optional[Layout] = None) -> Tensor:
    """Scatter tokens into the experts' row buffer.

    Args:
        x: float [T, M] tokens.
        routing: from :func:`fmoe.top_k_routing` (or any router) over the same T tokens.
        weighted: multiply each copy by its gate (pre-score mode).
        layout: :func:`fmoe.make_layout` of ``routing``; default the padded layout.

    Returns:
        padded: [E, C, M], row ``(e, c)`` the token at slot c of expert e; ragged: [R, M],
        experts' rows back to back. x's dtype; zero where no pair lands. Dropped pairs are absent.
    """
    check_dispatch_input(x, routing)
    lay = _layout(routing, layout)
    w = routing.weights if weighted else None
    out = dispatch_raw(x, lay.positions, w, lay.num_rows)
    return out.reshape(lay.buffer_shape(x.shape[1]))


def _rows(name: str, arg: str, y: Tensor, lay: Layout) -> Tensor:
    want = lay.buffer_shape(-1)[:-1]
    if y.dim() != len(want) + 1 or tuple(y.shape[:-1]) != want:
        dims = "[E, C, M]" if lay.kind == "padded" else "[R, M]"
        raise ValueError(f"{name}: {arg} must be {dims} = [{', '.join(map(str, want))}, M] ({lay.kind} layout), "
                         f"got shape {tuple(y.shape)}")
    return y.reshape(lay.num_rows, y.shape[-1])


def combine(y: Tensor, routing: Routing, *, weighted: bool = True, layout: Optional[Layout] = None) -> Tensor:
    """Gather expert outputs back to tokens, summing the k slots in order.

    Args:
        y: float expert outputs in the layout: [E, C, M] (padded) or [R, M] (ragged).
        routing: the routing that produced the buffers.
        weighted: multiply each slot by its gate (post-score mode).
        layout: the layout used by :func:`dispatch` (default padded).

    Returns:
        [T, M] in y's dtype; tokens whose every slot was dropped are 0.
    """
    _check_tokens("combine", y, routing)
    lay = _layout(routing, layout)
    w = routing.weights if weighted else None
    return combine_raw(_rows("combine", "y", y, lay), lay.positions, w)


def gate_grad(a: Tensor, b: Tensor, routing: Routing, *, layout: Optional[Layout] = None) -> Tensor:
    """g[j, t] = <a[t], b[row of pair (j, t)]> for kept pairs, 0 for dropped ones.

    Args:
        a: float [T, M]. b: float [E, C, M] (padded) or [R, M] (ragged).
    Returns:
        [k, T] in a's dtype.
    """
    _check_tokens("gate_grad", a, routing)
    lay = _layout(routing, layout)
    return gate_grad_raw(a, _rows("gate_grad", "b", b, lay), lay.positions)
