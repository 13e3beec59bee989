"""Packed-weight decode kernels (fmoe/ops/csrc/packed_gemm.cpp) against a float32 GEMV of the same bytes.

``single``: one warm expert [N=1536, K=2048] per format (mxfp4, nvfp4, mxfp8, fp8_block, fp8_row), one
activation row, 1 thread, every ISA path the CPU has (forced), the native call alone (no Python front;
``front_auto``: through ``grouped_matmul``; ``new_int8``: FP4 with the opt-in int8 activations; ``new_bf16``: FP4
with bf16 rows, the bf16 dot-product tiles on an AVX-512 BF16 CPU), timed by the thread's CPU time (``time.thread_time``),
interleaved with ``torch.mv`` over a float32 matrix holding as many bytes as the packed expert (data +
scales). Reports GB/s of stored bytes read and the ratio to that GEMV rate.

``multi``: E=64 experts [1536, 2048] (gate_up_proj's shape at M=2048, I=768), T = 1, 4, 16 tokens routed
top-6 (about 6 / 21 / 54 busy experts), 2 threads, through ``fmoe.quant.packed.grouped_matmul`` (the call
the layer makes), cold: each timed call follows an untimed 512 MiB read (bench_inference.timed_cold),
beside a cold float32 GEMV of the busy experts' packed bytes; ratio = call time / GEMV time.

``--old PATH`` times a second build of the extension (e.g. the previous commit's source compiled as
``fmoe_packed_gemm_old``: Python keeps one module per name) in the same run, interleaved, so before/after
share the host's noise. Medians of ``--repeats`` samples.

``cold`` (``--cold``): the layer's two packed GEMMs alone (bench_inference's swiglu experts: gate_up_proj
[E, 1536, 2048] then down_proj [E, 2048, 768], E=64, top-6 routed by a random gate), T = 1, 4, 16, 2 threads,
cold (each call after an untimed 512 MiB read), as x = time / (busy experts' stored bytes / stream rate), the
stream rate being that of the same run's eviction reads. Steps, interleaved: ``new`` this build's native call
(operands and outputs prepared once, so no Python front), ``old`` the ``--old`` build the same way, ``front``
``grouped_matmul`` (what the layer calls), and ``read``: a plain torch reduction (2 threads, no C++ of ours)
over the same busy experts' bytes, the ceiling for these buffer sizes (a few MiB per expert, one call each).

``layer`` (``--layer``): ``fmoe.moe`` decode with packed experts at 1 thread, CPU time, new vs ``--old``
(see :func:`layer`).

``prefill`` (``--prefill``): one packed grouped GEMM call at prefill shapes (E=64, ``--prefill-rows`` rows per
expert, T * k / E = 48 at T = 512, k = 6; gate_up_proj [1536, 2048] and down_proj [2048, 768]), 2 threads,
warm, float32 and bf16 rows, against the same GEMM on the weights already decoded to the rows' dtype
(``fmoe.ops.native.gather_mm``, what float experts run; see :func:`prefill`).

Run: ``python -m benchmarks.bench_packed_kernels [--repeats 15] [--formats ...] [--rows 1 4] [--old OLD.so]
[--no-single] [--no-multi] [--layer] [--cold] [--prefill]``.
"""
from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import os
import statistics
import time

import torch

FORMATS = ("mxfp4", "nvfp4", "mxfp8", "fp8_block", "fp8_row")
N, K, E, TOP = 1536, 2048, 64, 6


def _load_so(path: str):
    # Python keeps one module per extension name, so the other build must carry its own name
    # (the file's stem, e.g. fmoe_packed_gemm_old.so built from the old source under that name)
    name = os.path.basename(path).split(".")[0]
    if name == "fmoe_packed_gemm":
        raise ValueError(f"--old {path}: build it under another module name (its file stem), e.g. "
                         f"fmoe.ops.native.compile_extension('fmoe_packed_gemm_old', OLD.cpp, .../fmoe_packed_gemm_old.so, ...)")
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def _weights(fmt: str, experts: int, g: torch.Generator):
    import fmoe.quant as Q
    # quantize one expert's floats and repeat it: valid codes and scales without quantizing 64 experts
    w = Q.quantize(torch.randn(1, N, K, generator=g), fmt)
    rep = lambda t: None if t is None else t.expand(experts, *t.shape[1:]).contiguous()  # noqa: E731
    if experts == 1:
        return w
    return Q.QuantizedTensor(rep(w.data), rep(w.scales), rep(w.global_scale), fmt, (experts, N, K), w.block)


def _call(ext, a, offsets, w, isa: int, int8: bool = False, n: int = N):
    from fmoe.quant import _codecs as C
    from fmoe.quant import packed
    data, scales, table, fp4, bn, bk, gs = packed._operands(w)
    out = torch.empty(a.shape[0], n)
    return lambda: ext.packed_grouped_mm(a, offsets, data, scales, table, C.E4M3_TABLE, gs, fp4, bn, bk, out, isa,
                                         packed.DENSE_FROM, int8, *_trailing(ext, None))


def _trailing(ext, a16) -> tuple:
    # the trailing arguments an older build may lack: bf16 rows (arg14), the blas flag (arg15), the
    # bf16 dot-product tiles' flag (arg16)
    doc = ext.packed_grouped_mm.__doc__ or ""
    return (a16, True, True) if "arg16" in doc else (a16, True) if "arg15" in doc else (a16,) if "arg14" in doc else ()


def _interleaved(steps: dict, repeats: int, inner: int, clock=time.perf_counter) -> dict:
    times = {n: [] for n in steps}
    for fn in steps.values():
        fn()
    order = list(steps)
    for r in range(repeats):
        for name in (order[::-1] if r % 2 else order):
            fn = steps[name]
            t0 = clock()
            for _ in range(inner):
                fn()
            times[name].append((clock() - t0) / inner)
    return {n: statistics.median(v) for n, v in times.items()}


def single(formats, repeats: int, old=None, rows=(1,), log=print) -> dict:
    from fmoe.quant import packed
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    best = packed.ISAS[packed.best_isa()]
    isas = [i for i in ("avx2", "avx512") if packed.ISAS[i] <= best]
    res = {}
    for fmt, R in [(f, r) for r in rows for f in formats]:
        a = torch.randn(R, K, generator=g)
        off = torch.tensor([0, R], dtype=torch.int64)
        w = _weights(fmt, 1, g)
        nbytes = w.nbytes
        wf = torch.randn(nbytes // 4 // K, K, generator=g)
        xf = torch.randn(K, generator=g)
        steps = {"gemv": lambda: torch.mv(wf, xf)}
        if R > 1:   # the same bytes against R rows: an fp32 GEMM of R rows
            xr = torch.randn(K, R, generator=g)
            steps["gemv"] = lambda: torch.mm(wf, xr)
        for isa in isas:
            steps[f"new_{isa}"] = _call(packed._EXT, a, off, w, packed.ISAS[isa])
            if old is not None:
                steps[f"old_{isa}"] = _call(old, a, off, w, packed.ISAS[isa])
        steps["front_auto"] = lambda: packed.grouped_matmul(a, w, off)
        if fmt in ("mxfp4", "nvfp4") and packed.has_int8_path():   # opt-in int8 activations (VNNI)
            steps["new_int8"] = _call(packed._EXT, a, off, w, 0, True)
            if old is not None:
                steps["old_int8"] = _call(old, a, off, w, 0, True)
        if fmt in ("mxfp4", "nvfp4"):   # bf16 rows (a bf16 model's): the dot-product tiles where the CPU has them
            a16 = a.bfloat16()
            steps["new_bf16"] = _prefill_call(packed._EXT, a16.float(), a16, off, w, N)
            if old is not None:
                steps["old_bf16"] = _prefill_call(old, a16.float(), a16, off, w, N)
        # this thread's CPU time: on the shared 2-core host a wall clock mostly times the other tenants
        t = _interleaved(steps, repeats, inner=10, clock=time.thread_time)
        gemv = wf.numel() * 4 / t["gemv"] / 1e9
        row = {"bytes": nbytes, "gemv_gb_per_s": gemv}
        for name, s in t.items():
            if name != "gemv":
                row[name] = {"gb_per_s": nbytes / s / 1e9, "vs_gemv": nbytes / s / 1e9 / gemv, "us": s * 1e6}
        res[f"{fmt}_rows{R}"] = row
        log(f"  {fmt:9s} rows {R:2d} {nbytes / 2**20:5.2f} MiB  gemv {gemv:5.1f} GB/s | " + "  ".join(
            f"{n} {row[n]['gb_per_s']:5.1f} ({row[n]['vs_gemv']:.2f})" for n in t if n != "gemv"))
    return res


def multi(formats, tokens, repeats: int, old=None, log=print) -> dict:
    from fmoe.quant import packed

    from .bench_inference import timed_cold
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(1)
    res = {}
    for fmt in formats:
        w = _weights(fmt, E, g)
        per_expert = w.nbytes // E
        for T in tokens:
            idx = torch.randn(T, E, generator=g).topk(TOP, dim=-1).indices.reshape(-1)
            counts = torch.bincount(idx, minlength=E)
            busy = int((counts > 0).sum())
            off = torch.zeros(E + 1, dtype=torch.int64)
            off[1:] = counts.cumsum(0)
            a = torch.randn(int(off[-1]), K, generator=g)
            nbytes = busy * per_expert
            wf = torch.randn(nbytes // 4 // K, K, generator=g)
            xf = torch.randn(K, generator=g)
            steps = {"gemv": lambda: torch.mv(wf, xf), "new": lambda: packed.grouped_matmul(a, w, off)}
            if old is not None:
                steps["old"] = _call(old, a, off, w, 0)
            with torch.no_grad():
                t = timed_cold(steps, repeats, log)
            row = {"busy": busy, "rows": int(off[-1]), "bytes": nbytes, "stream_gb_per_s": t["stream_gb_per_s"],
                   "gemv_gb_per_s": wf.numel() * 4 / t["gemv"] / 1e9}
            for name in steps:
                if name != "gemv":
                    row[name] = {"ms": t[name] * 1e3, "gb_per_s": nbytes / t[name] / 1e9, "vs_gemv": t[name] / t["gemv"]}
            res[f"{fmt}_T{T}"] = row
            log(f"  {fmt:9s} T={T:2d} busy {busy:2d}: gemv {row['gemv_gb_per_s']:5.1f} GB/s | " + "  ".join(
                f"{n} {row[n]['ms']:6.2f} ms {row[n]['gb_per_s']:5.1f} GB/s ({row[n]['vs_gemv']:.2f}x gemv)"
                for n in steps if n != "gemv"))
    return res


def _read_step(ws, busy_ids):
    """A torch reduction over the busy experts' stored bytes (data and scales) of every weight in ws:
    each expert's contiguous block viewed as int32 words and reduced with max (vectorized, no widening
    to int64, unlike a sum of integers; no float specials, unlike a float view)."""
    views = []
    for w in ws:
        for t in (w.data, w.scales):
            b = t.view(torch.uint8)
            for e in busy_ids:
                blk = b[e].reshape(-1)
                n = blk.numel() // 4 * 4
                views.append(blk[:n].view(torch.int32))
    return lambda: [v.max() for v in views]


def cold(formats, tokens, repeats: int, old=None, threads: int = 2, log=print) -> dict:
    """The layer's two packed expert GEMMs alone, cold, ``threads`` threads, against the same run's
    stream rate (module docstring, ``cold``). Rows: median and min of each step as a multiple of the
    busy bytes' stream time. At 1 thread every time (the stream reads' too) is the thread's CPU time,
    which the other tenants of a shared host do not inflate; at 2 threads wall time (a thread that
    waits for its partner counts)."""
    from fmoe.quant import packed

    from . import bench_inference as BI
    torch.set_num_threads(threads)
    clock = time.thread_time if threads == 1 else time.perf_counter
    g = torch.Generator().manual_seed(3)
    wg = torch.randn(BI.E, BI.M, generator=g) * 0.02
    buf = torch.ones(BI.FLUSH_BYTES // 4)
    buf.sum()
    res = {}
    for fmt in formats:
        wu, wd = BI._rand_packed(fmt, 2 * BI.I, BI.M, g), BI._rand_packed(fmt, BI.M, BI.I, g)
        for T in tokens:
            x = torch.randn(T, BI.M, generator=g)
            idx = (x @ wg.T).topk(BI.K_TOP, dim=-1).indices.reshape(-1)
            counts = torch.bincount(idx, minlength=BI.E)
            busy_ids = torch.nonzero(counts).reshape(-1).tolist()
            off = torch.zeros(BI.E + 1, dtype=torch.int64)
            off[1:] = counts.cumsum(0)
            R = int(off[-1])
            a, h = torch.randn(R, BI.M, generator=g), torch.randn(R, BI.I, generator=g)
            nbytes = sum(BI._nbytes(w, len(busy_ids)) for w in (wu, wd))

            def pair(ext, a=a, h=h, off=off):
                f1, f2 = _call(ext, a, off, wu, 0, n=2 * BI.I), _call(ext, h, off, wd, 0, n=BI.M)
                return lambda: (f1(), f2())
            steps = {"new": pair(packed._EXT)}
            if old is not None:
                steps["old"] = pair(old)
            steps["front"] = lambda a=a, h=h, off=off: (packed.grouped_matmul(a, wu, off), packed.grouped_matmul(h, wd, off))
            steps["read"] = _read_step((wu, wd), busy_ids)
            times = {n: [] for n in steps}
            rates = []
            order = list(steps)
            with torch.no_grad():
                for fn in steps.values():
                    fn()
                for r in range(repeats):
                    for name in (order[::-1] if r % 2 else order):
                        t0 = clock()
                        buf.sum()
                        rates.append(BI.FLUSH_BYTES / (clock() - t0) / 1e9)
                        t0 = clock()
                        steps[name]()
                        times[name].append(clock() - t0)
            rate = statistics.median(rates)
            bound = nbytes / (rate * 1e9)
            row = {"threads": threads, "busy": len(busy_ids), "rows": R, "bytes": nbytes, "stream_gb_per_s": rate, "bound_us": bound * 1e6}
            for name, v in times.items():
                row[name] = {"us": statistics.median(v) * 1e6, "min_us": min(v) * 1e6,
                             "x": statistics.median(v) / bound, "min_x": min(v) / bound}
            res[f"{fmt}_T{T}"] = row
            log(f"  {fmt:9s} T={T:2d} busy {len(busy_ids):2d} {nbytes / 2**20:5.1f} MiB: stream {rate:5.1f} GB/s, "
                f"bound {bound * 1e6:6.0f} us | " + "  ".join(
                    f"{n} {row[n]['us']:6.0f} us {row[n]['x']:.2f}x (min {row[n]['min_x']:.2f})" for n in times))
    return res


def layer(formats, tokens, repeats: int, old=None, log=print) -> dict:
    """``fmoe.moe`` decode with packed experts (bench_inference's layer: swiglu M=2048 I=768 E=64 k=6)
    at 1 thread, cold weights, timed by the thread's CPU time, the new build and (``old``) the other
    one swapped in as ``packed._EXT``, interleaved. The bound is the busy experts' stored bytes over
    the CPU-time rate of a 1-thread read of the 512 MiB eviction buffer in the same loop: the
    scheduler's preemptions on the shared host count in neither."""
    import fmoe
    from fmoe.quant import packed

    from . import bench_inference as BI
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(2)
    spec = BI._spec()
    gate = {"wg": torch.randn(BI.E, BI.M, generator=g) * 0.02}
    buf = torch.ones(BI.FLUSH_BYTES // 4)
    buf.sum()
    exts = {"new": packed._EXT}
    if old is not None:
        exts["old"] = old
    res = {}
    try:
        for fmt in formats:
            wts = {"gate_up_proj": BI._rand_packed(fmt, 2 * BI.I, BI.M, g), "down_proj": BI._rand_packed(fmt, BI.M, BI.I, g)}
            params = {"gate": gate, "experts": wts}
            for T in tokens:
                x = torch.randn(T, BI.M, generator=g)
                busy = torch.unique((x @ gate["wg"].T).topk(BI.K_TOP, dim=-1).indices).numel()
                nbytes = sum(BI._nbytes(w, busy) for w in wts.values())
                cpu = {n: [] for n in exts}
                rates = []
                order = list(exts)
                with torch.no_grad():
                    for name in order:
                        packed._EXT = exts[name]
                        fmoe.moe(params, x, spec)
                    for r in range(repeats):
                        for name in (order[::-1] if r % 2 else order):
                            c0 = time.thread_time()
                            buf.sum()
                            rates.append(BI.FLUSH_BYTES / (time.thread_time() - c0) / 1e9)
                            packed._EXT = exts[name]
                            c0 = time.thread_time()
                            fmoe.moe(params, x, spec)
                            cpu[name].append(time.thread_time() - c0)
                rate = statistics.median(rates)
                bound = nbytes / (rate * 1e9)
                row = {"busy": busy, "bytes": nbytes, "stream_cpu_gb_per_s": rate, "bound_ms": bound * 1e3}
                for name in exts:
                    t = statistics.median(cpu[name])
                    row[name] = {"cpu_ms": t * 1e3, "vs_stream": t / bound}
                res[f"{fmt}_T{T}"] = row
                log(f"  {fmt:9s} T={T:2d} busy {busy:2d}: bound {bound * 1e3:6.2f} ms ({rate:.1f} GB/s) | " + "  ".join(
                    f"{n} {row[n]['cpu_ms']:6.2f} ms = {row[n]['vs_stream']:.2f}x" for n in exts))
    finally:
        packed._EXT = exts["new"]
    return res


def _prefill_call(ext, a, a16, off, w, n: int, isa: int = 0):
    """The native call with float32 rows a, or bf16 rows a16 (a being their float32 copy), as
    packed._native passes them."""
    from fmoe.quant import _codecs as C
    from fmoe.quant import packed
    data, scales, table, fp4, bn, bk, gs = packed._operands(w)
    out = torch.empty(a.shape[0], n)
    b16 = a16 if a16 is not None and (fp4 or scales.dtype == torch.float32) else None
    return lambda: ext.packed_grouped_mm(a, off, data, scales, table, C.E4M3_TABLE, gs, fp4, bn, bk, out, isa,
                                         packed.DENSE_FROM, False, *_trailing(ext, b16))


def prefill(formats, rows: int, repeats: int, old=None, threads: int = 2, log=print) -> dict:
    """One packed grouped GEMM call at prefill shapes, warm, ``threads`` threads (1: timed by the thread's CPU
    time; 2: wall time): E=64 experts with ``rows``
    rows each, for gate_up_proj [1536, 2048] and down_proj [2048, 768] (bench_inference's layer). Steps,
    interleaved, medians: ``new`` (and ``old``, the ``--old`` build) the native call with float32 rows and
    with bf16 rows (the call packed.grouped_matmul makes, without its Python front); ``f32`` / ``bf16`` the
    same products on the weights decoded once beforehand to float32 / bf16 (``gather_mm``, what float
    experts run, auto regime); ``f32_par`` / ``bf16_par`` the same in gather_mm's parallel regime (one
    single-threaded GEMM per expert, the packed call's threading). The packed call's time less the
    decoded GEMM's is what decoding costs it (decode, its stores and reloads, the smaller BLAS calls)."""
    from fmoe.ops import native as NO
    from fmoe.quant import packed
    from fmoe.quant.formats import dequantize

    from . import bench_inference as BI
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(4)
    off = torch.arange(0, (BI.E + 1) * rows, rows, dtype=torch.int64)
    res = {}
    for name, (n, k) in {"gate_up": (2 * BI.I, BI.M), "down": (BI.M, BI.I)}.items():
        a = torch.randn(BI.E * rows, k, generator=g)
        a16 = a.bfloat16()
        a16f = a16.float()
        for fmt in formats:
            w = BI._rand_packed(fmt, n, k, g)
            w32 = dequantize(w)
            w16 = w32.bfloat16()
            steps = {"new_f32": _prefill_call(packed._EXT, a, None, off, w, n),
                     "new_bf16": _prefill_call(packed._EXT, a16f, a16, off, w, n)}
            if old is not None:
                steps["old_f32"] = _prefill_call(old, a, None, off, w, n)
                steps["old_bf16"] = _prefill_call(old, a16f, a16, off, w, n)
            steps["f32"] = lambda: NO.gather_mm(a, w32, off, transposed=True)
            steps["f32_par"] = lambda: NO.gather_mm(a, w32, off, transposed=True, regime="parallel")
            steps["bf16"] = lambda: NO.gather_mm(a16, w16, off, transposed=True)
            steps["bf16_par"] = lambda: NO.gather_mm(a16, w16, off, transposed=True, regime="parallel")
            if threads == 1:   # no parallel regime to compare at one thread
                del steps["f32_par"], steps["bf16_par"]
            with torch.no_grad():
                # one thread: its CPU time, which the other tenants of a shared host do not inflate
                t = _interleaved(steps, repeats, inner=1, clock=time.thread_time if threads == 1 else time.perf_counter)
            row = {n_: v * 1e3 for n_, v in t.items()}
            res[f"{name}_{fmt}"] = row
            log(f"  {name:7s} {fmt:9s} ms: " + "  ".join(f"{n_} {v:6.1f}" for n_, v in row.items())
                + f" | new/f32 {t['new_f32'] / t['f32']:.2f}x, new_bf16/bf16 {t['new_bf16'] / t['bf16']:.2f}x")
            del w32, w16
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 16])
    p.add_argument("--rows", nargs="+", type=int, default=[1], help="activation rows of the single-expert call")
    p.add_argument("--old", default=None, help="path of another build of fmoe_packed_gemm to time beside this one")
    p.add_argument("--no-single", action="store_true")
    p.add_argument("--no-multi", action="store_true")
    p.add_argument("--layer", action="store_true", help="also fmoe.moe decode at 1 thread, CPU time (see layer())")
    p.add_argument("--cold", action="store_true", help="also the layer's two GEMMs cold vs the stream (see cold())")
    p.add_argument("--cold-threads", type=int, default=2, choices=(1, 2),
                   help="threads of --cold (1: CPU time, robust on a shared host; 2: wall time)")
    p.add_argument("--prefill", action="store_true", help="also one call at prefill shapes (see prefill())")
    p.add_argument("--prefill-rows", type=int, default=48, help="rows per expert of --prefill (T * k / E)")
    p.add_argument("--prefill-threads", type=int, default=2, choices=(1, 2),
                   help="threads of --prefill (1: the thread's CPU time, robust on a shared host; 2: wall time)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    from fmoe.quant import packed
    packed.build(verbose=False)
    old = _load_so(args.old) if args.old else None
    with open("/proc/loadavg") as f:
        load0 = f.read().split()[:3]
    print(f"{packed.status()}; load average {' '.join(load0)}")
    out = {"status": packed.status(), "loadavg_start": load0}
    if not args.no_single:
        print("single expert [1536, 2048], one row, warm, 1 thread: GB/s of stored bytes (ratio to the fp32 GEMV)")
        out["single"] = single(args.formats, args.repeats, old, args.rows)
    if not args.no_multi:
        print("E=64 [1536, 2048], top-6 routed rows, cold, 2 threads")
        out["multi"] = multi(args.formats, args.tokens, args.repeats, old)
    if args.layer:
        print("fmoe.moe decode, swiglu M=2048 I=768 E=64 k=6, cold, 1 thread, CPU time: x = time / (bytes / stream)")
        out["layer"] = layer([f for f in args.formats if f in ("mxfp4", "nvfp4", "fp8_block")], args.tokens, args.repeats, old)
    if args.cold:
        print(f"the layer's two packed GEMMs (swiglu M=2048 I=768 E=64 k=6), cold, {args.cold_threads} thread(s): "
              f"x = time / (bytes / stream)")
        out["cold"] = cold([f for f in args.formats if f in ("mxfp4", "nvfp4", "fp8_block")], args.tokens, args.repeats, old,
                           args.cold_threads)
    if args.prefill:
        print(f"prefill: one grouped GEMM, E=64, {args.prefill_rows} rows per expert, warm, {args.prefill_threads} "
              f"thread(s), medians (ms)")
        out["prefill"] = prefill([f for f in args.formats if f in ("mxfp4", "nvfp4", "fp8_block")], args.prefill_rows,
                                 args.repeats, old, args.prefill_threads)
    with open("/proc/loadavg") as f:
        out["loadavg_end"] = f.read().split()[:3]
    print(f"load average at the end: {' '.join(out['loadavg_end'])}")
    if args.json:
        from fmoe._io import atomic_write_text
        atomic_write_text(args.json, json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
