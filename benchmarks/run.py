"""Benchmark entry point: ``python -m benchmarks.run [--quick] [--only NAME] [--out DIR]``.

Runs the suites in one process (so ratios compare numbers from one run),
writes ``<out>/results.json`` and PNG plots, and prints a table.

Suites: ``core`` (configs: coarse, fine_cf1, fine_cf2, decode_8, decode_64),
``layouts`` and ``routing``. ``--only`` takes a suite or a config name.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import numba
import torch

from fmoe import _numba

from . import bench_core, bench_cpu_layouts, bench_cpu_routing

SUITES = {"core": bench_core, "layouts": bench_cpu_layouts, "routing": bench_cpu_routing}
TARGETS = {"train_vs_dense": 0.85, "decode_vs_dense": 0.50, "fwd_vs_bound": 1.3, "bwd_vs_bound": 1.6,
           "vs_transformers": 1.5}


def machine() -> dict:
    model, cores = platform.processor(), os.cpu_count()
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in lscpu.splitlines():
            key, _, val = line.partition(":")
            if key.strip() == "Model name":
                model = val.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return {"cpu": model, "logical_cpus": cores, "torch": torch.__version__, "numba": numba.__version__,
            "torch_threads": torch.get_num_threads(), "threading_layer": _numba.threading_layer(),
            "python": platform.python_version()}


def _fmt(v, spec=".2f"):
    return "-" if v is None else format(v, spec)


def table(results: dict) -> str:
    core = results["suites"].get("core")
    lines = []
    if core:
        dense = core["dense_gemm"]["gflops"]
        lines.append(f"dense GEMM fwd+bwd {dense:.1f} GFLOP/s (best of "
                     f"{len(core['dense_gemm'].get('measurements', [dense]))} measurements taken next to the configs); "
                     f"copy bandwidth "
                     f"{core['copy_bandwidth']['gb_per_s']:.1f} GB/s")
        lines.append("")
        lines.append("| config | variant | ms/step | useful GFLOP/s | vs dense | speed-up vs transformers "
                     "| peak RSS growth MiB |")
        lines.append("|---|---|---|---|---|---|---|")
        for name, r in core["configs"].items():
            for v, m in r["variants"].items():
                if "seconds" not in m:
                    lines.append(f"| {name} | {v} | skipped | | | | |")
                    continue
                rss = r["peak_rss_bytes"].get(v)
                lines.append(f"| {name} | {v} | {m['seconds'] * 1e3:.1f} | {m['useful_gflops']:.1f} | "
                             f"{r['vs_dense'][v]:.2f} | {_fmt(r.get('speedup_vs_transformers', {}).get(v))} | "
                             f"{_fmt(rss / 2**20 if rss is not None else None, '.0f')} |")
        lines.append("")
        lines.append("| config | backend | dispatch+combine fwd ms | x bound | bwd ms | x bound |")
        lines.append("|---|---|---|---|---|---|")
        for name, r in core["configs"].items():
            dc = r["dispatch_combine"]
            lines.append(f"| {name} | numba, into reused buffers | {dc['numba_into_fwd_seconds'] * 1e3:.2f} | "
                         f"{dc['numba_into_fwd_vs_bound']:.2f} | | |")
            for b, m in dc["backends"].items():
                lines.append(f"| {name} | {b} | {m['fwd_seconds'] * 1e3:.2f} | {m['fwd_vs_bound']:.2f} | "
                             f"{m['bwd_seconds'] * 1e3:.2f} | {m['bwd_vs_bound']:.2f} |")
    lay = results["suites"].get("layouts")
    if lay:
        lines.append("")
        lines.append("| shape [E,C,K,N] | " + " | ".join(k for k in next(iter(lay.values())) if k != "shape")
                     + " |  (GFLOP/s fwd+bwd)")
        lines.append("|---" * (len(next(iter(lay.values())))) + "|")
        for name, r in lay.items():
            lines.append(f"| {name} {r['shape']} | " + " | ".join(f"{m['gflops']:.1f}" for k, m in r.items()
                                                                 if k != "shape") + " |")
    rt = results["suites"].get("routing")
    if rt:
        lines.append("")
        lines.append("| config | tokens | assign_slots torch ms | numba ms | speed-up |")
        lines.append("|---|---|---|---|---|")
        for name, r in rt.items():
            lines.append(f"| {name} | {r['tokens']} | {r['torch_seconds'] * 1e3:.2f} | {r['numba_seconds'] * 1e3:.3f} | "
                         f"{r['speedup']:.0f}x |")
    return "\n".join(lines)


def plots(results: dict, out_dir: str) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots")
        return []
    paths = []
    core = results["suites"].get("core")
    if core and core["configs"]:
        names = list(core["configs"])
        variants = ["reference", "numba", "numba+rows", "numba+exact", "transformers"]
        fig, ax = plt.subplots(figsize=(9, 4))
        width = 0.16
        for i, v in enumerate(variants):
            vals = [core["configs"][n]["variants"].get(v, {}).get("useful_gflops", 0) for n in names]
            ax.bar([j + i * width for j in range(len(names))], vals, width, label=v)
        ax.axhline(core["dense_gemm"]["gflops"], color="k", ls="--", label="dense GEMM")
        ax.set_xticks([j + 2 * width for j in range(len(names))], names)
        ax.set_ylabel("useful GFLOP/s (median)")
        ax.set_title("MoE layer step, float32")
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(os.path.join(out_dir, "moe_layer.png"))
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)

        fig, ax = plt.subplots(figsize=(9, 4))
        for i, (b, d) in enumerate((("reference", "fwd"), ("reference", "bwd"), ("numba", "fwd"), ("numba", "bwd"))):
            vals = [core["configs"][n]["dispatch_combine"]["backends"][b][f"{d}_vs_bound"] for n in names]
            ax.bar([j + i * width for j in range(len(names))], vals, width, label=f"{b} {d}")
        ax.axhline(1.0, color="k", ls="--", label="bandwidth bound")
        ax.set_yscale("log")
        ax.set_xticks([j + 1.5 * width for j in range(len(names))], names)
        ax.set_ylabel("time / (bytes / copy bandwidth)")
        ax.set_title("dispatch + combine")
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(os.path.join(out_dir, "dispatch_combine.png"))
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer tokens and repeats (< 2 minutes)")
    p.add_argument("--only", default=None, help="a suite (core, layouts, routing) or a config name")
    p.add_argument("--out", default=os.path.join("benchmarks", "out"), help="output directory")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    results = {"machine": machine(), "command": " ".join(["python -m benchmarks.run", *sys.argv[1:]]),
               "quick": args.quick, "targets": TARGETS, "suites": {}}
    config_names = {c.name for c in bench_core.CONFIGS}
    for name, suite in SUITES.items():
        if args.only and args.only != name and not (name in ("core", "routing") and args.only in config_names):
            continue
        print(f"[{name}]", flush=True)
        results["suites"][name] = suite.run(args.quick, args.only, lambda s: print(s, flush=True))
    results["machine"]["threading_layer"] = _numba.threading_layer()
    results["seconds"] = time.time() - t0
    path = os.path.join(args.out, "results.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print()
    print(table(results))
    print()
    print(f"wrote {path} and {', '.join(plots(results, args.out)) or 'no plots'} in {results['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
