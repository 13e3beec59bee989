"""Packed decode GEMMs read from DRAM: each expert projection alone, cold, against the stream rate.

The two expert GEMMs of bench_inference's layer (swiglu M=2048, I=768, E=64, k=6): gate_up
([E, 1536, 2048]) and down ([E, 2048, 768]), one ``fmoe.quant.packed.grouped_matmul`` call each on
the rows of T tokens routed top-6 by a random gate. Each timed call follows an untimed eviction
read of a 512 MiB float32 buffer (``buf.sum()``, larger than the L3), whose own time is the stream
rate of the same threads; ``warm`` repeats the call without the eviction. Reported: the busy
experts' stored bytes (data + scales) / the call's median time, and that as a fraction of the
median stream rate. The host is shared: run under the timing lock, alternate trees, report
``uptime``.

``--compute`` adds the rate of one expert's projection held in L2 (what the decode loop does per byte
without memory in the way), ``--int8`` the FP4 formats with int8 activations beside them.

Run: ``python -m benchmarks.bench_packed_dram [--threads 2] [--tokens 1 4 16] [--formats mxfp4 ...]
[--compute] [--warm] [--int8]``
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from benchmarks.bench_inference import E, FLUSH_BYTES, I, K_TOP, M, _nbytes, _rand_packed, timed_cold

PROJ = {"gate_up": (2 * I, M), "down": (M, I)}


def measure(formats, tokens, projs, repeats: int, warm: bool, int8: bool = False, log=print) -> dict:
    from fmoe.quant import packed
    g = torch.Generator().manual_seed(0)
    wg = torch.randn(E, M, generator=g) * 0.02
    weights = {(f, pr): _rand_packed(f, n, k, g) for f in formats for pr, (n, k) in PROJ.items() if pr in projs}
    buf = torch.ones(FLUSH_BYTES // 4)
    res = {}
    for T in tokens:
        x = torch.randn(T, M, generator=g)
        counts = torch.bincount((x @ wg.T).topk(K_TOP, dim=-1).indices.reshape(-1), minlength=E)
        busy = int((counts > 0).sum())
        offs = torch.zeros(E + 1, dtype=torch.int64)
        offs[1:] = counts.cumsum(0)
        steps = {}
        for (f, pr), w in weights.items():
            a = torch.randn(int(offs[-1]), PROJ[pr][1], generator=g)
            steps[(f, pr)] = (lambda a=a, w=w: packed.grouped_matmul(a, w, offs))
            if int8 and f in ("mxfp4", "nvfp4") and packed.has_int8_path():
                steps[(f + "/i8", pr)] = (lambda a=a, w=w: packed.grouped_matmul(a, w, offs, activations="int8"))
        t = timed_cold(steps, repeats, log, warm=warm, buf=buf)
        rate = t["stream_gb_per_s"]
        for (f, pr) in steps:
            nb = _nbytes(weights[(f.split("/")[0], pr)], busy)
            cold = nb / t[(f, pr)] / 1e9
            row = {"busy": busy, "bytes": nb, "cold_gb_s": cold, "stream_gb_s": rate, "frac": cold / rate}
            if warm:
                row["warm_gb_s"] = nb / t["warm"][(f, pr)] / 1e9
            res[f"T={T} {f} {pr}"] = row
            log(f"T={T:3d} {f:9s} {pr:7s} busy {busy:2d}: cold {cold:5.1f} GB/s = {cold / rate:.2f} of stream "
                f"{rate:.1f}" + (f", warm {row['warm_gb_s']:5.1f} GB/s" if warm else ""))
    return res


def compute_rate(formats, projs, int8: bool = False, repeats: int = 200, log=print) -> dict:
    """The kernels' rate with the weights in L2: one expert's projection (about 0.4-3 MB) against one
    row, called back to back on the calling thread set; stored bytes / the fastest call. What the
    decode loop can do per byte when memory is not in the way (compare with the stream rate)."""
    from fmoe.quant import packed
    g = torch.Generator().manual_seed(0)
    o = torch.zeros(E + 1, dtype=torch.int64)
    o[1:] = 1   # one row, expert 0
    res = {}
    for f in formats:
        for pr in projs:
            n, k = PROJ[pr]
            w = _rand_packed(f, n, k, g)
            nb = _nbytes(w, 1)
            a = torch.randn(1, k, generator=g)
            acts = ["float"] + (["int8"] if int8 and f in ("mxfp4", "nvfp4") and packed.has_int8_path() else [])
            for act in acts:
                fn = (lambda a=a, w=w, act=act: packed.grouped_matmul(a, w, o, activations=act))
                for _ in range(20):
                    fn()
                ts = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    fn()
                    ts.append(time.perf_counter() - t0)
                name = f + ("/i8" if act == "int8" else "")
                res[f"{name} {pr}"] = nb / min(ts) / 1e9
                log(f"compute {name:9s} {pr:7s} ({nb / 1e6:.1f} MB in L2): {res[f'{name} {pr}']:5.1f} GB/s "
                    f"(fastest of {repeats})")
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 16])
    p.add_argument("--formats", nargs="+", default=["mxfp4", "nvfp4", "fp8_block"])
    p.add_argument("--projs", nargs="+", default=list(PROJ))
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--warm", action="store_true", help="also time a second call without the eviction")
    p.add_argument("--int8", action="store_true", help="also FP4 with int8 activations (name/i8)")
    p.add_argument("--compute", action="store_true", help="also the L2-resident rate of one expert (compute_rate)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from fmoe.quant import packed
    print(f"{packed.status()}; threads {args.threads}; load {os.getloadavg()[0]:.2f}")
    with torch.no_grad():
        if args.compute:
            compute_rate(args.formats, args.projs, args.int8)
        measure(args.formats, args.tokens, args.projs, args.repeats, args.warm, args.int8)
    print(f"load at end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
