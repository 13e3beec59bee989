"""The expert plan: what every expert kind needs to know about one routing, built once.

    plan = make_plan(routing, needs_grad=True, dtype=torch.float32)
    print(plan)   # ExpertPlan(T=64, E=8, rows=128, busy=8, max_rows=23, phase=train, float32, cpu)

A rows plan (:class:`ExpertPlan`: eager calls, torch.compile's custom op, each rank of an
expert-parallel call) lists the kept (token, expert) pairs sorted by expert
(capacity honoured, dropped pairs absent): ``tokens [N]`` (the token of each row), ``pairs
[N]`` (the flat pair index ``j * T + t``, which gathers the row's gate weight) and the expert
bounds, both as host ints (the kernels' loop bounds) and as an int64 ``offsets [E + 1]``
tensor (their argument); ``experts [N]``, the expert of each row, is made on first use. Rows
in a plan are exactly the rows of :func:`fmoe.make_layout` (routing, 'ragged'); tests check it.

A layout plan (:class:`LayoutPlan`, ``make_plan(..., layout=)``: under forward-mode AD and a
second derivative under torch.func, and wherever Tutel's buffer arithmetic is asked for) holds the routing and its
:class:`~fmoe.Layout` instead: static buffer shapes, no host bounds, phase 'traced'.

Either plan names the call's phase, dtype and precision: the key by which
:mod:`fmoe.engine.table` picks the kernel.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Union

import torch
from torch import Tensor

from .. import _slots
from ..layout import Layout
from ..routing import Routing

__all__ = ["PHASES", "TRACED", "DECODE_ROWS", "ExpertPlan", "LayoutPlan", "make_plan", "plan_from_bounds", "phase_of", "kept_rows"]

PHASES = ("train", "prefill", "decode")
TRACED = "traced"   # the phase of a layout plan

# Inference calls whose busy experts hold at most this many rows on average are 'decode':
# their GEMMs read each busy expert's weights for a handful of rows, so the kernel is bound
# by the weight stream and runs experts side by side instead of one threaded GEMM each. At
# 16 rows an fp32 [512 x 512] expert is 16 MFLOP against 1 MiB read, near the crossover
# of a 2-core host's GEMM rate and memory stream (both measured in BENCHMARKS.md).
DECODE_ROWS = 16


def phase_of(needs_grad: bool, rows: int, busy: int) -> str:
    """'train' (a gradient will be taken), else 'decode' (at most :data:`DECODE_ROWS` rows per
    busy expert on average) or 'prefill'."""
    if needs_grad:
        return "train"
    return "decode" if rows <= DECODE_ROWS * max(busy, 1) else "prefill"


@dataclasses.dataclass(frozen=True, eq=False)
class ExpertPlan:
    """A rows plan: the kept pairs of one routing sorted by expert, and the call's kernel key.

    Attributes:
        tokens: int64 [N]. Token of each row (rows sorted by expert, then slot).
        pairs: int64 [N]. Flat pair index ``j * T + t`` of each row.
        offsets: int64 [E + 1], on tokens' device. Expert e owns rows ``offsets[e]:offsets[e+1]``.
        bounds: the same E + 1 offsets as host ints.
        num_tokens: T.
        dropped: int64 [] pairs lost to capacity (None where unknown).
        phase: one of :data:`PHASES`.
        dtype: the compute dtype of the expert GEMMs.
        precision: None (float GEMMs) or a quantized-training recipe.
        num_slots: k, the routing's pairs per token (the bound on a token's rows); 0 where unknown.
    """

    tokens: Tensor
    pairs: Tensor
    offsets: Tensor
    bounds: tuple
    num_tokens: int
    dropped: Optional[Tensor] = None
    phase: str = "train"
    dtype: torch.dtype = torch.float32
    precision: Any = None
    num_slots: int = 0

    @property
    def num_experts(self) -> int:
        return len(self.bounds) - 1

    @property
    def num_rows(self) -> int:
        """Rows the expert GEMMs see: N kept pairs."""
        return self.bounds[-1]

    @functools.cached_property
    def experts(self) -> Tensor:
        """int64 [N]: the expert of each row (per-expert biases; made on first use, since
        bias-free kinds never need it)."""
        # row r belongs to the expert whose bounds hold it: the count of ends offsets[1:] <= r
        return torch.searchsorted(self.offsets[1:], torch.arange(self.num_rows, device=self.device), right=True)

    def row_weights(self, weights: Tensor) -> Tensor:
        """The gate weight of each row: [N] from the routing's [k, T] ``weights``."""
        return weights.reshape(-1).index_select(0, self.pairs)

    @property
    def sizes(self) -> list:
        """Rows per expert (host ints)."""
        b = self.bounds
        return [b[e + 1] - b[e] for e in range(len(b) - 1)]

    @property
    def busy(self) -> int:
        """Experts with at least one row."""
        return sum(1 for n in self.sizes if n)

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def __repr__(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        sizes = self.sizes
        return (f"ExpertPlan(T={self.num_tokens}, E={self.num_experts}, rows={self.num_rows}, busy={self.busy}, "
                f"max_rows={max(sizes, default=0)}, phase={self.phase}, {dt}, "
                f"{self.device.type}" + ("" if self.precision is None else f", precision={self.precision}") + ")")


@dataclasses.dataclass(frozen=True, eq=False)
class LayoutPlan:
    """A layout plan: one routing and its :class:`~fmoe.Layout` (static buffer shapes, no host
    row counts), whose GEMMs run over the layout's whole buffers; its phase is :data:`TRACED`.

    Attributes:
        routing: the :class:`~fmoe.Routing`; None for a bare layout's GEMMs
            (:meth:`fmoe.engine.GroupedGemm.over`: no dispatch, combine or token count).
        layout: :func:`fmoe.make_layout` of it, padded or ragged.
        dtype, precision: as :class:`ExpertPlan`'s.
    """

    routing: Optional[Routing]
    layout: Layout
    dtype: torch.dtype = torch.float32
    precision: Any = None
    phase = TRACED

    @property
    def num_tokens(self) -> int:
        return self.routing.num_tokens

    @property
    def num_experts(self) -> int:
        return self.layout.num_experts

    @property
    def num_rows(self) -> int:
        """The layout's static buffer rows."""
        return self.layout.num_rows

    @property
    def dropped(self) -> Tensor:
        return self.routing.num_dropped()

    @property
    def sizes(self):
        raise ValueError("a layout plan has no host row counts (its buffers have static shapes)")

    def row_weights(self, weights: Tensor) -> Tensor:
        """The kernels read the routing's [k, T] ``weights`` through the layout's positions."""
        return weights

    @property
    def device(self) -> torch.device:
        return self.layout.positions.device

    def __repr__(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        return (f"LayoutPlan(T={self.num_tokens}, E={self.num_experts}, layout={self.layout.kind}, "
                f"rows={self.num_rows}, phase={self.phase}, {dt}, {self.device.type}"
                + ("" if self.precision is None else f", precision={self.precision}") + ")")


def _walk_cpu(ids: Tensor, slots: Tensor, counts: Tensor, C: int) -> tuple[Tensor, Tensor, tuple, Tensor, Tensor]:
    # One numba walk over the pairs replaces the ragged layout's two dozen small ops (about
    # 0.15-0.3 ms of a decode call at T 16, E 32-64). Returns (tokens, pairs, bounds, dropped,
    # offsets): the walk writes the offsets tensor too.
    k, T = ids.shape
    E = counts.shape[0]
    out, pairs = torch.empty(E + 2 + k * T, dtype=torch.int64), torch.empty(k * T, dtype=torch.int64)
    a, host = _slots.int64_array, out.numpy()
    N = _slots.kept_rows_walk(a(ids), a(slots), a(counts), C, host, pairs.numpy())
    if N < 0:
        raise ValueError(f"make_plan: the routing's counts disagree with its slots: {_slots.KEPT_ROWS_ERRORS[N]}")
    # (numpy reads the bounds; a torch slice costs a microsecond each)
    return (out[E + 2:E + 2 + N], pairs if N == k * T else pairs[:N], tuple(host[:E + 1].tolist()), out[E + 1],
            out[:E + 1])


def _rows_cpu(ids: Tensor, slots: Tensor, counts: Tensor, C: int) -> tuple[Tensor, Tensor, tuple, Tensor]:
    return _walk_cpu(ids, slots, counts, C)[:4]


def _rows_torch(ids: Tensor, slots: Tensor, counts: Tensor, C: int) -> tuple[Tensor, Tensor, tuple, Tensor]:
    # Ragged rows run in (expert, slot) order, which is the order of the padded rows
    # e * C + slot: sorting the kept pairs by that key gives them.
    kept = ((ids >= 0) & (slots < C)).reshape(-1)
    pairs = torch.nonzero(kept).squeeze(1)
    key = (ids * C + slots).reshape(-1).index_select(0, pairs)
    pairs = pairs.index_select(0, torch.argsort(key, stable=True))
    bounds = [0]
    for n in counts.clamp(max=C).tolist():
        bounds.append(bounds[-1] + n)
    dropped = ((ids >= 0) & (slots >= C)).sum()
    return pairs.remainder(ids.shape[1]), pairs, tuple(bounds), dropped


def rows_reference(routing: Routing) -> tuple[Tensor, Tensor, tuple, Tensor]:
    """(tokens, pairs, bounds, dropped) in torch ops: the reference of the CPU walk, and the
    path off the CPU."""
    return _rows_torch(routing.expert_ids, routing.slots, routing.counts, routing.capacity)


def kept_rows(expert_ids: Tensor, slots: Tensor, counts: Tensor, capacity: int) -> tuple[Tensor, Tensor, tuple, Tensor]:
    """(tokens [N], pairs [N], bounds (E + 1 host ints), dropped []) of a routing given as its
    tensors (``expert_ids``/``slots`` int64 [k, T], ``counts`` int64 [E]) and capacity: the kept
    pairs sorted by expert, one host sync."""
    if expert_ids.device.type == "cpu":
        return _rows_cpu(expert_ids, slots, counts, capacity)
    return _rows_torch(expert_ids, slots, counts, capacity)


def plan_from_bounds(tokens: Tensor, pairs: Tensor, bounds, num_tokens: int, *, needs_grad: bool,
                     dtype: torch.dtype, precision=None, dropped: Optional[Tensor] = None,
                     num_slots: int = 0) -> ExpertPlan:
    """An :class:`ExpertPlan` from rows already sorted by expert (bounds: E + 1 host ints;
    ``num_slots``: the routing's k where known)."""
    bounds = tuple(int(b) for b in bounds)
    if len(bounds) < 2 or bounds[0] != 0 or any(b1 < b0 for b0, b1 in zip(bounds, bounds[1:])):
        raise ValueError(f"plan bounds must start at 0 and never decrease, got {bounds[:8]}...")
    if tokens.shape != (bounds[-1],) or pairs.shape != (bounds[-1],):
        raise ValueError(f"plan tokens and pairs must be int64 [N] with N={bounds[-1]} (the last bound), got "
                         f"{tuple(tokens.shape)} and {tuple(pairs.shape)}")
    busy = sum(1 for b0, b1 in zip(bounds, bounds[1:]) if b1 > b0)
    offsets = torch.tensor(bounds, dtype=torch.int64, device=tokens.device)
    return ExpertPlan(tokens, pairs, offsets, bounds, num_tokens, dropped, phase_of(needs_grad, bounds[-1], busy),
                      dtype, precision, num_slots)


def make_plan(routing: Routing, *, needs_grad: bool, dtype: torch.dtype, precision=None,
              layout: Optional[Layout] = None) -> Union[ExpertPlan, LayoutPlan]:
    """The plan of ``routing``: its kept pairs sorted by expert (one host sync), or with
    ``layout`` a layout plan (no host sync: the layout kernels over the layout's buffers).

    Args:
        routing: any :class:`~fmoe.Routing` (capacity honoured: pairs past it are dropped).
        needs_grad: a gradient will be taken through the experts (phase 'train').
        dtype: the expert GEMMs' compute dtype.
        precision: the quantized-training recipe, or None.
        layout: :func:`fmoe.make_layout` of ``routing``, for a layout plan.
    Raises:
        ValueError for a routing whose counts disagree with its slots (a hand-made one).
    """
    if not isinstance(routing, Routing):
        raise TypeError(f"make_plan: routing must be a fmoe.Routing, got {type(routing).__name__}")
    if layout is not None:
        return LayoutPlan(routing, layout, dtype, precision)
    if routing.expert_ids.device.type != "cpu":
        tokens, pairs, bounds, dropped = _rows_torch(routing.expert_ids, routing.slots, routing.counts,
                                                     routing.capacity)
        return plan_from_bounds(tokens, pairs, bounds, routing.num_tokens, needs_grad=needs_grad, dtype=dtype,
                                precision=precision, dropped=dropped, num_slots=routing.k)
    # the walk's bounds are valid by construction and it wrote the offsets tensor: the plan
    # without plan_from_bounds' checks and copy (a tenth of a small decode call's host time)
    tokens, pairs, bounds, dropped, offsets = _walk_cpu(routing.expert_ids, routing.slots, routing.counts,
                                                        routing.capacity)
    busy = len(set(bounds)) - 1   # the bounds start at 0 and never decrease: one new value per busy expert
    return ExpertPlan(tokens, pairs, offsets, bounds, routing.num_tokens, dropped,
                      phase_of(needs_grad, bounds[-1], busy), dtype, precision, routing.k)
