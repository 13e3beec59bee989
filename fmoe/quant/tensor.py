"""QuantizedTensor: a packed low-precision tensor as a pytree node.

Logical layout: a quantized tensor has logical shape [..., N, K]; blocks run along the last
axis K (the reduction axis, nn.Linear's "in"), so a weight is out x in like checkpoints.

Leaves (these are what torch.func transforms and torch.save see):
  data          packed elements
  scales        block scales
  global_scale  optional second-level scale (NVFP4), shape [...] (one per matrix)
Static context: fmt, shape (logical shape at construction), block, and whether a global
scale is present (None is not a leaf).

Per format (lead = the leading "..." dims):
  fmt          data                         scales                               block
  "mxfp4"      uint8 [lead, N, K/2]         uint8 E8M0 [lead, N, K/32]           (1, 32)
  "nvfp4"      uint8 [lead, N, K/2]         float8_e4m3fn [lead, N, K/16]        (1, 16)
  "mxfp8"      float8_e4m3fn [lead, N, K]   uint8 E8M0 [lead, N, K/32]           (1, 32)
  "fp8_block"  float8_e4m3fn [lead, N, K]   float32 [lead, ceil(N/bn), ceil(K/bk)]  (bn, bk)
  "fp8_row"    float8_e4m3fn [lead, N, K]   float32 [lead, N, 1]                 (1, K)

Under torch.func.vmap the leaves lose their batched dims while the static `shape` does not,
so every method derives the leading dims from `data` and only N-independent facts (K, the
format, the block) from the context.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.utils._pytree as pytree

from . import _codecs as C

FORMATS = ("mxfp4", "nvfp4", "mxfp8", "fp8_block", "fp8_row")
FP4_FORMATS = ("mxfp4", "nvfp4")
MX_BLOCK = 32
NVFP4_BLOCK = 16
_FP8 = torch.float8_e4m3fn


def _validate(qt: "QuantizedTensor") -> None:
    """Check data/scales/global_scale against the format table in the module docstring.

    Shape and dtype checks only (no values read), so it is safe under vmap and tracing: the
    leading dims are taken from ``data`` and every other leaf must agree with them. A leaf that
    is not a tensor (pytree plumbing, e.g. an in_dims tree) skips the checks.
    """
    d, s, g = qt.data, qt.scales, qt.global_scale
    if not isinstance(d, torch.Tensor) or not isinstance(s, torch.Tensor):
        if isinstance(d, (int, type(None))) and isinstance(s, (int, type(None))):
            return
        raise TypeError(f"QuantizedTensor({qt.fmt}): data and scales must be tensors, got "
                        f"{type(d).__name__} and {type(s).__name__}")
    fmt, K = qt.fmt, qt.shape[-1]
    name = f"QuantizedTensor({fmt}, shape={tuple(qt.shape)})"
    if d.dim() < 2:
        raise ValueError(f"{name}: data must be [..., N, K'], got shape {list(d.shape)}")
    lead, N = tuple(d.shape[:-2]), d.shape[-2]
    bn, bk = (tuple(qt.block) + (None, None))[:2] if isinstance(qt.block, tuple) else (None, None)
    if fmt in FP4_FORMATS or fmt == "mxfp8":
        blk = NVFP4_BLOCK if fmt == "nvfp4" else MX_BLOCK
        if (bn, bk) != (1, blk) or K % blk:
            raise ValueError(f"{name}: {fmt} needs block (1, {blk}) and K a multiple of {blk}, got block "
                             f"{qt.block} and K={K}")
        want_d = (torch.uint8, K // 2) if fmt in FP4_FORMATS else (_FP8, K)
        want_s = (_FP8 if fmt == "nvfp4" else torch.uint8, lead + (N, K // blk))
    elif fmt == "fp8_block":
        if not (isinstance(bn, int) and isinstance(bk, int) and bn >= 1 and bk >= 1):
            raise ValueError(f"{name}: fp8_block needs a block (bn, bk) of positive ints, got {qt.block}")
        want_d = (_FP8, K)
        want_s = (torch.float32, lead + (-(-N // bn), -(-K // bk)))
    else:  # fp8_row
        if (bn, bk) != (1, K):
            raise ValueError(f"{name}: fp8_row needs block (1, K) = (1, {K}), got {qt.block}")
        want_d = (_FP8, K)
        want_s = (torch.float32, lead + (N, 1))
    if d.dtype != want_d[0] or d.shape[-1] != want_d[1]:
        raise ValueError(f"{name}: data must be {want_d[0]} [..., N, {want_d[1]}], got {d.dtype} {list(d.shape)}")
    if s.dtype != want_s[0] or tuple(s.shape) != want_s[1]:
        raise ValueError(f"{name}: scales must be {want_s[0]} {list(want_s[1])} for data {list(d.shape)}, got "
                         f"{s.dtype} {list(s.shape)}")
    if fmt == "nvfp4":
        if not isinstance(g, torch.Tensor) or tuple(g.shape) != lead or not g.dtype.is_floating_point:
            got = "None" if g is None else f"{getattr(g, 'dtype', type(g).__name__)} {list(getattr(g, 'shape', []))}"
            raise ValueError(f"{name}: nvfp4 needs a floating global_scale of shape {list(lead)} (one per matrix), "
                             f"got {got}")
    elif g is not None:
        raise ValueError(f"{name}: only nvfp4 has a global_scale, got one for {fmt}")


@dataclasses.dataclass(frozen=True)
class QuantizedTensor:
    """Packed quantized tensor; see the module docstring for the per-format layout."""

    data: torch.Tensor
    scales: torch.Tensor
    global_scale: Optional[torch.Tensor]
    fmt: str
    shape: tuple
    block: tuple

    def __post_init__(self):
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown quantized format {self.fmt!r}; expected one of {FORMATS}")
        if len(self.shape) < 2:
            raise ValueError(f"QuantizedTensor needs a logical shape [..., N, K], got {self.shape}")
        _validate(self)

    # -- shape facts derived from the leaves (valid under vmap) --------------------------------
    @property
    def logical_shape(self) -> tuple:
        """Logical shape [..., N, K] as seen from the current leaves."""
        return tuple(self.data.shape[:-1]) + (self.shape[-1],)

    @property
    def ndim(self) -> int:
        return self.data.dim()

    @property
    def device(self) -> torch.device:
        return self.data.device

    def numel(self) -> int:
        n = 1
        for d in self.logical_shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        """Bytes of all leaves (packed data + scales + global scale)."""
        total = self.data.numel() * self.data.element_size()
        total += self.scales.numel() * self.scales.element_size()
        if self.global_scale is not None:
            total += self.global_scale.numel() * self.global_scale.element_size()
        return total

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self, dtype)

    def __getitem__(self, index) -> "QuantizedTensor":
        """Index the leading (non-N, non-K) dims only, e.g. w[e] selects one expert."""
        if self.ndim <= 2:
            raise IndexError("QuantizedTensor indexing selects leading dims; this one has only [N, K]")
        idx = index if isinstance(index, tuple) else (index,)
        if any(i is Ellipsis or i is None for i in idx) or len(idx) > self.ndim - 2:
            raise IndexError(f"QuantizedTensor supports int/slice indexing of the {self.ndim - 2} "
                             f"leading dims, got {index!r}")
        data = self.data[idx]
        gs = None if self.global_scale is None else self.global_scale[idx]
        shape = tuple(data.shape[:-1]) + (self.shape[-1],)
        return QuantizedTensor(data, self.scales[idx], gs, self.fmt, shape, self.block)

    def to(self, device) -> "QuantizedTensor":
        gs = None if self.global_scale is None else self.global_scale.to(device)
        return dataclasses.replace(self, data=self.data.to(device), scales=self.scales.to(device),
                                   global_scale=gs)

    def __repr__(self) -> str:
        return (f"QuantizedTensor(fmt={self.fmt!r}, shape={self.logical_shape}, block={self.block}, "
                f"device={self.device})")


# --- exact decode (lives with the type so that it never imports the quantizers) ----------------

def _blocks(x: torch.Tensor, bk: int) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // bk, bk)


def _expand_block_scales(s: torch.Tensor, bn: int, bk: int, n: int, k: int) -> torch.Tensor:
    return s.repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]


def dequantize(qt: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Exact decode of qt to a [..., N, K] tensor: products formed in FP32, then cast to dtype.

    MX formats refuse float16: e2m1 * 2^k overflows/underflows FP16 for most k (spec §7).
    """
    if not isinstance(qt, QuantizedTensor):
        raise TypeError(f"dequantize expects a QuantizedTensor, got {type(qt).__name__}")
    if dtype == torch.float16 and qt.fmt in ("mxfp4", "mxfp8"):
        raise ValueError(f"{qt.fmt} is never dequantized to float16 (not exact, spec §7); "
                         f"use bfloat16 or float32")
    fmt = qt.fmt
    if fmt in FP4_FORMATS:
        vals = C.decode_e2m1(C.unpack_fp4(qt.data))
    else:
        vals = C.decode_e4m3(qt.data)
    k = qt.shape[-1]
    if fmt in ("mxfp4", "mxfp8"):
        out = _blocks(vals, MX_BLOCK) * C.decode_e8m0(qt.scales).unsqueeze(-1)
    elif fmt == "nvfp4":
        out = _blocks(vals, NVFP4_BLOCK) * C.decode_e4m3(qt.scales).unsqueeze(-1)
        out = out * qt.global_scale.float()[..., None, None, None]
    elif fmt == "fp8_row":
        out = vals * qt.scales.float()
    else:  # fp8_block
        bn, bk = qt.block
        out = vals * _expand_block_scales(qt.scales.float(), bn, bk, vals.shape[-2], k)
    return out.reshape(*vals.shape[:-1], k).to(dtype)


def bits_per_weight(qt: QuantizedTensor) -> float:
    """Storage bits per logical element, counting packed data, block scales and global scale."""
    return 8.0 * qt.nbytes / qt.numel()


def is_quantized(obj) -> bool:
    """True if obj is a QuantizedTensor."""
    return isinstance(obj, QuantizedTensor)


def _flatten(qt: QuantizedTensor):
    # An absent global scale is left out of the leaves (vmap rejects None leaves with in_dims=0);
    # its absence is recorded in the static context instead.
    has_gs = qt.global_scale is not None
    children = [qt.data, qt.scales] + ([qt.global_scale] if has_gs else [])
    return children, (qt.fmt, qt.shape, qt.block, has_gs)


def _unflatten(children, context) -> QuantizedTensor:
    fmt, shape, block, has_gs = context
    children = list(children)
    gs = children[2] if has_gs else None
    return QuantizedTensor(children[0], children[1], gs, fmt, shape, block)


def _flatten_with_keys(qt: QuantizedTensor):
    children, ctx = _flatten(qt)
    names = ("data", "scales", "global_scale")
    return [(pytree.GetAttrKey(n), c) for n, c in zip(names, children)], ctx


pytree.register_pytree_node(
    QuantizedTensor,
    _flatten,
    _unflatten,
    serialized_type_name="fmoe.quant.QuantizedTensor",
    flatten_with_keys_fn=_flatten_with_keys,
)

# Lets torch.load(..., weights_only=True) rebuild QuantizedTensor objects.
torch.serialization.add_safe_globals([QuantizedTensor])
