"""What fmoe.moe's per-call input checks cost (issue 36), beside the call they guard.

    python -m benchmarks.bench_checks [--T 4096 --M 512 --H 1024 --E 8 --k 2 --device cpu]

Prints microseconds per call (median of repeats) of: check_params (every expert leaf against the
spec, shapes only), the router-logits finiteness check ([T, E]: one reduction, one host read; one
process), the x and gate finiteness check the expert-parallel path runs before its first collective
([T, M]), and one whole forward of the same layer for scale. Timings on a shared machine are noisy:
compare medians of a few runs.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import fmoe


def _median_us(fn, repeats: int, inner: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t) / inner * 1e6)
    return statistics.median(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--M", type=int, default=512)
    ap.add_argument("--H", type=int, default=1024)
    ap.add_argument("--E", type=int, default=8)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args(argv)
    moe_mod = sys.modules["fmoe.moe"]
    from fmoe.routing import check_finite
    dev = torch.device(a.device)
    spec = fmoe.MoESpec(model_dim=a.M, num_experts=a.E, gate=fmoe.GateSpec(k=a.k, capacity_factor=1.0),
                        experts=fmoe.ExpertSpec("ffn", a.H))
    params = fmoe.init_params(spec, generator=torch.Generator().manual_seed(0))
    params = {g: {n: t.to(dev) for n, t in d.items()} for g, d in params.items()}
    x = torch.randn(a.T, a.M, generator=torch.Generator().manual_seed(1)).to(dev)
    logits = x @ params["gate"]["wg"].t()

    def sync(fn):
        def run():
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
        return run

    rows = [
        ("check_params (ffn, 4 leaves)", sync(lambda: fmoe.check_params(params, spec)), 200),
        (f"router logits finite [{a.T}, {a.E}]", sync(lambda: check_finite(logits, "logits", "")), 50),
        (f"x + gate finite (EP) [{a.T}, {a.M}]", sync(lambda: moe_mod._check_finite_inputs(x, params["gate"])), 5),
        (f"moe forward T={a.T} M={a.M} H={a.H} E={a.E} k={a.k}", sync(lambda: fmoe.moe(params, x, spec)), 1),
    ]
    print(f"device {dev}, torch threads {torch.get_num_threads()}")
    with torch.no_grad():
        for name, fn, inner in rows:
            print(f"{name:48s} {_median_us(fn, a.repeats, inner):12.1f} us")


if __name__ == "__main__":
    main()
