"""Quantizers and the dequantizer for every fmoe format, pinned to spec §6.3.

All quantizers take a float tensor of logical shape [..., N, K] (ndim >= 2), blocks along K,
and return a QuantizedTensor. Arithmetic is FP32 with IEEE division (tensor / tensor or
tensor / scalar, never python_scalar / tensor, which torch evaluates via a reciprocal).

Odd shapes: MX and NVFP4 require K to be a multiple of the block (32 / 16) and raise a
ValueError naming the shape otherwise (no padding, so a packed row is always whole blocks).
FP8 blocks follow DeepSeek: ragged edges are zero-padded for the scale computation and the
padding is dropped (spec §4.1).
"""
from __future__ import annotations

import torch

from . import _codecs as C
# dequantize and its block helpers live with the type (fmoe.quant.tensor), so the type never imports
# this module (no formats <-> tensor cycle); re-exported here.
from .tensor import FP4_FORMATS, MX_BLOCK, NVFP4_BLOCK, QuantizedTensor, _blocks, _expand_block_scales, dequantize  # noqa: F401

FP8_WEIGHT_BLOCK = (128, 128)
ACT_AMAX_FLOOR = 1e-4  # DeepSeek act_quant clamp (spec §4.2); avoids 0/0 on zero tiles


def _check_input(x: torch.Tensor, name: str, block_k: int | None = None) -> None:
    if not isinstance(x, torch.Tensor) or not torch.is_floating_point(x):
        raise TypeError(f"{name}: expected a float tensor, got {type(x).__name__} "
                        f"{getattr(x, 'dtype', '')}")
    if x.dim() < 2:
        raise ValueError(f"{name}: expected logical shape [..., N, K], got {tuple(x.shape)}")
    if block_k is not None and x.shape[-1] % block_k:
        raise ValueError(f"{name}: K = {x.shape[-1]} (shape {tuple(x.shape)}) is not a multiple "
                         f"of the block size {block_k}; pad K to a multiple of {block_k} first")
    if not torch.isfinite(x).all():
        raise ValueError(f"{name}: input contains inf or NaN; block quantizers never encode "
                         f"non-finite values silently (spec §6.3)")


# --- MX ------------------------------------------------------------------------------------

def _mx_scale(xb: torch.Tensor, emax: int, max_elem: float, scale_rule: str) -> torch.Tensor:
    amax = xb.abs().amax(dim=-1)
    if scale_rule == "floor":
        return C.mx_scale_floor(amax, emax)
    if scale_rule == "rceil":
        return C.mx_scale_rceil(amax, max_elem)
    raise ValueError(f"scale_rule must be 'floor' or 'rceil', got {scale_rule!r}")


def _divide_by_e8m0(xb: torch.Tensor, byte: torch.Tensor) -> torch.Tensor:
    # Division by a power of two is exact in float64 for every byte, including 2^-127.
    return xb.double() * torch.ldexp(torch.ones((), dtype=torch.float64),
                                     127 - byte.to(torch.float64)).unsqueeze(-1)


def quantize_mxfp4(w: torch.Tensor, *, scale_rule: str = "floor") -> QuantizedTensor:
    """OCP MXFP4: E2M1 elements, 32-element blocks along K, E8M0 scales (spec §2).

    w: float [..., N, K], K % 32 == 0. scale_rule "floor" (spec default) or "rceil".
    Returns fmt "mxfp4" (data uint8 [..., N, K/2], scales uint8 [..., N, K/32]).
    """
    _check_input(w, "quantize_mxfp4", MX_BLOCK)
    xb = _blocks(w.float(), MX_BLOCK)
    byte = _mx_scale(xb, 2, C.E2M1_MAX, scale_rule)
    codes = C.encode_e2m1(_divide_by_e8m0(xb, byte))
    data = C.pack_fp4(codes.flatten(-2))
    return QuantizedTensor(data, byte, None, "mxfp4", tuple(w.shape), (1, MX_BLOCK))


def quantize_mxfp8(x: torch.Tensor, *, scale_rule: str = "floor") -> QuantizedTensor:
    """OCP MXFP8 (E4M3 elements), 32-element blocks along K, E8M0 scales (spec §2, §10.3).

    x: float [..., N, K], K % 32 == 0. Returns fmt "mxfp8" (data float8_e4m3fn [..., N, K],
    scales uint8 [..., N, K/32]).
    """
    _check_input(x, "quantize_mxfp8", MX_BLOCK)
    xb = _blocks(x.float(), MX_BLOCK)
    byte = _mx_scale(xb, 8, C.E4M3_MAX, scale_rule)
    # The quotient is exact in float64; one rounding happens in the cast below.
    q = _divide_by_e8m0(xb, byte)
    data = C.encode_e4m3(q.float()).flatten(-2)
    return QuantizedTensor(data, byte, None, "mxfp8", tuple(x.shape), (1, MX_BLOCK))


# --- NVFP4 ---------------------------------------------------------------------------------

def quantize_nvfp4(w: torch.Tensor, *, weight_scale_2: torch.Tensor | None = None) -> QuantizedTensor:
    """NVFP4 in the ModelOpt form (spec §3.2): E2M1, 16-element blocks, UE4M3 block scales,
    one FP32 global scale per [N, K] matrix.

    w: float [..., N, K], K % 16 == 0. weight_scale_2: optional float32 [...] (default
    amax(|W|) / 2688 per matrix). Returns fmt "nvfp4" (data uint8 [..., N, K/2], scales
    float8_e4m3fn [..., N, K/16], global_scale float32 [...]).

    Zero blocks get s_b = 1.0 as ModelOpt does. A non-zero block whose scale would round to
    E4M3 zero (amax_block < ~2.2e-6 amax) gets the smallest subnormal 2^-9 instead, where
    ModelOpt would divide by zero.
    """
    _check_input(w, "quantize_nvfp4", NVFP4_BLOCK)
    w = w.float()
    if weight_scale_2 is None:
        amax = w.abs().amax(dim=(-2, -1))
        weight_scale_2 = amax / (6.0 * 448.0)
    sf2 = weight_scale_2.float().reshape(w.shape[:-2])
    if (sf2 <= 0).any():
        # An all-zero matrix: any positive scale decodes it to zero.
        sf2 = torch.where(sf2 > 0, sf2, torch.ones_like(sf2))
    xb = _blocks(w, NVFP4_BLOCK)
    sf2b = sf2[..., None, None]  # broadcast over [N, K/16]
    block_amax = xb.abs().amax(dim=-1)
    s = block_amax / (6.0 * sf2b)
    s = torch.where(block_amax == 0, torch.ones_like(s), s.clamp(min=2.0 ** -9))
    s_fp8 = C.encode_e4m3(s)
    divisor = s_fp8.float() * sf2b
    codes = C.encode_e2m1(xb / divisor.unsqueeze(-1))
    data = C.pack_fp4(codes.flatten(-2))
    return QuantizedTensor(data, s_fp8, sf2.clone(), "nvfp4", tuple(w.shape), (1, NVFP4_BLOCK))


# --- FP8 blocks and rows --------------------------------------------------------------------

def _pad_to(x: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    n, k = x.shape[-2:]
    pn, pk = (-n) % bn, (-k) % bk
    if pn or pk:
        x = torch.nn.functional.pad(x, (0, pk, 0, pn))
    return x


def _block_amax(x: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    xp = _pad_to(x, bn, bk)
    n, k = xp.shape[-2:]
    xb = xp.reshape(*xp.shape[:-2], n // bn, bn, k // bk, bk)
    return xb.abs().amax(dim=(-3, -1))


def quantize_fp8_block(w: torch.Tensor, block: tuple = FP8_WEIGHT_BLOCK) -> QuantizedTensor:
    """DeepSeek FP8 blockwise weight quantization (spec §4.1): s = amax_block / 448 (FP32),
    q = E4M3(clamp(W / s, +-448)), weight_scale_inv = s.

    w: float [..., N, K]; any N, K (ragged edges padded for the amax only).
    Returns fmt "fp8_block" (data float8_e4m3fn [..., N, K], scales float32
    [..., ceil(N/bn), ceil(K/bk)]). An all-zero block gets s = 1.0 (the pinned formula
    would give 0/0).
    """
    _check_input(w, "quantize_fp8_block")
    bn, bk = block
    w = w.float()
    amax = _block_amax(w, bn, bk)
    s = amax / 448.0
    s = torch.where(amax == 0, torch.ones_like(s), s)
    q = C.encode_e4m3(w / _expand_block_scales(s, bn, bk, *w.shape[-2:]))
    return QuantizedTensor(q, s, None, "fp8_block", tuple(w.shape), (bn, bk))


def quantize_fp8_act_tiles(x: torch.Tensor, tile: int = 128, scale_fmt: str = "fp32") -> QuantizedTensor:
    """DeepSeek act_quant (spec §4.2): 1 x tile tiles along K, s = max(amax, 1e-4) / 448,
    optionally rounded up to a power of two (scale_fmt="ue8m0").

    x: float [..., T, K]; K need not be a multiple of tile. Returns fmt "fp8_block" with
    block (1, tile), scales float32 [..., T, ceil(K/tile)].
    """
    _check_input(x, "quantize_fp8_act_tiles")
    x = x.float()
    amax = _block_amax(x, 1, tile).clamp(min=ACT_AMAX_FLOOR)
    s = amax / 448.0
    if scale_fmt == "ue8m0":
        s = C.pow2_ceil(s)
    elif scale_fmt != "fp32":
        raise ValueError(f"scale_fmt must be 'fp32' or 'ue8m0', got {scale_fmt!r}")
    q = C.encode_e4m3(x / _expand_block_scales(s, 1, tile, *x.shape[-2:]))
    return QuantizedTensor(q, s, None, "fp8_block", tuple(x.shape), (1, tile))


def quantize_fp8_rowwise(x: torch.Tensor, *, amax_floor: float = ACT_AMAX_FLOOR) -> QuantizedTensor:
    """Per-row FP8 (weights or activations): s = max(amax_row, amax_floor) / 448,
    q = E4M3(clamp(x / s, +-448)).

    x: float [..., N, K]. Returns fmt "fp8_row" (data float8_e4m3fn [..., N, K], scales
    float32 [..., N, 1]). Pass amax_floor=0 for the plain formula (zero rows then get s = 1).
    """
    _check_input(x, "quantize_fp8_rowwise")
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True).clamp(min=amax_floor)
    s = amax / 448.0
    s = torch.where(s == 0, torch.ones_like(s), s)
    q = C.encode_e4m3(x / s)
    return QuantizedTensor(q, s, None, "fp8_row", tuple(x.shape), (1, x.shape[-1]))


_QUANTIZERS = {
    "mxfp4": quantize_mxfp4,
    "mxfp8": quantize_mxfp8,
    "nvfp4": quantize_nvfp4,
    "fp8_block": quantize_fp8_block,
    "fp8_row": quantize_fp8_rowwise,
}


def quantize(x: torch.Tensor, fmt: str, **kwargs) -> QuantizedTensor:
    """Quantize x [..., N, K] to fmt ("mxfp4", "nvfp4", "mxfp8", "fp8_block", "fp8_row")."""
    try:
        fn = _QUANTIZERS[fmt]
    except KeyError:
        raise ValueError(f"unknown format {fmt!r}; expected one of {tuple(_QUANTIZERS)}") from None
    return fn(x, **kwargs)
