"""The expert-parallel dispatch exchange alone: rows sent straight from x against dispatch then exchange.

    mpiexec -n 2 python -m benchmarks.bench_ep_exchange [--rounds 60] [--tokens 2048] [--experts 32]

``from_x``: what an eager ragged expert-parallel step runs (:class:`fmoe.parallel._SendRows`: the
communicator reads each kept row where it lies in x; MPIComm with one indexed datatype per peer).
``dispatch``: the two-op path it replaced (:func:`fmoe.ops.dispatch_raw` into an [N, M] buffer,
then :func:`fmoe.comm.all_to_all_v`). Top-k routing of random logits, rows sorted by expert (a
ragged layout, nothing dropped), one torch thread per rank; the two are timed interleaved in a
shuffled order each round (the slowest rank's time) and checked equal bit for bit first. With
``--gloo`` the same over TorchDistComm (gloo), which gathers into a pooled buffer and then exchanges.
Also the placed route's exchanges (:meth:`mpi_backend.MPIComm.exchange_rows`; gloo's
:meth:`fmoe.comm.TorchDistComm.exchange_rows` gathers, exchanges and places through its buffers):
``placed``, rows from x landing in expert order (:class:`fmoe.parallel._SendPlaced`), against
``from_x``; ``back_from_sorted``, expert outputs in expert order sent back from where they lie
(:class:`fmoe.parallel._Exchange`), against ``back``, the plain exchange of source-major rows.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from fmoe import parallel as _parallel
from fmoe.comm import all_to_all_v
from fmoe.ops import dispatch_raw

from . import bench_comm


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--model_dim", type=int, default=768)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--gloo", action="store_true")
    a = ap.parse_args(argv)
    comm = bench_comm.ep_world()
    W = comm.size
    xcomm = bench_comm.gloo(comm) if a.gloo else comm
    T, E, M, k = a.tokens, a.experts, a.model_dim, a.k
    g = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(T, M, generator=g)
    ids = torch.topk(torch.randn(T, E, generator=g), k, dim=1).indices.t().reshape(-1)   # pair j * T + t
    by_expert = torch.argsort(ids, stable=True)
    N = k * T
    pos = torch.empty_like(by_expert).index_copy_(0, by_expert, torch.arange(N)).view(k, T)
    tokens = by_expert % T                                    # the token of each row
    sizes = torch.bincount(ids, minlength=E)
    send = sizes.reshape(W, E // W).sum(1)
    recv = comm.all_to_all(send, 0, 0).tolist()
    send = send.tolist()
    # where each received row goes in expert order (fmoe.parallel._ragged_expert_parallel's place)
    n = E // W
    recv_matrix = comm.all_to_all(sizes, 0, 0).reshape(W, n)
    local_id = torch.repeat_interleave(torch.arange(n).repeat(W), recv_matrix.reshape(-1))
    got_by_expert = torch.argsort(local_id, stable=True)
    place = torch.empty_like(got_by_expert).index_copy_(0, got_by_expert, torch.arange(got_by_expert.shape[0]))

    def from_x():
        return _parallel._SendRows.apply(x, pos, tokens, xcomm, send, recv)

    def dispatch():
        return all_to_all_v(dispatch_raw(x, pos, None, N), xcomm, send, recv)

    def placed():
        return _parallel._SendPlaced.apply(x, pos, tokens, place, xcomm, send, recv)

    y = from_x().clone()   # stands in for the experts' outputs (source-major), and in expert order:
    y_sorted = y.index_select(0, got_by_expert)

    def back():
        return all_to_all_v(y, xcomm, recv, send)

    def back_from_sorted():
        return _parallel._Exchange.apply(y_sorted, place, None, xcomm, recv, send)

    if not torch.equal(from_x(), dispatch()):
        raise AssertionError("the two exchanges differ")
    variants = {"from_x": from_x, "dispatch": dispatch}
    if hasattr(xcomm, "exchange_rows"):
        if not torch.equal(placed(), y_sorted) or not torch.equal(back_from_sorted(), back()):
            raise AssertionError("the placed exchanges differ")
        variants.update(placed=placed, back=back, back_from_sorted=back_from_sorted)
    times = {n: [] for n in variants}
    order = random.Random(0)
    for rnd in range(a.rounds + 1):   # round 0 warms up
        names = list(variants)
        order.shuffle(names)
        for name in names:
            comm.mpi_comm.Barrier()
            t0 = time.perf_counter()
            variants[name]()
            dt = float(comm.all_reduce(torch.tensor([time.perf_counter() - t0], dtype=torch.float64), "max"))
            if rnd:
                times[name].append(dt * 1e3)
    def ratio(a_, b_):
        return statistics.median(u / v for u, v in zip(times[a_], times[b_]))
    out = {n: {"median_ms": statistics.median(v), "min_ms": min(v)} for n, v in times.items()}
    out["from_x_over_dispatch_per_round_median"] = ratio("from_x", "dispatch")
    if "placed" in times:
        out["placed_over_from_x_per_round_median"] = ratio("placed", "from_x")
        out["back_from_sorted_over_back_per_round_median"] = ratio("back_from_sorted", "back")
    if comm.rank == 0:
        print(f"{'gloo' if a.gloo else 'MPIComm'} W={W} T={T} E={E} M={M} k={k}: " + " | ".join(
            f"{n} median {v['median_ms']:.2f} ms, min {v['min_ms']:.2f} ms" for n, v in out.items() if n in times)
              + " | per round: " + ", ".join(f"{n[:-len('_per_round_median')]} {v:.3f}" for n, v in out.items()
                                             if n.endswith("_per_round_median")))
    comm.close()
    return out


if __name__ == "__main__":
    main()
