"""N gate settings in one vmapped forward/backward vs N sequential runs (CPU).

    python benchmarks/bench_ablate.py                 # N=8, ~1 minute on 2 cores
    python benchmarks/bench_ablate.py --n 4 8 16 --tokens 1024

Two sweeps, each timed three ways in one process, interleaved rep by rep
(these machines are shared and noisy, so only same-process ratios mean much):

* ``tensor``: settings that keep shapes (temperature, gate noise scale, loss
  coefficients, a stacked gate per setting);
* ``shape``: settings that change shapes (k in 1..3, capacity factors incl.
  dropless, number of experts), masked inside static maxima.

Ways: ``vmap`` = ``sweep_moe(mode="masked")`` (one vmapped call);
``grouped`` = one vmapped call per distinct (k, C, E); ``loop`` = N separate
runs with real shapes (what one would do without fmoe.ablate). Prints a table
and one JSON line with medians (ms) and speedups loop/vmap.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import fmoe
from fmoe import ablate


def _points(kind: str, n: int, E: int) -> list:
    pts = []
    for i in range(n):
        if kind == "tensor":
            pts.append(ablate.Point(temperature=0.5 + 0.25 * (i % 4), gate_noise=0.5 * (i % 3),
                                    aux_coef=0.01 * (i % 2), z_coef=1e-3 * (i % 2)))
        else:
            cfs = (1.0, 1.25, 2.0, 0.0)
            pts.append(ablate.Point(k=1 + i % 3, capacity_factor=cfs[(i // 3) % 4],
                                    num_experts=E if i % 4 else E // 2))
    return pts


def _run(args, kind: str, n: int) -> dict:
    M, E, T, H = args.model_dim, args.experts, args.tokens, args.hidden
    spec = fmoe.MoESpec(model_dim=M, num_experts=E, gate=fmoe.GateSpec(k=2, capacity_factor=1.25),
                        experts=fmoe.ExpertSpec(hidden_size=H))
    g = torch.Generator().manual_seed(0)
    params = fmoe.init_params(spec, generator=g)
    x, target, noise = torch.randn(T, M, generator=g), torch.randn(T, M, generator=g), torch.randn(T, E, generator=g)
    pts = _points(kind, n, E)
    gates = {"wg": torch.randn(n, E, M, generator=g) * 0.1} if kind == "tensor" else None
    modes = ["masked", "grouped", "loop"] if kind == "shape" else ["masked", "loop"]
    times: dict = {m: [] for m in modes}
    for rep in range(args.warmup + args.reps):
        for m in modes:
            t0 = time.perf_counter()
            ablate.sweep_moe(params, x, spec, pts, target=target, gates=gates, noise=noise, mode=m)
            if rep >= args.warmup:
                times[m].append(time.perf_counter() - t0)
    med = {("vmap" if m == "masked" else m): statistics.median(v) * 1e3 for m, v in times.items()}
    out = {"sweep": kind, "n": n, "median_ms": {k: round(v, 2) for k, v in med.items()},
           "speedup_vs_loop": {k: round(med["loop"] / v, 2) for k, v in med.items() if k != "loop"}}
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[8], help="settings per sweep")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--model_dim", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = [_run(args, kind, n) for n in args.n for kind in ("tensor", "shape")]
    print(f"{'sweep':>7} {'N':>3} {'loop ms':>9} {'grouped ms':>11} {'vmap ms':>9} {'loop/vmap':>10}")
    for r in results:
        ms = r["median_ms"]
        grouped = f"{ms['grouped']:.1f}" if "grouped" in ms else "-"
        print(f"{r['sweep']:>7} {r['n']:>3} {ms['loop']:>9.1f} {grouped:>11} {ms['vmap']:>9.1f} "
              f"{r['speedup_vs_loop']['vmap']:>9.2f}x")
    report = {
        "bench": "ablate",
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "torch": torch.__version__, "threads": torch.get_num_threads()},
        "config": {k: v for k, v in vars(args).items()},
        "results": results,
    }
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
