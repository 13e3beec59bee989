"""Dropless paths against one process on the concatenated global batch; bad input across ranks."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils import _pytree as pytree

import fmoe
from fmoe.comm import InconsistentRanksError
from fmoe.parallel import shard_experts
from _helpers import M, allclose, full_params, local_batch, local_params, make_spec


def _global(comm, T=16):
    xs = [local_batch(u, T) for u in range(comm.size)]
    return torch.cat(xs), slice(comm.rank * T, (comm.rank + 1) * T)


@pytest.mark.parametrize("layout", ["padded", "ragged"])
@pytest.mark.parametrize("k", [1, 2])
def test_dropless_padded_and_a2av_equal_global_batch(comm, k, layout):
    """Dropless through moe(): padded (capacity = group max load, all-to-all) and ragged
    (no padding rows, all-to-all-v) equal one process on the global batch, values and grads."""
    E = 2 * comm.size
    spec = dataclasses.replace(make_spec(E, k, 0.0), layout=layout)
    full = full_params(spec)
    X, mine = _global(comm)
    ref = pytree.tree_map(lambda t: t.clone().requires_grad_(True), full)
    y_all, aux_all = fmoe.moe(ref, X, spec)
    cot_all = torch.randn(y_all.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    (y_all * cot_all).sum().backward()
    assert aux_all.dropped.item() == 0

    local = local_params(spec, full, comm)
    q = pytree.tree_map(lambda t: t.clone().requires_grad_(True), local)
    y, aux = fmoe.moe(q, X[mine], spec, comm=comm)
    allclose(y, y_all[mine].detach(), f"moe cf=0 k={k} {layout}")
    assert aux.dropped.item() == 0
    (y * cot_all[mine]).sum().backward()
    want = shard_experts("ffn", {kk: g.grad for kk, g in ref["experts"].items()}, E, comm.rank, comm.size)
    for kk in want:
        allclose(q["experts"][kk].grad, want[kk], f"{layout} grad {kk}")
    gate_sum = comm.all_reduce(q["gate"]["wg"].grad, "sum")
    allclose(gate_sum, ref["gate"]["wg"].grad, f"{layout} gate grad summed over ranks", atol=1e-5)  # fp32 gate


def test_unequal_token_counts_agree_on_capacity(comm):
    """Ragged last batch: cf > 0 capacity comes from max T over ranks, so no hang and no mismatch."""
    spec = make_spec(comm.size, 2, 1.0)
    p = local_params(spec, full_params(spec), comm)
    x = local_batch(comm.rank, T=8 + 4 * comm.rank)
    y, aux = fmoe.moe(p, x, spec, comm=comm)
    caps = comm.all_gather(torch.tensor([aux.capacity]), 0).tolist()
    assert len(set(caps)) == 1 and y.shape == x.shape


@pytest.mark.parametrize("what", ["k", "model_dim", "capacity_factor", "mode", "bad_x"])
def test_inconsistent_ranks_raise_everywhere(comm, what):
    spec = make_spec(comm.size, 2, 1.0)
    full = full_params(spec)
    parallel = fmoe.parallel.ParallelSpec()
    x = local_batch(comm.rank)
    odd = comm.rank == comm.size - 1
    if odd and what == "k":
        spec = dataclasses.replace(spec, gate=dataclasses.replace(spec.gate, k=1))
    if odd and what == "capacity_factor":
        spec = dataclasses.replace(spec, gate=dataclasses.replace(spec.gate, capacity_factor=2.0))
    if odd and what == "mode":
        parallel = fmoe.parallel.ParallelSpec(mode="adaptive:0")
    if odd and what == "model_dim":
        spec = dataclasses.replace(spec, model_dim=2 * M)
        full = full_params(spec)
        x = torch.randn(16, 2 * M, dtype=torch.float64)
    if odd and what == "bad_x":
        x = x[:, :3]
    p = local_params(spec, full, comm)
    with pytest.raises(ValueError) as err:
        fmoe.moe(p, x, spec, comm=comm, parallel=parallel)
    if what != "bad_x" or not odd:
        assert isinstance(err.value, InconsistentRanksError), err.value
    # and the communicator still works afterwards (nobody is stuck half-way)
    assert comm.all_reduce(torch.ones(1), "sum").item() == comm.size


def test_int8_activations_refuse_expert_parallel_on_every_rank(comm):
    """ExpertSpec(int8_activations=True) runs on the fused packed stage of one process: every rank
    raises the same error before any collective (no hang), and the communicator still works after."""
    spec = make_spec(comm.size, 2, 0.0)
    spec = dataclasses.replace(spec, experts=dataclasses.replace(spec.experts, int8_activations=True))
    p = local_params(spec, full_params(spec), comm)
    with torch.no_grad(), pytest.raises(ValueError, match=f"this call is expert parallel over {comm.size} ranks"):
        fmoe.moe(p, local_batch(comm.rank, 8), spec, comm=comm)
    assert comm.all_reduce(torch.ones(1), "sum").item() == comm.size
