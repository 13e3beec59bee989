"""Expert parallel through the one pipeline: every router x layout, and architecture blocks with
a finite capacity factor, equal one process (outputs and expert gradients)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import fmoe
from fmoe.parallel import ParallelSpec
from _helpers import M, allclose, distributed, full_params, local_batch, local_params, reference

ROUTERS = [fmoe.GateSpec(type="top", k=2), fmoe.GateSpec(type="cosine_top", k=2, proj_dim=4),
           fmoe.GateSpec(type="qwen", k=2), fmoe.GateSpec(type="deepseek", k=2, n_group=2, routed_scaling_factor=2.0),
           fmoe.GateSpec(type="gpt_oss", k=2), fmoe.GateSpec(type="mixtral", k=2),
           fmoe.GateSpec(type="sinkhorn", k=2), fmoe.GateSpec(type="expert_choice", k=2, capacity_factor=1.0)]


def _cases():
    for gate in ROUTERS:
        cfs = [1.0] if gate.type == "expert_choice" else [0.0, 0.5]
        for cf in cfs:
            for layout in ("padded", "ragged"):
                if gate.type == "expert_choice" and layout == "ragged":
                    continue
                yield pytest.param(gate, cf, layout, id=f"{gate.type}-cf{cf}-{layout}")


@pytest.mark.parametrize("gate,cf,layout", list(_cases()))
def test_every_router_and_layout_equals_one_process(comm, gate, cf, layout):
    E = 2 * comm.size
    spec = fmoe.MoESpec(model_dim=M, num_experts=E, gate=dataclasses.replace(gate, capacity_factor=cf),
                        experts=fmoe.ExpertSpec(hidden_size=6), layout=layout,
                        normalize_gate=gate.type != "expert_choice")
    full = full_params(spec)
    x = local_batch(comm.rank)
    cot = torch.randn(x.shape[0], M, generator=torch.Generator().manual_seed(7 + comm.rank), dtype=torch.float64)
    parallel = ParallelSpec()
    yd, gd = distributed(spec, local_params(spec, full, comm), x, comm, parallel, cot)
    yr, gr = reference(spec, full, x, comm.size, parallel, cot)
    tag = f"{gate.type} cf={cf} {layout}"
    allclose(yd, yr, f"output {tag}", atol=1e-10)
    n = E // comm.size
    for k, v in gr["experts"].items():
        summed = comm.all_reduce(v, "sum")[comm.rank * n:(comm.rank + 1) * n]
        allclose(gd["experts"][k], summed, f"grad experts.{k} {tag}", atol=1e-10)


def test_ragged_needs_whole_experts_per_rank(comm):
    spec = fmoe.MoESpec(model_dim=M, num_experts=1, gate=fmoe.GateSpec(k=1, capacity_factor=0.0),
                        experts=fmoe.ExpertSpec(hidden_size=12), layout="ragged")
    full = full_params(spec)
    with pytest.raises(ValueError, match="ragged layout needs E >= W"):
        distributed(spec, local_params(spec, full, comm), local_batch(comm.rank), comm)
    # 'auto' picks the padded layout there (the experts are shared by the ranks)
    auto = dataclasses.replace(spec, layout="auto")
    assert auto.layout_kind(comm.size) == "padded"
    yd, _ = distributed(auto, local_params(auto, full, comm), local_batch(comm.rank), comm)
    yr, _ = reference(auto, full, local_batch(comm.rank), comm.size)
    allclose(yd, yr, "auto layout with a shared expert")


@pytest.mark.parametrize("wire", ["bf16", "fp8", "mxfp8"])
@pytest.mark.parametrize("layout", ["padded", "ragged"])
def test_compressed_all_to_all_through_moe(comm, layout, wire):
    """moe() with ParallelSpec(wire=...) equals the one-process pipeline whose expert stage
    round-trips every row through the same wire format (rows are encoded independently, so
    where they travel does not change them); bytes on the wire shrink as stated."""
    from fmoe.comm import LocalComm, compress
    from fmoe.layout import make_layout
    from fmoe.parallel import expert_parallel

    E = 2 * comm.size
    spec = fmoe.MoESpec(model_dim=32, num_experts=E, gate=fmoe.GateSpec(k=2, capacity_factor=0.0 if layout == "ragged"
                                                                          else 1.0),
                        experts=fmoe.ExpertSpec(hidden_size=16), layout=layout)
    full = fmoe.init_params(spec, generator=torch.Generator().manual_seed(0))
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(50 + comm.rank))
    parallel = ParallelSpec(wire=wire)
    local = local_params(spec, full, comm)
    y, aux = fmoe.moe(local, x, spec, comm=comm, parallel=parallel)
    # one-process reference with the same routing and the same per-row wire round trip
    r = aux.routing
    lay = make_layout(r, spec.layout_kind(comm.size))
    buf = fmoe.dispatch(x, r, layout=lay)
    out = expert_parallel(spec.experts, full["experts"], buf, LocalComm(), ParallelSpec(wire=wire, check=False),
                          layout=lay, num_experts=E, output_dim=32)
    want = fmoe.combine(out, r, layout=lay)
    allclose(y, want, f"{layout} wire={wire}", atol=2e-5)
    plain, _ = fmoe.moe(local, x, spec, comm=comm)
    rel = ((y - plain).norm() / plain.norm()).item()
    assert 0 < rel < (2e-2 if wire == "bf16" else 8e-2), rel
    if wire == "fp8":
        assert compress.wire_bytes((1024, 32), "fp32") >= 3.5 * compress.wire_bytes((1024, 32), "fp8")
