"""Cost of the cross-rank checks: a distributed fmoe.moe forward under each ``checks`` setting.

    mpiexec -n 2 python benchmarks/bench_agreement.py [--rounds 15] [--tokens 64,4096] [--no-gloo]
                                                     [--json out.json]

For each backend (MPIComm over mpi4py; TorchDistComm over gloo, set up over TCP inside the same
job) and each T, times ``fmoe.moe(params, x, spec, comm=c)`` (forward only, T tokens per rank,
M=H=64, E=2W, top-2, capacity factor 1) with communicators built with ``checks="off"``,
``"step"``, ``"full"`` (the default), and ``previous``: the checks as they were before the
control exchange (a separate 128-byte header all-gather before every collective's data, and the
agreement record as a matched all-gather of its own: three exchanges more than "off" per forward).
Rounds are interleaved (every case once per round, in a rotating order) so load on a shared
machine hits every case alike; prints per case the median over rounds of the mean ms per call,
and the ratio of each median to "off". A few micro cases (one small all_reduce) come last. Then rank 0
alone runs the same forwards over an in-process 2-rank emulation (``_Echo``: the peer sends what this rank
sends), which measures the checks' CPU cost with no waiting on a peer, immune to the machine's load.
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import time

import numpy as np
import torch


def _previous(base):
    """A subclass of ``base`` (MPIComm or TorchDistComm) with the checks as they were before."""
    from fmoe.comm import matching

    class Previous(base):
        _stage_agreement = None  # the agreement goes through self.all_gather: header, then the record

        def _begin(self, kind, x=None, *, op="", error=None, payload=None):
            self._calls += 1
            call = self._calls
            hdr = matching.header(kind, call, x, op=op, failed=error is not None)
            table = self._raw_gather_words(hdr)
            matching.check(table, self.rank, kind, error, self._gather_text)
            return call, None  # the data then moves as an unchecked collective, as it did after the header

    return Previous


def _mpi_words(comm):
    def gather(words):
        out = np.empty((comm.size, words.size), dtype=np.int64)
        comm.mpi_comm.Allgather(words, out)
        return out
    return gather


def _gloo_words(comm):
    import torch.distributed as dist

    def gather(words):
        out = torch.empty(comm.size * words.size, dtype=torch.int64)
        dist.all_gather_into_tensor(out, torch.from_numpy(words), group=comm.group)
        return out.reshape(comm.size, words.size).numpy()
    return gather


def _u8(buf) -> np.ndarray:
    return buf.reshape(-1).view(np.uint8) if isinstance(buf, np.ndarray) else np.asarray(memoryview(buf).cast("B"))


class _Echo:
    """An mpi4py-like 2-rank communicator inside one process: the peer sends exactly what this rank
    sends. MPIComm over it runs a whole distributed forward with no waiting, so the difference between
    the settings is their CPU cost alone (the number the shared machine's load cannot blur)."""

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 2

    def Allgather(self, s, r):
        a, b = _u8(s), _u8(r)
        b[:a.size] = a
        b[a.size:2 * a.size] = a

    def Allreduce(self, s, r, op):
        r[...] = s + s if op is _MPI.SUM else s

    def Alltoall(self, s, r):
        _u8(r)[:] = _u8(s)

    def Barrier(self):
        pass

    def Split(self, color, key):
        return self


_MPI = None


def _emulated(spec, params, xs, settings, rounds: int) -> dict:
    """{(T, setting): [us per call per round]} of moe forwards over MPIComm(_Echo()), interleaved."""
    from mpi_backend import MPIComm

    import fmoe
    comms = {s: MPIComm(_Echo(), checks=s) for s in settings if s != "previous"}
    prev = _previous(MPIComm)(_Echo())
    prev._raw_gather_words = _mpi_words(prev)
    comms["previous"] = prev
    out = {}
    for T, x in xs.items():
        for c in comms.values():
            for _ in range(5):
                fmoe.moe(params, x, spec, comm=c)
        n = 20 if T < 1024 else 2
        for _ in range(rounds):
            for s, c in comms.items():
                t0 = time.perf_counter()
                for _ in range(n):
                    fmoe.moe(params, x, spec, comm=c)
                out.setdefault((T, s), []).append((time.perf_counter() - t0) / n * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--tokens", default="64,4096")
    ap.add_argument("--no-gloo", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from mpi4py import MPI

    import fmoe
    from fmoe._io import atomic_write_text
    from fmoe.parallel import shard_experts
    from mpi_backend import MPIComm

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    W, rank = world.Get_size(), world.Get_rank()
    spec = fmoe.MoESpec(model_dim=64, num_experts=2 * W, gate=fmoe.GateSpec(k=2, capacity_factor=1.0),
                        experts=fmoe.ExpertSpec(type="ffn", hidden_size=64))
    full = fmoe.init_params(spec, generator=torch.Generator().manual_seed(0))
    params = {"gate": full["gate"], "experts": shard_experts("ffn", full["experts"], spec.num_experts, rank, W)}
    tokens = [int(t) for t in a.tokens.split(",")]
    xs = {T: torch.randn(T, 64, generator=torch.Generator().manual_seed(rank)) for T in tokens}
    settings = ("off", "step", "full", "previous")

    comms = {}
    PrevMPI = _previous(MPIComm)
    for s in settings:
        c = PrevMPI(world) if s == "previous" else MPIComm(world, checks=s)
        if s == "previous":
            c._raw_gather_words = _mpi_words(c)
        comms[("mpi", s)] = c
    backends = ["mpi"]
    if not a.no_gloo:
        import torch.distributed as dist
        from fmoe.comm.torch_dist import TorchDistComm
        port = np.zeros(1, dtype=np.int64)
        if rank == 0:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port[0] = sock.getsockname()[1]
        world.Bcast(port, root=0)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{int(port[0])}", rank=rank, world_size=W)
        PrevGloo = _previous(TorchDistComm)
        for s in settings:
            c = PrevGloo() if s == "previous" else TorchDistComm(checks=s)
            if s == "previous":
                c._raw_gather_words = _gloo_words(c)
            comms[("gloo", s)] = c
        backends.append("gloo")

    cases = {}
    for b in backends:
        for T in tokens:
            for s in settings:
                c = comms[(b, s)]
                cases[(b, T, s)] = (lambda c=c, T=T: fmoe.moe(params, xs[T], spec, comm=c))
    small = torch.ones(8)
    out8 = small.numpy().copy()
    micro = {("mpi", "all_reduce 8 fp32", "raw mpi4py"): lambda: world.Allreduce(small.numpy(), out8)}
    for s in settings:
        micro[("mpi", "all_reduce 8 fp32", s)] = (lambda c=comms[("mpi", s)]: c.all_reduce(small, "sum"))
    cases.update(micro)
    reps = {k: (3 if k[1] >= 1024 else 10) if isinstance(k[1], int) else 200
            for k in cases}

    for fn in cases.values():  # warm up: allocator, numba/threads, sub-communicators
        for _ in range(3):
            fn()
    times = {k: [] for k in cases}
    keys = list(cases)
    for r in range(a.rounds):
        order = keys[r % len(keys):] + keys[:r % len(keys)]
        for k in order:
            world.Barrier()
            t0 = time.perf_counter()
            for _ in range(reps[k]):
                cases[k]()
            times[k].append((time.perf_counter() - t0) / reps[k] * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    if rank == 0:
        print(f"world size {W}; ms per call over {a.rounds} interleaved rounds: median (ratio to off), "
              "then the best round (ratio): on a loaded machine the best round is the closer estimate")
        for b in backends:
            for T in tokens:
                base, bbase = med[(b, T, "off")], best[(b, T, "off")]
                row = "  ".join(f"{s} {med[(b, T, s)]:7.3f} ({med[(b, T, s)] / base:5.3f})" for s in settings)
                print(f"  {b:4s} moe forward T={T:<5d} median  {row}")
                row = "  ".join(f"{s} {best[(b, T, s)]:7.3f} ({best[(b, T, s)] / bbase:5.3f})" for s in settings)
                print(f"  {b:4s} moe forward T={T:<5d} best    {row}")
        base = med[("mpi", "all_reduce 8 fp32", "raw mpi4py")]
        row = "  ".join(f"{s} {med[('mpi', 'all_reduce 8 fp32', s)] * 1e3:6.1f} us" for s in settings)
        print(f"  mpi  all_reduce 8 fp32    raw {base * 1e3:6.1f} us  {row}")
        if a.json:
            atomic_write_text(a.json, json.dumps(
                {"world_size": W, "rounds": a.rounds,
                 "median_ms": {" ".join(map(str, k)): v for k, v in med.items()},
                 "best_ms": {" ".join(map(str, k)): v for k, v in best.items()},
                 "all_ms": {" ".join(map(str, k)): v for k, v in times.items()}}, indent=1))
    # The checks' CPU cost alone, on rank 0 while rank 1 sleeps (a rank spinning in a barrier would take
    # the CPU the measurement needs).
    global _MPI
    _MPI = MPI
    if rank == 0:
        emu = _emulated(spec, params, xs, settings, a.rounds)
        print("in-process 2-rank emulation (the peer echoes rank 0's data; no waiting): ms per call, median "
              "and best round (ratio to off)")
        for T in tokens:
            for label, pick in (("median", statistics.median), ("best", min)):
                base = pick(emu[(T, "off")])
                row = "  ".join(f"{s} {pick(emu[(T, s)]):7.3f} ({pick(emu[(T, s)]) / base:5.3f})" for s in settings)
                print(f"  emu  moe forward T={T:<5d} {label:7s} {row}")
        if a.json:
            atomic_write_text(a.json + ".emulated.json", json.dumps(
                {" ".join(map(str, k)): v for k, v in emu.items()}, indent=1))
    req = world.Ibarrier()
    while not req.Test():
        time.sleep(0.01)
    # one end-of-job shutdown per backend (TorchDistComm.close also destroys the process group)
    comms[("mpi", "full")].close()
    if "gloo" in backends:
        comms[("gloo", "full")].close()


if __name__ == "__main__":
    main()
