"""Block quantizers against the spec's exact test vectors (§10.2-§10.5), round trips and errors."""
import hashlib

import pytest
import torch

import fmoe.quant as Q


def hexb(t: torch.Tensor) -> str:
    if t.dtype != torch.uint8:
        t = t.view(torch.uint8)
    return t.contiguous().numpy().tobytes().hex()


V1 = [0, .25, .5, .75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, -6, -0., -.25, -.5, -.75,
      -1, -1.25, -1.5, -1.75, -2, -2.5, -3, -3.5, -4, -5, 0.1, -0.1]


@pytest.mark.parametrize("rule", ["floor", "rceil"])
def test_mxfp4_v1_v2(rule):
    x = torch.tensor([V1], dtype=torch.float32)
    q = Q.quantize_mxfp4(x, scale_rule=rule)
    assert q.scales.tolist() == [[0x7F]] and hexb(q.data) == "00212243446566f788a9aacbccedee80"
    deq = [0, 0, .5, 1, 1, 1, 1.5, 2, 2, 2, 3, 4, 4, 4, 6, -6, -0., -0., -.5, -1, -1, -1, -1.5,
           -2, -2, -2, -3, -4, -4, -4, 0, -0.]
    d = Q.dequantize(q)[0]
    assert d.tolist() == deq and torch.equal(torch.signbit(d), torch.signbit(torch.tensor(deq)))
    q2 = Q.quantize_mxfp4(x * 2.0**-7, scale_rule=rule)
    assert q2.scales.tolist() == [[0x78]] and hexb(q2.data) == hexb(q.data)


def test_mxfp4_v3_v4_v5():
    v3 = torch.tensor([[7, -6.5, 6, 5.5, 3.25, 0, 1, -1] * 4])
    q = Q.quantize_mxfp4(v3)
    assert q.scales.item() == 0x7F and hexb(q.data) == "f77705a2" * 4
    assert Q.dequantize(q)[0, :8].tolist() == [6, -6, 6, 6, 3, 0, 1, -1]  # saturation at 6·X
    q = Q.quantize_mxfp4(v3, scale_rule="rceil")
    assert q.scales.item() == 0x80 and hexb(q.data) == "d6550391" * 4
    q = Q.quantize_mxfp4(torch.zeros(1, 32))
    assert q.scales.item() == 0x00 and hexb(q.data) == "00" * 16
    v5 = torch.tensor([[((37 * k) % 113 - 56) / 32 for k in range(32)]])
    q = Q.quantize_mxfp4(v5)
    assert q.scales.item() == 0x7D and hexb(q.data) == "cf744dd7743dd7722ee7721ee7600ee6"
    q = Q.quantize_mxfp4(v5, scale_rule="rceil")
    assert q.scales.item() == 0x7E and hexb(q.data) == "ae522bb5522bb5511cc5510cc5400cc4"


@pytest.mark.parametrize("a,rule,scale,head", [
    (300.0, "floor", 0x7F, "79f938b81d587878"), (300.0, "rceil", 0x7F, "79f938b81d587878"),
    (500.0, "floor", 0x7F, "7efe38b81d587878"), (500.0, "rceil", 0x80, "78f830b015507070")])
def test_mxfp8_vectors(a, rule, scale, head):
    x = torch.tensor([[a, -a, 1, -1, 0.1, 17, 255, 256] * 4])
    q = Q.quantize_mxfp8(x, scale_rule=rule)
    assert q.scales.item() == scale and hexb(q.data[0, :8]) == head


def _nvfp4_base():
    W = torch.tensor([[((29 * k + 13 * r) % 61 - 30) / 16 for k in range(32)] for r in range(2)])
    W[1, 16:] *= 0.01
    return W


def test_nvfp4_vector_c_tie_sensitive():
    q = Q.quantize_nvfp4(_nvfp4_base())
    assert q.global_scale.view(torch.int32).item() == 0x3A36DB6E
    assert hexb(q.scales) == "7e7e7e49"
    assert hexb(q.data[0]) == "8fa7b6c6d6d5e5e4e3f270796a6b6c5d"
    assert hexb(q.data[1]) == "4d4e2e1f0f97a7c6c6d5e5e4e3f2f178"


def test_nvfp4_vector_c2_and_c3_zero_block():
    W = _nvfp4_base()
    W[0, 5] = 1.9
    q = Q.quantize_nvfp4(W)
    assert q.global_scale.view(torch.int32).item() == 0x3A394B95
    assert hexb(q.scales) == "7e7e7d49"
    assert hexb(q.data[0]) == "8fa776c6d6d5e5e4e3f270796a6b6c5d"
    assert hexb(q.data[1]) == "5e4e3e1f0f97b7c6c6d5e5e4e3f2f178"
    Z = torch.zeros(1, 32)
    Z[0, :16] = torch.linspace(-1, 1, 16)
    q = Q.quantize_nvfp4(Z)
    assert q.scales.view(torch.uint8)[0, 1].item() == 0x38 and hexb(q.data[0, 8:]) == "00" * 8
    assert Q.dequantize(q)[0, 16:].abs().max() == 0


def _deepseek_weight():
    i = torch.arange(256)[:, None]
    j = torch.arange(128)[None, :]
    return ((((7 * i + 3 * j) % 97) - 48).float() / 64) * torch.where(i < 128, 1.0, 0.003)


def test_fp8_block_deepseek_vector():
    W = _deepseek_weight()
    q = Q.quantize_fp8_block(W)
    assert q.scales.flatten().view(torch.int32).tolist() == [0x3ADB6DB7, 0x36A88569]
    assert hashlib.sha256(bytes.fromhex(hexb(q.data))).hexdigest()[:16] == "e863935b8c961b52"
    assert hexb(q.data[0, :16]) == "fefdfcfbfafaf9f8f6f4f2f1eeeae6de"
    assert hexb(q.data[128, :16]) == "f7f5f3f1efece8e1d15964696d707274"
    err = (Q.dequantize(q) - W).abs().max().item()
    assert abs(err - 0.0267857) < 1e-6


@pytest.mark.parametrize("fmt,scales,digest,head", [
    ("fp32", [0.007254464086145163, 0.1160714253783226] * 2, "fb01db266b39b779",
     "fefbf9f4edd96972777a7dfdfaf7f2e9"),
    ("ue8m0", [0.0078125, 0.125] * 2, "0351fe5ee73ae2ce", "fdfaf8f3ecd86871767a7cfcfaf6f1e8")])
def test_fp8_activation_tiles_vector(fmt, scales, digest, head):
    t = torch.arange(2)[:, None]
    c = torch.arange(256)[None, :]
    X = ((((11 * t + 5 * c) % 53) - 26).float() / 8) * torch.where(c >= 128, 16.0, 1.0)
    q = Q.quantize_fp8_act_tiles(X, scale_fmt=fmt)
    assert q.scales.flatten().tolist() == scales
    assert hashlib.sha256(bytes.fromhex(hexb(q.data))).hexdigest()[:16] == digest
    assert hexb(q.data[0, :16]) == head
    if fmt == "fp32":
        assert hexb(q.data[0, 128:144]) == "fcf9f5efe16571767a7cfdfbf8f3eb00"


@pytest.mark.parametrize("fmt,rel", [("mxfp4", 0.2), ("nvfp4", 0.15), ("mxfp8", 0.04),
                                     ("fp8_block", 0.04), ("fp8_row", 0.04)])
def test_round_trip_idempotent_and_error(fmt, rel):
    torch.manual_seed(0)
    w = torch.randn(2, 48, 256) * 0.02
    q = Q.quantize(w, fmt)
    d = Q.dequantize(q)
    assert d.shape == w.shape and d.dtype == torch.float32
    assert ((d - w).norm() / w.norm()).item() < rel
    # Quantizing already-quantized values is exact for the power-of-two / per-matrix schemes.
    if fmt in ("mxfp4", "mxfp8"):
        q2 = Q.quantize(d, fmt)
        assert torch.equal(q2.data.view(torch.uint8), q.data.view(torch.uint8))
        assert torch.equal(Q.dequantize(q2), d)
    assert torch.equal(Q.dequantize(q, torch.bfloat16), d.to(torch.bfloat16))


def test_statistical_rmse_mxfp4_floor_vs_rceil():
    torch.manual_seed(0)
    w = torch.randn(256, 4096) * 0.02  # quarter of the spec's §10.7 matrix, same distribution
    rmse = {r: (Q.dequantize(Q.quantize_mxfp4(w, scale_rule=r)) - w).pow(2).mean().sqrt().item()
            for r in ("floor", "rceil")}
    assert abs(rmse["floor"] - 2.281e-3) < 3e-5 and abs(rmse["rceil"] - 2.370e-3) < 3e-5


def test_saturation_and_nonfinite_errors():
    x = torch.ones(1, 32)
    x[0, 3] = float("inf")
    for fmt in ("mxfp4", "nvfp4", "mxfp8", "fp8_block", "fp8_row"):
        with pytest.raises(ValueError, match="inf or NaN"):
            Q.quantize(x, fmt)
    x[0, 3] = float("nan")
    with pytest.raises(ValueError, match="inf or NaN"):
        Q.quantize_mxfp4(x)
    # A block far beyond E4M3's range still encodes: the scale absorbs it, nothing overflows.
    big = torch.full((1, 32), 3e38)
    assert torch.allclose(Q.dequantize(Q.quantize_mxfp8(big)), big, rtol=0.07)
    # E8M0 0xFF decodes the whole block to NaN (spec §2.1).
    q = Q.quantize_mxfp4(torch.ones(1, 64))
    bad = Q.QuantizedTensor(q.data, torch.tensor([[0xFF, q.scales[0, 1]]], dtype=torch.uint8), None,
                            "mxfp4", (1, 64), (1, 32))
    d = Q.dequantize(bad)
    assert torch.isnan(d[0, :32]).all() and torch.equal(d[0, 32:], torch.ones(32))


def test_odd_shapes():
    with pytest.raises(ValueError, match=r"K = 48 .* block size 32"):
        Q.quantize_mxfp4(torch.randn(4, 48))
    with pytest.raises(ValueError, match=r"K = 40 .* block size 16"):
        Q.quantize_nvfp4(torch.randn(4, 40))
    with pytest.raises(ValueError, match=r"\[\.\.\., N, K\]"):
        Q.quantize_mxfp4(torch.randn(64))
    with pytest.raises(ValueError, match="float16"):
        Q.dequantize(Q.quantize_mxfp4(torch.randn(2, 32)), torch.float16)
    # FP8 blocks accept ragged edges (DeepSeek pads for the amax only).
    w = torch.randn(130, 200)
    q = Q.quantize_fp8_block(w)
    assert q.scales.shape == (2, 2) and q.data.shape == (130, 200)
    assert ((Q.dequantize(q) - w).abs() <= w.abs() * 2**-4 + 2e-3).all()


def test_bits_per_weight():
    w = torch.randn(8, 256, 512)
    assert Q.bits_per_weight(Q.quantize_mxfp4(w)) <= 4.25 * 1.01
    assert Q.bits_per_weight(Q.quantize_nvfp4(w)) <= 4.5 * 1.01
    assert Q.bits_per_weight(Q.quantize_mxfp4(w)) == 4.25
    assert Q.bits_per_weight(Q.quantize_fp8_block(w)) < 8.01
