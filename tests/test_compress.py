"""Compressed all-to-all wire formats (fmoe.comm.compress), single process."""
from __future__ import annotations

import pytest
import torch

from fmoe.comm import LocalComm
from fmoe.comm import compress as CC
from fmoe.quant import formats as QF


def _x(shape=(4, 6, 160), seed=0, scale=3.0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


def test_fp8_row_wire_is_the_spec_quantizer_bit_for_bit():
    x = _x()
    x[0, 0] = 0.0  # an all-zero row: scale 1, zeros
    p = CC.encode_wire(x, "fp8")
    qt = QF.quantize_fp8_rowwise(x, amax_floor=0.0)
    assert p.dtype == torch.uint8 and p.shape == (4, 6, 164)
    assert torch.equal(p[..., :160], qt.data.view(torch.uint8))
    assert torch.equal(p[..., 160:].contiguous().view(torch.float32), qt.scales)
    y = CC.decode_wire(p, "fp8", 160)
    assert torch.equal(y, QF.dequantize(qt))
    assert torch.equal(y[0, 0], torch.zeros(160))


def test_fp8_block_wire_is_per_128_scales():
    x = _x()  # 160 = one full block + a ragged 32
    p = CC.encode_wire(x, "fp8_block")
    assert p.shape == (4, 6, 160 + 8)
    y = CC.decode_wire(p, "fp8_block", 160)
    for lo, hi in ((0, 128), (128, 160)):
        qt = QF.quantize_fp8_rowwise(x[..., lo:hi].contiguous(), amax_floor=0.0)
        assert torch.equal(y[..., lo:hi], QF.dequantize(qt))
        assert torch.equal(p[..., lo:hi], qt.data.view(torch.uint8))


def test_mxfp8_wire_is_the_spec_quantizer_bit_for_bit():
    x = _x()
    p = CC.encode_wire(x, "mxfp8")
    qt = QF.quantize_mxfp8(x)
    assert p.shape == (4, 6, 165)
    assert torch.equal(p[..., :160], qt.data.view(torch.uint8))
    assert torch.equal(p[..., 160:], qt.scales)
    assert torch.equal(CC.decode_wire(p, "mxfp8", 160), QF.dequantize(qt))


def test_bf16_and_fp32_wires():
    x = _x()
    assert torch.equal(CC.decode_wire(CC.encode_wire(x, "bf16"), "bf16", 160), x.bfloat16().float())
    assert CC.encode_wire(x, "fp32") is x
    xb = x.bfloat16()
    assert CC.decode_wire(CC.encode_wire(xb, "fp8"), "fp8", 160, torch.bfloat16).dtype == torch.bfloat16


def test_round_trip_of_decoded_values_is_exact():
    # decode(encode(.)) is idempotent: an already-representable tensor passes unchanged
    x = _x()
    for wire in ("bf16", "fp8", "fp8_block", "mxfp8"):
        once = CC.decode_wire(CC.encode_wire(x, wire), wire, 160)
        twice = CC.decode_wire(CC.encode_wire(once, wire), wire, 160)
        assert torch.equal(once, twice), wire


def test_non_finite_rows_arrive_as_nan_not_dropped():
    x = _x()
    x[1, 2, 5] = float("nan")
    x[2, 3, 140] = float("inf")
    for wire, width in (("fp8", 160), ("fp8_block", 128), ("mxfp8", 32)):  # the NaN sits in block 0
        y = CC.decode_wire(CC.encode_wire(x, wire), wire, 160)
        assert int(torch.isnan(y[1, 2]).sum()) == width, wire
        assert torch.isnan(y[2, 3, 140])
        finite = torch.ones(4, 6, dtype=torch.bool)
        finite[1, 2] = finite[2, 3] = False
        assert torch.isfinite(y[finite]).all()


def test_wire_bytes_counts_the_payload():
    for wire in CC.WIRE_FORMATS:
        x = _x((2, 8, 128))
        p = CC.encode_wire(x, wire)
        assert CC.wire_bytes(x.shape, wire) == p.numel() * p.element_size(), wire
    fp32 = CC.wire_bytes((8, 64, 128), "fp32")
    assert fp32 == 8 * 64 * 128 * 4
    assert CC.wire_bytes((8, 64, 128), "bf16") * 2 == fp32
    for wire in ("fp8", "mxfp8", "fp8_block"):
        assert fp32 / CC.wire_bytes((8, 64, 128), wire) >= 3.5, wire
    assert CC.wire_bytes((8, 64, 128), "fp32", torch.bfloat16) == fp32 // 2


def test_local_compressed_a2a_is_differentiable_with_its_own_grad_wire():
    x = _x((4, 6, 128)).requires_grad_()
    y = CC.all_to_all(x, LocalComm(), 1, 0, wire="fp8", grad_wire="mxfp8")
    assert torch.equal(y, CC.decode_wire(CC.encode_wire(x.detach(), "fp8"), "fp8", 128))
    g = _x((4, 6, 128), seed=1)
    (gx,) = torch.autograd.grad(y, x, g)
    assert torch.equal(gx, CC.decode_wire(CC.encode_wire(g, "mxfp8"), "mxfp8", 128))
    # torch.func.grad through the compressed exchange
    gf = torch.func.grad(lambda t: (CC.all_to_all(t, LocalComm(), 1, 0, wire="bf16") * g).sum())(x.detach())
    assert torch.equal(gf, g.bfloat16().float())
    yv = CC.all_to_all_v(x.reshape(24, 128), LocalComm(), [24], [24], wire="fp8_block")
    assert torch.equal(yv, CC.decode_wire(CC.encode_wire(x.detach().reshape(24, 128), "fp8_block"),
                                          "fp8_block", 128))


def test_errors_name_the_problem():
    x = _x((4, 6, 128))
    with pytest.raises(ValueError, match="unknown wire format 'fp4'"):
        CC.all_to_all(x, LocalComm(), 1, 0, wire="fp4")
    with pytest.raises(ValueError, match="must not be the last axis"):
        CC.all_to_all(x, LocalComm(), 2, 0)
    with pytest.raises(ValueError, match="multiple of 32"):
        CC.encode_wire(_x((4, 48)), "mxfp8")
    with pytest.raises(ValueError, match="expected a uint8 payload"):
        CC.decode_wire(torch.zeros(4, 10, dtype=torch.uint8), "fp8", 128)
    with pytest.raises(ValueError, match="send_counts sum to 3"):
        CC.all_to_all_v(x.reshape(24, 128), LocalComm(), [3], [3])
    with pytest.raises(ValueError, match="unknown wire format 'int8'"):
        CC.wire_from_name("int8")
    assert CC.wire_from_name("fp8_row") == "fp8"
