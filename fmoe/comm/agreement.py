"""Cross-rank agreement: every rank is in the same call of the same program step, with the same settings.

A distributed fmoe call exchanges one fixed-size int64 record per rank (the
*agreement record*) before any of its data moves:

    [MAGIC, kind, call number, error flag, settings digest, field count, field 0, ..., field F-1]

* ``kind`` and ``call number``: the number counts agreement calls per
  communicator object (kept in :mod:`.registry`, never on the communicator).
  A rank that skipped or repeated a step shifts its calls against its peers';
  shifted calls whose settings differ raise at once (field mismatch), and at
  the latest the first rank to finish meets a peer still inside an fmoe call
  with its end-of-job check (kind ``end``, run by ``close()`` and by
  :func:`~fmoe.comm.abort_on_error`): every rank raises
  :class:`StepMismatchError` naming each rank's kind and call number, instead
  of the peer waiting forever. Ranks that use different communicator objects
  for the same group sit at different numbers and raise too.
* ``error flag``: a rank whose local inputs are invalid still joins the
  exchange, so every rank raises (the bad rank its own error, the others
  :class:`InconsistentRanksError` with its message) instead of hanging.
* ``digest`` and the fields: static settings (spec, parallel mode, dtype, ...);
  any difference raises on every rank naming the field and each rank's value.

The decision to raise is taken from the gathered table, identical on every
rank, so all ranks leave the check the same way (further text exchanges for
the message happen on all ranks or on none).

Cost: with fmoe's communicators the record rides in the control exchange of the
call's first collective (:mod:`.matching`; a small all_reduce/all_gather such as the
router's capacity agreement is then matched, agreed and done in one exchange), so a
checked call makes no exchange more than an unchecked one; with any other
communicator it is one all-gather of ``8 * (6 + FIELDS)`` bytes per rank per call.
``checks="off"`` on the communicator skips it (README "Failure behaviour").
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import struct
from typing import Callable, Optional

import torch

from . import registry


MAGIC = 0x664D6F4541475245  # "fMoEAGRE"
FIELDS = 24                 # field slots in the record; more fields are folded into the last slot
_HEAD = 6
RECORD = _HEAD + FIELDS     # int64 words of one record


class InconsistentRanksError(ValueError):
    """Ranks called a collective MoE function with different static settings or invalid inputs."""


class StepMismatchError(InconsistentRanksError):
    """Ranks are not in the same call: one skipped, repeated or reordered a step, or finished early."""


class CollectiveMismatchError(InconsistentRanksError):
    """Ranks entered different collectives (kind, dtype, shape or call number differ)."""


def _stable(obj) -> str:
    """A process-independent description of a static setting (no addresses, no salted hashes)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        inner = ",".join(f"{f.name}={_stable(getattr(obj, f.name))}" for f in dataclasses.fields(obj))
        return f"{type(obj).__name__}({inner})"
    if callable(obj):
        return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"
    return repr(obj)


def _h64(text: str) -> int:
    return struct.unpack("<q", hashlib.blake2b(text.encode(), digest_size=8).digest())[0]


@functools.lru_cache(maxsize=512)
def _h64_of_hashable(kind: type, v) -> int:
    return _h64(_stable(v))


def _cacheable(v) -> bool:
    """Values compared by content (strings, frozen eq-dataclasses): never identity-hashed objects,
    whose id may be reused by a different object later."""
    if isinstance(v, str):
        return True
    params = getattr(type(v), "__dataclass_params__", None)
    return params is not None and params.frozen and params.eq


# id -> (object, fingerprint) of frozen specs seen lately: the same spec object comes back every call,
# and finding it by identity skips hashing it (a nested frozen dataclass hashes all its fields each time).
# The object is held, so its id cannot be reused while it is here.
_BY_ID: dict = {}


def _fingerprint(fields: dict) -> list[int]:
    out = []
    for v in fields.values():
        if type(v) is int and abs(v) < 2 ** 62:
            out.append(v)
            continue
        if type(v) in (str, float, type(None)):  # often built afresh per call: found by value
            out.append(_h64_of_hashable(type(v), v))
            continue
        if _cacheable(v):  # frozen specs repeat every call: describing them dominated the check's cost
            hit = _BY_ID.get(id(v))
            if hit is not None and hit[0] is v:
                out.append(hit[1])
                continue
            try:
                fp = _h64_of_hashable(type(v), v)
            except (TypeError, RuntimeError):  # an unhashable field, or a tensor field compared on a collision
                out.append(_h64(_stable(v)))
                continue
            if len(_BY_ID) >= 512:
                _BY_ID.clear()
            _BY_ID[id(v)] = (v, fp)
            out.append(fp)
            continue
        out.append(_h64(_stable(v)))
    return out


def _gather_text(comm, text: str, width: int = 400) -> list[str]:
    raw = text.encode()[:width]
    buf = torch.zeros(width, dtype=torch.uint8)
    buf[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    rows = comm.all_gather(buf.unsqueeze(0), 0)
    return [bytes(r.tolist()).rstrip(b"\0").decode(errors="replace") for r in rows]


# kind code -> readable name, for the kinds this process knows (a peer's unknown kind prints as hex)
_KINDS: dict[int, str] = {}


_CODES: dict[str, int] = {}


def _kind(name: str) -> int:
    code = _CODES.get(name)
    if code is None:
        code = _CODES[name] = _h64("kind:" + name)
        _KINDS.setdefault(code, name)
    return code


_CALL, _END = _kind("call"), _kind("end")


# (name, fingerprint) pairs -> record tail: the digest and slots of settings seen before.
_TAILS: dict = {}


def _tail(fields: dict) -> list[int]:
    """[digest, field count, slot 0..FIELDS-1] of a record."""
    fp = _fingerprint(fields)
    key = tuple(zip(fields, fp))
    tail = _TAILS.get(key)
    if tail is None:
        digest = _h64("|".join(f"{n}={v}" for n, v in key))
        slots = fp[:FIELDS - 1] + ([_h64(repr(fp[FIELDS - 1:]))] if len(fp) >= FIELDS else [])
        tail = [digest, len(fp)] + slots + [0] * (FIELDS - len(slots))
        if len(_TAILS) >= 256:
            _TAILS.clear()
        _TAILS[key] = tail
    return tail


def _record_values(kind: int, call: int, failed: bool, fields: dict) -> list[int]:
    return [MAGIC, kind, call, int(failed)] + _tail(fields)


def _record(kind: int, call: int, failed: bool, fields: dict) -> torch.Tensor:
    """The record as int64 [RECORD]."""
    return torch.tensor(_record_values(kind, call, failed, fields), dtype=torch.int64)


def _describe(row) -> str:
    kind, call = int(row[1]), int(row[2])
    name = _KINDS.get(kind, f"kind {kind & 0xFFFFFFFF:#x}")
    return f"{'end-of-job check' if name == 'end' else 'fmoe ' + name} #{call}"


@dataclasses.dataclass
class Pending:
    """One rank's agreement record waiting to travel with its communicator's next exchange.

    Attributes:
        record: this rank's record, RECORD = _HEAD + FIELDS ints (:func:`_record`'s values).
        call: the agreement call number it carries.
        error: this rank's local input error (then it is exchanged at once), or None.
        fields: the settings it fingerprints (named in the error messages).
    """

    record: object
    call: int
    error: Optional[BaseException]
    fields: dict


def agree_across_ranks(comm, fields: dict, local_check: Optional[Callable[[], None]] = None, *,
                       kind: str = "call", defer: bool = False) -> None:
    """Collective guard run before the first exchange of a distributed call.

    Runs ``local_check`` (input validation) on every rank, then all-gathers the
    agreement record (module docstring). Raises on every rank if the ranks are
    at different calls (:class:`StepMismatchError`), if any rank failed its
    check (that rank re-raises its error, the others raise
    :class:`InconsistentRanksError` quoting it), or if any field differs
    (:class:`InconsistentRanksError` naming the field and every rank's value).

    A communicator with ``checks="off"`` skips the exchange (``local_check`` still
    raises, on this rank only). fmoe's own communicators (MPIComm, TorchDistComm) send the
    record in their fixed-size control exchange (:mod:`.matching`); with ``defer`` it waits
    there for the communicator's next collective and travels with it (no exchange of its
    own), except when ``local_check`` failed: then it goes at once, so the peers raise too.

    Args:
        comm: communicator (size W); its call counter advances by one.
        fields: name -> static value (int, or anything with a stable repr).
            Every rank must pass the same names in the same order.
        local_check: callable raising ValueError/TypeError on invalid local input.
        kind: which agreement point this is ('call' for fmoe's functions,
            'end' for :func:`end_of_job_check`).
        defer: let the record ride on the communicator's next collective (the errors
            above are then raised by that collective, on every rank).
    """
    err: Optional[BaseException] = None
    if local_check is not None:
        try:
            local_check()
        except (ValueError, TypeError) as e:
            err = e
    if getattr(comm, "checks", "full") == "off":
        if err is not None:
            raise err
        return
    call = registry.next_call(comm)
    stage = getattr(comm, "_stage_agreement", None)
    if stage is not None:
        # ints, not a tensor: inside a torch.func transform a fresh tensor is wrapped and has no storage
        stage(Pending(_record_values(_kind(kind), call, err is not None, fields), call, err, fields), defer=defer)
        return
    mine = _record(_kind(kind), call, err is not None, fields)
    table = comm.all_gather(mine.unsqueeze(0), 0)  # [W, HEAD + FIELDS]
    if table.shape != (comm.size, mine.numel()) or table.dtype != torch.int64:
        raise CollectiveMismatchError(f"agreement exchange returned {tuple(table.shape)} {table.dtype}, "
                                      f"expected ({comm.size}, {mine.numel()}) int64")
    rows = table.tolist()  # every decision below is taken from this table, identical on all ranks
    bad = [r for r, row in enumerate(rows) if row[0] != MAGIC]
    if bad:
        raise CollectiveMismatchError(
            f"rank(s) {bad} answered the agreement exchange of call #{call} with data that is not an agreement "
            "record: they were in a different collective (mismatched program order)")
    check_records(rows, Pending(None, call, err, fields), lambda text: _gather_text(comm, text))


def describe(row) -> str:
    """'fmoe call #3' / 'end-of-job check #2' for one gathered record row."""
    return _describe(row)


def check_records(rows: list, mine: Pending, gather_text: Callable[[str], list]) -> None:
    """Decide from the gathered records (W lists of _HEAD + FIELDS ints, identical on every rank).

    Raises on every rank alike (see :func:`agree_across_ranks`); ``gather_text`` all-gathers one
    string per rank and is called on all ranks or on none.
    """
    err, fields = mine.error, mine.fields
    if any(row[1:3] != rows[0][1:3] for row in rows):
        raise StepMismatchError(
            "ranks are at different steps: " + "; ".join(f"rank {r} is in {_describe(row)}"
                                                         for r, row in enumerate(rows))
            + ". A rank skipped, repeated or reordered a step (every rank must make the same fmoe calls in the "
            "same order on this communicator).")
    failed = [r for r, row in enumerate(rows) if row[3]]
    if failed:
        msg = gather_text("" if err is None else f"{type(err).__name__}: {err}")
        if err is not None:
            raise err
        raise InconsistentRanksError("invalid input on rank(s) " + "; ".join(f"{r}: {msg[r]}" for r in failed))
    if all(row[4:] == rows[0][4:] for row in rows):
        return
    names = list(fields)
    if any(row[5] != rows[0][5] for row in rows):
        raise InconsistentRanksError(f"ranks passed different numbers of settings ({[row[5] for row in rows]}) "
                                     f"in {_describe(rows[0])}")
    diff = [i for i in range(FIELDS) if any(row[_HEAD + i] != rows[0][_HEAD + i] for row in rows)]
    diff_names = [names[i] if i < FIELDS - 1 else "the settings after " + names[FIELDS - 2] for i in diff]
    name = names[diff[0]] if diff and diff[0] < len(names) else None
    values = gather_text(_stable(fields[name])[:200] if name else "")
    per_rank = "; ".join(f"rank {r}: {v}" for r, v in enumerate(values)) if name else ""
    raise InconsistentRanksError(
        f"ranks disagree on {', '.join(diff_names) or 'the settings digest'}"
        + (f"; {name} per rank: {per_rank}" if name else "")
        + ". Every rank must call with the same static settings.")


def end_of_job_check(comm) -> None:
    """Collective end-of-job check: every rank has made the same number of agreement calls.

    A rank that skipped a step reaches this while a peer is still in its last
    fmoe call; the two records differ in kind and both ranks raise
    :class:`StepMismatchError` instead of the peer waiting forever. Called by
    the communicators' ``close()`` and when :func:`fmoe.comm.abort_on_error`'s
    block ends normally; a no-op on one process.
    """
    if getattr(comm, "size", 1) == 1 or registry.is_closed(comm):
        return
    agree_across_ranks(comm, {}, kind="end")
