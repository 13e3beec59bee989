"""CPU decode benchmark: fused FP4/FP8 expert matmul vs FP32 dense bmm vs dequantize-then-matmul.

All three run in the same process on the same shapes, round-robin one call at a time,
medians over repeats (the 1-minute load average is recorded: the dev VM is shared).
Prints a table and writes JSON to benchmarks/out/bench_quant.json.

    python benchmarks/bench_quant.py [--fmt mxfp4|nvfp4|mxfp8|fp8_block|fp8_row]
        [--experts 8 --n 1024 --k 2048 --repeats 15 --tokens 1 2 4 8 16 32 64 --threads N]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import fmoe.quant as Q
from fmoe.quant import matmul as M
from fmoe._numba import threading_layer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--tokens", type=int, nargs="*", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--fmt", default="mxfp4")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch.set_num_threads (numba follows torch); 0 keeps the default")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    E, N, K = args.experts, args.n, args.k
    dense = torch.randn(E, N, K) * 0.02
    w = Q.quantize(dense, args.fmt)
    wt = dense.transpose(1, 2)  # same memory traffic as a [E, K, N] weight for bmm
    rows = []
    for c in args.tokens:
        x = torch.randn(E, c, K)
        fns = {
            "fused": lambda: M._fused(x, w),
            "dense_fp32": lambda: torch.bmm(x, wt),
            "dequant_matmul": lambda: M._dequant_per_expert(x, w),
        }
        times = {k: [] for k in fns}
        names = list(fns)
        for fn in fns.values():
            fn()  # warm-up (numba compile / caches)
        # Round-robin, one call at a time, rotating the order: the shared VM's load changes
        # within seconds, and this way every change hits all three about equally.
        for r in range(args.repeats):
            for i in range(len(names)):
                k = names[(r + i) % len(names)]
                t0 = time.perf_counter()
                fns[k]()
                times[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        rows.append({"tokens_per_expert": c, **{f"{k}_ms": round(v, 4) for k, v in med.items()},
                     "speedup_vs_dense": round(med["dense_fp32"] / med["fused"], 3),
                     "speedup_vs_dequant": round(med["dequant_matmul"] / med["fused"], 3)})
    result = {
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "torch_threads": torch.get_num_threads(), "numba_layer": threading_layer(),
                    "torch": torch.__version__, "loadavg_1m_end": round(os.getloadavg()[0], 2)},
        "config": {"fmt": args.fmt, "experts": E, "n": N, "k": K, "repeats": args.repeats,
                   "bits_per_weight": Q.bits_per_weight(w),
                   "auto_crossover": Q.crossover(args.fmt)},
        "rows": rows,
    }
    print(f"{'C':>4} {'fused ms':>10} {'dense fp32':>11} {'deq+mm':>9} {'x dense':>8} {'x deq':>7}")
    for r in rows:
        print(f"{r['tokens_per_expert']:>4} {r['fused_ms']:>10.3f} {r['dense_fp32_ms']:>11.3f} "
              f"{r['dequant_matmul_ms']:>9.3f} {r['speedup_vs_dense']:>8.2f} "
              f"{r['speedup_vs_dequant']:>7.2f}")
    os.makedirs(os.path.join(os.path.dirname(__file__), "out"), exist_ok=True)
    tag = f"_t{args.threads}" if args.threads else ""
    path = os.path.join(os.path.dirname(__file__), "out", f"bench_quant_{args.fmt}{tag}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["machine"]), "->", path)


if __name__ == "__main__":
    main()
