"""Quantized expert training: low-precision expert GEMMs with float master weights.

Every step the expert GEMMs run on quantized operands while the optimizer keeps FP32 (or
BF16) master weights. One call of :func:`quantized_mm` is one expert GEMM ``y = x @ op(w)``
over any layout (padded buffers [E, C, K] or ragged rows [R, K]); the layout lives in the
two callables it is given:

    mm(a, b, transposed)  -> per-expert a @ (b^T if transposed else b)   (float)
    wgrad(a, b)           -> per-expert a^T b, shape [E, P, Q]            (float)

and, for ragged rows, in ``offsets`` [E + 1] (the quantizers' blocks follow the experts; a
:class:`fmoe.engine.GroupedGemm` over a ragged layout passes its offsets).

Forward, dgrad and wgrad (the three GEMMs of a linear layer) each quantize their operands
along that GEMM's reduction axis, as a low-precision tensor core needs them:

    forward  y  = mm(q_K(x),  q_K(w))            reduction over K (x's last axis)
    dgrad    dx = mm(q_N(gy), q_N(w), not t)     reduction over N (gy's last axis)
    wgrad    dw = wgrad(q_T(gy), q_T(x)) or wgrad(q_T(x), q_T(gy))   reduction over tokens

``q`` is quantize-then-dequantize with the bit-exact codecs of :mod:`fmoe.quant.formats`
(spec/formats.md); the quantizer is a straight-through estimator, so dw lands on the master
weight as is. Which operands are quantized is a :class:`TrainPrecision` recipe:

    weights       the weight format: "fp32" (no rounding), "bf16", "fp8_row", "fp8_block"
                  (128x128 weight blocks, 1x128 activation/gradient tiles, DeepSeek-V3),
                  "mxfp8", "mxfp4", "nvfp4"
    activations   also quantize x (forward and wgrad) in the matching activation format
    grads         also quantize gy (dgrad and wgrad); FP4 gradients use stochastic rounding
                  when ``stochastic_rounding`` (unbiased: E[q(g)] = g inside the range)
    hadamard      random Hadamard transform (16-point, random signs) of both wgrad operands
                  along the token axis before quantizing (NVFP4 training recipe); exact in
                  real arithmetic since the transform is orthogonal. Per expert: padded
                  [E, C, K] buffers, or ragged rows with their offsets; the wgrad then runs
                  as torch.bmm (or the fused kernel; on ragged rows one mm per expert) over
                  each expert's 16-padded token axis rather than through the layout's wgrad
    save_activations  "fp8": keep the x saved for backward as FP8 rows (1 byte per element
                  plus one FP32 scale per row) instead of x's dtype (activation compression)

Activation/gradient formats: "fp8_row" per token row (one FP32 scale), "fp8_block" 1x128
tiles with s = max(amax, 1e-4)/448 (DeepSeek act_quant), MX and NVFP4 their own 1-D blocks
(NVFP4 with one FP32 global scale per matrix: per expert). FP8 amax comes from the current
tensor (no delayed scaling). No scale block spans two experts: padded buffers are per expert
by construction, and ragged rows (``offsets``) are quantized expert by expert along the
token axis (each expert's first row starts a block; its FP8 row scales and NVFP4 global
scale are its own), so every expert's GEMMs see exactly the operands a call on its rows
alone would. The token axis is zero-padded to the block size per expert (zeros change no
amax) and cropped after decoding.

Randomness (stochastic rounding, Hadamard signs) comes only from the ``generator`` passed
in; a recipe that needs it raises without one.

Compute: quantized operands are decoded to FP32 and multiplied in FP32 (the exact products
a tensor core forms, FP32 accumulation); y and dx come back in x's dtype, dw in w's dtype.
Paths (all give the same decoded operands; only the GEMM summation order may differ):
  "auto"       quantize-dequantize each operand in one pass with the numba kernels of
               :mod:`fmoe.quant._cpu_kernels` (CPU; the torch codecs on other devices and
               under torch.func), then the layout's float mm / wgrad
  "reference"  the spec quantizers of :mod:`fmoe.quant.formats`, dequantize, mm / wgrad
  "native"     CUDA: the forward through the native W4A16 / FP8 block kernels (FP4 weights;
               fp8_block with quantized activations), bf16 outputs; backward as "auto".
               "auto" on CUDA does the same where a kernel fits and the library is built,
               the torch codecs and the layout's mm otherwise
  "fused"      padded CPU [E, C, K] buffers: operands packed by the spec quantizers and
               multiplied by the fused kernels of :mod:`fmoe.quant.matmul` (weights decoded
               in registers) in forward, dgrad and (x quantized) wgrad: the W4A16 / W8A16
               inference kernels reused for training; slower than "auto" here because
               packing runs in torch
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import numpy as np
import torch
from torch import Tensor

from . import _codecs as C
from . import formats as F
from .tensor import FP4_FORMATS, QuantizedTensor

__all__ = ["TrainPrecision", "recipe_from_name", "PRECISION_NAMES", "TRAIN_FORMATS",
           "quantized_mm", "quantized_mm_reference", "fake_quantize", "quantize_operand",
           "quantize_sr", "hadamard_along_tokens", "bmm_layout"]

TRAIN_FORMATS = ("fp32", "bf16", "fp8_row", "fp8_block", "mxfp8", "mxfp4", "nvfp4")
PRECISION_NAMES = TRAIN_FORMATS
_FLOAT_FORMATS = ("fp32", "bf16")  # rounding only, no block scales
SAVE_FORMATS = (None, "fp8")
PATHS = ("auto", "fused", "reference", "native")
HADAMARD_SIZE = 16

# Block length along the quantized axis that the token axis must be padded to.
_AXIS_BLOCK = {"mxfp8": F.MX_BLOCK, "mxfp4": F.MX_BLOCK, "nvfp4": F.NVFP4_BLOCK}


@dataclasses.dataclass(frozen=True)
class TrainPrecision:
    """Static quantized-training recipe (frozen, hashable); see the module docstring.

    weights: one of TRAIN_FORMATS. activations / grads: also quantize x / gy.
    stochastic_rounding: FP4 gradient operands round stochastically (needs a generator).
    hadamard: random Hadamard transform of the wgrad operands (needs a generator).
    save_activations: None or "fp8" (x saved for backward as FP8 rows).
    """

    weights: str = "fp8_block"
    activations: bool = False
    grads: bool = False
    stochastic_rounding: bool = True
    hadamard: bool = False
    save_activations: Optional[str] = None

    def __post_init__(self):
        if self.weights not in TRAIN_FORMATS:
            raise ValueError(f"TrainPrecision.weights must be one of {TRAIN_FORMATS}, got {self.weights!r}")
        if self.save_activations not in SAVE_FORMATS:
            raise ValueError(f"TrainPrecision.save_activations must be one of {SAVE_FORMATS}, "
                             f"got {self.save_activations!r}")
        for name in ("activations", "grads", "stochastic_rounding", "hadamard"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"TrainPrecision.{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def uses_sr(self) -> bool:
        """True when gradient operands are stochastically rounded (FP4 grads)."""
        return self.grads and self.stochastic_rounding and self.weights in FP4_FORMATS

    @property
    def uses_hadamard(self) -> bool:
        """True when the wgrad operands get the random Hadamard transform."""
        return self.hadamard and (self.activations or self.grads) and self.weights not in _FLOAT_FORMATS

    @property
    def needs_generator(self) -> bool:
        return self.uses_sr or self.uses_hadamard


def recipe_from_name(name: str, *, save_activations: Optional[str] = None) -> Optional[TrainPrecision]:
    """The recipe behind a CLI precision name (``PRECISION_NAMES``).

    "fp32" -> None (no quantization; with save_activations a float recipe that only
    compresses the saved activations). Every other name quantizes weights, activations and
    output gradients in that format (full low-precision training of the expert GEMMs);
    "mxfp4" and "nvfp4" round gradients stochastically, and "nvfp4" adds the random
    Hadamard transform on wgrad (NVIDIA's NVFP4 recipe).
    """
    if name not in PRECISION_NAMES:
        raise ValueError(f"unknown precision {name!r}; expected one of {PRECISION_NAMES}")
    if name == "fp32":
        if save_activations is not None:
            return TrainPrecision(weights="fp32", save_activations=save_activations)
        return None
    return TrainPrecision(weights=name, activations=True, grads=True,
                          stochastic_rounding=name in FP4_FORMATS, hadamard=name == "nvfp4",
                          save_activations=save_activations)


# --- operand quantizers (last axis = reduction axis) ------------------------------------------

def _sr_e2m1(v: Tensor, generator: torch.Generator) -> Tensor:
    """Stochastically rounded E2M1 codes of already-scaled float32 v (saturating to +-6).

    A magnitude a between grid neighbours lo < hi rounds to hi with probability
    (a - lo) / (hi - lo), so E[decode] = clamp(v, -6, 6). Sign of zero kept, NaN refused.
    """
    if torch.isnan(v).any():
        raise ValueError("stochastic E2M1 rounding: NaN input has no E2M1 encoding")
    grid = C.E2M1_VALUES[:8].to(v.device)  # 0, .5, 1, 1.5, 2, 3, 4, 6
    a = v.abs().float().clamp(max=C.E2M1_MAX)
    lo_idx = (torch.searchsorted(grid, a.contiguous(), right=True) - 1).clamp(0, 7)
    hi_idx = (lo_idx + 1).clamp(max=7)
    lo, hi = grid[lo_idx], grid[hi_idx]
    gap = hi - lo
    p = torch.where(gap > 0, (a - lo) / torch.where(gap > 0, gap, torch.ones_like(gap)), torch.zeros_like(a))
    u = torch.rand(a.shape, generator=generator, device=v.device, dtype=torch.float32)
    code = torch.where(u < p, hi_idx, lo_idx).to(torch.uint8)
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def quantize_sr(x: Tensor, fmt: str, *, generator: torch.Generator) -> QuantizedTensor:
    """FP4 quantization with stochastic element rounding, x float [..., N, K] -> fmt.

    The block scales (and the NVFP4 global scale) are exactly those of the round-to-nearest
    quantizer of spec/formats.md (``quantize(x, fmt)``); only the E2M1 element codes are
    rounded stochastically, from ``generator``. fmt: "mxfp4" or "nvfp4".
    """
    if fmt not in FP4_FORMATS:
        raise ValueError(f"quantize_sr: stochastic rounding is for FP4 formats {FP4_FORMATS}, got {fmt!r}")
    if not isinstance(generator, torch.Generator):
        raise TypeError("quantize_sr: pass an explicit torch.Generator (stochastic rounding never "
                        "draws from the global RNG)")
    base = F.quantize(x, fmt)
    xf = x.float()
    if fmt == "mxfp4":
        scaled = F._divide_by_e8m0(F._blocks(xf, F.MX_BLOCK), base.scales).float()
    else:
        sf2b = base.global_scale.float()[..., None, None]
        divisor = C.decode_e4m3(base.scales) * sf2b
        scaled = F._blocks(xf, F.NVFP4_BLOCK) / divisor.unsqueeze(-1)
    codes = _sr_e2m1(scaled, generator)
    data = C.pack_fp4(codes.flatten(-2))
    return QuantizedTensor(data, base.scales, base.global_scale, fmt, tuple(x.shape), base.block)


def _act_quantizer(fmt: str, x: Tensor, sr: bool, generator) -> QuantizedTensor:
    """Quantize an activation / gradient operand [..., rows, K] along K."""
    if fmt == "fp8_row":
        return F.quantize_fp8_rowwise(x)
    if fmt == "fp8_block":
        return F.quantize_fp8_act_tiles(x, 128)
    if sr:
        return quantize_sr(x, fmt, generator=generator)
    return F.quantize(x, fmt)


def quantize_operand(t: Tensor, fmt: str, role: str, *, sr: bool = False,
                     generator: Optional[torch.Generator] = None) -> QuantizedTensor:
    """Quantize t [..., rows, K] along its last axis (the reduction axis of the GEMM).

    role "weight": fp8_block uses 128x128 blocks, fp8_row one scale per row, others their
    1-D blocks; role "act" (activations and gradients): fp8_block uses 1x128 tiles.
    sr: stochastic element rounding (FP4 formats only; needs generator).
    Returns a QuantizedTensor of logical shape t.shape (not for fmt "bf16").
    """
    if fmt not in TRAIN_FORMATS or fmt in _FLOAT_FORMATS:
        raise ValueError(f"quantize_operand: fmt must be one of {TRAIN_FORMATS[2:]}, got {fmt!r}")
    if role == "weight":
        if sr:
            return quantize_sr(t, fmt, generator=generator)
        return F.quantize(t, fmt)
    if role != "act":
        raise ValueError(f"quantize_operand: role must be 'weight' or 'act', got {role!r}")
    return _act_quantizer(fmt, t, sr and fmt in FP4_FORMATS, generator)


FAKE_QUANT_IMPLS = ("auto", "numba", "torch")


def fake_quantize(t: Tensor, fmt: str, role: str, *, sr: bool = False,
                  generator: Optional[torch.Generator] = None, impl: str = "auto") -> Tensor:
    """dequantize(quantize_operand(t, ...)) as float32 [t.shape]; "bf16" rounds to bfloat16,
    "fp32" only converts.

    impl "torch": the spec quantizers of :mod:`fmoe.quant.formats`, then dequantize;
    "numba": one-pass numba kernels (CPU), bit-exact with "torch" (the same stochastic
    draws too); "auto": numba for plain CPU tensors, torch otherwise (GPU, torch.func).
    """
    if fmt == "fp32":
        return t.float()
    if fmt == "bf16":
        return t.to(torch.bfloat16).float()
    if impl not in FAKE_QUANT_IMPLS:
        raise ValueError(f"fake_quantize: impl must be one of {FAKE_QUANT_IMPLS}, got {impl!r}")
    if impl == "numba" or (impl == "auto" and t.device.type == "cpu" and not _wrapped(t) and t.dim() >= 2):
        return _fake_quantize_numba(t, fmt, role, sr and fmt in FP4_FORMATS, generator)
    return F.dequantize(quantize_operand(t, fmt, role, sr=sr, generator=generator))


def _fake_quantize_numba(t: Tensor, fmt: str, role: str, sr: bool, generator) -> Tensor:
    from .. import _numba
    from . import _cpu_kernels as K

    if fmt not in TRAIN_FORMATS or fmt in _FLOAT_FORMATS:
        raise ValueError(f"fake_quantize: fmt must be one of {TRAIN_FORMATS}, got {fmt!r}")
    if role not in ("weight", "act"):
        raise ValueError(f"fake_quantize: role must be 'weight' or 'act', got {role!r}")
    if t.device.type != "cpu" or t.dim() < 2:
        raise ValueError(f"fake_quantize: the numba kernels take CPU tensors [..., N, K], got "
                         f"{tuple(t.shape)} on {t.device}")
    if not torch.is_floating_point(t):
        raise TypeError(f"fake_quantize: expected a float tensor, got {t.dtype}")
    if sr and not isinstance(generator, torch.Generator):
        raise TypeError("fake_quantize: stochastic rounding needs an explicit torch.Generator")
    x = t.detach().float().contiguous()
    kdim = x.shape[-1]
    if fmt in _AXIS_BLOCK and kdim % _AXIS_BLOCK[fmt]:
        raise ValueError(f"fake_quantize: K = {kdim} (shape {tuple(x.shape)}) is not a multiple of "
                         f"the block size {_AXIS_BLOCK[fmt]}; pad K to a multiple of "
                         f"{_AXIS_BLOCK[fmt]} first")
    out = torch.empty_like(x)
    x2, o2 = x.view(-1, kdim), out.view(-1, kdim)
    u = torch.rand(x.shape, generator=generator, dtype=torch.float32) if sr else x2[:1, :1]
    floor = np.float32(F.ACT_AMAX_FLOOR)
    with _numba.kernel_call():
        if fmt == "fp8_row":
            bad = K.fq_fp8_rows(x2.numpy(), o2.numpy(), kdim, floor)
        elif fmt == "fp8_block" and role == "act":
            bad = K.fq_fp8_rows(x2.numpy(), o2.numpy(), 128, floor)
        elif fmt == "fp8_block":
            n = x.shape[-2]
            bn, bk = F.FP8_WEIGHT_BLOCK
            bad = K.fq_fp8_block2d(x.view(-1, n, kdim).numpy(), out.view(-1, n, kdim).numpy(), bn, bk)
        elif fmt in ("mxfp8", "mxfp4"):
            bad = K.fq_mx(x2.numpy(), o2.numpy(), fmt == "mxfp4", u.view(-1, u.shape[-1]).numpy(), sr)
        else:  # nvfp4: one global scale per [N, K] matrix
            n = x.shape[-2]
            bad = K.fq_nvfp4(x.view(-1, n, kdim).numpy(), out.view(-1, n, kdim).numpy(),
                             u.reshape(-1, n, kdim).numpy() if sr else u.view(1, 1, 1).numpy(), sr)
    if bad:
        raise ValueError(f"fake_quantize: input contains inf or NaN ({bad} values); block quantizers "
                         f"never encode non-finite values silently (spec §6.3)")
    return out


def _pad_rows(t: Tensor, multiple: int) -> Tensor:
    pad = (-t.shape[-1]) % multiple
    return torch.nn.functional.pad(t, (0, pad)) if pad else t


def _hadamard_matrix(signs: Tensor) -> Tensor:
    """diag(signs) @ H16 / 4: orthogonal, float32 [16, 16]."""
    h = torch.ones(1, 1, device=signs.device)
    while h.shape[0] < HADAMARD_SIZE:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return signs.float()[:, None] * h / math.sqrt(HADAMARD_SIZE)


def hadamard_along_tokens(tT: Tensor, signs: Tensor) -> Tensor:
    """Apply the block-diagonal random Hadamard transform along the last axis of tT [..., T],
    T a multiple of 16; signs: +-1 float [16]. Orthogonal: (a R) . (b R) = a . b."""
    *lead, T = tT.shape
    R = _hadamard_matrix(signs).to(tT.device)
    return (tT.float().reshape(*lead, T // HADAMARD_SIZE, HADAMARD_SIZE) @ R).reshape(*lead, T)


def _token_operand(t: Tensor, fmt: Optional[str], sr: bool, generator, signs: Optional[Tensor],
                   want_qt: bool, impl: str = "auto"):
    """Operand t [..., T, P] of a wgrad, quantized along the token axis T.

    Returns (float32 [..., P, T_padded] transposed values or None, QuantizedTensor of logical
    [..., P, T_padded] or None, T). fmt None: no quantization (the Hadamard transform still
    applies if signs are given, so both operands stay in the same basis).
    """
    T = t.shape[-2]
    tT = t.float().transpose(-1, -2)
    mult = HADAMARD_SIZE if signs is not None else 1
    if fmt in _AXIS_BLOCK:
        mult = max(mult, _AXIS_BLOCK[fmt])
    tT = _pad_rows(tT, mult)
    if tT.dim() < 2:
        raise ValueError("wgrad operand needs at least 2 dims")
    if signs is not None:
        tT = hadamard_along_tokens(tT, signs)
    if fmt is None or fmt in _FLOAT_FORMATS:
        return fake_quantize(tT, fmt or "fp32", "act"), None, T
    if not want_qt:
        return fake_quantize(tT.contiguous(), fmt, "act", sr=sr, generator=generator, impl=impl), None, T
    qt = quantize_operand(tT.contiguous(), fmt, "act", sr=sr, generator=generator)
    return None, qt, T


# --- layout helpers --------------------------------------------------------------------------

def bmm_layout():
    """(mm, wgrad) for padded [E, C, K] buffers with torch.bmm (the tests' and the default
    layout): mm(a, b, t) = a @ (b^T if t else b); wgrad(a, b) = a^T b."""
    def mm(a, b, transposed):
        return torch.bmm(a, b.transpose(1, 2) if transposed else b)

    def wgrad(a, b):
        return torch.bmm(a.transpose(1, 2), b)

    return mm, wgrad


def _wrapped(*ts) -> bool:
    # torch.func wraps tensors (grad tracking, batching) and numba cannot read a wrapper's
    # storage; under a transform the GEMMs go through mm / wgrad (same decoded values).
    f = torch._C._functorch
    return any(f.is_functorch_wrapped_tensor(t) for t in ts)


def _fused_ok(x: Tensor, fmt: str, path: str, rows: int, *others: Tensor) -> bool:
    if fmt in _FLOAT_FORMATS or path == "reference" or _wrapped(x, *others):
        return False
    ok = x.device.type == "cpu" and x.dim() == 3
    if path == "fused":
        if not ok:
            raise ValueError(f"quantized_mm: path 'fused' needs CPU [E, C, K] buffers, got "
                             f"{tuple(x.shape)} on {x.device}")
        return True
    return False  # "auto": numba fake quantization + the layout's float GEMMs


def _fused(a: Tensor, qt: QuantizedTensor) -> Tensor:
    from .matmul import _run
    qt = QuantizedTensor(qt.data.detach(), qt.scales.detach(),
                         None if qt.global_scale is None else qt.global_scale.detach(),
                         qt.fmt, qt.shape, qt.block)
    return _run(a.detach().float().contiguous(), qt, "fused")


# --- the autograd function -------------------------------------------------------------------

def _weight_qts(w: Tensor, recipe: TrainPrecision, transposed: bool, which: str):
    """w in [E, N, K] orientation quantized along K ("fwd") or along N ("dgrad")."""
    w_nk = w if transposed else w.transpose(-1, -2)
    src = w_nk if which == "fwd" else w_nk.transpose(-1, -2)
    return quantize_operand(src.float().contiguous(), recipe.weights, "weight")


def _impl(path: str) -> str:
    return "torch" if path == "reference" else "auto"


def _weight_values(w: Tensor, recipe: TrainPrecision, transposed: bool, which: str, impl: str):
    """float32 quantized-dequantized weight in w's own orientation, for mm."""
    if recipe.weights in _FLOAT_FORMATS:
        return fake_quantize(w, recipe.weights, "weight")
    w_nk = w if transposed else w.transpose(-1, -2)
    src = w_nk if which == "fwd" else w_nk.transpose(-1, -2)
    vals = fake_quantize(src.contiguous(), recipe.weights, "weight", impl=impl)
    # vals is [E, N, K] ("fwd") or [E, K, N] ("dgrad")
    if which == "fwd":
        return vals if transposed else vals.transpose(-1, -2)
    return vals.transpose(-1, -2) if transposed else vals


def _row_pieces(groups: list, rows: int) -> list:
    """[lo, hi) row ranges that tile [0, rows): the experts' groups, then the padding rows."""
    pieces = [(lo, hi) for lo, hi in groups if hi > lo]
    end = groups[-1][1] if groups else 0
    if rows > end:
        pieces.append((end, rows))
    return pieces


def _fq_along_k(t: Tensor, fmt: str, sr: bool, generator, impl: str, groups) -> Tensor:
    """fake_quantize of an activation/gradient t along its last axis K. On ragged rows
    (``groups``: each expert's [lo, hi)) NVFP4's per-matrix FP32 global scale is taken per
    expert (as on padded buffers); every other format's scales are per row already."""
    if groups is None or fmt != "nvfp4" or t.dim() != 2:
        return fake_quantize(t, fmt, "act", sr=sr, generator=generator, impl=impl)
    pieces = _row_pieces(groups, t.shape[0])
    if not pieces:
        return t.float()
    return torch.cat([fake_quantize(t[lo:hi], fmt, "act", sr=sr, generator=generator, impl=impl)
                      for lo, hi in pieces])


def _x_operand(x: Tensor, recipe: TrainPrecision, impl: str, groups=None) -> Tensor:
    if not recipe.activations:
        return x.float()
    return _fq_along_k(x, recipe.weights, False, None, impl, groups)


def _native_forward(x, w, recipe, transposed, path):
    """CUDA forward through the native kernels where one fits (None otherwise): FP4 weights
    as W4A16 (the activation operand rounded to bf16, as the A16 kernel takes it: exact for
    MXFP4-quantized activations, a bf16 rounding otherwise), FP8 128x128 weights with 1x128
    FP8 activation tiles as the FP8 block GEMM (exactly the recipe's operands). Outputs are
    bf16 (the kernels' epilogue). path "native" raises where no kernel fits."""
    fmt = recipe.weights
    fits = x.is_cuda and x.dim() == 3 and not _wrapped(x, w) and (
        fmt in FP4_FORMATS or (fmt == "fp8_block" and recipe.activations))
    if not fits:
        if path == "native":
            raise ValueError(f"quantized_mm: path 'native' needs CUDA [E, C, K] buffers and FP4 "
                             f"weights or fp8_block with quantized activations; got {fmt} "
                             f"(activations={recipe.activations}) {tuple(x.shape)} on {x.device}")
        return None
    from . import native
    try:
        native.lib()
    except RuntimeError:
        if path == "native":
            raise
        return None  # library not built: the torch reference path below
    w_nk = (w if transposed else w.transpose(-1, -2)).detach().float().contiguous()
    if fmt in FP4_FORMATS:
        xq = _x_operand(x.detach(), recipe, "torch")
        return native.w4a16_matmul(xq.to(torch.bfloat16).contiguous(), F.quantize(w_nk, fmt))
    a = F.quantize_fp8_act_tiles(x.detach().float().contiguous(), 128)
    return native.fp8_block_matmul(a, F.quantize_fp8_block(w_nk))


def _forward(x, w, recipe, transposed, mm, path, groups=None):
    if path in ("auto", "native") and x.is_cuda:
        y = _native_forward(x, w, recipe, transposed, path)
        if y is not None:
            return y.to(x.dtype)
    xq = _x_operand(x, recipe, _impl(path), groups)
    if _fused_ok(x, recipe.weights, path, x.shape[-2] if x.dim() == 3 else 0, w):
        y = _fused(xq, _weight_qts(w, recipe, transposed, "fwd"))
    else:
        y = mm(xq, _weight_values(w, recipe, transposed, "fwd", _impl(path)), transposed)
    return y.to(x.dtype)


def _dgrad(gy, w, recipe, transposed, mm, path, generator, x_dtype, groups=None):
    if recipe.grads:
        gq = _fq_along_k(gy, recipe.weights, recipe.uses_sr, generator, _impl(path), groups)
    else:
        gq = gy.float()
    if _fused_ok(gy, recipe.weights, path, gy.shape[-2] if gy.dim() == 3 else 0, w):
        dx = _fused(gq, _weight_qts(w, recipe, transposed, "dgrad"))
    else:
        dx = mm(gq, _weight_values(w, recipe, transposed, "dgrad", _impl(path)), not transposed)
    return dx.to(x_dtype)


def _wgrad(x, gy, w, recipe, transposed, wgrad, path, generator, groups=None):
    """dw (w's shape) from x [..., T, K] and gy [..., T, N], both quantized along T.

    groups: ragged rows [R, .] only, each expert's row range [lo, hi): the token axis is
    quantized expert by expert (see :func:`_wgrad_ragged`)."""
    fmt = recipe.weights
    signs = None
    if recipe.uses_hadamard:
        signs = torch.randint(0, 2, (HADAMARD_SIZE,), generator=generator,
                              device=generator.device).float().mul_(2).sub_(1)
    x_fmt = fmt if recipe.activations else None
    g_fmt = fmt if recipe.grads else None
    if x.dim() == 2:
        return _wgrad_ragged(x, gy, w, recipe, transposed, wgrad, path, generator, signs,
                             x_fmt, g_fmt, [(0, x.shape[0])] if groups is None else groups)
    fused = (x_fmt is not None and fmt not in _FLOAT_FORMATS and x.dim() == 3 and
             _fused_ok(gy, fmt, path, gy.shape[-1], x))
    gT, _, T = _token_operand(gy, g_fmt, recipe.uses_sr, generator, signs, False, _impl(path))
    xT, x_qt, _ = _token_operand(x, x_fmt, False, generator, signs, fused, _impl(path))
    if fused:
        # dw_nk[e] = gT[e] @ dequant(x_qt[e])^T over the padded token axis (zero padding
        # adds nothing); the x operand is decoded in registers.
        dw_nk = _fused(gT, x_qt)
        dw = dw_nk if transposed else dw_nk.transpose(-1, -2)
        return dw.contiguous().to(w.dtype)
    if signs is not None:
        # The transform mixed the padded tokens in: multiply over the whole padded axis
        # (padded [E, C, K] buffers only, checked by quantized_mm).
        dw_nk = torch.bmm(gT, xT.transpose(-1, -2))
        dw = dw_nk if transposed else dw_nk.transpose(-1, -2)
        return dw.contiguous().to(w.dtype)
    # Back to token-major [..., T, P] for the layout's wgrad (drop the padding).
    g_tm = gT[..., :T].transpose(-1, -2)
    x_tm = xT[..., :T].transpose(-1, -2)
    dw = wgrad(g_tm, x_tm) if transposed else wgrad(x_tm, g_tm)
    return dw.to(w.dtype)


def _wgrad_ragged(x, gy, w, recipe, transposed, wgrad, path, generator, signs, x_fmt, g_fmt,
                  groups):
    """wgrad over ragged rows x [R, K], gy [R, N]: no token-axis block spans two experts.

    Each expert's rows [lo, hi) are quantized on their own along the token axis, exactly as
    a call on that expert's rows alone would: its first row starts a block, its last block is
    zero-padded to the block size, the FP8 row scales and the NVFP4 global scale are its own,
    stochastic rounding draws expert by expert. Without the Hadamard transform the decoded
    operands are cropped back to the expert's rows (padding rows: zero) and the layout's
    ``wgrad`` runs on them; with it, each expert's padded token axis is multiplied whole
    (the transform mixed the padding in), an empty expert gets a zero gradient.
    """
    impl = _impl(path)

    def per_expert(t, fmt, sr):
        if signs is None and (fmt is None or fmt in _FLOAT_FORMATS):
            return None  # element-wise rounding: no blocks, the whole tensor at once below
        return [None if hi <= lo else _token_operand(t[lo:hi], fmt, sr, generator, signs, False, impl)[0]
                for lo, hi in groups]

    g_parts = per_expert(gy, g_fmt, recipe.uses_sr)
    x_parts = per_expert(x, x_fmt, False)
    if signs is not None:
        P, Q = gy.shape[-1], x.shape[-1]
        dw_nk = torch.stack([torch.zeros(P, Q, device=x.device) if gT is None else gT @ xT.transpose(0, 1)
                             for gT, xT in zip(g_parts, x_parts)])
        dw = dw_nk if transposed else dw_nk.transpose(-1, -2)
        return dw.contiguous().to(w.dtype)

    def token_major(parts, t, fmt):
        if parts is None:
            return fake_quantize(t, fmt or "fp32", "act")
        rows = [p[:, :hi - lo].transpose(0, 1) for p, (lo, hi) in zip(parts, groups) if p is not None]
        end = groups[-1][1] if groups else 0
        if t.shape[0] > end:  # the layout's padding rows (no expert): zero
            rows.append(t.new_zeros(t.shape[0] - end, t.shape[1], dtype=torch.float32))
        return torch.cat(rows) if rows else t.new_zeros(t.shape, dtype=torch.float32)

    g_tm, x_tm = token_major(g_parts, gy, g_fmt), token_major(x_parts, x, x_fmt)
    dw = wgrad(g_tm, x_tm) if transposed else wgrad(x_tm, g_tm)
    return dw.to(w.dtype)


def _compress_saved(x: Tensor):
    qt = F.quantize_fp8_rowwise(x, amax_floor=0.0)
    return qt.data, qt.scales


def _restore_saved(data: Tensor, scales: Tensor, dtype) -> Tensor:
    return (data.float() * scales).to(dtype)


class _QuantizedMM(torch.autograd.Function):
    @staticmethod
    def forward(x, w, recipe, transposed, mm, wgrad, generator, path, offsets):
        return _forward(x, w, recipe, transposed, mm, path, _groups(offsets, x))

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w, recipe, transposed, mm, wgrad, generator, path, offsets = inputs
        ctx.recipe, ctx.transposed, ctx.mm, ctx.wgrad = recipe, transposed, mm, wgrad
        ctx.generator, ctx.path, ctx.x_dtype = generator, path, x.dtype
        ctx.groups = _groups(offsets, x)
        if recipe.save_activations == "fp8":
            data, scales = _compress_saved(x.detach())
            ctx.save_for_backward(data, scales, w)
            ctx.compressed = True
        else:
            ctx.save_for_backward(x, w)
            ctx.compressed = False

    @staticmethod
    def backward(ctx, gy):
        if ctx.compressed:
            data, scales, w = ctx.saved_tensors
            x = _restore_saved(data, scales, ctx.x_dtype)
        else:
            x, w = ctx.saved_tensors
        r = ctx.recipe
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _dgrad(gy, w, r, ctx.transposed, ctx.mm, ctx.path, ctx.generator, ctx.x_dtype,
                        ctx.groups)
        if ctx.needs_input_grad[1]:
            dw = _wgrad(x, gy, w, r, ctx.transposed, ctx.wgrad, ctx.path, ctx.generator, ctx.groups)
        return dx, dw, None, None, None, None, None, None, None

    @staticmethod
    def vmap(info, in_dims, x, w, recipe, transposed, mm, wgrad, generator, path, offsets):
        # One call per batch element: the quantizers and kernels are not batching rules;
        # each element is quantized on its own (its own scales), as an unbatched call would.
        def pick(t, d, b):
            return t if d is None else t.select(d, b)

        outs = [_QuantizedMM.apply(pick(x, in_dims[0], b), pick(w, in_dims[1], b), recipe,
                                   transposed, mm, wgrad, generator, path,
                                   None if offsets is None else pick(offsets, in_dims[8], b))
                for b in range(info.batch_size)]
        return torch.stack(outs), 0


def _groups(offsets: Optional[Tensor], x: Tensor):
    """Each expert's row range [lo, hi) of ragged rows x [R, K] from offsets [E + 1], or None
    (padded buffers, or ragged rows whose offsets were not given: one group)."""
    if offsets is None or x.dim() != 2:
        return None
    o = [int(v) for v in offsets.tolist()]
    if o[0] != 0 or any(b < a for a, b in zip(o, o[1:])) or o[-1] > x.shape[0]:
        raise ValueError(f"quantized_mm: offsets must start at 0, be non-decreasing and end at "
                         f"most at R = {x.shape[0]}; got {o}")
    return list(zip(o[:-1], o[1:]))


def _layout_offsets(x: Tensor, offsets: Optional[Tensor]) -> Optional[Tensor]:
    """The ragged group boundaries, checked: ``offsets`` (None: padded buffers, or ragged rows
    that are one group)."""
    if x.dim() != 2:
        if offsets is not None:
            raise ValueError(f"quantized_mm: offsets are for ragged rows [R, K]; padded buffers "
                             f"{tuple(x.shape)} are per expert already")
        return None
    if offsets is not None:
        if not isinstance(offsets, Tensor) or offsets.dim() != 1 or torch.is_floating_point(offsets):
            raise TypeError(f"quantized_mm: offsets must be an int tensor [E + 1], got {offsets!r}")
    return offsets


def _check_call(x, w, recipe, transposed, generator, path, offsets=None):
    if not isinstance(recipe, TrainPrecision):
        raise TypeError(f"quantized_mm: recipe must be a TrainPrecision, got {type(recipe).__name__}")
    if not isinstance(x, Tensor) or not torch.is_floating_point(x):
        raise TypeError(f"quantized_mm: x must be a float tensor, got {type(x).__name__}")
    if not isinstance(w, Tensor) or not torch.is_floating_point(w) or w.dim() < 2:
        raise TypeError("quantized_mm: w must be a float master weight [E, K, N] or [E, N, K]")
    k_w = w.shape[-1] if transposed else w.shape[-2]
    if x.shape[-1] != k_w:
        raise ValueError(f"quantized_mm: x has K = {x.shape[-1]} but w {tuple(w.shape)} "
                         f"(transposed={transposed}) has K = {k_w}")
    if path not in PATHS:
        raise ValueError(f"quantized_mm: path must be one of {PATHS}, got {path!r}")
    if path == "native" and not x.is_cuda:
        raise ValueError(f"quantized_mm: path 'native' runs the CUDA kernels; x is on {x.device}")
    if recipe.needs_generator and not isinstance(generator, torch.Generator):
        raise ValueError("quantized_mm: this recipe uses stochastic rounding or a random Hadamard "
                         "transform; pass generator=torch.Generator() (fmoe never draws from the "
                         "global RNG)")
    if recipe.uses_hadamard and x.dim() != 3 and offsets is None:
        raise ValueError(f"quantized_mm: the Hadamard transform runs along each expert's token "
                         f"axis and needs padded [E, C, K] buffers or ragged rows with their "
                         f"offsets= (a 16-token block must not span two experts); got x "
                         f"{tuple(x.shape)} without offsets")
    if offsets is not None and offsets.shape[0] - 1 != w.shape[0]:
        raise ValueError(f"quantized_mm: offsets has {offsets.shape[0] - 1} experts, w "
                         f"{tuple(w.shape)} has {w.shape[0]}")
    fmt = recipe.weights
    if fmt in _AXIS_BLOCK:
        b = _AXIS_BLOCK[fmt]
        n_w = w.shape[-2] if transposed else w.shape[-1]
        if x.shape[-1] % b or n_w % b:
            raise ValueError(f"quantized_mm: {fmt} needs both weight dims to be multiples of {b} "
                             f"(its blocks run along K in forward and along N in dgrad); got w "
                             f"{tuple(w.shape)}")


def quantized_mm(x: Tensor, w: Tensor, recipe: Optional[TrainPrecision], *, transposed: bool,
                 mm: Callable, wgrad: Callable, generator: Optional[torch.Generator] = None,
                 path: str = "auto", offsets: Optional[Tensor] = None) -> Tensor:
    """One expert GEMM with quantized operands and float master weights.

    Args:
        x: float activations in the layout ([E, C, K] buffers or [R, K] rows), float32/bf16.
        w: float master weight [E, N, K] if ``transposed`` else [E, K, N] (float32/bf16).
        recipe: a TrainPrecision, or None for the plain float GEMM ``mm(x, w, transposed)``.
        transposed: y = x @ w^T (w out x in) instead of x @ w.
        mm: ``mm(a, b, transposed) -> a @ op(b)`` per expert over the layout.
        wgrad: ``wgrad(a, b) -> a^T b`` per expert over the layout, [E, P, Q].
        generator: torch.Generator for stochastic rounding / Hadamard signs (required when
            the recipe uses them; advanced once per backward).
        path: "auto" | "fused" | "reference" (see the module docstring).
        offsets: ragged rows only, int64 [E + 1] (expert e owns rows offsets[e]:offsets[e+1]):
            every token-axis block, FP8 row scale and NVFP4 global scale is then per expert
            (no block spans two experts; each expert is quantized as its rows alone would
            be); the layout plan's kernel passes its ragged layout's. [R, K] rows without
            offsets are one group (one expert's rows).
    Returns:
        y in x's dtype ([E, C, N] or [R, N]). Backward: dx in x's dtype, dw on w (its dtype).
    Composes with torch.func.grad / vjp and (per batch element) vmap.
    """
    if recipe is None:
        return mm(x, w, transposed)
    offsets = _layout_offsets(x, offsets)
    _check_call(x, w, recipe, transposed, generator, path, offsets)
    return _QuantizedMM.apply(x, w, recipe, bool(transposed), mm, wgrad, generator, path, offsets)


def quantized_mm_reference(x: Tensor, w: Tensor, recipe: TrainPrecision, *, transposed: bool,
                           gy: Tensor, generator: Optional[torch.Generator] = None):
    """Obviously-right (y, dx, dw) for padded [E, C, K] buffers: quantize each operand along
    its GEMM's reduction axis with :func:`fake_quantize`, then plain torch.bmm in FP32.

    Same randomness order as :func:`quantized_mm` (dgrad's gradient quantization draws first,
    then the Hadamard signs, then wgrad's), so with equal generators the results are equal.
    """
    w_nk = (w if transposed else w.transpose(1, 2)).float()
    fmt = recipe.weights
    xq = fake_quantize(x, fmt, "act", impl="torch") if recipe.activations else x.float()
    wf = fake_quantize(w_nk.contiguous(), fmt, "weight", impl="torch")            # [E, N, K] along K
    y = torch.bmm(xq, wf.transpose(1, 2))
    sr = recipe.uses_sr
    gq = fake_quantize(gy, fmt, "act", sr=sr, generator=generator, impl="torch") if recipe.grads else gy.float()
    wd = fake_quantize(w_nk.transpose(1, 2).contiguous(), fmt, "weight", impl="torch")  # [E, K, N] along N
    dx = torch.bmm(gq, wd.transpose(1, 2))
    signs = None
    if recipe.uses_hadamard:
        signs = torch.randint(0, 2, (HADAMARD_SIZE,), generator=generator,
                              device=generator.device).float() * 2 - 1

    def tok(t, on, use_sr):
        tT = t.float().transpose(1, 2)
        mult = HADAMARD_SIZE if signs is not None else 1
        if on and fmt in _AXIS_BLOCK:
            mult = max(mult, _AXIS_BLOCK[fmt])
        tT = _pad_rows(tT, mult)
        if signs is not None:
            tT = hadamard_along_tokens(tT, signs)
        if on:
            tT = fake_quantize(tT.contiguous(), fmt, "act", sr=use_sr, generator=generator, impl="torch")
        return tT

    gT = tok(gy, recipe.grads, sr)
    xT = tok(x, recipe.activations, False)
    dw_nk = torch.bmm(gT, xT.transpose(1, 2))  # padded tokens are zero in both
    dw = dw_nk if transposed else dw_nk.transpose(1, 2)
    return y.to(x.dtype), dx.to(x.dtype), dw.to(w.dtype)
