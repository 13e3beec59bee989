"""Cost of the fault checks per call: the collective header and the step agreement.

    mpiexec -n 2 python benchmarks/bench_agreement.py [--iters 2000] [--json out.json]

Prints the median and the best round's microseconds per call (rank 0; on a shared, loaded machine the
best round is the closer estimate of the intrinsic cost), measured round-robin so load hits all alike:
raw mpi4py collectives (no header), MPIComm's matched collectives (header exchange + data), the
agreement check alone, and a small distributed fmoe.moe forward with and without the check.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from mpi4py import MPI

    import fmoe
    from fmoe._io import atomic_write_text
    from fmoe.comm.agreement import agree_across_ranks
    from fmoe.parallel import ParallelSpec, parallel_fields, shard_experts
    from mpi_backend import MPIComm

    world = MPI.COMM_WORLD
    comm = MPIComm(world)
    W = comm.size
    spec = fmoe.MoESpec(model_dim=64, num_experts=2 * W, gate=fmoe.GateSpec(k=2, capacity_factor=1.0),
                        experts=fmoe.ExpertSpec(type="ffn", hidden_size=64))
    full = fmoe.init_params(spec, generator=torch.Generator().manual_seed(0))
    params = {"gate": full["gate"], "experts": shard_experts("ffn", full["experts"], spec.num_experts, comm.rank, W)}
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(comm.rank))
    fields = parallel_fields(spec, ParallelSpec(), W, x.dtype, params["experts"])
    small = torch.ones(8)
    rec = torch.zeros(1, 30, dtype=torch.int64)
    out8, out_rec = small.numpy().copy(), torch.zeros(W, 30, dtype=torch.int64).numpy()
    on, off = ParallelSpec(check=True), ParallelSpec(check=False)

    cases = {
        "raw Allreduce 8 fp32": lambda: world.Allreduce(small.numpy(), out8),
        "MPIComm.all_reduce 8 fp32": lambda: comm.all_reduce(small, "sum"),
        "raw Allgather 30 int64": lambda: world.Allgather(rec.numpy(), out_rec),
        "MPIComm.all_gather 30 int64": lambda: comm.all_gather(rec, 0),
        "agree_across_ranks (moe fields)": lambda: agree_across_ranks(comm, fields),
        "moe forward T=64, check on": lambda: fmoe.moe(params, x, spec, comm=comm, parallel=on),
        "moe forward T=64, check off": lambda: fmoe.moe(params, x, spec, comm=comm, parallel=off),
    }
    times = {k: [] for k in cases}
    reps = {k: (a.iters // 20 if k.startswith("moe") else a.iters) for k in cases}
    for name, fn in cases.items():  # warm up
        for _ in range(5):
            fn()
    rounds = 10
    for _ in range(rounds):
        for name, fn in cases.items():
            n = max(reps[name] // rounds, 1)
            world.Barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            times[name].append((time.perf_counter() - t0) / n * 1e6)
    res = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    if comm.rank == 0:
        print(f"world size {W}; us per call over {rounds} rounds: median, best")
        for k in res:
            print(f"  {k:34s} {res[k]:9.1f} {best[k]:9.1f}")
        for label, a_, b_ in (("header overhead (all_reduce)", "MPIComm.all_reduce 8 fp32", "raw Allreduce 8 fp32"),
                              ("check share of a moe forward", "moe forward T=64, check on",
                               "moe forward T=64, check off")):
            print(f"  {label:34s} {res[a_] - res[b_]:9.1f} {best[a_] - best[b_]:9.1f}")
        if a.json:
            atomic_write_text(a.json, json.dumps({"world_size": W, "median_us": res, "best_us": best}, indent=1))
    comm.close()


if __name__ == "__main__":
    main()
