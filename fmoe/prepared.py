"""One layer's inference calls with what its spec and parameters fix decided once.

    step = fmoe.prepare(params, spec)
    y, aux = step(x)                     # fmoe.moe(params, x, spec), bit for bit

:func:`fmoe.moe` decides on every call what runs: it checks the pytree against the spec, asks
which door the call takes (:func:`fmoe.engine.traced.door`), makes the plan, asks whether the
fused packed stage takes it (:func:`fmoe.engine.kinds.fused_stage`) and checks the stage's
weights. At decode on a CPU each of these is microseconds, and together they were a quarter to two
fifths of a patched model's MoE block (each call's Python and small tensor ops between the router's
native call and the experts' one; BENCHMARKS.md, "Prepared decode calls"). A prepared call makes the
decisions that the spec and the parameters' types and shapes fix once (the pytree check, the
expert kind's form, :func:`fmoe.engine.kinds.fused_act`, the stage's weight operands,
:func:`fmoe.quant.packed.stage_weights`, and those of a packed shared SwiGLU,
:func:`fmoe.experts.shared_stage`) and on each call checks what can change between calls: x
(type, dtype, shape, device), grad mode and the parameters' ``requires_grad``, torch.compile,
torch.func and forward-AD levels, the biases' dtypes (:func:`fmoe.engine.kinds.fused_operands_ok`).

The fast lane is :func:`fmoe.moe`'s own route for such a call, step for step: the native route
(:func:`fmoe.routers.route_native`), its rows' gates, the fused stage's one native call on the
same operands, the shared experts and :func:`fmoe.moe.finish`. It runs where every weight of the
routed experts is packed (:class:`fmoe.quant.QuantizedTensor`) and the call is an eager CPU call of
at most :data:`fmoe.routers.NATIVE_MAX_TOKENS` tokens that needs no gradient, with a router the
native route runs; every other call is ``fmoe.moe(params, x, spec)`` itself. Inference only: no
communicator, gate noise, replayed routing or ``training``.

The prepared call holds the parameter objects it was given (a copy of the pytree's containers,
not of its tensors): in-place updates of them are seen (``load_state_dict``, a ``.data`` swap of a
float tensor); a leaf replaced in the caller's pytree afterwards is not: prepare again
(:meth:`PreparedMoE.holds` says whether a pytree still has this call's leaves).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .engine import kinds as _kinds
from .engine import traced as _traced
from .experts import expert_dtype, expert_form, run_shared_stage, shared_experts, shared_stage
from .moe import MoEAux, MoESpec, balance_loss, check_params, finish, moe
from .routers import native_applies, route_native

__all__ = ["PreparedMoE", "prepare"]


def _copy_tree(p):
    # the pytree's dicts copied, its leaves shared: later edits of the caller's dicts leave this call alone
    return {k: _copy_tree(v) for k, v in p.items()} if isinstance(p, dict) else p


def _leaves(p) -> list:
    return [v for x in p.values() for v in _leaves(x)] if isinstance(p, dict) else [p]


def _same_leaf(a, b) -> bool:
    """b is the leaf a, or (a QuantizedTensor made afresh from the same stored tensors, as a
    module's FP8 weights are on every read) the same format, shape and storage."""
    if a is b:
        return True
    from .quant import QuantizedTensor   # optional: low-precision weights
    if not (isinstance(a, QuantizedTensor) and isinstance(b, QuantizedTensor)):
        return False
    if (a.fmt, a.shape, a.block) != (b.fmt, b.shape, b.block):
        return False
    pairs = ((a.data, b.data), (a.scales, b.scales), (a.global_scale, b.global_scale))
    return all((s is None and t is None) or (s is not None and t is not None and s.data_ptr() == t.data_ptr()
                                              and s.shape == t.shape and s.stride() == t.stride()
                                              and s.dtype == t.dtype) for s, t in pairs)


class PreparedMoE:
    """``fmoe.moe(params, x, spec)`` for one layer's inference calls (:func:`prepare`).

    Attributes:
        params: the pytree's containers as given to :func:`prepare` (its leaves, not copies).
        spec: the layer's :class:`fmoe.MoESpec`.
        fast: whether calls can take the fast lane (every routed expert weight packed, a fused
            kind, a native router, spec settings the lane runs); False: every call is ``fmoe.moe``'s.
    """

    __slots__ = ("params", "spec", "fast", "_leaves", "_form", "_weights", "_biases", "_shared")

    def __init__(self, params: dict, spec: MoESpec):
        check_params(params, spec)   # raises as fmoe.moe would, naming the leaf
        self.params = _copy_tree(params)
        self.spec = spec
        self._leaves = _leaves(self.params)
        self._form = self._weights = self._biases = self._shared = None
        self.fast = self._prepare_lane()

    def _prepare_lane(self) -> bool:
        spec, es = self.spec, self.spec.experts
        if (es.type == "custom" or es.takes_plan or es.precision is not None or spec.plan != "auto"
                or not spec.is_postscore or spec.batch_prioritized or spec.combine not in _kinds.LAYOUT_ORDERS):
            return False
        kw = expert_form(es, self.params["experts"])
        w_in, w_out, b_in, b_out = tuple(kw["w_in"]), kw["w_out"], kw["b_in"], kw["b_out"]
        act = _kinds.fused_act(kw["form"], w_in, w_out)
        if act is None:
            return False
        from .quant import packed   # optional: low-precision weights
        self._form = kw["form"]
        self._weights = packed.stage_weights(w_in, w_out, act=act, activations="int8" if kw["form"].int8 else "float")
        self._biases = (b_in, b_out)
        if spec.shared == "swiglu":   # a packed shared SwiGLU: its stage weights once too
            self._shared = shared_stage(self.params["shared"], activation=es.act())
        return True

    def holds(self, params: dict) -> bool:
        """Whether ``params`` has this call's leaves in the same places (the same objects, or
        QuantizedTensors over the same stored tensors): then this call runs that pytree."""
        new = _leaves(params)
        return len(new) == len(self._leaves) and all(_same_leaf(a, b) for a, b in zip(self._leaves, new))

    def __call__(self, x: Tensor) -> tuple[Tensor, MoEAux]:
        """y with x's leading dims and dtype, and the :class:`fmoe.MoEAux`: those of
        ``fmoe.moe(self.params, x, self.spec)``, bit for bit."""
        spec, params = self.spec, self.params
        if not self.fast or type(x) is not Tensor or x.dim() < 2 or x.shape[-1] != spec.model_dim:
            return moe(params, x, spec)   # (its errors for a bad x)
        tokens = x if x.dim() == 2 else x.reshape(-1, spec.model_dim)
        gate, experts = params["gate"], params["experts"]
        b_in, b_out = self._biases
        if not (native_applies(gate, tokens, spec.gate, False) and _traced._eager(tokens, b_in, b_out)):
            return moe(params, x, spec)
        native = route_native(gate, tokens, spec.gate, num_experts=spec.num_experts, normalize=spec.normalize_gate,
                              alignment=spec.alignment, fraction=spec.balance_loss and spec.is_gshard_loss)
        if native is None:
            return moe(params, x, spec)
        routing, out, loss, rows = native
        dt = expert_dtype(experts, x.dtype)
        compute = tokens if tokens.dtype == dt else tokens.to(dt)
        w_rows = rows.gates(routing.weights)
        if rows.bounds is None or not _kinds.fused_operands_ok(compute, w_rows, b_in, b_out):
            return moe(params, x, spec)
        from .quant import packed   # optional: low-precision weights
        order, form = spec.combine, self._form
        if spec.shared is None:
            shared = None
        elif self._shared is not None and tokens.dtype in (torch.float32, torch.bfloat16):
            # shared_experts' one stage call (swiglu_mlp's: the lane is an eager no-grad CPU call), its weights made once
            shared = (run_shared_stage(self._shared, tokens), None)
        else:
            shared = shared_experts(spec.shared, params, tokens, activation=spec.experts.act())
        y = packed.run_stage(self._weights, compute, rows.tokens, rows.offsets, w_rows, b_in=b_in, b_out=b_out,
                             order=order, pairs=rows.pairs, num_slots=routing.k, alpha=form.alpha, limit=form.limit)
        return finish(x, y, shared, balance_loss(spec, routing, out, loss), routing, rows.dropped, out)


def prepare(params: dict, spec: MoESpec) -> PreparedMoE:
    """A layer's inference call: ``prepare(params, spec)(x)`` is ``fmoe.moe(params, x, spec)`` bit
    for bit, with what ``spec`` and ``params`` fix decided here once (:mod:`fmoe.prepared`).

    Args:
        params: the layer's pytree (:func:`fmoe.init_params`; packed expert weights take the fast lane).
        spec: its :class:`fmoe.MoESpec`.
    Raises:
        ValueError where ``params`` does not fit ``spec`` (:func:`fmoe.check_params`).
    """
    return PreparedMoE(params, spec)
