"""Where a training step's time and memory go (issue 11 analysis), for one layer config.

    python -m benchmarks.bench_profile --config fine_cf125.gated_ffn [--variant fmoe|tutel] [--tokens N]

Same layer, weights and step as ``bench_layer`` (forward + backward with a fixed upstream gradient).
Prints, and writes to ``--out`` as JSON:

1. time by category: torch.profiler over ``--steps`` steps after a warm-up; self CPU time of
   every op, grouped into routing, dispatch, expert GEMMs, activation, combine, copies /
   allocation and other (autograd engine, Python); the step's wall time next to it;
2. page faults: minor faults per step (getrusage) x the measured cost of faulting one fresh
   page in (a fresh buffer's first fill minus a second fill of the same buffer);
3. saved tensors: every tensor autograd keeps for backward, found by walking the graph from
   the output (``_saved_*`` attributes of built-in nodes, ``saved_tensors`` of custom
   Functions), deduplicated by storage, with the node that holds it; the total next to the
   count from ``torch.autograd.graph.saved_tensors_hooks`` (every pack call);
4. RSS timeline: a thread samples VmRSS every ~0.5 ms during one step; RSS at the end of
   forward, the forward peak and the backward peak, above the resting set.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import subprocess
import sys
import threading
import time

import torch

from . import bench_common as bc
from . import bench_layer as bl

CATEGORIES = [  # (category, substrings of op names); first match wins
    ("dispatch", ("fmoe::dispatch", "dispatch", "encode")),
    ("combine", ("fmoe::combine", "fmoe::gate_grad", "combine", "decode")),
    ("expert GEMMs", ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::addbmm", "grouped_mm",
                      "aten::_grouped_mm", "aten::linear", "aten::matmul", "ragged")),
    ("activation", ("silu", "sigmoid", "aten::mul", "relu", "gelu")),
    ("routing", ("softmax", "topk", "cumsum", "sort", "one_hot", "argmax", "scatter", "gather", "aten::sum",
                 "aten::mean", "aten::div", "aten::lt", "aten::ge", "aten::where", "bincount", "aten::max")),
    ("copies / allocation", ("aten::empty", "aten::zeros", "aten::zero_", "aten::fill_", "aten::copy_",
                             "aten::clone", "aten::contiguous", "aten::cat", "aten::stack", "index",
                             "aten::new_", "aten::resize_", "aten::to", "aten::_to_copy", "aten::narrow_copy")),
]


def category(name: str) -> str:
    low = name.lower()  # Tutel's ops are GatingEncoder / GatingDecoder
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def _statm_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def profile_time(step, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile
    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        wall = (time.perf_counter() - t0) / steps
    ops = collections.defaultdict(float)
    for e in prof.key_averages():
        ops[e.key] += e.self_cpu_time_total / 1e6 / steps
    cats = collections.defaultdict(float)
    for name, s in ops.items():
        cats[category(name)] += s
    top = sorted(ops.items(), key=lambda kv: -kv[1])[:25]
    return {"wall_seconds_profiled": wall, "self_seconds_total": sum(ops.values()),
            "by_category": dict(sorted(cats.items(), key=lambda kv: -kv[1])),
            "top_ops": [{"op": n, "category": category(n), "seconds": s} for n, s in top]}


def page_faults(step) -> dict:
    step()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    step()
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    faults = r1.ru_minflt - r0.ru_minflt
    n = 64 << 20  # 256 MiB of float32: fresh pages vs the same pages again
    costs = []
    for _ in range(3):
        buf = torch.empty(n)
        t0 = time.perf_counter()
        buf.fill_(1.0)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        buf.fill_(2.0)
        costs.append((first - (time.perf_counter() - t0)) / (n * 4 / os.sysconf("SC_PAGE_SIZE")))
        del buf
    per_fault = sorted(costs)[1]
    return {"minor_faults_per_step": faults, "fault_bytes_per_step": faults * os.sysconf("SC_PAGE_SIZE"),
            "seconds_per_fault": per_fault, "fault_seconds_per_step": faults * per_fault, "step_seconds": wall}


def saved_tensors(forward) -> dict:
    packed = []

    def pack(t):
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = forward()
    seen, rows, stack, visited = {}, [], [y.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        found = []
        for attr in dir(node):
            if attr.startswith("_saved_"):
                try:
                    v = getattr(node, attr)
                except Exception:
                    continue
                found += [(attr, t) for t in (v if isinstance(v, (tuple, list)) else [v]) if isinstance(t, torch.Tensor)]
        if hasattr(node, "saved_tensors") and not any(a.startswith("_saved_") for a in dir(node)):
            try:
                found += [("saved_tensors", t) for t in node.saved_tensors if isinstance(t, torch.Tensor)]
            except Exception:
                pass
            # tensors a custom Function keeps as plain ctx attributes (invisible to saved_tensors hooks)
            for attr, v in getattr(node, "__dict__", {}).items():
                for t in (v if isinstance(v, (tuple, list)) else [v]):
                    if isinstance(t, torch.Tensor):
                        found.append(("ctx." + attr, t))
        for attr, t in found:
            key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            nbytes = t.untyped_storage().nbytes()
            rows.append({"node": node.name(), "attr": attr, "shape": list(t.shape), "dtype": str(t.dtype),
                         "storage_bytes": nbytes, "shared": key in seen})
            seen.setdefault(key, nbytes)
        stack += [fn for fn, _ in node.next_functions]
    packed_unique = {(t.untyped_storage().data_ptr()): t.untyped_storage().nbytes() for t in packed}
    rows.sort(key=lambda r: -r["storage_bytes"])
    return {"graph_saved_unique_bytes": sum(seen.values()), "graph_saved_count": len(rows),
            "hook_packed_count": len(packed), "hook_packed_unique_bytes": sum(packed_unique.values()),
            "tensors": rows[:40]}


def rss_timeline(forward, reset, dy) -> dict:
    reset()
    bc._trim()
    rest = _statm_rss()
    samples, stop = [], threading.Event()

    def sampler():
        while not stop.is_set():
            samples.append((time.perf_counter(), _statm_rss()))
            time.sleep(0.0005)

    th = threading.Thread(target=sampler, daemon=True)
    th.start()
    t0 = time.perf_counter()
    y = forward()
    t_fwd = time.perf_counter()
    rss_fwd_end = _statm_rss()
    y.backward(dy)
    t_bwd = time.perf_counter()
    stop.set()
    th.join()
    fwd = [r for t, r in samples if t <= t_fwd] or [rss_fwd_end]
    bwd = [r for t, r in samples if t > t_fwd] or [rss_fwd_end]
    mib = bc.MIB
    return {"rest_mib": rest / mib, "forward_end_above_rest_mib": (rss_fwd_end - rest) / mib,
            "forward_peak_above_rest_mib": (max(fwd) - rest) / mib,
            "backward_peak_above_rest_mib": (max(bwd) - rest) / mib,
            "forward_seconds": t_fwd - t0, "backward_seconds": t_bwd - t_fwd, "samples": len(samples)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_profile", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="fine_cf125.gated_ffn", choices=sorted(bl.BY_NAME))
    ap.add_argument("--variant", default="fmoe", choices=["fmoe", "tutel"])
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=os.path.join("benchmarks", "out"))
    args = ap.parse_args(argv)
    c = bl.BY_NAME[args.config]
    tokens = args.tokens or c.tokens
    layer, x = bl.build(c, tokens, args.variant)
    step, reset = bl.step_fns(layer, x, c.train)
    params = list(layer.parameters())

    def forward():
        for p in params:
            p.grad = None
        x.grad = None
        return layer(x)

    res = {"config": args.config, "variant": args.variant, "tokens": tokens,
           "param_bytes": sum(p.numel() * p.element_size() for p in params),
           "input_bytes": x.numel() * x.element_size()}
    res["time"] = profile_time(step, args.steps)
    res["faults"] = page_faults(step)
    if c.train:
        res["saved"] = saved_tensors(forward)
        reset()
        res["rss"] = rss_timeline(forward, reset, bc.upstream_grad(x))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"profile_{args.config}_{args.variant}.json")
    bc.write_json(path, res)
    t, f = res["time"], res["faults"]
    s, r = res.get("saved"), res.get("rss")
    print(f"{args.config} {args.variant} T={tokens}: profiled step {t['wall_seconds_profiled'] * 1e3:.0f} ms, "
          f"self CPU sum {t['self_seconds_total'] * 1e3:.0f} ms")
    for k, v in t["by_category"].items():
        print(f"  {k:22s} {v * 1e3:8.1f} ms  {v / t['wall_seconds_profiled'] * 100:5.1f}%")
    print("  top ops: " + "; ".join(f"{o['op']} {o['seconds'] * 1e3:.1f}" for o in t["top_ops"][:12]))
    print(f"  page faults: {f['minor_faults_per_step']} / step = {f['fault_bytes_per_step'] / bc.MIB:.0f} MiB "
          f"fresh, ~{f['fault_seconds_per_step'] * 1e3:.1f} ms at {f['seconds_per_fault'] * 1e6:.2f} us/fault "
          f"(unprofiled step {f['step_seconds'] * 1e3:.0f} ms)")
    if not c.train:
        print(f"wrote {path}")
        return 0
    print(f"  saved for backward: {s['graph_saved_unique_bytes'] / bc.MIB:.1f} MiB unique in {s['graph_saved_count']}"
          f" tensors (hooks: {s['hook_packed_count']} packs, {s['hook_packed_unique_bytes'] / bc.MIB:.1f} MiB);"
          f" params {res['param_bytes'] / bc.MIB:.0f} MiB, input {res['input_bytes'] / bc.MIB:.1f} MiB")
    for row in s["tensors"][:14]:
        print(f"    {row['storage_bytes'] / bc.MIB:7.1f} MiB {row['node']}.{row['attr']} {row['shape']} "
              f"{row['dtype']}{' (shared)' if row['shared'] else ''}")
    print(f"  RSS above rest: forward end {r['forward_end_above_rest_mib']:.0f} MiB, forward peak "
          f"{r['forward_peak_above_rest_mib']:.0f}, backward peak {r['backward_peak_above_rest_mib']:.0f} "
          f"(fwd {r['forward_seconds'] * 1e3:.0f} ms, bwd {r['backward_seconds'] * 1e3:.0f} ms, "
          f"{r['samples']} samples)")
    print(f"wrote {path}")
    return 0


PROFILED = ("fine_cf125.gated_ffn", "dropless.gated_ffn")


def run(quick: bool, only, log=print) -> dict:
    """Suite ``profile`` (``python -m benchmarks.run --only profile``): this script for fine_cf125 and
    dropless, fmoe and Tutel, each in its own process; returns {config: {variant: result}}."""
    import tempfile
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for cfg in PROFILED:
            out[cfg] = {}
            for variant in ("fmoe", "tutel"):
                if variant == "tutel" and bl.tutel_status() is not None:
                    out[cfg][variant] = {"skipped": bl.tutel_status()}
                    continue
                cmd = [sys.executable, "-m", "benchmarks.bench_profile", "--config", cfg, "--variant", variant,
                       "--out", tmp, "--steps", "1" if quick else "3"]
                if quick:
                    cmd += ["--tokens", str(bl.BY_NAME[cfg].quick_tokens)]
                p = subprocess.run(cmd, cwd=bc.REPO, capture_output=True, text=True, timeout=600)
                log("\n".join(line for line in p.stdout.splitlines() if not line.startswith("wrote")))
                try:
                    with open(os.path.join(tmp, f"profile_{cfg}_{variant}.json")) as f:
                        out[cfg][variant] = json.load(f)
                except OSError:
                    out[cfg][variant] = {"error": (p.stderr or "no output").strip().splitlines()[-1]}
    return out


if __name__ == "__main__":
    raise SystemExit(main())
