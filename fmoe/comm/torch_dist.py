"""`TorchDistComm`: the Communicator protocol over a torch.distributed group (gloo on CPU, nccl on GPU)."""
from __future__ import annotations

import datetime
import gc
import math
import os
import sys
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from . import matching, shm
from .buffers import recv_buffer
from .agreement import end_of_job_check
from .layout import (a2a_front, a2av_counts, front_to_concat, gathered_to_axis, move_rows, norm_axis, place_error,
                     raw_collective, rows_error)
from .registry import forget_all, mark_closed


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
# torch >= 2.13 deprecates all_gather_into_tensor (a FutureWarning on every rank, every job) for
# all_gather_single, the same collective; older torch has only the first.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TorchDistComm(matching.ControlExchange):
    """Communicator over a ``torch.distributed`` process group.

    Args:
        group: a process group; None means the default (WORLD) group, which
            must already be initialised (see :meth:`from_env`).
        checks: ``"full"`` (default), ``"step"`` or ``"off"``, as for ``mpi_backend.MPIComm``
            (:mod:`fmoe.comm.matching`).
        shared_memory: where every rank of the group is on this host (gloo, CPU tensors), the
            all-to-alls (:meth:`exchange_rows`, the expert-parallel exchanges; ``all_to_all_v``;
            ``all_to_all`` from :data:`fmoe.comm.shm.PAYS_FROM_BYTES`) move their rows through
            shared memory, gloo carrying only the synchronisation (:mod:`fmoe.comm.shm`; the same
            bytes). Small exchanges cost 0.2-0.5 ms more that way; False: always through the
            backend.

    Collective timeouts are the process group's own (``init_process_group(timeout=...)``); a
    collective that fails (timeout, dead peer) aborts this process with a message naming it, and
    torchrun then stops the others. Under ``checks="full"`` every collective is matched by a
    control record (kind, call number, dtype, shape; :mod:`fmoe.comm.matching`), so mismatched
    calls raise on every rank instead of pairing up.
    """

    def __init__(self, group=None, *, checks: str = "full", shared_memory: bool = True):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("TorchDistComm needs an initialised torch.distributed process group; "
                               "call TorchDistComm.from_env() under torchrun, or init_process_group first")
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.checks = matching.check_mode(checks)
        if not isinstance(shared_memory, bool):
            raise TypeError(f"TorchDistComm: shared_memory must be True or False, got {shared_memory!r}")
        self.shared_memory = shared_memory
        self._gloo = dist.get_backend(group) == "gloo"   # shared memory serves gloo's CPU tensors only
        self._calls = 0  # collectives started on this object (the header's call number)
        self._pending = None  # an fmoe call's agreement record waiting for this object's next collective

    @classmethod
    def from_env(cls, backend: str = "gloo", timeout: Optional[float] = None, *,
                 checks: str = "full", shared_memory: bool = True) -> "TorchDistComm":
        """Initialise the default group from torchrun's variables (env://) unless already done."""
        if not dist.is_initialized():
            kw = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
            dist.init_process_group(backend=backend, init_method="env://", **kw)
        return cls(checks=checks, shared_memory=shared_memory)

    def __repr__(self) -> str:
        return (f"TorchDistComm(rank={self.rank}, size={self.size}, backend={dist.get_backend(self.group)}, "
                f"checks={self.checks!r}, shared_memory={self.shared_memory})")

    def close(self) -> None:
        """Shut the default process group down cleanly (collective: every rank calls it at the end).

        Exiting with a live gloo group lets its threads be torn down mid-flight, which aborts a rank
        at interpreter exit ("terminate called without an active exception") about one run in three.
        Also forgets every registered communicator: call it once, at the end of the job.
        """
        if dist.is_initialized():
            end_of_job_check(self)
            dist.barrier()
            dist.destroy_process_group()
        # Sub-groups made for sharded experts / 2DH live in the handle registry and its per-comm
        # caches (registry.cache_of); freed at interpreter teardown, their gloo threads abort the process.
        forget_all()
        mark_closed(self)
        gc.collect()

    def abort(self, message: str = "", code: int = 1) -> None:
        """Print ``message`` and end this process at once; torchrun then stops the other ranks."""
        if message:
            sys.stderr.write(f"[fmoe rank {self.rank}/{self.size}] aborting: {message}\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(code)

    def _do(self, what: str, fn):
        """Run one torch.distributed call; a failure (timeout, dead peer) aborts with its name."""
        try:
            return fn()
        except (RuntimeError, dist.DistBackendError) as e:
            self.abort(f"{what} failed: {type(e).__name__}: {str(e)[:500]} (a peer rank crashed, never joined "
                       "it, or is stuck; the process group timeout bounds the wait)")

    def _exchange_control(self, words: list, what: str) -> list:
        w = torch.tensor(words, dtype=torch.int64)
        table = torch.empty(self.size * matching.CTRL, dtype=torch.int64)
        self._do(what, lambda: _all_gather_tensor(table, w, group=self.group))
        return table.reshape(self.size, matching.CTRL).tolist()

    def _gather_text(self, text: str, width: int = 400) -> list[str]:
        raw = text.encode()[:width]
        buf = torch.zeros(width, dtype=torch.uint8)
        buf[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
        out = torch.empty(self.size * width, dtype=torch.uint8)
        self._do("error report", lambda: _all_gather_tensor(out, buf, group=self.group))
        return [bytes(row.tolist()).rstrip(b"\0").decode(errors="replace") for row in out.reshape(self.size, width)]

    def barrier(self) -> None:
        call, table = self._begin("barrier")
        if table is None:  # a control all-gather already held every rank until all had entered
            self._do(f"barrier #{call}", lambda: dist.barrier(self.group))

    @raw_collective
    def exchange(self, front: Tensor) -> Tensor:
        """Row w of ``front`` [W, ...] goes to rank w; row u of the result came from rank u."""
        err = None
        if front.dim() == 0 or front.shape[0] != self.size:
            err = ValueError(f"exchange: leading dim must be {self.size}, got {tuple(front.shape)}")
        call, _ = self._begin("all_to_all", front, error=err)
        front = front.contiguous()
        out = recv_buffer(self, front.shape, front.dtype, front.device)   # CPU: reused, no fresh pages to fault
        # all_to_all's size is the same on every rank, so it may choose the path: shared memory where it pays
        big = front.numel() * front.element_size() >= shm.PAYS_FROM_BYTES
        if front.numel() and not (big and self._shared(front, None, None, out, [1] * self.size, [1] * self.size)):
            self._do(f"all_to_all #{call}", lambda: dist.all_to_all_single(out, front, group=self.group))
        return out

    @raw_collective
    def all_to_all(self, x: Tensor, concat_axis: int, split_axis: int) -> Tensor:
        try:
            front, concat_axis = a2a_front(x, concat_axis, split_axis, self.size)
        except ValueError as e:  # tell the peers before raising, so they do not wait for data
            self._begin("all_to_all", x, error=e)
            raise AssertionError("unreachable: _begin re-raises")  # pragma: no cover
        return front_to_concat(self.exchange(front), concat_axis)

    def _begin_v(self, x: Tensor, send: list, recv: list, err) -> int:
        """Begin an all-to-all-v (raising ``err`` on every rank); in checked mode the ranks' counts
        must pair up: recv[u] on rank w == send[w] on rank u. Returns the call's number."""
        mine = torch.tensor(send + recv, dtype=torch.int64)
        inline = err is None and matching.fits(mine)
        call, ctrl = self._begin("all_to_all_v", x, error=err, payload=mine if inline else None)
        if ctrl is not None:
            if inline:
                table = matching.payload_of(ctrl, mine)
            else:
                table = torch.empty(self.size * 2 * self.size, dtype=torch.int64)
                self._do(f"all_to_all_v #{call} (counts)",
                         lambda: _all_gather_tensor(table, mine, group=self.group))
            matching.check_counts(table.reshape(self.size, 2 * self.size), call)
        return call

    @raw_collective
    def all_to_all_v(self, x: Tensor, send_counts: Sequence[int], recv_counts: Sequence[int]) -> Tensor:
        send, recv, err = a2av_counts(x, send_counts, recv_counts, self.size)
        call = self._begin_v(x, send, recv, err)
        x = x.contiguous()
        out = recv_buffer(self, (sum(recv),) + tuple(x.shape[1:]), x.dtype, x.device)   # CPU: reused
        if not self._shared(x, None, None, out, send, recv):
            self._do(f"all_to_all_v #{call}", lambda: dist.all_to_all_single(
                out, x, output_split_sizes=recv, input_split_sizes=send, group=self.group))
        return out

    def _shared(self, x: Tensor, rows, place, out: Tensor, send: list, recv: list) -> bool:
        """``out[place] = all_to_all_v(x[rows], send, recv)`` through shared memory where this group
        can (:mod:`fmoe.comm.shm`: every rank on this host, ``shared_memory``, gloo, CPU rows of
        nonzero width; decided alike on every rank); False: nothing moved, the backend moves them."""
        if not (self.shared_memory and self._gloo and x.device.type == "cpu" and math.prod(x.shape[1:])):
            return False
        seg = shm.segments(self)
        return seg is not None and seg.exchange(self, x, rows, place, out, send, recv)

    @raw_collective
    def exchange_rows(self, x: Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], *,
                      rows: Optional[Tensor] = None, place: Optional[Tensor] = None) -> Tensor:
        """``all_to_all_v(x[rows], send_counts, recv_counts)`` with received row i put in row
        ``place[i]`` of the result (rows or place None: in order); the same bytes as
        ``mpi_backend.MPIComm.exchange_rows``.

        Where every rank is on this host (and ``shared_memory``), the rows go through shared memory
        (:mod:`fmoe.comm.shm`): each rank packs the rows for its peers into its own segment and
        copies its rows out of theirs, gloo carrying a counts all-to-all (with the rows themselves
        where each peer's are small) and, for larger ones, a barrier. Otherwise
        torch.distributed moves contiguous buffers only: the rows for the peers are gathered into
        a send buffer and, where ``place`` is given, the received ones placed from a receive
        buffer (a run of consecutive destinations is one copy). This rank's own rows never enter
        the exchange: they are copied once, from x to their destinations (on the gloo path while
        the peers' rows are in flight). Either way the same bytes land in the same rows.

        Args:
            x: contiguous CPU [T, ...]. rows: int64 [sum(send_counts)], entries in [0, T).
            place: int64 [sum(recv_counts)], a permutation of [0, sum(recv_counts)).
        Returns:
            [sum(recv_counts), ...] (a receive buffer of this communicator's pool).
        """
        send, recv, err = a2av_counts(x if rows is None else rows, send_counts, recv_counts, self.size)
        if err is None and rows is not None:
            err = rows_error(x, rows)
        if err is None and place is not None:
            err = place_error(place, sum(recv))
        if err is None and x.device.type != "cpu":
            err = ValueError(f"exchange_rows moves CPU tensors only, got a tensor on {x.device}")
        if err is None and send[self.rank] != recv[self.rank]:
            err = ValueError(f"exchange_rows: this rank sends itself {send[self.rank]} rows but receives "
                             f"{recv[self.rank]} from itself (send_counts[{self.rank}] must equal recv_counts"
                             f"[{self.rank}])")
        call = self._begin_v(x, send, recv, err)
        x = x.contiguous()
        tail = tuple(x.shape[1:])
        out = recv_buffer(self, (sum(recv),) + tail, x.dtype)   # reused: no fresh pages to fault
        if math.prod(tail) == 0:   # (from the shape: every rank skips alike)
            return out
        if self._shared(x, rows, place, out, send, recv):
            return out
        me, R = self.rank, out.shape[0]
        ns, nr, s0, r0 = send[me], recv[me], sum(send[:me]), sum(recv[:me])
        peer_send, peer_recv = send[:me] + [0] + send[me + 1:], recv[:me] + [0] + recv[me + 1:]
        if rows is None and (s0 == 0 or s0 + ns == x.shape[0]):
            sbuf = x[ns:] if s0 == 0 else x[:s0]                 # one piece of x: sent where it lies
        else:
            sbuf = recv_buffer(self, (x.shape[0] - ns if rows is None else rows.shape[0] - ns,) + tail, x.dtype)
            if rows is None:
                torch.cat([x[:s0], x[s0 + ns:]], out=sbuf)
            else:
                move_rows(x, torch.cat([rows[:s0], rows[s0 + ns:]]), None, sbuf)
        direct = place is None and (r0 == 0 or r0 + nr == R)
        rbuf = (out[nr:] if r0 == 0 else out[:r0]) if direct else recv_buffer(self, (R - nr,) + tail, x.dtype)
        work = self._do(f"all_to_all_v #{call}", lambda: dist.all_to_all_single(
            rbuf, sbuf, output_split_sizes=peer_recv, input_split_sizes=peer_send, group=self.group,
            async_op=True))
        if ns:   # this rank's own rows, while the peers' are in flight
            own = (x[s0:s0 + ns], None) if rows is None else (x, rows[s0:s0 + ns])
            move_rows(*own, *((None, out[r0:r0 + nr]) if place is None else (place[r0:r0 + nr], out)))
        self._do(f"all_to_all_v #{call}", work.wait)
        if place is not None:
            move_rows(rbuf, None, torch.cat([place[:r0], place[r0 + nr:]]), out)
        elif not direct:
            out[:r0].copy_(rbuf[:r0])
            out[r0 + nr:].copy_(rbuf[r0:])
        return out

    @raw_collective
    def all_reduce(self, x: Tensor, op: str = "sum") -> Tensor:
        err = None if op in _OPS else ValueError(f"all_reduce op must be one of {tuple(_OPS)}, got {op!r}")
        inline = err is None and matching.fits(x)
        call, ctrl = self._begin("all_reduce", x, op=op if err is None else "", error=err,
                                 payload=x if inline else None)
        if ctrl is not None and inline:  # the data came with the control records
            return matching.reduce_rows(ctrl, x, op)
        out = x.detach().clone().contiguous()
        self._do(f"all_reduce({op}) #{call}", lambda: dist.all_reduce(out, op=_OPS[op], group=self.group))
        return out

    @raw_collective
    def all_gather(self, x: Tensor, axis: int = 0) -> Tensor:
        err = None
        try:
            axis = norm_axis(axis, max(x.dim(), 1))
        except ValueError as e:
            err = e
        inline = err is None and matching.fits(x)
        call, ctrl = self._begin("all_gather", x, error=err, payload=x if inline else None)
        x = x.contiguous()
        if ctrl is not None and inline:  # the data came with the control records
            out = matching.payload_of(ctrl, x)
        else:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            self._do(f"all_gather #{call}", lambda: dist.all_gather(parts, x, group=self.group))
            out = torch.stack(parts)
        return out if x.dim() == 0 else gathered_to_axis(out, axis)

    def split(self, color: int, key: Optional[int] = None) -> "TorchDistComm":
        """Sub-group of the ranks with the same ``color`` ordered by ``key`` (collective over this group)."""
        mine = torch.tensor([int(color), self.rank if key is None else int(key), dist.get_rank()],
                            dtype=torch.int64)
        table = self.all_gather(mine.unsqueeze(0), 0).tolist()
        members = sorted((k, g) for c, k, g in table if c == int(color))
        if [g for _, g in members] != sorted(g for _, g in members):
            # torch.distributed numbers a new group's ranks by global rank.
            raise ValueError("TorchDistComm.split: key must order ranks as their global ranks do; "
                             f"got (key, global rank) pairs {members}")
        # Only the members create the group, so disjoint colours do not wait on each other.
        sub = dist.new_group([g for _, g in members], use_local_synchronization=True)
        return TorchDistComm(sub, checks=self.checks, shared_memory=self.shared_memory)
