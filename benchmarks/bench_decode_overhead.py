"""Host overhead of one decode call through ``fmoe.moe``, by section, warm and cold (issue 35).

The layer of ``benchmarks.bench_inference`` (swiglu experts M=2048, I=768, E=64, k=6, dropless
top-k router; packed MXFP4 and float32 experts), T = 1 and 4 tokens, under no_grad. Sections,
each timed as its own call on the routing / plan / rows the layer makes:

* ``layer``: the whole ``fmoe.moe`` call;
* ``layer_host`` (packed formats): the same call with the packed extension's kernel replaced by a
  fill of its output with zeros, so everything but the C++ GEMM (Python, small torch ops,
  allocations; the kernel's own argument checks excluded) is timed in place; where the layer
  takes the fused expert stage (``fmoe.quant.packed.expert_stage``, one native call from the
  gather to the combine), that call is replaced by a zero [T, O] output, so the stage's C++
  gather, activation and combine are left out with its GEMMs;
* ``checks``: ``moe._check_input`` + ``moe.check_params``;
* ``route``: ``moe._route`` (router GEMM, scores, top-k, finiteness check, slots, capacity, the
  Routing and the GShard loss; where the router's native call runs, the plan's rows too);
* ``plan``: ``engine.make_plan`` + ``plan.row_weights`` (given the native call's rows where it made them);
* ``experts``: ``fmoe.experts.routed_experts`` (door, expert form, plan, ``kinds.run``: both GEMMs included);
* ``gemms`` (packed): the layer's two ``fmoe.quant.packed.grouped_matmul`` calls on rows of the
  plan's shape; ``gemms_check``: their argument validation alone (``packed._check``, where the
  tree has it).

``warm``: the sections called round robin, back to back. ``cold``: each call after an untimed read
of 512 MiB (bench_inference's eviction), as bench_inference times the layer. Medians and 20th
percentiles (the host is shared; the low percentile is the less disturbed figure).

``layer_host`` for float32 experts stubs the float grouped-GEMM extension the same way (gather_mm
zeroes its output, mm_scatter adds nothing). ``--grad`` times with grad enabled and the float
parameters requiring gradients (a training step's forward) instead of under no_grad. Each run
also counts the dispatched aten ops of one warm ``layer_host`` and ``route`` call (torch.profiler:
the aten events no other aten op encloses; ``layer_host``, since the extensions' GEMMs dispatch
aten ops of their own).

``--compare DIR`` times another checkout (e.g. ``git archive <commit> | tar -x -C DIR``) against
this one: the two run in alternating child processes (A B A B ...), each for ``--rounds`` rounds,
and the table gives both and their ratio. The children import fmoe from their own tree.

Run: ``python -m benchmarks.bench_decode_overhead [--repeats 200] [--cold-repeats 25] [--tokens 1 4]
[--formats mxfp4 float32] [--grad] [--compare DIR --rounds 3] [--json PATH]``.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

FLUSH_BYTES = 512 << 20


class _NoKernel:
    """The packed extension with its GEMM a no-op (``layer_host``): every other attribute is the real one."""

    def __init__(self, ext):
        self._ext = ext

    def __getattr__(self, name):
        return getattr(self._ext, name)

    @staticmethod
    def packed_grouped_mm(*args):
        # the output (argument 10) zeroed, not left as torch.empty's garbage: the activation after
        # it would otherwise run on whatever bytes the allocator returned (denormals and NaNs slow
        # silu by two orders of magnitude, and which bytes come back varies between trees)
        args[10].zero_()
        return 0

    @staticmethod
    def packed_expert_stage(*args):
        # the fused stage (fmoe.quant.packed.expert_stage): its zero output [T, O] in x's dtype
        # (x: argument 0; the weights' data: the first list argument, the out-projection's last),
        # so the whole native stage (gather, GEMMs, activation, combine: all C++) is left out
        data = next(a for a in args if isinstance(a, list))
        return args[0].new_zeros((args[0].shape[0], data[-1].shape[1]))


class _NoFloatKernel(_NoKernel):
    """The float grouped-GEMM extension with its GEMMs no-ops (float ``layer_host``): gather_mm
    zeroes its output (argument 5), mm_scatter leaves its zeroed output as it is."""

    @staticmethod
    def gather_mm(*args):
        args[5].zero_()

    @staticmethod
    def mm_scatter(*args):
        return None


def _stubbed(module, stub, fn):
    """``fn()`` with ``module._EXT`` replaced by ``stub(module._EXT)``."""
    ext = module._EXT
    module._EXT = stub(ext)
    try:
        return fn()
    finally:
        module._EXT = ext


def _quantiles(v: list) -> dict:
    s = sorted(v)
    return {"median": statistics.median(s), "p20": s[len(s) // 5]}


def _time(steps: dict, repeats: int, cold: bool) -> dict:
    if repeats < 1:
        return {}
    buf = torch.ones(FLUSH_BYTES // 4) if cold else None
    times = {n: [] for n in steps}
    order = list(steps)
    for fn in steps.values():
        for _ in range(3):
            fn()   # warm-up (numba, allocator)
    for r in range(repeats):
        for name in (order[::-1] if r % 2 else order):
            if cold:
                buf.sum()
            t0 = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - t0)
    return {n: _quantiles(v) for n, v in times.items()}


def sections(fmt: str, T: int, grad: bool = False):
    """{name: zero-argument callable} for one format and token count (imports fmoe from sys.path);
    ``grad``: the float parameters require gradients (time the calls under enable_grad)."""
    from benchmarks.bench_inference import E, I, M, _rand_packed, _spec
    import fmoe  # noqa: F401
    moe = importlib.import_module("fmoe.moe")
    from fmoe.engine import plan as _plan
    from fmoe.ops import native
    from fmoe.quant import packed
    spec = _spec()
    g = torch.Generator().manual_seed(0)
    gate = {"wg": torch.randn(E, M, generator=g) * 0.02}
    w = {"gate_up_proj": _rand_packed(fmt, 2 * I, M, g), "down_proj": _rand_packed(fmt, M, I, g)}
    if grad:   # a training step's forward: every float parameter takes a gradient
        gate["wg"].requires_grad_()
        for v in w.values():
            if isinstance(v, torch.Tensor):
                v.requires_grad_()
    params = {"gate": gate, "experts": w}
    x = torch.randn(T, M, generator=g)
    kind = spec.layout_kind(1)

    def route():
        return moe._route(params, x, spec, kind, comm=None, generator=None, noise=None, training=False, alignment=1)

    # where the router's native call made the plan's rows with the routing (fmoe.routers.route_native),
    # the plan and experts sections take them as the layer does
    # (a tree from before the native route, under --compare, returns three and takes no rows)
    routed = route()
    routing, rows = routed[0], (routed[3] if len(routed) > 3 else None)
    given = {} if rows is None else {"rows": rows}

    def plan():
        p = _plan.make_plan(routing, needs_grad=False, dtype=torch.float32, **given)
        return rows.row_gates if rows is not None and rows.row_gates is not None else p.row_weights(routing.weights)

    def checks():
        moe._check_input(x, spec)
        moe.check_params(params, spec)

    steps = {"layer": lambda: fmoe.moe(params, x, spec), "checks": checks, "route": route, "plan": plan,
             "experts": lambda: fmoe.experts.routed_experts(spec.experts, w, x, routing, layout_kind=kind, **given)}
    if fmt != "float32":
        pl = _plan.make_plan(routing, needs_grad=False, dtype=torch.float32)
        a, h = torch.randn(pl.num_rows, M, generator=g), torch.randn(pl.num_rows, I, generator=g)
        steps["gemms"] = lambda: (packed.grouped_matmul(a, w["gate_up_proj"], pl.offsets),
                                  packed.grouped_matmul(h, w["down_proj"], pl.offsets))
        check = getattr(packed, "_check_args", None) or getattr(packed, "_check", None)
        if check is not None:
            steps["gemms_check"] = lambda: (check(a, w["gate_up_proj"], pl.offsets), check(h, w["down_proj"], pl.offsets))
        if packed.AVAILABLE:
            steps["layer_host"] = lambda: _stubbed(packed, _NoKernel, lambda: fmoe.moe(params, x, spec))
    elif native.AVAILABLE:
        steps["layer_host"] = lambda: _stubbed(native, _NoFloatKernel, lambda: fmoe.moe(params, x, spec))
    return steps


def count_ops(fn) -> int:
    """Dispatched aten ops of one (warm) call of ``fn``: the torch.profiler's aten:: events that
    no other aten op encloses (what the Python side asked the dispatcher for)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    n = 0
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        p = e.cpu_parent
        while p is not None and not p.name.startswith("aten::"):
            p = p.cpu_parent
        n += p is None
    return n


def measure(formats, tokens, repeats: int, cold_repeats: int, only=None, grad: bool = False) -> dict:
    out = {"threads": torch.get_num_threads(), "loadavg_start": os.getloadavg()[0], "runs": {}}
    with torch.set_grad_enabled(grad):
        for fmt in formats:
            for T in tokens:
                steps = sections(fmt, T, grad)
                # (layer_host: the extension's GEMMs call aten ops of their own, which are no host work)
                ops = {n: count_ops(steps[n]) for n in ("layer_host", "route") if n in steps}
                if only:
                    steps = {n: f for n, f in steps.items() if n in only}
                out["runs"][f"{fmt} T={T}"] = {"warm": _time(steps, repeats, False),
                                                "cold": _time(steps, cold_repeats, True), "ops": ops}
    out["loadavg_end"] = os.getloadavg()[0]
    return out


def _child(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    res = measure(args.formats, args.tokens, args.repeats, args.cold_repeats, args.sections, args.grad)
    from fmoe._io import atomic_write_text
    atomic_write_text(args.child, json.dumps(res))
    return 0


def _merge(runs: list) -> dict:
    """Median over child runs of each section's median and p20 (the op counts: the first run's)."""
    out, ops = {}, {}
    for key in runs[0]["runs"]:
        out[key] = {}
        ops[key] = runs[0]["runs"][key].get("ops", {})
        for mode in ("warm", "cold"):
            out[key][mode] = {n: {q: statistics.median(r["runs"][key][mode][n][q] for r in runs)
                                  for q in ("median", "p20")}
                              for n in runs[0]["runs"][key][mode] if all(n in r["runs"][key][mode] for r in runs)}
    return out, ops


def _spawn(tree: str, args, path: str) -> dict:
    here = os.path.abspath(__file__)
    cmd = [sys.executable, here, "--child", path, "--repeats", str(args.repeats), "--cold-repeats",
           str(args.cold_repeats), "--formats", *args.formats, "--tokens", *map(str, args.tokens)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.grad:
        cmd += ["--grad"]
    if args.sections:
        cmd += ["--sections", *args.sections]
    env = dict(os.environ, PYTHONPATH=tree)
    subprocess.run(cmd, cwd=tree, env=env, check=True)
    with open(path) as f:
        return json.load(f)


def table(res: dict, base: dict = None) -> list:
    lines = []
    for key, modes in res.items():
        for mode, secs in modes.items():
            if not secs:
                continue
            lines += ["", f"{key}, {mode} (us: median / p20" + (", this tree vs --compare" if base else "") + ")", "",
                      "| section | " + ("this tree | compare | ratio (p20) |" if base else "median | p20 |"),
                      "|---|---|---|" + ("---|" if base else "")]
            for n, q in secs.items():
                if base:
                    b = base[key][mode].get(n)
                    other = f"{b['median'] * 1e6:.0f} / {b['p20'] * 1e6:.0f}" if b else "-"
                    ratio = f"{q['p20'] / b['p20']:.2f}" if b else "-"
                    lines.append(f"| {n} | {q['median'] * 1e6:.0f} / {q['p20'] * 1e6:.0f} | {other} | {ratio} |")
                else:
                    lines.append(f"| {n} | {q['median'] * 1e6:.0f} | {q['p20'] * 1e6:.0f} |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=200, help="warm calls per section")
    p.add_argument("--cold-repeats", type=int, default=25, help="cold calls per section")
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 4])
    p.add_argument("--formats", nargs="+", default=["mxfp4", "float32"])
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--sections", nargs="+", default=None, help="time only these sections (e.g. the host-only ones: "
                   "layer_host route plan checks gemms_check; without the GEMM sections warm calls stay warm)")
    p.add_argument("--grad", action="store_true", help="time with grad enabled and the float parameters "
                   "requiring gradients (a training step's forward) instead of under no_grad")
    p.add_argument("--compare", default=None, help="another checkout to time against this one")
    p.add_argument("--rounds", type=int, default=3, help="child runs per tree with --compare")
    p.add_argument("--json", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return _child(args)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as d:
        mine, other = [], []
        for r in range(args.rounds if args.compare else 1):
            mine.append(_spawn(here, args, os.path.join(d, f"a{r}.json")))
            if args.compare:
                other.append(_spawn(os.path.abspath(args.compare), args, os.path.join(d, f"b{r}.json")))
    (this, ops), (base, base_ops) = _merge(mine), (_merge(other) if other else (None, None))
    res = {"this": this, "compare": base, "ops": ops, "compare_ops": base_ops, "grad": args.grad,
           "threads": mine[0]["threads"], "loadavg": [r["loadavg_start"] for r in mine + other]}
    print(f"{res['threads']} torch threads{', grad enabled' if args.grad else ', no_grad'}; load average at each "
          f"child's start {res['loadavg']}")
    print("\n".join(table(res["this"], res["compare"])))
    print("\ndispatched aten ops per call (" + ("this tree / compare" if base_ops else "this tree") + ")\n")
    for key, n in ops.items():
        print(f"{key}: " + ", ".join(f"{s} {c}" + (f" / {base_ops[key].get(s, '-')}" if base_ops else "")
                                     for s, c in n.items()))
    if args.json:
        from fmoe._io import atomic_write_text
        atomic_write_text(args.json, json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
