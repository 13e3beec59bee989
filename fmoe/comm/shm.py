"""All-to-alls through shared memory when every rank of a torch.distributed group is on one host.

gloo moves CPU tensors over TCP even between processes of one host: on a 2-vCPU host a 12 MB
all-to-all-v of an expert-parallel step took 14 ms (0.9 GB/s), three of them a tenth of the step.
Where every rank of the group runs on the same host, TorchDistComm's all-to-alls
(:meth:`~fmoe.comm.TorchDistComm.exchange_rows`, ``all_to_all_v``, ``all_to_all``) move their rows
through shared memory instead:

1. one all-to-all (gloo) of fixed-size blocks: block w of a rank holds its counts and segment for
   rank w, and the rows it sends w where every peer's share is at most :data:`INLINE_BYTES`;
2. each rank with more writes the rows it sends its peers into its own segment (a file under
   /dev/shm that every rank maps), in destination order, as the gloo path packs its send buffer,
   and one barrier follows (none where every rank's rows came inline);
3. each rank copies its rows out of the blocks it received or the peers' segments into the result,
   placed as the gloo path places them.

The same bytes land in the same places, so the result equals the gloo path's bit for bit. gloo
still carries the synchronisation, so a dead peer or a timeout ends the job as a gloo collective
would. The counts exchange also checks that the counts pair up (rank u's send to w is w's receive from
u) and that the rows have one size on every rank, and raises on every rank where they do not. A
segment grows when a call needs more (the new file is unlinked once every peer has mapped it, so
nothing is left in /dev/shm after a clean step) and is reserved with ``posix_fallocate``: a full
/dev/shm is an error at that point (every rank then takes the gloo path for the call), never a
SIGBUS on a later write.

What it costs (2 ranks on a 2-vCPU host, float32 rows of width 768 a peer, ``checks="off"``): 12.6 MB
7.2-7.6 ms against gloo's 9.2-12.7; 197 KB 0.94-1.02 against 0.51; 1-16 rows (3-49 KB) 0.52-0.60
against 0.32-0.40, of which the counts all-to-all is about 0.3 and this module's Python 0.1. Which path a
call takes must be the same on every rank, and an all-to-all-v's sizes differ between ranks, so
``exchange_rows`` and ``all_to_all_v`` cannot choose by size: small (decode-sized) exchanges are
0.2-0.5 ms slower this way, and ``TorchDistComm(shared_memory=False)`` keeps them on gloo.

    seg = segments(comm)    # None: the ranks are not all on this host (gloo moves the rows)
    seg.exchange(comm, x, rows, place, out, send, recv)  # False: a rank could not make its segment
"""
from __future__ import annotations

import math
import os
import secrets
import socket
import weakref
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .layout import move_rows
from .registry import cache_of

__all__ = []   # TorchDistComm's transport: nothing here for users

_KEY = "fmoe.comm.shm: segments"
_DIR = "/dev/shm"
_MIN_BYTES = 1 << 20
# A rank that sends each peer at most this many bytes sends them inside the counts all-to-all; when
# every rank does, the call is that one collective (no segment write, no barrier). Every call moves
# blocks of this size (2 ranks: one 64 KiB block 0.1 ms more than a 4 KiB one over gloo), which
# spares decode-sized exchanges (a few rows of width 2048: 24-64 KiB a peer) the segment write and
# the barrier (0.2-0.4 ms): with 8 KiB blocks 4 rows of width 768 took 0.75-0.86 ms, with 64 KiB 0.54-0.60.
INLINE_BYTES = 64 << 10
# Below this many bytes in all, gloo's own all-to-all was faster on a 2-vCPU host (0.3-0.45 ms against
# 0.5-0.95): TorchDistComm.all_to_all, whose size every rank shares, takes shared memory only from here.
PAYS_FROM_BYTES = 512 << 10


def _unlink_all(paths: list) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    paths.clear()


def _sent(x: Tensor, rows: Optional[Tensor], start: int, n: int) -> tuple:
    """(source, row indices) of the n rows this rank sends from position ``start`` on: x's own rows
    in order (rows None) or x's rows ``rows[start:start + n]``, as :func:`move_rows` takes them."""
    return (x[start:start + n], None) if rows is None else (x, rows[start:start + n])


def _reserve(path: str, nbytes: int) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)   # the pages exist now: no SIGBUS on a full /dev/shm later
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)


class Segments:
    """This rank's shared segment and its maps of the peers' (one object per communicator, kept in
    its registry cache: it holds no reference to the communicator, which would keep it alive)."""

    def __init__(self, rank: int, token: str):
        self.rank = rank
        self.token = token
        self.gen = 0                    # the generation of this rank's segment (0: none yet)
        self.cap = 0
        self.mine: Optional[Tensor] = None
        self.peers: dict = {}           # rank -> (generation, uint8 tensor)
        self._unlink: list = []         # this rank's files its peers have not yet mapped
        # a call that raised (or only small calls since) leaves a new file pending: gone with this object
        weakref.finalize(self, _unlink_all, self._unlink)

    def _path(self, rank: int, gen: int) -> str:
        return os.path.join(_DIR, f"fmoe-{self.token}-r{rank}-g{gen}")

    def _ensure(self, nbytes: int) -> bool:
        """This rank's segment holds ``nbytes``: grown (a new file) where it does not. False where
        the file cannot be made (/dev/shm full or unwritable): the call then takes gloo."""
        if nbytes <= self.cap:
            return True
        cap = -(-max(nbytes + nbytes // 4, _MIN_BYTES) // 4096) * 4096
        path = self._path(self.rank, self.gen + 1)
        try:
            _reserve(path, cap)
            seg = torch.from_file(path, shared=True, size=cap, dtype=torch.uint8)
        except (OSError, RuntimeError):
            return False
        self.gen, self.cap, self.mine = self.gen + 1, cap, seg
        self._unlink.append(path)
        return True

    def _peer(self, u: int, gen: int, cap: int) -> Tensor:
        have = self.peers.get(u)
        if have is None or have[0] != gen:
            self.peers[u] = (gen, torch.from_file(self._path(u, gen), shared=True, size=cap, dtype=torch.uint8))
        return self.peers[u][1]

    def exchange(self, comm, x: Tensor, rows: Optional[Tensor], place: Optional[Tensor], out: Tensor, send: list,
                 recv: list) -> bool:
        """``out[place] = all_to_all_v(x[rows], send, recv)`` over ``comm`` (TorchDistComm.exchange_rows'
        contract, its arguments already checked; ``out`` [sum(recv), ...] contiguous, x contiguous).
        False, on every rank alike and with nothing moved, where a rank could not make its segment."""
        me, W = comm.rank, comm.size
        tail = tuple(x.shape[1:])
        row_bytes = math.prod(tail) * x.element_size()
        starts = [sum(send[:w]) for w in range(W)]
        s0, ns = starts[me], send[me]
        peer_rows = sum(send) - ns
        need = peer_rows * row_bytes
        inline = all(send[w] * row_bytes <= INLINE_BYTES for w in range(W) if w != me)
        ok = inline or self._ensure(need)
        head = torch.tensor([int(ok), int(inline), self.gen, self.cap, row_bytes] + list(send) + list(recv),
                            dtype=torch.int64)
        hb = head.numel() * 8
        # block w goes to rank w: this rank's header, then (inline) the rows for w
        mine = torch.empty(W, hb + INLINE_BYTES, dtype=torch.uint8)
        mine[:, :hb] = head.view(torch.uint8)
        if inline:
            for w in range(W):
                if w != me and send[w]:
                    buf = mine[w, hb:hb + send[w] * row_bytes].view(x.dtype).view(send[w], *tail)
                    move_rows(*_sent(x, rows, starts[w], send[w]), None, buf)
        table = torch.empty(W, hb + INLINE_BYTES, dtype=torch.uint8)
        comm._do("all-to-all (shared-memory counts)",
                 lambda: dist.all_to_all_single(table.view(-1), mine.view(-1), group=comm.group))
        t = table[:, :hb].contiguous().view(torch.int64).tolist()   # per rank: ok, inline, gen, cap, bytes, send, recv
        widths = [row[4] for row in t]
        if any(b != row_bytes for b in widths):
            raise ValueError(f"all-to-all: the ranks' rows differ in size (bytes per row by rank: {widths}); "
                             "every rank raises")
        if not all(row[0] for row in t):
            return False
        unpaired = [(u, w) for u in range(W) for w in range(W) if t[u][5 + w] != t[w][5 + W + u]]
        if unpaired:
            u, w = unpaired[0]
            raise ValueError(f"all-to-all: rank {u} sends rank {w} {t[u][5 + w]} rows but rank {w} expects "
                             f"{t[w][5 + W + u]} from it ({len(unpaired)} unpaired count(s)); every rank raises")
        if not inline:   # after the counts exchange: every peer is done reading this segment's last rows
            self._pack(x, rows, s0, ns, self.mine[:need].view(x.dtype).view(peer_rows, *tail))
        r0, nr = sum(recv[:me]), recv[me]
        if ns:   # this rank's own rows, straight from x
            to = (None, out[r0:r0 + nr]) if place is None else (place[r0:r0 + nr], out)
            move_rows(*_sent(x, rows, s0, ns), *to)
        # every peer's current segment, received from or not: a new one is unlinked after this call's barrier
        segs = {u: self._peer(u, t[u][2], t[u][3]) for u in range(W) if u != me and t[u][2]}
        if not all(row[1] for row in t):   # some rank wrote its segment: wait until all have
            comm._do("all-to-all (shared-memory barrier)", lambda: dist.barrier(group=comm.group))
            _unlink_all(self._unlink)   # every peer mapped them before the barrier
        at = 0
        for u in range(W):
            n = recv[u]
            if u != me and n:
                if t[u][1]:
                    src = table[u, hb:hb + n * row_bytes]
                else:
                    off = sum(t[u][5 + w] for w in range(me) if w != u) * row_bytes
                    src = segs[u][off:off + n * row_bytes]
                src = src.view(x.dtype).view(n, *tail)
                if place is None:
                    out[at:at + n].copy_(src)
                else:
                    move_rows(src, None, place[at:at + n], out)
            at += n
        return True

    @staticmethod
    def _pack(x: Tensor, rows: Optional[Tensor], s0: int, ns: int, buf: Tensor) -> None:
        """The rows this rank sends its peers, in destination order (its own ns rows at s0 left out)."""
        if rows is None:
            buf[:s0].copy_(x[:s0])
            buf[s0:].copy_(x[s0 + ns:])
        else:
            move_rows(x, torch.cat([rows[:s0], rows[s0 + ns:]]), None, buf)


def segments(comm) -> Optional[Segments]:
    """``comm``'s shared segments, made at its first call (a collective: every rank reports its host
    and whether it can write /dev/shm); None where the ranks are not all on one host with /dev/shm."""
    cache = cache_of(comm)
    seg = cache.get(_KEY)
    if seg is None:
        ok = os.path.isdir(_DIR) and os.access(_DIR, os.W_OK) and hasattr(os, "posix_fallocate")
        text = comm._gather_text(f"{int(ok)} {secrets.token_hex(8)} {socket.gethostname()}")
        rows = [r.split(" ", 2) for r in text]
        same = all(len(r) == 3 and r[0] == "1" and r[2] == rows[0][2] for r in rows)
        seg = cache.setdefault(_KEY, Segments(comm.rank, rows[0][1]) if same else False)
    return seg or None
