"""The kernel table: one implementation per (device, phase, dtype, precision), chosen once per call.

Every expert GEMM of the engine, on either plan, is one of three grouped forms (:class:`Kernel`):

* ``mm(a, w, plan, rows=, transposed=, bias=)`` -> [N, n]: row r of expert e is ``a[rows[r]] @
  op(w[e]) (+ bias[e])`` (``rows=None``: a is already [N, k] in plan order). op(w) is w [E, k, n]
  or, with ``transposed``, w [E, n, k] read as its transpose (nn.Linear's out x in). The CPU
  kernels (:attr:`Kernel.writes_out`) also write into a given ``out=`` and take the native
  threading ``regime=`` (the vmapped fold's scratch and its experts side by side).
* ``wgrad(a, b, plan, rows=, rows_b=)`` -> [E, P, Q]: ``sum over e's rows of a[rows[r]]^T
  b[rows_b[r]]`` (either operand gathered by the kernel, or already in plan order).
* ``scatter(a, w, plan, index=, out=, scale=, transposed=, bias=)``: ``out[index[r]] += scale[r] *
  (a[r] @ op(w[e]) (+ bias[e]))``, a token's terms in ascending expert order (the output
  projection straight into y, the data gradient straight into dx: no [N, n] buffer).

:func:`select` is the one place that picks a kernel; :func:`explain` prints what each GEMM of
a step would run and why (``python -m fmoe info --explain SHAPE``). The implementations:

* rows plans: the native C++ grouped GEMM ('cpu-native'), its per-expert ``torch.mm`` twin
  ('cpu-torch', also the reference), ``torch._grouped_mm`` ('cuda-grouped-mm'), the numba few-row
  kernel ('cpu-numba-rows', where measured faster), and for packed weights
  (``select(plan, packed=True)``) the native packed kernel ('cpu-packed') or fused low-precision
  calls ('cuda-packed');
* layout plans (phase 'traced'): ``mm`` and ``wgrad`` over the layout's whole buffers
  ('layout-padded': one ``torch.bmm``, Tutel's arithmetic; 'layout-ragged': the ragged op), the
  ops of :mod:`fmoe.ops.grouped`, which carry vmap, jvp and compile rules and differentiate by
  plain autograd. Their products return to tokens through the layout's combine, so they have
  no ``scatter``.
"""
from __future__ import annotations

import dataclasses
import itertools
import statistics
import time
from typing import Callable, Optional, Union

import torch
from torch import Tensor

from ..ops import native, numba_cpu
from ..ops.grouped import layout_bias, layout_mm, layout_wgrad
from . import wisdom
from .plan import PHASES, TRACED, ExpertPlan, LayoutPlan, phase_of, plan_from_bounds


DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One table entry.

    Attributes:
        name: what runs ('cpu-native', 'cpu-torch', 'cpu-numba-rows', 'cuda-grouped-mm', 'cuda-torch',
            'cpu-packed', 'cuda-packed', 'layout-padded', 'layout-ragged').
        why: one line: why this entry has this kernel.
        mm: ``mm(a, w, plan, *, rows, transposed, bias) -> [N, n]`` in a's dtype.
        wgrad: ``wgrad(a, b, plan, *, rows, rows_b) -> [E, P, Q]`` in a's dtype; None for packed
            weights (they take no gradient).
        scatter: ``scatter(a, w, plan, *, index, out, scale, transposed, bias) -> out``; None for
            layout plans (their products return through the layout's combine) and packed weights.
        static_rows: it takes a device rows plan (``plan.bounds`` None, :func:`fmoe.engine.plan.device_plan`):
            ``mm`` writes zeros into the dead rows (past ``offsets[E]``), ``wgrad`` reads none
            of them, and no host sync. Other kernels get the plan's :meth:`~fmoe.engine.ExpertPlan.on_host`.
        writes_out: ``mm`` also takes ``out=``, a contiguous [N, n] of a's dtype that it writes and
            returns (the bits of a fresh output of the same regime: a caller reuses one buffer across calls), and
            ``regime=`` (:func:`fmoe.ops.native.regime_for`'s 'serial' / 'parallel' / 'auto'; None:
            the entry's own), a speed, never a result beyond that module's bound.
    """

    name: str
    why: str
    mm: Callable = dataclasses.field(repr=False)
    wgrad: Optional[Callable] = dataclasses.field(repr=False)
    scatter: Optional[Callable] = dataclasses.field(repr=False)
    static_rows: bool = False
    writes_out: bool = False


def _native_kernel(impl: str, regime: str = "auto") -> tuple:
    """(mm, wgrad, scatter) over :mod:`.native` (impl 'native': the C++ kernels with this
    threading regime; 'reference': their per-expert torch.mm twins)."""
    kw = {} if impl == "reference" else {"regime": regime}
    own = regime
    planned = impl == "native"   # a plan's host bounds go straight to the extension, which checks them

    def mm(a: Tensor, w: Tensor, plan: ExpertPlan, *, rows: Optional[Tensor] = None, transposed: bool,
           bias: Optional[Tensor] = None, out: Optional[Tensor] = None, regime: Optional[str] = None) -> Tensor:
        if planned and plan.bounds is not None and out is None and regime is None:
            return native.planned_mm(a, w, plan.offsets, plan.bounds, rows=rows, transposed=transposed, bias=bias,
                                     regime=own)
        return native.gather_mm(a, w, plan.offsets, rows=rows, transposed=transposed, bias=bias, out=out, impl=impl,
                                regime=regime or own)

    def wgrad(a: Tensor, b: Tensor, plan: ExpertPlan, *, rows: Optional[Tensor] = None,
              rows_b: Optional[Tensor] = None) -> Tensor:
        return native.gather_wgrad(a, b, plan.offsets, rows=rows, rows_b=rows_b, impl=impl, **kw)

    def scatter(a: Tensor, w: Tensor, plan: ExpertPlan, *, index: Tensor, out: Tensor, scale: Optional[Tensor] = None,
                transposed: bool, bias: Optional[Tensor] = None) -> Tensor:
        if planned and plan.bounds is not None:
            return native.planned_scatter(a, w, plan.offsets, plan.bounds, index, out, scale=scale,
                                          transposed=transposed, bias=bias, regime=regime)
        return native.mm_scatter(a, w, plan.offsets, index, out, scale=scale, transposed=transposed, bias=bias,
                                 impl=impl, **kw)

    return mm, wgrad, scatter


def _add_bias(y: Tensor, bias: Optional[Tensor], plan: ExpertPlan) -> Tensor:
    # (a device plan's dead rows read the last expert's bias; _grouped_mm zeroes them after)
    return y if bias is None else y.add_(bias.index_select(0, plan.experts))


def _numba_rows_mm(a: Tensor, w: Tensor, plan: ExpertPlan, *, rows: Optional[Tensor] = None,
                   transposed: bool, bias: Optional[Tensor] = None) -> Tensor:
    """Few-row experts in one numba call (:func:`fmoe.ops.numba_cpu.few_rows_mm`), forward only."""
    y = numba_cpu.few_rows_mm(a if rows is None else a.index_select(0, rows), w, list(plan.bounds), transposed)
    return _add_bias(y, bias, plan)


def _grouped_mm_ok(*ts: Tensor) -> bool:
    # torch._grouped_mm's layout rule (ATen GroupedMMUtils.h): one of the last two strides is 1
    # and the other spans its dimension in a multiple of 16 bytes; off the CPU the data starts
    # on a 16-byte boundary too (a weight sliced at an odd column does not).
    for t in ts:
        if t.device.type != "cpu" and t.data_ptr() % 16:
            return False
        s, n, align = t.stride(), t.shape, 16 // t.element_size()
        if s[-1] == 1 and s[-2] >= max(1, n[-1]) and s[-2] % align == 0:
            continue
        if s[-2] == 1 and s[-1] >= max(1, n[-2]) and s[-1] % align == 0:
            continue
        return False
    return True


def _grouped_mm(a: Tensor, w: Tensor, plan: ExpertPlan, *, rows: Optional[Tensor] = None, transposed: bool,
                bias: Optional[Tensor] = None) -> Tensor:
    """One ``torch._grouped_mm`` over every expert (rows gathered first); the per-expert
    reference where its layout rule refuses the operands (one host sync).

    A device plan's dead rows (past ``offsets[E]``) come out 0: torch._grouped_mm allocates
    its output uninitialised and never writes rows past the last offset (ATen
    GroupedMMUtils.h ``_grouped_mm_fallback``, the CPU path and CUDA's off sm90/sm100 or
    outside bf16, slices rows by the offsets; CUDA's CUTLASS kernel, bf16 on sm90/sm100, sizes
    each group's problem from them), so they are filled with 0 (NaN-safe) after the bias."""
    if rows is not None:
        a = a.index_select(0, rows)
    op = w.transpose(1, 2) if transposed else w
    E = plan.num_experts
    offsets = plan.offsets.to(a.device)
    if plan.num_rows and _grouped_mm_ok(a, op):
        y = _add_bias(torch._grouped_mm(a, op, offs=offsets.narrow(0, 1, E).to(torch.int32)), bias, plan)
        return y if plan.dead is None else y.masked_fill_(plan.dead.unsqueeze(1), 0)
    # the reference writes the kept rows only: a device plan's dead rows stay 0
    out = None if plan.dead is None else a.new_zeros((plan.num_rows, op.shape[2]))
    return native.gather_mm_reference(a, w, offsets, transposed=transposed, bias=bias, out=out)


def _grouped_wgrad(a: Tensor, b: Tensor, plan: ExpertPlan, *, rows: Optional[Tensor] = None,
                   rows_b: Optional[Tensor] = None) -> Tensor:
    """One ``torch._grouped_mm`` over every expert's ``a_e^T b_e`` (rows gathered first); experts
    with no rows are zeroed (the op leaves them unwritten); the per-expert reference where its
    layout rule refuses the operands."""
    if rows is not None:
        a = a.index_select(0, rows)
    if rows_b is not None:
        b = b.index_select(0, rows_b)
    offs = plan.offsets.to(a.device)
    E = plan.num_experts
    if plan.num_rows and _grouped_mm_ok(a.t(), b):
        # each group reads its rows offs[e]:offs[e+1] only: a device plan's dead rows are never read
        ends = offs.narrow(0, 1, E)
        z = torch._grouped_mm(a.t(), b, offs=ends.to(torch.int32))
        return z.masked_fill_((ends == offs.narrow(0, 0, E)).view(-1, 1, 1), 0)
    return native.gather_wgrad_reference(a, b, offs)


def _scatter_through(mm: Callable) -> Callable:
    """A scatter from an ``mm``: the products into a buffer, then one index_add_ (rows in expert order)."""
    def scatter(a, w, plan, *, index, out, scale=None, transposed, bias=None):
        y = mm(a, w, plan, transposed=transposed, bias=bias).to(out.dtype)
        return out.index_add_(0, index, y if scale is None else y * scale.to(out.dtype).unsqueeze(1))
    return scatter


def _entry(device: str, phase: str, dtype: torch.dtype) -> Kernel:
    if device == "cpu":
        if native.AVAILABLE:
            decode = phase == "decode"
            # decode: side by side or one after another by the kernel's measured rule
            # (native.regime_for: rows per expert and matrix size); otherwise one after another
            mm, wg, sc = _native_kernel("native", "auto" if decode else "serial")
            how = ("experts side by side, one thread each, where few rows per expert leave the weight stream "
                   "the bound (native.regime_for)" if decode else "experts one after another, each GEMM threaded")
            return Kernel("cpu-native", f"C++ grouped GEMM, rows gathered in C++; {how}", mm, wg, sc,
                          writes_out=True)
        return Kernel("cpu-torch", f"per-expert torch.mm from Python ({native.status()})",
                      *_native_kernel("reference"), writes_out=True)
    if dtype in (torch.bfloat16, torch.float16, torch.float32) and hasattr(torch, "_grouped_mm"):
        return Kernel("cuda-grouped-mm", "torch._grouped_mm over all experts, products and weight gradients, on a "
                      "device rows plan (no host sync in fmoe; torch's own kernel reads the offsets on the host "
                      "outside bf16 on sm90/sm100)", _grouped_mm, _grouped_wgrad, _scatter_through(_grouped_mm),
                      static_rows=True)
    return Kernel("cuda-torch", f"per-expert torch.mm ({str(dtype).replace('torch.', '')}: no grouped kernel)",
                  *_native_kernel("reference"))


def _packed_cpu_mm(a: Tensor, w, plan: ExpertPlan, *, rows: Optional[Tensor] = None, transposed: bool = True,
                   bias: Optional[Tensor] = None) -> Tensor:
    """Packed weights (:class:`fmoe.quant.QuantizedTensor` [E, N, K], always out x in, so
    ``transposed`` does not apply) over a host rows plan: one native call decodes and multiplies
    every busy expert (:func:`fmoe.quant.packed.grouped_matmul`). Differentiable in a."""
    from ..quant import packed   # optional: low-precision weights
    y = packed.grouped_matmul(a if rows is None else a.index_select(0, rows), w, plan.offsets)
    return y if bias is None else y + bias.to(y.dtype).index_select(0, plan.experts)


def _packed_rows_mm(a: Tensor, w, plan: ExpertPlan, *, rows: Optional[Tensor] = None, transposed: bool = True,
                    bias: Optional[Tensor] = None) -> Tensor:
    """As :func:`_packed_cpu_mm`, off the CPU: :func:`fmoe.quant.matmul.rows_matmul` over the
    plan's device offsets (the ragged W4A16 kernel at decode, else every expert dequantized once
    and one ``torch._grouped_mm``), so a device plan runs as it is: its dead rows, past the last
    offset, come out 0 before the bias."""
    from ..quant import matmul as qmm   # optional: low-precision weights
    y = qmm.rows_matmul(a if rows is None else a.index_select(0, rows), w, plan.offsets)
    return y if bias is None else y + bias.to(y.dtype).index_select(0, plan.experts)


_PACKED = {"cpu": Kernel("cpu-packed", "packed weights: one native call decodes and multiplies every busy expert "
                         "(fmoe.quant.packed)", _packed_cpu_mm, None, None),
           "cuda": Kernel("cuda-packed", "packed weights, no Python per expert and no host sync "
                          "(fmoe.quant.matmul.rows_matmul): the ragged W4A16 kernel for bf16 rows of mxfp4/nvfp4 "
                          "weights at decode, else every expert dequantized once and one torch._grouped_mm",
                          _packed_rows_mm, None, None, static_rows=True)}


def _layout_kernel(kind: str, generator: Optional[torch.Generator] = None) -> Kernel:
    """The layout plan's GEMMs over its whole buffers (``rows`` must be None: the buffer is the
    rows), with the plan's quantized-training recipe around them (``generator`` feeds its
    stochastic rounding)."""
    def no_rows(*rows) -> None:
        if any(r is not None for r in rows):
            raise ValueError("a layout plan's GEMMs multiply its buffers as they are: rows must be None")

    def mm(a: Tensor, w, plan: LayoutPlan, *, rows: Optional[Tensor] = None, transposed: bool,
           bias: Optional[Tensor] = None) -> Tensor:
        no_rows(rows)
        lay = plan.layout
        if plan.precision is not None and isinstance(w, Tensor):
            from ..quant import training as _qt   # optional: quantized training recipes
            y = _qt.quantized_mm(a, w.to(a.dtype), plan.precision, transposed=transposed, generator=generator,
                                 mm=lambda x, w_, t: layout_mm(x, w_, lay, transposed=t),
                                 wgrad=lambda p, q: layout_wgrad(p, q, lay),
                                 offsets=lay.offsets if lay.kind == "ragged" else None)
        else:
            y = layout_mm(a, w, lay, transposed=transposed)
        return y if bias is None else y + layout_bias(bias, y, lay)

    def wgrad(a: Tensor, b: Tensor, plan: LayoutPlan, *, rows: Optional[Tensor] = None,
              rows_b: Optional[Tensor] = None) -> Tensor:
        no_rows(rows, rows_b)
        return layout_wgrad(a, b, plan.layout)

    why = ("one torch.bmm over every row of every expert buffer (Tutel's arithmetic)" if kind == "padded" else
           "the ragged grouped-GEMM op over the kept rows (one native call; vmap, jvp and compile rules)")
    return Kernel(f"layout-{kind}", why + "; dispatch before, the layout's combine after", mm, wgrad, None)


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


_COMPETING = {"cpu-numba-rows": lambda: Kernel(
    "cpu-numba-rows", "numba few-row kernel (the measured winner of this shape class, fmoe.engine.wisdom)",
    _numba_rows_mm, _native_kernel("reference")[1], _scatter_through(_numba_rows_mm))}


def kernel_by_name(key: tuple, name: str) -> Kernel:
    """The kernel ``name`` among those that compete for table key (device, phase, dtype)."""
    if name not in wisdom.CANDIDATES.get(key, ()):
        raise ValueError(f"no kernel {name!r} competes for {key}; candidates: {wisdom.CANDIDATES.get(key, ())}")
    return TABLE[key + (None,)] if name == TABLE[key + (None,)].name else _COMPETING[name]()


def select(plan: Union[ExpertPlan, LayoutPlan], matrix_bytes: int = 0, *, choice: Optional[str] = None,
           generator: Optional[torch.Generator] = None, packed: bool = False) -> Kernel:
    """The kernel for every GEMM of the call ``plan`` describes.

    A layout plan gets its layout's kernel (the plan's recipe around it, ``generator`` for its
    stochastic rounding); ``packed`` (a :class:`fmoe.quant.QuantizedTensor` weight) the device's
    packed kernel. Where several kernels compete for the plan's key
    (:data:`fmoe.engine.wisdom.CANDIDATES`), ``choice`` forces one by name; else the winner recorded for the call's shape class
    (``matrix_bytes``: one expert weight matrix) is taken if this machine has measured it, and
    the table's own entry otherwise."""
    if isinstance(plan, LayoutPlan):
        return _layout_kernel(plan.layout.kind, generator)
    if packed:
        return _PACKED["cpu" if plan.device.type == "cpu" else "cuda"]
    # a quantized-training recipe quantizes the operands around the float entry's GEMMs
    # (fmoe.quant.training.quantized_mm, composed by fmoe.engine.kinds.run)
    kern = kernel_for(plan.device.type, plan.phase, plan.dtype)
    key = (plan.device.type, plan.phase, plan.dtype)
    if choice is None and plan.precision is None and key in wisdom.CANDIDATES:
        # a device plan has no host count of busy experts: its static bound, as its phase
        busy = plan.busy if plan.bounds is not None else min(plan.num_experts, plan.num_rows)
        choice = wisdom.lookup(key, wisdom.shape_class(plan.dtype, plan.num_rows / max(1, busy), matrix_bytes))
    if choice is None or choice == kern.name:
        return kern
    return kernel_by_name(key, choice)


# --------------------------------------------------------------------------- explain

_SHAPE_KEYS = {"T": int, "M": int, "H": int, "E": int, "k": int, "O": int, "kind": str, "dtype": str,
               "device": str, "phase": str, "weights": str}


def parse_shape(text: str) -> dict:
    """'T=4096,M=512,H=1024,E=8,k=2,kind=ffn,dtype=float32,phase=train' -> dict (defaults:
    k 2, O = M, kind ffn, dtype float32, device cpu, weights float, phase from T*k/E as
    :func:`phase_of` with needs_grad for 'train'; 'traced': a step on a layout plan (forward-mode
    AD, plan='layout'); torch.compile and vmap/grad run the rows plan's kernels,
    :mod:`fmoe.engine.traced`). ``weights``: 'float' or a packed format of :mod:`fmoe.quant`
    (mxfp4, nvfp4, mxfp8, fp8_block, fp8_row: inference only)."""
    out = {"k": 2, "kind": "ffn", "dtype": "float32", "device": "cpu", "weights": "float"}
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
    elif out["phase"] not in PHASES + (TRACED,):
        raise ValueError(f"explain: phase must be one of {PHASES + (TRACED,)}, got {out['phase']!r}")
    if out["weights"] != "float":
        from ..quant.tensor import FORMATS   # optional: low-precision weights
        if out["weights"] not in FORMATS:
            raise ValueError(f"explain: weights must be 'float' or one of {FORMATS}, got {out['weights']!r}")
        if out["phase"] not in ("prefill", "decode"):
            raise ValueError(f"explain: packed weights ({out['weights']}) run inference only (they take no "
                             f"gradient); phase must be prefill or decode, got {out['phase']!r}")
    return out


def explain(text: str) -> str:
    """Which kernel each GEMM of one step of SHAPE runs, and why (one line each)."""
    s = parse_shape(text)
    traced = s["phase"] == TRACED
    if s["weights"] != "float":
        kern = _PACKED["cpu" if s["device"] == "cpu" else "cuda"]
    else:
        kern = _layout_kernel("padded") if traced else kernel_for(s["device"], s["phase"], s["dtype"])
    N, M, H, O, E = s["T"] * s["k"], s["M"], s["H"], s["O"], s["E"]
    width = 2 * H if s["kind"] != "ffn" else H
    gemms = [("forward in-projection", f"[{N} x {M}] @ [{M} x {width}] (rows gathered from x)"),
             ("forward out-projection", f"[{N} x {H}] @ [{H} x {O}]")]
    if s["phase"] in ("train", TRACED):
        gemms += [("backward out-projection dgrad", f"[{N} x {O}] @ [{O} x {H}]"),
                  ("backward out-projection wgrad", f"[{H} x {N}] @ [{N} x {O}] per expert"),
                  ("backward in-projection dgrad", f"[{N} x {width}] @ [{width} x {M}] (rows scattered into dx)"),
                  ("backward in-projection wgrad", f"[{M} x {N}] @ [{N} x {width}] per expert (rows gathered)")]
    if traced:   # dispatch and combine move the rows; each GEMM runs on whole buffers
        gemms = [(name, shape.split(" (")[0]) for name, shape in gemms]
    elif s["weights"] != "float":   # the packed kernels read rows in plan order
        gemms = [(name, shape.replace("(rows gathered from x)", "(rows gathered before the call)"))
                 for name, shape in gemms]
    lines = [f"shape: T={s['T']} M={M} H={H} O={O} E={E} k={s['k']} kind={s['kind']} "
             f"dtype={str(s['dtype']).replace('torch.', '')} device={s['device']} weights={s['weights']}",
             f"phase: {s['phase']} ({N} rows over at most {min(E, N)} experts, ~{N / max(1, min(E, N)):.1f} per expert)"
             + (", on the layout's buffers: padded [E, C, M] (every row multiplied) or ragged [k*T, M]" if traced else ""),
             f"kernel: {kern.name}: {kern.why}"]
    lines += [f"  {name:32s} {shape:52s} -> {kern.name}" for name, shape in gemms]
    return "\n".join(lines)


def tune(text: str, *, repeats: int = 7, log=print) -> dict:
    """Time every candidate kernel on SHAPE's GEMMs (random weights and rows) and record the
    winner of its class in :mod:`fmoe.engine.wisdom`. SHAPE as :func:`explain` takes it.

    Returns:
        {"class": str, "choice": str, "seconds": {kernel: median seconds of one call's GEMMs}}.
    """
    s = parse_shape(text)
    key = (s["device"], s["phase"], s["dtype"])
    names = wisdom.CANDIDATES.get(key)
    if not names:
        raise ValueError(f"tune: no kernels compete for {key} (phase {s['phase']}, "
                         f"{str(s['dtype']).replace('torch.', '')}): nothing to measure")
    T, M, H, E, k = s["T"], s["M"], s["H"], s["E"], s["k"]
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])        # [T, k]
    order = torch.argsort(ids.reshape(-1), stable=True)
    counts = torch.bincount(ids.reshape(-1), minlength=E).tolist()
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    tokens = (order // k).to(torch.int64)
    plan = plan_from_bounds(tokens, order.to(torch.int64), bounds, T, needs_grad=False, dtype=s["dtype"])
    x = torch.randn(T, M, generator=g, dtype=s["dtype"])
    w1 = torch.randn(E, H, M, generator=g, dtype=s["dtype"])
    w2 = torch.randn(E, H, M, generator=g, dtype=s["dtype"])
    kernels = {n: kernel_by_name(key, n) for n in names}

    def step(kern):
        h = kern.mm(x, w1, plan, rows=plan.tokens, transposed=True)
        return kern.mm(h, w2, plan, transposed=False)

    seconds = {}
    for n in names:
        step(kernels[n])   # compile / first-touch outside the timing
    times = {n: [] for n in names}
    for _ in range(repeats):   # interleaved: the machine's drift hits every candidate alike
        for n in names:
            t0 = time.perf_counter()
            step(kernels[n])
            times[n].append(time.perf_counter() - t0)
    seconds = {n: statistics.median(v) for n, v in times.items()}
    choice = min(seconds, key=seconds.get)
    cls = wisdom.shape_class(s["dtype"], plan.num_rows / max(1, plan.busy), H * M * w1.element_size())
    wisdom.record(cls, choice, seconds)
    if log is not None:
        log(f"wisdom {cls}: {choice} (" + ", ".join(f"{n} {t * 1e3:.3f} ms" for n, t in seconds.items()) + ")")
    return {"class": cls, "choice": choice, "seconds": seconds}
