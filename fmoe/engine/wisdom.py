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
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import Optional

import torch

__all__ = ["CANDIDATES", "path", "shape_class", "lookup", "record", "load", "forget"]

# table key (device, phase, dtype) -> the kernels that compete for it, the default first
CANDIDATES = {("cpu", "decode", torch.float32): ("cpu-native", "cpu-numba-rows"),
              ("cpu", "decode", torch.float64): ("cpu-native", "cpu-numba-rows")}


def path() -> str:
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
    if _CACHE.get("mtime") != mtime:
        try:
            with open(p, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError):
            data = {}   # a damaged file is as good as none: every class takes the default
        _CACHE.update(mtime=mtime, data=data if isinstance(data, dict) else {})
    return _CACHE["data"]


def lookup(key: tuple, cls: str) -> Optional[str]:
    """The recorded winner for table key ``key`` and class ``cls``, or None."""
    names = CANDIDATES.get(key)
    entry = load().get(cls) if names else None
    choice = entry.get("choice") if isinstance(entry, dict) else None
    return choice if choice in (names or ()) else None


def record(cls: str, choice: str, seconds: dict) -> None:
    """Write one class's winner into the wisdom file (atomically: a temp file, then rename)."""
    p = path()
    os.makedirs(os.path.dirname(p), exist_ok=True)
    data = dict(load())
    data[cls] = {"choice": choice, "seconds": seconds}
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(p), prefix=".wisdom-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, p)
    except BaseException:
        os.unlink(tmp)
        raise
    _CACHE.clear()


def forget() -> None:
    """Delete the wisdom file (every class back to the default)."""
    try:
        os.unlink(path())
    except FileNotFoundError:
        pass
    _CACHE.clear()
