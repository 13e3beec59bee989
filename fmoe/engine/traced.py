"""The rows plan under torch.compile: the engine's expert op as one ``torch.library`` custom op;
and :func:`door`, the one place that decides which door of the engine a call takes.

    y = traced.run(form, x, routing, w_in, w_out, b_in=b_in, b_out=b_out, order="fmoe", save="projections")

A compiled graph cannot hold the rows plan's host row counts, so the plan is built inside the op
(one numba walk over the routing's tensors, as in eager mode) and the op runs the same kernels
as :func:`fmoe.engine.kinds.run`: eager and compiled calls make the same GEMM calls on the same
rows. The op's shapes are static: y [T, O], and the saved in-projection outputs padded to the
bound of k*T rows (:func:`torch.library.register_fake`), so ``torch.compile(fullgraph=True)``
captures it with no graph break and no host sync in the graph. Its backward is a second custom op
over the same kernels (:func:`fmoe.engine.kinds` ``_backward``), registered with
:func:`torch.library.register_autograd`.

What it takes: built-in kinds with float weights whose activation is a known pure function
(:data:`ACTIVATIONS`, or GPT-OSS), no quantized-training recipe, combine 'fmoe' or 'eager', gates
on the outputs, and no torch.func transform around the compiled call (vmap/grad/jvp keep the
layout plan's staged kernel, whose ops carry those rules); :func:`applies` says which.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._C import _functorch
from torch.autograd import forward_ad as _fwd_ad

from ..ops.primitives import PLAIN_TENSORS
from ..routing import Routing
from . import kinds
from .kinds import ExpertForm
from .plan import kept_rows, plan_from_bounds
from .table import select

__all__ = ["ACTIVATIONS", "DOORS", "door", "applies", "run"]

ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
               "softplus": F.softplus, "elu": F.elu, "leaky_relu": F.leaky_relu, "mish": F.mish, "selu": F.selu,
               "hardswish": F.hardswish}
_NAMES = {**{fn: name for name, fn in ACTIVATIONS.items()}, torch.relu: "relu", F.sigmoid: "sigmoid",
          F.tanh: "tanh"}


def _activation_name(form: ExpertForm) -> Optional[str]:
    return "" if form.form == "gpt_oss" else _NAMES.get(form.activation)


def applies(form: ExpertForm, w: tuple, precision, order: str) -> bool:
    """True where a compiled call runs the experts through the custom op: compiling, outside any
    torch.func transform, float weights, no recipe, a known activation, order 'fmoe'/'eager'."""
    # _are_functorch_transforms_active: the functorch check dynamo folds to a constant
    if not torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return False
    return (precision is None and order in kinds.ORDERS and _activation_name(form) is not None
            and all(t is None or isinstance(t, Tensor) for t in w))


def _form(form: str, in_t: bool, out_t: bool, act: str, alpha: float, limit: float) -> ExpertForm:
    return ExpertForm(form, in_t, out_t, activation=ACTIVATIONS.get(act, F.silu), alpha=alpha, limit=limit)


def _plan(expert_ids: Tensor, slots: Tensor, counts: Tensor, capacity: int, T: int, train: bool, dtype):
    tokens, pairs, bounds, dropped = kept_rows(expert_ids, slots, counts, capacity)
    return plan_from_bounds(tokens, pairs, bounds, T, needs_grad=train, dtype=dtype, dropped=dropped)


@contextlib.contextmanager
def _local_autograd():
    """Autograd back on inside a custom op's kernel (which runs below the autograd keys), for a
    local graph on plain tensors that never leaves the op."""
    DK = torch._C.DispatchKey
    include, exclude = torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set()
    with torch._C._ForceDispatchKeyGuard(include.remove(DK.ADInplaceOrView), exclude.remove(DK.AutogradFunctionality)):
        yield


def _stored(f: ExpertForm, w_in: list, w_out: Tensor) -> tuple:
    """kinds.as_stored, and which weights it flipped (their gradients flip back)."""
    g, w_in2, w_out2 = kinds.as_stored(f, tuple(w_in), w_out)
    return g, w_in2, w_out2, g.in_transposed != f.in_transposed, g.out_transposed != f.out_transposed


@torch.library.custom_op("fmoe::expert_rows", mutates_args=())
def _expert_rows(x: Tensor, gates: Tensor, expert_ids: Tensor, slots: Tensor, counts: Tensor, capacity: int,
                 w_in: list[Tensor], w_out: Tensor, b_in: Optional[Tensor], b_out: Optional[Tensor], form: str,
                 in_t: bool, out_t: bool, act: str, alpha: float, limit: float, order: str, train: bool,
                 keep: bool) -> list[Tensor]:
    """[y [T, O], *z] where z are the in-projection outputs padded to k*T rows (when ``keep``)."""
    f, w_in, w_out, _, _ = _stored(_form(form, in_t, out_t, act, alpha, limit), w_in, w_out)
    plan = _plan(expert_ids, slots, counts, capacity, x.shape[0], train, x.dtype)
    kern = select(plan, kinds._matrix_bytes(w_out))
    w_rows = gates.reshape(-1).index_select(0, plan.pairs)
    y, z, _ = kinds.forward(kern, f, x, w_rows, plan, w_in, b_in, w_out, b_out, order)
    if not keep:
        return [y]
    rows = expert_ids.numel()
    return [y, *(torch.cat([t, t.new_zeros(rows - t.shape[0], t.shape[1])]) for t in z)]


@_expert_rows.register_fake
def _(x, gates, expert_ids, slots, counts, capacity, w_in, w_out, b_in, b_out, form, in_t, out_t, act, alpha, limit,
      order, train, keep):
    y = x.new_empty((x.shape[0], w_out.shape[1] if out_t else w_out.shape[2]))
    if not keep:
        return [y]
    return [y, *(x.new_empty((expert_ids.numel(), w.shape[1] if in_t else w.shape[2])) for w in w_in)]


@torch.library.custom_op("fmoe::expert_rows_backward", mutates_args=())
def _expert_rows_backward(gy: Tensor, x: Tensor, gates: Tensor, expert_ids: Tensor, slots: Tensor, counts: Tensor,
                          capacity: int, w_in: list[Tensor], w_out: Tensor, b_in: Optional[Tensor],
                          b_out: Optional[Tensor], z: list[Tensor], form: str, in_t: bool, out_t: bool, act: str,
                          alpha: float, limit: float, order: str, need: list[bool]) -> list[Tensor]:
    """[gx, g_gates, g_bin, g_out, g_bout, *g_in]; an input whose gradient is not needed gets an
    empty tensor."""
    f, w_in, w_out, flip_in, flip_out = _stored(_form(form, in_t, out_t, act, alpha, limit), w_in, w_out)
    plan = _plan(expert_ids, slots, counts, capacity, x.shape[0], True, x.dtype)
    kern = select(plan, kinds._matrix_bytes(w_out))
    w_rows = gates.reshape(-1).index_select(0, plan.pairs)
    N = plan.num_rows
    zz = tuple(t[:N] for t in z) if z else kinds._projections(kern, f, x, plan, w_in, b_in)
    with _local_autograd():   # the activation's derivative: a local graph over z's rows
        gx, g_rows, g_bin, g_out, g_bout, *g_in = kinds._backward(kern, f, plan, gy, tuple(need), x, w_rows, b_in,
                                                                 w_out, b_out, w_in, zz)
    g_gates = None
    if g_rows is not None:
        g_gates = gates.new_zeros(gates.numel()).index_copy_(0, plan.pairs, g_rows).view_as(gates)
    if g_out is not None and flip_out:
        g_out = g_out.transpose(1, 2)
    g_in = [g.transpose(1, 2) if g is not None and flip_in else g for g in g_in]
    return [x.new_empty(0) if g is None else g for g in (gx, g_gates, g_bin, g_out, g_bout, *g_in)]


@_expert_rows_backward.register_fake
def _(gy, x, gates, expert_ids, slots, counts, capacity, w_in, w_out, b_in, b_out, z, form, in_t, out_t, act, alpha,
      limit, order, need):
    like = (x, gates, b_in, w_out, b_out, *w_in)
    return [torch.empty_like(t) if n and t is not None else x.new_empty(0) for t, n in zip(like, need)]


def _setup(ctx, inputs, output):
    (x, gates, ids, slots, counts, capacity, w_in, w_out, b_in, b_out, form, in_t, out_t, act, alpha, limit, order,
     train, keep) = inputs
    ctx.statics = (capacity, form, in_t, out_t, act, alpha, limit, order)
    ctx.n_in = len(w_in)
    ctx.need = [x.requires_grad, gates.requires_grad, b_in is not None and b_in.requires_grad, w_out.requires_grad,
                b_out is not None and b_out.requires_grad, *(w.requires_grad for w in w_in)]
    ctx.save_for_backward(x, gates, ids, slots, counts, w_out, b_in, b_out, *w_in, *output[1:])


def _backward(ctx, grads):
    capacity, form, in_t, out_t, act, alpha, limit, order = ctx.statics
    saved = ctx.saved_tensors
    x, gates, ids, slots, counts, w_out, b_in, b_out = saved[:8]
    w_in, z = list(saved[8:8 + ctx.n_in]), list(saved[8 + ctx.n_in:])
    g = torch.ops.fmoe.expert_rows_backward(grads[0].contiguous(), x, gates, ids, slots, counts, capacity, w_in,
                                            w_out, b_in, b_out, z, form, in_t, out_t, act, alpha, limit, order,
                                            ctx.need)
    gx, g_gates, g_bin, g_out, g_bout, *g_in = (t if n else None for t, n in zip(g, ctx.need))
    return (gx, g_gates, None, None, None, None, g_in, g_out, g_bin, g_bout) + (None,) * 9


torch.library.register_autograd("fmoe::expert_rows", _backward, setup_context=_setup)


def run(form: ExpertForm, x: Tensor, routing: Routing, w_in: tuple, w_out: Tensor, *,
        b_in: Optional[Tensor] = None, b_out: Optional[Tensor] = None, order: str = "fmoe",
        save: str = "projections") -> Tensor:
    """The experts of ``form`` on the routing's kept pairs, summed back to tokens: y [T, O] in
    x's dtype (:func:`fmoe.engine.kinds.run` on a rows plan, as one custom op).

    Args:
        form: the expert kind (its activation one of :data:`ACTIVATIONS`, or GPT-OSS).
        x: float [T, M]. routing: its :class:`~fmoe.Routing` (gates: ``routing.weights`` [k, T]).
        w_in, w_out, b_in, b_out: as :func:`fmoe.experts.expert_form` returns them, in x's dtype.
        order: 'fmoe' or 'eager'. save: 'projections' (the in-projection outputs kept for
            backward, [k*T, H] each, padded) or 'recompute'.
    """
    act = _activation_name(form)
    if act is None:
        raise ValueError(f"the traced expert op takes the activations {sorted(ACTIVATIONS)}; got {form.activation!r} "
                         "(other callables run on the layout plan)")
    ts = (x, routing.weights, b_in, w_out, b_out, *w_in)
    train = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)
    out = torch.ops.fmoe.expert_rows(x, routing.weights, routing.expert_ids, routing.slots, routing.counts,
                                     routing.capacity, list(w_in), w_out, b_in, b_out, form.form, form.in_transposed,
                                     form.out_transposed, act, float(form.alpha), float(form.limit), order, train,
                                     train and save == "projections")
    return out[0]


def _eager(*ts: Optional[Tensor]) -> bool:
    """True where :func:`fmoe.engine.kinds.run` runs a rows plan: eager mode (no torch.func transform, no torch.compile, no
    forward-AD level) on plain tensors without ``__torch_function__`` overrides. Elsewhere the
    caller runs the staged pipeline (its ops carry vmap, jvp and compile rules)."""
    if torch.compiler.is_compiling() or _functorch.maybe_current_level() is not None:
        return False
    if _fwd_ad._current_level >= 0:
        return False
    present = [t for t in ts if t is not None]
    if any(type(t) not in PLAIN_TENSORS for t in present):
        return False
    return not torch.overrides.has_torch_function(tuple(present))


DOORS = ("rows", "compiled", "layout")


def door(form: Optional[ExpertForm], tensors: tuple, *, precision=None, order: str = "fmoe", prescore: bool = False,
         plan: str = "auto") -> str:
    """The door of one call: 'rows' (a rows plan in eager mode, :func:`fmoe.engine.kinds.run`),
    'compiled' (the same plan and kernels inside this module's custom op, under torch.compile) or
    'layout' (a layout plan, the staged kernel: torch.func transforms, pre-scored gates, combine
    'grouped', ``MoESpec(plan='layout')``, what the custom op does not take). :func:`fmoe.moe`
    and each rank's :func:`fmoe.parallel.expert_stage` ask here.

    Args:
        form: the kind (None: custom experts, which have no compiled door).
        tensors: the call's x, gates and weights (packed weights, None biases allowed).
        precision: the quantized-training recipe or None. order: the combine order.
        prescore: gates scale the experts' inputs. plan: :attr:`fmoe.MoESpec.plan`.
    Returns:
        one of :data:`DOORS`.
    """
    if plan != "auto" or prescore or order not in kinds.ORDERS:
        return "layout"
    if _eager(*(t for t in tensors if t is None or isinstance(t, Tensor))):
        return "rows"
    if form is not None and applies(form, tensors, precision, order):
        return "compiled"
    return "layout"
