"""Quantized MoE inference on the CPU against the memory-stream bound (issue 35): suite ``inference``.

``layer``: ``fmoe.moe`` decode (no grad) with swiglu experts M=2048, I=768, E=64, k=6 whose
gate_up_proj and down_proj are packed (MXFP4, NVFP4, FP8 block 128x128; float32 beside them for the
float bound), T = 1, 4, 16 tokens. Each timed call starts with cold weights: before it, an untimed
read of a 512 MiB float32 buffer (larger than this host's L3) evicts them, and that read's own time
is the machine's memory-stream rate, measured in the same run, interleaved with the variants. The
bound of a call = the busy experts' stored bytes (packed data + scales, both projections) / that
rate; the table reports time / bound for the whole layer and for its two expert GEMM calls alone
(``fmoe.quant.packed.grouped_matmul`` on the plan's rows, the calls the layer makes).

Run: ``python -m benchmarks.bench_inference [--quick] [--repeats N] [--formats mxfp4 ...] [--tokens 1 4 16]``
or ``python -m benchmarks.run --only inference``. Medians; the host is shared: the load average is
recorded at the start and the end.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Callable, Optional

import torch

M, I, E, K_TOP = 2048, 768, 64, 6
FLUSH_BYTES = 512 << 20


def _rand_packed(fmt: str, n: int, k: int, g: torch.Generator):
    """A random valid packed [E, n, k] weight of fmt (random codes, moderate scales, no NaN bytes):
    what a checkpoint holds, without quantizing gigabytes of floats."""
    from fmoe.quant import QuantizedTensor
    if fmt in ("mxfp4", "nvfp4"):
        data = torch.randint(0, 256, (E, n, k // 2), dtype=torch.uint8, generator=g)
        if fmt == "mxfp4":
            sc = torch.randint(118, 124, (E, n, k // 32), dtype=torch.uint8, generator=g)
            return QuantizedTensor(data, sc, None, "mxfp4", (E, n, k), (1, 32))
        sc = torch.randint(0x30, 0x50, (E, n, k // 16), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
        gs = torch.rand(E, generator=g) * 1e-2 + 1e-3
        return QuantizedTensor(data, sc, gs, "nvfp4", (E, n, k), (1, 16))
    if fmt == "fp8_block":
        b = torch.randint(0, 256, (E, n, k), dtype=torch.uint8, generator=g)
        b[(b & 0x7F) == 0x7F] -= 1
        sc = torch.rand(E, -(-n // 128), -(-k // 128), generator=g) * 1e-3 + 1e-4
        return QuantizedTensor(b.view(torch.float8_e4m3fn), sc, None, "fp8_block", (E, n, k), (128, 128))
    if fmt == "float32":
        return torch.randn(E, n, k, generator=g) * 0.02
    raise ValueError(fmt)


def _nbytes(w, experts: int = E) -> int:
    """Stored bytes of `experts` experts of w (packed data + scales + global scale, or floats)."""
    if isinstance(w, torch.Tensor):
        return w[0].numel() * w.element_size() * experts
    return w.nbytes * experts // w.logical_shape[0]


def _spec():
    import fmoe
    return fmoe.MoESpec(model_dim=M, num_experts=E, gate=fmoe.GateSpec(k=K_TOP, capacity_factor=0.0),
                        experts=fmoe.ExpertSpec(type="swiglu", hidden_size=I))


def timed_cold(steps: dict[str, Callable[[], object]], repeats: int, log: Callable[[str], None] = print) -> dict:
    """Interleaved timing, each call after an untimed eviction read of FLUSH_BYTES; the eviction
    reads are timed separately as the stream rate. {name: median seconds, "stream_gb_per_s": rate}."""
    buf = torch.ones(FLUSH_BYTES // 4)
    buf.sum()
    times = {n: [] for n in steps}
    rates = []
    order = list(steps)
    for fn in steps.values():
        fn()   # warm-up (compiles, allocator)
    for r in range(repeats):
        for name in (order[::-1] if r % 2 else order):
            t0 = time.perf_counter()
            buf.sum()
            rates.append(FLUSH_BYTES / (time.perf_counter() - t0) / 1e9)
            t0 = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - t0)
    out = {n: statistics.median(v) for n, v in times.items()}
    out["stream_gb_per_s"] = statistics.median(rates)
    return out


def layer_decode(formats=("mxfp4", "nvfp4", "fp8_block"), tokens=(1, 4, 16), repeats: int = 15,
                 float_bound: bool = True, log: Callable[[str], None] = print) -> dict:
    import fmoe
    from fmoe.quant import packed
    spec = _spec()
    g = torch.Generator().manual_seed(0)
    gate = {"wg": torch.randn(E, M, generator=g) * 0.02}
    fmts = list(formats) + (["float32"] if float_bound else [])
    weights = {f: {"gate_up_proj": _rand_packed(f, 2 * I, M, g), "down_proj": _rand_packed(f, M, I, g)} for f in fmts}
    res = {"config": {"M": M, "I": I, "E": E, "k": K_TOP, "kind": "swiglu", "repeats": repeats,
                      "native": packed.status()}, "tokens": {}}
    for T in tokens:
        x = torch.randn(T, M, generator=g)
        busy = torch.unique((x @ gate["wg"].T).topk(K_TOP, dim=-1).indices).numel()
        steps, bytes_busy = {}, {}
        for f in fmts:
            params = {"gate": gate, "experts": weights[f]}
            steps[f"layer_{f}"] = (lambda p=params: fmoe.moe(p, x, spec))
            bytes_busy[f] = sum(_nbytes(w, busy) for w in weights[f].values())
            if f != "float32":
                # the layer's two packed expert GEMMs alone, on rows of the same per-expert counts
                counts = torch.bincount((x @ gate["wg"].T).topk(K_TOP, dim=-1).indices.reshape(-1), minlength=E)
                offs = torch.zeros(E + 1, dtype=torch.int64)
                offs[1:] = counts.cumsum(0)
                a = torch.randn(int(offs[-1]), M, generator=g)
                h = torch.randn(int(offs[-1]), I, generator=g)
                wf = weights[f]
                steps[f"gemms_{f}"] = (lambda a=a, h=h, o=offs, wf=wf: (packed.grouped_matmul(a, wf["gate_up_proj"], o),
                                                                      packed.grouped_matmul(h, wf["down_proj"], o)))
        with torch.no_grad():
            t = timed_cold(steps, repeats, log)
        rate = t["stream_gb_per_s"]
        row = {"busy_experts": busy, "stream_gb_per_s": rate, "formats": {}}
        for f in fmts:
            bound = bytes_busy[f] / (rate * 1e9)
            r = {"bytes_busy": bytes_busy[f], "bound_seconds": bound, "layer_seconds": t[f"layer_{f}"],
                 "layer_vs_stream": t[f"layer_{f}"] / bound,
                 "read_gb_per_s": bytes_busy[f] / t[f"layer_{f}"] / 1e9}
            if f"gemms_{f}" in t:
                r["gemms_seconds"] = t[f"gemms_{f}"]
                r["gemms_vs_stream"] = t[f"gemms_{f}"] / bound
            row["formats"][f] = r
            log(f"  T={T} {f:9s} busy {busy:2d}: layer {r['layer_seconds'] * 1e3:7.2f} ms = "
                f"{r['layer_vs_stream']:.2f}x stream"
                + (f", gemms {r['gemms_seconds'] * 1e3:7.2f} ms = {r['gemms_vs_stream']:.2f}x" if "gemms_seconds" in r else "")
                + f"  ({rate:.1f} GB/s stream)")
        res["tokens"][str(T)] = row
    return res


def run(quick: bool, only: Optional[str] = None, log: Callable[[str], None] = print) -> dict:
    out = {"loadavg_start": os.getloadavg()}
    out["layer"] = layer_decode(repeats=7 if quick else 15, log=log)
    out["loadavg_end"] = os.getloadavg()
    return out


def tables(res: dict) -> list[str]:
    lay = res.get("layer")
    if not lay:
        return []
    lines = [f"load average at start {res['loadavg_start'][0]:.1f}, end {res['loadavg_end'][0]:.1f} (2 cores)", "",
             "| T | busy | format | layer ms | x stream | expert GEMMs ms | x stream | stream GB/s |",
             "|---|---|---|---|---|---|---|---|"]
    for T, row in lay["tokens"].items():
        for f, r in row["formats"].items():
            g = f"{r['gemms_seconds'] * 1e3:.2f} | {r['gemms_vs_stream']:.2f}" if "gemms_seconds" in r else " | "
            lines.append(f"| {T} | {row['busy_experts']} | {f} | {r['layer_seconds'] * 1e3:.2f} | "
                         f"{r['layer_vs_stream']:.2f} | {g} | {row['stream_gb_per_s']:.1f} |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--formats", nargs="+", default=["mxfp4", "nvfp4", "fp8_block"])
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 16])
    p.add_argument("--no-float", action="store_true", help="skip the float32 experts")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    res = {"loadavg_start": os.getloadavg()}
    res["layer"] = layer_decode(args.formats, args.tokens, args.repeats, not args.no_float)
    res["loadavg_end"] = os.getloadavg()
    print("\n".join(tables(res)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
