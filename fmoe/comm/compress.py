"""Compressed, differentiable all-to-all: the payload travels in a low-precision wire format.

The MoE dispatch / combine exchanges move [..., M] rows of activations (and, in backward,
their gradients). Here each row is encoded along its last axis M into a byte payload that
carries its own scales, sent with the ordinary uint8 all-to-all (one exchange: data and scales
of a row sit side by side), and decoded on arrival:

    wire          payload per row of M values                       bytes / row
    "fp32"        the tensor as is (no compression, x's dtype)       M * itemsize
    "bf16"        bfloat16 (RNE)                                     2 M
    "fp8"         E4M3 codes + one FP32 scale per row (per token)    M + 4
    "fp8_block"   E4M3 codes + one FP32 scale per 128 values         M + 4 ceil(M / 128)
    "mxfp8"       OCP MXFP8: E4M3 + one E8M0 byte per 32 values      M + M / 32   (M % 32 == 0)

FP8 scales come from the row (block) itself: s = amax / 448, q = E4M3(clamp(x / s, +-448)),
the pinned formula of spec/formats.md (``quantize_fp8_rowwise`` with no amax floor, so small
gradients keep their precision; an all-zero row gets s = 1). MXFP8 is ``quantize_mxfp8``
bit for bit. A row (block) holding inf or NaN is sent with a NaN scale (FP32 NaN / E8M0
0xFF) and arrives as NaN: nothing is dropped and no rank raises while the others wait.

Forward and backward pick their wire separately (``wire=``, ``grad_wire=``); the backward
of an all-to-all is the all-to-all with the axes (counts) swapped, compressed in grad_wire.
The compression is applied on one rank too (the exchange is then the identity), so a run
sees the same numerics at every world size. The split and concat axes may be any axis but
the last (the encoded one). Composes with torch.func.grad / vjp (not vmap).

:func:`wire_bytes` gives the bytes a call puts on the wire (pure, from the shape); nothing is
counted globally.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

from ..quant import _codecs as C
from ..quant import formats as QF
from . import collectives  # noqa: F401  (registers torch.ops.fmoe.all_to_all / all_to_all_v)
from .layout import norm_axis
from .registry import handle_of

__all__ = ["WIRE_FORMATS", "wire_bytes", "row_bytes", "encode_wire", "decode_wire",
           "all_to_all", "all_to_all_v", "wire_from_name"]

WIRE_FORMATS = ("fp32", "bf16", "fp8", "fp8_block", "mxfp8")
FP8_WIRE_BLOCK = 128
_WIRE_NAMES = {"fp32": "fp32", "bf16": "bf16", "fp8": "fp8", "fp8_row": "fp8", "fp8_block": "fp8_block",
               "mxfp8": "mxfp8"}


def wire_from_name(name: str) -> str:
    """CLI name ("fp32", "bf16", "fp8", "fp8_row", "fp8_block", "mxfp8") -> wire format."""
    try:
        return _WIRE_NAMES[name]
    except KeyError:
        raise ValueError(f"unknown wire format {name!r}; expected one of {tuple(_WIRE_NAMES)}") from None


def _check_wire(wire: str, m: int) -> None:
    if wire not in WIRE_FORMATS:
        raise ValueError(f"unknown wire format {wire!r}; expected one of {WIRE_FORMATS}")
    if wire == "mxfp8" and m % QF.MX_BLOCK:
        raise ValueError(f"wire 'mxfp8' needs the last dim to be a multiple of {QF.MX_BLOCK}, got {m}")


def row_bytes(m: int, wire: str, dtype: torch.dtype = torch.float32) -> int:
    """Payload bytes of one row of m values in ``wire`` (dtype: x's dtype, for "fp32")."""
    _check_wire(wire, m)
    if wire == "fp32":
        return m * torch.empty((), dtype=dtype).element_size()
    if wire == "bf16":
        return 2 * m
    if wire == "fp8":
        return m + 4
    if wire == "fp8_block":
        return m + 4 * math.ceil(m / FP8_WIRE_BLOCK)
    return m + m // QF.MX_BLOCK


def wire_bytes(shape: Sequence[int], wire: str, dtype: torch.dtype = torch.float32) -> int:
    """Bytes one all-to-all of a tensor of ``shape`` (last axis encoded) sends from one rank,
    its own slice included: rows * row_bytes(shape[-1], wire, dtype)."""
    shape = tuple(int(s) for s in shape)
    if not shape:
        raise ValueError("wire_bytes: need at least one dim")
    rows = math.prod(shape[:-1])
    return rows * row_bytes(shape[-1], wire, dtype)


# --- encode / decode -------------------------------------------------------------------------

def _fp8_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """x float [..., m] -> (E4M3 bytes uint8 [..., m], FP32 scales [..., 1]); non-finite rows
    get a NaN scale."""
    xf = x.float()
    bad = ~torch.isfinite(xf).all(dim=-1, keepdim=True)
    clean = torch.where(bad, torch.zeros_like(xf), xf)
    flat = clean.reshape(-1, 1, clean.shape[-1]) if clean.dim() == 1 else clean
    qt = QF.quantize_fp8_rowwise(flat, amax_floor=0.0)
    data = qt.data.reshape(xf.shape).view(torch.uint8)
    scales = torch.where(bad, torch.full_like(qt.scales.reshape(bad.shape), float("nan")),
                         qt.scales.reshape(bad.shape))
    return data, scales


def encode_wire(x: Tensor, wire: str) -> Tensor:
    """x float [..., M] -> payload [..., row_bytes(M, wire)] (uint8; for "fp32" x itself).

    Per row: the element bytes, then the scale bytes (little-endian FP32 or E8M0).
    """
    if not isinstance(x, Tensor) or not torch.is_floating_point(x) or x.dim() < 1:
        raise TypeError(f"encode_wire: expected a float tensor with >= 1 dim, got "
                        f"{type(x).__name__} {getattr(x, 'dtype', '')}")
    m = x.shape[-1]
    _check_wire(wire, m)
    if wire == "fp32":
        return x
    if wire == "bf16":
        return x.to(torch.bfloat16).contiguous().view(torch.uint8)
    lead = x.shape[:-1]
    if wire == "fp8":
        data, s = _fp8_rows(x)
        return torch.cat([data, s.contiguous().view(torch.uint8)], dim=-1)
    if wire == "fp8_block":
        nb = math.ceil(m / FP8_WIRE_BLOCK)
        xp = torch.nn.functional.pad(x.float(), (0, nb * FP8_WIRE_BLOCK - m))
        data, s = _fp8_rows(xp.reshape(*lead, nb, FP8_WIRE_BLOCK))
        data = data.reshape(*lead, nb * FP8_WIRE_BLOCK)[..., :m]
        return torch.cat([data, s.reshape(*lead, nb).contiguous().view(torch.uint8)], dim=-1)
    # mxfp8: zero non-finite blocks for the spec quantizer, then mark them NaN (0xFF).
    xb = x.float().reshape(*lead, m // QF.MX_BLOCK, QF.MX_BLOCK)
    bad = ~torch.isfinite(xb).all(dim=-1)
    clean = torch.where(bad.unsqueeze(-1), torch.zeros_like(xb), xb).reshape(*lead, m)
    flat = clean.reshape(-1, m) if clean.dim() == 1 else clean
    qt = QF.quantize_mxfp8(flat)
    data = qt.data.reshape(*lead, m).view(torch.uint8)
    sb = torch.where(bad, torch.full_like(bad, 255, dtype=torch.uint8), qt.scales.reshape(bad.shape))
    return torch.cat([data, sb], dim=-1)


def decode_wire(payload: Tensor, wire: str, m: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Inverse of :func:`encode_wire`: payload [..., row_bytes(m, wire)] -> dtype [..., m]
    (products formed in FP32, then cast)."""
    _check_wire(wire, m)
    if wire == "fp32":
        return payload.to(dtype)
    nbytes = row_bytes(m, wire, dtype)
    if payload.dtype != torch.uint8 or payload.shape[-1] != nbytes:
        raise ValueError(f"decode_wire: expected a uint8 payload [..., {nbytes}] for wire {wire!r} "
                         f"and m={m}, got {payload.dtype} {tuple(payload.shape)}")
    lead = payload.shape[:-1]
    p = payload.contiguous()
    if wire == "bf16":
        return p.view(torch.bfloat16).to(dtype)
    vals = C.decode_e4m3(p[..., :m].contiguous())
    tail = p[..., m:].contiguous()
    if wire == "fp8":
        return (vals * tail.view(torch.float32)).to(dtype)
    if wire == "fp8_block":
        s = tail.view(torch.float32).repeat_interleave(FP8_WIRE_BLOCK, dim=-1)[..., :m]
        return (vals * s).reshape(*lead, m).to(dtype)
    s = C.decode_e8m0(tail).repeat_interleave(QF.MX_BLOCK, dim=-1)
    return (vals * s).to(dtype)


# --- differentiable exchanges ------------------------------------------------------------------

def _roundtrip_a2a(x: Tensor, handle, size: int, concat: int, split: int, wire: str) -> Tensor:
    payload = encode_wire(x, wire)
    if size > 1:
        if wire == "fp32":
            payload = torch.ops.fmoe.all_to_all(payload, handle, concat, split)
        else:
            payload = torch.ops.fmoe.all_to_all(payload.contiguous(), handle, concat, split)
    return decode_wire(payload, wire, x.shape[-1], x.dtype)


def _roundtrip_a2av(x: Tensor, handle, size: int, send: list, recv: list, wire: str) -> Tensor:
    payload = encode_wire(x, wire)
    if size > 1:
        flat = payload.reshape(payload.shape[0], -1).contiguous()
        out = torch.ops.fmoe.all_to_all_v(flat, handle, send, recv)
        payload = out.reshape(out.shape[0], *payload.shape[1:])
    return decode_wire(payload, wire, x.shape[-1], x.dtype)


class _CompressedA2A(torch.autograd.Function):
    @staticmethod
    def forward(x, handle, size, concat, split, wire, grad_wire):
        return _roundtrip_a2a(x, handle, size, concat, split, wire)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.handle, ctx.size, ctx.concat, ctx.split, _, ctx.grad_wire = inputs

    @staticmethod
    def backward(ctx, g):
        gx = _roundtrip_a2a(g, ctx.handle, ctx.size, ctx.split, ctx.concat, ctx.grad_wire)
        return gx, None, None, None, None, None, None


class _CompressedA2AV(torch.autograd.Function):
    @staticmethod
    def forward(x, handle, size, send, recv, wire, grad_wire):
        return _roundtrip_a2av(x, handle, size, send, recv, wire)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.handle, ctx.size, ctx.send, ctx.recv, _, ctx.grad_wire = inputs

    @staticmethod
    def backward(ctx, g):
        gx = _roundtrip_a2av(g, ctx.handle, ctx.size, ctx.recv, ctx.send, ctx.grad_wire)
        return gx, None, None, None, None, None, None


def all_to_all(x: Tensor, comm, concat_axis: int, split_axis: int, *, wire: str = "fp8",
               grad_wire: str | None = None) -> Tensor:
    """:func:`fmoe.comm.all_to_all` with the payload compressed to ``wire``.

    Args:
        x: float [..., M]; ``x.shape[split_axis]`` divisible by ``comm.size``.
        comm: a Communicator (MPIComm, TorchDistComm, Hierarchical2DComm, LocalComm).
        concat_axis, split_axis: as in :func:`fmoe.comm.all_to_all`; neither may be the
            last axis (rows are encoded along it).
        wire: forward wire format (WIRE_FORMATS). grad_wire: the backward's (default: wire).
    Returns:
        x's dtype and the plain all-to-all's shape: decode(a2a(encode(x))).
    """
    grad_wire = wire if grad_wire is None else grad_wire
    if x.dim() < 2:
        raise ValueError(f"compressed all_to_all: x needs >= 2 dims (rows are encoded along the "
                         f"last), got {tuple(x.shape)}")
    a = norm_axis(concat_axis, x.dim(), "concat_axis")
    b = norm_axis(split_axis, x.dim(), "split_axis")
    if x.dim() - 1 in (a, b):
        raise ValueError(f"compressed all_to_all: concat_axis {a} and split_axis {b} must not be the "
                         f"last axis {x.dim() - 1} (the encoded one)")
    for wf in (wire, grad_wire):
        _check_wire(wf, x.shape[-1])
    if x.shape[b] % comm.size:
        raise ValueError(f"compressed all_to_all: x.shape[{b}] = {x.shape[b]} is not divisible by "
                         f"the communicator size {comm.size}")
    handle = handle_of(comm) if comm.size > 1 else 0
    return _CompressedA2A.apply(x, handle, comm.size, a, b, wire, grad_wire)


def all_to_all_v(x: Tensor, comm, send_counts: Sequence[int], recv_counts: Sequence[int], *,
                 wire: str = "fp8", grad_wire: str | None = None) -> Tensor:
    """:func:`fmoe.comm.all_to_all_v` (rows along dim 0) with the payload compressed.

    Args:
        x: float [sum(send_counts), ..., M] (>= 2 dims).
        send_counts, recv_counts: W Python ints each.
        wire, grad_wire: as in :func:`all_to_all`.
    Returns:
        [sum(recv_counts), ..., M] in x's dtype; backward swaps the counts.
    """
    grad_wire = wire if grad_wire is None else grad_wire
    send, recv = [int(c) for c in send_counts], [int(c) for c in recv_counts]
    if len(send) != comm.size or len(recv) != comm.size:
        raise ValueError(f"compressed all_to_all_v: need {comm.size} send and recv counts, got "
                         f"{len(send)} and {len(recv)}")
    if x.dim() < 2:
        raise ValueError(f"compressed all_to_all_v: x needs >= 2 dims [rows, ..., M], got {tuple(x.shape)}")
    if sum(send) != x.shape[0]:
        raise ValueError(f"compressed all_to_all_v: send_counts sum to {sum(send)} but x has "
                         f"{x.shape[0]} rows")
    if comm.size == 1 and send != recv:
        raise ValueError(f"compressed all_to_all_v: on one rank recv_counts must equal send_counts, "
                         f"got {send} and {recv}")
    for wf in (wire, grad_wire):
        _check_wire(wf, x.shape[-1])
    handle = handle_of(comm) if comm.size > 1 else 0
    return _CompressedA2AV.apply(x, handle, comm.size, send, recv, wire, grad_wire)

