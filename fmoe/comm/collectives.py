"""Differentiable collectives that compose with torch.func and torch.compile.

Layering mirrors :mod:`fmoe.ops.primitives`:

1. ``torch.ops.fmoe.{all_to_all, all_gather, all_to_all_v}`` custom ops take
   an int communicator handle (:mod:`.registry`), so torch.compile traces them
   as opaque calls with a fake kernel, and carry vmap rules (the vmapped batch
   rides inside every chunk, so all ranks must vmap with the same batch size).
2. ``torch.autograd.Function`` fronts give grad/vjp/jvp under torch.func:
   each collective is linear, its backward is the dual collective
   (all_to_all with the axes swapped; all_gather -> reduce-scatter;
   all_to_all_v with the counts swapped) and its jvp is itself.
   Dynamo refuses a custom jvp, so a jvp-less twin is used while compiling.
3. The public functions below, taking the communicator object.

The raw ``comm.all_to_all`` etc. of a :class:`~fmoe.comm.Communicator` are not
differentiable; use these in models.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from .buffers import recv_buffer
from .layout import a2a_out_shape, norm_axis
from .registry import handle_of, lookup


def _fresh(out: Tensor, x: Tensor) -> Tensor:
    # custom ops may not return an alias of an input; size-1 communicators do.
    if out.numel() and out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        return out.clone()
    return out


# --------------------------------------------------------------------------- custom ops

@torch.library.custom_op("fmoe::all_to_all", mutates_args=())
def _a2a_op(x: Tensor, handle: int, concat_axis: int, split_axis: int) -> Tensor:
    return _fresh(lookup(handle).all_to_all(x, concat_axis, split_axis), x)


@_a2a_op.register_fake
def _(x, handle, concat_axis, split_axis):
    return x.new_empty(a2a_out_shape(x.shape, concat_axis, split_axis, lookup(handle).size))


@torch.library.custom_op("fmoe::all_gather", mutates_args=())
def _ag_op(x: Tensor, handle: int, axis: int) -> Tensor:
    return _fresh(lookup(handle).all_gather(x.contiguous(), axis), x)


@_ag_op.register_fake
def _(x, handle, axis):
    shape = list(x.shape)
    shape[axis] *= lookup(handle).size
    return x.new_empty(shape)


@torch.library.custom_op("fmoe::all_to_all_v", mutates_args=())
def _a2av_op(x: Tensor, handle: int, send_counts: list[int], recv_counts: list[int]) -> Tensor:
    return _fresh(lookup(handle).all_to_all_v(x.contiguous(), send_counts, recv_counts), x)


@_a2av_op.register_fake
def _(x, handle, send_counts, recv_counts):
    return x.new_empty(sum(recv_counts), *x.shape[1:])


@torch.library.custom_op("fmoe::gather_all_to_all_v", mutates_args=())
def _ga2av_op(x: Tensor, rows: Tensor, handle: int, send_counts: list[int], recv_counts: list[int]) -> Tensor:
    """``all_to_all_v(x[rows], ...)``: a communicator with ``gather_all_to_all_v`` (MPIComm) sends the
    rows from where they lie in x; any other gathers them first (the same bytes on the wire)."""
    comm = lookup(handle)
    gather = getattr(comm, "gather_all_to_all_v", None)
    if gather is None:
        # the gathered rows go into a pooled buffer (free again once the exchange has read it): a
        # fresh one of tens of MB would page-fault on every step
        rows_buf = recv_buffer(comm, (rows.shape[0], *x.shape[1:]), x.dtype, x.device)
        return _fresh(comm.all_to_all_v(torch.index_select(x, 0, rows, out=rows_buf), send_counts, recv_counts), x)
    return _fresh(gather(x.contiguous(), rows, send_counts, recv_counts), x)


@_ga2av_op.register_fake
def _(x, rows, handle, send_counts, recv_counts):
    return x.new_empty(sum(recv_counts), *x.shape[1:])


@torch.library.custom_op("fmoe::exchange_rows", mutates_args=())
def _xrows_op(x: Tensor, rows: Optional[Tensor], place: Optional[Tensor], handle: int, send_counts: list[int],
              recv_counts: list[int]) -> Tensor:
    """``all_to_all_v(x[rows], ...)`` with received row i put in row ``place[i]`` of the result (rows
    or place None: in order), on a communicator with ``exchange_rows`` (MPIComm: the rows are read
    and written where they lie; TorchDistComm: gathered into and placed from its buffers). Others
    have no such method: :func:`fmoe.parallel` takes them through ``gather_all_to_all_v`` and
    ``all_to_all_v`` instead."""
    comm = lookup(handle)
    move = getattr(comm, "exchange_rows", None)
    if move is None:   # the same type on every rank: every rank raises here
        raise TypeError(f"exchange_rows needs a communicator with an exchange_rows method (MPIComm, "
                        f"TorchDistComm), got {type(comm).__name__}: use fmoe.comm.all_to_all_v after an index_select")
    return _fresh(move(x.contiguous(), send_counts, recv_counts, rows=rows, place=place), x)


@_xrows_op.register_fake
def _(x, rows, place, handle, send_counts, recv_counts):
    return x.new_empty(sum(recv_counts), *x.shape[1:])


def _front(t: Tensor, dim, size: int) -> Tensor:
    return t.unsqueeze(0).expand(size, *t.shape) if dim is None else t.movedim(dim, 0)


@torch.library.register_vmap("fmoe::all_to_all")
def _a2a_vmap(info, in_dims, x, handle, concat_axis, split_axis):
    xb = _front(x, in_dims[0], info.batch_size).contiguous()
    return torch.ops.fmoe.all_to_all(xb, handle, concat_axis + 1, split_axis + 1), 0


@torch.library.register_vmap("fmoe::all_gather")
def _ag_vmap(info, in_dims, x, handle, axis):
    xb = _front(x, in_dims[0], info.batch_size)
    return torch.ops.fmoe.all_gather(xb, handle, axis + 1), 0


@torch.library.register_vmap("fmoe::all_to_all_v")
def _a2av_vmap(info, in_dims, x, handle, send_counts, recv_counts):
    xb = _front(x, in_dims[0], info.batch_size)  # [B, rows, ...]: rows must stay dim 0
    rows = xb.movedim(0, 1).contiguous()
    out = torch.ops.fmoe.all_to_all_v(rows.reshape(rows.shape[0], -1), handle, send_counts, recv_counts)
    return out.reshape(out.shape[0], *rows.shape[1:]).movedim(1, 0), 0


# --------------------------------------------------------------------------- fronts

class _A2ABase(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x, handle, concat_axis, split_axis):
        return torch.ops.fmoe.all_to_all(x, handle, concat_axis, split_axis)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.handle, ctx.concat_axis, ctx.split_axis = inputs

    @staticmethod
    def backward(ctx, g):
        return _a2a(g, ctx.handle, ctx.split_axis, ctx.concat_axis), None, None, None


class _A2A(_A2ABase):
    @staticmethod
    def jvp(ctx, tx, *_):
        return _a2a(tx, ctx.handle, ctx.concat_axis, ctx.split_axis)


class _AGBase(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x, handle, axis):
        return torch.ops.fmoe.all_gather(x, handle, axis)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.handle, ctx.axis = inputs

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter(g, ctx.handle, ctx.axis), None, None


class _AG(_AGBase):
    @staticmethod
    def jvp(ctx, tx, *_):
        return _ag(tx, ctx.handle, ctx.axis)


class _A2AVBase(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x, handle, send_counts, recv_counts):
        return torch.ops.fmoe.all_to_all_v(x, handle, send_counts, recv_counts)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.handle, ctx.send, ctx.recv = inputs

    @staticmethod
    def backward(ctx, g):
        return _a2av(g, ctx.handle, ctx.recv, ctx.send), None, None, None


class _A2AV(_A2AVBase):
    @staticmethod
    def jvp(ctx, tx, *_):
        return _a2av(tx, ctx.handle, ctx.send, ctx.recv)


def _pick(eager, compiled):
    return compiled if torch.compiler.is_compiling() else eager


def _a2a(x, handle, concat_axis, split_axis):
    return _pick(_A2A, _A2ABase).apply(x, handle, concat_axis, split_axis)


def _ag(x, handle, axis):
    return _pick(_AG, _AGBase).apply(x, handle, axis)


def _a2av(x, handle, send, recv):
    return _pick(_A2AV, _A2AVBase).apply(x, handle, list(send), list(recv))


def _reduce_scatter(x, handle, axis):
    # Sum over ranks of x, each rank keeping its 1/W slice of ``axis``: an
    # all-to-all that splits and concatenates along ``axis`` puts every
    # source's copy of my slice side by side; summing them finishes the job.
    world = lookup(handle).size
    if world == 1:
        return x
    y = _a2a(x, handle, axis, axis)
    shape = list(y.shape)
    shape[axis:axis + 1] = [world, shape[axis] // world]
    return y.reshape(shape).sum(axis)


# --------------------------------------------------------------------------- public

def all_to_all(x: Tensor, comm, concat_axis: int, split_axis: int) -> Tensor:
    """Differentiable JAX-style all-to-all (spec §12.2).

    Args:
        x: any dtype/shape; ``x.shape[split_axis]`` divisible by ``comm.size``.
        comm: a Communicator (same on every rank of the group).
        concat_axis, split_axis: see :meth:`Communicator.all_to_all`.
    Returns:
        x's dtype; ``split_axis`` shrunk W times, ``concat_axis`` grown W times.
        Backward is the all-to-all with the axes swapped.
    """
    if comm.size == 1:
        return x
    a = norm_axis(concat_axis, x.dim(), "concat_axis")
    b = norm_axis(split_axis, x.dim(), "split_axis")
    return _a2a(x, handle_of(comm), a, b)


def all_gather(x: Tensor, comm, axis: int = 0) -> Tensor:
    """Differentiable all-gather along ``axis``; backward is a reduce-scatter (sum)."""
    if comm.size == 1:
        return x
    return _ag(x, handle_of(comm), norm_axis(axis, x.dim()))


def reduce_scatter(x: Tensor, comm, axis: int = 0) -> Tensor:
    """Differentiable reduce-scatter (sum) along ``axis``; backward is an all-gather."""
    if comm.size == 1:
        return x
    return _reduce_scatter(x, handle_of(comm), norm_axis(axis, x.dim()))


def all_to_all_v(x: Tensor, comm, send_counts: Sequence[int], recv_counts: Sequence[int]) -> Tensor:
    """Differentiable variable all-to-all of rows (dim 0); backward swaps the counts.

    Args:
        x: [sum(send_counts), ...].
        send_counts, recv_counts: W Python ints each (recv_counts must be what
            the peers send: exchange counts first, e.g. with ``comm.all_to_all``).
    Returns:
        [sum(recv_counts), ...], rows grouped by source rank.
    """
    send, recv = [int(c) for c in send_counts], [int(c) for c in recv_counts]
    if len(send) != comm.size or len(recv) != comm.size:
        raise ValueError(f"all_to_all_v: need {comm.size} send and recv counts, got {len(send)} and {len(recv)}")
    if sum(send) != x.shape[0]:
        raise ValueError(f"all_to_all_v: send_counts sum to {sum(send)} but x has {x.shape[0]} rows")
    if comm.size == 1:
        return x
    return _a2av(x, handle_of(comm), send, recv)
