"""Checkpoint layouts (spec §5) loaded without conversion loss, and the 128x4 swizzle (§5.3, §10.6)."""
import pytest
import torch

import fmoe.quant as Q
from fmoe.quant import _codecs as C


def test_gpt_oss_layout_b2_per_element_formula():
    g = torch.Generator().manual_seed(0)
    E, N, KB = 2, 3, 4
    blocks = torch.randint(0, 256, (E, N, KB, 16), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(100, 140, (E, N, KB), generator=g, dtype=torch.int32).to(torch.uint8)
    scales[0, 0, 0], scales[0, 1, 1], scales[1, 2, 3] = 0x00, 0xF0, 200
    q = Q.from_gpt_oss(blocks, scales)
    assert q.fmt == "mxfp4" and q.logical_shape == (E, N, KB * 32)
    d = Q.dequantize(q)
    for e in range(E):
        for n in range(N):
            for k in range(KB * 32):
                byte = blocks[e, n, k // 32, (k % 32) // 2].item()
                nib = byte & 0xF if k % 2 == 0 else byte >> 4
                want = torch.ldexp(C.E2M1_VALUES[nib].double(),
                                   torch.tensor(scales[e, n, k // 32].item() - 127.0)).float()
                assert torch.equal(d[e, n, k], want), (e, n, k)
    b2, s2 = Q.to_gpt_oss(q)
    assert torch.equal(b2, blocks) and torch.equal(s2, scales)


def test_deepseek_fp8_load_is_lossless():
    w = torch.randn(3, 256, 384)
    q = Q.quantize_fp8_block(w)
    weight, sinv = Q.to_deepseek_fp8(q)
    q2 = Q.from_deepseek_fp8(weight, sinv)
    assert torch.equal(Q.dequantize(q2), weight.float() * sinv.repeat_interleave(128, -2)
                       .repeat_interleave(128, -1))
    # ue8m0 scales stored as float8_e8m0fnu (transformers) decode exactly.
    e8 = torch.tensor([[0x7F, 0x80], [0x7E, 0x79]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    q3 = Q.from_deepseek_fp8(weight[0, :256, :256], e8)
    assert q3.scales.tolist() == [[1.0, 2.0], [0.5, 2.0**-6]]
    with pytest.raises(ValueError, match="does not match"):
        Q.from_deepseek_fp8(weight[0], sinv[0, :1])


def test_modelopt_nvfp4_load_is_lossless():
    torch.manual_seed(1)
    w = torch.randn(4, 32, 64)
    q = Q.quantize_nvfp4(w)
    weight, ws, ws2 = Q.to_modelopt_nvfp4(q)
    per_expert = [Q.from_modelopt_nvfp4(weight[e], ws[e], ws2[e]) for e in range(4)]
    stacked = Q.stack(per_expert)
    assert torch.equal(Q.dequantize(stacked), Q.dequantize(q))
    # The spec's dequant formula, written out.
    vals = C.decode_e2m1(C.unpack_fp4(weight)).view(4, 32, 4, 16)
    ref = (vals * ws.float()[..., None] * ws2[:, None, None, None]).reshape(4, 32, 64)
    assert torch.equal(Q.dequantize(q), ref)
    with pytest.raises(ValueError, match="weight_scale"):
        Q.from_modelopt_nvfp4(weight[0], ws[0, :, :2], ws2[0])
    assert Q.nvfp4_alpha(torch.tensor(0.5), ws2[0]).item() == 0.5 * ws2[0].item()


def test_swizzle_offsets_spec_10_6():
    R, Cs = 256, 8
    lin = torch.arange(R * Cs, dtype=torch.int32).reshape(R, Cs)
    sw = Q.swizzle_scales(lin)
    cases = {(0, 0): 0, (0, 1): 1, (0, 3): 3, (0, 4): 512, (1, 0): 16, (31, 0): 496, (32, 0): 4,
             (33, 0): 20, (64, 2): 10, (127, 3): 511, (128, 0): 1024, (255, 7): 2047}
    for (r, c), off in cases.items():
        assert Q.swizzle_offset(r, c, Cs) == off
        assert sw[off].item() == lin[r, c].item()
    assert torch.equal(Q.unswizzle_scales(sw, R, Cs), lin)


def test_swizzle_padding_and_experts_fp8():
    E, R, Cs = 2, 130, 5
    s = torch.randint(1, 127, (E, R, Cs), dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    sw = Q.swizzle_scales(s)
    assert sw.shape == (E, 256 * 8) and sw.dtype == torch.float8_e4m3fn
    for r, c in [(0, 0), (129, 4), (77, 3)]:
        assert sw[1, Q.swizzle_offset(r, c, Cs)].view(torch.uint8) == s[1, r, c].view(torch.uint8)
    back = Q.unswizzle_scales(sw, R, Cs)
    assert torch.equal(back.view(torch.uint8), s.view(torch.uint8))
