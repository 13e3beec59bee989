"""Checkpoint layouts in and out of QuantizedTensor, lossless (spec §5), and the 128x4
swizzled block-scale layout (spec §5.3).

Loading never re-quantizes: the bytes of the checkpoint become the leaves of the
QuantizedTensor (reshaped, and scale dtypes reinterpreted exactly).
"""
from __future__ import annotations

import math

import torch

from .tensor import QuantizedTensor


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


# --- gpt-oss MXFP4 (spec §5.1) --------------------------------------------------------------

def from_gpt_oss(blocks: torch.Tensor, scales: torch.Tensor) -> QuantizedTensor:
    """gpt-oss `*_blocks` uint8 [..., N, K/32, 16] + `*_scales` uint8 [..., N, K/32]
    -> QuantizedTensor "mxfp4" of logical shape [..., N, K] (rows = output channels)."""
    _need(blocks.dtype == torch.uint8 and blocks.dim() >= 3 and blocks.shape[-1] == 16,
          f"from_gpt_oss: blocks must be uint8 [..., N, K/32, 16], got {blocks.dtype} "
          f"{tuple(blocks.shape)}")
    if scales.dtype == torch.float8_e8m0fnu:
        scales = scales.view(torch.uint8)
    _need(scales.dtype == torch.uint8 and tuple(scales.shape) == tuple(blocks.shape[:-1]),
          f"from_gpt_oss: scales must be uint8 {tuple(blocks.shape[:-1])}, got {scales.dtype} "
          f"{tuple(scales.shape)}")
    data = blocks.reshape(*blocks.shape[:-2], blocks.shape[-2] * 16)
    shape = tuple(blocks.shape[:-2]) + (blocks.shape[-2] * 32,)
    return QuantizedTensor(data, scales, None, "mxfp4", shape, (1, 32))


def to_gpt_oss(qt: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of from_gpt_oss: (blocks uint8 [..., N, K/32, 16], scales uint8 [..., N, K/32])."""
    _need(qt.fmt == "mxfp4", f"to_gpt_oss: needs an mxfp4 tensor, got {qt.fmt}")
    data = qt.data
    return data.reshape(*data.shape[:-1], data.shape[-1] // 16, 16), qt.scales


# --- DeepSeek FP8 blocks (spec §4.1, §4.4) --------------------------------------------------

def from_deepseek_fp8(weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                      block: tuple = (128, 128)) -> QuantizedTensor:
    """DeepSeek / transformers FP8 `weight` float8_e4m3fn [..., N, K] + `weight_scale_inv`
    [..., ceil(N/bn), ceil(K/bk)] (float32, or float8_e8m0fnu for ue8m0 checkpoints; it is the
    decode multiplier) -> QuantizedTensor "fp8_block"."""
    if weight.dtype == torch.uint8:
        weight = weight.view(torch.float8_e4m3fn)
    _need(weight.dtype == torch.float8_e4m3fn and weight.dim() >= 2,
          f"from_deepseek_fp8: weight must be float8_e4m3fn [..., N, K], got {weight.dtype} "
          f"{tuple(weight.shape)}")
    bn, bk = block
    n, k = weight.shape[-2:]
    want = tuple(weight.shape[:-2]) + (-(-n // bn), -(-k // bk))
    _need(tuple(weight_scale_inv.shape) == want,
          f"from_deepseek_fp8: weight_scale_inv shape {tuple(weight_scale_inv.shape)} does not "
          f"match weight {tuple(weight.shape)} with block {block}; expected {want}")
    # e8m0 -> float32 is exact (powers of two); bf16/f32 -> f32 too.
    scales = weight_scale_inv.float()
    return QuantizedTensor(weight, scales, None, "fp8_block", tuple(weight.shape), (bn, bk))


def to_deepseek_fp8(qt: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight float8_e4m3fn [..., N, K], weight_scale_inv float32 [..., N/bn, K/bk])."""
    _need(qt.fmt == "fp8_block", f"to_deepseek_fp8: needs an fp8_block tensor, got {qt.fmt}")
    return qt.data, qt.scales


# --- ModelOpt NVFP4 (spec §5.2) -------------------------------------------------------------

def from_modelopt_nvfp4(weight: torch.Tensor, weight_scale: torch.Tensor,
                        weight_scale_2: torch.Tensor) -> QuantizedTensor:
    """ModelOpt `weight` uint8 [..., N, K/2] + `weight_scale` float8_e4m3fn [..., N, K/16]
    (linear, not swizzled) + `weight_scale_2` float32 [] or [...] -> QuantizedTensor "nvfp4".

    `input_scale` is not part of the weight: it only matters for W4A4 activation
    quantization (alpha = input_scale * weight_scale_2, see nvfp4_alpha).
    """
    _need(weight.dtype == torch.uint8 and weight.dim() >= 2,
          f"from_modelopt_nvfp4: weight must be uint8 [..., N, K/2], got {weight.dtype} "
          f"{tuple(weight.shape)}")
    if weight_scale.dtype == torch.uint8:
        weight_scale = weight_scale.view(torch.float8_e4m3fn)
    want = tuple(weight.shape[:-1]) + (weight.shape[-1] // 8,)
    _need(weight_scale.dtype == torch.float8_e4m3fn and tuple(weight_scale.shape) == want,
          f"from_modelopt_nvfp4: weight_scale must be float8_e4m3fn {want}, got "
          f"{weight_scale.dtype} {tuple(weight_scale.shape)}")
    lead = tuple(weight.shape[:-2])
    gs = torch.as_tensor(weight_scale_2, dtype=torch.float32)
    _need(gs.numel() in (1, math.prod(lead)),
          f"from_modelopt_nvfp4: weight_scale_2 of shape {tuple(gs.shape)} fits neither one "
          f"scalar nor one per matrix {lead}")
    gs = gs.reshape(()).expand(lead).clone() if gs.numel() == 1 else gs.reshape(lead)
    shape = tuple(weight.shape[:-1]) + (weight.shape[-1] * 2,)
    return QuantizedTensor(weight, weight_scale, gs, "nvfp4", shape, (1, 16))


def to_modelopt_nvfp4(qt: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight uint8 [..., N, K/2], weight_scale float8_e4m3fn [..., N, K/16], weight_scale_2)."""
    _need(qt.fmt == "nvfp4", f"to_modelopt_nvfp4: needs an nvfp4 tensor, got {qt.fmt}")
    return qt.data, qt.scales, qt.global_scale


def nvfp4_alpha(input_scale: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """GEMM epilogue alpha for W4A4 NVFP4 (spec §3.4): input_scale * weight_scale_2 in FP32."""
    return input_scale.float() * weight_scale_2.float()


def stack(qts: list) -> QuantizedTensor:
    """Stack per-expert QuantizedTensors of equal format/shape into one with a new lead dim."""
    _need(len(qts) > 0, "stack: empty list")
    q0 = qts[0]
    for q in qts:
        _need(q.fmt == q0.fmt and q.logical_shape == q0.logical_shape and q.block == q0.block,
              f"stack: mismatched tensors {q0!r} vs {q!r}")
    # torch.stack has no float8 kernel on CPU; stack the bytes instead.
    def st(ts):
        if ts[0].dtype == torch.float8_e4m3fn:
            return torch.stack([t.view(torch.uint8) for t in ts]).view(torch.float8_e4m3fn)
        return torch.stack(ts)
    gs = None if q0.global_scale is None else torch.stack([q.global_scale for q in qts])
    return QuantizedTensor(st([q.data for q in qts]), st([q.scales for q in qts]), gs, q0.fmt,
                           (len(qts),) + q0.logical_shape, q0.block)


# --- 128x4 swizzled scale layout (spec §5.3) ------------------------------------------------

def swizzle_offset(r: int, c: int, cs: int) -> int:
    """Byte offset of linear scale (r, c) in the 128x4 swizzled layout with cs scale columns."""
    return ((r // 128) * (-(-cs // 4)) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)


def swizzle_scales(s: torch.Tensor) -> torch.Tensor:
    """Linear scales [..., R, Cs] -> swizzled flat [..., ceil(R/128)*128 * ceil(Cs/4)*4].

    Padding is zero; the leading dims (experts) are swizzled separately. Any 1-byte or wider
    dtype works; float8 is handled through its bytes.
    """
    fp8 = s.dtype == torch.float8_e4m3fn
    t = s.view(torch.uint8) if fp8 else s
    r, cs = t.shape[-2:]
    rp, cp = -(-r // 128) * 128, -(-cs // 4) * 4
    t = torch.nn.functional.pad(t, (0, cp - cs, 0, rp - r)) if (rp, cp) != (r, cs) else t
    lead = t.shape[:-2]
    t = t.reshape(-1, rp // 128, 4, 32, cp // 4, 4).permute(0, 1, 4, 3, 2, 5).contiguous()
    out = t.reshape(*lead, rp * cp)
    return out.view(torch.float8_e4m3fn) if fp8 else out


def unswizzle_scales(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of swizzle_scales: flat [..., Rp*Cp] -> linear [..., rows, cols]."""
    fp8 = flat.dtype == torch.float8_e4m3fn
    t = flat.view(torch.uint8) if fp8 else flat
    rp, cp = -(-rows // 128) * 128, -(-cols // 4) * 4
    _need(t.shape[-1] == rp * cp, f"unswizzle_scales: last dim {t.shape[-1]} != {rp * cp} for "
                                  f"rows={rows}, cols={cols}")
    lead = t.shape[:-1]
    t = t.reshape(-1, rp // 128, cp // 4, 32, 4, 4).permute(0, 1, 4, 3, 2, 5)
    out = t.reshape(*lead, rp, cp)[..., :rows, :cols].contiguous()
    return out.view(torch.float8_e4m3fn) if fp8 else out
