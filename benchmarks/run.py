"""Benchmark entry point: ``python -m benchmarks.run [--quick] [--only NAME] [--out DIR] [--no-memory]``.

Default suites (issue 11; everything side by side in one run, medians and ratios):

* ``layer``  (benchmarks/bench_layer.py): ``fmoe.nn.MoELayer`` with default settings vs Tutel's
  layer on the same weights, vs the dense-GEMM roofline (training) and the weight-stream
  bound (decode); configs coarse, fine_cf125, fine_cf2, dropless, fine_e64k8, fine_e128k8, decode_16,
  decode_64;
* ``blocks`` (benchmarks/bench_blocks.py): ``fmoe.models`` blocks (Qwen3-MoE, DeepSeek-V3,
  GPT-OSS, Mixtral) vs transformers' own blocks with both experts implementations, for
  training, prefill and decode.

Peak resident memory of every variant is measured in its own subprocess (``--no-memory``
skips it). Other suites run only when named: ``--only core|layouts|routing|profile|gemm_calls|inference``
(``profile``: where fine_cf125's and dropless's step time and memory go, benchmarks/bench_profile.py;
``gemm_calls``: per-expert vs batched GEMM calls, the decode weight order and MoELayer's weight storage,
benchmarks/bench_gemm_calls.py; ``inference``: packed-expert MoE decode against the memory-stream bound and a
whole patched model against transformers, benchmarks/bench_inference.py).
``--only`` also takes one layer config or one arch name. Writes ``<out>/results.json``
(atomically), ``<out>/results.md`` (the tables) and PNG plots; prints the tables and one
status line per target.
"""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time

import numba
import torch

from fmoe import _numba

from . import (bench_blocks, bench_common, bench_core, bench_cpu_layouts, bench_cpu_routing, bench_gemm_calls,
               bench_inference, bench_layer, bench_profile)

DEFAULT_SUITES = {"layer": bench_layer, "blocks": bench_blocks}
EXTRA_SUITES = {"core": bench_core, "layouts": bench_cpu_layouts, "routing": bench_cpu_routing,
                "profile": bench_profile, "gemm_calls": bench_gemm_calls, "inference": bench_inference}
# Issue 11's thresholds; each suite's targets() turns its results into status lines against them.
TARGETS = {
    "T1 training useful GFLOP/s / dense GEMM rate of the same shapes": ">= 0.90",
    "T2 decode (T <= 64, no grad) time / time to stream the busy experts' weights once": "<= 1.2",
    "T3 time / Tutel's (same weights), geo-mean over coarse, fine_cf125, fine_cf2, decode_16": "<= 0.55, none > 1",
    "T4 transformers block time / fmoe block time, both experts implementations": ">= 1.5 train/prefill, >= 1.2 decode",
    "T5 training-step peak memory above the resting set": "<= 0.5x Tutel (cf 1.25, dropless); <= transformers'",
}


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
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {"cpu": model, "logical_cpus": cores, "torch": torch.__version__, "numba": numba.__version__,
            "torch_threads": torch.get_num_threads(), "threading_layer": _numba.threading_layer(),
            "python": platform.python_version(), "loadavg_start": load, "commit": commit()}


def commit() -> str:
    """The fmoe commit measured: git's HEAD (+ "-dirty" when fmoe/ has uncommitted changes), or the
    first line of ``.bench_commit`` in a snapshot without .git (git archive), else "unknown"."""
    repo = bench_common.REPO
    try:
        head = subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode == 0:
            dirty = subprocess.run(["git", "-C", repo, "status", "--porcelain", "--", "fmoe"], capture_output=True,
                                   text=True, timeout=10).stdout.strip()
            return head.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        with open(os.path.join(repo, ".bench_commit")) as f:
            return f.readline().strip() + " (snapshot)"
    except OSError:
        return "unknown"


def _fmt(v, spec=".2f"):
    return "-" if v is None else format(v, spec)


def _ms(m: dict) -> str:
    if "seconds" in m:
        return f"{m['seconds'] * 1e3:.1f}" + (" (1 step)" if m.get("steps") == 1 else "")
    return "skipped" if "skipped" in m else ("error" if "error" in m else "-")


def _mem(m: dict) -> str:
    """'+above rest / absolute peak' in MiB."""
    if not m:
        return "-"
    if m.get("above_rest_mib") is not None:
        return f"+{m['above_rest_mib']:.0f} / {m['peak_mib']:.0f}"
    return "skipped" if "skipped" in m else f"error ({m.get('error', '?')[:60]})"


def layer_tables(lay: dict) -> list[str]:
    L = [f"Tutel: {lay['tutel']}; {lay['repeats']} repeats, medians; memory = MiB above the resting set / "
         "absolute VmHWM, each variant in its own process", ""]
    train = {n: r for n, r in lay["configs"].items() if r["config"]["train"]}
    dec = {n: r for n, r in lay["configs"].items() if not r["config"]["train"]}
    if train:
        L += ["| config | T | M | H | E | k | cf | kept pairs | fmoe ms | tutel ms | fmoe/tutel time (CPU time) | "
              "dense GF/s batched / flat / loop | fmoe GF/s | fmoe vs dense (vs flat) | fmoe vs loop | tutel vs dense | "
              "fmoe mem MiB | tutel mem MiB | fmoe/tutel mem |",
              "|" + "---|" * 19]
        for n, r in train.items():
            c, v = r["config"], r["variants"]
            L.append(f"| {n} | {r['tokens']} | {c['model_dim']} | {c['hidden']} | {c['experts']} | {c['k']} | "
                     f"{c['cf']:g} | {r['kept_pairs']} | {_ms(v['fmoe'])} | {_ms(v.get('tutel', {}))} | "
                     f"{_fmt(r.get('fmoe_time_vs_tutel'))} ({_fmt(r.get('fmoe_cpu_vs_tutel'))}) | {v['dense_batched']['gflops']:.0f} / "
                     f"{v['dense_flat']['gflops']:.0f} / {_fmt(v.get('dense_loop', {}).get('gflops'), '.0f')} | "
                     f"{v['fmoe']['gflops']:.0f} | {r['fmoe_vs_dense']:.2f} ({_fmt(r.get('fmoe_vs_dense_flat'))}) | "
                     f"{_fmt(r.get('fmoe_vs_dense_loop'))} | {_fmt(r.get('tutel_vs_dense'))} | {_mem(r['memory'].get('fmoe'))} | "
                     f"{_mem(r['memory'].get('tutel'))} | {_fmt(r.get('fmoe_mem_vs_tutel'))} |")
    if train and any("fmoe_recompute" in r["variants"] for r in train.values()):
        L += ["", "fmoe variants: `fmoe` = default (the expert engine, `save='projections'`: the in-projection "
              "outputs kept for backward); `recompute` = `save='recompute'` (recomputed in backward); `staged` = "
              "`plan='layout'` (dispatch -> seam -> combine, Tutel's arithmetic bit for bit). Same round-robin as "
              "the table above.", "",
              "| config | fmoe ms | recompute ms | staged ms | fmoe vs dense | recompute vs dense | staged vs dense | "
              "recompute/tutel time | fmoe mem MiB | recompute mem MiB | staged mem MiB | "
              "fmoe / recompute / staged mem vs tutel |",
              "|" + "---|" * 12]
        for n, r in train.items():
            v, m = r["variants"], r["memory"]
            if "fmoe_recompute" not in v:
                continue
            L.append(f"| {n} | {_ms(v['fmoe'])} | {_ms(v['fmoe_recompute'])} | {_ms(v['fmoe_staged'])} | "
                     f"{r['fmoe_vs_dense']:.2f} | {_fmt(r.get('fmoe_recompute_vs_dense'))} | "
                     f"{_fmt(r.get('fmoe_staged_vs_dense'))} | {_fmt(r.get('fmoe_recompute_time_vs_tutel'))} | "
                     f"{_mem(m.get('fmoe'))} | {_mem(m.get('fmoe_recompute'))} | {_mem(m.get('fmoe_staged'))} | "
                     f"{_fmt(r.get('fmoe_mem_vs_tutel'))} / {_fmt(r.get('fmoe_recompute_mem_vs_tutel'))} / "
                     f"{_fmt(r.get('fmoe_staged_mem_vs_tutel'))} |")
    if dec:
        L += ["", "| config | T | M | H | E | k | busy experts | busy weights MiB | read GB/s | stream bound ms | "
              "fmoe ms | fmoe x bound | expert GEMMs alone ms (x bound) | fmoe x GEMMs | tutel ms | tutel x bound | "
              "fmoe/tutel time (CPU time) | staged ms | fmoe mem MiB | tutel mem MiB |",
              "|" + "---|" * 20]
        for n, r in dec.items():
            c, v = r["config"], r["variants"]
            L.append(f"| {n} | {r['tokens']} | {c['model_dim']} | {c['hidden']} | {c['experts']} | {c['k']} | "
                     f"{r['busy_experts']} | {r['weight_bytes_busy'] / 2**20:.0f} | {r['read_gb_per_s']:.1f} | "
                     f"{r['stream_bound_seconds'] * 1e3:.1f} | {_ms(v['fmoe'])} | {r['fmoe_vs_stream']:.2f} | "
                     f"{_ms(v.get('expert_gemms', {}))} ({_fmt(r.get('gemms_vs_stream'))}) | "
                     f"{_fmt(r.get('fmoe_vs_gemms'))} | {_ms(v.get('tutel', {}))} | {_fmt(r.get('tutel_vs_stream'))} | "
                     f"{_fmt(r.get('fmoe_time_vs_tutel'))} ({_fmt(r.get('fmoe_cpu_vs_tutel'))}) | "
                     f"{_ms(v.get('fmoe_staged', {}))} | {_mem(r['memory'].get('fmoe'))} | "
                     f"{_mem(r['memory'].get('tutel'))} |")
    return L


def block_tables(bl: dict) -> list[str]:
    if "skipped" in bl:
        return [f"transformers: {bl['skipped']}"]
    L = [f"transformers {bl['transformers']}; {bl['repeats']} repeats ({bench_blocks.DECODE_REPEATS} for decode), medians; speed-up = transformers time / "
         "fmoe (default) time; memory = MiB above the resting set / absolute VmHWM, own process each", "",
         "| arch | phase | T | fmoe ms | fmoe_grouped ms | hf_eager ms | hf_grouped_mm ms | speed-up vs eager (CPU) | "
         "vs grouped_mm (CPU) | dense GF/s (batched / loop) | fmoe vs dense (vs flat) | fmoe vs loop | stream bound ms | "
         "fmoe x bound | GEMM floor ms | max speed-up vs eager / grouped_mm | fmoe mem MiB | hf_eager mem MiB | "
         "hf_grouped_mm mem MiB |",
         "|" + "---|" * 19]
    for a, r in bl["archs"].items():
        for ph, p in r["phases"].items():
            v, s, m, sc = p["variants"], p["speedup_vs_hf"], p["memory"], p.get("cpu_speedup_vs_hf", {})
            L.append(f"| {a} | {ph} | {p['tokens']} | {_ms(v['fmoe'])} | {_ms(v.get('fmoe_grouped', {}))} | "
                     f"{_ms(v.get('hf_eager', {}))} | {_ms(v.get('hf_grouped_mm', {}))} | {_fmt(s.get('eager'))} "
                     f"({_fmt(sc.get('eager'))}) | {_fmt(s.get('grouped_mm'))} ({_fmt(sc.get('grouped_mm'))}) | "
                     f"{_fmt(p.get('dense_gflops'), '.0f')}{'' if 'dense_loop' not in v else ' / ' + _fmt(v['dense_loop'].get('gflops'), '.0f')} | "
                     f"{_fmt(p.get('fmoe_vs_dense'))}{'' if 'fmoe_vs_dense_flat' not in p else ' (' + _fmt(p['fmoe_vs_dense_flat']) + ')'} | "
                     f"{_fmt(p.get('fmoe_vs_dense_loop'))} | "
                     f"{_fmt(p['stream_bound_seconds'] * 1e3 if 'stream_bound_seconds' in p else None, '.1f')} | "
                     f"{_fmt(p.get('fmoe_vs_stream'))} | "
                     f"{_fmt(p['floor_seconds'] * 1e3 if 'floor_seconds' in p else None, '.1f')} | "
                     f"{_fmt(p.get('max_speedup_vs_hf', {}).get('eager'))} / "
                     f"{_fmt(p.get('max_speedup_vs_hf', {}).get('grouped_mm'))} | "
                     f"{_mem(m.get('fmoe'))} | {_mem(m.get('hf_eager'))} | "
                     f"{_mem(m.get('hf_grouped_mm'))} |")
    return L


def profile_tables(pr: dict) -> list[str]:
    cats = [c for c, _ in bench_profile.CATEGORIES] + ["other"]
    L = ["| config | variant | T | profiled step ms | " + " | ".join(f"{c} ms" for c in cats)
         + " | fresh pages MiB (fault ms) | saved for bwd MiB | RSS fwd end / fwd peak / bwd peak, MiB above rest |",
         "|" + "---|" * (len(cats) + 7)]
    for cfg, vs in pr.items():
        for v, r in vs.items():
            if "time" not in r:
                L.append(f"| {cfg} | {v} | {r.get('skipped') or r.get('error')} |")
                continue
            t, f, sv, rs = r["time"], r["faults"], r.get("saved"), r.get("rss")
            if sv is None:
                continue
            L.append(f"| {cfg} | {v} | {r['tokens']} | {t['wall_seconds_profiled'] * 1e3:.0f} | "
                     + " | ".join(f"{t['by_category'].get(c, 0) * 1e3:.0f}" for c in cats)
                     + f" | {f['fault_bytes_per_step'] / 2**20:.0f} ({f['fault_seconds_per_step'] * 1e3:.0f}) | "
                     f"{sv['graph_saved_unique_bytes'] / 2**20:.0f} | {rs['forward_end_above_rest_mib']:.0f} / "
                     f"{rs['forward_peak_above_rest_mib']:.0f} / {rs['backward_peak_above_rest_mib']:.0f} |")
    return L


def table(results: dict) -> str:
    lines = []
    s = results["suites"]
    if "layer" in s:
        lines += ["### MoELayer vs Tutel, dense roofline, stream bound (suite `layer`)", ""] + layer_tables(s["layer"])
    if "blocks" in s:
        lines += ["", "### Architecture blocks vs transformers (suite `blocks`)", ""] + block_tables(s["blocks"])
    if "profile" in s:
        lines += ["", "### Where the step goes (suite `profile`)", ""] + profile_tables(s["profile"])
    if "gemm_calls" in s:
        lines += ["", "### How expert GEMMs are issued (suite `gemm_calls`)", ""] + bench_gemm_calls.tables(s["gemm_calls"])
    if "inference" in s:
        lines += ["", "### Packed-expert inference vs the stream bound and transformers (suite `inference`)", ""] + \
            bench_inference.tables(s["inference"])
    legacy = legacy_tables(results)
    if legacy:
        lines += ["", legacy]
    if results["targets"]:
        lines += ["", "### Targets", ""] + [f"- {t['line']}" for t in results["targets"]]
    return "\n".join(lines)


def legacy_tables(results: dict) -> str:
    """Tables of the older suites (core, layouts, routing), run with --only SUITE."""
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

    def save(fig, name):
        fig.tight_layout()
        paths.append(os.path.join(out_dir, name))
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)

    lay = results["suites"].get("layer")
    if lay and lay["configs"]:
        train = {n: r for n, r in lay["configs"].items() if r["config"]["train"]}
        dec = {n: r for n, r in lay["configs"].items() if not r["config"]["train"]}
        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        if train:
            ax, names, w = axes[0], list(train), 0.16
            for i, v in enumerate(("fmoe", "tutel", "dense_flat", "dense_batched", "dense_loop")):
                ax.bar([j + i * w for j in range(len(names))],
                       [train[n]["variants"].get(v, {}).get("gflops") or 0 for n in names], w, label=v)
            ax.set_xticks([j + 2 * w for j in range(len(names))], names, rotation=20)
            ax.set_ylabel("useful GFLOP/s (median)")
            ax.set_title("training step (fwd+bwd)")
            ax.legend(fontsize=8)
        if dec:
            ax, names, w = axes[1], list(dec), 0.25
            for i, (v, label) in enumerate((("fmoe", "fmoe"), ("gemms", "fmoe's expert GEMMs alone"), ("tutel", "tutel"))):
                ax.bar([j + i * w for j in range(len(names))],
                       [dec[n].get(f"{v}_vs_stream") or 0 for n in names], w, label=label)
            ax.axhline(1.0, color="k", ls="--", label="stream bound")
            ax.axhline(1.2, color="r", ls=":", label="target 1.2x")
            ax.set_xticks([j + w for j in range(len(names))], names)
            ax.set_ylabel("time / weight-stream time")
            ax.set_title("decode, no grad")
            ax.legend(fontsize=8)
        names = [n for n, r in lay["configs"].items() if "fmoe_time_vs_tutel" in r]
        ax = axes[2]
        ax.bar(names, [lay["configs"][n]["fmoe_time_vs_tutel"] for n in names], 0.4, label="time")
        ax.bar([j + 0.4 for j in range(len(names))],
               [lay["configs"][n].get("fmoe_mem_vs_tutel") or 0 for n in names], 0.4, label="peak memory")
        ax.axhline(0.55, color="r", ls=":", label="time target 0.55")
        ax.axhline(0.5, color="m", ls="--", label="memory target 0.5")
        ax.set_ylabel("fmoe / Tutel")
        ax.set_title("vs Tutel (same weights)")
        ax.tick_params(axis="x", rotation=20)
        ax.legend(fontsize=8)
        save(fig, "layer.png")
    bl = results["suites"].get("blocks")
    if bl and bl.get("archs"):
        rows = [(a, ph, p) for a, r in bl["archs"].items() for ph, p in r["phases"].items()]
        fig, axes = plt.subplots(1, 2, figsize=(14, 4))
        ax, w = axes[0], 0.4
        for i, impl in enumerate(bench_blocks.HF_IMPLS):
            ax.bar([j + i * w for j in range(len(rows))], [p["speedup_vs_hf"].get(impl, 0) for _, _, p in rows],
                   w, label=f"vs hf {impl}")
        ax.axhline(1.5, color="r", ls=":", label="target 1.5x (train/prefill)")
        ax.axhline(1.0, color="k", ls="--")
        ax.set_yscale("log")
        ax.set_xticks([j + 0.5 * w for j in range(len(rows))], [f"{a} {ph}" for a, ph, _ in rows], fontsize=7,
                      rotation=60, ha="right")
        ax.set_ylabel("transformers time / fmoe time")
        ax.set_title("architecture blocks")
        ax.legend(fontsize=8)
        ax = axes[1]
        mrows = [(a, ph, p) for a, ph, p in rows if p["memory"]]
        w = 0.27
        for i, v in enumerate(("fmoe", "hf_eager", "hf_grouped_mm")):
            ax.bar([j + i * w for j in range(len(mrows))],
                   [p["memory"].get(v, {}).get("above_rest_mib") or 0 for _, _, p in mrows], w, label=v)
        ax.set_xticks([j + w for j in range(len(mrows))], [f"{a}\n{ph}" for a, ph, _ in mrows], fontsize=7)
        ax.set_ylabel("peak MiB above resting set")
        ax.set_title("peak memory, own process per variant")
        ax.legend(fontsize=8)
        save(fig, "blocks.png")
    core = results["suites"].get("core")
    if core and core["configs"]:
        names = list(core["configs"])
        fig, ax = plt.subplots(figsize=(9, 4))
        variants = ["reference", "numba", "numba+staged", "transformers"]
        width = 0.8 / len(variants)
        for i, v in enumerate(variants):
            vals = [core["configs"][n]["variants"].get(v, {}).get("useful_gflops", 0) for n in names]
            ax.bar([j + i * width for j in range(len(names))], vals, width, label=v)
        ax.axhline(core["dense_gemm"]["gflops"], color="k", ls="--", label="dense GEMM")
        ax.set_xticks([j + (len(variants) - 1) / 2 * width for j in range(len(names))], names)
        ax.set_ylabel("useful GFLOP/s (median)")
        ax.set_title("core suite: MoE layer step, float32")
        ax.legend(fontsize=8)
        save(fig, "moe_layer.png")
    return paths


def select(only):
    """The suites to run and the ``only`` each gets (None = all of its configs)."""
    if only is None:
        return {n: (m, None) for n, m in DEFAULT_SUITES.items()}
    if only in DEFAULT_SUITES:
        return {only: (DEFAULT_SUITES[only], None)}
    if only in EXTRA_SUITES:
        return {only: (EXTRA_SUITES[only], only)}
    if all(part in bench_layer.BY_NAME or part in bench_layer.BY_BASE for part in only.split(",")):
        return {"layer": (bench_layer, only)}
    if only in bench_blocks.ARCHS:
        return {"blocks": (bench_blocks, only)}
    known = (list(DEFAULT_SUITES) + list(EXTRA_SUITES) + list(bench_layer.BY_NAME) + list(bench_blocks.ARCHS))
    raise SystemExit(f"--only {only!r}: not a suite, layer config or arch; known: {', '.join(known)}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small shapes, 2 repeats, a subset (< 60 s): a smoke run")
    p.add_argument("--only", default=None, help="a suite (layer, blocks, core, layouts, routing, profile, gemm_calls, inference), "
                   "layer configs (comma-separated; a config's base name runs every expert kind of it) or an arch")
    p.add_argument("--out", default=os.path.join("benchmarks", "out"), help="output directory")
    p.add_argument("--no-memory", action="store_true", help="skip the per-variant peak-memory subprocesses")
    args = p.parse_args(argv)
    chosen = select(args.only)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    results = {"machine": machine(), "command": " ".join(["python -m benchmarks.run", *(argv if argv is not None
                                                                                      else sys.argv[1:])]),
               "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "quick": args.quick,
               "memory": not args.no_memory, "target_definitions": TARGETS, "suites": {}, "targets": []}
    path = os.path.join(args.out, "results.json")
    md = os.path.join(args.out, "results.md")

    def save(partial: bool) -> str:
        results["partial"] = partial
        results["targets"] = [t for n in results["suites"] if n in DEFAULT_SUITES
                              for t in results["suites"][n].get("targets", [])]
        results["seconds"] = time.time() - t0
        try:
            results["machine"]["loadavg_end"] = os.getloadavg()
        except OSError:
            pass
        bench_common.write_json(path, results)
        text = table(results)
        mach = results["machine"]
        tmp = md + ".tmp"
        with open(tmp, "w") as f:
            f.write(f"Command: `{results['command']}` ({results['date_utc']}, {results['seconds']:.0f} s, fmoe "
                    f"{mach['commit']}, load average {_fmt(mach['loadavg_start'] and mach['loadavg_start'][0], '.1f')} "
                    f"at start, {_fmt(mach.get('loadavg_end') and mach['loadavg_end'][0], '.1f')} at end"
                    f"{'; PARTIAL: the run did not finish' if partial else ''})\n\n{text}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, md)
        return text

    for name, (suite, only) in chosen.items():
        print(f"[{name}]", flush=True)
        if name in DEFAULT_SUITES:
            def checkpoint(partial_suite, name=name):
                results["suites"][name] = partial_suite
                save(True)
            kw = {"memory": not args.no_memory, "checkpoint": checkpoint}
        else:
            kw = {}
        results["suites"][name] = suite.run(args.quick, only, lambda s: print(s, flush=True), **kw)
    results["machine"]["threading_layer"] = _numba.threading_layer()
    text = save(False)
    print()
    print(text)
    print()
    print(f"wrote {path}, {md} and {', '.join(plots(results, args.out)) or 'no plots'} in {results['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
