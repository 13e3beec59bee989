"""The kernel table: one implementation per (device, phase, dtype, precision), chosen once per call.

Every expert GEMM of the engine is one of two grouped forms over a plan's rows:

* ``mm(a, w, plan, rows=, transposed=)`` -> [N, n]: row r of expert e is ``a[rows[r]] @ op(w[e])``
  (``rows=None``: a is already [N, k] in plan order). op(w) is w [E, k, n] or, with
  ``transposed``, w [E, n, k] read as its transpose (nn.Linear's out x in).
* ``wgrad(a, b, plan, rows=)`` -> [E, P, Q]: ``sum over e's rows of a[rows[r]]^T b[r]``.

:func:`select` is the one place that picks a kernel; :func:`explain` prints what each GEMM of
a step would run and why (``python -m fmoe info --explain SHAPE``).
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Callable, Optional

import torch
from torch import Tensor

from . import native
from .plan import PHASES, ExpertPlan, phase_of

__all__ = ["Kernel", "TABLE", "DTYPES", "select", "kernel_for", "explain", "parse_shape"]

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One table entry.

    Attributes:
        name: what runs ('cpu-native', 'cpu-torch', 'cuda-grouped-mm', 'cuda-torch').
        why: one line: why this entry has this kernel.
        mm: ``mm(a, w, plan, *, rows, transposed) -> [N, n]`` in a's dtype.
        wgrad: ``wgrad(a, b, plan, *, rows) -> [E, P, Q]`` in a's dtype.
    """

    name: str
    why: str
    mm: Callable = dataclasses.field(repr=False)
    wgrad: Callable = dataclasses.field(repr=False)


def _native_kernel(impl: str):
    def mm(a: Tensor, w: Tensor, plan: ExpertPlan, *, rows: Optional[Tensor] = None, transposed: bool) -> Tensor:
        return native.gather_mm(a, w, plan.offsets, rows=rows, transposed=transposed, impl=impl)

    def wgrad(a: Tensor, b: Tensor, plan: ExpertPlan, *, rows: Optional[Tensor] = None) -> Tensor:
        return native.gather_wgrad(a, b, plan.offsets, rows=rows, impl=impl)

    return mm, wgrad


def _grouped_mm_ok(*ts: Tensor) -> bool:
    # torch._grouped_mm's layout rule (ATen GroupedMMUtils.h): one of the last two strides is 1
    # and the other spans its dimension in a multiple of 16 bytes.
    for t in ts:
        s, n, align = t.stride(), t.shape, 16 // t.element_size()
        if s[-1] == 1 and s[-2] >= max(1, n[-1]) and s[-2] % align == 0:
            continue
        if s[-2] == 1 and s[-1] >= max(1, n[-2]) and s[-1] % align == 0:
            continue
        return False
    return True


def _grouped_mm(a: Tensor, w: Tensor, plan: ExpertPlan, *, rows: Optional[Tensor] = None, transposed: bool) -> Tensor:
    """One ``torch._grouped_mm`` over every expert (rows gathered first); the per-expert
    reference where its layout rule refuses the operands."""
    if rows is not None:
        a = a.index_select(0, rows)
    op = w.transpose(1, 2) if transposed else w
    if plan.num_rows and _grouped_mm_ok(a, op):
        offs = plan.offsets[1:].to(device=a.device, dtype=torch.int32)
        return torch._grouped_mm(a, op, offs=offs)
    return native.gather_mm_reference(a, w, plan.offsets.to(a.device), transposed=transposed)


def _entry(device: str, phase: str, dtype: torch.dtype) -> Kernel:
    if device == "cpu":
        if native.AVAILABLE:
            mm, wg = _native_kernel("native")
            how = ("experts side by side, one thread each (a few rows per expert: the weight stream bounds it)"
                   if phase == "decode" else "experts one after another, each GEMM threaded")
            return Kernel("cpu-native", f"C++ grouped GEMM, rows gathered in C++; {how}", mm, wg)
        mm, wg = _native_kernel("reference")
        return Kernel("cpu-torch", f"per-expert torch.mm from Python ({native.status()})", mm, wg)
    if dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        mm, wg = _grouped_mm, _native_kernel("reference")[1]
        return Kernel("cuda-grouped-mm", "torch._grouped_mm over all experts (bf16); weight gradients per expert",
                      mm, wg)
    mm, wg = _native_kernel("reference")
    return Kernel("cuda-torch", f"per-expert torch.mm ({str(dtype).replace('torch.', '')}: no grouped kernel)",
                  mm, wg)


TABLE: dict = {(dev, phase, dt, None): _entry(dev, phase, dt)
               for dev, phase, dt in itertools.product(("cpu", "cuda"), PHASES, DTYPES)}


def kernel_for(device: str, phase: str, dtype: torch.dtype, precision=None) -> Kernel:
    """The table entry for one key; ValueError naming the key where there is none."""
    key = (device, phase, dtype, precision)
    try:
        return TABLE[key]
    except (KeyError, TypeError):
        raise ValueError(f"the expert engine has no kernel for device={device!r}, phase={phase!r}, dtype={dtype}, "
                         f"precision={precision!r}; supported: devices cpu/cuda, phases {PHASES}, dtypes "
                         f"{[str(d).replace('torch.', '') for d in DTYPES]}, precision None") from None


def select(plan: ExpertPlan) -> Kernel:
    """The kernel for every GEMM of the call ``plan`` describes."""
    return kernel_for(plan.device.type, plan.phase, plan.dtype, plan.precision)


# --------------------------------------------------------------------------- explain

_SHAPE_KEYS = {"T": int, "M": int, "H": int, "E": int, "k": int, "O": int, "kind": str, "dtype": str,
               "device": str, "phase": str}


def parse_shape(text: str) -> dict:
    """'T=4096,M=512,H=1024,E=8,k=2,kind=ffn,dtype=float32,phase=train' -> dict (defaults:
    k 2, O = M, kind ffn, dtype float32, device cpu, phase from T*k/E as :func:`phase_of` with
    needs_grad for 'train')."""
    out = {"k": 2, "kind": "ffn", "dtype": "float32", "device": "cpu"}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, val = part.partition("=")
        if not sep or key not in _SHAPE_KEYS:
            raise ValueError(f"explain: bad field {part!r}; expected KEY=VALUE with KEY one of {sorted(_SHAPE_KEYS)}")
        try:
            out[key] = _SHAPE_KEYS[key](val)
        except ValueError:
            raise ValueError(f"explain: {key} must be {_SHAPE_KEYS[key].__name__}, got {val!r}") from None
    missing = [k for k in ("T", "M", "H", "E") if k not in out]
    if missing:
        raise ValueError(f"explain: the shape needs {', '.join(missing)} (e.g. T=4096,M=512,H=1024,E=8)")
    out.setdefault("O", out["M"])
    if out["kind"] not in ("ffn", "gated_ffn", "swiglu", "gpt_oss"):
        raise ValueError(f"explain: kind must be ffn, gated_ffn, swiglu or gpt_oss, got {out['kind']!r}")
    dtype = getattr(torch, out["dtype"], None)
    if dtype not in DTYPES:
        raise ValueError(f"explain: dtype must be one of float32, float64, bfloat16, float16, got {out['dtype']!r}")
    out["dtype"] = dtype
    rows = out["T"] * out["k"]
    busy = min(out["E"], rows)
    if "phase" not in out:
        out["phase"] = phase_of(False, rows, busy)
    elif out["phase"] not in PHASES:
        raise ValueError(f"explain: phase must be one of {PHASES}, got {out['phase']!r}")
    return out


def explain(text: str) -> str:
    """Which kernel each GEMM of one step of SHAPE runs, and why (one line each)."""
    s = parse_shape(text)
    kern = kernel_for(s["device"], s["phase"], s["dtype"])
    N, M, H, O, E = s["T"] * s["k"], s["M"], s["H"], s["O"], s["E"]
    width = 2 * H if s["kind"] != "ffn" else H
    gemms = [("forward in-projection", f"[{N} x {M}] @ [{M} x {width}] (rows gathered from x)"),
             ("forward out-projection", f"[{N} x {H}] @ [{H} x {O}]")]
    if s["phase"] == "train":
        gemms += [("backward out-projection dgrad", f"[{N} x {O}] @ [{O} x {H}]"),
                  ("backward out-projection wgrad", f"[{H} x {N}] @ [{N} x {O}] per expert"),
                  ("backward in-projection dgrad", f"[{N} x {width}] @ [{width} x {M}] (rows scattered into dx)"),
                  ("backward in-projection wgrad", f"[{M} x {N}] @ [{N} x {width}] per expert (rows gathered)")]
    lines = [f"shape: T={s['T']} M={M} H={H} O={O} E={E} k={s['k']} kind={s['kind']} "
             f"dtype={str(s['dtype']).replace('torch.', '')} device={s['device']}",
             f"phase: {s['phase']} ({N} rows over at most {min(E, N)} experts, ~{N / max(1, min(E, N)):.1f} per expert)",
             f"kernel: {kern.name}: {kern.why}"]
    lines += [f"  {name:32s} {shape:52s} -> {kern.name}" for name, shape in gemms]
    return "\n".join(lines)
