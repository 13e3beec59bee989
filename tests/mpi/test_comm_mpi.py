"""MPIComm and TorchDistComm collectives, and the differentiable all-to-all under torch.func / compile."""
from __future__ import annotations

import pytest
import torch

import fmoe
from fmoe.comm import Hierarchical2DComm, all_gather, all_to_all, all_to_all_v, reduce_scatter
from _helpers import allclose, full_params, init_gloo, local_batch, local_params, make_spec


def _expected_a2a(make, W, rank, concat, split):
    """What rank ``rank`` must receive, built from every rank's input."""
    outs = []
    for u in range(W):
        chunks = make(u).chunk(W, dim=split)
        outs.append(chunks[rank])
    return torch.cat(outs, dim=concat)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.int64])
def test_all_to_all_layouts_and_dtypes(comm, dtype):
    W, r = comm.size, comm.rank
    make = lambda u: (torch.arange(W * 2 * 3 * W, dtype=torch.float64).reshape(W * 2, 3, W) * (u + 1)).to(dtype)
    for concat, split in [(0, 0), (1, 0), (0, 2), (2, 0), (1, 2)]:
        got = comm.all_to_all(make(r), concat, split)
        assert torch.equal(got, _expected_a2a(make, W, r, concat, split)), (concat, split)


def test_reduce_gather_split_v(comm):
    W, r = comm.size, comm.rank
    assert comm.all_reduce(torch.tensor([r + 1.0]), "sum").item() == W * (W + 1) / 2
    assert comm.all_reduce(torch.tensor([r], dtype=torch.bfloat16), "max").item() == W - 1
    assert comm.all_reduce(torch.tensor([r + 5]), "min").item() == 5
    assert comm.all_gather(torch.tensor([[r]]), 1).tolist() == [list(range(W))]
    sub = comm.split(r % 2)
    assert sub.size == len(range(r % 2, W, 2)) and sub.rank == r // 2
    send = [r + 1] * W
    recv = [u + 1 for u in range(W)]
    got = comm.all_to_all_v(torch.full((sum(send), 2), float(r)), send, recv)
    assert got[:, 0].tolist() == sum([[float(u)] * (u + 1) for u in range(W)], [])
    assert comm.all_to_all_v(torch.zeros(0, 3), [0] * W, [0] * W).shape == (0, 3)


def test_2dh_equals_flat_bit_for_bit(comm):
    W = comm.size
    x = torch.randn(W * 3, 5 * W, 2, generator=torch.Generator().manual_seed(comm.rank), dtype=torch.float32)
    for L in [q for q in range(1, W + 1) if W % q == 0]:
        h = Hierarchical2DComm(comm, L)
        for concat, split in [(1, 0), (0, 1), (0, 0)]:
            assert torch.equal(h.all_to_all(x, concat, split), comm.all_to_all(x, concat, split)), (L, concat, split)


def test_grad_vmap_jvp_of_all_to_all(comm):
    W = comm.size
    D = torch.randn(W * 2, 3, 4, generator=torch.Generator().manual_seed(comm.rank), dtype=torch.float64)
    w = torch.arange(4.0, dtype=torch.float64)
    g = torch.func.grad(lambda d: (all_to_all(d, comm, 1, 0) ** 2 * w).sum())(D)
    allclose(g, 2 * D * w, "grad of a2a")
    Y = comm.all_to_all(D, 1, 0)
    vb = torch.func.vmap(lambda d: all_to_all(d, comm, 1, 0))(torch.stack([D, 2 * D, 3 * D]))
    assert torch.equal(vb[2], 3 * Y)
    _, t = torch.func.jvp(lambda d: all_to_all(d, comm, 1, 0), (D,), (D,))
    assert torch.equal(t, Y)
    # all_gather <-> reduce_scatter and all_to_all_v are each other's adjoints
    x = D[:2].clone().requires_grad_(True)
    (all_gather(x, comm, 0) * torch.arange(W * 2.0).view(-1, 1, 1)).sum().backward()
    allclose(x.grad, W * torch.arange(comm.rank * 2.0, comm.rank * 2.0 + 2).view(-1, 1, 1).expand_as(x), "ag grad")
    rs = reduce_scatter(torch.ones(W, 3, dtype=torch.float64), comm, 0)
    allclose(rs, torch.full((1, 3), float(W), dtype=torch.float64), "reduce_scatter")
    rows = torch.randn(W, 2, dtype=torch.float64, requires_grad=True)
    out = all_to_all_v(rows, comm, [1] * W, [1] * W)
    out.sum().backward()
    allclose(rows.grad, torch.ones_like(rows), "a2a_v grad")


def test_func_grad_of_moe_matches_distributed_finite_differences(comm):
    """Directional derivative of L = sum over ranks of loss_r against central differences."""
    E = comm.size
    spec = make_spec(E, 2, 1.0, fp32_gate=False)  # float64 end to end, or differences are fp32 noise
    local = local_params(spec, full_params(spec), comm)["experts"]
    gate = full_params(spec)["gate"]
    x = local_batch(comm.rank)
    cot = torch.randn(x.shape[0], spec.model_dim, generator=torch.Generator().manual_seed(comm.rank + 3),
                      dtype=torch.float64)

    def loss(experts, x):
        y, _ = fmoe.moe({"gate": gate, "experts": experts}, x, spec, comm=comm)
        return (y * cot).sum()

    gp, gx = torch.func.grad(loss, argnums=(0, 1))(local, x)
    gen = torch.Generator().manual_seed(50 + comm.rank)
    v = {k: torch.randn(t.shape, generator=gen, dtype=torch.float64) for k, t in local.items()}
    vx = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    eps = 1e-6

    def total(sign):
        p = {k: local[k] + sign * eps * v[k] for k in local}
        return comm.all_reduce(loss(p, x + sign * eps * vx).detach().reshape(1), "sum").item()

    fd = (total(1) - total(-1)) / (2 * eps)
    mine = sum((gp[k] * v[k]).sum() for k in local) + (gx * vx).sum()
    analytic = comm.all_reduce(mine.reshape(1), "sum").item()
    assert abs(fd - analytic) <= 1e-6 * max(1.0, abs(analytic)), (fd, analytic)


def test_all_to_all_inside_torch_compile(comm):
    D = torch.randn(comm.size * 2, 3, 4, generator=torch.Generator().manual_seed(comm.rank))
    f = torch.compile(lambda d: all_to_all(d * 2, comm, 1, 0) + 1, fullgraph=True, backend="eager")
    assert torch.equal(f(D), comm.all_to_all(D * 2, 1, 0) + 1)


def test_torch_dist_gloo_matches_mpi(comm):
    from fmoe.comm import TorchDistComm
    init_gloo(comm)
    tdc = TorchDistComm()
    x = torch.randn(comm.size * 2, 3, generator=torch.Generator().manual_seed(comm.rank))
    assert torch.equal(tdc.all_to_all(x, 1, 0), comm.all_to_all(x, 1, 0))
    assert torch.equal(tdc.all_gather(x, 1), comm.all_gather(x, 1))
    assert torch.equal(tdc.all_reduce(x, "max"), comm.all_reduce(x, "max"))
    send = [comm.rank + 1] * comm.size
    recv = [u + 1 for u in range(comm.size)]
    rows = torch.full((sum(send), 2), float(comm.rank))
    assert torch.equal(tdc.all_to_all_v(rows, send, recv), comm.all_to_all_v(rows, send, recv))
    sub = tdc.split(comm.rank % 2)
    assert sub.size == len(range(comm.rank % 2, comm.size, 2))
    # the MoE layer over gloo equals the MoE layer over MPI
    spec = make_spec(comm.size, 2, 0.0)
    p = local_params(spec, full_params(spec), comm)
    xb = local_batch(comm.rank)
    assert torch.equal(fmoe.moe(p, xb, spec, comm=tdc)[0], fmoe.moe(p, xb, spec, comm=comm)[0])
