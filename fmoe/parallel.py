"""Expert parallelism: the expert stage of :func:`fmoe.moe` across ranks (spec §12).

    out = expert_parallel(spec.experts, local_expert_params, buffers, comm, parallel,
                          layout=layout, num_experts=E, output_dim=O)    # buffers' layout, O features

Placement (spec §12.1): with E >= W rank w owns experts [w*n, (w+1)*n), n = E/W.
With E < W, s = W/E ranks share one expert: rank w holds shard j = w % s of
expert w // s (hidden units [j*H/s, (j+1)*H/s); fc2 bias elements
[j*ceil(O/s), (j+1)*ceil(O/s)), zero-padded). :func:`shard_experts` cuts that
layout out of a full parameter pytree.

Parallel degree r (``ParallelSpec.mode``), switchable per call with the same
parameters (spec §12.3):

* r = 0: no all-to-all; every rank all-gathers every expert and runs them on
  its own buffers (ZeRO-3 style; gradients return by reduce-scatter).
* r >= 1 (r divides s): buffers are repeated r times along capacity, exchanged
  so that each group of g = s/r consecutive owners jointly holds one copy,
  each group all-gathers its hidden slice H/r, partial outputs come back and
  are summed over the r copies; the fc2 bias is added as bias/r per copy, i.e.
  exactly once. With s = 1 this is plain expert parallel on [n, W*C, M].

Overlap degree d chunks the capacity axis (each chunk: all-to-all, experts,
all-to-all back); ``local_size`` routes every all-to-all through the two-level
(2DH) exchange. Both give the same bytes as the plain path.

Ragged buffers (dropless, :mod:`fmoe.layout`) travel by all-to-all-v: rank w's experts own a
contiguous run of rows, so exactly the kept rows are sent (E >= W; r in {0, 1}; d = 1).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Callable, Optional

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from .comm.collectives import all_gather, all_to_all, all_to_all_v
from .comm import compress as _compress
from .comm import matching
from .comm.agreement import InconsistentRanksError, agree_across_ranks
from .comm.hierarchical import Hierarchical2DComm
from .comm.layout import plain
from .comm.registry import cache_of, calls_of, handle_of
from .engine import kinds as _kinds
from .engine import traced as _traced
from .engine.traced import door
from .engine.plan import plan_from_bounds
from .engine.table import select
from .experts import EXPERT_PARAMS, expert_form, shard_axes, sharding
from .layout import Layout, make_layout
from .routers import check_router_params
from .routing import _trusted_routing, check_finite
from .ops import check_dispatch_input, combine_raw, dispatch
from .ops.orders import combine_in_order

__all__ = ["ParallelSpec", "sharding", "shard_experts", "capacity_alignment", "expert_stage", "expert_parallel"]


@dataclasses.dataclass(frozen=True)
class ParallelSpec:
    """How the expert stage runs across ranks; pass one per call (nothing sticks).

    Attributes:
        mode: 'data' (r = 1), 'model' (r = s), 'adaptive:N' (r = N clamped to
            [0, s]; must be 0 or a divisor of s).
        overlap_degree: d in [1, 32]: chunks along capacity (spec §12.5).
        local_size: ranks per node for the 2DH all-to-all (None: flat).
        check: agree on a fingerprint of the static settings (and the step) before any data
            moves and raise :class:`InconsistentRanksError` on every rank if they differ; on
            fmoe's communicators the fingerprint rides on the call's first collective, and their
            ``checks="off"`` skips it whatever this says.
        wire: payload format of the dispatch and combine all-to-alls (and all-to-all-v for
            ragged rows): 'fp32' (the compute dtype, uncompressed), 'bf16', 'fp8' (E4M3 with
            per-row scales), 'fp8_block' (per-128 scales) or 'mxfp8'; scales travel with the
            data (:mod:`fmoe.comm.compress`).
        grad_wire: the backward all-to-alls' format (None: same as ``wire``).
    """

    mode: str = "adaptive:1"
    overlap_degree: int = 1
    local_size: Optional[int] = None
    check: bool = True
    wire: str = "fp32"
    grad_wire: Optional[str] = None

    def __post_init__(self):
        _parse_mode(self.mode)
        d = self.overlap_degree
        if isinstance(d, bool) or not isinstance(d, int) or not 1 <= d <= 32:
            raise ValueError(f"overlap_degree must be an int in [1, 32], got {d!r}")
        if self.local_size is not None and (not isinstance(self.local_size, int) or self.local_size < 1):
            raise ValueError(f"local_size must be a positive int or None, got {self.local_size!r}")
        object.__setattr__(self, "wire", _compress.wire_from_name(self.wire))
        if self.grad_wire is not None:
            object.__setattr__(self, "grad_wire", _compress.wire_from_name(self.grad_wire))

    @property
    def compressed(self) -> bool:
        return self.wire != "fp32" or self.grad_wire not in (None, "fp32")

    def degree(self, s: int) -> int:
        """The parallel degree r for sharding count s (validated)."""
        kind, n = _parse_mode(self.mode)
        r = 1 if kind == "data" else s if kind == "model" else min(max(n, 0), s)
        if r != 0 and s % r:
            raise ValueError(f"parallel mode {self.mode!r} gives r={r}, which is not 0 or a divisor of the "
                             f"sharding count s={s}; valid r: {[0] + [q for q in range(1, s + 1) if s % q == 0]}")
        return r


def _parse_mode(mode) -> tuple[str, int]:
    if mode in ("data", "model"):
        return mode, 0
    if isinstance(mode, str) and mode.startswith("adaptive:"):
        try:
            return "adaptive", int(mode.split(":", 1)[1])
        except ValueError:
            pass
    raise ValueError(f"parallel mode must be 'data', 'model' or 'adaptive:N' with an integer N, got {mode!r}")


def capacity_alignment(num_experts: int, world: int, parallel: Optional[ParallelSpec] = None,
                       base: int = 1) -> int:
    """Capacity multiple that keeps C divisible by s and by d (spec §7.2), combined with ``base``."""
    parallel = parallel or ParallelSpec()
    _, s = sharding(num_experts, world)
    return math.lcm(base, s * parallel.overlap_degree)


# --------------------------------------------------------------------------- placement

def _shard_leaf(t: Tensor, axis: int, s: int, j: int, padded: bool) -> Tensor:
    size = t.shape[axis]
    if padded:
        piece = -(-size // s)
        if piece * s != size:
            pad = [0, 0] * (t.dim() - 1 - axis) + [0, piece * s - size]
            t = torch.nn.functional.pad(t, pad)
    elif size % s:
        raise ValueError(f"cannot shard a dimension of size {size} over s={s} ranks (needs divisibility)")
    else:
        piece = size // s
    return t.narrow(axis, j * piece, piece)


def shard_experts(expert_type: str, params: dict, num_experts: int, rank: int, world: int) -> dict:
    """This rank's slice of a full expert pytree (every leaf [E, ...]), as laid out in spec §12.1."""
    n, s = sharding(num_experts, world)
    if s == 1:
        return pytree.tree_map(lambda t: t[rank * n:(rank + 1) * n].clone(), params)
    axes = _axes(expert_type, params)
    e, j = divmod(rank, s)
    return {k: None if v is None else _shard_leaf(v[e:e + 1], axes[k].shard_axis, s, j, axes[k].padded).clone()
            for k, v in params.items()}


def _axes(expert_type: str, params: dict) -> dict:
    axes = shard_axes(expert_type)
    if axes is None:
        raise ValueError(f"expert type {expert_type!r} cannot be sharded (E < W); only 'ffn' and 'gated_ffn' "
                         "can (fmoe.experts.EXPERT_PARAMS)")
    unknown = [k for k, v in params.items() if v is not None and k not in axes]
    bad = [k for k, v in params.items() if v is not None and not isinstance(v, Tensor)]
    if unknown or bad:
        raise ValueError(f"cannot shard expert parameters {unknown + bad} (unknown keys or quantized weights)")
    return axes


# --------------------------------------------------------------------------- agreement

def _leaf_sig(params) -> str:
    if isinstance(params, dict) and all(isinstance(v, Tensor) for v in params.values()):
        # the common pytree, described without flattening (this runs on every call)
        return "|".join(f"{k}:{tuple(v.shape)}:{v.dtype}" for k, v in params.items())
    leaves, spec = pytree.tree_flatten(params)
    return str(spec) + "|" + ";".join(f"{tuple(getattr(t, 'shape', ()))}:{getattr(t, 'dtype', type(t).__name__)}"
                                      for t in leaves)


def parallel_fields(spec, parallel: ParallelSpec, world: int, dtype, expert_params) -> dict:
    """The static settings every rank must share for one MoE call."""
    return {"world_size": world, "num_experts": spec.num_experts, "model_dim": spec.model_dim,
            "k": spec.gate.k, "capacity_factor": spec.gate.capacity_factor, "output_dim": spec.output_dim,
            "spec": spec, "parallel": parallel if parallel.check else dataclasses.replace(parallel, check=True),
            "dtype": str(dtype), "expert_params": _leaf_sig(expert_params)}


# --------------------------------------------------------------------------- sub-communicators

# Derived communicators (splits, 2DH wrappers) per base communicator live in the communicator
# registry (fmoe.comm.registry.cache_of), never as attributes on the communicator the user passed
# in; the communicators' close() drops them (gloo sub-groups must be freed before exit).
def _derived(comm, tag, make):
    """``make()`` memoised per (comm, tag).

    ``tag`` must name the whole partition (e.g. "groups of 2 consecutive ranks"), not this
    rank's part of it: a split is a collective, so every rank must miss the cache together.
    The agreement check guarantees that all ranks run the same mode, hence reach the same
    tags in the same order.
    """
    cache = cache_of(comm)
    if tag not in cache:
        cache[tag] = make()
    return cache[tag]


def _sub(comm, tag: str, color: int):
    return _derived(comm, tag, lambda: comm.split(color))


def _a2a_comm(comm, local_size: Optional[int]):
    if local_size is None or local_size in (1, comm.size):
        return comm
    return _derived(comm, ("2dh", local_size), lambda: Hierarchical2DComm(comm, local_size))


# --------------------------------------------------------------------------- parameter gathers

def _gather_all(expert_type: str, params: dict, comm, num_experts: int, s: int, out_dim: int) -> dict:
    """Every expert in full on every rank (r = 0), differentiable (backward: reduce-scatter)."""
    if s == 1:
        return pytree.tree_map(lambda t: all_gather(t, comm, 0), params)
    axes = _axes(expert_type, params)
    full = {}
    for k, v in params.items():
        if v is None:
            full[k] = None
            continue
        g = all_gather(v, comm, 0)                       # [W, *rest] = [E*s, *rest]
        a = axes[k].shard_axis
        g = g.reshape(num_experts, s, *g.shape[1:]).movedim(1, a)
        g = g.reshape(*g.shape[:a], s * g.shape[a + 1], *g.shape[a + 2:])
        full[k] = g[..., :out_dim] if axes[k].padded else g
    return full


def _gather_group(expert_type: str, params: dict, comm, s: int, r: int, out_dim: int) -> dict:
    """Hidden slice H/r for this rank's group of s/r owners; fc2 bias in full, divided by r."""
    axes = _axes(expert_type, params)
    g = s // r
    group = _sub(comm, f"consecutive-{g}", comm.rank // g) if g > 1 else None
    shard = _sub(comm, f"consecutive-{s}", comm.rank // s)
    out = {}
    for k, v in params.items():
        if v is None:
            out[k] = None
        elif axes[k].padded:
            out[k] = all_gather(v, shard, axes[k].shard_axis)[..., :out_dim] / r
        else:
            out[k] = v if group is None else all_gather(v, group, axes[k].shard_axis)
    return out


# --------------------------------------------------------------------------- expert stage

def _a2a(x: Tensor, comm, concat_axis: int, split_axis: int, parallel: ParallelSpec) -> Tensor:
    if parallel.compressed:
        return _compress.all_to_all(x, comm, concat_axis, split_axis, wire=parallel.wire,
                                    grad_wire=parallel.grad_wire)
    return all_to_all(x, comm, concat_axis, split_axis)


def _a2av(x: Tensor, comm, send: list, recv: list, parallel: ParallelSpec) -> Tensor:
    if parallel.compressed:
        return _compress.all_to_all_v(x, comm, send, recv, wire=parallel.wire, grad_wire=parallel.grad_wire)
    return all_to_all_v(x, comm, send, recv)


class _SendRows(torch.autograd.Function):
    """``all_to_all_v(dispatch(x, layout), comm, send, recv)`` for an unweighted ragged layout, in one
    op: the exchange reads each row where it lies in x (``rows``: the token of each buffer row), so
    no [N, M] dispatch buffer is written and read again. Backward is the exchange back and then
    the dispatch's own backward (the combine over the layout's positions): the same ops, hence the
    same bits, as the two-op path."""

    @staticmethod
    def forward(x, pos, rows, comm, send, recv):
        return torch.ops.fmoe.gather_all_to_all_v(x, rows, handle_of(comm), send, recv)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, pos, rows, ctx.comm, ctx.send, ctx.recv = inputs
        ctx.save_for_backward(pos)
        ctx.save_for_forward(pos, rows)

    @staticmethod
    def backward(ctx, g):
        pos, = ctx.saved_tensors
        return combine_raw(all_to_all_v(g, ctx.comm, ctx.recv, ctx.send), pos, None), None, None, None, None, None

    @staticmethod
    def jvp(ctx, tx, *_):
        pos, rows = ctx.saved_tensors
        return _SendRows.apply(tx, pos, rows, ctx.comm, ctx.send, ctx.recv)


def _exchange_rows(x: Tensor, rows: Optional[Tensor], place: Optional[Tensor], comm, send: list,
                   recv: list) -> Tensor:
    return torch.ops.fmoe.exchange_rows(x, rows, place, handle_of(comm), send, recv)


class _SendPlaced(torch.autograd.Function):
    """:class:`_SendRows` whose received rows land in expert order: received row i (source-major)
    goes to row ``place[i]``, so the engine's plan over them is in order (no gather, no scatter).
    Backward sends each gradient row from where it lies (:class:`_Exchange`) and combines it
    over the layout's positions, as :class:`_SendRows`' backward does."""

    @staticmethod
    def forward(x, pos, rows, place, comm, send, recv):
        return _exchange_rows(x, rows, place, comm, send, recv)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, pos, rows, place, ctx.comm, ctx.send, ctx.recv = inputs
        ctx.save_for_backward(pos, place)
        ctx.save_for_forward(pos, rows, place)

    @staticmethod
    def backward(ctx, g):
        pos, place = ctx.saved_tensors
        back = _Exchange.apply(g, place, None, ctx.comm, ctx.recv, ctx.send)
        return combine_raw(back, pos, None), None, None, None, None, None, None

    @staticmethod
    def jvp(ctx, tx, *_):
        pos, rows, place = ctx.saved_tensors
        return _SendPlaced.apply(tx, pos, rows, place, ctx.comm, ctx.send, ctx.recv)


class _Exchange(torch.autograd.Function):
    """``all_to_all_v(t[rows], comm, send, recv)`` with received row i written to row ``place[i]``
    (rows or place None: in order), rows read and written where they lie. With both indices
    permutations (or None) it is a permutation of rows across ranks: its transpose, the backward,
    is the same exchange with the indices' roles and the counts swapped, and its jvp is itself."""

    @staticmethod
    def forward(t, rows, place, comm, send, recv):
        return _exchange_rows(t, rows, place, comm, send, recv)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, rows, place, ctx.comm, ctx.send, ctx.recv = inputs
        ctx.save_for_backward(rows, place)
        ctx.save_for_forward(rows, place)

    @staticmethod
    def backward(ctx, g):
        rows, place = ctx.saved_tensors
        return _Exchange.apply(g, place, rows, ctx.comm, ctx.recv, ctx.send), None, None, None, None, None

    @staticmethod
    def jvp(ctx, tt, *_):
        rows, place = ctx.saved_tensors
        return _Exchange.apply(tt, rows, place, ctx.comm, ctx.send, ctx.recv)


def _layout_tokens(layout: Layout, num_tokens: int) -> Tensor:
    """int64 [N]: the token of each row of a ragged layout cut to its kept rows (:func:`_kept_rows`:
    rows [0, N) each hold one pair), i.e. the rows :func:`fmoe.ops.dispatch` would copy."""
    flat = layout.positions.reshape(-1)                     # pair j * T + t -> its row, -1 if not kept
    tokens = torch.arange(flat.shape[0], device=flat.device) % max(1, num_tokens)
    N = int(layout.sizes.sum())
    if N != flat.shape[0]:                                  # dropped pairs hold no row
        kept = flat >= 0
        flat, tokens = flat[kept], tokens[kept]
    return torch.empty(N, dtype=torch.int64, device=flat.device).index_copy_(0, flat, tokens)


def _engine_form(experts, params, x: Tensor) -> dict:
    """The kind's :func:`~fmoe.experts.expert_form` and, as ``kw["door"]``, the engine door
    (:func:`fmoe.engine.traced.door`) that runs these experts on x; ``kw["lift"]``: the level of
    the one torch.func grad level the eager rows plan runs beneath (:class:`_BelowGrad`), else None.

    Where the door is the traced op only because of a single grad level (``torch.func.grad``,
    ``vjp``; nothing else: no vmap, jvp, second derivative or compile), the received rows take the
    eager door beneath that level instead: the same plan and kernels, and the placed exchanges
    and in-order plan that eager mode runs (the op builds its plan inside it and gathers and
    scatters its rows by index)."""
    kw = expert_form(experts, params)
    ts = (x, *kw["w_in"], kw["w_out"], kw["b_in"], kw["b_out"])
    d = door(kw["form"], ts, precision=experts.precision)
    lift = _grad_level(ts) if d == "traced" else None
    return {**kw, "door": "rows" if lift is not None else d, "lift": lift}


def _grad_level(tensors: tuple = ()) -> Optional[int]:
    """The level of the call's torch.func transforms where they are exactly one grad level in eager
    mode (no forward-mode AD) and no tensor of ``tensors`` asks for a gradient outside it, else None.
    A tensor asks where it or the value beneath its wrapper requires grad: a plain x that requires
    grad reaches the received rows through the exchange, which wraps them at the level."""
    if torch.compiler.is_compiling() or torch.autograd.forward_ad._current_level >= 0:
        return None
    if any(isinstance(t, Tensor) and _outer_grad(t) for t in tensors):
        return None
    stack = torch._C._functorch.get_interpreter_stack() or []
    if len(stack) != 1 or stack[0].key() != torch._C._functorch.TransformType.Grad:
        return None
    return stack[0].level()


def _outer_grad(t: Tensor) -> bool:
    """Whether autograd outside every torch.func level wants t's gradient (the innermost value
    beneath t's functorch wrappers requires grad)."""
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t.requires_grad


class _BelowGrad(torch.autograd.Function):
    """``run(*tensors)`` (the eager engine: a rows plan through :func:`fmoe.engine.kinds.run`,
    whose kernels read plain tensors' storage) under one torch.func grad level: torch.func runs
    this forward beneath the level on the unwrapped tensors, where ``run`` records a plain
    autograd graph; backward replays that graph beneath the level (``torch.autograd.grad`` for
    the inputs the level differentiates, ``needs``) and lifts its gradients to the level. First
    order only (:func:`_grad_level`); ``box``: a one-call :class:`_Box` that hands the graph from
    forward to setup_context."""

    @staticmethod
    def forward(box, needs, *tensors):
        leaves = [None if t is None else t.detach().requires_grad_(n) for t, n in zip(tensors, needs)]
        with torch.enable_grad():
            y = box.run(*leaves)
        box.graph = (y, leaves)
        return y.detach()

    @staticmethod
    def setup_context(ctx, inputs, output):
        # (torch.func calls it twice: for the Function it runs beneath the level and for its own)
        ctx.graph, ctx.level = inputs[0].graph, inputs[0].level

    @staticmethod
    def backward(ctx, g):
        (y, leaves), ctx.graph = ctx.graph, None
        want = [t for t in leaves if t is not None and t.requires_grad]
        if torch._C._functorch.get_interpreter_stack():
            with torch._functorch.pyfunctorch.retrieve_current_functorch_interpreter().lower():
                got = iter(torch.autograd.grad(y, want, torch._C._functorch._unwrap_for_grad(g, ctx.level)))
            lift = torch._C._functorch._wrap_for_grad
        else:   # the function of torch.func.vjp called after its level ended: plain tensors, nothing to lift
            got = iter(torch.autograd.grad(y, want, g))
            lift = lambda t, level: t   # noqa: E731
        return (None, None, *(lift(next(got), ctx.level) if t is not None and t.requires_grad else None
                              for t in leaves))


class _Box:
    __slots__ = ("run", "level", "graph")

    def __init__(self, run, level: int):
        self.run, self.level, self.graph = run, level, None


def _received_routing(x: Tensor, mask: Tensor, rows: Optional[Tensor]):
    """The received rows as a routing of k = 1 over R = ``x.shape[0]`` "tokens" (the traced op
    builds its plan from a routing's tensors): row t is a pair of its local expert at its rank
    among that expert's rows; an empty padded row is a masked pair (id -1). Gates are 1 (they act
    at the source rank's combine). Shapes are static (no host sync), as a compiled graph needs.

    Args:
        x: [R, M] the received rows, flat.
        mask: uint8/bool [n, R_e] (padded, R = n * R_e) or int64 [n] rows per local expert (ragged).
        rows: ragged only: int64 [R], x's rows in local-expert order (None: x's own order).
    """
    R = x.shape[0]
    if mask.dim() == 2:
        n, per = mask.shape
        filled = mask.reshape(-1).bool()
        ids = torch.arange(n, device=x.device).repeat_interleave(per)
        rank = filled.view(n, per).cumsum(1).reshape(-1) - 1
        ids, slots, counts = ids.masked_fill(~filled, -1), rank.masked_fill(~filled, -1), mask.sum(1, dtype=torch.int64)
    else:
        n, counts = mask.shape[0], mask
        ids = torch.repeat_interleave(torch.arange(n, device=x.device), counts, output_size=R)
        slots = torch.arange(R, device=x.device) - (counts.cumsum(0) - counts).index_select(0, ids)
        if rows is not None:   # the i-th row in expert order is x's row rows[i]
            ids, slots = torch.empty_like(ids).index_put_((rows,), ids), torch.empty_like(slots).index_put_((rows,), slots)
    return _trusted_routing(ids.view(1, R), slots.view(1, R), x.new_ones(1, R), counts, max(1, R), n)


def _engine_rows(experts, params, x: Tensor, mask: Tensor, save: str, generator,
                 rows: Optional[Tensor] = None) -> Tensor:
    """This rank's experts on the filled rows of a received buffer, through the engine: a rows
    plan in eager mode and beneath a single torch.func grad level (:class:`_BelowGrad`), the
    traced op (the same plan built inside it) under torch.compile and vmap; where neither runs
    (forward-mode AD, a second derivative, an activation or a recipe the op does not take) the same plan through :func:`fmoe.engine.kinds.reference`, plain
    autograd over per-expert GEMMs. Custom experts take the padded buffer whole (Tutel's contract).

    Args:
        params: this rank's expert parameters (n experts).
        x: float [n, R_e, M] (padded: R_e rows per local expert) or [R, M] with ``mask`` rows
            already sorted by local expert (see ``mask``).
        mask: uint8/bool [n, R_e] (padded) marking the rows that hold a pair; or, for a flat x,
            int64 [n] rows per local expert (ragged, every row filled).
        rows: for a flat x, int64 [R] its rows in local-expert order (default: x's own order).
    Returns:
        [*x.shape[:-1], O]: each filled row's expert output, unweighted; empty rows 0 (custom
        experts: whatever ``fn`` gives them; combine never reads them).
    """
    if experts.type == "custom":
        return experts.fn(params, x)
    kw = _engine_form(experts, params, x)
    flat = x.reshape(-1, x.shape[-1])
    if kw["door"] == "traced":
        y = _traced.run(kw["form"], flat, _received_routing(flat, mask, rows), kw["w_in"], kw["w_out"],
                        b_in=kw["b_in"], b_out=kw["b_out"], save=save)
        return y.reshape(*x.shape[:-1], y.shape[-1])
    if x.dim() == 3:
        rows = torch.nonzero(mask.reshape(-1)).squeeze(1)        # e-major: sorted by local expert
        sizes = mask.sum(1, dtype=torch.int64)
        in_order = False
    else:
        in_order = rows is None   # x's rows already in local-expert order: the plan's tokens are its rows
        rows = torch.arange(flat.shape[0], device=x.device) if rows is None else rows
        sizes = mask
    bounds = [0]
    for c in sizes.tolist():                                      # the kernels' loop bounds (host ints)
        bounds.append(bounds[-1] + c)
    weights = (*kw["w_in"], kw["w_out"], kw["b_in"], kw["b_out"])
    needs_grad = torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in (x, *weights))
    rows = plain(rows)   # (made under a grad level: a wrapper with no storage for the plan's kernels)

    def make_plan():
        return plan_from_bounds(rows, rows, bounds, flat.shape[0], needs_grad=needs_grad, dtype=flat.dtype,
                                precision=experts.precision, in_order=in_order)

    n_in = len(kw["w_in"])
    # w_rows None: every gate 1 (the gates act at the source rank's combine), no product by them
    if kw["door"] == "rows":
        def run(f, *w):
            return _kinds.run(kw["form"], f, None, make_plan(), w[:n_in], w[n_in], b_in=w[n_in + 1],
                              b_out=w[n_in + 2], save=save, generator=generator)
        if kw["lift"] is None:
            y = run(flat, *weights)
        else:
            ts = (flat, *weights)
            y = _BelowGrad.apply(_Box(run, kw["lift"]), [t is not None and t.requires_grad for t in ts], *ts)
    else:
        plan = make_plan()
        mm = _kinds._rows_mm(select(plan, generator=generator), plan, generator)
        y = _kinds.reference(kw["form"], flat, None, plan, kw["w_in"], kw["b_in"], kw["w_out"], kw["b_out"], mm=mm)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _filled(layout: Layout, C: int) -> Tensor:
    """uint8 [E, C]: 1 where a padded buffer row holds a pair (slots below min(counts, C))."""
    return (torch.arange(C, device=layout.sizes.device) < layout.sizes.unsqueeze(1)).to(torch.uint8)


def _kept_rows(layout: Layout) -> Layout:
    """A ragged layout cut to its kept rows (R = N, a host sync the exchange's counts make anyway):
    the dispatch writes, and the exchanges and the combine carry, no zero rows past them."""
    N = int(layout.sizes.sum())
    return layout if N in (0, layout.num_rows) else dataclasses.replace(layout, num_rows=N)


def expert_stage(experts, expert_params, x: Tensor, routing, comm, parallel: Optional[ParallelSpec] = None, *,
                 layout_kind: str, num_experts: int, output_dim: int, prescore: bool = False, order: str = "fmoe",
                 save: str = "projections", generator=None) -> Tensor:
    """:func:`fmoe.moe`'s expert stage on several ranks: this rank's tokens into the layout's
    buffers, :func:`expert_parallel`, and back to tokens. Eager ragged rows of whole experts
    (r = 1, d = 1, an uncompressed wire, gates at the combine) skip the dispatch buffer: the
    exchange reads each kept row from x (:class:`_SendRows`).

    Args:
        experts, expert_params, comm, parallel, num_experts, output_dim, generator: as
            :func:`expert_parallel`.
        x: float [T, M] this rank's tokens. routing: their :class:`~fmoe.Routing`.
        layout_kind: 'padded' or 'ragged' (:meth:`fmoe.MoESpec.layout_kind`).
        prescore: the gates scale the experts' inputs instead of their outputs.
        order: the combine order, 'fmoe', 'eager' or 'grouped' (:class:`fmoe.MoESpec`).
        save: what the engine's backward keeps (:attr:`fmoe.MoESpec.save`).
    Returns:
        [T, O] in x's dtype.
    """
    par = parallel or ParallelSpec()
    _, s = sharding(num_experts, comm.size)
    if (layout_kind == "padded" and s == 1 and par.degree(s) == 1 and par.overlap_degree == 1
            and experts.type != "custom" and _traced.data_shapes()
            and _engine_form(experts, expert_params, x)["door"] != "layout"):
        # The engine multiplies the kept rows only; exchanged as ragged rows, no row past an
        # expert's fill crosses the wire either (the same pairs in the same order: equal outputs).
        # Not where shapes must be static (compiling, vmap): padded buffers and their fill masks.
        layout_kind = "ragged"
    layout = make_layout(routing, layout_kind)
    if layout_kind == "ragged" and _traced.data_shapes():
        layout = _kept_rows(layout)
    if (layout_kind == "ragged" and _traced.data_shapes() and comm.size > 1 and s == 1 and par.degree(s) == 1
            and par.overlap_degree == 1 and not par.compressed and not prescore and experts.type != "custom"):
        # the exchange reads the rows from x itself (_SendRows): no dispatch buffer
        check_dispatch_input(x, routing)
        out = _stage(experts, expert_params, None, (x, _layout_tokens(layout, x.shape[0])), comm, parallel, layout,
                     num_experts, output_dim, save, generator)
    else:
        buffers = dispatch(x, routing, weighted=prescore, layout=layout)
        out = expert_parallel(experts, expert_params, buffers, comm, parallel, layout=layout,
                              num_experts=num_experts, output_dim=output_dim, save=save, generator=generator)
    return combine_in_order(out, routing, layout, order, weighted=not prescore)


def expert_parallel(experts, expert_params, buffers: Tensor, comm, parallel: Optional[ParallelSpec] = None,
                    *, layout: Layout, num_experts: int, output_dim: int, save: str = "projections",
                    generator=None) -> Tensor:
    """Run the experts of all ranks on this rank's dispatch buffers.

    Args:
        experts: the :class:`~fmoe.ExpertSpec` (its function, parameter layout and precision).
        expert_params: this rank's expert pytree (:func:`shard_experts` layout).
        buffers: this rank's dispatch buffers in ``layout``: padded [E, C, M] (C divisible by
            s * d, use :func:`capacity_alignment`, and equal on every rank) or ragged [R, M].
        comm: communicator of the expert-parallel group (size W).
        parallel: per-call :class:`ParallelSpec` (default 'adaptive:1', d = 1, flat).
        layout: the dispatch layout. Ragged buffers travel by all-to-all-v (exactly the kept
            rows, no padding; E >= W, r in {0, 1}, d = 1).
        num_experts: E. output_dim: O.
        save: what the engine's backward keeps (:attr:`fmoe.MoESpec.save`).
        generator: RNG of the experts' quantized-training recipe, if any.

    In eager mode built-in experts run on the expert engine (:mod:`fmoe.engine`): a rows plan
    over the received rows that hold pairs (padded buffers: a uint8 fill mask travels with the
    data by the same all-to-all; ragged rows: all of them), so padding rows are never
    multiplied. Custom experts and traced calls run the staged kernel over every buffer row.

    Returns:
        Expert outputs for this rank's buffers in the same layout ([E, C, O] or [R, O]).
    """
    return _stage(experts, expert_params, buffers, None, comm, parallel, layout, num_experts, output_dim, save,
                  generator)


def _stage(experts, expert_params, buffers: Optional[Tensor], source: Optional[tuple], comm, parallel, layout: Layout,
           num_experts: int, output_dim: int, save: str, generator) -> Tensor:
    """:func:`expert_parallel` on ``buffers``, or with ``source`` = (x [T, M], the token of each row
    [N]) on the ragged rows that the exchange reads from x itself (no dispatch buffer)."""
    parallel = parallel or ParallelSpec()
    W = comm.size
    E = num_experts
    dtype = (buffers if source is None else source[0]).dtype
    if layout.num_experts != E:
        raise ValueError(f"expert_parallel: layout has {layout.num_experts} experts, num_experts={E}")
    n, s = sharding(E, W)
    r = parallel.degree(s)
    d = parallel.overlap_degree
    agreed = _agreed_by_moe(comm)
    if parallel.check:
        fields = {"world_size": W, "num_experts": E, "output_dim": output_dim, "experts": experts,
                  "parallel": dataclasses.replace(parallel, check=True), "layout": layout.kind,
                  "dtype": str(dtype), "expert_params": _leaf_sig(expert_params)}
        if layout.kind == "padded":
            fields["capacity"] = layout.capacity
        agree_across_ranks(comm, fields, defer=True)
        agreed = True
    # An agreed call's collectives on comm follow from the agreed settings (kind, order, dtype, shape):
    # under checks="full" they need no control record each. Not while tracing (a context variable is
    # no graph op): compiled calls keep their records.
    scope = matching.covered(comm) if agreed and not torch.compiler.is_compiling() else contextlib.nullcontext()
    with scope:
        return _expert_stage(experts, expert_params, buffers, source, comm, parallel, layout, E, n, s, r, d,
                             output_dim, save, generator)


def _expert_stage(experts, expert_params, buffers, source, comm, parallel, layout, E, n, s, r, d, output_dim, save,
                  generator):
    if layout.kind == "ragged":
        return _ragged_expert_parallel(experts, expert_params, buffers, comm, parallel, layout, r, d, save, generator,
                                       source)
    _, C, M = buffers.shape
    et = experts.type
    if r == 0:
        full = _gather_all(et, expert_params, comm, E, s, output_dim)
        return _engine_rows(experts, full, buffers, _filled(layout, C), save, generator)
    if C % (s * d):
        raise ValueError(f"expert_parallel: capacity {C} must be divisible by s*d = {s}*{d}; route with "
                         f"alignment=capacity_alignment(E, W, parallel)")
    local = expert_params if s == 1 else _gather_group(et, expert_params, comm, s, r, output_dim)
    filled = _filled(layout, C)
    xcomm = _a2a_comm(comm, parallel.local_size)
    step = C // d
    outs = []
    for i in range(d):
        sl = slice(None) if d == 1 else slice(i * step, (i + 1) * step)
        outs.append(_expert_chunk(experts, local, buffers[:, sl], filled[:, sl], xcomm, s, r, save, generator,
                                  parallel))
    return outs[0] if d == 1 else torch.cat(outs, dim=1)


def _expert_chunk(experts, local, chunk: Tensor, filled: Tensor, comm, s: int, r: int, save: str, generator,
                  parallel: ParallelSpec) -> Tensor:
    """One capacity chunk [E, c, M] -> [E, c, O] through all-to-all, experts, all-to-all.

    The chunk's fill mask [E, c] makes the same trip as the rows, and the engine multiplies only
    the received rows that hold pairs."""
    E, c, M = chunk.shape
    W = comm.size
    if s == 1:
        x = _a2a(chunk, comm, 1, 0, parallel)                  # [n, W*c, M]
        y = _engine_rows(experts, local, x, comm.all_to_all(filled, 1, 0), save, generator)
        return _a2a(y, comm, 0, 1, parallel)                   # [E, c, O]
    rep = chunk.repeat(1, r, 1) if r > 1 else chunk            # [E, r*c, M]: r copies of every row
    x = _a2a(rep.reshape(W, r * c // s, M), comm, 1, 0, parallel)  # [1, W*r*c/s, M]
    # partial sums over this group's hidden slice
    f = (filled.repeat(1, r) if r > 1 else filled).reshape(W, r * c // s)
    y = _engine_rows(experts, local, x, comm.all_to_all(f, 1, 0), save, generator)
    y = _a2a(y, comm, 0, 1, parallel)                          # [W, r*c/s, O]
    return y.reshape(E, r, c, y.shape[-1]).sum(1)              # sum the r partial outputs


def _ragged_expert_parallel(experts, expert_params, rows: Optional[Tensor], comm, parallel: ParallelSpec,
                            layout: Layout, r: int, d: int, save: str, generator, source: Optional[tuple] = None
                            ) -> Tensor:
    """Ragged rows [R, M] (sorted by global expert) through all-to-all-v, experts, all-to-all-v.

    Rank w owns experts [w*n, (w+1)*n), whose rows are contiguous in the ragged buffer, so the
    send buffer is the buffer itself: exactly the kept rows travel, no padding. With ``source``
    = (x [T, M], token of each row [N]) instead of ``rows`` (None) the exchange reads the rows from
    x (:class:`_SendRows`; r = 1 only). Received rows are source-major: the engine's plan reads them
    in local-expert order and writes each output row back in place.
    """
    W, E = comm.size, layout.num_experts
    n, s = sharding(E, W)
    if s != 1:
        raise ValueError(f"the ragged layout needs E >= W (whole experts per rank); E={E}, W={W}: route with "
                         "MoESpec(layout='padded') to share experts across ranks")
    if experts.type == "custom":
        raise ValueError("custom experts take padded buffers [E, C, M]; route them with layout='padded'")
    if d != 1:
        raise ValueError(f"the ragged layout runs with overlap_degree=1 (got {d}); overlap chunks the padded "
                         "capacity axis: use MoESpec(layout='padded') with a finite capacity_factor")
    R = layout.num_rows if rows is None else rows.shape[0]
    sizes = layout.sizes
    N = int(sizes.sum())                                        # host sync: all-to-all-v needs counts
    if r == 0:                                                  # every expert on every rank, no exchange
        full = _gather_all(experts.type, expert_params, comm, E, s, 0)
        y = _engine_rows(experts, full, rows[:N], sizes, save, generator)
        return y if N == R else torch.cat([y, y.new_zeros(R - N, y.shape[1])])
    xcomm = _a2a_comm(comm, parallel.local_size)
    recv_matrix = comm.all_to_all(sizes, 0, 0).reshape(W, n)  # [source, local expert]
    send = sizes.reshape(W, n).sum(1).tolist()
    recv = recv_matrix.sum(1).tolist()
    local_id = torch.repeat_interleave(torch.arange(n, device=sizes.device).repeat(W), recv_matrix.reshape(-1))
    by_expert = torch.argsort(local_id, stable=True)
    local_sizes = recv_matrix.sum(0)
    if (source is not None and hasattr(xcomm, "exchange_rows")
            and _engine_form(experts, expert_params, source[0])["door"] == "rows"):
        # MPIComm and TorchDistComm write each received row where it goes: rows in expert order, an
        # in-order plan (the eager engine's GEMMs read and write them in place: no gather, zero fill
        # or scatter), and the outputs go back from where they lie. place[i]: the expert-order row
        # of source-major received row i. (The traced op and the reference gather and scatter by
        # any index: they keep the plain exchanges.)
        place = torch.empty_like(by_expert).index_copy_(0, by_expert, torch.arange(by_expert.shape[0]))
        got = _SendPlaced.apply(source[0], layout.positions, source[1], place, xcomm, send, recv)
        y = _engine_rows(experts, expert_params, got, local_sizes, save, generator)
        ret = _Exchange.apply(y, place, None, xcomm, recv, send)   # [N, O] in this rank's row order
    else:
        if source is None:
            got = _a2av(rows[:N], xcomm, send, recv, parallel)    # [sum recv, M], source-major
        else:
            got = _SendRows.apply(source[0], layout.positions, source[1], xcomm, send, recv)
        y = _engine_rows(experts, expert_params, got, local_sizes, save, generator, rows=by_expert)
        ret = _a2av(y, xcomm, recv, send, parallel)                # [N, O] in this rank's row order
    if N == R:
        return ret
    return torch.cat([ret, ret.new_zeros(R - N, ret.shape[1])])


_AGREED = "fmoe.parallel: agreed call"  # registry cache key: the agreement number of the moe call in flight


def _agreed_by_moe(comm) -> bool:
    """Whether :func:`check_moe_call` agreed the call now reaching its expert stage (consumed once)."""
    token = cache_of(comm).pop(_AGREED, None)
    return token is not None and token == calls_of(comm)


def _check_router(params, spec) -> None:
    try:
        check_router_params(params["gate"], spec.gate, spec.num_experts, spec.model_dim)
    except ValueError as e:
        raise ValueError(f"parameter pytree does not match the MoESpec: {e}") from None


def _check_finite_inputs(x: Tensor, gate_params) -> None:
    """Expert parallelism: x and the router's parameters hold no NaN/Inf, checked before the call's
    first collective so every rank raises (on one process the router checks its logits instead:
    T x E values, not T x M)."""
    why = ("the router cannot pick experts for those tokens. Find where the NaN/Inf comes from upstream, "
           "or clean x (torch.nan_to_num) before the layer")
    check_finite(x, "moe: x", why)
    for path, leaf in pytree.tree_flatten_with_path(gate_params)[0]:
        if isinstance(leaf, Tensor) and leaf.is_floating_point():
            check_finite(leaf.reshape(-1, leaf.shape[-1]) if leaf.dim() else leaf.reshape(1, 1),
                         f"moe: params['gate']{pytree.keystr(path)}", "the router's parameters are corrupt "
                         "(a diverged update?): restore them from a checkpoint")


def check_moe_call(comm, spec, parallel: ParallelSpec, x, params, routing, local_check: Callable[[], None]) -> None:
    """The agreement step of a distributed :func:`fmoe.moe` call, run before any other collective.

    Local input errors (:func:`check_expert_layout`; ``local_check``: :func:`fmoe.moe`'s input,
    parameter (:func:`fmoe.check_params`) and replay checks; then x's and the router's parameters'
    finiteness and shapes) and cross-rank mismatches
    both raise on every rank. The agreement record travels with the call's first collective (no
    exchange of its own) on fmoe's communicators; their ``checks="off"`` skips it.
    """
    if torch.compiler.is_compiling():
        raise NotImplementedError(
            "fmoe.moe: expert parallelism (a comm of size > 1) does not run inside one torch.compile graph: its "
            "agreement check and its exchanges' row counts run on the host. Compile without fullgraph=True "
            "(the graph breaks at the check and at each exchange, and the expert stage between them still "
            "compiles), wrap the layer in torch.compiler.disable, or differentiate the step with torch.func, "
            "which runs expert parallelism")
    cache_of(comm).pop(_AGREED, None)  # a token left by a call that failed before its expert stage

    def local():
        if isinstance(params, dict) and "experts" in params:   # the layout's fix before any leaf's shape
            check_expert_layout(spec, params["experts"], comm.size, comm.rank)
        local_check()   # moe's input, params (check_params) and replay checks
        if routing is None:   # the router checks its parameters when it runs: here, on every rank first
            _check_finite_inputs(x, params["gate"])
            _check_router(params, spec)

    if not parallel.check:
        local()
        return
    experts = params.get("experts") if isinstance(params, dict) else None
    fields = parallel_fields(spec, parallel, comm.size, getattr(x, "dtype", None), experts)
    fields["routing_capacity"] = -1 if routing is None else int(routing.capacity)

    def check():
        local()
        n, s = sharding(spec.num_experts, comm.size)
        parallel.degree(s)
    agree_across_ranks(comm, fields, check, defer=True)
    cache_of(comm)[_AGREED] = calls_of(comm)


def _lead(t) -> Optional[tuple]:
    shape = getattr(t, "logical_shape", None) or getattr(t, "shape", None)
    return tuple(shape) if shape is not None else None


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def check_expert_layout(spec, experts, world: int, rank: int) -> None:
    """Raise ValueError, naming the counts and the fix, unless ``experts`` is rank ``rank``'s part of
    ``spec.num_experts`` experts on ``world`` ranks (:func:`shard_experts`' layout).

    Checked: E against W (one must divide the other); every expert leaf's leading dim (E/W experts
    per rank, or 1 when W/E ranks share an expert); for shared 'ffn' / 'gated_ffn' experts, the
    hidden axis of each leaf (H/s units of the expert, fc2 bias ceil(O/s) entries) and for whole
    experts the full H. Custom expert types are not checked (their pytree is the user's).

    Args:
        spec: the :class:`~fmoe.MoESpec`; experts: this rank's expert pytree (leaves [n, ...]).
        world, rank: W and this rank.
    """
    E, W = spec.num_experts, world
    n, s = sharding(E, W)
    et = spec.experts.type
    if et not in EXPERT_PARAMS or not isinstance(experts, dict):
        return
    fix = (f"pass fmoe.parallel.shard_experts({et!r}, full_experts, {E}, comm.rank, comm.size) or "
           "fmoe.init_params(spec, comm=comm)")
    layouts = {p.name: p for p in EXPERT_PARAMS[et]}
    for key, leaf in experts.items():
        shape = _lead(leaf)
        if key not in layouts or not shape:
            continue
        lead = shape[0]
        if lead != n:
            if lead == E and W > 1:
                what = f"all {E} experts"
            else:
                what = f"{lead} expert{'s' if lead != 1 else ''}"
            if lead > 0 and E % lead == 0:
                where = f" (the layout of {E // lead} rank{'s' if E // lead != 1 else ''})"
            else:
                where = (f" (which fits no layout of {E} experts: a rank holds E/W of them for a world size W "
                         "dividing E, or 1 when W/E ranks share each)")
            need = f"{n} per rank" if s == 1 else f"a 1/{s} shard of one expert per rank ({s} ranks share each)"
            raise ValueError(
                f"expert parameter experts[{key!r}] {list(shape)} holds {what} on rank {rank} of {W}{where}; "
                f"MoESpec.num_experts={E} on {W} ranks needs {need}: {fix}")
    axes = shard_axes(et)
    if axes is None:
        return
    H, O = spec.experts.hidden_size, spec.output_dim
    for key, leaf in experts.items():
        lay = axes.get(key)
        shape = _lead(leaf)
        if lay is None or not shape or len(shape) <= lay.shard_axis:
            continue
        full = O if lay.padded else H
        want = -(-full // s) if lay.padded else full // s
        got = shape[lay.shard_axis]
        if got == want:
            continue
        axis = "output entries" if lay.padded else "hidden units"
        if s == 1:
            raise ValueError(
                f"expert parameter experts[{key!r}] {list(shape)} has {got} {axis} along dim {lay.shard_axis} on "
                f"rank {rank} of {W}; whole experts ({_n(E, 'expert')} on {W} ranks) need all {full} (a shard of an "
                f"expert is only for E < W): {fix}")
        if not lay.padded and H % s:
            raise ValueError(f"hidden_size={H} cannot be cut into {s} shards ({W} ranks share {E} experts): use "
                             f"a hidden_size divisible by {s}")
        part = "the whole expert" if got == full else f"{got} of them"
        raise ValueError(
            f"expert parameter experts[{key!r}] {list(shape)} holds {part} ({axis} along dim {lay.shard_axis}) on "
            f"rank {rank} of {W}; {_n(E, 'expert')} on {W} ranks {'are each' if E > 1 else 'is'} shared by {s} "
            f"ranks, so each rank holds "
            f"shard {rank % s} of expert {rank // s}: {want} of {full} {axis}: {fix}")
