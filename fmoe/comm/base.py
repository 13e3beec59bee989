"""The Communicator protocol and the single-process implementation."""
from __future__ import annotations

from typing import Optional, Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor


REDUCE_OPS = ("sum", "max", "min")


@runtime_checkable
class Communicator(Protocol):
    """What fmoe needs from a process group.

    All methods are collectives: every rank of the group must call them in the
    same order with compatible shapes. None of them mutates its input.

    Attributes:
        rank: this process's index in the group, 0 <= rank < size.
        size: number of processes W.
    """

    rank: int
    size: int

    def all_to_all(self, x: Tensor, concat_axis: int, split_axis: int) -> Tensor:
        """JAX-style all-to-all: split ``x`` along ``split_axis`` into ``size``
        equal chunks, send chunk w to rank w, concatenate what arrives along
        ``concat_axis`` in source-rank order."""
        ...

    def all_to_all_v(self, x: Tensor, send_counts: Sequence[int], recv_counts: Sequence[int]) -> Tensor:
        """Variable all-to-all along dim 0: rows ``[sum(send_counts[:w]), +send_counts[w])``
        go to rank w; the result stacks ``recv_counts[u]`` rows from each source u."""
        ...

    def all_reduce(self, x: Tensor, op: str = "sum") -> Tensor:
        """Elementwise reduction over ranks ('sum', 'max' or 'min'); returns a new tensor."""
        ...

    def all_gather(self, x: Tensor, axis: int = 0) -> Tensor:
        """Concatenate every rank's ``x`` along ``axis`` in rank order."""
        ...

    def split(self, color: int, key: Optional[int] = None) -> "Communicator":
        """Sub-communicator of the ranks that passed the same ``color``,
        ordered by ``key`` (default: current rank)."""
        ...

    # Communicators made by fmoe.comm.from_env() also have close(): an end-of-job, collective
    # shutdown (torch.distributed needs it to exit cleanly). It is not needed by fmoe's functions.


class LocalComm:
    """The trivial communicator of one process. Every collective is an identity."""

    rank = 0
    size = 1

    def all_to_all(self, x: Tensor, concat_axis: int, split_axis: int) -> Tensor:
        return x

    def all_to_all_v(self, x: Tensor, send_counts: Sequence[int], recv_counts: Sequence[int]) -> Tensor:
        if list(send_counts) != list(recv_counts) or sum(send_counts) != x.shape[0]:
            raise ValueError(
                f"LocalComm.all_to_all_v: counts must match x's rows, got send={list(send_counts)}, "
                f"recv={list(recv_counts)}, rows={x.shape[0]}")
        return x

    def all_reduce(self, x: Tensor, op: str = "sum") -> Tensor:
        if op not in REDUCE_OPS:
            raise ValueError(f"all_reduce op must be one of {REDUCE_OPS}, got {op!r}")
        return x.clone()

    def all_gather(self, x: Tensor, axis: int = 0) -> Tensor:
        return x

    def split(self, color: int, key: Optional[int] = None) -> "LocalComm":
        return self

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return "LocalComm()"


def resolve(comm) -> Communicator:
    """``None`` -> :class:`LocalComm`; anything else must implement the protocol."""
    if comm is None:
        return LocalComm()
    missing = [a for a in ("rank", "size", "all_to_all", "all_reduce", "all_gather", "split")
               if not hasattr(comm, a)]
    if missing:
        raise TypeError(f"comm of type {type(comm).__name__} is not a Communicator: missing {missing}")
    return comm
