"""The two transformers combine orders, over either layout (architectures.md §1.3, §11).

:func:`fmoe.combine` (MoESpec.combine='fmoe') sums the k slots in fp32 and casts once. These
two reproduce transformers' own accumulation orders (the same products, roundings and order
of additions), so an architecture block matches a transformers block bit for bit wherever its
expert GEMMs are the same calls too (see :mod:`fmoe.models.common`):

* ``eager_combine`` — transformers' eager expert loop: each (token, slot) product ``y * w`` is
  formed with torch type promotion (dt x dt -> dt for Qwen/GPT-OSS, dt x fp32 -> fp32 for
  DeepSeek/Mixtral), cast to dt, and added to the token's output in dt, experts in ascending
  id order.
* ``grouped_combine`` — transformers' grouped_mm / batched_mm back-ends: the weight applied per
  row with torch promotion first, then :func:`fmoe.combine`'s fp32 sum over k and one cast.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..layout import Layout
from ..routing import Routing
from . import combine as _combine
from .reference import compute_dtype as _compute_dtype


COMBINES = ("fmoe", "eager", "grouped")


def _rows(y: Tensor, layout: Layout) -> Tensor:
    return y.reshape(layout.num_rows, y.shape[-1])


def eager_combine(y: Tensor, routing: Routing, layout: Layout, out_dtype: torch.dtype) -> Tensor:
    """transformers' eager accumulation order, vectorised.

    The eager loop visits experts in ascending id and index_adds ``(y * w).to(dt)``; a token
    never meets the same expert twice, so its output is the dt running sum of its k
    contributions sorted by expert id. Masked or dropped pairs contribute nothing.

    Args:
        y: expert outputs in the layout ([E, C, H] or [R, H]) in dt. routing, layout: those
            that filled the buffers. out_dtype: dt.
    Returns:
        [T, H] in out_dtype.
    """
    pos = layout.positions                                  # [k, T], -1 when not kept
    rows = _rows(y, layout)[pos.clamp(min=0)]               # [k, T, H]
    # Promotion as in transformers: dt*dt stays dt, dt*fp32 becomes fp32, then one cast.
    contrib = (rows * routing.weights.unsqueeze(-1)).to(out_dtype)
    contrib = torch.where((pos >= 0).unsqueeze(-1), contrib, torch.zeros((), dtype=out_dtype, device=y.device))
    key = torch.where(routing.expert_ids >= 0, routing.expert_ids, torch.full_like(routing.expert_ids, -1))
    order = torch.argsort(key, dim=0, stable=True)         # [k, T]
    contrib = contrib.gather(0, order.unsqueeze(-1).expand_as(contrib))
    out = contrib[0]
    for j in range(1, contrib.shape[0]):
        out = out + contrib[j]   # one dt rounding per expert, like index_add_
    return out


def grouped_combine(y: Tensor, routing: Routing, layout: Layout, out_dtype: torch.dtype) -> Tensor:
    """transformers' grouped_mm / batched_mm order through :func:`fmoe.combine`.

    Each buffer row holds exactly one (token, slot) pair, so the routing weight is applied
    per row with torch promotion first (a bf16 x bf16 product is rounded to bf16, as those
    back-ends do), then fmoe's combine sums the k slots in fp32 and the result is cast once.

    Args:
        y: expert outputs in the layout (dt). routing, layout: as dispatched. out_dtype: dt.
    Returns:
        [T, H] in out_dtype.
    """
    w = routing.weights
    if (w.dtype in (torch.float32, torch.float64) and out_dtype == y.dtype
            and torch.promote_types(y.dtype, w.dtype) == w.dtype == _compute_dtype(y.dtype)):
        # The per-row product y * w is formed in w's dtype, which is also combine's compute
        # dtype: combine's weighted sum forms the same products and sums them in the same
        # order, then casts once to dt (fp32 experts; fp32 weights on bf16 experts): the same
        # result without the weighted copy of the buffer.
        return _combine(y, routing, weighted=True, layout=layout)
    R = layout.num_rows
    pos = layout.positions.reshape(-1)
    w = w.reshape(-1)
    # Row R is a bin for masked pairs; kept positions are unique so index_copy is a scatter.
    w_rows = torch.zeros(R + 1, dtype=w.dtype, device=w.device).index_copy(
        0, torch.where(pos >= 0, pos, torch.full_like(pos, R)), w)[:R]
    weighted = _rows(y, layout) * w_rows.unsqueeze(1)
    return _combine(weighted.reshape(y.shape), routing, weighted=False, layout=layout).to(out_dtype)


def combine_in_order(y: Tensor, routing: Routing, layout: Layout, order: str = "fmoe", *, weighted: bool = True) -> Tensor:
    """The layout's buffer y back to tokens [T, O] in y's dtype, summed in ``order``: 'fmoe'
    (:func:`fmoe.combine`, gate-weighted unless ``weighted=False``), 'eager' or 'grouped'
    (transformers' orders above, always gate-weighted)."""
    if order == "eager":
        return eager_combine(y, routing, layout, y.dtype)
    if order == "grouped":
        return grouped_combine(y, routing, layout, y.dtype)
    if order != "fmoe":
        raise ValueError(f"order must be one of {COMBINES}, got {order!r}")
    return _combine(y, routing, weighted=weighted, layout=layout)
