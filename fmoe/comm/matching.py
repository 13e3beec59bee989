"""Matched collectives: a fixed-size header exchanged before every collective's data.

MPI (blocking or not) and gloo match collectives by order only: rank 0's
all_reduce can meet rank 1's all_gather, and both may return each other's
bytes. So every collective of :class:`~mpi_backend.MPIComm` and
:class:`~fmoe.comm.TorchDistComm` first all-gathers one int64 header per rank

    [MAGIC, kind, call number, error flag, dtype, ndim, dim 0..7, extra, 0]

(the same size for every kind, so the header exchange itself always matches)
and compares them on every rank; the data moves only if all agree. A mismatch
raises :class:`CollectiveMismatchError` on every rank naming each rank's
collective; a rank whose local arguments were invalid sets the error flag, so
its peers raise too instead of waiting for data that never comes.

Shapes that must agree: the whole shape for all_to_all, all_gather and
all_reduce (and the reduction op); the row shape (all dims but the first) for
all_to_all_v, whose counts are then cross-checked (``recv[u]`` on rank w equals
``send[w]`` on rank u) with one more all-gather.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from .agreement import CollectiveMismatchError, InconsistentRanksError, _h64

__all__ = ["HEADER", "KINDS", "header", "check", "check_counts", "CollectiveMismatchError"]

MAGIC = 0x664D6F45434F4C4C  # "fMoECOLL"
HEADER = 16
_DIMS = 8
KINDS = ("all_to_all", "all_to_all_v", "all_reduce", "all_gather", "barrier", "split", "close")
_CODE = {k: i + 1 for i, k in enumerate(KINDS)}
_DTYPES = (None, torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2,
           torch.complex64, torch.complex128)
_DCODE = {d: i for i, d in enumerate(_DTYPES)}
_OPS = ("", "sum", "max", "min")
_SAME_SHAPE = {"all_to_all", "all_gather", "all_reduce"}


def header(kind: str, call: int, x: Optional[Tensor] = None, *, op: str = "", failed: bool = False) -> np.ndarray:
    """This rank's header (numpy int64 [HEADER]: cheaper to build than a tensor, and MPI sends it as
    is) for collective number ``call`` of ``kind`` on ``x``."""
    h = [0] * HEADER
    h[0], h[1], h[2], h[3] = MAGIC, _CODE[kind], call, int(failed)
    if x is not None:
        code = _DCODE.get(x.dtype)
        h[4] = code if code is not None else len(_DTYPES) + (_h64(str(x.dtype)) & 0xFFFF)
        shape = list(x.shape)
        if kind == "all_to_all_v" and shape:
            shape[0] = 0  # rows differ per rank; the counts are checked separately
        h[5] = len(shape)
        dims = shape[:_DIMS - 1] + ([_h64(repr(shape[_DIMS - 1:]))] if len(shape) >= _DIMS else [])
        h[6:6 + len(dims)] = dims
    h[14] = _OPS.index(op) if op in _OPS else 0
    return np.array(h, dtype=np.int64)


def _describe(row: Sequence[int]) -> str:
    if row[0] != MAGIC:
        return "not an fmoe collective header (the rank is in some other exchange)"
    kind = KINDS[row[1] - 1] if 1 <= row[1] <= len(KINDS) else f"kind {row[1]}"
    op = f"({_OPS[row[14]]})" if 0 < row[14] < len(_OPS) else ""
    text = f"{kind}{op} #{row[2]}"
    if row[5] or row[4]:
        dt = _DTYPES[row[4]] if 0 < row[4] < len(_DTYPES) else f"dtype {row[4]}"
        dims = [("rows" if kind == "all_to_all_v" and i == 0 else str(d)) for i, d in enumerate(row[6:6 + min(row[5], _DIMS)])]
        text += f" {str(dt).replace('torch.', '')} [{', '.join(dims)}]"
    return text


def check(table, rank: int, kind: str, error: Optional[BaseException],
          gather_text: Callable[[str], list]) -> None:
    """Compare the gathered headers [W, HEADER] (tensor or array); raise on every rank unless all match.

    ``error`` is this rank's own argument error (re-raised here after its peers
    have been told); ``gather_text`` all-gathers one string per rank (run only
    when every rank sees a flag, so all ranks call it together).
    """
    rows = table.tolist()
    mine = rows[rank]
    if any(r[:3] != mine[:3] for r in rows):
        raise CollectiveMismatchError(
            "ranks entered different collectives: " + "; ".join(f"rank {u}: {_describe(r)}" for u, r in enumerate(rows))
            + ". Every rank must make the same collective calls in the same order.")
    failed = [u for u, r in enumerate(rows) if r[3]]
    if failed:
        texts = gather_text("" if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        raise InconsistentRanksError(f"{kind} #{mine[2]}: invalid arguments on rank(s) "
                                     + "; ".join(f"{u}: {texts[u]}" for u in failed))
    if kind in _SAME_SHAPE:
        differ = any(r[4:] != mine[4:] for r in rows)
    elif kind == "all_to_all_v":
        differ = any(r[4:6] != mine[4:6] or r[7:] != mine[7:] for r in rows)
    else:
        differ = False
    if differ:
        raise CollectiveMismatchError(
            f"ranks called {kind} #{mine[2]} with different dtypes/shapes/ops: "
            + "; ".join(f"rank {u}: {_describe(r)}" for u, r in enumerate(rows))
            + (" (every rank passes the same shape)" if kind in _SAME_SHAPE else " (rows may differ, the rest not)"))


def check_counts(counts: Tensor, call: int) -> None:
    """all_to_all_v: ``counts`` [W, 2W], row u = rank u's send counts then its recv counts.

    Every rank holds the whole table, so all ranks take the same decision:
    raise unless rank w's ``recv[u]`` equals rank u's ``send[w]`` for all u, w.
    """
    W = counts.shape[0]
    send, recv = counts[:, :W], counts[:, W:]
    bad = (recv != send.t()).nonzero().tolist()
    if bad:
        w, u = bad[0]
        raise CollectiveMismatchError(
            f"all_to_all_v #{call}: counts do not pair up in {len(bad)} place(s), e.g. rank {w} expects "
            f"{int(recv[w, u])} rows from rank {u}, which sends it {int(send[u, w])}")
