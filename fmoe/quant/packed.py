"""Grouped matmul over packed expert weights: every busy expert of one projection in ONE native call.

    grouped_matmul(a, w, offsets, isa="auto", impl="auto") -> y [R, N]
        y[r] = a[r] @ dequant(w[e]).T for the rows r in offsets[e]:offsets[e + 1]

a: float32 or bfloat16 [R, K], rows already in expert order (a plan's rows); w: QuantizedTensor
[E, N, K] of any fmoe format (mxfp4, nvfp4, mxfp8, fp8_block, fp8_row) on the CPU; offsets: int64
[E + 1] on the CPU, 0-based, non-decreasing, ending at R. y is in a's dtype, accumulated in FP32.
Differentiable with respect to a only (weights are frozen): da[rows of e] = dy @ dequant(w[e]).

The native kernel (fmoe/ops/csrc/packed_gemm.cpp, its own extension ``fmoe_packed_gemm`` beside
the float grouped GEMM, built by ``python -m fmoe build``) decodes the weights in registers, splits
(expert, 64-row tile) jobs over the intra-op threads, and picks its vector path at run time
(``isa``: "auto" the widest the CPU has, or "portable" / "avx2" / "avx512" forced; forcing one the
CPU lacks is a ValueError). Experts with more than :data:`DENSE_FROM` rows decode one tile at a
time to FP32 and multiply with ``at::mm``. bf16 rows decode it to bf16 where that is exact (FP4
values with their scales, bare E4M3 values) and multiply in bf16 with fp32 accumulation: on AVX-512
BF16 CPUs without AMX with fmoe's vdpbf16ps GEMM, which scales each block's sum once (NVFP4's global
scale, FP8's float block scales; MXFP4 up to 64 rows an expert, past which a bf16 ``at::mm`` ran
faster), elsewhere MXFP4 with a bf16 ``at::mm`` and NVFP4 and FP8 with MKL's bf16 GEMM (the scale
its alpha), else in FP32. On CPUs with AVX-512 BF16, bf16 rows of FP4 weights take the bf16 dot-product
tiles up to 32 rows an expert for MXFP4 and 16 for NVFP4 (``_EXT.dot_rows(block)``; faster than the
decoded tile's GEMM there) and that GEMM past them. ``impl``: "auto" runs the extension when it is built
and otherwise the numba kernels of :func:`fmoe.quant.expert_matmul`, one call per busy expert;
"native" insists (RuntimeError naming the build command); "reference" runs
:func:`grouped_matmul_reference`.

Numerics: the decoded weights times their block scales are dequantize()'s products; only the
summation order (and, for nvfp4, where the global scale multiplies) differs, so the result is
within ``(K + 2) * eps32 * (|a| @ |dequant(w[e])|.T)`` of the reference (tests check every ISA
path against that bound; bf16 rows: that bound plus one bf16 rounding). Weight bytes that encode NaN
decode to NaN, as in dequantize(). Two edges of float32's range, both far outside what a model
holds, take other paths so that the bound holds there too:

* The bf16 paths run on vdpbf16ps, or on bf16 GEMMs that may (oneDNN's on AVX-512 BF16 CPUs), which
  read denormal inputs as zero. So bf16 rows with a nonzero value below 2^-100 in magnitude run the
  float32 paths, and so do MXFP4 tiles with a scale below 2^-25 (whose weights times such rows
  could be denormal).
* The AVX-512 register tiles sum a scale block's unscaled products (FP4 values up to 6, E4M3 up to
  448) and then multiply by the scale, and NVFP4's global scale multiplies the finished sum, so
  against small scales rows near float32's limit would overflow where the reference's products of
  the scaled weights stay finite (MXFP4 rows of 2^124 randn against scales of 2^-124 did). Rows with
  a finite value of 2^90 or more run scaled by 2^-40 and their outputs are scaled back (a power of
  two: exact wherever the scaled values and products stay in float32's normal range; those far
  below the row's large values lose low bits, far inside the bound).
"""
from __future__ import annotations

import dataclasses
import os

import torch
from torch import Tensor

from . import _codecs as C
from .tensor import FP4_FORMATS, QuantizedTensor, dequantize

__all__ = ["AVAILABLE", "ISAS", "StageWeights", "expert_stage", "run_stage", "stage_weights", "grouped_matmul",
           "grouped_matmul_reference", "best_isa", "has_int8_path", "status", "build"]

ISAS = {"auto": 0, "portable": 1, "avx2": 2, "avx512": 3}
_ISA_NAMES = {v: k for k, v in ISAS.items()}
# Rows per expert above which a job decodes its tile and runs at::mm instead of the
# register tiles (which decode a group of weight rows once per pass of 4 or 8 activation rows,
# the group staying in L1 between passes). Chosen, not measured: at::mm wins once the FLOPs per
# weight dominate; re-measure (benchmarks/bench_packed_kernels.py --rows) when the VM is quiet.
DENSE_FROM = 8

_NAME = "fmoe_packed_gemm"
_SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ops", "csrc",
                       "packed_gemm.cpp")
# No -march: the vector paths carry their own target attributes and are picked at run time.
_CFLAGS = ("-O3", "-fopenmp")
_LDFLAGS = ("-fopenmp",)

_EXT = None
_WHY = ""
AVAILABLE = False


# --------------------------------------------------------------------------- build and load

def library_path() -> str:
    """Where the built extension for this torch, Python and source lives (may not exist)."""
    from ..ops import native
    return native.extension_path(_NAME, _SOURCE, _CFLAGS, _LDFLAGS)


def _try_load() -> None:
    global _EXT, _WHY, AVAILABLE
    from ..ops import native
    _EXT, _WHY = native.find_extension(_NAME, _SOURCE, library_path(), "numba fallback")
    AVAILABLE = _EXT is not None


def status() -> str:
    """One line: whether the packed-weight extension is active (and its widest ISA path), or why not."""
    if AVAILABLE:
        return f"native CPU packed-weight GEMM: active, {best_isa()} ({library_path()})"
    return f"native CPU packed-weight GEMM: {_WHY}"


def build(verbose: bool = True) -> str:
    """Compile the packed-weight extension for the current key (a no-op when built) and load it.
    Same machinery as :func:`fmoe.ops.native.build`, its own module and cache directory, so a
    failure here never touches the float grouped GEMM. Returns the library path."""
    from ..ops import native
    path = library_path()
    if not os.path.exists(path):
        native.compile_extension(_NAME, _SOURCE, path, cflags=_CFLAGS, ldflags=_LDFLAGS,
                                 what="the packed-weight GEMM", tag="fmoe.quant.packed", verbose=verbose)
    if not AVAILABLE:
        _try_load()
        if not AVAILABLE:
            raise RuntimeError(status())
    return path


def build_command() -> int:
    """``python -m fmoe build``'s packed-GEMM step (:func:`fmoe.ops.native.build_step`); without a
    compiler packed weights run the numba kernels."""
    from ..ops import native
    return native.build_step("fmoe.quant.packed", "packed weights run the numba kernels", lambda: build(verbose=False),
                             status)


def best_isa() -> str:
    """The widest vector path the extension runs on this CPU ("avx512", "avx2" or "portable")."""
    if not AVAILABLE:
        raise RuntimeError(status())
    return _ISA_NAMES[int(_EXT.best_isa())]


# --------------------------------------------------------------------------- validation

def _check_args(a, w, offsets) -> None:
    """Types, shapes and devices of grouped_matmul's operands (no read of the offsets' values)."""
    fn = "grouped_matmul"
    if not isinstance(w, QuantizedTensor):
        raise TypeError(f"{fn}: w must be a QuantizedTensor, got {type(w).__name__}")
    if not isinstance(a, Tensor) or a.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"{fn}: a must be a float32 or bfloat16 tensor, got "
                        f"{getattr(a, 'dtype', type(a).__name__)}")
    ws = w.logical_shape
    if a.dim() != 2 or len(ws) != 3 or a.shape[1] != ws[2]:
        raise ValueError(f"{fn}: expected a [R, K] and w [E, N, K], got a {tuple(a.shape)} and w {ws}")
    if a.device.type != "cpu" or w.device.type != "cpu":
        raise ValueError(f"{fn}: a and w must be CPU tensors (got {a.device} and {w.device}); on CUDA use "
                         f"fmoe.quant.native")
    if not isinstance(offsets, Tensor) or offsets.dtype != torch.int64 or offsets.dim() != 1 \
            or offsets.device.type != "cpu" or offsets.shape[0] != ws[0] + 1:
        raise ValueError(f"{fn}: offsets must be a CPU int64 [E + 1] = [{ws[0] + 1}] tensor, got "
                         f"{getattr(offsets, 'dtype', type(offsets).__name__)} {tuple(getattr(offsets, 'shape', ()))}")


def _bounds(offsets: Tensor, rows: int) -> list:
    """The offsets as host ints, checked: 0 first, never decreasing, R last."""
    o = offsets.tolist()
    if o[0] != 0 or o[-1] != rows or any(o1 < o0 for o0, o1 in zip(o, o[1:])):
        raise ValueError(f"grouped_matmul: offsets must start at 0, never decrease and end at R = {rows} "
                         f"(the rows of a), got {o[:4]}...{o[-2:]}")
    return o


def _check(a, w, offsets) -> list:
    """Every check of grouped_matmul's operands; returns the offsets as host ints."""
    _check_args(a, w, offsets)
    return _bounds(offsets, a.shape[0])


# --------------------------------------------------------------------------- the three implementations

def grouped_matmul_reference(a: Tensor, w: QuantizedTensor, offsets: Tensor) -> Tensor:
    """Reference: dequantize each busy expert to FP32, torch.mm its rows. Shapes as grouped_matmul."""
    o = _check(a, w, offsets)
    y = torch.zeros(a.shape[0], w.logical_shape[1], dtype=torch.float32)
    for e in range(len(o) - 1):
        if o[e + 1] > o[e]:
            y[o[e]:o[e + 1]] = a[o[e]:o[e + 1]].float() @ dequantize(w[e]).T
    return y.to(a.dtype)


def _numba(a: Tensor, w: QuantizedTensor, o: list) -> Tensor:
    from .matmul import expert_matmul
    y = torch.zeros(a.shape[0], w.logical_shape[1], dtype=a.dtype)
    for e in range(len(o) - 1):
        if o[e + 1] > o[e]:
            y[o[e]:o[e + 1]] = expert_matmul(a[o[e]:o[e + 1]].unsqueeze(0), w[e:e + 1])[0]
    return y


def _operands(w: QuantizedTensor):
    """(data uint8, scales, table, fp4, bn, bk, gscale) as the kernel reads them."""
    fmt = w.fmt
    if fmt in FP4_FORMATS:
        table = C.E8M0_TABLE if fmt == "mxfp4" else C.E4M3_TABLE
        gs = None if w.global_scale is None else w.global_scale.float().reshape(-1).contiguous()
        sc = w.scales.contiguous()
        return w.data.contiguous(), sc if sc.dtype == torch.uint8 else sc.view(torch.uint8), table, True, 1, w.block[1], gs
    data = w.data.contiguous().view(torch.uint8)
    if fmt == "mxfp8":
        return data, w.scales.contiguous(), C.E8M0_TABLE, False, 1, 32, None
    bn, bk = w.block
    return data, w.scales.float().contiguous(), C.E8M0_TABLE, False, bn, bk, None


def _native(a: Tensor, w: QuantizedTensor, offsets: Tensor, isa: str, act_int8: bool = False, *,
            blas: bool = True, dot_bf16: bool = True) -> Tensor:
    # blas=False: bf16 rows skip MKL's bf16 GEMM (NVFP4, FP8: the path of a torch build without it; tests);
    # dot_bf16=False: bf16 rows skip the vdpbf16ps kernels, the dot-product tiles and fmoe's tile GEMM (a CPU
    # without AVX-512 BF16; tests)
    data, scales, table, fp4, bn, bk, gs = _operands(w)
    out = torch.empty(a.shape[0], w.logical_shape[1], dtype=torch.float32)
    if a.requires_grad:
        a = a.detach()
    # bf16 rows: the many-rows path multiplies FP4 weights (exact in bf16) and FP8 weights with
    # float scales (their E4M3 values, the scales applied per block) as bf16
    a_bf16 = a.contiguous() if a.dtype == torch.bfloat16 and (fp4 or scales.dtype == torch.float32) else None
    a32 = a if a.dtype == torch.float32 and a.is_contiguous() else a.float().contiguous()
    try:
        # the kernel checks the offsets' values (0 first, never decreasing, R last) before it reads them
        _EXT.packed_grouped_mm(a32, offsets.contiguous(), data, scales, table, C.E4M3_TABLE, gs, fp4, bn, bk, out,
                               ISAS[isa], DENSE_FROM, act_int8, a_bf16, blas, dot_bf16)
    except ValueError:
        _bounds(offsets, a.shape[0])   # bad offsets: raise the message that names them and R
        raise
    return out if a.dtype == torch.float32 else out.to(a.dtype)


def has_int8_path() -> bool:
    """Whether ``activations="int8"`` runs here (the extension built, an AVX-512 VNNI CPU)."""
    return AVAILABLE and bool(_EXT.has_vnni())


def check_int8_weights(where: str, ws) -> None:
    """Raise ValueError unless int8 activations can multiply every packed weight of ``ws`` here:
    MXFP4 / NVFP4 weights whose K (the rows' width) is a multiple of 128, on an AVX-512 VNNI CPU."""
    bad = [(w.fmt, w.shape[-1]) for w in ws if w.fmt not in FP4_FORMATS or w.shape[-1] % 128]
    if bad:
        raise ValueError(f"{where}: int8 activations need MXFP4/NVFP4 weights whose input width is a multiple of "
                         f"128; got (format, width) {bad}: use float activations for these weights")
    if not has_int8_path():
        raise ValueError(f"{where}: int8 activations need the native packed kernel on an AVX-512 VNNI CPU "
                         f"({status()}; VNNI: {AVAILABLE and bool(_EXT.has_vnni())}): use float activations here")


def _run(a: Tensor, w: QuantizedTensor, offsets: Tensor, isa: str, impl: str, act: str = "float") -> Tensor:
    # the offsets' values are checked by whichever path reads them (the extension checks its own)
    if act == "int8":
        return _native(a, w, offsets, isa, True)
    if impl == "reference":
        return grouped_matmul_reference(a, w, offsets)
    if impl == "native" or (impl == "auto" and AVAILABLE):
        if not AVAILABLE:
            raise RuntimeError(f"grouped_matmul(impl='native'): {status()}")
        return _native(a, w, offsets, isa)
    return _numba(a, w, _bounds(offsets, a.shape[0]))


class _GroupedMatmul(torch.autograd.Function):
    """Weights travel as their leaves; the gradient flows to ``a`` only."""

    @staticmethod
    def forward(ctx, a, offsets, data, scales, gscale, meta):
        fmt, shape, block, o, isa, impl, act = meta
        w = QuantizedTensor(data, scales, gscale, fmt, shape, block)
        ctx.save_for_backward(data, scales, gscale)
        ctx.meta = meta
        return _run(a, w, offsets, isa, impl, act)

    @staticmethod
    def backward(ctx, dy):
        data, scales, gscale = ctx.saved_tensors
        fmt, shape, block, o = ctx.meta[:4]
        w = QuantizedTensor(data, scales, gscale, fmt, shape, block)
        da = torch.zeros(dy.shape[0], shape[-1], dtype=torch.float32)
        for e in range(len(o) - 1):
            if o[e + 1] > o[e]:
                da[o[e]:o[e + 1]] = dy[o[e]:o[e + 1]].float() @ dequantize(w[e])
        return da.to(dy.dtype), None, None, None, None, None


def grouped_matmul(a: Tensor, w: QuantizedTensor, offsets: Tensor, *, isa: str = "auto",
                   impl: str = "auto", activations: str = "float") -> Tensor:
    """y[r] = a[r] @ dequant(w[e]).T for every expert e's rows offsets[e]:offsets[e + 1] (module docstring).

    a: float32/bfloat16 [R, K]; w: QuantizedTensor [E, N, K]; offsets: int64 [E + 1] (CPU).
    Returns [R, N] in a.dtype. isa: "auto" | "portable" | "avx2" | "avx512"; impl: "auto" |
    "native" | "reference". activations: "float" (default: a as given, FP32 products) or "int8"
    (opt-in, mxfp4/nvfp4 with K % 128 == 0 on an AVX-512 VNNI CPU, :func:`has_int8_path`): each
    32-element block of a row is rounded to int8 (scale amax / 127) and multiplied with integer
    dot products, as llama.cpp's Q8 activations are; |error| <= |W| @ (d / 2) per row over the
    blocks' scales d, beside the float rounding. Experts with more than DENSE_FROM rows still
    take the float path.
    """
    _check_args(a, w, offsets)
    if isa not in ISAS:
        raise ValueError(f"grouped_matmul: isa must be one of {tuple(ISAS)}, got {isa!r}")
    if impl not in ("auto", "native", "reference"):
        raise ValueError(f"grouped_matmul: impl must be 'auto', 'native' or 'reference', got {impl!r}")
    if isa not in ("auto", "portable") and AVAILABLE and ISAS[isa] > ISAS[best_isa()]:
        raise ValueError(f"grouped_matmul: isa={isa!r} is not supported by this CPU (widest: {best_isa()!r}); "
                         f"pass isa='auto'")
    if activations not in ("float", "int8"):
        raise ValueError(f"grouped_matmul: activations must be 'float' or 'int8', got {activations!r}")
    if activations == "int8":
        check_int8_weights("grouped_matmul", (w,))
    if not (a.requires_grad and torch.is_grad_enabled()):
        # nothing to differentiate: skip the autograd.Function (its bookkeeping costs a decode
        # step more than the validation does)
        return _run(a, w, offsets, isa, impl, activations)
    meta = (w.fmt, w.shape, w.block, tuple(_bounds(offsets, a.shape[0])), isa, impl, activations)
    return _GroupedMatmul.apply(a, offsets, w.data, w.scales, w.global_scale, meta)


# --------------------------------------------------------------------------- the fused expert stage

# The elementwise steps the fused stage runs (fmoe.engine.kinds.ExpertForm.hidden's): ffn's relu
# and silu, glu's silu(g) * u (g, u: the halves of one fused in-projection, or two), GPT-OSS's
# clamped SwiGLU (gate/up in alternate rows).
STAGE_ACTS = {"relu": 0, "silu": 1, "glu": 2, "gpt_oss": 3}
_STAGE_ORDERS = {"fmoe": 0, "eager": 1, "grouped": 2}


def _weight_operands(w: QuantizedTensor):
    """(data, scales, table, gscale or an empty tensor, (fp4, bn, bk)) as the fused stage reads
    them: the stored tensors themselves (one-byte dtypes are read as bytes; a copy only of a
    non-contiguous one)."""
    fmt = w.fmt
    d = w.data if w.data.is_contiguous() else w.data.contiguous()
    s = w.scales if w.scales.is_contiguous() else w.scales.contiguous()
    if fmt in FP4_FORMATS:
        gs = w.global_scale
        if gs is not None and not (gs.dtype == torch.float32 and gs.is_contiguous()):
            gs = gs.float().contiguous()
        return d, s, C.E8M0_TABLE if fmt == "mxfp4" else C.E4M3_TABLE, _NO_GSCALE if gs is None else gs, (1, 1, w.block[1])
    if fmt == "mxfp8":
        return d, s, C.E8M0_TABLE, _NO_GSCALE, (0, 1, 32)
    return d, s, C.E8M0_TABLE, _NO_GSCALE, (0, *w.block)


_NO_GSCALE = torch.empty(0)
# The vector width of torch's elementwise kernels in this process (its CPU capability): the fused
# stage computes exp on it, so that its activation is torch's, bit for bit.
_EXP_ISA = {"AVX512": ISAS["avx512"], "AVX2": ISAS["avx2"]}.get(torch.backends.cpu.get_cpu_capability(),
                                                                  ISAS["portable"])


def expert_stage(x: Tensor, tokens: Tensor, offsets: Tensor, gates: Tensor, w_in: tuple, w_out: QuantizedTensor, *,
                 act: str, b_in=None, b_out=None, order: str = "fmoe", pairs=None, num_slots: int = 0,
                 alpha: float = 1.702, limit: float = 7.0, isa: str = "auto", buffers: tuple = (),
                 activations: str = "float") -> Tensor:
    """A rows plan's whole expert stage over packed weights in ONE native call (forward only).

        x_r = x[tokens];  z_i = x_r @ dequant(w_in[i]).T per expert;  z_0 += b_in[e]
        h = act(z);  y_r = h @ dequant(w_out).T per expert (+ b_out[e]);  y[t] = sum of gate_r * y_r

    Args:
        x: float32 or bfloat16 [T, M] (unit column stride), CPU. tokens: int64 [N], each row's
            token, rows sorted by expert; offsets: int64 [E + 1] (expert e's rows
            offsets[e]:offsets[e + 1]). gates: [N] float32 (or bfloat16 with bfloat16 x).
        w_in: one QuantizedTensor [E, H', M] (ffn: H' = H; glu: gate rows then up rows, H' = 2H;
            gpt_oss: gate/up in alternate rows, H' = 2H) or, for glu, two [E, H, M] (gate, up).
        w_out: QuantizedTensor [E, O, H]. b_in: [E, H'] (added to the first in-projection) or
            None; b_out: [E, O] or None; both in x's dtype.
        act: a key of :data:`STAGE_ACTS`. alpha, limit: GPT-OSS's constants.
        order: the combine, :func:`fmoe.engine.kinds._accumulate`'s: 'fmoe' (fp32 sum in row
            order), 'eager' (bf16: each token's running sum in dt over its ``num_slots`` slots;
            fp32: as 'fmoe') or 'grouped' (fp32 sum in ascending ``pairs`` order: each row's
            pair index j * T + t, int64 [N]). ``pairs`` is read by 'grouped' only and
            ``num_slots`` (the routing's k) by 'eager' on bf16 rows only: a caller passes both
            whatever the order.
        isa: as :func:`grouped_matmul`'s. buffers: () or float32 [N, H'] per in-projection and
            [N, H] for h, which the call computes in (tests read z and h from them).
        activations: "float", or "int8": both GEMMs as :func:`grouped_matmul`'s
            ``activations="int8"`` (FP4 weights, M and H multiples of 128, an AVX-512 VNNI CPU).
    Returns:
        y [T, O] in x's dtype; a token with no row is 0.

    Equality with the unfused composition (:func:`fmoe.engine.kinds.reference` over
    :func:`grouped_matmul`): bit for bit. The gather copies; both GEMMs are the same kernel call on
    the same operands (and thread count); every other step is the torch op's float operation on
    the same values, in the same order, rounded to bf16 where the op's output is bf16. The
    activation's exp is torch's own: Sleef's u10 expf (exported by libtorch_cpu) on the lanes of
    torch's vectorized loop at its CPU capability's width, std::exp on that loop's scalar tails,
    with the ranges split as TensorIterator splits them over the threads (tests/test_packed_fused.py
    checks z, h and y separately on every ISA path). Where a torch build lacks those symbols or
    vectorizes otherwise, each exp still is within 1 ulp, so h is within a few ulp (bf16: a
    rounding boundary may move one bf16 ulp) and y within the out-projection's rounding of that.
    """
    return run_stage(stage_weights(w_in, w_out, act=act, isa=isa, activations=activations), x, tokens, offsets,
                     gates, b_in=b_in, b_out=b_out, order=order, pairs=pairs, num_slots=num_slots, alpha=alpha,
                     limit=limit, buffers=buffers)


@dataclasses.dataclass(frozen=True, eq=False)
class StageWeights:
    """The weights of one layer's :func:`expert_stage` as its native call reads them, checked once
    (:func:`stage_weights`): a caller that runs the same layer call after call (a prepared
    inference call, :class:`fmoe.PreparedMoE`) keeps one and pays for the checks and operand
    lists once.

    Attributes:
        weights: the QuantizedTensors (in-projections, then the out-projection).
        args: the native call's weight operands (data, scales, tables, global scales, format flags).
        act: the activation's code (:data:`STAGE_ACTS`); isa: the forced path's code (0: auto);
        int8: int8-rounded activations.
    """

    weights: tuple
    args: tuple
    act: int
    isa: int
    int8: bool


def stage_weights(w_in: tuple, w_out: QuantizedTensor, *, act: str, isa: str = "auto",
                  activations: str = "float") -> StageWeights:
    """:func:`expert_stage`'s weights, activation, path and activations checked, its weight operands
    gathered: what :func:`run_stage` takes. Raises as :func:`expert_stage` does."""
    if not AVAILABLE:
        raise RuntimeError(f"expert_stage: {status()}")
    if act not in STAGE_ACTS:
        raise ValueError(f"expert_stage: act must be one of {tuple(STAGE_ACTS)}, got {act!r}")
    if isa not in ISAS:
        raise ValueError(f"expert_stage: isa must be one of {tuple(ISAS)}, got {isa!r}")
    ws = (*w_in, w_out)
    if not all(isinstance(w, QuantizedTensor) and w.device.type == "cpu" for w in ws):
        raise TypeError("expert_stage: every weight must be a CPU QuantizedTensor, got "
                        f"{[type(w).__name__ for w in ws]}")
    if isa not in ("auto", "portable") and ISAS[isa] > ISAS[best_isa()]:
        raise ValueError(f"expert_stage: isa={isa!r} is not supported by this CPU (widest: {best_isa()!r}); "
                         f"pass isa='auto'")
    if activations not in ("float", "int8"):
        raise ValueError(f"expert_stage: activations must be 'float' or 'int8', got {activations!r}")
    if activations == "int8":
        check_int8_weights("expert_stage", ws)
    ops = [_weight_operands(w) for w in ws]
    args = ([op[0] for op in ops], [op[1] for op in ops], [op[2] for op in ops], [op[3] for op in ops],
            [v for op in ops for v in op[4]])
    return StageWeights(ws, args, STAGE_ACTS[act], ISAS[isa], activations == "int8")


def run_stage(weights: StageWeights, x: Tensor, tokens: Tensor, offsets: Tensor, gates: Tensor, *, b_in=None,
              b_out=None, order: str = "fmoe", pairs=None, num_slots: int = 0, alpha: float = 1.702,
              limit: float = 7.0, buffers: tuple = ()) -> Tensor:
    """:func:`expert_stage` with its weights given as :func:`stage_weights` made them; the other
    arguments, the result and the errors as there (the native call checks the rows, offsets,
    gates, pairs, biases and shapes against the weights before it reads a row)."""
    if order not in _STAGE_ORDERS:
        raise ValueError(f"expert_stage: order must be one of {tuple(_STAGE_ORDERS)}, got {order!r}")
    if not isinstance(x, Tensor) or x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu":
        raise TypeError(f"expert_stage: x must be a float32 or bfloat16 CPU tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    data, scales, tables, gscales, flags = weights.args
    # the operands the order's combine reads; the others are not checked or read
    pairs = pairs if order == "grouped" else None
    num_slots = num_slots if order == "eager" and x.dtype is torch.bfloat16 else 0
    return _EXT.packed_expert_stage(x, tokens, offsets, gates, pairs, _STAGE_ORDERS[order], num_slots, data, scales,
                                    tables, gscales, flags, C.E4M3_TABLE, b_in, b_out, weights.act, alpha, limit,
                                    weights.isa, DENSE_FROM, _EXP_ISA, list(buffers), weights.int8)


_try_load()
