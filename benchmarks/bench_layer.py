"""Issue-11 layer suite: ``fmoe.nn.MoELayer`` (default settings) vs Tutel's layer on the same
weights, vs the dense-GEMM roofline (training) and the weight-stream bound (decode), with the
peak memory of each variant measured in its own process.

Every config runs once per expert kind a user can pick (``KINDS``: ffn with relu, ffn with gelu,
gated_ffn, swiglu, gpt_oss), named ``<config>.<kind>``. Per config, timed round-robin one step
each per repeat (medians):

    fmoe           MoELayer(gate_type={'type': 'top', k, capacity_factor}, experts of the kind:
                   ffn with Tutel's defaults (both biases), gated_ffn without biases, swiglu,
                   gpt_oss) -- defaults otherwise; training = forward + backward with a fixed
                   upstream gradient (y.backward(dy)) and x.requires_grad (dx is computed, as
                   inside a network);
                   decode = eval() forward under no_grad
    tutel          tutel.moe.moe_layer with the same experts ('ffn' with the same activation,
                   'llama_ffn' for gated_ffn), its state dict loaded from the fmoe layer's (same
                   names, same weights; the outputs are compared once); for swiglu, Tutel's
                   'llama_ffn' of the same sizes (the same SwiGLU math, its own weights); skipped
                   for gpt_oss (Tutel has no clamped GLU) and when ``import tutel`` fails
    fmoe_staged    the staged pipeline (``plan="layout"``: dispatch -> seam -> combine)
    fmoe_recompute gated_ffn training only: ``save='recompute'``
    dense_flat     training only: the 9 GEMMs of a SwiGLU FFN fwd+bwd on one [kept, M] matrix
    dense_batched  training only: the same on [E, ceil(kept/E), M] (per-expert shapes, balanced)
    dense_loop     training only: dense_batched's shapes as one torch.mm per expert (the calls a
                   per-expert MoE makes; splits T1's gap into per-expert GEMM calls and the rest)
    weights_read   decode only: one read (a sum) of all experts' weights; the stream bound is
                   busy experts' bytes / the bandwidth this step achieves
    expert_gemms   decode only: the step's expert GEMMs alone, as fmoe issues them on the same
                   weights and per-expert row counts (bench_common.expert_gemms_step): the
                   floor that no gather, activation or scatter work can lower

Useful GFLOP/s counts the expert GEMMs on kept (routed, non-dropped) rows only: kept x 6·M·H
(x3 for training; 4·M·H per row for ffn's two GEMMs). "vs dense" divides it by dense_batched's rate (the same per-expert shapes,
perfectly balanced) of the same run; "vs flat" by dense_flat's (one GEMM of the same FLOPs).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.nn.functional as F

import fmoe.nn
from fmoe.experts import expert_form

from . import bench_common as bc

MODULE = "benchmarks.bench_layer"
MAX_SECONDS = 12.0   # a variant stops being timed once its steps add up to this (>= 1 step each)


@dataclasses.dataclass(frozen=True)
class LayerConfig:
    name: str
    tokens: int
    model_dim: int
    hidden: int
    experts: int
    k: int
    cf: float          # > 0 padded capacity factor, 0 dropless (Tutel's meaning too)
    train: bool
    quick_tokens: Optional[int] = None
    expert: str = "gated_ffn"

    def flop_per_row(self) -> int:
        gemms = 2 if self.expert.startswith("ffn") else 3
        return gemms * 2 * self.model_dim * self.hidden


# name -> (MoELayer experts dict extras, Tutel experts dict or None)
KINDS = {"ffn_relu": ({"type": "ffn", "activation_fn": F.relu}, {"type": "ffn", "activation_fn": F.relu}),
         "ffn_gelu": ({"type": "ffn", "activation_fn": F.gelu}, {"type": "ffn", "activation_fn": F.gelu}),
         "gated_ffn": ({"type": "gated_ffn", "has_fc1_bias": False, "has_fc2_bias": False}, {"type": "llama_ffn"}),
         "swiglu": ({"type": "swiglu"}, {"type": "llama_ffn"}),
         "gpt_oss": ({"type": "gpt_oss"}, None)}
WEIGHTS_COPIED = ("ffn_relu", "ffn_gelu", "gated_ffn")   # Tutel gets fmoe's state dict (same names)

BASES = [
    LayerConfig("coarse", 2048, 512, 1024, 8, 2, 1.25, True, quick_tokens=256),
    LayerConfig("fine_cf125", 4096, 768, 384, 32, 4, 1.25, True, quick_tokens=512),
    LayerConfig("fine_cf2", 4096, 768, 384, 32, 4, 2.0, True, quick_tokens=512),
    LayerConfig("dropless", 4096, 768, 384, 32, 4, 0.0, True, quick_tokens=512),
    LayerConfig("fine_e64k8", 2048, 768, 256, 64, 8, 1.25, True, quick_tokens=256),
    LayerConfig("fine_e128k8", 2048, 768, 384, 128, 8, 1.25, True, quick_tokens=256),
    LayerConfig("decode_16", 16, 1024, 512, 64, 6, 0.0, False),
    LayerConfig("decode_64", 64, 1024, 512, 64, 6, 0.0, False),
]
CONFIGS = [dataclasses.replace(b, name=f"{b.name}.{k}", expert=k) for b in BASES for k in KINDS]
# Not in the full run: "smoke", a seconds-long config for tests/test_benchmarks.py; "overhead",
# M = H = 8 with 64 experts, where a step is the per-expert Python and dispatch cost and little else
# (python -m benchmarks.bench_ab --only overhead).
SMOKE = LayerConfig("smoke", 256, 128, 64, 8, 2, 1.25, True)
OVERHEAD = LayerConfig("overhead", 2048, 8, 8, 64, 4, 0.0, True)
BY_NAME = {c.name: c for c in CONFIGS + [SMOKE, OVERHEAD]}
BY_BASE = {b.name: [c.name for c in CONFIGS if c.name.startswith(b.name + ".")] for b in BASES}
QUICK = ("fine_cf125.gated_ffn",)      # what --quick runs when no --only is given
TUTEL_GEOMEAN = tuple(f"{b}.{k}" for b in ("coarse", "fine_cf125", "fine_cf2", "decode_16") for k in KINDS)
MEMORY_VS_TUTEL = tuple(f"{b}.{k}" for b in ("fine_cf125", "dropless") for k in KINDS)


def tutel_status() -> Optional[str]:
    """None when Tutel's layer imports, else why not (the column is skipped)."""
    try:
        from tutel import moe as _  # noqa: F401
    except Exception as exc:
        return f"not installed ({type(exc).__name__}: {exc})"
    return None


# fmoe variants beside the default layer (the expert engine, projections saved for backward):
# the engine recomputing them, and the staged pipeline.
FMOE_VARIANTS = {"fmoe": {}, "fmoe_recompute": {"save": "recompute"}, "fmoe_staged": {"plan": "layout"}}


def variants_of(c: LayerConfig) -> list:
    """The fmoe variants timed beside the default for this config (recompute: gated_ffn training)."""
    return [n for n in FMOE_VARIANTS if n != "fmoe" and (n != "fmoe_recompute" or (c.train and c.expert == "gated_ffn"))]


def build(c: LayerConfig, tokens: int, variant: str):
    """(layer, x) for one variant; the fmoe layer's weights are drawn from seed 0, Tutel gets a copy
    where its experts hold the same names (:data:`WEIGHTS_COPIED`)."""
    if c.expert not in KINDS:
        raise ValueError(f"unknown expert kind {c.expert!r}; one of {sorted(KINDS)}")
    kind, tutel_kind = KINDS[c.expert]
    layer = fmoe.nn.MoELayer({"type": "top", "k": c.k, "capacity_factor": c.cf}, c.model_dim,
                             experts={**kind, "num_experts_per_device": c.experts, "hidden_size_per_expert": c.hidden},
                             generator=torch.Generator().manual_seed(0),
                             **FMOE_VARIANTS.get(variant, {}))
    if variant == "tutel":
        if tutel_kind is None:
            raise ValueError(f"Tutel has no {c.expert} expert")
        from tutel import moe as tutel_moe
        t = tutel_moe.moe_layer(gate_type={"type": "top", "k": c.k, "capacity_factor": c.cf, "fp32_gate": True},
                                model_dim=c.model_dim,
                                experts={**tutel_kind, "num_experts_per_device": c.experts,
                                         "hidden_size_per_expert": c.hidden})
        if c.expert in WEIGHTS_COPIED:
            t.load_state_dict(layer.state_dict())
        layer = t
    elif variant not in FMOE_VARIANTS:
        raise ValueError(f"unknown layer variant {variant!r}")
    x = torch.randn(tokens, c.model_dim, generator=torch.Generator().manual_seed(1))
    if c.train:
        x.requires_grad_(True)
        layer.train()
    else:
        layer.eval()
    return layer, x


def step_fns(layer, x, train: bool) -> tuple[Callable[[], None], Callable[[], None]]:
    """(step, reset): a training step leaves fresh grads each time, as zero_grad(set_to_none) does."""
    params = [p for p in layer.parameters()]

    def reset():
        for p in params:
            p.grad = None
        x.grad = None

    if train:
        dy = bc.upstream_grad(x)

        def step():
            reset()
            layer(x).backward(dy)
    else:
        def step():
            with torch.no_grad():
                layer(x)
    return step, reset


def memory_case(case: dict):
    """Entry point of the memory subprocess (bench_common.isolated_peak)."""
    c = BY_NAME[case["config"]]
    layer, x = build(c, case["tokens"], case["variant"])
    return step_fns(layer, x, c.train)


def bench_config(c: LayerConfig, tokens: int, repeats: int, memory: bool, log: Callable[[str], None]) -> dict:
    fm, x = build(c, tokens, "fmoe")
    with torch.no_grad():
        _, aux = fm(x, return_aux=True)
    routing = aux.routing
    kept_per_expert = torch.minimum(routing.counts, torch.tensor(routing.capacity))
    kept = int(kept_per_expert.sum())
    busy = int((kept_per_expert > 0).sum())
    passes = 3 if c.train else 1
    useful = kept * c.flop_per_row() * passes
    res = {"config": dataclasses.asdict(c), "tokens": tokens, "capacity": routing.capacity, "kept_pairs": kept,
           "dropped_pairs": tokens * c.k - kept, "busy_experts": busy, "useful_gflop": useful / 1e9,
           "variants": {}, "memory": {}}
    steps, flops = {}, {}
    steps["fmoe"], _ = step_fns(fm, x, c.train)
    flops["fmoe"] = useful
    others = variants_of(c)
    for name in others:
        steps[name], _ = step_fns(build(c, tokens, name)[0], x, c.train)
        flops[name] = useful
    why = tutel_status()
    if why is None and KINDS[c.expert][1] is None:
        why = f"Tutel has no {c.expert} expert"
    if why is None:
        tl, _ = build(c, tokens, "tutel")
        if c.expert in WEIGHTS_COPIED:
            with torch.no_grad():
                fm.eval(), tl.eval()
                res["tutel_max_abs_diff"] = (fm(x) - tl(x)).abs().max().item()
                if c.train:
                    fm.train(), tl.train()
        steps["tutel"], _ = step_fns(tl, x, c.train)
        flops["tutel"] = useful
    else:
        res["variants"]["tutel"] = {"skipped": why}
        log(f"  {c.name} tutel: skipped: {why}")
    if c.train:   # the dense rate of the same per-expert shapes (a SwiGLU FFN's GEMMs)
        dsteps, dflops = bc.dense_ffn_steps(kept, c.model_dim, c.hidden, c.experts)
        steps.update(dsteps)
        flops.update(dflops)
    else:
        steps["weights_read"], all_bytes = bc.weight_stream(fm.experts.parameters())   # as stored
        with torch.no_grad():
            kw = expert_form(fm.specs[0].experts, fm.params()["experts"])
        steps["expert_gemms"] = bc.expert_gemms_step(kept_per_expert.tolist(), kw, fm.specs[0].combine, tokens)
        res["weight_bytes_all"] = all_bytes
        res["weight_bytes_busy"] = all_bytes * busy // c.experts
    for name, m in bc.round_robin(steps, repeats, max_seconds=MAX_SECONDS).items():
        if name in flops:
            m["gflops"] = flops[name] / m["seconds"] / 1e9
        res["variants"][name] = m
    v = res["variants"]
    t_f = v["fmoe"]["seconds"]
    if c.train:
        # The target's denominator is the dense rate of the same shapes: the per-expert GEMMs,
        # batched with perfect balance; one flat GEMM of the same FLOPs is reported beside it.
        dense_rate = v["dense_batched"]["gflops"]
        res["dense_gflops"] = dense_rate
        res["fmoe_vs_dense"] = v["fmoe"]["gflops"] / dense_rate
        res["fmoe_vs_dense_flat"] = v["fmoe"]["gflops"] / v["dense_flat"]["gflops"]
        res["dense_loop_vs_dense"] = v["dense_loop"]["gflops"] / dense_rate
        res["fmoe_vs_dense_loop"] = v["fmoe"]["gflops"] / v["dense_loop"]["gflops"]
        if "seconds" in v.get("tutel", {}):
            res["tutel_vs_dense"] = v["tutel"]["gflops"] / dense_rate
    else:
        bw = res["weight_bytes_all"] / v["weights_read"]["seconds"]
        res["read_gb_per_s"] = bw / 1e9
        res["stream_bound_seconds"] = res["weight_bytes_busy"] / bw
        res["fmoe_vs_stream"] = t_f / res["stream_bound_seconds"]
        res["gemms_vs_stream"] = v["expert_gemms"]["seconds"] / res["stream_bound_seconds"]
        res["fmoe_vs_gemms"] = t_f / v["expert_gemms"]["seconds"]
        if "seconds" in v.get("tutel", {}):
            res["tutel_vs_stream"] = v["tutel"]["seconds"] / res["stream_bound_seconds"]
    if "seconds" in v.get("tutel", {}):
        res["fmoe_time_vs_tutel"] = t_f / v["tutel"]["seconds"]
        res["fmoe_cpu_vs_tutel"] = v["fmoe"]["cpu_seconds"] / v["tutel"]["cpu_seconds"]
    del fm, steps
    for name in others:
        res[f"{name}_time_vs_fmoe"] = v[name]["seconds"] / t_f
        if c.train:
            res[f"{name}_vs_dense"] = v[name]["gflops"] / res["dense_gflops"]
        if "seconds" in v.get("tutel", {}):
            res[f"{name}_time_vs_tutel"] = v[name]["seconds"] / v["tutel"]["seconds"]
    if memory and (c.name in MEMORY_VS_TUTEL or c not in CONFIGS):   # T5's configs (and the test configs)
        for variant in (*(others if c.train else ()), "fmoe", "tutel"):
            if variant == "tutel" and why is not None:
                res["memory"][variant] = {"skipped": why}
                continue
            res["memory"][variant] = bc.isolated_peak(MODULE, {"config": c.name, "tokens": tokens,
                                                               "variant": variant})
        mt = res["memory"].get("tutel", {})
        for name in ("fmoe", *others):
            mf = res["memory"].get(name, {})
            if mf.get("above_rest_bytes") is not None and mt.get("above_rest_bytes"):
                res[f"{name}_mem_vs_tutel"] = mf["above_rest_bytes"] / mt["above_rest_bytes"]
    log("  " + line(c.name, res))
    return res


def line(name: str, r: dict) -> str:
    v = r["variants"]
    parts = [f"{name}:"]
    for k, m in v.items():
        if "seconds" in m:
            parts.append(f"{k} {m['seconds'] * 1e3:.1f} ms" + (f" ({m['gflops']:.0f} GF/s)" if "gflops" in m else ""))
    for k in ("fmoe_vs_dense", "fmoe_vs_stream", "fmoe_time_vs_tutel", "fmoe_mem_vs_tutel"):
        if k in r:
            parts.append(f"{k} {r[k]:.2f}")
    for k, m in r["memory"].items():
        if m.get("above_rest_mib") is not None:
            parts.append(f"{k} +{m['above_rest_mib']:.0f} MiB")
        elif "error" in m:
            parts.append(f"{k} mem error: {m['error']}")
    return ", ".join(parts)


def targets(res: dict) -> list[dict]:
    """Issue-11 targets 1, 2, 3, 5 (layer part) from this suite's results."""
    out = []
    cf = res["configs"]
    train = {n: r["fmoe_vs_dense"] for n, r in cf.items() if "fmoe_vs_dense" in r}
    if train:
        worst = min(train, key=train.get)
        r = cf[worst]
        out.append(bc.status("T1 layer training >= 0.90 of dense", train[worst], 0.90, True,
                             "worst " + worst + "; " + ", ".join(f"{n} {v:.2f}" for n, v in train.items()),
                             "Bound: " + bc.t1_bound(worst, r) + " (suite profile splits the rest)."))
    dec = {n: r["fmoe_vs_stream"] for n, r in cf.items() if "fmoe_vs_stream" in r}
    if dec:
        worst = max(dec, key=dec.get)
        r = cf[worst]
        out.append(bc.status("T2 layer decode <= 1.2x weight stream", dec[worst], 1.2, False,
                             "worst " + worst + "; " + ", ".join(f"{n} {v:.2f}x" for n, v in dec.items()),
                             f"Bound: {worst} takes {r['variants']['fmoe']['seconds'] * 1e3:.1f} ms; reading its "
                             f"{r['busy_experts']} busy experts' {r['weight_bytes_busy'] / bc.MIB:.0f} MiB once takes "
                             f"{r['stream_bound_seconds'] * 1e3:.1f} ms at the {r['read_gb_per_s']:.1f} GB/s a sum "
                             "reaches on the same tensors; " + bc.gemm_floor(r) + "."))
    tut = {n: cf[n]["fmoe_time_vs_tutel"] for n in TUTEL_GEOMEAN if n in cf and "fmoe_time_vs_tutel" in cf[n]}
    if tut:
        detail = ", ".join(f"{n} {v:.2f}" for n, v in tut.items())
        if len(tut) < len(TUTEL_GEOMEAN):
            detail += f" (only {len(tut)} of {len(TUTEL_GEOMEAN)} configs run)"
    else:
        detail = tutel_status() or f"none of {', '.join(TUTEL_GEOMEAN)} run"
    out.append(bc.status("T3 time vs Tutel geo-mean <= 0.55", bc.geomean(tut.values()), 0.55, False, detail))
    every = {n: r["fmoe_time_vs_tutel"] for n, r in cf.items() if "fmoe_time_vs_tutel" in r}
    if every:
        worst = max(every, key=every.get)
        out.append(bc.status("T3 no config slower than Tutel", every[worst], 1.0, False,
                             "worst " + worst + "; " + ", ".join(f"{n} {v:.2f}" for n, v in every.items())))
    mem = {n: cf[n]["fmoe_mem_vs_tutel"] for n in MEMORY_VS_TUTEL if n in cf and "fmoe_mem_vs_tutel" in cf[n]}
    if mem:
        worst = max(mem, key=mem.get)
        m = cf[worst]["memory"]
        out.append(bc.status("T5 layer training peak memory <= 0.5x Tutel", mem[worst], 0.5, False,
                             "peak above rest; " + ", ".join(f"{n} {v:.2f}" for n, v in mem.items()),
                             f"Bound: {worst}: fmoe +{m['fmoe']['above_rest_mib']:.0f} MiB vs Tutel "
                             f"+{m['tutel']['above_rest_mib']:.0f} MiB above the resting set (suite profile lists "
                             "the saved tensors)."))
    return out


def run(quick: bool, only: Optional[str], log: Callable[[str], None] = print, memory: bool = True,
        checkpoint: Optional[Callable[[dict], None]] = None) -> dict:
    """Run the layer suite; returns a JSON-able dict (configs, targets). ``checkpoint`` gets the
    partial result after each config (so a run cut short still leaves its numbers on disk)."""
    repeats = 2 if quick else 8   # slow phases of seconds come and go on this VM: 4 left medians bimodal
    if only:   # config names or bases (every kind of that config), comma-separated
        names = [n for part in only.split(",") for n in (BY_BASE.get(part) or [part]) if n in BY_NAME]
    else:
        names = list(QUICK) if quick else [c.name for c in CONFIGS]
    try:
        from fmoe.ops import numba_cpu
        numba_cpu.warmup()
        warm = None
    except Exception as exc:  # kernels then compile on the warm-up step instead
        warm = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        log(f"  numba warmup failed ({warm}); kernels compile on first use")
    out = {"tutel": tutel_status() or "installed", "numba_warmup_error": warm, "repeats": repeats, "configs": {}}
    for name in names:
        c = BY_NAME[name]
        tokens = c.quick_tokens if quick and c.quick_tokens else c.tokens
        out["configs"][name] = bench_config(c, tokens, repeats, memory, log)
        out["targets"] = targets(out)
        if checkpoint is not None:
            checkpoint(out)
    return out
