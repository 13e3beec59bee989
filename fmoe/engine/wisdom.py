"""Measured kernel choice: where two kernels compete for one table key, time both on this
machine and keep the winner per shape class on disk (as FFTW keeps its wisdom).

Today one key competes: CPU decode in float32/float64, where the native grouped GEMM
(experts side by side, one MKL call each) meets the numba few-row kernel
(:func:`fmoe.ops.numba_cpu.few_rows_mm`). Which wins is the CPU's: MKL's few-row sgemm was
level or ahead on an Intel Xeon and 2.7-9.9x slower than the weight stream on an AMD EPYC
(BENCHMARKS.md), so no fixed rule fits every machine.

    python -m fmoe warmup --tune T=16,M=1024,H=512,E=64,k=6     # measure, record
    fmoe.engine.table.tune(shape)                              # the same from Python

A shape class is (dtype, rows per busy expert rounded up to a power of two, one expert
matrix's bytes rounded up to a power of two). A call looks its class up; a class never
measured takes the table's default (the native kernel), so nothing is timed inside a user's
call and the choice never changes under a running job. ``select(plan, choice=...)`` forces a
kernel (tests, benchmarks). The file is ``~/.cache/fmoe/wisdom.json``, written atomically.

It also keeps this machine's thresholds of the native grouped GEMM's threading regime
(:func:`fmoe.ops.native.regime_for`), measured by ``python -m fmoe warmup --calibrate``
(:func:`fmoe.ops.native.calibrate`) under the key ``"native-regime"``; :func:`regime`
returns them, or None when never measured (the kernel's defaults then apply). Like the
kernel choice, they pick a speed, never a result beyond the stated rounding.
"""
from __future__ import annotations

import functools
import json
import os
import tempfile
from typing import Optional

import torch


# table key (device, phase, dtype) -> the kernels that compete for it, the default first
CANDIDATES = {("cpu", "decode", torch.float32): ("cpu-native", "cpu-numba-rows"),
              ("cpu", "decode", torch.float64): ("cpu-native", "cpu-numba-rows")}


# the wisdom file's key for the native kernel's regime thresholds, and their fields (ints)
REGIME_KEY = "native-regime"
_REGIME_FIELDS = ("below_rows", "below_rows_big", "small_matrix_bytes")


def path() -> str:
    return _path_under(os.environ.get("HOME"))


@functools.lru_cache(maxsize=4)
def _path_under(home: Optional[str]) -> str:
    # keyed by $HOME: expanduser on every call cost a decode step ~20 us
    return os.path.join(os.path.expanduser("~"), ".cache", "fmoe", "wisdom.json")


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def shape_class(dtype: torch.dtype, rows_per_expert: float, matrix_bytes: int) -> str:
    """'float32|r4|b1048576': the class a call with these sizes is looked up under."""
    return f"{str(dtype).replace('torch.', '')}|r{_pow2(max(1, round(rows_per_expert)))}|b{_pow2(matrix_bytes)}"


_CACHE: dict = {}


def load() -> dict:
    """The recorded choices {class: {"choice": name, "seconds": {name: s}}} (empty if none)."""
    p = path()
    try:
        mtime = os.stat(p).st_mtime_ns
    except OSError:
        return {}
    if _CACHE.get("mtime") != (p, mtime):
        try:
            with open(p, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError):
            data = {}   # a damaged file is as good as none: every class takes the default
        _CACHE.update(mtime=(p, mtime), data=data if isinstance(data, dict) else {})
    return _CACHE["data"]


def lookup(key: tuple, cls: str) -> Optional[str]:
    """The recorded winner for table key ``key`` and class ``cls``, or None."""
    names = CANDIDATES.get(key)
    entry = load().get(cls) if names else None
    choice = entry.get("choice") if isinstance(entry, dict) else None
    return choice if choice in (names or ()) else None


def _write(key: str, entry: dict) -> None:
    """Set one key of the wisdom file (atomically: a temp file, then rename)."""
    p = path()
    os.makedirs(os.path.dirname(p), exist_ok=True)
    data = dict(load())
    data[key] = entry
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(p), prefix=".wisdom-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, p)
    except BaseException:
        os.unlink(tmp)
        raise
    _CACHE.clear()


def record(cls: str, choice: str, seconds: dict) -> None:
    """Write one class's winner into the wisdom file (atomically)."""
    _write(cls, {"choice": choice, "seconds": seconds})


def regime() -> Optional[dict]:
    """This machine's measured regime thresholds ``{"below_rows", "below_rows_big",
    "small_matrix_bytes"}`` (ints >= 0), or None when never measured or damaged."""
    entry = load().get(REGIME_KEY)
    if not isinstance(entry, dict):
        return None
    got = {k: entry.get(k) for k in _REGIME_FIELDS}
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in got.values()):
        return None
    return got


def record_regime(thresholds: dict, seconds: dict) -> None:
    """Write the measured regime thresholds (and the timings they came from) atomically.
    ValueError naming the field when one is missing or not an int >= 0."""
    for k in _REGIME_FIELDS:
        v = thresholds.get(k)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"record_regime: thresholds[{k!r}] must be an int >= 0, got {v!r} "
                             f"(fields: {', '.join(_REGIME_FIELDS)})")
    _write(REGIME_KEY, {**{k: thresholds[k] for k in _REGIME_FIELDS}, "seconds": seconds})


def forget() -> None:
    """Delete the wisdom file (every class back to the default)."""
    try:
        os.unlink(path())
    except FileNotFoundError:
        pass
    _CACHE.clear()
