"""ExpertSpec(int8_activations=True): packed FP4 experts at inference multiply int8-rounded rows.

The fused stage with int8 activations against the composition it replaces (kinds.reference over
grouped_matmul(activations="int8")): bit for bit, because both GEMMs are the same kernel call on
the same operands (the rows' int8 rounding happens inside that call) and every other step is the
float stage's (tests/test_packed_fused.py). Against float activations: within the documented
bound |W| @ (d / 2) per row of each GEMM's input, checked on GEMM 1, and the layer's relative
error. Every call the fused stage does not take raises, naming what to change.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import fmoe
from fmoe import quant as Q
from fmoe.engine import kinds
from fmoe.quant import packed

from tests.test_packed_fused import _case

vnni = pytest.mark.skipif(not packed.has_int8_path(),
                          reason="int8 activations run on an AVX-512 VNNI CPU with the packed extension built")
M, E = 128, 6


def _int8_form(case):
    form, *rest = case
    return (dataclasses.replace(form, int8=True), *rest)


def _unfused_int8(form, x, w_rows, plan, w_in, w_out, b_in, b_out, order):
    mm = lambda a, w, transposed: packed.grouped_matmul(a, w, plan.offsets, activations="int8")   # noqa: E731
    return kinds.reference(form, x, w_rows, plan, w_in, b_in, w_out, b_out, order, mm=mm)


@vnni
@pytest.mark.parametrize("typ", ["swiglu", "gpt_oss", "gated_ffn", "ffn"])
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("T,cf", [(1, 0.0), (4, 0.0), (16, 1.25)])
@pytest.mark.parametrize("dt,order", [(torch.float32, "fmoe"), (torch.bfloat16, "grouped"), (torch.bfloat16, "eager")])
def test_fused_int8_stage_equals_the_int8_composition(typ, fmt, T, cf, dt, order):
    form, x, w_rows, plan, w_in, w_out, b_in, b_out = _int8_form(_case(typ, fmt, T, cf=cf, dt=dt))
    with torch.no_grad():
        act = kinds.fused_stage(form, x, w_rows, plan, w_in, w_out, b_in, b_out)
        assert act is not None
        y = kinds.run_fused(act, form, x, w_rows, plan, w_in, w_out, b_in, b_out, order)
        ref = _unfused_int8(form, x, w_rows, plan, w_in, w_out, b_in, b_out, order)
        flt = kinds.run_fused(act, dataclasses.replace(form, int8=False), x, w_rows, plan, w_in, w_out, b_in, b_out,
                              order)
    assert torch.equal(y, ref)
    assert not torch.equal(y, flt)       # the int8 rows did run
    rel = ((y.float() - flt.float()).norm() / flt.float().norm()).item()
    assert rel < 0.05, rel               # about 1 % (BENCHMARKS.md); a wrong row or expert is O(1)


@vnni
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_int8_gemm_within_the_documented_bound(fmt):
    """GEMM 1 of the stage (read from its buffer) against float activations: |error| <= |W| @ (d / 2)
    plus the float rounding of both dot products, per row."""
    form, x, w_rows, plan, w_in, w_out, b_in, b_out = _int8_form(_case("swiglu", fmt, 16))
    act = kinds.fused_stage(form, x, w_rows, plan, w_in, w_out, b_in, b_out)
    N, H2 = plan.tokens.shape[0], w_in[0].shape[1]
    bufs = (torch.empty(N, H2), torch.empty(N, H2 // 2))
    with torch.no_grad():
        kinds.run_fused(act, form, x, w_rows, plan, w_in, w_out, b_in, b_out, "fmoe", buffers=bufs)
    a = x.index_select(0, plan.tokens)
    d = a.reshape(N, -1, 32).abs().amax(-1) / 127            # each block's int8 scale
    half = (d / 2).repeat_interleave(32, dim=1)
    o = plan.offsets
    for e in range(E):
        rows = slice(int(o[e]), int(o[e + 1]))
        if rows.start == rows.stop:
            continue
        W = Q.dequantize(w_in[0][e]).double()
        ref = a[rows].double() @ W.T
        eps = torch.finfo(torch.float32).eps
        bound = half[rows].double() @ W.abs().T + 2 * M * eps * ((a[rows].abs() + half[rows]).double() @ W.abs().T)
        assert ((bufs[0][rows].double() - ref).abs() <= bound).all()


def _layer(typ="swiglu", fmt="mxfp4", int8=True, T=4):
    spec = fmoe.MoESpec(model_dim=M, num_experts=E, gate=fmoe.GateSpec(k=2, capacity_factor=0.0),
                        experts=fmoe.ExpertSpec(type=typ, hidden_size=128, int8_activations=int8))
    p = fmoe.init_params(spec, generator=torch.Generator().manual_seed(0))
    p["experts"] = {n: Q.quantize(v, fmt) for n, v in p["experts"].items()}
    return spec, p, torch.randn(T, M, generator=torch.Generator().manual_seed(1))


@vnni
def test_moe_takes_int8_activations_where_the_spec_asks():
    spec, p, x = _layer()
    with torch.no_grad():
        y8, _ = fmoe.moe(p, x, spec)
        yf, _ = fmoe.moe(p, x, dataclasses.replace(spec, experts=dataclasses.replace(spec.experts,
                                                                                      int8_activations=False)))
    assert not torch.equal(y8, yf)
    assert ((y8 - yf).norm() / yf.norm()).item() < 0.05


def test_int8_activations_refuse_what_the_fused_stage_does_not_take():
    spec, p, x = _layer()
    if packed.has_int8_path():
        # a gradient: the gate's parameters require grad outside no_grad
        for t in p["gate"].values():
            t.requires_grad_(True)
        with pytest.raises(ValueError, match="int8_activations=True\\) runs on the fused packed inference stage only"
                                             ".*needs a gradient"):
            fmoe.moe(p, x, spec)
    # float weights
    fspec, fp, x = _layer()
    fp = fmoe.init_params(fspec, generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), pytest.raises(ValueError, match="expert weights are float tensors"):
        fmoe.moe(fp, x, fspec)
    # FP8 weights: no integer dot products
    if packed.has_int8_path():
        spec8, p8, x = _layer(fmt="fp8_block")
        with torch.no_grad(), pytest.raises(ValueError, match=r"int8 activations need MXFP4/NVFP4 weights .*fp8_block"):
            fmoe.moe(p8, x, spec8)
    else:
        with torch.no_grad(), pytest.raises(ValueError, match="AVX-512 VNNI"):
            fmoe.moe(p, x, spec)
    # vmapped calls (packed weights: a layout plan)
    with torch.no_grad(), pytest.raises(ValueError, match="this call runs on a layout plan"):
        torch.func.vmap(lambda xx: fmoe.moe(p, xx, spec)[0])(x.unsqueeze(0).expand(2, -1, -1))


def test_int8_activations_spec_checks():
    with pytest.raises(TypeError, match="int8_activations must be a bool"):
        fmoe.ExpertSpec(type="swiglu", hidden_size=8, int8_activations=1)
    with pytest.raises(ValueError, match="does not combine with"):
        fmoe.ExpertSpec(type="swiglu", hidden_size=8, int8_activations=True, precision="mxfp4")


def _gpt_oss_block(H=128, I=128):
    from fmoe.models import GptOssBlockConfig
    cfg = GptOssBlockConfig(hidden_size=H, num_experts=E, top_k=2, intermediate_size=I)
    g = torch.Generator().manual_seed(3)
    experts = {"gate_up_proj": Q.quantize(torch.randn(E, 2 * I, H, generator=g) * 0.05, "mxfp4"),
               "gate_up_proj_bias": torch.randn(E, 2 * I, generator=g) * 0.1,
               "down_proj": Q.quantize(torch.randn(E, H, I, generator=g) * 0.05, "mxfp4"),
               "down_proj_bias": torch.randn(E, H, generator=g) * 0.1}
    params = {"router": {"weight": torch.randn(E, H, generator=g), "bias": torch.randn(E, generator=g)},
              "experts": experts}
    return cfg, params, torch.randn(3, H, generator=g)


@vnni
def test_architecture_blocks_pass_int8_activations_to_the_experts():
    from fmoe.models import gpt_oss
    cfg, params, x = _gpt_oss_block()
    with torch.no_grad():
        y8, _ = gpt_oss.moe_block(params, x, cfg, int8_activations=True)
        yf, _ = gpt_oss.moe_block(params, x, cfg)
        spec8 = dataclasses.replace(gpt_oss.moe_spec(cfg), experts=dataclasses.replace(gpt_oss.moe_spec(cfg).experts,
                                                                                        int8_activations=True))
        ref, _ = fmoe.moe({"gate": {"wg": params["router"]["weight"], "bias": params["router"]["bias"]},
                           "experts": params["experts"]}, x, spec8)
    assert torch.equal(y8, ref) and not torch.equal(y8, yf)


def test_architecture_blocks_refuse_int8_activations_on_widths_they_cannot_take():
    from fmoe.models import gpt_oss
    cfg, params, x = _gpt_oss_block(H=64, I=128)
    want = (r"int8 activations need MXFP4/NVFP4 weights whose input width is a multiple of 128.*\('mxfp4', 64\)"
            if packed.has_int8_path() else "AVX-512 VNNI")
    with torch.no_grad(), pytest.raises(ValueError, match=want):
        gpt_oss.moe_block(params, x, cfg, int8_activations=True)


def test_patch_passes_int8_activations_to_every_block(tmp_path):
    from fmoe.examples import generate as G
    path = G.write_checkpoint(str(tmp_path / "gpt_oss"), "gpt_oss", "tiny")
    model, _ = G.load_patched(path, "gpt_oss", int8_activations=True)
    blocks = [m for m in model.modules() if type(m).__name__ == "FmoeMoEBlock"]
    assert blocks and all(b.int8_activations and "int8_activations=True" in b.extra_repr() for b in blocks)
    # the tiny model's hidden size (64) is no multiple of 128: the first block's call says so
    want = r"\('mxfp4', 64\)" if packed.has_int8_path() else "AVX-512 VNNI"
    with pytest.raises(ValueError, match=want):
        G.greedy(model, torch.tensor([[1, 2, 3]]), 2)
