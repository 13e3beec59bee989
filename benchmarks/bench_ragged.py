"""ragged_mm / ragged_wgrad against their roofline baselines, side by side in one process.

``python -m benchmarks.bench_ragged [--quick] [--repeats N] [--threads N] [--only train|decode]``

train   One expert linear layer forward + backward (y = ragged_mm(x, w, offsets), then
        dgrad ragged_mm + wgrad ragged_wgrad) at the fine-grained shapes of issue 11,
        both weight layouts, against
          dense     torch.mm of the same total rows and shapes, forward + backward
                    (the machine's rate for these GEMMs: the denominator of T1);
          bmm@cf    torch.bmm on padded [E, C, K] buffers, C = ceil(cf * rows / E),
                    cf 1.0 / 1.25 / 2.0, forward + backward;
          ragged_via_padded_bmm  the ragged product as copy into [E, max rows, K], one
                    bmm, copy back (the batched alternative ragged_mm does not take).
        Reported as useful GFLOP/s (3 GEMMs of 2 * rows * K * N FLOPs) and ratios.
decode  Forward only (no grad) at T <= 64 tokens, 128 experts, top-8, against
          stream    one read of as many bytes as the busy experts' weights (torch.sum
                    or a numba parallel sum, the faster; the denominator of T2);
          per-group torch.mm (the reference: one BLAS call per busy expert);
          bmm       padded torch.bmm over all experts.

Variants are timed round-robin (one call each per repeat) so that load bursts on a
shared machine hit all alike; medians are printed as JSON lines.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from typing import Callable

import numpy as np
import torch
from numba import njit, prange

from fmoe import _numba
from fmoe.ops import ragged as RG
from fmoe.ops import tuning


def round_robin(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 1) -> dict[str, float]:
    """Median seconds of each fn, the fns called in turn once per repeat."""
    for _ in range(warmup):
        for f in fns.values():
            f()
    times: dict[str, list] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def routed_offsets(T: int, E: int, k: int, g: torch.Generator) -> torch.Tensor:
    """int64 [E + 1] offsets of a random top-k routing of T tokens (distinct experts per token)."""
    ids = torch.rand(T, E, generator=g).topk(k, dim=1).indices.reshape(-1)
    counts = torch.bincount(ids, minlength=E)
    return torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])


# --------------------------------------------------------------------------- training

TRAIN = [  # (name, T, M, H, E, k)
    ("e64_k8_h512", 2048, 768, 512, 64, 8),
    ("e128_k8_h256", 2048, 768, 256, 128, 8),
    ("e32_k4_h768", 4096, 768, 768, 32, 4),
]


def bench_train(name, T, M, H, E, k, transposed, repeats, g):
    off = routed_offsets(T, E, k, g)
    R = k * T
    counts = (off[1:] - off[:-1]).tolist()
    K, N = M, H  # the first expert linear: [M] -> [H]
    x = torch.randn(R, K, generator=g).requires_grad_()
    w = (torch.randn(E, N, K, generator=g) if transposed else torch.randn(E, K, N, generator=g)) * K ** -0.5
    w.requires_grad_()
    gy = torch.randn(R, N, generator=g)

    def ragged():
        y = RG.ragged_mm(x, w, off, transposed=transposed)
        torch.autograd.grad(y, (x, w), gy)

    wd = w.detach()[0].clone().requires_grad_()  # one [K, N] / [N, K] weight for the dense rate

    def dense():
        y = x @ (wd.t() if transposed else wd)
        torch.autograd.grad(y, (x, wd), gy)

    # The same ragged product through one padded bmm: rows copied into [E, max rows, K]
    # (index_copy_), one batched GEMM, copied back (index_select). One threaded region per
    # GEMM instead of one per group, at the price of two copies and the padding FLOPs.
    Cmax = max(counts)
    dest = torch.cat([torch.arange(n) + e * Cmax for e, n in enumerate(counts)])

    def ragged_bmm():
        xp = x.new_zeros(E * Cmax, K).index_copy(0, dest, x)
        y = torch.bmm(xp.view(E, Cmax, K), w.transpose(1, 2) if transposed else w)
        y = y.view(E * Cmax, N).index_select(0, dest)
        torch.autograd.grad(y, (x, w), gy)

    fns = {"ragged": ragged, "dense": dense, "ragged_via_padded_bmm": ragged_bmm}
    for cf in (1.0, 1.25, 2.0):
        C = math.ceil(cf * R / E)
        xb = torch.randn(E, C, K, generator=g).requires_grad_()
        gyb = torch.randn(E, C, N, generator=g)

        def bmm(xb=xb, gyb=gyb):
            y = torch.bmm(xb, w.transpose(1, 2) if transposed else w)
            torch.autograd.grad(y, (xb, w), gyb)

        fns[f"bmm_cf{cf}"] = bmm
    t = round_robin(fns, repeats)
    flop = 3 * 2 * R * K * N
    out = {"suite": "train", "config": name, "T": T, "M": M, "H": H, "E": E, "k": k, "transposed": transposed,
           "rows": R, "max_rows": max(counts), "min_rows": min(counts), "seconds": t,
           "useful_gflops": {v: flop / s / 1e9 for v, s in t.items()},
           "ratio_vs_dense": t["dense"] / t["ragged"],
           "ragged_over_padded_bmm": t["ragged"] / t["ragged_via_padded_bmm"],
           "ratio_padded_bmm_vs_dense": t["dense"] / t["ragged_via_padded_bmm"]}
    for cf in (1.0, 1.25, 2.0):
        out[f"speedup_vs_bmm_cf{cf}"] = t[f"bmm_cf{cf}"] / t["ragged"]
    return out


# --------------------------------------------------------------------------- decode

@njit(parallel=True, fastmath={"reassoc"})
def _numba_read(a):
    """Sum of a 2-D float32 array, parallel over rows: one streaming read of its bytes."""
    total = np.float32(0)
    for i in prange(a.shape[0]):
        s = np.float32(0)
        for j in range(a.shape[1]):
            s += a[i, j]
        total += s
    return total


DECODE = [  # (name, T, M, H, E, k)
    ("decode_1", 1, 768, 768, 128, 8),
    ("decode_8", 8, 768, 768, 128, 8),
    ("decode_64", 64, 768, 768, 128, 8),
]


def bench_decode(name, T, M, H, E, k, transposed, repeats, g, routings=4):
    """Each call takes the next of ``routings`` random routings, so that the busy
    experts change between calls as they do token to token (their weights are not
    simply still in cache); the stream baseline reads as many experts' bytes at a
    matching rotating place in the same weight tensor."""
    offs = [routed_offsets(T, E, k, g) for _ in range(routings)]
    counts = [(o[1:] - o[:-1]).tolist() for o in offs]
    busy = [sum(1 for c in cs if c) for cs in counts]
    R = k * T
    K, N = M, H
    x = torch.randn(R, K, generator=g)
    w = (torch.randn(E, N, K, generator=g) if transposed else torch.randn(E, K, N, generator=g)).contiguous()
    flat = w.view(E, K * N)
    spans = []
    for p, b in enumerate(busy):
        first = min(p * E // routings, E - b)
        spans.append(flat[first:first + b])
    C = max(max(cs) for cs in counts)
    xb = torch.randn(E, C, K, generator=g)
    wop = w.transpose(1, 2) if transposed else w
    turn = {"i": 0}

    def rotating(fn):
        def call():
            turn["i"] = (turn["i"] + 1) % routings
            return fn(turn["i"])
        return call

    fns = {
        "ragged": rotating(lambda i: RG.ragged_mm(x, w, offs[i], transposed=transposed)),
        "stream": rotating(lambda i: spans[i].sum()),

        "stream_numba": rotating(lambda i: _numba_read(spans[i].numpy())),
        "per_group_mm": rotating(lambda i: RG.ragged_mm_reference(x, w, offs[i], transposed=transposed)),
        "bmm": lambda: torch.bmm(xb, wop),
    }
    with torch.no_grad(), _numba.kernel_call():
        t = round_robin(fns, repeats, warmup=2)
    # Reading the weights once, the faster of torch's (OpenMP) and numba's (TBB) reads:
    # on a shared machine either thread pool may stall in a given run.
    stream = min(t["stream"], t["stream_numba"])
    mean_busy = statistics.mean(busy)
    return {"suite": "decode", "config": name, "T": T, "M": M, "H": H, "E": E, "k": k, "transposed": transposed,
            "busy_experts": busy, "max_rows": C, "weight_bytes_streamed": mean_busy * K * N * 4,
            "seconds": t, "stream_gb_per_s": mean_busy * K * N * 4 / stream / 1e9,
            "ratio_vs_stream": t["ragged"] / stream,
            "ratio_per_group_mm_vs_stream": t["per_group_mm"] / stream,
            "ratio_bmm_vs_stream": t["bmm"] / stream}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="first config of each suite, 3 repeats")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--only", choices=("train", "decode"))
    p.add_argument("--threads", type=int, default=0, help="torch (and so numba) threads; 0 = torch's default")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = 3 if args.quick else args.repeats
    g = torch.Generator().manual_seed(0)
    print(json.dumps({"machine": platform.machine(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                      "numba_layer": _numba.threading_layer(), "torch": torch.__version__,
                      "loadavg": os.getloadavg(),
                      "tuning": {k: getattr(tuning, k) for k in ("RAGGED_SERIAL_BYTES", "NUMBA_SERIAL_ELEMENTS")}}))
    for tr in (True, False):
        if args.only in (None, "decode"):
            for cfg in DECODE[:1] if args.quick else DECODE:
                print(json.dumps(bench_decode(*cfg, tr, repeats, g)), flush=True)
        if args.only in (None, "train"):
            for cfg in TRAIN[:1] if args.quick else TRAIN:
                print(json.dumps(bench_train(*cfg, tr, repeats, g)), flush=True)
    print(json.dumps({"loadavg_end": os.getloadavg()}))


if __name__ == "__main__":
    main()
