"""Matched collectives: a fixed-size control record exchanged with (or before) a collective's data.

MPI (blocking or not) and gloo match collectives by order only: rank 0's
all_reduce can meet rank 1's all_gather, and both may return each other's
bytes. So a checked collective of :class:`~mpi_backend.MPIComm` and
:class:`~fmoe.comm.TorchDistComm` all-gathers one *control record* per rank,
int64 [CTRL] = [header (HEADER) | agreement record (RECORD) | payload (PAYLOAD)]:

    header:  [MAGIC, kind, call number, error flag, dtype, ndim, dim 0..7, op, 0]
    record:  the step-agreement record of the fmoe call this collective starts, or zeros
             (:mod:`.agreement`; deferred from the call's start so it costs no exchange of its own)
    payload: the data itself when it fits (all_reduce / all_gather of at most PAYLOAD_BYTES,
             all_to_all_v's counts): such a collective is matched and done in one exchange

(the same size for every kind, so control exchanges always pair up) and
compares them on every rank; the data moves only if all agree. A mismatch
raises :class:`CollectiveMismatchError` on every rank naming each rank's
collective; a rank whose local arguments were invalid sets the error flag, so
its peers raise too instead of waiting for data that never comes.

Which collectives are checked is the communicator's ``checks`` setting (:data:`CHECKS`):

* ``"full"`` (default): every collective. Those that a checked fmoe call makes inside its
  expert stage (:func:`covered`) move raw: the call's agreement record already fixed their kind,
  order, dtype and shape on every rank. Everything else, the backward pass's exchanges included,
  sends its control record first (small ones: control record only).
* ``"step"``: only the step agreement, once per fmoe call, carried by the call's first collective.
* ``"off"``: nothing; the agreement is skipped too (local argument checks still raise locally).

Shapes that must agree: the whole shape for all_to_all, all_gather and
all_reduce (and the reduction op); the row shape (all dims but the first) for
all_to_all_v, whose counts are then cross-checked (``recv[u]`` on rank w equals
``send[w]`` on rank u) with one more all-gather.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from . import agreement
from .agreement import CollectiveMismatchError, InconsistentRanksError, StepMismatchError, _h64


MAGIC = 0x664D6F45434F4C4C  # "fMoECOLL"
HEADER = 16
_DIMS = 8
KINDS = ("all_to_all", "all_to_all_v", "all_reduce", "all_gather", "barrier", "split", "close", "agreement")
_CODE = {k: i + 1 for i, k in enumerate(KINDS)}
_DTYPES = (None, torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2,
           torch.complex64, torch.complex128)
_DCODE = {d: i for i, d in enumerate(_DTYPES)}
_OPS = ("", "sum", "max", "min")
_SAME_SHAPE = {"all_to_all", "all_gather", "all_reduce"}

CHECKS = ("full", "step", "off")
RECORD = agreement.RECORD
PAYLOAD = 18                      # int64 words of inline data: 144 bytes (a capacity, a few counts)
PAYLOAD_BYTES = 8 * PAYLOAD
CTRL = HEADER + RECORD + PAYLOAD  # 64 words, 512 bytes per rank


def _header_words(kind: str, call: int, x: Optional[Tensor], op: str, failed: bool) -> list[int]:
    h = [MAGIC, _CODE[kind], call, int(failed)] + [0] * (HEADER - 4)
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
    return h


def header(kind: str, call: int, x: Optional[Tensor] = None, *, op: str = "", failed: bool = False) -> np.ndarray:
    """This rank's header (numpy int64 [HEADER]: cheaper to build than a tensor, and MPI sends it as
    is) for collective number ``call`` of ``kind`` on ``x``."""
    return np.array(_header_words(kind, call, x, op, failed), dtype=np.int64)


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


# --------------------------------------------------------------------------- control exchange

def check_mode(checks) -> str:
    """Validate a communicator's ``checks`` setting ('full', 'step' or 'off')."""
    if not isinstance(checks, str) or checks not in CHECKS:
        raise ValueError(f"checks must be one of {CHECKS} ('full': every collective matched; 'step': the "
                         f"step agreement of each fmoe call only; 'off': nothing), got {checks!r}")
    return checks


# ids of the communicators whose collectives the current fmoe call's agreement already fixed
_COVERED: contextvars.ContextVar = contextvars.ContextVar("fmoe_covered", default=frozenset())


@contextlib.contextmanager
def covered(comm):
    """Within this block ``comm``'s collectives need no control record of their own under
    ``checks="full"``: the caller's agreement fixed their kind, order, dtype and shape on every rank.

    Held in a context variable (per thread and task), never on the communicator.
    """
    token = _COVERED.set(_COVERED.get() | {id(comm)})
    try:
        yield
    finally:
        _COVERED.reset(token)


def is_covered(comm) -> bool:
    return id(comm) in _COVERED.get()


def fits(x: Tensor) -> bool:
    """Whether ``x``'s bytes fit in the control record's payload (then the collective is one exchange)."""
    return x.device.type == "cpu" and x.numel() * x.element_size() <= PAYLOAD_BYTES


def control_words(kind: str, call: int, x: Optional[Tensor] = None, *, op: str = "", failed: bool = False,
                  record=None, payload: Optional[Tensor] = None) -> list[int]:
    """This rank's control record as CTRL ints: header, agreement record (or zeros), payload bytes.

    ``record``: RECORD ints from :mod:`.agreement`; ``payload``: a tensor with :func:`fits`.
    Plain ints, not arrays: this runs once per checked collective, between tensor ops that leave
    numpy's code cold, where every array call costs several microseconds.
    """
    words = _header_words(kind, call, x, op, failed)
    words += _NO_RECORD if record is None else list(record)
    if payload is None:
        return words + _NO_PAYLOAD
    if payload.dtype == torch.int64:  # the common case (a capacity, counts)
        flat = payload.detach().reshape(-1).tolist()
        return words + flat + [0] * (PAYLOAD - len(flat))
    raw = _numpy(payload)
    raw = raw.reshape(-1).view(np.uint8) if raw is not None else \
        payload.detach().reshape(-1).contiguous().view(torch.uint8).numpy()
    buf = np.zeros(PAYLOAD, dtype=np.int64)
    buf.view(np.uint8)[:raw.size] = raw
    return words + buf.tolist()


def control(kind: str, call: int, x: Optional[Tensor] = None, *, op: str = "", failed: bool = False,
            record=None, payload: Optional[Tensor] = None) -> np.ndarray:
    """:func:`control_words` as int64 numpy [CTRL]."""
    return np.array(control_words(kind, call, x, op=op, failed=failed, record=record, payload=payload),
                    dtype=np.int64)


def _table(table) -> np.ndarray:
    """Gathered control records as int64 numpy [W, CTRL] (from a list of rows, an array or a tensor)."""
    return np.asarray(table, dtype=np.int64)


_NO_RECORD = [0] * RECORD
_NO_PAYLOAD = [0] * PAYLOAD

# dtypes numpy holds natively: their inline payloads are read and reduced in numpy (a few us less per
# collective than tensor ops, which matters on the small exchanges this path exists for)
_NUMPY = {torch.float32: np.float32, torch.float64: np.float64, torch.int64: np.int64, torch.int32: np.int32,
          torch.int16: np.int16, torch.int8: np.int8, torch.uint8: np.uint8}
_REDUCE = {"sum": np.add, "max": np.maximum, "min": np.minimum}


def _numpy(t: Tensor) -> Optional[np.ndarray]:
    if t.dtype not in _NUMPY:
        return None
    return np.ascontiguousarray(t.detach().numpy())


def _rows(table, like: Tensor) -> np.ndarray:
    """[W, numel] of like's numpy dtype (a view when the payload is whole int64 words)."""
    table = _table(table)
    n = like.numel()
    if like.dtype in (torch.int64, torch.float64):
        return table[:, HEADER + RECORD:HEADER + RECORD + n].view(_NUMPY[like.dtype]) if n else \
            np.zeros((table.shape[0], 0), _NUMPY[like.dtype])
    raw = np.ascontiguousarray(table[:, HEADER + RECORD:]).view(np.uint8)[:, :n * like.element_size()]
    return np.ascontiguousarray(raw)


def payload_of(table: np.ndarray, like: Tensor) -> Tensor:
    """Every rank's payload [W, *like.shape] (like's dtype) out of the gathered control records [W, CTRL]."""
    W = len(table)
    raw = _rows(table, like)
    if like.dtype in _NUMPY:
        return torch.from_numpy(np.ascontiguousarray(raw).view(_NUMPY[like.dtype]).reshape(W, *like.shape))
    return torch.from_numpy(raw).view(like.dtype).reshape(W, *like.shape)


def reduce_rows(table: np.ndarray, like: Tensor, op: str) -> Tensor:
    """all_reduce of the inline payloads of the gathered control records [W, CTRL] (each shaped like
    ``like``), taken on every rank from the same table in the same order, so every rank gets bit-identical
    results; floats narrower than 32 bits are reduced in fp32, as MPIComm does."""
    dtype = like.dtype
    if dtype == torch.int64 and isinstance(table, list):  # plain ints: no array calls
        n = like.numel()
        cols = zip(*(r[HEADER + RECORD:HEADER + RECORD + n] for r in table))
        fn = sum if op == "sum" else max if op == "max" else min
        vals = [((fn(c) + 2 ** 63) % 2 ** 64) - 2 ** 63 for c in cols]  # int64 wraps, as in MPI
        return torch.tensor(vals, dtype=torch.int64).reshape(like.shape)
    if dtype in _NUMPY:
        rows = _rows(table, like)
        if dtype not in (torch.int64, torch.float64):
            rows = rows.view(_NUMPY[dtype])
        out = _REDUCE[op].reduce(rows, axis=0, dtype=rows.dtype)  # in the payload's own dtype, like MPI
        return torch.from_numpy(out.reshape(like.shape))
    rows = payload_of(table, like)
    if dtype == torch.bool:
        rows = rows.to(torch.uint8)
    elif dtype.is_floating_point and dtype.itemsize < 4:
        rows = rows.float()
    out = rows.sum(0) if op == "sum" else rows.amax(0) if op == "max" else rows.amin(0)
    return out.to(dtype)


def check_control(table, rank: int, kind: str, error: Optional[BaseException],
                  gather_text: Callable[[str], list], pending=None) -> None:
    """Decide from the gathered control records [W, CTRL] (identical on every rank); raise on all ranks alike.

    Order: records that are not fmoe's (another exchange met this one), then the agreement records
    (a rank in a different fmoe call, or one that skipped a call, is a step mismatch), then the headers
    (:func:`check`). ``pending`` is this rank's :class:`~fmoe.comm.agreement.Pending` sent with it.
    """
    lists = table if isinstance(table, list) else _table(table).tolist()
    # the common case: every rank sent the same header and record, without an error flag
    first = lists[0][:HEADER + RECORD]
    if first[0] == MAGIC and not first[3] and (first[HEADER] == 0 or not first[HEADER + 3]) \
            and all(r[:HEADER + RECORD] == first for r in lists[1:]):
        return
    rows = _table(lists)
    heads = rows[:, :HEADER]
    if (heads[:, 0] == MAGIC).all():
        recs = rows[:, HEADER:HEADER + RECORD]
        has = recs[:, 0] == agreement.MAGIC
        if has.any() and not has.all():
            raise StepMismatchError(
                "ranks are at different steps: " + "; ".join(
                    f"rank {u} is in {agreement.describe(recs[u].tolist())}" if has[u] else
                    f"rank {u} is in {_describe(heads[u].tolist())}, outside any fmoe call"
                    for u in range(len(rows)))
                + ". A rank skipped, repeated or reordered a step, or made a collective of its own where its "
                "peers started an fmoe call.")
        if has.all():
            agreement.check_records(recs.tolist(), pending, gather_text)
    check(heads, rank, kind, error, gather_text)


class ControlExchange:
    """The collective-matching protocol MPIComm and TorchDistComm share: the call counter, the
    pending agreement record of an fmoe call, and the control exchange that carries both.

    A communicator sets ``checks``, ``rank``, ``_calls = 0`` and ``_pending = None``, and provides
    ``_exchange_control(words, what) -> table`` (one all-gather of this rank's ``CTRL`` ints:
    W lists of ``CTRL`` ints) and ``_gather_text(text, width)``."""

    def _stage_agreement(self, pending, *, defer: bool) -> None:
        """Take an fmoe call's agreement record (:class:`fmoe.comm.agreement.Pending`); it travels in
        the control record of this object's next collective, or now unless ``defer`` (or on a local error)."""
        if self._pending is not None:  # an earlier call's record that no collective carried
            self._begin("agreement")
        self._pending = pending
        if not defer or pending.error is not None:
            self._begin("agreement")

    def _begin(self, kind: str, x: Optional[Tensor] = None, *, op: str = "",
               error: Optional[BaseException] = None, payload: Optional[Tensor] = None):
        """Start the next collective: (call number, gathered control records: W lists of CTRL ints, or None).

        None: the collective moves unchecked (``checks`` is not "full", or an agreed fmoe call
        covers it) and raises ``error`` here. Otherwise the control exchange carried the header,
        the pending agreement record and ``payload`` (whose result the caller reads off the table);
        it raised on every rank unless all agree.
        """
        self._calls += 1
        call = self._calls
        pending = self._pending
        if pending is None and (self.checks != "full" or is_covered(self)):
            if error is not None:
                raise error
            return call, None
        self._pending = None
        words = control_words(kind, call, x, op=op, failed=error is not None,
                              record=None if pending is None else pending.record, payload=payload)
        table = self._exchange_control(words, f"{kind} #{call} (header)")
        check_control(table, self.rank, kind, error, self._gather_text, pending)
        return call, table
