"""Where each kept (slot, token) pair lives in the experts' row buffer: the padded and the ragged layout.

One :class:`~fmoe.Routing` gives either layout; both are a flat row buffer [R, M] in which
expert e owns the rows ``starts[e] .. starts[e] + sizes[e]``:

* **padded** (Tutel's ``[E, C, M]``, slot-major): row ``e * C + slot``; R = E * C; expert e's
  filled rows are ``min(counts[e], C)``, the rest of its C rows are zero padding. Bit-exact
  with Tutel's encode/decode; used whenever capacity is finite.
* **ragged** (tokens sorted by expert, no padding between experts): row ``offsets[e] + slot``
  with ``offsets = [0, cumsum(min(counts, C))]``; within an expert the pairs keep the
  slot-major order of the padded layout. R = k * T is a static bound (memory ∝ k·T), so the
  buffer shape never depends on the data: no host synchronisation, and the layout composes
  with ``vmap`` and ``torch.compile``. Rows ``offsets[E] .. R`` (masked or dropped pairs) are
  zero and never multiplied. The default for dropless routing.

Everything here is pure torch on the routing's tensors (a cumsum and an add), so a layout is
as cheap as ``routing.positions()`` and differentiates like the routing does (not at all:
positions are integers).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from .routing import Routing

__all__ = ["Layout", "LAYOUTS", "make_layout", "padded_layout", "ragged_layout"]

LAYOUTS = ("padded", "ragged")


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
    """Frozen dispatch metadata for one routing (a pytree; ``kind``/``num_rows``/... are static).

    Attributes:
        positions: int64 [k, T]. Buffer row of pair (j, t), -1 where the pair is not kept.
        starts: int64 [E]. First row of expert e.
        sizes: int64 [E]. Rows of expert e that hold pairs (``min(counts, C)``).
        kind: 'padded' or 'ragged'.
        num_rows: static R, rows of the buffer.
        num_experts: static E.
        capacity: static C of the routing (the padded layout's rows per expert).
    """

    positions: Tensor
    starts: Tensor
    sizes: Tensor
    kind: str
    num_rows: int
    num_experts: int
    capacity: int

    @property
    def offsets(self) -> Tensor:
        """int64 [E + 1] ragged group boundaries (``starts`` then the end of the last group).

        Only meaningful for the ragged layout, where the groups are contiguous."""
        if self.kind != "ragged":
            raise ValueError("offsets exist for the ragged layout only; the padded layout has starts e*C")
        # narrow, not [-1:]: the same values, and a form fake CUDA tensors of a CPU-only torch take
        last = min(1, self.starts.shape[0])
        end = self.starts.shape[0] - last
        return torch.cat([self.starts, self.starts.narrow(0, end, last) + self.sizes.narrow(0, end, last)])

    def buffer_shape(self, features: int) -> tuple:
        """Shape of the dispatch buffer with ``features`` columns: (E, C, M) or (R, M)."""
        if self.kind == "padded":
            return (self.num_experts, self.capacity, features)
        return (self.num_rows, features)


_LEAVES = ("positions", "starts", "sizes")


def _ctx(lay: Layout):
    return (lay.kind, lay.num_rows, lay.num_experts, lay.capacity)


pytree.register_pytree_node(
    Layout,
    lambda lay: ([getattr(lay, n) for n in _LEAVES], _ctx(lay)),
    lambda leaves, c: Layout(*leaves, *c),
    serialized_type_name="fmoe.layout.Layout",
    flatten_with_keys_fn=lambda lay: ([(pytree.GetAttrKey(n), getattr(lay, n)) for n in _LEAVES], _ctx(lay)),
)


def _sizes(routing: Routing) -> Tensor:
    return routing.counts.clamp(max=routing.capacity).to(torch.int64)


def _layout(routing: Routing, kind: str, starts: Tensor, sizes: Tensor, num_rows: int) -> Layout:
    # both layouts put pair (j, t) at its expert's first row plus its slot
    ids = routing.expert_ids
    pos = starts.gather(0, ids.clamp(min=0).reshape(-1)).reshape(ids.shape) + routing.slots
    pos = torch.where(routing.kept(), pos, torch.full_like(pos, -1))
    return Layout(pos, starts, sizes, kind, num_rows, routing.num_experts, routing.capacity)


def padded_layout(routing: Routing) -> Layout:
    """Tutel's slot-major [E, C, M] layout: row ``e * C + slot``."""
    E, C = routing.num_experts, routing.capacity
    starts = torch.arange(E, device=routing.counts.device, dtype=torch.int64) * C
    return _layout(routing, "padded", starts, _sizes(routing), E * C)


def ragged_layout(routing: Routing) -> Layout:
    """Pairs sorted by expert, no padding rows: row ``offsets[e] + slot``, R = k * T."""
    sizes = _sizes(routing)
    return _layout(routing, "ragged", torch.cumsum(sizes, 0) - sizes, sizes, routing.k * routing.num_tokens)


def make_layout(routing: Routing, kind: str) -> Layout:
    """The layout called ``kind`` ('padded' | 'ragged') of ``routing``."""
    if kind == "padded":
        return padded_layout(routing)
    if kind == "ragged":
        return ragged_layout(routing)
    raise ValueError(f"unknown layout {kind!r}; expected one of {LAYOUTS}")
