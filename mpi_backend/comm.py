"""`MPIComm`: the fmoe Communicator protocol over an mpi4py communicator.

Buffers are zero-copy: a contiguous CPU tensor is handed to MPI as a numpy
view of its bytes, so any dtype (bf16 and fp8 included) moves without a
conversion; only reductions need a typed view (bf16/fp16 are reduced in fp32
because MPI has no portable half-precision sum).

Collectives block, unless ``timeout`` is given: then each one is started
non-blocking and polled, and a rank that waits longer than ``timeout`` seconds
prints what it was waiting for and aborts the whole job (a collective that one
peer never joins cannot be cancelled in MPI, so abort is the only exit: a
timeout never returns).

Matched collectives: MPI matches collectives by order, not kind, so a checked
collective first all-gathers a fixed-size control record (kind, call number,
dtype, shape, op, the pending step-agreement record, and the data itself when
it is small; :mod:`fmoe.comm.matching`) and moves data only when all ranks
agree; otherwise every rank raises ``CollectiveMismatchError``. Invalid
arguments on one rank raise on every rank. The call number is this object's
own count of its collectives. ``checks=`` chooses what is checked (``"full"``,
``"step"``, ``"off"``; see :class:`MPIComm`).
"""
from __future__ import annotations

import array
import math
import sys
import time
from typing import Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from fmoe.comm import matching
from fmoe.comm.buffers import recv_buffer
from fmoe.comm.agreement import end_of_job_check
from fmoe.comm.layout import (a2a_front, a2av_counts, front_to_concat, gathered_to_axis, move_rows, norm_axis,
                              place_error, plain, raw_collective, rows_error, runs)
from fmoe.comm.registry import forget, mark_closed

__all__ = ["MPIComm", "mpi_launched"]

_REDUCE = ("sum", "max", "min")

# Seconds an aborting rank waits after flushing its message, before MPI_Abort.
ABORT_DRAIN_S = 0.5


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("mpi_backend needs mpi4py and an MPI library: pip install 'fmoe[mpi]'") from e
    return MPI


def mpi_launched() -> bool:
    """True when this process was started by an MPI launcher with more than one rank.

    Reads only the launchers' own rank-count variables (MPICH/Hydra, Open MPI,
    Slurm PMI) and does not initialise MPI.
    """
    import os
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS", "PMIX_SIZE"):
        if var in os.environ:
            return True
    return False


def _bytes(t: Tensor):
    """An MPI byte buffer over a contiguous CPU tensor's memory (no copy, any dtype).

    ``MPI.buffer.fromaddress`` costs ~0.3 us, a numpy view ~6 us: it matters
    for small capacity buffers, where the exchange itself takes tens of us.
    """
    if t.device.type != "cpu":
        raise ValueError(f"MPIComm moves CPU tensors only, got a tensor on {t.device}")
    if not t.is_contiguous():
        raise ValueError("internal: MPIComm buffer must be contiguous")
    return _mpi().buffer.fromaddress(t.data_ptr(), t.numel() * t.element_size())


class MPIComm(matching.ControlExchange):
    """Communicator over ``mpi4py.MPI.Comm`` (default ``COMM_WORLD``).

    Args:
        comm: an mpi4py intracommunicator; None means ``MPI.COMM_WORLD``.
        timeout: seconds any single collective may wait before the job is
            aborted with a message naming the collective; None waits forever.
        checks: what is verified across ranks (:mod:`fmoe.comm.matching`):
            ``"full"`` (default) every collective is matched (kind, order, dtype, shape,
            op) and every fmoe call agrees on its step and settings; ``"step"`` only the
            step agreement, once per fmoe call; ``"off"`` nothing (a mismatch then
            pairs data wrongly or waits for ``timeout``). On an fmoe forward
            ``"full"`` and ``"step"`` make no exchange more than ``"off"``; ``"full"``
            adds one small exchange before each collective outside a checked fmoe
            call's forward (e.g. the backward all-to-alls, a user's own collectives).

    Attributes:
        rank, size: this process's place in ``comm``.
        mpi_comm: the wrapped mpi4py communicator.
    """

    def __init__(self, comm=None, *, timeout: Optional[float] = None, checks: str = "full"):
        MPI = _mpi()
        self.mpi_comm = MPI.COMM_WORLD if comm is None else comm
        self.rank = self.mpi_comm.Get_rank()
        self.size = self.mpi_comm.Get_size()
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
        self.timeout = timeout
        self.checks = matching.check_mode(checks)
        self._calls = 0  # collectives started on this object (the header's call number)
        self._pending = None  # an fmoe call's agreement record waiting for this object's next collective

    def __repr__(self) -> str:
        return f"MPIComm(rank={self.rank}, size={self.size}, timeout={self.timeout}, checks={self.checks!r})"

    # ------------------------------------------------------------------ plumbing

    def _exchange_control(self, words: list, what: str) -> list:
        # array.array, not numpy: a few plain buffer ops (this path runs between cache-cold tensor ops)
        w = array.array("q", words)
        got = array.array("q", bytes(8 * self.size * matching.CTRL))
        self._run(what, lambda: self.mpi_comm.Allgather(w, got), lambda: self.mpi_comm.Iallgather(w, got))
        flat, n = got.tolist(), matching.CTRL
        return [flat[u * n:(u + 1) * n] for u in range(self.size)]

    def _gather_text(self, text: str, width: int = 400) -> list[str]:
        raw = text.encode()[:width]
        buf = torch.zeros(width, dtype=torch.uint8)
        buf[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
        out = torch.empty(self.size, width, dtype=torch.uint8)
        s, r = _bytes(buf), _bytes(out)
        self._run("error report", lambda: self.mpi_comm.Allgather(s, r), lambda: self.mpi_comm.Iallgather(s, r))
        return [bytes(row.tolist()).rstrip(b"\0").decode(errors="replace") for row in out]

    def _run(self, what: str, blocking, nonblocking):
        if self.timeout is None:
            return blocking()
        req = nonblocking()
        deadline = time.monotonic() + self.timeout
        spins = 0
        while not req.Test():
            spins += 1
            if spins > 1000:  # busy-poll first (latency), then back off (CPU for peers)
                time.sleep(1e-4)
            if time.monotonic() > deadline:
                self.abort(f"{what} did not complete within {self.timeout} s (a peer rank never joined it, "
                           "crashed, or is stuck)")

    def abort(self, message: str = "", code: int = 1) -> None:
        """Print ``message`` to stderr and abort every rank of the job (never returns)."""
        if message:
            sys.stderr.write(f"[fmoe rank {self.rank}/{self.size}] aborting: {message}\n")
        sys.stderr.flush()
        sys.stdout.flush()
        # MPI_Abort kills every rank and its output forwarder at once; a message still in the
        # pipe to mpiexec was then lost now and then (an empty job log in tests/test_faults_launch.py).
        time.sleep(ABORT_DRAIN_S)
        self.mpi_comm.Abort(code)

    def barrier(self) -> None:
        call, table = self._begin("barrier")
        if table is None:  # a control all-gather already held every rank until all had entered
            self._run(f"barrier #{call}", self.mpi_comm.Barrier, self.mpi_comm.Ibarrier)

    def close(self) -> None:
        """End-of-job shutdown (collective). mpi4py finalizes MPI at interpreter exit; this checks that
        every rank made the same fmoe calls (a rank that skipped a step raises here, on every rank,
        instead of leaving a peer waiting) and that no rank leaves while another is inside a collective."""
        end_of_job_check(self)
        self.barrier()
        forget(self)
        mark_closed(self)

    # ------------------------------------------------------------------ protocol

    @raw_collective
    def exchange(self, front: Tensor, out: Optional[Tensor] = None) -> Tensor:
        """Row w of contiguous ``front`` [W, ...] goes to rank w; row u of the result came from rank u.

        ``out`` (contiguous, front's shape and dtype) is filled in place when given:
        reusing it avoids page-faulting a fresh large buffer on every call.
        """
        return self._exchange(front, out)

    def _exchange(self, front: Tensor, out: Optional[Tensor] = None) -> Tensor:
        err = None
        if front.dim() == 0 or front.shape[0] != self.size:
            err = ValueError(f"exchange: leading dim must be {self.size}, got {tuple(front.shape)}")
        elif out is not None and (out.shape != front.shape or out.dtype != front.dtype or not out.is_contiguous()):
            err = ValueError(f"exchange: out must be contiguous {tuple(front.shape)} {front.dtype}")
        elif front.device.type != "cpu":
            err = ValueError(f"MPIComm moves CPU tensors only, got a tensor on {front.device}")
        call, _ = self._begin("all_to_all", front, error=err)
        front = front.contiguous()
        if out is None:
            out = recv_buffer(self, front.shape, front.dtype)   # reused: no fresh pages to fault
        if front.numel():
            s, r = _bytes(front), _bytes(out)
            self._run(f"all_to_all #{call}", lambda: self.mpi_comm.Alltoall(s, r),
                      lambda: self.mpi_comm.Ialltoall(s, r))
        return out

    @raw_collective
    def all_to_all(self, x: Tensor, concat_axis: int, split_axis: int) -> Tensor:
        """JAX-style all-to-all (see :class:`fmoe.comm.Communicator`); one MPI_Alltoall."""
        try:
            front, concat_axis = a2a_front(x, concat_axis, split_axis, self.size)
        except ValueError as e:  # tell the peers before raising, so they do not wait for data
            self._begin("all_to_all", x, error=e)
            raise AssertionError("unreachable: _begin re-raises")  # pragma: no cover
        return front_to_concat(self._exchange(front), concat_axis)

    @raw_collective
    def all_to_all_v(self, x: Tensor, send_counts: Sequence[int], recv_counts: Sequence[int]) -> Tensor:
        """Variable all-to-all of rows (dim 0) with MPI_Alltoallv; rows travel as one derived type."""
        return self._all_to_all_v(x, send_counts, recv_counts, None)

    @raw_collective
    def gather_all_to_all_v(self, x: Tensor, rows: Tensor, send_counts: Sequence[int],
                            recv_counts: Sequence[int]) -> Tensor:
        """``all_to_all_v(x.index_select(0, rows), send_counts, recv_counts)`` without that copy: MPI
        reads each peer's rows of x where they lie (one indexed datatype per peer) and this rank's own
        rows are gathered straight into the result.

        Args:
            x: contiguous CPU [T, ...]. rows: int64 [sum(send_counts)], entries in [0, T).
        Returns:
            [sum(recv_counts), ...] (a receive buffer of this communicator's pool).
        """
        return self._all_to_all_v(x, send_counts, recv_counts, plain(rows))

    @raw_collective
    def exchange_rows(self, x: Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], *,
                      rows: Optional[Tensor] = None, place: Optional[Tensor] = None) -> Tensor:
        """``all_to_all_v`` of the rows ``x[rows]`` (None: x's rows in order) whose received row i
        lands in row ``place[i]`` of the result (None: in order), with no copy on either side: MPI
        reads each peer's rows where they lie and writes them where they go (one indexed datatype
        per peer and side); this rank's own rows are copied once, from x to their destinations.

        Args:
            x: contiguous CPU [T, ...]. rows: int64 [sum(send_counts)], entries in [0, T).
            place: int64 [sum(recv_counts)], a permutation of [0, sum(recv_counts)).
        Returns:
            [sum(recv_counts), ...] (a receive buffer of this communicator's pool).
        """
        return self._all_to_all_v(x, send_counts, recv_counts, None if rows is None else plain(rows),
                                  None if place is None else plain(place))

    def _all_to_all_v(self, x: Tensor, send_counts, recv_counts, rows: Optional[Tensor],
                      place: Optional[Tensor] = None) -> Tensor:
        MPI = _mpi()
        send, recv, err = a2av_counts(x if rows is None else rows, send_counts, recv_counts, self.size)
        if err is None and rows is not None:
            err = rows_error(x, rows)
        if err is None and place is not None:
            err = place_error(place, sum(recv))
        mine = torch.tensor(send + recv, dtype=torch.int64)
        inline = err is None and matching.fits(mine)
        call, ctrl = self._begin("all_to_all_v", x, error=err, payload=mine if inline else None)
        if ctrl is not None:  # checked: the counts must pair up (recv[u] on w == send[w] on u)
            if inline:
                table = matching.payload_of(ctrl, mine)
            else:
                table = torch.empty(self.size, 2 * self.size, dtype=torch.int64)
                sb, rb = _bytes(mine), _bytes(table)
                self._run(f"all_to_all_v #{call} (counts)", lambda: self.mpi_comm.Allgather(sb, rb),
                          lambda: self.mpi_comm.Iallgather(sb, rb))
            matching.check_counts(table, call)
        x = x.contiguous()
        out = recv_buffer(self, (sum(recv),) + tuple(x.shape[1:]), x.dtype)   # reused: no fresh pages to fault
        # (from the shape, not a row: a rank that sends no rows still joins the exchange)
        row_bytes = math.prod(x.shape[1:]) * x.element_size()
        if row_bytes == 0:
            return out
        sdis = np.concatenate([[0], np.cumsum(send)[:-1]]).tolist()
        rdis = np.concatenate([[0], np.cumsum(recv)[:-1]]).tolist()
        me = self.rank
        if send[me] and send[me] == recv[me]:
            # this rank's own rows: one plain copy (MPI's self-copy of a large block took about as
            # long as the transfer to a peer: 25 MB on 2 ranks, 17 ms -> 9 ms with this)
            self._own_rows(x, rows, place, out, sdis[me], rdis[me], send[me])
            send, recv = list(send), list(recv)
            send[me] = recv[me] = 0
        if rows is None and place is None:
            self._alltoallv(call, x, out, send, sdis, recv, rdis, row_bytes)
        else:
            self._gather_alltoallw(call, x, rows, place, out, send, sdis, recv, rdis, row_bytes)
        return out

    @staticmethod
    def _own_rows(x: Tensor, rows: Optional[Tensor], place: Optional[Tensor], out: Tensor, s0: int, r0: int,
                  n: int) -> None:
        """This rank's n own rows, ``x[rows[s0:s0+n]]`` (or ``x[s0:s0+n]``), into ``out[place[r0:r0+n]]``
        (or ``out[r0:r0+n]``), copied once (:func:`fmoe.comm.layout.move_rows`)."""
        move_rows(x if rows is not None else x[s0:s0 + n], None if rows is None else rows[s0:s0 + n],
                  None if place is None else place[r0:r0 + n], out if place is not None else out[r0:r0 + n])

    def _alltoallv(self, call, x, out, send, sdis, recv, rdis, row_bytes) -> None:
        row = _mpi().BYTE.Create_contiguous(row_bytes).Commit()
        try:
            s = [_bytes(x) if x.numel() else np.empty(0, np.uint8), (send, sdis), row]
            r = [_bytes(out) if out.numel() else np.empty(0, np.uint8), (recv, rdis), row]
            self._run(f"all_to_all_v #{call}", lambda: self.mpi_comm.Alltoallv(s, r),
                      lambda: self.mpi_comm.Ialltoallv(s, r))
        finally:
            row.Free()

    def _gather_alltoallw(self, call, x, rows, place, out, send, sdis, recv, rdis, row_bytes) -> None:
        # Per peer one datatype over the rows it gets, at their byte offsets in x (MPI_Aint: no int
        # overflow on large buffers), and one over where its rows land in out; counts 1 or 0, the
        # Alltoallw (int) displacements all 0.
        # A run of consecutive rows is one block of the datatype: MPI moves it as one piece (rows
        # put in expert order come in a few runs per peer; rows gathered by token, one row each).
        MPI = _mpi()
        row = MPI.BYTE.Create_contiguous(row_bytes).Commit()
        types = []

        def rows_type(index: Optional[Tensor], start: int, count: int):
            if index is None:
                return row.Create_hindexed_block(count, [start * row_bytes]).Commit()
            idx = index.numpy()[start:start + count]
            spans = runs(idx)
            if len(spans) == count:
                return row.Create_hindexed_block(1, (idx * row_bytes).tolist()).Commit()
            return row.Create_hindexed([b - a for a, b in spans], [int(idx[a]) * row_bytes for a, _ in spans]).Commit()

        try:
            stypes, rtypes = [], []
            for u in range(self.size):
                st = rows_type(rows, sdis[u], send[u]) if send[u] else row
                rt = rows_type(place, rdis[u], recv[u]) if recv[u] else row
                types += [t for t in (st, rt) if t is not row]
                stypes.append(st)
                rtypes.append(rt)
            zeros = [0] * self.size
            s = [_bytes(x) if x.numel() else np.empty(0, np.uint8), ([int(c > 0) for c in send], zeros), stypes]
            r = [_bytes(out) if out.numel() else np.empty(0, np.uint8), ([int(c > 0) for c in recv], zeros), rtypes]
            self._run(f"all_to_all_v #{call}", lambda: self.mpi_comm.Alltoallw(s, r),
                      lambda: self.mpi_comm.Ialltoallw(s, r))
        finally:
            for t in types:
                t.Free()
            row.Free()

    @raw_collective
    def all_reduce(self, x: Tensor, op: str = "sum") -> Tensor:
        """Elementwise reduction over ranks; half precisions are reduced in fp32."""
        MPI = _mpi()
        err = None if op in _REDUCE else ValueError(f"all_reduce op must be one of {_REDUCE}, got {op!r}")
        inline = err is None and matching.fits(x)
        call, ctrl = self._begin("all_reduce", x, op=op if err is None else "", error=err,
                                 payload=x if inline else None)
        if ctrl is not None and inline:  # the data came with the control records
            return matching.reduce_rows(ctrl, x, op)
        mpi_op = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op]
        work = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        if work.dtype == torch.bool:
            work = work.to(torch.uint8)
        send = work.contiguous()  # MPI reads it and writes `out`: the caller's x is untouched
        out = torch.empty_like(send)
        if send.numel():
            s, r = send.reshape(-1).numpy(), out.reshape(-1).numpy()
            self._run(f"all_reduce({op}) #{call}", lambda: self.mpi_comm.Allreduce(s, r, mpi_op),
                      lambda: self.mpi_comm.Iallreduce(s, r, mpi_op))
        return out.to(x.dtype)

    @raw_collective
    def all_gather(self, x: Tensor, axis: int = 0) -> Tensor:
        """Concatenate every rank's x (same shape everywhere) along ``axis``."""
        try:
            axis = norm_axis(axis, max(x.dim(), 1))
            err = None
        except ValueError as e:
            err = e
        inline = err is None and matching.fits(x)
        call, ctrl = self._begin("all_gather", x, error=err, payload=x if inline else None)
        x = x.contiguous()
        if ctrl is not None and inline:  # the data came with the control records
            out = matching.payload_of(ctrl, x)
        else:
            out = recv_buffer(self, (self.size,) + tuple(x.shape), x.dtype)   # reused: no fresh pages to fault
        if x.numel() and not (ctrl is not None and inline):
            s, r = _bytes(x), _bytes(out)
            self._run(f"all_gather #{call}", lambda: self.mpi_comm.Allgather(s, r),
                      lambda: self.mpi_comm.Iallgather(s, r))
        if x.dim() == 0:
            return out
        return gathered_to_axis(out, axis)

    def split(self, color: int, key: Optional[int] = None) -> "MPIComm":
        """MPI_Comm_split: ranks with equal ``color``, ordered by ``key`` (default: rank)."""
        self._begin("split")
        sub = self.mpi_comm.Split(int(color), self.rank if key is None else int(key))
        return MPIComm(sub, timeout=self.timeout, checks=self.checks)
