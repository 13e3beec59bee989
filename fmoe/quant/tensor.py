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

FORMATS = ("mxfp4", "nvfp4", "mxfp8", "fp8_block", "fp8_row")
FP4_FORMATS = ("mxfp4", "nvfp4")


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
        from .formats import dequantize

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
