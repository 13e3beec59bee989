"""dispatch, combine and gate_grad as custom ops that compose with torch.func and torch.compile.

Layering (why three layers):

1. ``torch.ops.fmoe.{dispatch,combine,gate_grad}`` are ``torch.library`` custom
   ops. Backends register kernels on them (the pure-torch reference is the
   default; ``fmoe.ops.numba_cpu`` registers a CPU kernel). They carry a fake
   (meta) kernel for torch.compile, an autograd formula for plain autograd and
   ``opcheck``, and a vmap rule that folds the vmapped batch into the row axis
   so any mix of batched inputs is a single kernel call.
2. ``torch.autograd.Function`` fronts with ``setup_context``, ``backward``,
   ``jvp`` and ``generate_vmap_rule=True``. In torch 2.13 ``torch.func.grad``,
   ``vjp`` and ``jacrev`` fail on a bare custom op and ``jvp`` silently returns
   zero tangents; the Function front makes all of them work. Dynamo refuses a
   Function with a custom ``jvp``, so while compiling a jvp-less twin is used.
3. The public functions in :mod:`fmoe.ops` that take a :class:`~fmoe.Routing`.

The three ops are closed under differentiation (each is linear in each
argument): the backward of dispatch is combine + gate_grad, the backward of
combine is dispatch + gate_grad, and the backward of gate_grad is combine +
dispatch. So every derivative order runs through the same kernels.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.autograd.forward_ad as _fwd_ad
from torch import Tensor
from torch.utils import _python_dispatch

from . import reference


# --------------------------------------------------------------------------- custom ops

@torch.library.custom_op("fmoe::dispatch", mutates_args=())
def _dispatch_op(x: Tensor, pos: Tensor, weights: Optional[Tensor], num_rows: int) -> Tensor:
    return reference.dispatch(x, pos, weights, num_rows)


@torch.library.custom_op("fmoe::combine", mutates_args=())
def _combine_op(y: Tensor, pos: Tensor, weights: Optional[Tensor]) -> Tensor:
    return reference.combine(y, pos, weights)


@torch.library.custom_op("fmoe::gate_grad", mutates_args=())
def _gate_grad_op(a: Tensor, b: Tensor, pos: Tensor) -> Tensor:
    return reference.gate_grad(a, b, pos)


@_dispatch_op.register_fake
def _(x, pos, weights, num_rows):
    return x.new_empty(num_rows, x.shape[1])


@_combine_op.register_fake
def _(y, pos, weights):
    return y.new_empty(pos.shape[1], y.shape[1])


@_gate_grad_op.register_fake
def _(a, b, pos):
    return a.new_empty(pos.shape[0], pos.shape[1])


# Autograd formulas, shared by the custom ops (plain autograd on torch.ops.fmoe.*,
# checked by opcheck) and by the Function fronts below.

def _dispatch_setup(ctx, inputs, output):
    x, pos, w, num_rows = inputs
    ctx.save_for_backward(x, pos, w)
    ctx.save_for_forward(x, pos, w)
    ctx.num_rows = num_rows


def _dispatch_bwd(ctx, g):
    x, pos, w = ctx.saved_tensors
    gx = combine_raw(g, pos, w) if ctx.needs_input_grad[0] else None
    gw = gate_grad_raw(x, g, pos).to(w.dtype) if w is not None and ctx.needs_input_grad[2] else None
    return gx, None, gw, None


def _combine_setup(ctx, inputs, output):
    y, pos, w = inputs
    ctx.save_for_backward(y, pos, w)
    ctx.save_for_forward(y, pos, w)


def _combine_bwd(ctx, g):
    y, pos, w = ctx.saved_tensors
    gy = dispatch_raw(g, pos, w, y.shape[0]) if ctx.needs_input_grad[0] else None
    gw = gate_grad_raw(g, y, pos).to(w.dtype) if w is not None and ctx.needs_input_grad[2] else None
    return gy, None, gw


def _gate_grad_setup(ctx, inputs, output):
    a, b, pos = inputs
    ctx.save_for_backward(a, b, pos)
    ctx.save_for_forward(a, b, pos)


def _gate_grad_bwd(ctx, g):
    a, b, pos = ctx.saved_tensors
    ga = combine_raw(b, pos, g).to(a.dtype) if ctx.needs_input_grad[0] else None
    gb = dispatch_raw(a, pos, g, b.shape[0]).to(b.dtype) if ctx.needs_input_grad[1] else None
    return ga, gb, None


torch.library.register_autograd("fmoe::dispatch", _dispatch_bwd, setup_context=_dispatch_setup)
torch.library.register_autograd("fmoe::combine", _combine_bwd, setup_context=_combine_setup)
torch.library.register_autograd("fmoe::gate_grad", _gate_grad_bwd, setup_context=_gate_grad_setup)


# --------------------------------------------------------------------------- vmap rules

def _batched(t: Optional[Tensor], dim: Optional[int], size: int) -> Optional[Tensor]:
    """Move the vmapped dim to the front, materialising it if absent."""
    if t is None:
        return None
    if dim is None:
        return t.unsqueeze(0).expand(size, *t.shape)
    return t.movedim(dim, 0)


def _fold_pos(pos: Tensor, w: Optional[Tensor], rows: int) -> tuple[Tensor, Optional[Tensor]]:
    """[B, k, T] positions into rows of [B*R] -> [k, B*T] (batch b's rows shifted by b*R)."""
    B, k, T = pos.shape
    shift = (torch.arange(B, device=pos.device) * rows).view(B, 1, 1)
    folded = torch.where(pos >= 0, pos + shift, torch.full_like(pos, -1))
    folded = folded.permute(1, 0, 2).reshape(k, B * T)
    if w is not None:
        w = w.permute(1, 0, 2).reshape(k, B * T)
    return folded, w


@torch.library.register_vmap("fmoe::dispatch")
def _dispatch_vmap(info, in_dims, x, pos, weights, num_rows):
    B = info.batch_size
    xb = _batched(x, in_dims[0], B)
    pb = _batched(pos, in_dims[1], B)
    wb = _batched(weights, in_dims[2], B)
    fp, fw = _fold_pos(pb, wb, num_rows)
    out = torch.ops.fmoe.dispatch(xb.reshape(B * xb.shape[1], xb.shape[2]), fp, fw, B * num_rows)
    return out.reshape(B, num_rows, -1), 0


@torch.library.register_vmap("fmoe::combine")
def _combine_vmap(info, in_dims, y, pos, weights):
    B = info.batch_size
    yb = _batched(y, in_dims[0], B)
    pb = _batched(pos, in_dims[1], B)
    wb = _batched(weights, in_dims[2], B)
    R = yb.shape[1]
    fp, fw = _fold_pos(pb, wb, R)
    out = torch.ops.fmoe.combine(yb.reshape(B * R, yb.shape[2]), fp, fw)
    return out.reshape(B, pb.shape[2], -1), 0


@torch.library.register_vmap("fmoe::gate_grad")
def _gate_grad_vmap(info, in_dims, a, b, pos):
    B = info.batch_size
    ab = _batched(a, in_dims[0], B)
    bb = _batched(b, in_dims[1], B)
    pb = _batched(pos, in_dims[2], B)
    R = bb.shape[1]
    k, T = pb.shape[1], pb.shape[2]
    fp, _ = _fold_pos(pb, None, R)
    out = torch.ops.fmoe.gate_grad(ab.reshape(B * T, ab.shape[2]), bb.reshape(B * R, bb.shape[2]), fp)
    return out.reshape(k, B, T), 1


# --------------------------------------------------------------------------- fronts

class _DispatchBase(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x, pos, w, num_rows):
        return torch.ops.fmoe.dispatch(x, pos, w, num_rows)

    setup_context = staticmethod(_dispatch_setup)
    backward = staticmethod(_dispatch_bwd)


class _Dispatch(_DispatchBase):
    @staticmethod
    def jvp(ctx, tx, tpos, tw, tnum_rows):
        x, pos, w = ctx.saved_tensors
        out = None
        if tx is not None:
            out = dispatch_raw(tx, pos, w, ctx.num_rows)
        if tw is not None:
            term = dispatch_raw(x, pos, tw, ctx.num_rows)
            out = term if out is None else out + term
        return out if out is not None else x.new_zeros(ctx.num_rows, x.shape[1])


class _CombineBase(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(y, pos, w):
        return torch.ops.fmoe.combine(y, pos, w)

    setup_context = staticmethod(_combine_setup)
    backward = staticmethod(_combine_bwd)


class _Combine(_CombineBase):
    @staticmethod
    def jvp(ctx, ty, tpos, tw):
        y, pos, w = ctx.saved_tensors
        out = None
        if ty is not None:
            out = combine_raw(ty, pos, w)
        if tw is not None:
            term = combine_raw(y, pos, tw)
            out = term if out is None else out + term
        return out if out is not None else y.new_zeros(pos.shape[1], y.shape[1])


class _GateGradBase(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(a, b, pos):
        return torch.ops.fmoe.gate_grad(a, b, pos)

    setup_context = staticmethod(_gate_grad_setup)
    backward = staticmethod(_gate_grad_bwd)


class _GateGrad(_GateGradBase):
    @staticmethod
    def jvp(ctx, ta, tb, tpos):
        a, b, pos = ctx.saved_tensors
        out = None
        if ta is not None:
            out = gate_grad_raw(ta, b, pos)
        if tb is not None:
            term = gate_grad_raw(a, tb, pos)
            out = term if out is None else out + term
        return out if out is not None else a.new_zeros(pos.shape)


def _compiling() -> bool:
    return torch.compiler.is_compiling()


_functorch = torch._C._functorch
_has_torch_function = torch.overrides.has_torch_function


def forward_only(*ts: Optional[Tensor]) -> bool:
    """True when a Function front's ``apply`` could only run its ``forward``.

    That is: not compiling, no torch.func transform (grad, vjp, jvp, vmap) active, no
    forward-AD dual level open, no ``__torch_function__`` override among the inputs, and
    either grad mode is off or no input requires grad. Then ``apply`` records nothing and
    returns ``forward(*args)``, so calling the forward directly is the same computation
    without ``apply``'s per-call cost (argument binding through ``inspect``: ~60 us).
    """
    if _compiling() or _functorch.maybe_current_level() is not None or _fwd_ad._current_level >= 0:
        return False
    present = tuple(t for t in ts if t is not None)
    if _has_torch_function(present):
        return False
    if not torch.is_grad_enabled():
        return True
    return not any(t.requires_grad for t in present)


# The CPU kernel each op's CPU registration runs (a backend fills this when it registers:
# fmoe.ops.numba_cpu). The forward-only path calls it without the dispatcher (~30 us per op)
# when that is the same call: plain CPU tensors, no dispatch mode, no profiler.
CPU_KERNELS: dict = {}
PLAIN_TENSORS = (Tensor, torch.nn.Parameter)   # no subclass, no __torch_function__ of its own


def _cpu_kernel(name: str, ts):
    fn = CPU_KERNELS.get(name)
    if fn is None:
        return None
    for t in ts:
        if t is not None and (type(t) not in PLAIN_TENSORS or t.device.type != "cpu"):
            return None
    if _python_dispatch._get_current_dispatch_mode() is not None or torch._C._autograd._profiler_enabled():
        return None
    return fn


def dispatch_raw(x: Tensor, pos: Tensor, weights: Optional[Tensor], num_rows: int) -> Tensor:
    """Differentiable ``D[pos[j,t]] = w[j,t] * x[t]`` on flat positions; [T, M] -> [R, M]."""
    if forward_only(x, pos, weights):
        fn = _cpu_kernel("dispatch", (x, pos, weights))
        if fn is not None:
            return fn(x, pos, weights, num_rows)
        return torch.ops.fmoe.dispatch(x, pos, weights, num_rows)
    fn = _DispatchBase if _compiling() else _Dispatch
    return fn.apply(x, pos, weights, num_rows)


def combine_raw(y: Tensor, pos: Tensor, weights: Optional[Tensor]) -> Tensor:
    """Differentiable ``out[t] = sum_j w[j,t] * y[pos[j,t]]``; [R, M] -> [T, M]."""
    if forward_only(y, pos, weights):
        fn = _cpu_kernel("combine", (y, pos, weights))
        if fn is not None:
            return fn(y, pos, weights)
        return torch.ops.fmoe.combine(y, pos, weights)
    fn = _CombineBase if _compiling() else _Combine
    return fn.apply(y, pos, weights)


def gate_grad_raw(a: Tensor, b: Tensor, pos: Tensor) -> Tensor:
    """Differentiable ``g[j,t] = <a[t], b[pos[j,t]]>``; ([T, M], [R, M]) -> [k, T]."""
    if forward_only(a, b, pos):
        fn = _cpu_kernel("gate_grad", (a, b, pos))
        if fn is not None:
            return fn(a, b, pos)
        return torch.ops.fmoe.gate_grad(a, b, pos)
    fn = _GateGradBase if _compiling() else _GateGrad
    return fn.apply(a, b, pos)
