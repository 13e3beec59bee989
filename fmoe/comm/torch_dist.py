"""`TorchDistComm`: the Communicator protocol over a torch.distributed group (gloo on CPU, nccl on GPU)."""
from __future__ import annotations

import datetime
import gc
import os
import sys
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .layout import chunks_to_front, front_to_concat, gathered_to_axis, norm_axis, raw_collective
from .registry import forget_all

__all__ = ["TorchDistComm"]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class TorchDistComm:
    """Communicator over a ``torch.distributed`` process group.

    Args:
        group: a process group; None means the default (WORLD) group, which
            must already be initialised (see :meth:`from_env`).

    Collective timeouts are the process group's own (``init_process_group(timeout=...)``).
    """

    def __init__(self, group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("TorchDistComm needs an initialised torch.distributed process group; "
                               "call TorchDistComm.from_env() under torchrun, or init_process_group first")
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    @classmethod
    def from_env(cls, backend: str = "gloo", timeout: Optional[float] = None) -> "TorchDistComm":
        """Initialise the default group from torchrun's variables (env://) unless already done."""
        if not dist.is_initialized():
            kw = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
            dist.init_process_group(backend=backend, init_method="env://", **kw)
        return cls()

    def __repr__(self) -> str:
        return f"TorchDistComm(rank={self.rank}, size={self.size}, backend={dist.get_backend(self.group)})"

    def close(self) -> None:
        """Shut the default process group down cleanly (collective: every rank calls it at the end).

        Exiting with a live gloo group lets its threads be torn down mid-flight, which aborts a rank
        at interpreter exit ("terminate called without an active exception") about one run in three.
        Also forgets every registered communicator: call it once, at the end of the job.
        """
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        # Sub-groups made for sharded experts / 2DH live in the split cache and the handle
        # registry; freed at interpreter teardown, their gloo threads abort the process.
        self.__dict__.pop("_fmoe_subcomms", None)
        forget_all()
        gc.collect()

    def abort(self, message: str = "", code: int = 1) -> None:
        """Print ``message`` and end this process at once; torchrun then stops the other ranks."""
        if message:
            sys.stderr.write(f"[fmoe rank {self.rank}/{self.size}] aborting: {message}\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(code)

    def barrier(self) -> None:
        dist.barrier(self.group)

    @raw_collective
    def exchange(self, front: Tensor) -> Tensor:
        """Row w of ``front`` [W, ...] goes to rank w; row u of the result came from rank u."""
        front = front.contiguous()
        out = torch.empty_like(front)
        if front.numel():
            dist.all_to_all_single(out, front, group=self.group)
        return out

    @raw_collective
    def all_to_all(self, x: Tensor, concat_axis: int, split_axis: int) -> Tensor:
        concat_axis = norm_axis(concat_axis, x.dim(), "concat_axis")
        return front_to_concat(self.exchange(chunks_to_front(x, split_axis, self.size)), concat_axis)

    @raw_collective
    def all_to_all_v(self, x: Tensor, send_counts: Sequence[int], recv_counts: Sequence[int]) -> Tensor:
        send, recv = [int(c) for c in send_counts], [int(c) for c in recv_counts]
        if len(send) != self.size or len(recv) != self.size or sum(send) != x.shape[0]:
            raise ValueError(f"all_to_all_v: need {self.size} counts each with sum(send_counts) == rows; got "
                             f"send={send}, recv={recv}, rows={x.shape[0]}")
        x = x.contiguous()
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send, group=self.group)
        return out

    @raw_collective
    def all_reduce(self, x: Tensor, op: str = "sum") -> Tensor:
        if op not in _OPS:
            raise ValueError(f"all_reduce op must be one of {tuple(_OPS)}, got {op!r}")
        out = x.detach().clone().contiguous()
        dist.all_reduce(out, op=_OPS[op], group=self.group)
        return out

    @raw_collective
    def all_gather(self, x: Tensor, axis: int = 0) -> Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        out = torch.stack(parts)
        return out if x.dim() == 0 else gathered_to_axis(out, norm_axis(axis, x.dim()))

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
        return TorchDistComm(sub)
