"""Expert-parallel training step against one process running the same local GEMM shapes.

    mpiexec -n 2 python -m benchmarks.bench_ep [--reps 7] [--kinds ffn,swiglu] [--cfs 1.25,0] [--json out.json]
    mpiexec -n 2 python -m benchmarks.bench_ep --kinds ffn --cfs 1.25 --profile 5 [--profile_variant gloo]
    mpiexec -n 2 python -m benchmarks.bench_ep --variants mpi,gloo,func --before    # A/B of each route

Each rank holds E/W experts and receives about k*T rows; the baseline runs fmoe.moe on one
process with E/W experts and the same T tokens per rank (the same expert GEMMs, no exchange),
on every rank at once so both see the same load. Variants per (kind, capacity factor), timed
interleaved round by round (forward + backward, one torch thread per rank, the slowest rank's
time):

* ``mpi``: expert parallel over MPIComm;
* ``gloo``: expert parallel over TorchDistComm (gloo, initialised inside this job), on the same
  placed route as ``mpi`` (:meth:`fmoe.comm.TorchDistComm.exchange_rows`; the ranks share this host,
  so the rows go through shared memory, gloo carrying the synchronisation: :mod:`fmoe.comm.shm`);
* ``gloo_tcp``: the same with ``TorchDistComm(shared_memory=False)``: the rows over gloo's TCP;
* ``func``: ``mpi`` under ``torch.func.grad``, where the received rows run the eager engine
  beneath the grad level (:class:`fmoe.parallel._BelowGrad`: the placed exchanges and in-order
  plan of ``mpi``; the engine's traced op before);
* ``local``: the one-process baseline;
With ``--before``, each timed variant also runs as it ran before its route changed, interleaved
with it (an A/B within one process, round by round: the ratio of each round's pair, whose median
moves far less than either time on a shared host):

* ``mpi_before``, ``gloo_before``: ``exchange_rows`` hidden from the communicator (MPIComm,
  TorchDistComm), so the step takes the unplaced route (rows received source-major, gathered by
  the engine's kernels by a permuted index, its output zero-filled and scattered);
* ``func_before``: ``func`` with the received rows on the traced op (the engine's custom op, its
  plan built inside it, rows gathered and scattered by index) and the unplaced exchanges.

Rank 0 prints the medians and the ratios to ``local``, and the same for each variant's best round
(on a shared host the best round is the one least disturbed by other processes; a median of a
few rounds there moves by 10-20 % from run to run); with ``--json`` it writes them too.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import fmoe
from fmoe import parallel as _parallel
from fmoe.comm import TorchDistComm
from fmoe.parallel import ParallelSpec, shard_experts
from mpi_backend import MPIComm

from . import bench_comm

KINDS = ("ffn", "gated_ffn", "swiglu", "gpt_oss")


def _spec(kind: str, E: int, M: int, H: int, k: int, cf: float) -> fmoe.MoESpec:
    return fmoe.MoESpec(model_dim=M, num_experts=E, gate=fmoe.GateSpec(k=k, capacity_factor=cf),
                        experts=fmoe.ExpertSpec(type=kind, hidden_size=H))


def _func_step(params, x, spec, comm, parallel):
    def loss(p):
        return fmoe.moe(p, x, spec, comm=comm, parallel=parallel)[0].square().mean()
    torch.func.grad(loss)({g: {k: v for k, v in d.items() if v is not None} for g, d in params.items()})


def _step(params, x, spec, comm=None, parallel=None):
    p = {g: {k: v.detach().requires_grad_(True) for k, v in d.items() if v is not None}
         for g, d in params.items()}
    y, _ = fmoe.moe(p, x, spec, comm=comm, parallel=parallel)
    y.square().mean().backward()


def _before(step, cls):
    """``step`` with ``cls.exchange_rows`` hidden from :mod:`fmoe.parallel` and the eager engine kept
    from running beneath a grad level (:func:`fmoe.parallel._grad_level`): the route before."""
    def run():
        real, level = cls.exchange_rows, _parallel._grad_level
        del cls.exchange_rows
        _parallel._grad_level = lambda *a: None
        try:
            step()
        finally:
            cls.exchange_rows, _parallel._grad_level = real, level
    return run


def _profile(comm, step, n: int) -> dict:
    """``n`` profiled steps after two warm ones; rank 0 prints the ops' self CPU times per step."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(2):
        step()
    comm.mpi_comm.Barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            step()
    if comm.rank == 0:
        print(f"{n} steps; times are totals over them")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60))
    comm.close()
    return {}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--cfs", default="1.25,2.0,0")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--model_dim", type=int, default=768)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", type=int, default=0,
                    help="instead of timing: N steps of one variant (--profile_variant) under torch.profiler (first "
                         "kind and cf); rank 0 prints the ops by self CPU time")
    ap.add_argument("--profile_variant", default="mpi", choices=("mpi", "gloo", "gloo_tcp", "func", "local",
                                                                  "mpi_before", "gloo_before", "func_before"))
    ap.add_argument("--before", action="store_true", help="also time each variant's route before (see the module "
                                                           "docstring), round by round")
    ap.add_argument("--variants", default="mpi,gloo,func",
                    help="which of mpi, gloo, gloo_tcp, func to time (with local)")
    a = ap.parse_args(argv)
    comm = bench_comm.ep_world()
    W = comm.size
    gloo = bench_comm.gloo(comm)
    gloo_tcp = TorchDistComm(shared_memory=False)
    T, E, M, H, k = a.tokens, a.experts, a.model_dim, a.hidden, a.k
    x = torch.randn(T, M, generator=torch.Generator().manual_seed(1 + comm.rank))
    results = []
    for kind in a.kinds.split(","):
        for cf in (float(c) for c in a.cfs.split(",")):
            spec = _spec(kind, E, M, H, k, cf)
            full = fmoe.init_params(spec, generator=torch.Generator().manual_seed(0))
            local = {"gate": full["gate"], "experts": shard_experts(kind, full["experts"], E, comm.rank, W)}
            # the baseline: E/W experts on one process, the same tokens: the same local GEMM shapes
            one_spec = _spec(kind, E // W, M, H, k, cf)
            one = fmoe.init_params(one_spec, generator=torch.Generator().manual_seed(0))

            variants = {"mpi": lambda: _step(local, x, spec, comm, ParallelSpec()),
                        "gloo": lambda: _step(local, x, spec, gloo, ParallelSpec()),
                        "gloo_tcp": lambda: _step(local, x, spec, gloo_tcp, ParallelSpec()),
                        "func": lambda: _func_step(local, x, spec, comm, ParallelSpec()),
                        "local": lambda: _step(one, x, one_spec)}
            for n, cls in (("mpi", MPIComm), ("gloo", TorchDistComm), ("func", MPIComm)):
                variants[f"{n}_before"] = _before(variants[n], cls)
            if a.profile:
                return _profile(comm, variants[a.profile_variant], a.profile)
            timed = a.variants.split(",")
            timed += [f"{n}_before" for n in timed] if a.before else []
            variants = {n: f for n, f in variants.items() if n in timed or n == "local"}
            times = {n: [] for n in variants}
            for rep in range(a.reps + 1):   # round 0 warms up
                for name, fn in variants.items():
                    comm.mpi_comm.Barrier()
                    t0 = time.perf_counter()
                    fn()
                    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                    dt = float(comm.all_reduce(dt, "max"))
                    if rep:
                        times[name].append(dt)
            med = {n: statistics.median(v) for n, v in times.items()}
            best = {n: min(v) for n, v in times.items()}
            others = [n for n in times if n != "local"]
            row = {"kind": kind, "cf": cf, **{f"{n}_ms": v * 1e3 for n, v in med.items()},
                   **{f"{n}_over_local": med[n] / med["local"] for n in others},
                   **{f"{n}_best_ms": v * 1e3 for n, v in best.items()},
                   **{f"{n}_best_over_local": best[n] / best["local"] for n in others}}
            pairs = [n for n in times if f"{n}_before" in times]
            for n in pairs:   # paired round by round: the A/B
                row[f"{n}_over_before_per_round"] = statistics.median(
                    u / v for u, v in zip(times[n], times[f"{n}_before"]))
            results.append(row)
            if comm.rank == 0:
                print(f"{kind:9s} cf={cf:<5} local {row['local_ms']:8.1f} ms | " + " | ".join(
                    f"{n} {row[f'{n}_ms']:8.1f} ms ({row[f'{n}_over_local']:.2f}x)" for n in others)
                    + f" || best: local {row['local_best_ms']:.1f} ms, " + ", ".join(
                    f"{n} {row[f'{n}_best_over_local']:.2f}x" for n in others)
                    + "".join(f" || {n} / {n}_before per round {row[f'{n}_over_before_per_round']:.3f}"
                              for n in pairs), flush=True)
    out = {"ranks": W, "threads_per_rank": 1, "T_per_rank": T, "E": E, "M": M, "H": H, "k": k, "reps": a.reps,
           "load": os.getloadavg(), "rows": results}
    if comm.rank == 0 and a.json:
        tmp = a.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(out, f, indent=1)
        os.replace(tmp, a.json)
    comm.close()
    return out


if __name__ == "__main__":
    main()
