"""Packed expert weights on the rows plan in transformers' 'grouped' combine order (kinds.run's
reference composition over the packed GEMMs): bit for bit the layout plan's staged kernel, which
sums in that order too.

Both make the same packed GEMM calls (fmoe.quant.packed.grouped_matmul) on the same rows in
the same order, the same bias additions and the same activation; the combine multiplies each
row by its gate with torch promotion and sums a token's k terms in fp32 in slot order on
both sides, so the outputs are equal exactly, in fp32 and bf16.
"""
from __future__ import annotations

import pytest
import torch

import fmoe
from fmoe import quant as Q
from fmoe.engine import kinds, make_plan
from fmoe.experts import expert_form
from fmoe.layout import make_layout


def _case(typ: str, fmt: str, dt: torch.dtype, T: int, k: int = 3, E: int = 6):
    spec = fmoe.MoESpec(model_dim=64, num_experts=E, gate=fmoe.GateSpec(k=k, capacity_factor=0.0),
                        experts=fmoe.ExpertSpec(type=typ, hidden_size=32))
    params = fmoe.init_params(spec, generator=torch.Generator().manual_seed(0))
    ex = params["experts"]
    if typ == "gpt_oss":   # float x @ W [E, K, N] -> packed out x in [E, N, K]; biases in dt
        experts = {"gate_up_proj": Q.quantize(ex["gate_up_proj"].transpose(1, 2).contiguous(), fmt),
                   "down_proj": Q.quantize(ex["down_proj"].transpose(1, 2).contiguous(), fmt),
                   "gate_up_proj_bias": ex["gate_up_proj_bias"].to(dt), "down_proj_bias": ex["down_proj_bias"].to(dt)}
    else:                  # swiglu is out x in already
        experts = {n: Q.quantize(v, fmt) for n, v in ex.items()}
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, 64, generator=g).to(dt)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])   # [T, k], distinct per token
    w = torch.softmax(torch.randn(T, k, generator=g), -1).to(dt)
    r = fmoe.make_routing(ids.t().contiguous(), w.t().contiguous(), E, 0.0)   # [k, T]
    return spec, experts, x, r


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("typ,fmt", [("gpt_oss", "mxfp4"), ("swiglu", "nvfp4"), ("swiglu", "fp8_block")])
@pytest.mark.parametrize("T", [1, 9])
def test_packed_rows_plan_in_grouped_order_equals_the_staged_kernel(typ, fmt, dt, T):
    spec, experts, x, r = _case(typ, fmt, dt, T)
    kw = expert_form(spec.experts, experts)
    w_in, w_out, b_in, b_out = kw["w_in"], kw["w_out"], kw["b_in"], kw["b_out"]
    rows = make_plan(r, needs_grad=False, dtype=dt)
    assert kinds.packed_rows(rows, tuple(w_in), w_out) and "grouped" in kinds.rows_orders(rows, tuple(w_in), w_out)
    got = kinds.run(kw["form"], x, rows.row_weights(r.weights), rows, w_in, w_out, b_in=b_in, b_out=b_out,
                    order="grouped")
    staged = make_plan(r, needs_grad=False, dtype=dt, layout=make_layout(r, "ragged"))
    want = kinds.run(kw["form"], x, r.weights, staged, w_in, w_out, b_in=b_in, b_out=b_out, order="grouped")
    assert got.dtype == dt and torch.equal(got, want)


def test_float_rows_plan_still_refuses_the_grouped_order():
    spec, _, x, r = _case("swiglu", "mxfp4", torch.float32, 4)
    ex = fmoe.init_params(spec, generator=torch.Generator().manual_seed(0))["experts"]
    kw = expert_form(spec.experts, ex)
    rows = make_plan(r, needs_grad=False, dtype=torch.float32)
    assert not kinds.packed_rows(rows, tuple(kw["w_in"]), kw["w_out"])
    with pytest.raises(ValueError, match=r"order must be one of \('fmoe', 'eager'\) on a rows plan with float "
                                         r"weights, got 'grouped'"):
        kinds.run(kw["form"], x, rows.row_weights(r.weights), rows, kw["w_in"], kw["w_out"], order="grouped")


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_moe_with_packed_experts_in_grouped_order_equals_the_layout_plan(dt):
    # fmoe.moe's default plan and plan='layout' on packed gpt_oss experts in the 'grouped' order (the
    # order a patched transformers block follows by default): equal bit for bit, whichever door the
    # default plan takes
    import dataclasses
    spec, experts, x, _ = _case("gpt_oss", "mxfp4", dt, 5)
    spec = dataclasses.replace(spec, combine="grouped")
    gate = {k: v.to(dt) for k, v in fmoe.init_params(spec, generator=torch.Generator().manual_seed(2))["gate"].items()}
    params = {"gate": gate, "experts": experts}
    with torch.no_grad():
        y, aux = fmoe.moe(params, x, spec)
        y_layout, aux_layout = fmoe.moe(params, x, dataclasses.replace(spec, plan="layout"))
    assert torch.equal(aux.routing.expert_ids, aux_layout.routing.expert_ids)
    assert y.dtype == dt and torch.equal(y, y_layout)
