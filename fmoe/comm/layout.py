"""Pure reshapes shared by every communicator: the flexible all-to-all as
"move the W chunks to the front, exchange rows of a [W, ...] buffer, move the
source axis to the concatenation axis".

Backends only implement the exchange of a contiguous [W, ...] buffer (row w
goes to rank w; row u of the result came from rank u); these helpers turn that
into JAX-style ``all_to_all(x, concat_axis, split_axis)`` (spec §12.2).
"""
from __future__ import annotations

import functools
from typing import Optional

import numpy as np
import torch
from torch import Tensor


def plain(t: Tensor) -> Tensor:
    """The underlying tensor of a torch.func-wrapped one (GradTrackingTensor, BatchedTensor, ...).

    The raw collectives of a Communicator are not differentiable; code that
    runs them on metadata (capacity, counts, fingerprints) inside a torch.func
    transform hands them wrapped tensors, which have no storage to send.
    Batched (vmapped) tensors cannot be unwrapped meaningfully and are refused.
    """
    f = torch._C._functorch
    while f.is_functorch_wrapped_tensor(t):
        if f.is_batchedtensor(t):
            raise ValueError("a raw collective got a vmapped tensor; use fmoe.comm.all_to_all & co. under vmap")
        t = f.get_unwrapped(t)
    return t


def raw_collective(method):
    """Decorator for a Communicator's (non-differentiable) collectives.

    Inside a torch.func transform even fresh tensors are wrapped and have no
    storage, so MPI or gloo could not read them. The method gets the plain
    tensor and runs with functorch disabled; its result is a plain tensor, a
    constant to any surrounding transform (differentiable collectives go
    through :mod:`fmoe.comm.collectives`).
    """
    @functools.wraps(method)
    def wrapper(self, x, *args, **kwargs):
        with torch._C._DisableFuncTorch():
            return method(self, plain(x), *args, **kwargs)
    return wrapper


def norm_axis(axis: int, ndim: int, what: str = "axis") -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"{what}={axis} is out of range for a tensor with {ndim} dims")
    return axis % ndim


def chunks_to_front(x: Tensor, split_axis: int, world: int) -> Tensor:
    """x [..., W*c, ...] (split along ``split_axis``) -> contiguous [W, ..., c, ...].

    A no-copy view when ``split_axis`` is 0 and x is contiguous (the common
    dispatch case), so MPI can send straight from the caller's buffer.
    """
    b = norm_axis(split_axis, x.dim(), "split_axis")
    size = x.shape[b]
    if size % world:
        raise ValueError(f"all_to_all: split axis {b} has size {size}, not divisible by the "
                         f"{world} ranks of the communicator (shape {tuple(x.shape)})")
    shape = tuple(x.shape[:b]) + (world, size // world) + tuple(x.shape[b + 1:])
    if b == 0:
        return x.reshape(shape).contiguous()
    return x.reshape(shape).movedim(b, 0).contiguous()


def front_to_concat(y: Tensor, concat_axis: int) -> Tensor:
    """y [W, *chunk] (row u from rank u) -> chunk with axis ``concat_axis`` grown W times,
    blocks in source-rank order."""
    chunk = tuple(y.shape[1:])
    a = norm_axis(concat_axis, len(chunk), "concat_axis")
    world = y.shape[0]
    out_shape = chunk[:a] + (world * chunk[a],) + chunk[a + 1:]
    if a == 0:
        return y.reshape(out_shape)  # already source-major: free
    return y.movedim(0, a).reshape(out_shape)


gathered_to_axis = front_to_concat  # all_gather: [W, *x] -> x concatenated along axis


def a2a_out_shape(shape, concat_axis: int, split_axis: int, world: int) -> list:
    """Output shape of the flexible all-to-all (for fake/meta kernels)."""
    out = list(shape)
    b = norm_axis(split_axis, len(out), "split_axis")
    a = norm_axis(concat_axis, len(out), "concat_axis")
    if out[b] % world:
        raise ValueError(f"all_to_all: split axis {b} has size {out[b]}, not divisible by {world} ranks")
    out[b] //= world
    out[a] *= world
    return out


def a2a_front(x: Tensor, concat_axis: int, split_axis: int, world: int) -> tuple[Tensor, int]:
    """Validated all-to-all arguments of every backend: (chunks moved to the front, concat axis).

    Raises ValueError naming the problem (the backend tells its peers before re-raising)."""
    if x.dim() == 0:
        raise ValueError("all_to_all needs at least one dimension")
    concat_axis = norm_axis(concat_axis, x.dim(), "concat_axis")
    return chunks_to_front(x, split_axis, world), concat_axis


def a2av_counts(x: Tensor, send_counts, recv_counts, world: int):
    """(send, recv, error or None): all-to-all-v counts as ints, checked against x's rows."""
    send, recv = [int(c) for c in send_counts], [int(c) for c in recv_counts]
    err = None
    if x.dim() == 0 or len(send) != world or len(recv) != world or sum(send) != x.shape[0] \
            or min(send + recv) < 0:
        err = ValueError(f"all_to_all_v: need {world} non-negative counts each with sum(send_counts) == "
                         f"rows; got send={send}, recv={recv}, rows={x.shape[0] if x.dim() else None}")
    return send, recv, err


def place_error(place: Tensor, R: int) -> Optional[ValueError]:
    """Why ``place`` cannot say where each of R received rows goes (None: it can): it must be a
    permutation of [0, R), or a result row would be left unwritten."""
    if place.dtype != torch.int64 or place.dim() != 1 or place.device.type != "cpu" or not place.is_contiguous():
        return ValueError(f"exchange_rows: place must be a contiguous int64 CPU vector, got {place.dtype} "
                          f"{tuple(place.shape)} on {place.device}")
    if place.shape[0] != R:
        return ValueError(f"exchange_rows: place must hold one destination per received row, {R} "
                          f"(sum(recv_counts)), got {place.shape[0]}")
    if R:
        lo, hi = torch.aminmax(place)
        if int(lo) < 0 or int(hi) >= R:
            return ValueError(f"exchange_rows: place must lie in [0, {R}) (the result's rows), got entries from "
                              f"{int(lo)} to {int(hi)}")
        if int(torch.bincount(place, minlength=R).max()) > 1:
            return ValueError("exchange_rows: place must send each received row to its own result row (a "
                              "permutation of [0, sum(recv_counts))); it repeats an entry")
    return None


def rows_error(x: Tensor, rows: Tensor) -> Optional[ValueError]:
    """Why ``rows`` cannot index the rows of x (None: it can)."""
    if rows.dtype != torch.int64 or rows.dim() != 1 or rows.device.type != "cpu" or not rows.is_contiguous():
        return ValueError(f"gather_all_to_all_v: rows must be a contiguous int64 CPU vector, got {rows.dtype} "
                          f"{tuple(rows.shape)} on {rows.device}")
    if x.dim() == 0:
        return ValueError("gather_all_to_all_v: x needs a row dimension, got a 0-d tensor")
    if rows.numel():
        lo, hi = torch.aminmax(rows)
        if int(lo) < 0 or int(hi) >= x.shape[0]:
            return ValueError(f"gather_all_to_all_v: rows must lie in [0, {x.shape[0]}) (x's rows), got entries "
                              f"from {int(lo)} to {int(hi)}")
    return None


def runs(dest: np.ndarray) -> list:
    """[(start, stop)] of the runs of ``dest`` that count up by one (destinations of consecutive rows)."""
    if dest.size == 0:
        return []
    cut = (np.flatnonzero(np.diff(dest) != 1) + 1).tolist()
    return list(zip([0] + cut, cut + [dest.size]))


# Rows whose destinations break into more runs than this are gathered once and placed once.
MAX_RUNS = 64


def move_rows(x: Tensor, rows: Optional[Tensor], place: Optional[Tensor], out: Tensor) -> None:
    """``out[place] = x[rows]`` (rows None: x's rows in order; place None: out's rows in order),
    each row copied once. Consecutive rows read (rows) or written (place) in runs are one block
    copy per run where there are few runs; else one gather and one placement.
    ``rows`` / ``place``: contiguous int64 CPU vectors, one entry per moved row."""
    if rows is None and place is None:
        out.copy_(x)
        return
    d = (rows if place is None else place).numpy()
    spans = runs(d)
    if len(spans) > MAX_RUNS:
        if place is None:
            torch.index_select(x, 0, rows, out=out)
        elif rows is None:
            out.index_copy_(0, place, x)
        else:
            out.index_copy_(0, place, x.index_select(0, rows))
        return
    for a, b in spans:
        at = int(d[a])
        if place is None:      # rows[a:b] consecutive: one block of x
            out[a:b].copy_(x[at:at + b - a])
        elif rows is None:     # place[a:b] consecutive: one block of out
            out[at:at + b - a].copy_(x[a:b])
        else:
            torch.index_select(x, 0, rows[a:b], out=out[at:at + b - a])
