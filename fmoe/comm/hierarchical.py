"""Two-level (2DH) all-to-all (spec §12.4): one exchange among the ranks that
share a local index (inter-node), one among the ranks of a node (intra-node),
and a local reorder. It moves the same bytes to the same places as the flat
exchange, so results are bit-for-bit identical; it only trades W-1 small
inter-node messages for N-1 larger ones.
"""
from __future__ import annotations

from typing import Optional, Sequence

from torch import Tensor

from .layout import chunks_to_front, front_to_concat, norm_axis


class Hierarchical2DComm:
    """Wrap a communicator so its all-to-all runs in two levels.

    Global rank = node * local_size + local. Construction is collective (it
    splits ``comm`` twice). Every other collective is delegated to ``comm``.

    Args:
        comm: the flat communicator (size W).
        local_size: L, ranks per node; W % L must be 0. L = 1 or L = W
            degrade to the flat exchange.
    """

    def __init__(self, comm, local_size: int):
        W = comm.size
        if isinstance(local_size, bool) or not isinstance(local_size, int) or local_size < 1 or W % local_size:
            raise ValueError(f"2DH all-to-all: local_size must be a positive divisor of the world size {W}, "
                             f"got {local_size!r}")
        self.base = comm
        self.rank, self.size = comm.rank, W
        self.local_size = local_size
        self.num_nodes = W // local_size
        node, local = divmod(comm.rank, local_size)
        self.inter = comm.split(local, node)   # same local index, ordered by node
        self.intra = comm.split(node, local)   # same node, ordered by local index

    def __repr__(self) -> str:
        return f"Hierarchical2DComm({self.base!r}, local_size={self.local_size})"

    def exchange(self, front: Tensor) -> Tensor:
        """Flat-exchange semantics on [W, ...] (row w to rank w), done in two levels."""
        N, L = self.num_nodes, self.local_size
        chunk = tuple(front.shape[1:])
        x = front.reshape((N, L) + chunk)
        if N > 1:
            x = self.inter.all_to_all(x, 0, 0)            # [N_src, L_dst, *chunk]
        x = x.transpose(0, 1).contiguous()                  # [L_dst, N_src, *chunk]
        if L > 1:
            x = self.intra.all_to_all(x, 0, 0)            # [L_src, N_src, *chunk]
        return x.transpose(0, 1).reshape((N * L,) + chunk)  # global source order

    def all_to_all(self, x: Tensor, concat_axis: int, split_axis: int) -> Tensor:
        concat_axis = norm_axis(concat_axis, x.dim(), "concat_axis")
        return front_to_concat(self.exchange(chunks_to_front(x, split_axis, self.size)), concat_axis)

    def all_to_all_v(self, x: Tensor, send_counts: Sequence[int], recv_counts: Sequence[int]) -> Tensor:
        return self.base.all_to_all_v(x, send_counts, recv_counts)

    def all_reduce(self, x: Tensor, op: str = "sum") -> Tensor:
        return self.base.all_reduce(x, op)

    def all_gather(self, x: Tensor, axis: int = 0) -> Tensor:
        return self.base.all_gather(x, axis)

    def split(self, color: int, key: Optional[int] = None):
        return self.base.split(color, key)

    def abort(self, message: str = "", code: int = 1) -> None:
        abort(self.base, message, code)


def abort(comm, message: str = "", code: int = 1) -> None:
    from .launch import abort as _abort
    _abort(comm, message, code)
