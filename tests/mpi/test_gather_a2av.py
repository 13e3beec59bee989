"""The gathered all-to-all-v: rows sent from where they lie in x (MPIComm.gather_all_to_all_v, one
indexed MPI datatype per peer), and the expert-parallel exchange built on it (no dispatch buffer).

Checked: the bytes equal ``all_to_all_v(x.index_select(0, rows))`` for several dtypes and row shapes,
uneven and empty counts, repeated and unordered rows; a bad ``rows`` raises on every rank; the
torch op's fallback for a communicator without the method (TorchDistComm over gloo) gives the same
rows; and the exchange's gradient equals the dispatch-then-exchange path's bit for bit.
"""
from __future__ import annotations

import pytest
import torch

from fmoe.comm import all_to_all_v
from fmoe.comm.registry import handle_of
from fmoe.ops import combine_raw, dispatch_raw
from mpi_backend import MPIComm
from _helpers import init_gloo, ragged_send


def _case(comm, dtype, tail, seed):
    """(x [T, *tail], rows, send, recv): uneven counts (rank r sends (r + u) % 3 rows to u, the
    rows drawn with repeats and in no order from x), a peer with none."""
    W, r = comm.size, comm.rank
    g = torch.Generator().manual_seed(seed + r)
    T = 7 + r
    x = (torch.randn(T, *tail, generator=g, dtype=torch.float64) * 100).to(dtype)
    send = [(r + u) % 3 for u in range(W)]
    recv = [(u + r) % 3 for u in range(W)]
    rows = torch.randint(0, T, (sum(send),), generator=g)
    return x, rows, send, recv


@pytest.mark.parametrize("dtype,tail", [(torch.float32, (5,)), (torch.float64, (3, 2)), (torch.bfloat16, (4,)),
                                        (torch.int64, (1,))])
def test_gathered_rows_equal_the_gathered_buffer_exchanged(comm, dtype, tail):
    x, rows, send, recv = _case(comm, dtype, tail, seed=3)
    want = comm.all_to_all_v(x.index_select(0, rows), send, recv)
    assert want.shape == (sum(recv), *tail)
    # with a timeout (MPI_Ialltoallw, polled) and without (the blocking MPI_Alltoallw)
    for c in (comm, MPIComm(comm.mpi_comm)):
        assert torch.equal(c.gather_all_to_all_v(x, rows, send, recv), want), c


def test_gathered_exchange_with_no_rows_and_a_non_contiguous_x(comm):
    W = comm.size
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(comm.rank))[:, ::2]   # strided view
    assert comm.gather_all_to_all_v(x, torch.zeros(0, dtype=torch.int64), [0] * W, [0] * W).shape == (0, 4)
    rows = torch.tensor([5, 0] * W)
    got = comm.gather_all_to_all_v(x, rows, [2] * W, [2] * W)
    assert torch.equal(got, comm.all_to_all_v(x.index_select(0, rows), [2] * W, [2] * W))


@pytest.mark.parametrize("bad,match", [("range", r"rows must lie in \[0, 6\).*from 0 to 6"),
                                       ("dtype", "rows must be a contiguous int64 CPU vector")])
def test_bad_rows_raise_on_every_rank(comm, bad, match):
    """Rank 0 passes the bad rows; every rank raises it (the peers do not wait for data)."""
    W = comm.size
    x = torch.zeros(6, 2)
    rows = torch.zeros(W, dtype=torch.int64)
    if comm.rank == 0:
        rows = torch.tensor([6] + [0] * (W - 1)) if bad == "range" else rows.to(torch.int32)
    with pytest.raises(ValueError, match=match) as err:
        comm.gather_all_to_all_v(x, rows, [1] * W, [1] * W)
    assert comm.rank == 0 or "invalid arguments on rank(s) 0" in str(err.value)


def test_fallback_of_a_communicator_without_the_method(comm):
    """gloo's TorchDistComm has no gather_all_to_all_v: the torch op gathers first, same rows."""
    init_gloo(comm)
    from fmoe.comm import TorchDistComm
    gloo = TorchDistComm()
    assert not hasattr(gloo, "gather_all_to_all_v")
    x, rows, send, recv = _case(comm, torch.float32, (3,), seed=9)
    got = torch.ops.fmoe.gather_all_to_all_v(x, rows, handle_of(gloo), send, recv)
    assert torch.equal(got, comm.all_to_all_v(x.index_select(0, rows), send, recv))


def test_expert_parallel_send_equals_dispatch_then_exchange_with_gradient(comm):
    """parallel._SendRows (the rows sent from x) against dispatch then all_to_all_v over the same
    ragged positions: output and x's gradient (through the combine) bit for bit."""
    from fmoe.parallel import _SendRows
    g = torch.Generator().manual_seed(40 + comm.rank)
    T, k, M = 9, 2, 6
    pos, tokens, N, send, recv = ragged_send(comm, g, T, k)
    x = torch.randn(T, M, generator=g, dtype=torch.float32)
    cot = torch.randn(sum(recv), M, generator=g, dtype=torch.float32)

    xa = x.clone().requires_grad_(True)
    ya = _SendRows.apply(xa, pos, tokens, comm, send, recv)
    (ya * cot).sum().backward()
    xb = x.clone().requires_grad_(True)
    yb = all_to_all_v(dispatch_raw(xb, pos, None, N), comm, send, recv)
    (yb * cot).sum().backward()
    assert torch.equal(ya, yb)
    assert torch.equal(xa.grad, xb.grad)
    assert torch.equal(xa.grad, combine_raw(all_to_all_v(cot, comm, recv, send), pos, None))
    # torch.func.grad and jvp take the same op
    gf = torch.func.grad(lambda t: (_SendRows.apply(t, pos, tokens, comm, send, recv) * cot).sum())(x)
    assert torch.equal(gf, xb.grad)
    tx = torch.randn(T, M, generator=g)
    _, t_out = torch.func.jvp(lambda t: _SendRows.apply(t, pos, tokens, comm, send, recv), (x,), (tx,))
    assert torch.equal(t_out, all_to_all_v(dispatch_raw(tx, pos, None, N), comm, send, recv))


@pytest.mark.parametrize("cf", [0.0, 1.0])
def test_rows_from_x_over_2dh_and_gloo_equal_flat_mpi_bit_for_bit(comm, cf):
    """The expert-parallel step on communicators that gather first (2DH with local_size=2, a real
    two-level exchange from 4 ranks; gloo) equals MPIComm's rows-from-x exchange bit for bit, the
    output and the expert gradients; and it equals one process."""
    from fmoe.comm import TorchDistComm
    from fmoe.parallel import ParallelSpec
    from _helpers import allclose, distributed, full_params, local_batch, local_params, make_spec, reference
    init_gloo(comm)
    W = comm.size
    spec = make_spec(2 * W, 2, cf)
    full = full_params(spec)
    local = local_params(spec, full, comm)
    x = local_batch(comm.rank, T=24)
    cot = torch.randn(x.shape[0], spec.output_dim, generator=torch.Generator().manual_seed(7 + comm.rank),
                      dtype=torch.float64)
    y, g = distributed(spec, local, x, comm, ParallelSpec(), cot)
    for c, par in ((comm, ParallelSpec(local_size=2)), (TorchDistComm(), ParallelSpec())):
        y2, g2 = distributed(spec, local, x, c, par, cot)
        assert torch.equal(y2, y), (c, par)
        for k in g["experts"]:
            assert torch.equal(g2["experts"][k], g["experts"][k]), (c, par, k)
    yr, _ = reference(spec, full, x, W, ParallelSpec(), cot)
    allclose(y, yr, f"rows from x vs one process cf={cf}")
