"""torch.compile and torch.func against eager mode, one process, interleaved.

    python -m benchmarks.bench_compile [--reps 7] [--kinds ffn,swiglu] [--cfs 1.25,0] [--sweep 8] [--per_example 4]
        [--threads 0] [--profile 12] [--json out.json]

Per (kind, capacity factor), a training step (forward + backward of ``fmoe.moe``):

* ``eager``: the rows plan on the native kernels;
* ``compiled``: ``torch.compile(fullgraph=True)`` of the same step (the rows plan's custom op,
  :mod:`fmoe.engine.traced`);
* ``compiled_layout``: compiled with ``MoESpec(plan='layout')``: the staged kernel over the
  layout's buffers, the route compiled calls took before the custom op.

And a sweep of N gate matrices: one ``vmap`` over them (forward: the custom op's vmap rule, one
folded call that multiplies each kept (token, expert) pair once) against N eager calls, and the
same vmap with ``MoESpec(plan='layout')`` (the staged kernel, the route vmapped calls took before);
beside each median wall time, the median process CPU time (a steadier ratio on a shared host)
and minor page faults (first touches of fresh pages) per call, and each variant's peak memory
above the resting set (:func:`benchmarks.bench_common.measure_peak`, after the timings); then the
route alone (``fmoe.route``: gate GEMM, top-k, slot walk, capacity, loss), vmapped against N
eager routes; with ``--profile R``, the R costliest ops of one vmapped call (torch.profiler).
And with ``--per_example B``, per-example gradients of a training loss over B token batches:
``vmap(grad)`` (the op's training fold: shared weights stay E experts, the weight gradients
per (expert, element)) against B eager gradient calls, and the same vmap on the layout plan.
Medians of ``--reps`` rounds, each round running every variant once.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time

import torch
from torch.func import vmap

import fmoe
from benchmarks.bench_common import MIB, measure_peak

KINDS = ("ffn", "gated_ffn", "swiglu", "gpt_oss")


def _spec(kind, cf, M, H, E, k, plan="auto"):
    return fmoe.MoESpec(model_dim=M, num_experts=E, gate=fmoe.GateSpec(k=k, capacity_factor=cf),
                        experts=fmoe.ExpertSpec(type=kind, hidden_size=H), plan=plan)


def _leaves(p):
    return [v for d in p.values() for v in d.values() if v is not None]


def _train_step(spec):
    def step(p, x):
        y, aux = fmoe.moe(p, x, spec)
        return y.square().mean() + aux.l_aux
    return step


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--kinds", default="ffn,swiglu")
    ap.add_argument("--cfs", default="1.25,0")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--model_dim", type=int, default=768)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--sweep", type=int, default=8, help="gate settings in the vmapped sweep (0: none)")
    ap.add_argument("--per_example", type=int, default=0, help="B: per-example gradients over B batches (0: none)")
    ap.add_argument("--per_example_kind", default="swiglu")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--profile", type=int, default=0,
                    help="after the sweep, the ops of one vmapped call by self CPU time, this many rows (0: none)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    T, M, H, E, k = a.tokens, a.model_dim, a.hidden, a.experts, a.k
    x = torch.randn(T, M, generator=torch.Generator().manual_seed(1))
    rows = []
    torch._dynamo.config.recompile_limit = 64   # one compiled step per variant and setting
    for kind in filter(None, a.kinds.split(",")):   # --kinds "": the sweep alone
        for cf in (float(c) for c in a.cfs.split(",")):
            spec, lspec = _spec(kind, cf, M, H, E, k), _spec(kind, cf, M, H, E, k, plan="layout")
            p = fmoe.init_params(spec, generator=torch.Generator().manual_seed(0))
            leaves = _leaves(p)
            for t in leaves:
                t.requires_grad_(True)
            fns = {"eager": _train_step(spec), "compiled": torch.compile(_train_step(spec), fullgraph=True),
                   "compiled_layout": torch.compile(_train_step(lspec), fullgraph=True)}
            runs = {n: (lambda f=f: torch.autograd.grad(f(p, x), leaves)) for n, f in fns.items()}
            for f in runs.values():   # compile and warm up outside the timing
                f()
                f()
            times = {n: [] for n in runs}
            for _ in range(a.reps):
                for n, f in runs.items():
                    times[n].append(_timed(f))
            med = {n: statistics.median(v) for n, v in times.items()}
            row = {"kind": kind, "cf": cf, **{f"{n}_ms": v * 1e3 for n, v in med.items()},
                   "compiled_over_eager": med["compiled"] / med["eager"],
                   "compiled_layout_over_eager": med["compiled_layout"] / med["eager"]}
            rows.append(row)
            print(f"{kind:9s} cf={cf:<5} eager {row['eager_ms']:8.1f} ms | compiled {row['compiled_ms']:8.1f} ms "
                  f"({row['compiled_over_eager']:.2f}x) | compiled, layout plan {row['compiled_layout_ms']:8.1f} ms "
                  f"({row['compiled_layout_over_eager']:.2f}x)", flush=True)
    per_example = _per_example(a, x) if a.per_example else None
    sweep = _sweep(a, x) if a.sweep else None
    out = {"T": T, "M": M, "H": H, "E": E, "k": k, "threads": torch.get_num_threads(), "reps": a.reps,
           "load": os.getloadavg(), "steps": rows, "sweep": sweep, "per_example": per_example}
    if a.json:
        tmp = a.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(out, f, indent=1)
        os.replace(tmp, a.json)
    return out


def _interleaved(fns: dict, reps: int, stats: dict = None) -> dict:
    """Median seconds of each function, every round running each once (after one warm-up each);
    ``stats``, where given, gets each function's median CPU seconds and minor page faults."""
    for f in fns.values():
        f()
    ts, cpu, faults = ({n: [] for n in fns} for _ in range(3))
    for _ in range(reps):
        for n, f in fns.items():
            c0, f0 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            ts[n].append(_timed(f))
            cpu[n].append(time.process_time() - c0)
            faults[n].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    if stats is not None:
        stats.update({n: {"cpu_s": statistics.median(cpu[n]), "minflt": statistics.median(faults[n])} for n in fns})
    return {n: statistics.median(v) for n, v in ts.items()}


def _per_example(a, x) -> dict:
    """vmap(grad) of a training loss over B token batches against B eager gradient calls."""
    T, M, H, E, k, B = a.tokens, a.model_dim, a.hidden, a.experts, a.k, a.per_example
    xs = torch.randn(B, T, M, generator=torch.Generator().manual_seed(3))
    specs = {"vmap": _spec(a.per_example_kind, 1.25, M, H, E, k),
             "vmap_layout": _spec(a.per_example_kind, 1.25, M, H, E, k, plan="layout")}
    p = fmoe.init_params(specs["vmap"], generator=torch.Generator().manual_seed(0))
    loss = {n: _train_step(s) for n, s in specs.items()}
    fns = {n: (lambda f=f: torch.func.vmap(torch.func.grad(f), in_dims=(None, 0))(p, xs)) for n, f in loss.items()}

    def loop():
        q = {g: {kk: (v.detach().requires_grad_() if v is not None else None) for kk, v in d.items()}
             for g, d in p.items()}
        return [torch.autograd.grad(loss["vmap"](q, xx), _leaves(q)) for xx in xs]
    fns["loop"] = loop
    med = _interleaved(fns, a.reps)
    row = {"B": B, "kind": a.per_example_kind, **{f"{n}_ms": v * 1e3 for n, v in med.items()},
           "vmap_over_loop": med["vmap"] / med["loop"], "vmap_layout_over_loop": med["vmap_layout"] / med["loop"]}
    print(f"per-example gradients over {B} batches ({a.per_example_kind} cf=1.25, T={T}): vmap(grad) "
          f"{row['vmap_ms']:.1f} ms ({row['vmap_over_loop']:.2f}x), on the layout plan {row['vmap_layout_ms']:.1f} ms "
          f"({row['vmap_layout_over_loop']:.2f}x), {B} eager gradient calls {row['loop_ms']:.1f} ms", flush=True)
    return row


def _sweep(a, x) -> dict:
    """The vmapped sweep: N gate matrices in one call against N eager calls (forward)."""
    T, M, H, E, k = a.tokens, a.model_dim, a.hidden, a.experts, a.k
    spec = _spec("ffn", 1.25, M, H, E, k)
    p = fmoe.init_params(spec, generator=torch.Generator().manual_seed(0))
    wgs = torch.randn(a.sweep, *p["gate"]["wg"].shape, generator=torch.Generator().manual_seed(2)) * 0.02
    one = lambda wg: fmoe.moe({"gate": {"wg": wg}, "experts": p["experts"]}, x, spec)[0]  # noqa: E731
    spec_layout = _spec("ffn", 1.25, M, H, E, k, plan="layout")
    one_layout = lambda wg: fmoe.moe({"gate": {"wg": wg}, "experts": p["experts"]}, x, spec_layout)[0]  # noqa: E731
    fns = {"vmap": lambda: vmap(one)(wgs), "vmap_layout": lambda: vmap(one_layout)(wgs),
           "loop": lambda: [one(wg) for wg in wgs]}

    def route(wg):   # the route alone (gate GEMM, top-k, slot walk, capacity, loss)
        r, l_aux = fmoe.route({"gate": {"wg": wg}}, x, spec)
        return r.slots, r.weights, l_aux
    routes = {"route_vmap": lambda: vmap(route)(wgs), "route_loop": lambda: [route(wg) for wg in wgs]}
    stats = {}
    with torch.no_grad():
        med = _interleaved(fns, a.reps, stats)
        peak = {n: measure_peak(f, lambda: None)["above_rest_bytes"] for n, f in fns.items()}
        med.update(_interleaved(routes, a.reps, stats))
    sweep = {"N": a.sweep, **{f"{n}_ms": v * 1e3 for n, v in med.items()},
             **{f"{n}_cpu_ms": st["cpu_s"] * 1e3 for n, st in stats.items()},
             **{f"{n}_minflt": st["minflt"] for n, st in stats.items()},
             **{f"{n}_peak_mib": None if v is None else v / MIB for n, v in peak.items()}}
    for v in ("vmap", "vmap_layout"):
        sweep[f"{v}_over_loop"] = sweep[f"{v}_ms"] / sweep["loop_ms"]
        sweep[f"{v}_cpu_over_loop"] = sweep[f"{v}_cpu_ms"] / sweep["loop_cpu_ms"]
    sweep["route_vmap_over_loop"] = sweep["route_vmap_ms"] / sweep["route_loop_ms"]
    if a.profile:
        sweep["profile"] = _profile(fns["vmap"], a.profile)
    mib = lambda n: "?" if sweep[f"{n}_peak_mib"] is None else f"{sweep[f'{n}_peak_mib']:.0f}"  # noqa: E731
    print(f"sweep of {a.sweep} gate settings (ffn cf=1.25, forward, {torch.get_num_threads()} threads): vmap "
          f"{sweep['vmap_ms']:.1f} ms ({sweep['vmap_over_loop']:.2f}x; CPU {sweep['vmap_cpu_over_loop']:.2f}x), "
          f"vmap on the layout plan {sweep['vmap_layout_ms']:.1f} ms ({sweep['vmap_layout_over_loop']:.2f}x), "
          f"{a.sweep} eager calls {sweep['loop_ms']:.1f} ms | minor faults per call: vmap {sweep['vmap_minflt']:.0f}, "
          f"loop {sweep['loop_minflt']:.0f} | peak above rest: vmap {mib('vmap')} MiB, layout {mib('vmap_layout')} "
          f"MiB, loop {mib('loop')} MiB | the route alone: vmapped {sweep['route_vmap_ms']:.1f} ms, {a.sweep} eager "
          f"routes {sweep['route_loop_ms']:.1f} ms", flush=True)
    return sweep


def _profile(fn, rows: int) -> list:
    """The ops of one call of ``fn`` (after a warm-up) by self CPU time: [(name, calls, self ms)],
    printed. The GEMMs are aten::mm / aten::bmm, except the fold's at two or more threads: experts
    side by side call BLAS directly, inside fmoe::expert_rows's self time (with the rows' gathers)."""
    from torch.profiler import ProfilerActivity, profile
    with torch.no_grad():
        fn()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    out = [(e.key, e.count, e.self_cpu_time_total / 1e3) for e in ops[:rows]]
    total = sum(e.self_cpu_time_total for e in ops) / 1e3
    print(f"one vmapped call, {total:.1f} ms of op self time (profiled): " +
          ", ".join(f"{n} {ms:.1f} ms ({c})" for n, c, ms in out), flush=True)
    return out


if __name__ == "__main__":
    main()
