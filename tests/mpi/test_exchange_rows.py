"""The placed all-to-all-v: rows sent from where they lie and written where they go
(MPIComm.exchange_rows, indexed MPI datatypes on both sides), and the expert-parallel exchanges
built on it (received rows in expert order, outputs and gradients sent back from that order).

Checked: the bytes equal ``all_to_all_v(x.index_select(0, rows))`` placed by ``index_copy_`` for
several dtypes and row shapes, uneven and empty counts, destinations in runs and in no order (this
rank's own rows through both of their copy paths); a bad ``place`` raises on every rank; the torch
op refuses a communicator without the method; the three autograd fronts equal the unplaced
composition bit for bit, forward, backward, under torch.func.grad and jvp; and the expert-parallel
step on the placed route equals the unplaced route (the method hidden) bit for bit, outputs and
gradients, down to the sign of zero.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

import fmoe
from fmoe.comm import all_to_all_v
from fmoe.comm.registry import handle_of
from fmoe.ops import combine_raw, dispatch_raw
from mpi_backend import MPIComm
from _helpers import init_gloo, ragged_send


def _case(comm, dtype, tail, seed, rows_kind, place_kind, own=None):
    """(x, rows, place, send, recv): rank r sends (r + u) % 3 rows to u (to itself ``own`` rows
    where given; x's rows drawn with repeats in no order, or x in order), and places the received
    rows in runs or in no order."""
    W, r = comm.size, comm.rank
    g = torch.Generator().manual_seed(seed + r)
    send = [own if own is not None and u == r else (r + u) % 3 for u in range(W)]
    recv = [own if own is not None and u == r else (u + r) % 3 for u in range(W)]
    T = sum(send) + 2 if rows_kind == "none" else 7 + r
    x = (torch.randn(T, *tail, generator=g, dtype=torch.float64) * 100).to(dtype)
    rows = None
    if rows_kind == "gather":
        rows = torch.randint(0, T, (sum(send),), generator=g)
    elif rows_kind == "none":
        x = x[:sum(send)]
    R = sum(recv)
    place = None
    if place_kind == "runs":   # blocks of consecutive rows, the blocks in no order
        starts = torch.randperm(max(1, R // 5) + 1, generator=g)
        bounds = sorted(set(torch.linspace(0, R, steps=starts.shape[0] + 1).long().tolist()))
        blocks = [torch.arange(a, b) for a, b in zip(bounds, bounds[1:])]
        order = torch.randperm(len(blocks), generator=g).tolist()
        place = torch.cat([blocks[i] for i in order]) if blocks else torch.zeros(0, dtype=torch.int64)
    elif place_kind == "shuffled":
        place = torch.randperm(R, generator=g)
    return x, rows, place, send, recv


def _want(comm, x, rows, place, send, recv):
    got = comm.all_to_all_v(x if rows is None else x.index_select(0, rows), send, recv)
    return got if place is None else torch.empty_like(got).index_copy_(0, place, got)


@pytest.mark.parametrize("dtype,tail", [(torch.float32, (5,)), (torch.float64, (3, 2)), (torch.bfloat16, (4,)),
                                        (torch.int64, (1,))])
@pytest.mark.parametrize("rows_kind", ["none", "gather"])
@pytest.mark.parametrize("place_kind", ["none", "runs", "shuffled"])
def test_placed_rows_equal_the_exchanged_buffer_placed(comm, dtype, tail, rows_kind, place_kind):
    x, rows, place, send, recv = _case(comm, dtype, tail, 3, rows_kind, place_kind)
    want = _want(comm, x, rows, place, send, recv)
    # with a timeout (MPI_Ialltoallw, polled) and without (the blocking MPI_Alltoallw); and over gloo
    # (TorchDistComm: the peers' rows gathered, exchanged asynchronously, placed from a buffer)
    for c in (comm, MPIComm(comm.mpi_comm), _gloo(comm)):
        assert torch.equal(c.exchange_rows(x, send, recv, rows=rows, place=place), want), c


@pytest.mark.parametrize("place_kind", ["runs", "shuffled"])
@pytest.mark.parametrize("rows_kind", ["none", "gather"])
def test_own_rows_in_many_runs_and_in_few(comm, place_kind, rows_kind):
    """This rank sends itself 200 rows: placed in a few runs they are gathered run by run straight
    into the result, shuffled (more runs than the cut-off, 64) gathered once and placed once; on
    MPIComm and on gloo (whose peers' rows take the same copy paths from its buffers)."""
    x, rows, place, send, recv = _case(comm, torch.float32, (3,), 11, rows_kind, place_kind, own=200)
    want = _want(comm, x, rows, place, send, recv)
    for c in (comm, _gloo(comm)):
        assert torch.equal(c.exchange_rows(x, send, recv, rows=rows, place=place), want), c


def test_gloo_rows_sent_in_runs_and_received_in_place(comm):
    """TorchDistComm's copy paths past the ones above: rows read in runs (the return trip's gather of
    the expert-order outputs), place None (received straight into the result where the peers'
    rows are one piece, through a buffer where this rank's own lie between them: 3+ ranks), and
    an empty exchange; the same bytes as MPIComm."""
    W, r = comm.size, comm.rank
    g = torch.Generator().manual_seed(21 + r)
    send = [2 + (r + u) % 3 for u in range(W)]
    recv = [2 + (u + r) % 3 for u in range(W)]
    x = torch.randn(sum(send) + 5, 4, generator=g)
    blocks = torch.randperm(sum(send) // 2 + 1, generator=g)[:len(send)]
    rows = torch.cat([torch.arange(2 * int(b), 2 * int(b) + c) % x.shape[0] for b, c in zip(blocks, send)])
    for rw, pl in ((rows, None), (None, None), (rows, torch.randperm(sum(recv), generator=g))):
        xs = x if rw is not None else x[:sum(send)]
        assert torch.equal(_gloo(comm).exchange_rows(xs, send, recv, rows=rw, place=pl),
                           comm.exchange_rows(xs, send, recv, rows=rw, place=pl))
    zero = [0] * W
    assert _gloo(comm).exchange_rows(torch.zeros(0, 3), zero, zero).shape == (0, 3)


@pytest.mark.parametrize("bad,match", [
    ("repeat", "place must send each received row to its own result row"),
    ("range", r"place must lie in \[0, 2W\)"),
    ("length", "place must hold one destination per received row"),
    ("dtype", "place must be a contiguous int64 CPU vector"),
    ("rows", r"rows must lie in \[0, 2W\)"),
    ("self", r"sends itself 2 rows but receives 3 from itself")])
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_bad_place_raises_on_every_rank(comm, bad, match, backend):
    """Rank 0 passes a bad place (or rows); every rank raises it (the peers do not wait for data), on
    MPIComm and on gloo; the communicator then still exchanges."""
    W = comm.size
    c = comm if backend == "mpi" else _gloo(comm)
    x = torch.zeros(2 * W, 2)
    place = torch.arange(2 * W)
    rows, recv = None, [2] * W
    if bad == "self" and backend == "mpi":
        pytest.skip("MPIComm sends its own rows by the send counts")
    if comm.rank == 0:
        if bad == "self":
            recv = [3, 1] + [2] * (W - 2)
        elif bad == "rows":
            rows = torch.arange(2 * W) + 1
        else:
            place = {"repeat": torch.zeros(2 * W, dtype=torch.int64), "range": place + 1,
                     "length": place[:-1].contiguous(), "dtype": place.to(torch.int32)}[bad]
    with pytest.raises(ValueError, match=match.replace("2W", str(2 * W))) as err:
        c.exchange_rows(x, [2] * W, recv, rows=rows, place=place)
    assert comm.rank == 0 or "invalid arguments on rank(s) 0" in str(err.value)
    x = torch.arange(4.0 * W).view(2 * W, 2) + comm.rank
    assert torch.equal(c.exchange_rows(x, [2] * W, [2] * W), comm.all_to_all_v(x, [2] * W, [2] * W))


def test_the_op_refuses_a_communicator_without_the_method(comm):
    from fmoe.comm import LocalComm
    with pytest.raises(TypeError, match="exchange_rows needs a communicator with an exchange_rows method"):
        torch.ops.fmoe.exchange_rows(torch.zeros(1, 2), None, None, handle_of(LocalComm()), [1], [1])


def _gloo(comm, shared_memory: bool = True, checks: str = "full"):
    """A TorchDistComm over gloo on this MPI world (on one host its all-to-alls go through shared memory)."""
    init_gloo(comm)
    from fmoe.comm import TorchDistComm
    return TorchDistComm(checks=checks, shared_memory=shared_memory)


def test_placed_fronts_equal_the_unplaced_composition_with_gradients(comm):
    """_SendPlaced (rows from x into place), _Exchange with rows (rows sent from an index) and with place
    (received rows to an index), against index ops around the plain exchange: outputs, x's
    gradient (through the layout's combine), torch.func.grad and jvp, bit for bit."""
    from fmoe.parallel import _Exchange, _SendPlaced
    g = torch.Generator().manual_seed(50 + comm.rank)
    T, k, M = 9, 2, 6
    pos, tokens, N, send, recv = ragged_send(comm, g, T, k)
    R = sum(recv)
    place = torch.randperm(R, generator=g)
    x = torch.randn(T, M, generator=g, dtype=torch.float64)
    cot = torch.randn(R, M, generator=g, dtype=torch.float64)

    def unplaced(t):
        got = all_to_all_v(dispatch_raw(t, pos, None, N), comm, send, recv)
        return torch.zeros_like(got).index_add(0, place, got)   # differentiable placement

    xa = x.clone().requires_grad_(True)
    ya = _SendPlaced.apply(xa, pos, tokens, place, comm, send, recv)
    (ya * cot).sum().backward()
    xb = x.clone().requires_grad_(True)
    yb = unplaced(xb)
    (yb * cot).sum().backward()
    assert torch.equal(ya, yb)
    assert torch.equal(xa.grad, xb.grad)
    assert torch.equal(xa.grad, combine_raw(all_to_all_v(cot.index_select(0, place), comm, recv, send), pos, None))
    gf = torch.func.grad(lambda t: (_SendPlaced.apply(t, pos, tokens, place, comm, send, recv) * cot).sum())(x)
    assert torch.equal(gf, xb.grad)
    tx = torch.randn(T, M, generator=g, dtype=torch.float64)
    _, t_out = torch.func.jvp(lambda t: _SendPlaced.apply(t, pos, tokens, place, comm, send, recv), (x,), (tx,))
    assert torch.equal(t_out, unplaced(tx))

    # the return trip: rows of y [R, O] read at place, back in each source's order; and its dual
    y = torch.randn(R, 3, generator=g, dtype=torch.float64)
    back_cot = torch.randn(N, 3, generator=g, dtype=torch.float64)
    ya = y.clone().requires_grad_(True)
    ret = _Exchange.apply(ya, place, None, comm, recv, send)
    (ret * back_cot).sum().backward()
    assert torch.equal(ret, all_to_all_v(y.index_select(0, place), comm, recv, send))
    placed = _Exchange.apply(back_cot, None, place, comm, send, recv)
    assert torch.equal(ya.grad, placed)
    assert torch.equal(placed, _want(comm, back_cot, None, place, send, recv))
    gp = torch.func.grad(lambda t: (_Exchange.apply(t, None, place, comm, send, recv) * y).sum())(back_cot)
    assert torch.equal(gp, ret.detach() * 0 + all_to_all_v(y.index_select(0, place), comm, recv, send))
    _, t_ret = torch.func.jvp(lambda t: _Exchange.apply(t, place, None, comm, recv, send), (y,), (y * 2,))
    assert torch.equal(t_ret, all_to_all_v((y * 2).index_select(0, place), comm, recv, send))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int64)


@pytest.mark.parametrize("kind", ["ffn", "gated_ffn", "gpt_oss"])
@pytest.mark.parametrize("cf", [0.0, 1.0])
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_placed_route_equals_the_unplaced_route_bit_for_bit(comm, monkeypatch, kind, cf, backend):
    """The expert-parallel training step on MPIComm's placed route (in-order plan: no gather, zero
    fill or scatter) against the same step with exchange_rows hidden (rows received source-major,
    the plan's permuted index): the output and the gradients of x, the gate and the experts
    equal to the bit, -0.0 included: each output row reaches the caller only through a sum that
    starts from +0.0 (the combine, dx's combine over the layout), where -0.0 and +0.0 add alike.
    The placed route is the one taken (the spy sees it). The same over gloo (TorchDistComm)."""
    from _helpers import full_params, local_batch, local_params, make_spec
    from fmoe.parallel import ParallelSpec
    W = comm.size
    spec = make_spec(2 * W, 2, cf, expert_type=kind)
    full = full_params(spec)
    local = local_params(spec, full, comm)
    x = local_batch(comm.rank, T=40)
    cot = torch.randn(x.shape[0], spec.output_dim, generator=torch.Generator().manual_seed(3 + comm.rank),
                      dtype=torch.float64)

    def step():
        p = {gr: {k: v.detach().clone().requires_grad_(True) for k, v in d.items()} for gr, d in local.items()}
        xs = x.clone().requires_grad_(True)
        y, _ = fmoe.moe(p, xs, spec, comm=c, parallel=ParallelSpec())
        (y * cot).sum().backward()
        return [y, xs.grad] + [v.grad for d in p.values() for v in d.values()]

    c = comm if backend == "mpi" else _gloo(comm)
    placed = []
    real = type(c).exchange_rows
    monkeypatch.setattr(type(c), "exchange_rows", lambda self, *a, **kw: placed.append(1) or real(self, *a, **kw))
    a = step()
    assert len(placed) == 4, f"the placed route ran {len(placed)} placed exchanges, not 4"
    monkeypatch.delattr(type(c), "exchange_rows")
    b = step()
    for i, (u, v) in enumerate(zip(a, b)):
        assert torch.equal(_bits(u), _bits(v)), f"{kind} cf={cf}: tensor {i} differs in its bits"


def _shm_files() -> list:
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith("fmoe-")) if os.path.isdir("/dev/shm") else []


# the shared-memory path needs a writable /dev/shm (on every rank: the ranks share this host here)
needs_shm = pytest.mark.skipif(not (os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)),
                               reason="no writable /dev/shm: TorchDistComm keeps its rows on gloo")


@needs_shm
@pytest.mark.parametrize("dtype,tail", [(torch.float32, (5,)), (torch.bfloat16, (4,)), (torch.int64, (1,))])
def test_shared_memory_moves_the_bytes_gloo_moves(comm, dtype, tail):
    """On one host TorchDistComm's exchange_rows goes through shared memory (the segments exist and
    grew) and gives gloo's bytes for every case of rows and place, own rows, a growth of the
    segment between calls, and an empty exchange; no file is left in /dev/shm."""
    from fmoe.comm import shm
    from fmoe.comm.registry import cache_of
    before = _shm_files()
    fast, tcp = _gloo(comm, True), _gloo(comm, False)
    for seed, (rows_kind, place_kind, own) in enumerate([("none", "none", None), ("gather", "shuffled", None),
                                                         ("none", "runs", 200), ("gather", "runs", 3)]):
        x, rows, place, send, recv = _case(comm, dtype, tail, 40 + seed, rows_kind, place_kind, own)
        want = tcp.exchange_rows(x, send, recv, rows=rows, place=place)
        assert torch.equal(fast.exchange_rows(x, send, recv, rows=rows, place=place), want), (seed, dtype)
    seg = cache_of(fast)[shm._KEY]
    assert isinstance(seg, shm.Segments) and seg.gen == 0   # a few rows: inside the counts all-to-all
    g = torch.Generator().manual_seed(comm.rank)
    # past INLINE_BYTES (a segment), past its 1 MiB (it grows), few again, then rank 0's rows inline
    # while the others' go through their segments
    for n_of in (lambda u: 10000, lambda u: 200000, lambda u: 400, lambda u: 10 if u == 0 else 10000):
        send = [0 if u == comm.rank else n_of(comm.rank) + u for u in range(comm.size)]
        recv = [0 if u == comm.rank else n_of(u) + comm.rank for u in range(comm.size)]
        x = (torch.randn(sum(send), *tail, generator=g, dtype=torch.float64) * 100).to(dtype)
        place = torch.randperm(sum(recv), generator=g)
        for pl in (None, place):
            assert torch.equal(fast.exchange_rows(x, send, recv, place=pl), tcp.exchange_rows(x, send, recv, place=pl))
    assert seg.gen == 2 and seg.cap >= 200000 * math.prod(tail) * x.element_size()
    assert not cache_of(tcp).get(shm._KEY)   # shared_memory=False never sets up segments
    zero = [0] * comm.size
    assert fast.exchange_rows(torch.zeros(0, 3), zero, zero).shape == (0, 3)
    assert _shm_files() == before


@needs_shm
def test_shared_memory_refuses_unpaired_counts_on_every_rank(comm):
    """Unchecked (checks="off"), rank 0 expects one row too many from rank 1: the counts exchange
    sees it and every rank raises, naming the pair; the communicator then still exchanges."""
    c = _gloo(comm, True, checks="off")
    W = comm.size
    x = torch.arange(4.0 * W).view(2 * W, 2) + comm.rank
    recv = [2] * W
    if comm.rank == 0:
        recv[1] = 3
    with pytest.raises(ValueError, match="all-to-all: rank 1 sends rank 0 2 rows but rank 0 expects 3 from it"):
        c.exchange_rows(x, [2] * W, recv)
    assert torch.equal(c.exchange_rows(x, [2] * W, [2] * W), comm.all_to_all_v(x, [2] * W, [2] * W))


@needs_shm
def test_a_rank_without_room_in_dev_shm_sends_every_rank_to_gloo(comm, monkeypatch):
    """Rank 0 cannot reserve its segment (a full /dev/shm): every rank takes the gloo path for that
    call (the same bytes), and the shared path again once rank 0 can."""
    from fmoe.comm import shm
    from fmoe.comm.registry import cache_of
    c = _gloo(comm, True)
    W, n = comm.size, 8000   # 96 KB a peer: past INLINE_BYTES, so each rank needs its segment
    x = torch.randn(n * W, 3, generator=torch.Generator().manual_seed(comm.rank))
    if comm.rank == 0:
        def full(path, nbytes):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(shm, "_reserve", full)
    assert torch.equal(c.exchange_rows(x, [n] * W, [n] * W), comm.all_to_all_v(x, [n] * W, [n] * W))
    gen = cache_of(c)[shm._KEY].gen
    monkeypatch.undo()
    assert torch.equal(c.exchange_rows(x, [n] * W, [n] * W), comm.all_to_all_v(x, [n] * W, [n] * W))
    assert (gen, cache_of(c)[shm._KEY].gen) == ((0, 1) if comm.rank == 0 else (1, 1))


def test_ranks_on_different_hosts_exchange_over_gloo(comm, monkeypatch):
    """Where one rank reports another host name the communicator makes no segments (gloo moves the rows)."""
    import socket
    from fmoe.comm import shm
    from fmoe.comm.registry import cache_of
    if comm.rank == comm.size - 1:
        monkeypatch.setattr(socket, "gethostname", lambda: "elsewhere")
    c = _gloo(comm, True)
    W = comm.size
    x = torch.randn(2 * W, 3, generator=torch.Generator().manual_seed(comm.rank))
    assert torch.equal(c.exchange_rows(x, [2] * W, [2] * W), comm.all_to_all_v(x, [2] * W, [2] * W))
    assert cache_of(c)[shm._KEY] is False


@needs_shm
def test_shared_memory_all_to_alls_move_the_bytes_gloo_moves(comm, monkeypatch):
    """all_to_all_v and all_to_all (equal chunks) through shared memory (rows inside the counts
    all-to-all, and through the segments) equal gloo's TCP path, for uneven and empty counts and
    several dtypes and axes."""
    from fmoe.comm import shm
    from fmoe.comm.registry import cache_of
    fast, tcp = _gloo(comm, True), _gloo(comm, False)
    calls = []
    real = shm.Segments.exchange
    monkeypatch.setattr(shm.Segments, "exchange", lambda self, *a: calls.append(1) or real(self, *a))
    W, r = comm.size, comm.rank
    g = torch.Generator().manual_seed(70 + r)
    for dtype, tail in ((torch.float32, (3,)), (torch.float64, (2, 2)), (torch.bfloat16, (5,))):
        send = [(r + 2 * u) % 4 for u in range(W)]
        recv = [(u + 2 * r) % 4 for u in range(W)]
        x = (torch.randn(sum(send), *tail, generator=g, dtype=torch.float64) * 10).to(dtype)
        assert torch.equal(fast.all_to_all_v(x, send, recv), tcp.all_to_all_v(x, send, recv)), dtype
        y = torch.randn(2 * W, 3, W, generator=g).to(dtype)
        assert torch.equal(fast.all_to_all(y, 0, 0), tcp.all_to_all(y, 0, 0)), dtype
        assert torch.equal(fast.all_to_all(y, 1, 2), tcp.all_to_all(y, 1, 2)), dtype
        big = torch.randn(3000 * W, 8, generator=g).to(dtype)   # 48-192 KB a peer: inline (bf16) and the segments
        assert torch.equal(fast.all_to_all(big, 0, 0), tcp.all_to_all(big, 0, 0)), dtype
        assert torch.equal(fast.all_to_all_v(big, [3000] * W, [3000] * W), tcp.all_to_all_v(big, [3000] * W, [3000] * W))
    zero = [0] * W
    assert fast.all_to_all_v(torch.zeros(0, 2), zero, zero).shape == (0, 2)
    # all_to_all takes shared memory only from PAYS_FROM_BYTES in all (its size is every rank's): the big ones
    assert len(calls) == 3 * 2 + 1 + sum(3000 * W * 8 * s >= shm.PAYS_FROM_BYTES for s in (4, 8, 2))
    assert cache_of(fast)[shm._KEY].gen >= 1


@needs_shm
def test_shared_memory_refuses_rows_of_different_sizes_on_every_rank(comm):
    """Unchecked, rank 0's rows are wider than the others': every rank raises, naming the sizes."""
    c = _gloo(comm, True, checks="off")
    W = comm.size
    x = torch.zeros(W, 3 if comm.rank == 0 else 2)
    with pytest.raises(ValueError, match=r"the ranks' rows differ in size \(bytes per row by rank: \[12, 8"):
        c.all_to_all_v(x, [1] * W, [1] * W)
