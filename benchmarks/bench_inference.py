"""Quantized MoE inference on the CPU against the memory-stream bound (issue 35): suite ``inference``.

``layer``: ``fmoe.moe`` decode (no grad) with swiglu experts M=2048, I=768, E=64, k=6 whose
gate_up_proj and down_proj are packed (MXFP4, NVFP4, FP8 block 128x128; float32 experts, and bfloat16
experts on bfloat16 rows, beside them for the float bound), T = 1, 4, 16 tokens. Each timed call starts
with cold weights: before it, an untimed read of a 512 MiB float32 buffer (larger than this host's L3)
evicts them, and that read's own time is the machine's memory-stream rate, measured in the same run,
interleaved with the variants. The
bound of a call = the busy experts' stored bytes (packed data + scales, both projections) / that
rate; the table reports time / bound for the whole layer and for its two expert GEMM calls alone
(``fmoe.quant.packed.grouped_matmul`` on the plan's rows, the calls the layer makes), and for FP4 the
same calls with the opt-in int8 activations (``activations="int8"``, AVX-512 VNNI) where the CPU has them,
and for the packed formats the whole layer on bf16 rows (what a bf16 model runs), and every format's layer with
its weights on transparent huge pages (``fmoe.quant.huge_pages``, as ``fmoe.examples.generate`` loads them).
"plain read" is the machine's floor for such a call: one contiguous float32 read (``sum``) of as many bytes,
timed as cold as the layer. A cold read of a few MB does not reach the 512 MiB read's rate (page walks,
prefetchers starting, the threads waking), so it is the fairer reference at T = 1. Beside them, timed as
cold: the router's native call alone (``fmoe.routers.route_native``: its GEMM, softmax, top-k and rows) and
one dispatched torch op (``torch.empty(1)``), what every layer call pays before its experts once the read
has evicted the code's cache lines and page-table entries with the data. A model's decode does not pay that:
its previous layer ran the same code over other weights. So each format is also timed as a model calls it
("after its twin"): between the eviction read and the timed call, an untimed call of the same layer over
other weights and another router brings the code back and none of the timed layer's weights.

``model`` (``--model``): the whole-model comparison, fmoe-patched with packed experts vs transformers'
own CPU path on the same written checkpoint (fmoe.examples.generate), each in its own process. Resident
memory (anonymous and file-backed apart) is read after load, at decode b1's steady state (the figure the
issue's target is judged on) and after prefill 512, with the peak. fmoe's loader copies the packed experts
onto huge pages (anonymous, resident from the load); with ``--four-k`` the same rounds also run fmoe with
them memory-mapped from the checkpoint on 4 KiB pages (``fmoe_4k``: paged in as decode first reads them).
Each process also records what bounds the ratios fmoe's MoE blocks can move: the time a decode step
spends inside the MoE blocks (forward hooks, an untimed pass) and the resident memory before any weight
is read (the imports both variants share) with the bytes of its weights. From them: the decode ratio
were fmoe's MoE blocks to take no time, and the memory ratio were fmoe to hold only its imports and
weights; and the MoE blocks' time against the time to stream their bytes once at the process's measured
rate (the layer decode ratio inside a model).

``llamacpp`` (``--llamacpp``; always in the suite): the peer's expert path, llama.cpp
(benchmarks/bench_llamacpp.py), and fmoe's measured the same way beside it, where llama-cpp-python and
gguf are installed; without them the table records why it is missing.

Run: ``python -m benchmarks.bench_inference [--quick] [--repeats N] [--formats mxfp4 ...] [--tokens 1 4 16]
[--llamacpp]`` or ``python -m benchmarks.run --only inference``. Medians; the host is shared: the load average is
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

from benchmarks.bench_common import report

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


def timed_cold(steps: dict, repeats: int, log: Callable[[str], None] = print, *, warm: bool = False,
               buf: Optional[torch.Tensor] = None, before: Optional[dict] = None) -> dict:
    """Interleaved timing, each call after an untimed eviction read of FLUSH_BYTES; the eviction
    reads are timed separately as the stream rate. ``before``: {name: an untimed call run between
    the eviction read and that step's timed call}. {name: median seconds, "stream_gb_per_s": rate},
    and with ``warm`` {"warm": {name: median seconds of the same call repeated at once}}. ``buf``:
    the float32 eviction buffer to read (default: a fresh one of FLUSH_BYTES). Where the kernel
    gives transparent huge pages, every other eviction reads a copy of the buffer on them instead,
    timed apart as "stream_huge_gb_per_s": the machine's stream rate without 4 KiB pages' TLB misses
    (on a virtual machine's nested page tables, each a walk of two tables)."""
    from fmoe.quant import huge_pages, hugepages
    buf = torch.ones(FLUSH_BYTES // 4) if buf is None else buf
    bufs = [buf, huge_pages(buf)] if hugepages.available() else [buf]
    for b in bufs:
        b.sum()
    times = {n: [] for n in steps}
    warm_times = {n: [] for n in steps}
    rates = [[] for _ in bufs]
    order = list(steps)
    for fn in [*steps.values(), *(before or {}).values()]:
        fn()   # warm-up (compiles, allocator)
    i = 0
    for r in range(repeats):
        for name in (order[::-1] if r % 2 else order):
            t0 = time.perf_counter()
            bufs[i % len(bufs)].sum()
            rates[i % len(bufs)].append(FLUSH_BYTES / (time.perf_counter() - t0) / 1e9)
            i += 1
            if before and name in before:
                before[name]()
            t0 = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - t0)
            if warm:
                t0 = time.perf_counter()
                steps[name]()
                warm_times[name].append(time.perf_counter() - t0)
    out = {n: statistics.median(v) for n, v in times.items()}
    out["stream_gb_per_s"] = statistics.median(rates[0])
    if len(bufs) > 1 and rates[1]:
        out["stream_huge_gb_per_s"] = statistics.median(rates[1])
    if warm:
        out["warm"] = {n: statistics.median(v) for n, v in warm_times.items()}
    return out


def layer_decode(formats=("mxfp4", "nvfp4", "fp8_block"), tokens=(1, 4, 16), repeats: int = 15,
                 float_bound: bool = True, log: Callable[[str], None] = print) -> dict:
    import dataclasses

    import fmoe
    from fmoe.quant import huge_pages, hugepages, packed
    from fmoe.routers import route_native
    spec = _spec()
    # the same layer with int8 activations (ExpertSpec.int8_activations: FP4 experts, a VNNI CPU)
    spec8 = dataclasses.replace(spec, experts=dataclasses.replace(spec.experts, int8_activations=True))
    g = torch.Generator().manual_seed(0)
    gate = {"wg": torch.randn(E, M, generator=g) * 0.02}
    fmts = list(formats) + (["float32", "bfloat16"] if float_bound else [])
    weights = {f: {"gate_up_proj": _rand_packed(f, 2 * I, M, g), "down_proj": _rand_packed(f, M, I, g)}
               for f in fmts if f != "bfloat16"}
    if "bfloat16" in fmts:   # bf16 experts on bf16 rows (a bf16 model's layer; the router weight stays float32)
        weights["bfloat16"] = {k: v.bfloat16() for k, v in weights["float32"].items()}
    # the same weights on transparent huge pages (what fmoe.examples.generate's loader does), where the kernel has them
    huge = {f: huge_pages(w) for f, w in weights.items()} if hugepages.available() else {}
    # a model's previous layer: the same shapes and kinds over other weights (its own router too). Called
    # untimed between the eviction read and a timed call, it brings back the code, its page-table entries and
    # the allocator's blocks, and none of the timed layer's weights: the layer as a model's decode calls it
    twin_gate = {"wg": torch.randn(E, M, generator=g) * 0.02}
    twin = {f: {"gate_up_proj": _rand_packed(f, 2 * I, M, g), "down_proj": _rand_packed(f, M, I, g)}
            for f in fmts if f != "bfloat16"}
    if "bfloat16" in fmts:
        twin["bfloat16"] = {k: v.bfloat16() for k, v in twin["float32"].items()}
    res = {"config": {"M": M, "I": I, "E": E, "k": K_TOP, "kind": "swiglu", "repeats": repeats,
                      "native": packed.status()}, "tokens": {}}
    for T in tokens:
        x = torch.randn(T, M, generator=g)
        busy = torch.unique((x @ gate["wg"].T).topk(K_TOP, dim=-1).indices).numel()
        steps, bytes_busy, before = {}, {}, {}
        # what any layer call pays cold before its experts: the router's native call (the GEMM, the softmax,
        # top-k and the rows: fmoe.routers.route_native), and one dispatched torch op (code and page tables
        # evicted with the data: its cost is the machine's, not the op's work)
        steps["route"] = (lambda: route_native(gate, x, spec.gate, num_experts=E, normalize=spec.normalize_gate,
                                               alignment=spec.alignment, fraction=False))
        steps["one_op"] = (lambda: torch.empty(1))
        for f in fmts:
            dt = torch.bfloat16 if f == "bfloat16" else torch.float32
            gf, xf = gate, x.to(dt)   # the float32 router weight init_params gives (fp32_gate)
            params = {"gate": gf, "experts": weights[f]}
            steps[f"layer_{f}"] = (lambda p=params, xf=xf: fmoe.moe(p, xf, spec))
            # the call a model makes (prepared where the experts are packed) after its twin's: code warm, weights cold
            tp = {"gate": twin_gate, "experts": twin[f]}
            if f in ("float32", "bfloat16"):
                steps[f"next_{f}"] = (lambda p=params, xf=xf: fmoe.moe(p, xf, spec))
                before[f"next_{f}"] = (lambda p=tp, xf=xf: fmoe.moe(p, xf, spec))
            else:   # fp32 rows, bf16 rows, and for FP4 on a VNNI CPU int8 activations
                variants = {"next": (spec, xf), "next16": (spec, x.bfloat16())}
                if f in ("mxfp4", "nvfp4") and packed.has_int8_path():
                    variants["next8"] = (spec8, xf)
                for name, (sp, xv) in variants.items():
                    steps[f"{name}_{f}"] = (lambda s=fmoe.prepare(params, sp), xv=xv: s(xv))
                    before[f"{name}_{f}"] = (lambda s=fmoe.prepare(tp, sp), xv=xv: s(xv))
            if huge:
                steps[f"layerhp_{f}"] = (lambda p={"gate": gf, "experts": huge[f]}, xf=xf: fmoe.moe(p, xf, spec))
            bytes_busy[f] = sum(_nbytes(w, busy) for w in weights[f].values())
            if f not in ("float32", "bfloat16"):
                # the machine's floor for this call: one contiguous read of as many bytes, as cold
                steps[f"read_{f}"] = (lambda b=torch.ones(bytes_busy[f] // 4): b.sum())
                # the same layer on bf16 rows (what a bf16 model runs: FP4 takes the bf16 dot-product tiles)
                steps[f"layer16_{f}"] = (lambda p=params, xb=x.bfloat16(): fmoe.moe(p, xb, spec))
                # the same call prepared (fmoe.prepare: what the spec and weights fix decided once; the patched
                # models' blocks run this way)
                steps[f"layerpr_{f}"] = (lambda s=fmoe.prepare(params, spec), xf=xf: s(xf))
                # the layer's two packed expert GEMMs alone, on rows of the same per-expert counts
                counts = torch.bincount((x @ gate["wg"].T).topk(K_TOP, dim=-1).indices.reshape(-1), minlength=E)
                offs = torch.zeros(E + 1, dtype=torch.int64)
                offs[1:] = counts.cumsum(0)
                a = torch.randn(int(offs[-1]), M, generator=g)
                h = torch.randn(int(offs[-1]), I, generator=g)
                wf = weights[f]
                steps[f"gemms_{f}"] = (lambda a=a, h=h, o=offs, wf=wf: (packed.grouped_matmul(a, wf["gate_up_proj"], o),
                                                                      packed.grouped_matmul(h, wf["down_proj"], o)))
                if f in ("mxfp4", "nvfp4") and packed.has_int8_path():   # opt-in int8 activations (VNNI)
                    steps[f"layer8_{f}"] = (lambda p=params: fmoe.moe(p, x, spec8))
                    steps[f"gemms8_{f}"] = (lambda a=a, h=h, o=offs, wf=wf: (
                        packed.grouped_matmul(a, wf["gate_up_proj"], o, activations="int8"),
                        packed.grouped_matmul(h, wf["down_proj"], o, activations="int8")))
        with torch.no_grad():
            t = timed_cold(steps, repeats, log, before=before)
        rate, rate_huge = t["stream_gb_per_s"], t.get("stream_huge_gb_per_s")
        row = {"busy_experts": busy, "stream_gb_per_s": rate, "stream_huge_gb_per_s": rate_huge, "formats": {},
               "route_seconds": t["route"], "one_op_seconds": t["one_op"]}
        for f in fmts:
            bound = bytes_busy[f] / (rate * 1e9)
            r = {"bytes_busy": bytes_busy[f], "bound_seconds": bound, "layer_seconds": t[f"layer_{f}"],
                 "layer_vs_stream": t[f"layer_{f}"] / bound,
                 "read_gb_per_s": bytes_busy[f] / t[f"layer_{f}"] / 1e9}
            for name, key in (("next", "layer_next"), ("next16", "layer_next_bf16"), ("next8", "layer_next_int8")):
                if f"{name}_{f}" in t:
                    r[f"{key}_seconds"] = t[f"{name}_{f}"]
                    r[f"{key}_vs_stream"] = t[f"{name}_{f}"] / bound
            if f"read_{f}" in t:
                r["read_seconds"] = t[f"read_{f}"]
                r["read_vs_stream"] = t[f"read_{f}"] / bound
            if f"gemms_{f}" in t:
                r["gemms_seconds"] = t[f"gemms_{f}"]
                r["gemms_vs_stream"] = t[f"gemms_{f}"] / bound
            if f"gemms8_{f}" in t:
                r["gemms_int8_seconds"] = t[f"gemms8_{f}"]
                r["gemms_int8_vs_stream"] = t[f"gemms8_{f}"] / bound
            if f"layer8_{f}" in t:
                r["layer_int8_seconds"] = t[f"layer8_{f}"]
                r["layer_int8_vs_stream"] = t[f"layer8_{f}"] / bound
            if f"layerhp_{f}" in t:
                r["layer_huge_pages_seconds"] = t[f"layerhp_{f}"]
                r["layer_huge_pages_vs_stream"] = t[f"layerhp_{f}"] / bound
                if rate_huge:   # against the stream rate on huge pages too (the machine's faster limit)
                    r["layer_huge_pages_vs_huge_stream"] = t[f"layerhp_{f}"] / (bytes_busy[f] / (rate_huge * 1e9))
            if f"layer16_{f}" in t:
                r["layer_bf16_seconds"] = t[f"layer16_{f}"]
                r["layer_bf16_vs_stream"] = t[f"layer16_{f}"] / bound
            if f"layerpr_{f}" in t:
                r["layer_prepared_seconds"] = t[f"layerpr_{f}"]
                r["layer_prepared_vs_stream"] = t[f"layerpr_{f}"] / bound
            row["formats"][f] = r
            log(f"  T={T} {f:9s} busy {busy:2d}: layer {r['layer_seconds'] * 1e3:7.2f} ms = "
                f"{r['layer_vs_stream']:.2f}x stream"
                + (f", gemms {r['gemms_seconds'] * 1e3:7.2f} ms = {r['gemms_vs_stream']:.2f}x" if "gemms_seconds" in r else "")
                + (f", plain read {r['read_vs_stream']:.2f}x" if "read_seconds" in r else "")
                + (f", int8 act {r['gemms_int8_vs_stream']:.2f}x" if "gemms_int8_seconds" in r else "")
                + (f", layer int8 act {r['layer_int8_vs_stream']:.2f}x" if "layer_int8_seconds" in r else "")
                + (f", layer bf16 rows {r['layer_bf16_vs_stream']:.2f}x" if "layer_bf16_seconds" in r else "")
                + (f", layer prepared {r['layer_prepared_vs_stream']:.2f}x" if "layer_prepared_seconds" in r else "")
                + f", after its twin {r['layer_next_vs_stream']:.2f}x"
                + (f" (bf16 rows {r['layer_next_bf16_vs_stream']:.2f}x" if "layer_next_bf16_seconds" in r else "")
                + (f", int8 act. {r['layer_next_int8_vs_stream']:.2f}x" if "layer_next_int8_seconds" in r else "")
                + (")" if "layer_next_bf16_seconds" in r else "")
                + (f", layer on huge pages {r['layer_huge_pages_vs_stream']:.2f}x" if "layer_huge_pages_seconds" in r
                   else "")
                + f"  ({rate:.1f} GB/s stream" + (f", {rate_huge:.1f} on huge pages)" if rate_huge else ")"))
        log(f"  T={T} cold, before any expert: the router's native call {t['route'] * 1e3:.3f} ms, one torch op "
            f"{t['one_op'] * 1e6:.0f} us")
        res["tokens"][str(T)] = row
    return res


def layer_prefill(formats=("mxfp4", "nvfp4", "fp8_block"), tokens: int = 512, repeats: int = 7,
                  log: Callable[[str], None] = print) -> dict:
    """Prefill of the same layer: ``fmoe.moe`` on ``tokens`` tokens (no grad) with packed experts,
    against float32 and bfloat16 experts of the same shapes, each with float32 and bfloat16 rows
    where it runs both (bf16 experts: bf16 rows only). Interleaved rounds, medians (warm weights:
    at T = 512 every expert is busy and the GEMMs, not the weight stream, bound the call). Wall
    time, or at one intra-op thread (``--threads 1``) that thread's CPU time, which the other
    tenants of a shared host do not inflate."""
    import fmoe
    spec = _spec()
    g = torch.Generator().manual_seed(1)
    gate = {"wg": torch.randn(E, M, generator=g) * 0.02}
    x = torch.randn(tokens, M, generator=g)
    steps = {}
    for f in list(formats) + ["float32", "bfloat16"]:
        w = {"gate_up_proj": _rand_packed("float32" if f == "bfloat16" else f, 2 * I, M, g),
             "down_proj": _rand_packed("float32" if f == "bfloat16" else f, M, I, g)}
        if f == "bfloat16":
            w = {k: v.bfloat16() for k, v in w.items()}
        for dt in ((torch.bfloat16,) if f == "bfloat16" else (torch.float32, torch.bfloat16)):
            xs = x.to(dt)
            p = {"gate": {"wg": gate["wg"].to(dt)}, "experts": w}
            steps[f"{f}|{str(dt).replace('torch.', '')}"] = (lambda p=p, xs=xs: fmoe.moe(p, xs, spec))
    times = {n: [] for n in steps}
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    with torch.no_grad():
        for fn in steps.values():
            fn()
        order = list(steps)
        for r in range(repeats):
            for n in (order[::-1] if r % 2 else order):
                t0 = clock()
                steps[n]()
                times[n].append(clock() - t0)
    res = {"tokens": tokens, "threads": torch.get_num_threads(), "clock": clock.__name__,
           "seconds": {n: statistics.median(v) for n, v in times.items()}}
    base = res["seconds"]["float32|float32"]
    for n, t in res["seconds"].items():
        log(f"  prefill T={tokens} {n:20s} {t * 1e3:8.1f} ms = {t / base:.2f}x float32 experts (float32 rows)")
    return res


# --------------------------------------------------------------------------- whole model

# /proc/self/status fields of resident memory: VmRSS = RssAnon + RssFile + RssShmem; VmHWM is the
# peak VmRSS so far
_MEMORY_FIELDS = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "VmHWM": "hwm"}


def _memory() -> dict:
    """This process's resident memory in bytes: {"rss", "anon" (heap, tensors), "file" (mapped
    files paged in: shared libraries, a memory-mapped checkpoint), "hwm" (the peak rss so far)}."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in _MEMORY_FIELDS:
                out[_MEMORY_FIELDS[key]] = int(line.split()[1]) * 1024
    return out


def _stream_rate(repeats: int = 5) -> float:
    buf = torch.ones(FLUSH_BYTES // 4)
    ts = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        buf.sum()
        ts.append(time.perf_counter() - t0)
    return FLUSH_BYTES / statistics.median(ts[1:]) / 1e9


def _decode_step_bytes(model, k: int, packed_experts: bool) -> int:
    """Bytes one batch-1 decode step must read: every non-expert weight as stored except the
    embedding table (a gather of one row), packed ones (``generate.PackedLinear``'s attention
    projections) included, the shared experts (packed or not), and k routed experts per MoE layer."""
    from fmoe.quant import QuantizedTensor
    total = 0
    emb = model.get_input_embeddings().weight
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t is emb or ".experts." in name or "rotary" in name:
            continue
        total += t.numel() * t.element_size()
    holders = {id(getattr(layer.mlp, n, None)) for layer in _moe_layers(model) for n in ("experts", "shared_experts")}
    total += sum(v.nbytes for m in model.modules() if id(m) not in holders
                 for v in vars(m).values() if isinstance(v, QuantizedTensor))
    return total + _moe_step_bytes(model, k, packed_experts, routers=False)


def _moe_step_bytes(model, k: int, packed_experts: bool, routers: bool = True) -> int:
    """Bytes a batch-1 decode step's MoE blocks must read: fmoe's packed shared experts (which are
    not parameters), k routed experts per MoE layer and, with ``routers``, every other weight of the
    blocks (routers, float shared experts, biases of the k experts' rows aside)."""
    from fmoe.quant import QuantizedTensor
    total = 0
    for layer in _moe_layers(model):
        if routers:
            total += sum(t.numel() * t.element_size() for name, t in
                         list(layer.mlp.named_parameters()) + list(layer.mlp.named_buffers())
                         if not name.startswith("experts."))
        shared = getattr(layer.mlp, "shared_experts", None)   # fmoe's packed ones (not parameters)
        total += sum(v.nbytes for v in vars(shared).values() if isinstance(v, QuantizedTensor)) if shared else 0
        ex = layer.mlp.experts
        for n in ("gate_up_proj", "gate_proj", "up_proj", "down_proj"):   # (NVFP4 keeps gate and up apart)
            w = getattr(ex, n, None)
            if w is not None:
                total += _nbytes(w, k) if packed_experts else w[0].numel() * w.element_size() * k
    return total


def _moe_layers(model) -> list:
    """The decoder layers whose MLP is an MoE block (DeepSeek's first layers are dense MLPs)."""
    return [layer for layer in model.model.layers if hasattr(layer.mlp, "experts")]


def _weight_bytes(model) -> int:
    """Bytes of every weight the model holds: parameters and buffers (tied ones once) and packed
    experts (fmoe's QuantizedTensors, which are neither)."""
    from fmoe.quant import QuantizedTensor
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    for m in model.modules():   # the routed experts' and (DeepSeek) the shared experts' holders
        total += sum(v.nbytes for v in vars(m).values() if isinstance(v, QuantizedTensor))
    return total


def _moe_block_seconds(model, run) -> float:
    """Seconds spent inside the model's MoE blocks (every MoE ``layer.mlp``'s forward, the router
    included) while ``run()`` runs: forward pre- and post-hooks reading perf_counter."""
    spent = [0.0]

    def pre(_m, _a):
        spent[0] -= time.perf_counter()

    def post(_m, _a, _o):
        spent[0] += time.perf_counter()
    hooks = [h for layer in _moe_layers(model)
             for h in (layer.mlp.register_forward_pre_hook(pre), layer.mlp.register_forward_hook(post))]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return spent[0]


def model_child(variant: str, path: str, arch: str, k: int, repeats: int) -> dict:
    """One variant in its own process (resident memory is the process's): "fmoe" (patched, packed
    experts on huge pages), "fmoe_4k" (the same, its experts left memory-mapped on 4 KiB pages) or
    "transformers" (its CPU path: experts dequantized to bf16; ModelOpt NVFP4, which it does not load
    on a CPU, dequantized by fmoe into its experts: ``generate.load_reference``). bf16 activations.

    Besides the timings and resident memory, it records what bounds the two ratios fmoe can reach
    by its MoE blocks alone: the process's resident memory before any weight is read (Python, torch,
    transformers and the architecture's modeling code, which both variants import) with the bytes
    of the weights it holds, and the time a decode step spends inside the MoE blocks (forward
    hooks, in an untimed pass after the timed steps)."""
    import importlib
    from fmoe.examples import generate as G
    importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
    memory = {"base": _memory()}
    dt = torch.bfloat16
    if variant in ("fmoe", "fmoe_4k"):
        model, _ = G.load_patched(path, arch, dtype=dt, huge_pages=variant == "fmoe")
    elif variant == "transformers":
        model = G.load_reference(path, dtype=dt)
    else:
        raise ValueError(f"model_child: unknown variant {variant!r}")
    import gc
    gc.collect()
    out = {"step_bytes": _decode_step_bytes(model, k, variant != "transformers"), "weight_bytes": _weight_bytes(model),
           "moe_step_bytes": _moe_step_bytes(model, k, variant != "transformers")}
    memory["load"] = _memory()
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size

    def gen(batch, new):
        prompt = torch.randint(1, vocab, (batch, 8), generator=g)
        t0, c0 = time.perf_counter(), time.process_time()
        G.greedy(model, prompt, new)
        return time.perf_counter() - t0, time.process_time() - c0

    def step(batch):   # (wall, CPU) seconds of one decode step: 17 new tokens less 1
        (w1, c1), (w0, c0) = gen(batch, 17), gen(batch, 1)
        return (w1 - w0) / 16, (c1 - c0) / 16

    for batch in (1, 8):
        gen(batch, 2)
        ts = [step(batch) for _ in range(repeats)]
        out[f"decode_b{batch}_tok_per_s"] = batch / statistics.median(t for t, _ in ts)
        # the process's CPU time per step (all threads): on a shared host the wall time also holds
        # the waits of threads descheduled by other work, the CPU time does not
        out[f"decode_b{batch}_cpu_ms_per_step"] = statistics.median(c for _, c in ts) * 1e3
        if batch == 1:   # decode's steady state: the weights it reads paged in, its libraries loaded
            memory["decode"] = _memory()
            moe = [_moe_block_seconds(model, lambda: gen(1, 17)) - _moe_block_seconds(model, lambda: gen(1, 1))
                   for _ in range(repeats)]
            out["decode_b1_moe_ms_per_step"] = statistics.median(moe) / 16 * 1e3
    x = torch.randint(1, vocab, (1, 512), generator=g)
    with torch.no_grad():
        model(x)
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(x)
            ts.append(time.perf_counter() - t0)
    out["prefill_512_tok_per_s"] = 512 / statistics.median(ts)
    memory["prefill"] = _memory()   # before the stream read's 512 MiB buffer raises the peak
    for when, m in memory.items():
        for key, v in m.items():
            if key != "hwm" or when == "prefill":
                out[f"{key}_{when}_bytes"] = v
    out["stream_gb_per_s"] = _stream_rate()
    out["decode_b1_bound_tok_per_s"] = out["stream_gb_per_s"] * 1e9 / out["step_bytes"]
    # the MoE blocks of a decode step against the time to stream their bytes once: the layer decode
    # ratio where a model calls the layer (code warm, each layer's weights cold)
    out["decode_b1_moe_vs_stream"] = (out["decode_b1_moe_ms_per_step"] * 1e-3
                                      / (out["moe_step_bytes"] / (out["stream_gb_per_s"] * 1e9)))
    return out


def model_suite(arch: str = "gpt_oss", size: str = "small", repeats: int = 3, rounds: int = 3,
                log: Callable[[str], None] = print, four_k: bool = False, fmt: Optional[str] = None) -> dict:
    """fmoe-patched (packed experts) vs transformers on the same checkpoint, each in its own process;
    ``rounds`` rounds with the processes alternating (the order reverses each round), each figure
    the median over the rounds (the host drifts by tens of percent between processes). ``four_k``:
    also fmoe with its experts on 4 KiB pages (``fmoe_4k``), in the same rounds. ``fmt``: the
    experts' packed format (``fmoe.examples.generate.FORMATS[arch]``; default its first)."""
    import subprocess
    import sys
    import tempfile
    from fmoe.examples import generate as G
    fmt = G.FORMATS[arch][0] if fmt is None else fmt
    res = {"arch": arch, "format": fmt, "size": size, "config": G.SIZES[size], "threads": torch.get_num_threads(),
           "rounds": rounds, "variants": {}}
    runs = {"fmoe": [], "transformers": []} | ({"fmoe_4k": []} if four_k else {})
    with tempfile.TemporaryDirectory(prefix="fmoe-bench-inference-") as path:
        G.write_checkpoint(path, arch, size, fmt=fmt)
        # flush the new file before the timed processes map it: reads of a fresh file's pages still
        # under writeback ran 10-25 % slower (fmoe maps the packed experts; transformers copies them)
        os.sync()
        res["checkpoint_bytes"] = os.path.getsize(os.path.join(path, "model.safetensors"))
        for rnd in range(rounds):
            for variant in (list(runs) if rnd % 2 == 0 else list(runs)[::-1]):
                cmd = [sys.executable, "-m", "benchmarks.bench_inference", "--model-child", variant, "--checkpoint",
                       path, "--arch", arch, "--k", str(G.SIZES[size]["k"]), "--repeats", str(repeats),
                       "--threads", str(torch.get_num_threads())]
                p = subprocess.run(cmd, capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(
                    os.path.abspath(__file__))), timeout=1800)
                if p.returncode:
                    res["variants"][variant] = {"error": p.stderr[-2000:]}
                    log(f"  {variant}: failed\n{p.stderr[-2000:]}")
                    return res
                r = json.loads(p.stdout.strip().splitlines()[-1])
                r["loadavg_after"] = os.getloadavg()[0]
                runs[variant].append(r)
                log(f"  round {rnd} {arch}/{size} {variant}: decode b1 {r['decode_b1_tok_per_s']:.1f} tok/s (bound "
                    f"{r['decode_b1_bound_tok_per_s']:.0f}; {r['decode_b1_cpu_ms_per_step']:.1f} CPU ms/token), b8 "
                    f"{r['decode_b8_tok_per_s']:.1f} tok/s, prefill 512 "
                    f"{r['prefill_512_tok_per_s']:.0f} tok/s, RSS MiB after load {r['rss_load_bytes'] / 2**20:.0f}, "
                    f"decode b1 {r['rss_decode_bytes'] / 2**20:.0f}, prefill {r['rss_prefill_bytes'] / 2**20:.0f}")
    for variant, rs in runs.items():
        res["variants"][variant] = {key: statistics.median(r[key] for r in rs) for key in rs[0]
                                    if isinstance(rs[0][key], (int, float))}
        res["variants"][variant]["rounds"] = rs
    v = res["variants"]
    res["decode_b1_speedup"] = v["fmoe"]["decode_b1_tok_per_s"] / v["transformers"]["decode_b1_tok_per_s"]
    # the target's figure: resident memory at decode's steady state (weights paged in, libraries loaded);
    # after load flatters a memory-mapped checkpoint, whose pages are only read in by the first steps
    res["rss_ratio"] = v["fmoe"]["rss_decode_bytes"] / v["transformers"]["rss_decode_bytes"]
    for when in ("load", "prefill"):
        res[f"rss_ratio_{when}"] = v["fmoe"][f"rss_{when}_bytes"] / v["transformers"][f"rss_{when}_bytes"]
    res["hwm_ratio"] = v["fmoe"]["hwm_prefill_bytes"] / v["transformers"]["hwm_prefill_bytes"]
    res["decode_b1_cpu_speedup"] = (v["transformers"]["decode_b1_cpu_ms_per_step"]
                                    / v["fmoe"]["decode_b1_cpu_ms_per_step"])
    res["decode_b8_speedup"] = v["fmoe"]["decode_b8_tok_per_s"] / v["transformers"]["decode_b8_tok_per_s"]
    # What fmoe's MoE blocks alone can reach: the decode ratio were they to take no time (transformers'
    # step over fmoe's step less its MoE blocks' time), and the memory ratio were fmoe to hold nothing
    # but its imports and its weights
    f, t = v["fmoe"], v["transformers"]
    f_step, t_step = 1e3 / f["decode_b1_tok_per_s"], 1e3 / t["decode_b1_tok_per_s"]
    res["decode_b1_moe_share"] = {n: r["decode_b1_moe_ms_per_step"] / (1e3 / r["decode_b1_tok_per_s"])
                                  for n, r in v.items()}
    res["decode_b1_speedup_ceiling"] = t_step / max(f_step - f["decode_b1_moe_ms_per_step"], 1e-9)
    res["rss_ratio_floor"] = (f["rss_base_bytes"] + f["weight_bytes"]) / t["rss_decode_bytes"]
    res["prefill_speedup"] = v["fmoe"]["prefill_512_tok_per_s"] / v["transformers"]["prefill_512_tok_per_s"]
    if four_k:   # the huge pages' gain: per round (the two ran side by side), then the median
        res["huge_pages_decode_b1_gain"] = statistics.median(
            a["decode_b1_tok_per_s"] / b["decode_b1_tok_per_s"] for a, b in zip(runs["fmoe"], runs["fmoe_4k"]))
        res["rss_ratio_4k"] = v["fmoe_4k"]["rss_decode_bytes"] / v["transformers"]["rss_decode_bytes"]
    return res


def run(quick: bool, only: Optional[str] = None, log: Callable[[str], None] = print) -> dict:
    out = {"loadavg_start": os.getloadavg()}
    out["layer"] = layer_decode(repeats=7 if quick else 15, log=log)
    out["prefill"] = layer_prefill(repeats=3 if quick else 7, log=log)
    out["model"] = model_suite(repeats=2 if quick else 3, log=log)
    # the peer, where it can be built here (llama-cpp-python, gguf): its expert read rate beside fmoe's
    from . import bench_llamacpp
    out["llamacpp"] = bench_llamacpp.measure(repeats=3 if quick else 5)
    for line in bench_llamacpp.report(out["llamacpp"]):
        log(f"  {line}")
    out["loadavg_end"] = os.getloadavg()
    return out


def tables(res: dict) -> list[str]:
    lay = res.get("layer")
    lines = [f"load average at start {res['loadavg_start'][0]:.1f}, end {res['loadavg_end'][0]:.1f} (2 cores); "
             f"{res.get('threads', torch.get_num_threads())} torch threads", "",
             "| T | busy | format | layer ms | x stream | plain read ms | x stream | expert GEMMs ms | x stream "
             "| GEMMs, int8 act. ms | x stream "
             "| layer, int8 act. ms | x stream | layer, bf16 rows ms | x stream | layer prepared ms | x stream "
             "| layer, huge pages ms | x stream "
             "| x stream on huge pages | stream GB/s | stream on huge pages GB/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"] if lay else []
    for T, row in (lay["tokens"] if lay else {}).items():
        for f, r in row["formats"].items():
            g = f"{r['gemms_seconds'] * 1e3:.2f} | {r['gemms_vs_stream']:.2f}" if "gemms_seconds" in r else " | "
            rd = f"{r['read_seconds'] * 1e3:.2f} | {r['read_vs_stream']:.2f}" if "read_seconds" in r else " | "
            g8 = (f"{r['gemms_int8_seconds'] * 1e3:.2f} | {r['gemms_int8_vs_stream']:.2f}" if "gemms_int8_seconds" in r
                  else " | ")
            l8 = (f"{r['layer_int8_seconds'] * 1e3:.2f} | {r['layer_int8_vs_stream']:.2f}" if "layer_int8_seconds" in r
                  else " | ")
            l16 = (f"{r['layer_bf16_seconds'] * 1e3:.2f} | {r['layer_bf16_vs_stream']:.2f}" if "layer_bf16_seconds" in r
                   else " | ")
            lp = (f"{r['layer_prepared_seconds'] * 1e3:.2f} | {r['layer_prepared_vs_stream']:.2f}"
                  if "layer_prepared_seconds" in r else " | ")
            hp = (f"{r['layer_huge_pages_seconds'] * 1e3:.2f} | {r['layer_huge_pages_vs_stream']:.2f} | "
                  f"{r.get('layer_huge_pages_vs_huge_stream', float('nan')):.2f}" if "layer_huge_pages_seconds" in r
                  else " | | ")
            huge_rate = row.get("stream_huge_gb_per_s")
            lines.append(f"| {T} | {row['busy_experts']} | {f} | {r['layer_seconds'] * 1e3:.2f} | "
                         f"{r['layer_vs_stream']:.2f} | {rd} | {g} | {g8} | {l8} | {l16} | {lp} | {hp} | {row['stream_gb_per_s']:.1f} | "
                         + (f"{huge_rate:.1f} |" if huge_rate else " |"))
    if lay:
        lines += ["", "What a layer call pays cold before any expert (each timed call follows the same eviction read; "
                  "x the busy experts' stream time of the first format):", "",
                  "| T | router's native call, cold ms | one torch op, cold us | x stream |", "|---|---|---|---|"]
        for T, row in lay["tokens"].items():
            if "route_seconds" in row:
                first = next(iter(row["formats"].values()))
                lines.append(f"| {T} | {row['route_seconds'] * 1e3:.3f} | {row['one_op_seconds'] * 1e6:.0f} | "
                             f"{row['route_seconds'] / first['bound_seconds']:.2f} |")
    if lay and any("layer_next_seconds" in r for row in lay["tokens"].values() for r in row["formats"].values()):
        lines += ["", "The layer as a model's decode calls it: after the untimed eviction read, an untimed call of the "
                  "same layer over other weights and router (a model's previous layer: the code, its page-table "
                  "entries and the allocator warm again, none of the timed layer's weights), then the timed call; "
                  "prepared where the experts are packed; packed formats also on bf16 rows and (FP4) with int8 "
                  "activations. Beside it the same call cold (the tables above):", "",
                  "| T | format | after its twin ms | x stream | bf16 rows, x stream | int8 act., x stream "
                  "| cold, x stream | plain read, cold, x stream |",
                  "|---|---|---|---|---|---|---|---|"]
        for T, row in lay["tokens"].items():
            for f, r in row["formats"].items():
                if "layer_next_seconds" not in r:
                    continue
                cold = r.get("layer_prepared_vs_stream", r["layer_vs_stream"])
                rd = f"{r['read_vs_stream']:.2f}" if "read_vs_stream" in r else ""
                b16 = f"{r['layer_next_bf16_vs_stream']:.2f}" if "layer_next_bf16_vs_stream" in r else ""
                i8 = f"{r['layer_next_int8_vs_stream']:.2f}" if "layer_next_int8_vs_stream" in r else ""
                lines.append(f"| {T} | {f} | {r['layer_next_seconds'] * 1e3:.2f} | **{r['layer_next_vs_stream']:.2f}** "
                             f"| {b16} | {i8} | {cold:.2f} | {rd} |")
    pre = res.get("prefill")
    if pre:
        base = pre["seconds"]["float32|float32"]
        b16 = pre["seconds"].get("bfloat16|bfloat16")
        how = f"{pre.get('threads', '?')} thread(s), {pre.get('clock', 'perf_counter')}"
        lines += ["", f"Prefill, T = {pre['tokens']} (the same layer, warm, {how}): experts | rows dtype | ms | x float32 "
                  "experts (float32 rows) | x bf16 experts (bf16 rows)", "",
                  "| experts | rows | ms | x fp32 experts | x bf16 experts |", "|---|---|---|---|---|"]
        for n, t in pre["seconds"].items():
            f, dt = n.split("|")
            rel = f"{t / b16:.2f}" if b16 and dt == "bfloat16" else ""
            lines.append(f"| {f} | {dt} | {t * 1e3:.1f} | {t / base:.2f} | {rel} |")
    mod = res.get("model")
    if mod:
        lines += ["", f"Whole model ({mod['arch']}, {mod.get('format', '')} experts, {mod['size']}: {mod['config']}), "
                  "bf16 activations, "
                  f"{mod.get('threads')} threads; "
                  f"checkpoint {mod['checkpoint_bytes'] / 2**20:.0f} MiB", "",
                  "| variant | decode b1 tok/s | b1 CPU ms/token | b1 stream bound tok/s | decode b8 tok/s | "
                  "prefill 512 tok/s |", "|---|---|---|---|---|---|"]
        for n, r in mod["variants"].items():
            if "error" in r:
                lines.append(f"| {n} | failed | | | | |")
                continue
            lines.append(f"| {n} | {r['decode_b1_tok_per_s']:.1f} | {r['decode_b1_cpu_ms_per_step']:.1f} | "
                         f"{r['decode_b1_bound_tok_per_s']:.0f} | "
                         f"{r['decode_b8_tok_per_s']:.1f} | {r['prefill_512_tok_per_s']:.0f} |")
        lines += _memory_table(mod)
        if "decode_b1_speedup" in mod:
            lines.append(f"\nfmoe / transformers: decode b1 {mod['decode_b1_speedup']:.2f}x (CPU time "
                         f"{mod['decode_b1_cpu_speedup']:.2f}x), b8 {mod['decode_b8_speedup']:.2f}x, prefill "
                         f"{mod['prefill_speedup']:.2f}x, resident memory at decode b1 {mod['rss_ratio']:.2f}x "
                         f"(after load {mod['rss_ratio_load']:.2f}x, after prefill 512 "
                         f"{mod['rss_ratio_prefill']:.2f}x, peak {mod['hwm_ratio']:.2f}x)")
        if "decode_b1_speedup_ceiling" in mod:
            v = mod["variants"]
            moe = ", ".join(f"{n} {r['decode_b1_moe_ms_per_step']:.2f} of {1e3 / r['decode_b1_tok_per_s']:.2f} ms "
                            f"({mod['decode_b1_moe_share'][n]:.0%})" for n, r in v.items())
            base = ", ".join(f"{n} {r['rss_base_bytes'] / 2**20:.0f} MiB + weights {r['weight_bytes'] / 2**20:.0f} MiB"
                             for n, r in v.items())
            if all("decode_b1_moe_vs_stream" in r for r in v.values()):
                lines.append("\nThe MoE blocks of a decode b1 step against the time to stream their bytes once (router, "
                             "shared experts and k routed experts a layer, as each variant stores them), at the stream "
                             "rate its process measured: " + ", ".join(
                                 f"{n} {r['decode_b1_moe_vs_stream']:.2f}x ({r['moe_step_bytes'] / 2**20:.1f} MiB, "
                                 f"{r['stream_gb_per_s']:.1f} GB/s)" for n, r in v.items()))
            lines.append(f"\nWhat the MoE blocks alone can reach: a decode b1 step inside the MoE blocks: {moe}; "
                         f"were fmoe's to take no time, decode b1 would be **{mod['decode_b1_speedup_ceiling']:.2f}x** "
                         f"transformers'. Resident before any weight (imports: Python, torch, transformers, the "
                         f"modeling code) and weights held: {base}; were fmoe to hold nothing else, its memory at "
                         f"decode b1 would be **{mod['rss_ratio_floor']:.2f}x** transformers'.")
        if "huge_pages_decode_b1_gain" in mod:
            lines.append(f"\nfmoe's experts on huge pages / memory-mapped on 4 KiB pages (fmoe_4k), decode b1: "
                         f"{mod['huge_pages_decode_b1_gain']:.2f}x (median of the rounds' ratios); fmoe_4k / "
                         f"transformers resident memory at decode b1 {mod['rss_ratio_4k']:.2f}x")
    lines += _llamacpp_table(res.get("llamacpp"))
    return lines


def _llamacpp_table(peer) -> list[str]:
    """llama.cpp's expert read rate beside fmoe's, measured alike (benchmarks/bench_llamacpp.py)."""
    if not peer:
        return []
    if "skipped" in peer:
        return ["", f"llama.cpp: not measured here: {peer['skipped']}."]
    from . import bench_llamacpp
    sh = peer["shape"]
    lines = ["", f"Expert reads measured alike (decode calls in a row through {sh['layers']} layers; the bytes the "
             f"wider experts add over the time they add), llama.cpp {peer['llama_cpp']} beside fmoe, "
             f"{peer['threads']} threads, stream {peer['stream_GBps']:.1f} GB/s:", "",
             "| expert path | GB/s | of the stream rate |", "|---|---|---|",
             f"| llama.cpp (MXFP4, Q8 rows) | {peer['expert_read_GBps']:.1f} | {peer['expert_read_over_stream']:.2f} |"]
    for act, m in peer["fmoe_marginal"].items():
        lines.append(f"| fmoe, {bench_llamacpp.VARIANTS.get(act, act)} | {m['read_GBps']:.1f} | "
                     f"{m['read_over_stream']:.2f} |")
    return lines


def _memory_table(mod: dict) -> list[str]:
    """Resident memory of each variant, MiB: total (anonymous + file-backed) after load, at decode b1's
    steady state (the figure the target is judged on) and after prefill 512, and the peak."""
    ok = {n: r for n, r in mod["variants"].items() if "error" not in r}
    if not ok:
        return []
    lines = ["", "Resident memory, MiB: total (anonymous + file-backed; /proc/self/status VmRSS = RssAnon + RssFile "
             "+ RssShmem). Judged on: **at decode b1** (after the b1 timings: the weights decode reads paged in, "
             "its libraries loaded); after load a memory-mapped checkpoint is not yet read in. Peak: VmHWM after "
             "prefill 512.", "",
             "| variant | after load | **at decode b1** | after prefill 512 | peak |", "|---|---|---|---|---|"]
    mib = 2 ** 20
    for n, r in ok.items():
        cells = [f"{r[f'rss_{w}_bytes'] / mib:.0f} ({r[f'anon_{w}_bytes'] / mib:.0f} + "
                 f"{r[f'file_{w}_bytes'] / mib:.0f})" for w in ("load", "decode", "prefill")]
        lines.append(f"| {n} | {cells[0]} | **{cells[1]}** | {cells[2]} | {r['hwm_prefill_bytes'] / mib:.0f} |")
    if len(ok) == 2:
        f, t = ok["fmoe"], ok["transformers"]
        ratio = [f"{f[f'rss_{w}_bytes'] / t[f'rss_{w}_bytes']:.2f}x" for w in ("load", "decode", "prefill")]
        lines.append(f"| fmoe / transformers | {ratio[0]} | **{ratio[1]}** | {ratio[2]} | "
                     f"{f['hwm_prefill_bytes'] / t['hwm_prefill_bytes']:.2f}x |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--formats", nargs="+", default=["mxfp4", "nvfp4", "fp8_block"])
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 16])
    p.add_argument("--prefill", type=int, default=512, help="prefill tokens (0: skip the prefill table)")
    p.add_argument("--no-float", action="store_true", help="skip the float32 and bfloat16 experts")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--model", action="store_true", help="also the whole-model comparison")
    p.add_argument("--model-only", action="store_true", help="only the whole-model comparison")
    p.add_argument("--size", default="small", help="whole-model size (fmoe.examples.generate.SIZES)")
    p.add_argument("--rounds", type=int, default=3, help="whole model: alternating rounds of the two processes")
    p.add_argument("--arch", default="gpt_oss", help="whole model: gpt_oss, deepseek_v3 or qwen3_moe")
    p.add_argument("--model-format", default=None,
                   help="whole model: the experts' packed format (default the architecture's first of "
                        "fmoe.examples.generate.FORMATS: gpt_oss mxfp4, deepseek_v3 and qwen3_moe fp8_block; "
                        "qwen3_moe also nvfp4)")
    p.add_argument("--four-k", action="store_true",
                   help="whole model: also fmoe with its experts memory-mapped on 4 KiB pages (no huge pages)")
    p.add_argument("--llamacpp", action="store_true",
                   help="also llama.cpp's expert path beside fmoe's, measured alike (benchmarks.bench_llamacpp; needs "
                        "llama-cpp-python and gguf, else the table says why it is missing)")
    p.add_argument("--model-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", default=None, help=argparse.SUPPRESS)
    p.add_argument("--k", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model_child:
        print(json.dumps(model_child(args.model_child, args.checkpoint, args.arch, args.k, args.repeats)))
        return 0
    res = {"loadavg_start": os.getloadavg(), "threads": torch.get_num_threads()}
    if not args.model_only:
        res["layer"] = layer_decode(args.formats, args.tokens, args.repeats, not args.no_float)
        if args.prefill:
            res["prefill"] = layer_prefill(args.formats, args.prefill, max(3, args.repeats // 2))
    if args.model or args.model_only:
        res["model"] = model_suite(args.arch, args.size, min(args.repeats, 3), args.rounds, four_k=args.four_k,
                                   fmt=args.model_format)
    if args.llamacpp:
        from . import bench_llamacpp
        res["llamacpp"] = bench_llamacpp.measure(repeats=min(args.repeats, 5))
    res["loadavg_end"] = os.getloadavg()
    report(tables(res), res, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
