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

A device rows plan (``bounds`` None; :func:`make_plan` off the CPU wherever the table's grouped
kernel runs the call: float32/bfloat16/float16, no quantized-training recipe) is built with no
host sync. Its rows are the static bound k*T: the kept pairs sorted by (expert, slot) first,
exactly a host plan's rows, then every pair that is not kept (id < 0 or slot >= capacity),
the "dead rows", in pair order. ``offsets`` come from the sorted keys on the device
(``offsets[E]`` = the kept rows); the kernels that take such a plan (:attr:`Kernel.static_rows
<fmoe.engine.table.Kernel>`) write zeros into dead rows and read none of them in a weight
gradient, and :meth:`ExpertPlan.row_weights` gives them gate weight 0 (so no gradient reaches a
dropped pair). Its phase comes from the static shapes: 'train' when a gradient is taken, else
'decode' where ``k*T / min(E, k*T) <= DECODE_ROWS`` (every pair kept, spread over as many
experts as it can reach), 'prefill' otherwise. :meth:`ExpertPlan.on_host` gives the host plan
of the same rows (one host sync) to consumers that loop over experts in Python.

A layout plan (:class:`LayoutPlan`, ``make_plan(..., layout=)``: under forward-mode AD and a
second derivative under torch.func, and wherever Tutel's buffer arithmetic is asked for) holds the routing and its
:class:`~fmoe.Layout` instead: static buffer shapes, no host bounds, phase 'traced'.

Either plan names the call's phase, dtype and precision: the key by which
:mod:`fmoe.engine.table` picks the kernel.
"""
from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any, Optional, Union

import torch
from torch import Tensor

from .. import _slots
from ..layout import Layout
from ..routing import KeptRows, Routing


PHASES = ("train", "prefill", "decode")
TRACED = "traced"   # the phase of a layout plan

# Inference calls whose busy experts hold at most this many rows on average are 'decode':
# their GEMMs read each busy expert's weights for a handful of rows, so the kernel is bound
# by the weight stream and runs experts side by side instead of one threaded GEMM each. At
# 16 rows an fp32 [512 x 512] expert is 16 MFLOP against 1 MiB read, near the crossover
# of a 2-core host's GEMM rate and memory stream (both measured in BENCHMARKS.md).
DECODE_ROWS = 16

# The dtypes torch._grouped_mm multiplies (the table's 'cuda-grouped-mm' entry): a call in one
# of them, with no quantized-training recipe, runs on a device rows plan off the CPU.
GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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
        bounds: the same E + 1 offsets as host ints; None on a device plan (N = k*T rows, those
            past ``offsets[E]`` dead: see the module docstring).
        num_tokens: T.
        dropped: int64 [] pairs lost to capacity (None where unknown).
        phase: one of :data:`PHASES`.
        dtype: the compute dtype of the expert GEMMs.
        precision: None (float GEMMs) or a quantized-training recipe.
        num_slots: k, the routing's pairs per token (the bound on a token's rows); 0 where unknown.
        in_order: every row is its own token (``tokens`` is ``arange(T)``, N = T: expert
            parallel's received rows placed in expert order), so a product row needs no gather
            or scatter to reach its token.
    """

    tokens: Tensor
    pairs: Tensor
    offsets: Tensor
    bounds: Optional[tuple]
    num_tokens: int
    dropped: Optional[Tensor] = None
    phase: str = "train"
    dtype: torch.dtype = torch.float32
    precision: Any = None
    num_slots: int = 0
    in_order: bool = False

    @property
    def num_experts(self) -> int:
        return self.offsets.shape[0] - 1

    @property
    def num_rows(self) -> int:
        """Rows the expert GEMMs see: N kept pairs (a device plan: the bound k*T, dead rows included)."""
        return self.tokens.shape[0]

    @functools.cached_property
    def experts(self) -> Tensor:
        """int64 [N]: the expert of each row (per-expert biases; made on first use, since
        bias-free kinds never need it). A device plan's dead rows read the last expert (a valid
        index; their products are zeroed)."""
        # row r belongs to the expert whose bounds hold it: the count of ends offsets[1:] <= r
        E = self.num_experts
        ends = self.offsets.narrow(0, 1, E)
        expert = torch.searchsorted(ends, torch.arange(self.num_rows, device=self.device), right=True)
        return expert if self.bounds is not None else expert.clamp_(max=max(E - 1, 0))

    @functools.cached_property
    def dead(self) -> Optional[Tensor]:
        """bool [N]: a device plan's dead rows (row >= ``offsets[E]``, computed on the device);
        None on a host plan (every row kept)."""
        if self.bounds is not None:
            return None
        kept = self.offsets.narrow(0, self.num_experts, 1)
        return torch.arange(self.num_rows, device=self.device) >= kept

    def row_weights(self, weights: Tensor) -> Tensor:
        """The gate weight of each row: [N] from the routing's [k, T] ``weights`` (a device
        plan's dead rows 0, and no gradient through them)."""
        w = weights.reshape(-1).index_select(0, self.pairs)
        return w if self.bounds is not None else w.masked_fill(self.dead, 0)

    def on_host(self) -> "ExpertPlan":
        """This plan with host bounds: itself, or a device plan's kept rows (its first
        ``offsets[E]`` rows, the same order) with ``bounds`` read from its offsets: one host
        sync, for the consumers that loop over experts in Python (the per-expert kernels, packed
        weights, quantized-training recipes, custom experts). Its phase is the device plan's."""
        if self.bounds is not None:
            return self
        bounds = tuple(self.offsets.tolist())   # the one host sync
        N = bounds[-1]
        return ExpertPlan(self.tokens.narrow(0, 0, N), self.pairs.narrow(0, 0, N), self.offsets, bounds,
                          self.num_tokens, self.dropped, self.phase, self.dtype, self.precision, self.num_slots)

    def _host_bounds(self, what: str) -> tuple:
        if self.bounds is None:
            raise ValueError(f"ExpertPlan.{what}: a device rows plan keeps its row counts on the device (no host "
                             f"sync); take plan.on_host() (one host sync) for host row counts")
        return self.bounds

    @property
    def sizes(self) -> list:
        """Rows per expert (host ints; a device plan raises ValueError: :meth:`on_host`)."""
        return self._sizes("sizes")

    def _sizes(self, what: str) -> list:
        b = self._host_bounds(what)
        return [b[e + 1] - b[e] for e in range(len(b) - 1)]

    @property
    def busy(self) -> int:
        """Experts with at least one row (a device plan raises ValueError: :meth:`on_host`)."""
        b = self._host_bounds("busy")
        return sum(map(operator.lt, b, b[1:]))   # b[e] < b[e + 1]: expert e has rows (no list of sizes)

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def __repr__(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        counts = ("device bounds" if self.bounds is None else
                  f"busy={self.busy}, max_rows={max(self.sizes, default=0)}")
        return (f"ExpertPlan(T={self.num_tokens}, E={self.num_experts}, rows={self.num_rows}, {counts}, "
                f"phase={self.phase}, {dt}, "
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
    # One walk over the pairs (fmoe._slots: C++, numba where not built) replaces the ragged layout's
    # two dozen small ops (about 0.15-0.3 ms of a decode call at T 16, E 32-64). Returns (tokens,
    # pairs, bounds, dropped, offsets): the walk writes the offsets tensor too.
    k, T = ids.shape
    E = counts.shape[0]
    out, pairs = torch.empty(E + 2 + k * T, dtype=torch.int64), torch.empty(k * T, dtype=torch.int64)
    N = _slots.kept_rows(ids, slots, counts, C, out, pairs)
    host = out.numpy()
    if N < 0:
        raise ValueError(f"make_plan: the routing's counts disagree with its slots: {_slots.KEPT_ROWS_ERRORS[N]}")
    # (numpy reads the bounds; a torch slice costs a microsecond each: one split cuts the three views)
    offsets, dropped, tokens, _ = out.split_with_sizes((E + 1, 1, N, k * T - N))
    return tokens, pairs if N == k * T else pairs[:N], tuple(host[:E + 1].tolist()), dropped[0], offsets


def _rows_cpu(ids: Tensor, slots: Tensor, counts: Tensor, C: int) -> tuple[Tensor, Tensor, tuple, Tensor]:
    return _walk_cpu(ids, slots, counts, C)[:4]


def _rows_torch(ids: Tensor, slots: Tensor, counts: Tensor, C: int) -> tuple[Tensor, Tensor, tuple, Tensor]:
    # the device plan's kept rows with its offsets read once (one host sync)
    p = device_plan(ids, slots, counts.shape[0], C, needs_grad=True, dtype=torch.float32).on_host()
    return p.tokens, p.pairs, p.bounds, p.dropped


def device_rows_by_default(device: torch.device, dtype: torch.dtype, precision) -> bool:
    """Whether :func:`make_plan` (and the traced op) build a device rows plan for a call on
    ``device`` in ``dtype`` with ``precision``: where the table's 'cuda-grouped-mm' entry runs it
    (:func:`fmoe.engine.table._entry`)."""
    return device.type != "cpu" and precision is None and dtype in GROUPED_DTYPES and hasattr(torch, "_grouped_mm")


def device_plan(expert_ids: Tensor, slots: Tensor, num_experts: int, capacity: int, *, needs_grad: bool,
                dtype: torch.dtype, precision=None) -> ExpertPlan:
    """A device rows plan (no host sync) of a routing given as its tensors: ``expert_ids`` and
    ``slots`` int64 [k, T], E experts, capacity C. Its N = k*T rows: the kept pairs sorted by
    (expert, slot), then the dead rows (id < 0 or slot >= C) in pair order; ``bounds`` None;
    the phase from the static shapes (module docstring)."""
    k, T = expert_ids.shape
    E, C, N = num_experts, capacity, k * T
    kept = (expert_ids >= 0) & (slots < C)
    # a kept pair's key is its padded row e * C + slot (unique: the host plan's order); every
    # other pair's key E * C sorts after them, in pair order (a stable sort)
    key = torch.where(kept, expert_ids * C + slots, E * C).reshape(-1)
    key, pairs = torch.sort(key, stable=True)
    # offsets[e]: the kept pairs of experts below e, the sorted keys below e * C
    offsets = torch.searchsorted(key, torch.arange(E + 1, device=key.device) * C)
    dropped = ((expert_ids >= 0) & (slots >= C)).sum()
    return ExpertPlan(pairs.remainder(T), pairs, offsets, None, T, dropped, phase_of(needs_grad, N, min(E, N)), dtype,
                      precision, k)


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
                     num_slots: int = 0, in_order: bool = False) -> ExpertPlan:
    """An :class:`ExpertPlan` from rows already sorted by expert (bounds: E + 1 host ints;
    ``num_slots``: the routing's k where known; ``in_order``: ``tokens`` is ``arange(num_tokens)``,
    checked)."""
    bounds = tuple(int(b) for b in bounds)
    if len(bounds) < 2 or bounds[0] != 0 or any(b1 < b0 for b0, b1 in zip(bounds, bounds[1:])):
        raise ValueError(f"plan bounds must start at 0 and never decrease, got {bounds[:8]}...")
    if tokens.shape != (bounds[-1],) or pairs.shape != (bounds[-1],):
        raise ValueError(f"plan tokens and pairs must be int64 [N] with N={bounds[-1]} (the last bound), got "
                         f"{tuple(tokens.shape)} and {tuple(pairs.shape)}")
    if in_order and (num_tokens != bounds[-1] or not torch.equal(tokens, torch.arange(num_tokens,
                                                                                      device=tokens.device))):
        raise ValueError(f"plan_from_bounds: in_order=True needs tokens == arange(num_tokens) with num_tokens = N "
                         f"= {bounds[-1]}, got num_tokens={num_tokens} and other tokens")
    busy = sum(1 for b0, b1 in zip(bounds, bounds[1:]) if b1 > b0)
    offsets = torch.tensor(bounds, dtype=torch.int64, device=tokens.device)
    return ExpertPlan(tokens, pairs, offsets, bounds, num_tokens, dropped, phase_of(needs_grad, bounds[-1], busy),
                      dtype, precision, num_slots, in_order)


def make_plan(routing: Routing, *, needs_grad: bool, dtype: torch.dtype, precision=None,
              layout: Optional[Layout] = None, device_rows: Optional[bool] = None,
              rows: Optional[KeptRows] = None) -> Union[ExpertPlan, LayoutPlan]:
    """The plan of ``routing``: its kept pairs sorted by expert (one host sync; off the CPU a
    device rows plan, no host sync), or with ``layout`` a layout plan (no host sync: the layout
    kernels over the layout's buffers).

    Args:
        routing: any :class:`~fmoe.Routing` (capacity honoured: pairs past it are dropped).
        needs_grad: a gradient will be taken through the experts (phase 'train').
        dtype: the expert GEMMs' compute dtype.
        precision: the quantized-training recipe, or None.
        layout: :func:`fmoe.make_layout` of ``routing``, for a layout plan.
        device_rows: True for a device rows plan (:func:`device_plan`) on any device, False
            for host bounds; None: a device plan off the CPU where the table's grouped kernel
            runs the call (dtype in :data:`GROUPED_DTYPES`, no ``precision``).
        rows: the routing's :class:`~fmoe.routing.KeptRows`, made with it by the native route:
            a host-bounds plan takes them instead of walking the routing.
    Raises:
        ValueError for a routing whose counts disagree with its slots (a hand-made one).
    """
    if not isinstance(routing, Routing):
        raise TypeError(f"make_plan: routing must be a fmoe.Routing, got {type(routing).__name__}")
    if layout is not None:
        return LayoutPlan(routing, layout, dtype, precision)
    ids = routing.expert_ids
    if rows is not None and not device_rows:
        b = rows.bounds
        return ExpertPlan(rows.tokens, rows.pairs, rows.offsets, b, routing.num_tokens, rows.dropped,
                          phase_of(needs_grad, b[-1], len(set(b)) - 1), dtype, precision, routing.k)
    if device_rows or (device_rows is None and device_rows_by_default(ids.device, dtype, precision)):
        return device_plan(ids, routing.slots, routing.num_experts, routing.capacity, needs_grad=needs_grad,
                           dtype=dtype, precision=precision)
    if ids.device.type != "cpu":
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
