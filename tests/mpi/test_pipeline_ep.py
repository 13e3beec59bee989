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
