"""The routing walks (fmoe._slots): the C++ extension against its numba twin, first call and warm.

Each implementation runs in a fresh process (the first call is what a process pays once: loading
the extension, or importing numba and loading its compiled walks from numba's cache), then warm
medians of the two walks at decode and training shapes: ``assign_slots`` (fmoe.routing.assign_slots'
CPU path, wrapper included) and ``kept_rows`` (make_plan's CPU walk, wrapper included), and the
process's resident memory at the end (numba's LLVM is the difference). The C++ process also times
``route_rows`` (fmoe.routers.route_native's one call: top-k, gates, slots, rows) at decode shapes, alone
and with the GShard loss made in the same call, against the loss's four torch ops it replaces.

Run: ``python -m benchmarks.bench_walks [--repeats N] [--json PATH]``. Medians; the host is shared.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# (k, T, E): decode (gpt-oss small / the layer at 1 and 16 tokens), prefill, training
SHAPES = [(4, 1, 32), (6, 16, 64), (4, 512, 32), (8, 8192, 64)]
# route_rows' (k, T, E): the issue's layer at 1, 4, 16 and 64 tokens
ROUTE_SHAPES = [(6, 1, 64), (6, 4, 64), (6, 16, 64), (6, 64, 64)]


def _median_us(fn, repeats: int, n: int) -> float:
    ts = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        ts.append((time.perf_counter() - t0) / n)
    return statistics.median(ts[1:]) * 1e6


def route_child(repeats: int) -> dict:
    """route_rows warm, without and with the loss, and the loss's torch ops (C++ process only)."""
    import torch
    from fmoe import _slots
    from fmoe.losses import gshard_loss
    if not _slots.route_rows_ready(6, _slots.ROUTE_TUTEL):
        return {}
    g = torch.Generator().manual_seed(1)
    out = {}
    for k, T, E in ROUTE_SHAPES:
        s = torch.softmax(torch.randn(T, E, generator=g), dim=-1)
        w = _slots.loss_width(T, E)
        frac = _slots.route_rows(s, s, k, _slots.ROUTE_TUTEL, torch.float32, False, -1, -1, 1, True)[12]
        out[f"k={k},T={T},E={E}"] = {
            "route_rows_us": _median_us(lambda: _slots.route_rows(s, s, k, _slots.ROUTE_TUTEL, torch.float32, False,
                                                                  -1, -1, 1, False), repeats, 1000),
            "route_rows_loss_us": _median_us(lambda: _slots.route_rows(s, s, k, _slots.ROUTE_TUTEL, torch.float32,
                                                                       False, -1, -1, 1, True, loss_scores=s,
                                                                       loss_width=w), repeats, 1000),
            "torch_loss_us": _median_us(lambda: gshard_loss(s, None, fraction=frac), repeats, 1000),
            "loss_width": w}
    return out


def child(impl: str, repeats: int) -> dict:
    t0 = time.perf_counter()
    import torch
    t1 = time.perf_counter()
    import fmoe
    from fmoe import _slots
    out = {"import_torch_s": t1 - t0, "import_fmoe_s": time.perf_counter() - t1,
           "numba_after_import": "numba" in sys.modules}
    g = torch.Generator().manual_seed(0)

    def args(k, T, E):
        ids = torch.randint(0, E, (k, T), generator=g)
        slots, counts = fmoe.routing.assign_slots_torch(ids, E)
        buf = torch.empty(E + 2 + k * T, dtype=torch.int64), torch.empty(k * T, dtype=torch.int64)
        return ids, slots, counts, buf

    ids, slots, counts, (o, p) = args(*SHAPES[0])
    t0 = time.perf_counter()
    _slots.assign_slots_fast(ids, SHAPES[0][2], None, impl=impl)
    out["first_assign_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    _slots.kept_rows(ids, slots, counts, 1 << 20, o, p, impl=impl)
    out["first_kept_rows_s"] = time.perf_counter() - t0
    out["shapes"] = {}
    for k, T, E in SHAPES:
        ids, slots, counts, (o, p) = args(k, T, E)
        res = {}
        for name, fn in (("assign_slots", lambda: _slots.assign_slots_fast(ids, E, None, impl=impl)),
                         ("kept_rows", lambda: _slots.kept_rows(ids, slots, counts, 1 << 20, o, p, impl=impl))):
            n = max(1, min(1000, 200_000 // (k * T)))   # calls per timing: ~1 ms or more each
            res[name + "_us"] = _median_us(fn, repeats, n)
        out["shapes"][f"k={k},T={T},E={E}"] = res
    out["numba_at_end"] = "numba" in sys.modules
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "RssAnon:", "RssFile:")):
                out[line.split(":")[0]] = int(line.split()[1]) * 1024
    if impl == "native":   # after the resident memory is read; route_rows has no numba twin
        out["route"] = route_child(repeats)
    return out


def run(repeats: int = 7, rounds: int = 3, log=print) -> dict:
    """``rounds`` fresh processes per implementation, alternating; figures are medians over them."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs = {"native": [], "numba": []}
    for rnd in range(rounds):
        for impl in (("native", "numba") if rnd % 2 == 0 else ("numba", "native")):
            p = subprocess.run([sys.executable, "-m", "benchmarks.bench_walks", "--child", impl, "--repeats",
                                str(repeats)], cwd=root, capture_output=True, text=True, timeout=600)
            if p.returncode:
                raise RuntimeError(f"bench_walks child {impl} failed:\n{p.stderr[-2000:]}")
            runs[impl].append(json.loads(p.stdout.strip().splitlines()[-1]))
    res = {"loadavg": os.getloadavg(), "rounds": runs, "median": {}}
    for impl, rs in runs.items():
        m = {key: statistics.median(r[key] for r in rs) for key in rs[0] if isinstance(rs[0][key], (int, float))
             and not isinstance(rs[0][key], bool)}
        m["numba_at_end"] = any(r["numba_at_end"] for r in rs)
        m["shapes"] = {s: {key: statistics.median(r["shapes"][s][key] for r in rs) for key in rs[0]["shapes"][s]}
                       for s in rs[0]["shapes"]}
        if impl == "native" and rs[0].get("route"):
            m["route"] = {s: {key: statistics.median(r["route"][s][key] for r in rs) for key in rs[0]["route"][s]}
                          for s in rs[0]["route"]}
        res["median"][impl] = m
    return res


def tables(res: dict) -> list[str]:
    med = res["median"]
    n = len(res["rounds"]["native"])
    lines = [f"load average {res['loadavg'][0]:.1f} (2 cores); medians of {n} processes each",
             "", "| walks | import fmoe s | first assign_slots ms | first kept_rows ms | numba loaded | RSS MiB "
             "(anon + file) |", "|---|---|---|---|---|---|"]
    for impl, m in med.items():
        lines.append(f"| {impl} | {m['import_fmoe_s']:.2f} | {m['first_assign_s'] * 1e3:.1f} | "
                     f"{m['first_kept_rows_s'] * 1e3:.2f} | {'yes' if m['numba_at_end'] else 'no'} | "
                     f"{m['VmRSS'] / 2**20:.0f} ({m['RssAnon'] / 2**20:.0f} + {m['RssFile'] / 2**20:.0f}) |")
    lines += ["", "| k, T, E | assign_slots C++ us | numba us | kept_rows C++ us | numba us |", "|---|---|---|---|---|"]
    for s, r in med["native"]["shapes"].items():
        n = med["numba"]["shapes"][s]
        lines.append(f"| {s} | {r['assign_slots_us']:.1f} | {n['assign_slots_us']:.1f} | {r['kept_rows_us']:.1f} | "
                     f"{n['kept_rows_us']:.1f} |")
    route = med["native"].get("route")
    if route:
        lines += ["", "route_rows (C++ only; warm; gates normalised, dropless; + loss: the GShard loss in the same call, "
                  "W = the vector width whose orders it adds in)", "",
                  "| k, T, E | route_rows us | + GShard loss us | the loss's 4 torch ops us | W |", "|---|---|---|---|---|"]
        for s, r in route.items():
            lines.append(f"| {s} | {r['route_rows_us']:.1f} | {r['route_rows_loss_us']:.1f} | "
                         f"{r['torch_loss_us']:.1f} | {r['loss_width']:.0f} |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.repeats)))
        return 0
    res = run(args.repeats, args.rounds)
    from benchmarks.bench_common import report   # here, not at the top: a child's import cost is measured
    report(tables(res), res, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
