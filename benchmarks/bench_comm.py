"""Communication benchmarks (run under MPI; rank 0 prints a table and JSON).

    mpiexec -n 2 python benchmarks/bench_comm.py [--reps 30] [--json out.json]

1. all-to-all of capacity buffers [E, C, M] fp32: raw mpi4py Alltoall on
   preallocated buffers vs MPIComm.exchange(out=) on the same buffers (wrapper
   overhead) and vs MPIComm.all_to_all (fresh output each call, as moe() uses it;
   concat=1 adds the expert-side reorder copy).
2. The same exchange through MPIComm vs TorchDistComm (gloo).
3. One expert-parallel training step (forward + backward of fmoe.moe) over W
   ranks vs one rank on the same global batch, and overlap degree d = 1 vs 2.
All numbers are medians of ``--reps`` timed repetitions in this one run.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import fmoe  # noqa: E402
from fmoe.parallel import ParallelSpec, shard_experts  # noqa: E402
from mpi_backend import MPIComm  # noqa: E402


def timed(comm, fn, reps, warmup=3):
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        comm.mpi_comm.Barrier()
        t0 = time.perf_counter()
        fn()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        out.append(float(comm.all_reduce(dt, "max")))  # a collective is as slow as its slowest rank
    return statistics.median(out)


def bench_a2a(comm, tdc, reps):
    rows = []
    W = comm.size
    for M in (64, 512, 2048):
        x = torch.randn(8 * W, 64, M)
        front = x.reshape(W, -1).contiguous()
        recv = torch.empty_like(front)
        s, r = front.view(torch.uint8).numpy(), recv.view(torch.uint8).numpy()
        raw = timed(comm, lambda: comm.mpi_comm.Alltoall(s, r), reps)
        ours = timed(comm, lambda: comm.exchange(front, out=recv), reps)
        fresh = timed(comm, lambda: comm.all_to_all(x, 0, 0), reps)
        expert_side = timed(comm, lambda: comm.all_to_all(x, 1, 0), reps)
        row = {"bytes_per_rank": x.numel() * 4, "raw_mpi4py_s": raw, "mpicomm_s": ours,
               "mpicomm_fresh_out_s": fresh,
               "mpicomm_concat1_s": expert_side, "overhead": ours / raw - 1, "fresh_overhead": fresh / raw - 1}
        if tdc is not None:
            g = timed(comm, lambda: tdc.all_to_all(x, 0, 0), reps)
            row.update(gloo_s=g, gloo_over_mpi=g / fresh)
        rows.append(row)
    return rows


def bench_step(comm, reps, T=2048, M=256, H=512, E=None):
    W = comm.size
    E = E or 2 * W
    spec = fmoe.MoESpec(model_dim=M, num_experts=E, gate=fmoe.GateSpec(k=2, capacity_factor=1.0),
                        experts=fmoe.ExpertSpec(hidden_size=H))
    full = fmoe.init_params(spec, generator=torch.Generator().manual_seed(0))
    X = torch.randn(T, M, generator=torch.Generator().manual_seed(1))
    local = {"gate": full["gate"], "experts": shard_experts("ffn", full["experts"], E, comm.rank, W)}
    x = X[comm.rank * T // W:(comm.rank + 1) * T // W]

    def step(params, xs, c, par=None):
        p = {g: {k: v.detach().requires_grad_(True) for k, v in d.items()} for g, d in params.items()}
        y, aux = fmoe.moe(p, xs, spec, comm=c, parallel=par)
        y.square().mean().backward()

    res = {"tokens": T, "model_dim": M, "hidden": H, "experts": E}
    for d in (1, 2):
        res[f"ep_{W}ranks_d{d}_s"] = timed(comm, lambda: step(local, x, comm, ParallelSpec(overlap_degree=d)), reps)
    one = lambda: step(full, X, None) if comm.rank == 0 else None  # other ranks wait at the barrier
    res["one_rank_s"] = timed(comm, one, reps)
    res["speedup"] = res["one_rank_s"] / res[f"ep_{W}ranks_d1_s"]
    res["overlap_d2_over_d1"] = res[f"ep_{W}ranks_d2_s"] / res[f"ep_{W}ranks_d1_s"]
    return res


def ep_world() -> MPIComm:
    """MPIComm over COMM_WORLD for the expert-parallel benchmarks: one torch thread per rank, at
    least two ranks (else exit with how to launch)."""
    torch.set_num_threads(1)
    comm = MPIComm()
    if comm.size < 2:
        sys.exit("run under mpiexec -n 2 (or more)")
    return comm


def gloo(comm):
    import torch.distributed as dist
    from fmoe.comm import TorchDistComm
    port = torch.tensor([0])
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port[0] = s.getsockname()[1]
    port = int(comm.all_reduce(port, "max"))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size)
    return TorchDistComm()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (ranks share the cores)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    comm = MPIComm()
    if comm.size < 2:
        sys.exit("run under mpiexec -n 2 (or more)")
    from mpi4py import MPI
    out = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "ranks": comm.size,
                       "torch": torch.__version__, "mpi": MPI.Get_library_version().splitlines()[0],
                       "threads_per_rank": a.threads},
           "reps": a.reps, "all_to_all": bench_a2a(comm, gloo(comm), a.reps), "train_step": bench_step(comm, a.reps)}
    if comm.rank == 0:
        print(f"{'bytes/rank':>11} {'raw mpi4py':>11} {'exchange':>11} {'overhead':>9} {'all_to_all':>11} "
              f"{'overhead':>9} {'concat=1':>11} {'gloo':>11} {'gloo/MPI':>9}")
        for r in out["all_to_all"]:
            print(f"{r['bytes_per_rank']:>11,} {r['raw_mpi4py_s']*1e3:>9.3f}ms {r['mpicomm_s']*1e3:>9.3f}ms "
                  f"{r['overhead']*100:>8.1f}% {r['mpicomm_fresh_out_s']*1e3:>9.3f}ms {r['fresh_overhead']*100:>8.1f}% "
                  f"{r['mpicomm_concat1_s']*1e3:>9.3f}ms {r['gloo_s']*1e3:>9.3f}ms "
                  f"{r['gloo_over_mpi']:>8.2f}x")
        s = out["train_step"]
        W = comm.size
        print(f"train step T={s['tokens']} M={s['model_dim']} H={s['hidden']} E={s['experts']}: 1 rank "
              f"{s['one_rank_s']*1e3:.1f} ms, {W} ranks {s[f'ep_{W}ranks_d1_s']*1e3:.1f} ms (speedup "
              f"{s['speedup']:.2f}x), overlap d=2 {s[f'ep_{W}ranks_d2_s']*1e3:.1f} ms "
              f"({s['overlap_d2_over_d1']:.2f}x of d=1)")
        print(json.dumps(out, indent=1))
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
