"""Core CPU benchmark: the MoE layer and its data movement, reference vs numba, in one process.

For each config (see CONFIGS) it measures, all in the same process so every
ratio compares numbers taken minutes apart on the same (noisy, shared) machine:

* dense GEMM rate: one big float32 matmul forward + backward (the machine's roofline);
* copy bandwidth: one large tensor copy (the bound for dispatch/combine);
* MoE layer step (training: forward + backward; decode: forward under no_grad) for
    reference   fmoe.moe with the pure-torch ops (numba_cpu.disabled())
    numba       fmoe.moe with the numba ops (default: on one process in eager mode the
                expert engine, which multiplies only the kept pairs)
    numba+staged  the staged pipeline spelled out (route -> dispatch into the padded layout ->
                apply_experts through GroupedGemm, one torch.bmm over the full buffers ->
                combine); equal to the engine within float rounding
    transformers  Qwen3-MoE sparse block (dropless peer), when transformers is installed
  reported as useful GFLOP/s = FLOPs of the expert GEMMs on routed, non-dropped rows / time;
* dispatch + combine alone, forward and backward, against bytes moved / copy bandwidth;
* peak RSS growth of each variant (VmHWM after resetting it through /proc/self/clear_refs).

Every figure is a median over repeats; the layer variants (and the transformers
peer) are timed round-robin, one step each per repeat, so that bursts of load from
other jobs on a shared machine hit all of them alike.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import statistics
import time
from typing import Callable, Optional

import torch

import fmoe
from fmoe import experts as fx
from fmoe.ops import numba_cpu
from fmoe.engine import GroupedGemm


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    tokens: int
    model_dim: int
    hidden: int
    experts: int
    k: int
    cf: float
    expert_type: str
    train: bool
    quick_tokens: Optional[int] = None  # --quick shrinks the token count only

    def flop_per_row(self) -> int:
        """Forward FLOPs of one token row through one expert."""
        gemms = 2 if self.expert_type == "ffn" else 3
        return gemms * 2 * self.model_dim * self.hidden


CONFIGS = [
    Config("coarse", 4096, 1024, 2048, 8, 2, 1.0, "gated_ffn", True, quick_tokens=512),
    Config("fine_cf1", 8192, 1024, 256, 64, 8, 1.0, "gated_ffn", True, quick_tokens=1024),
    Config("fine_cf2", 8192, 1024, 256, 64, 8, 2.0, "gated_ffn", True, quick_tokens=1024),
    Config("decode_8", 8, 2048, 768, 128, 8, 1.0, "gated_ffn", False),
    Config("decode_64", 64, 2048, 768, 128, 8, 1.0, "gated_ffn", False),
]


# --------------------------------------------------------------------------- measurement helpers

def median_time(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median wall time of fn() in seconds over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _proc_status(key: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@contextlib.contextmanager
def peak_rss(record: dict, key: str):
    """Store in record[key] the peak RSS growth (bytes) over the block, when Linux allows."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        ok = True
    except OSError:
        ok = False
    base = _proc_status("VmRSS")
    yield
    peak = _proc_status("VmHWM")
    record[key] = (peak - base) if ok and peak is not None and base is not None else None


def dense_gemm_rate(repeats: int, m: int = 4096, k: int = 1024, n: int = 2048) -> dict:
    """GFLOP/s of one [m,k] @ [k,n] float32 matmul forward + backward (3 GEMMs)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=g, requires_grad=True)
    b = torch.randn(k, n, generator=g, requires_grad=True)
    gy = torch.randn(m, n, generator=g)

    def step():
        a.grad = b.grad = None
        (a @ b).backward(gy)

    t = median_time(step, repeats)
    return {"shape": [m, k, n], "seconds": t, "gflops": 3 * 2 * m * k * n / t / 1e9}


def copy_bandwidth(repeats: int, nbytes: int = 512 << 20) -> dict:
    """Bytes read + written per second by a large float32 tensor copy."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    t = median_time(lambda: dst.copy_(src), repeats)
    return {"bytes": nbytes, "seconds": t, "gb_per_s": 2 * nbytes / t / 1e9}


# --------------------------------------------------------------------------- the MoE layer

def _spec(c: Config) -> fmoe.MoESpec:
    return fmoe.MoESpec(model_dim=c.model_dim, num_experts=c.experts,
                        gate=fmoe.GateSpec(k=c.k, capacity_factor=c.cf),
                        experts=fmoe.ExpertSpec(type=c.expert_type, hidden_size=c.hidden,
                                                has_fc1_bias=False, has_fc2_bias=False))


def _moe_staged(params, x, spec):
    """fmoe.moe's single-process staged pipeline on the padded layout, spelled out: the expert
    GEMMs are GroupedGemm's, one torch.bmm over every row of every expert buffer."""
    routing, l_aux = fmoe.route(params, x, spec)
    layout = fmoe.make_layout(routing, "padded")
    buf = fmoe.dispatch(x, routing, weighted=not spec.is_postscore, layout=layout)
    out = fx.apply_experts(spec.experts, params["experts"], buf, GroupedGemm.over(layout))
    return fmoe.combine(out, routing, weighted=spec.is_postscore, layout=layout), l_aux


def _step_fn(layer: Callable, params, x, train: bool):
    leaves = [t for t in torch.utils._pytree.tree_leaves(params) if isinstance(t, torch.Tensor)]

    def step():
        if train:
            for t in leaves:
                t.grad = None
            y, _ = layer(params, x)
            y.square().mean().backward()
        else:
            with torch.no_grad():
                layer(params, x)

    return step


def _transformers_block(c: Config, tokens: int):
    try:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    except Exception as exc:  # optional peer
        return None, f"transformers not available ({type(exc).__name__}: {exc})"
    cfg = Qwen3MoeConfig(hidden_size=c.model_dim, moe_intermediate_size=c.hidden, num_experts=c.experts,
                         num_experts_per_tok=c.k, norm_topk_prob=True)
    block = Qwen3MoeSparseMoeBlock(cfg).float()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # constructed weights may be untouched (zero) pages: reading those is free
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return block, None


_PARAMS: dict = {}  # configs that differ only in tokens / cf share parameters (decode's are 2.4 GB)


def _params(c: Config, spec: fmoe.MoESpec) -> dict:
    key = (c.model_dim, c.hidden, c.experts, c.expert_type)
    if key not in _PARAMS:
        _PARAMS.clear()
        _PARAMS[key] = fmoe.init_params(spec, generator=torch.Generator().manual_seed(0))
    return _PARAMS[key]


def bench_layer(c: Config, tokens: int, repeats: int, log: Callable[[str], None]) -> dict:
    spec = _spec(c)
    g = torch.Generator().manual_seed(0)
    params = _params(c, spec)
    for t in torch.utils._pytree.tree_leaves(params):
        t.requires_grad_(c.train)
    x = torch.randn(tokens, c.model_dim, generator=g)
    with torch.no_grad():
        routing, _ = fmoe.route(params, x, spec)
    kept = int(routing.kept().sum())
    C = routing.capacity
    useful = kept * c.flop_per_row() * (3 if c.train else 1)
    padded = c.experts * C * c.flop_per_row() * (3 if c.train else 1)
    res = {"config": dataclasses.asdict(c), "tokens": tokens, "capacity": C, "kept_pairs": kept,
           "dropped_pairs": int(routing.num_dropped()), "useful_gflop": useful / 1e9,
           "padded_gflop": padded / 1e9, "variants": {}, "peak_rss_bytes": {}}

    variants = {
        "reference": (lambda p, xx: fmoe.moe(p, xx, spec), numba_cpu.disabled),
        "numba": (lambda p, xx: fmoe.moe(p, xx, spec), contextlib.nullcontext),
        "numba+staged": (lambda p, xx: _moe_staged(p, xx, spec), contextlib.nullcontext),
    }
    steps = {name: (_step_fn(layer, params, x, c.train), ctx) for name, (layer, ctx) in variants.items()}
    flops = {name: useful for name in variants}

    block, why = _transformers_block(c, tokens)
    if block is None:
        log(f"  {c.name} transformers: skipped: {why}")
        res["variants"]["transformers"] = {"skipped": why}
    else:
        xb = x.reshape(1, tokens, c.model_dim)
        if c.train:
            xb = xb.clone().requires_grad_(True)

        def hf_layer(_, xx):
            out = block(xx)
            return (out[0] if isinstance(out, tuple) else out), None

        steps["transformers"] = (_step_fn(hf_layer, dict(block.named_parameters()), xb, c.train),
                                 contextlib.nullcontext)
        flops["transformers"] = tokens * c.k * c.flop_per_row() * (3 if c.train else 1)

    # Warm-up (and peak RSS) variant by variant, then timed steps interleaved round-robin so
    # that a burst of load from other jobs on this shared machine hits every variant alike.
    for name in list(steps):
        step, ctx = steps[name]
        try:
            with ctx(), peak_rss(res["peak_rss_bytes"], name):
                step()
        except Exception as exc:
            if name != "transformers":
                raise
            # the peer is best effort; report, never crash the suite
            res["variants"]["transformers"] = {"skipped": f"error: {type(exc).__name__}: {exc}"}
            log(f"  {c.name} transformers: error {exc}")
            del steps[name]
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for name, (step, ctx) in steps.items():
            with ctx():
                t0 = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - t0)
    for name, ts in times.items():
        t = statistics.median(ts)
        res["variants"][name] = {"seconds": t, "useful_gflops": flops[name] / t / 1e9,
                                 "all_seconds": ts}
        log(f"  {c.name} {name}: {t * 1e3:.1f} ms, {flops[name] / t / 1e9:.1f} useful GFLOP/s")
    for t in torch.utils._pytree.tree_leaves(params):
        t.grad = None
    del block
    gc.collect()
    return res


# --------------------------------------------------------------------------- dispatch + combine

def dispatch_combine_bytes(T: int, M: int, R: int, kept: int, itemsize: int = 4) -> dict:
    """Bytes a minimal implementation must move (rows of M values).

    forward:  dispatch reads kept x rows, writes all R buffer rows;
              combine reads kept rows, writes T output rows.
    backward: combine's: dispatch of the grad (reads kept, writes R) and gate_grad
              (reads T grad rows and kept buffer rows); dispatch's: combine of the
              grad (reads kept, writes T).
    """
    row = M * itemsize
    fwd = (kept + R) * row + (kept + T) * row
    bwd = (kept + R) * row + (T + kept) * row + (kept + T) * row
    return {"fwd": fwd, "bwd": bwd}


def bench_dispatch_combine(c: Config, tokens: int, repeats: int, bandwidth: float,
                           log: Callable[[str], None]) -> dict:
    g = torch.Generator().manual_seed(1)
    scores = torch.rand(tokens, c.experts, generator=g).softmax(1)
    r = fmoe.top_k_routing(scores, c.k, c.cf)
    x = torch.randn(tokens, c.model_dim, generator=g)
    R = c.experts * r.capacity
    kept = int(r.kept().sum())
    nbytes = dispatch_combine_bytes(tokens, c.model_dim, R, kept)
    res = {"bytes": nbytes, "bound_seconds": {k: v / bandwidth for k, v in nbytes.items()}, "backends": {}}
    for name, ctx in (("reference", numba_cpu.disabled), ("numba", contextlib.nullcontext)):
        with ctx():
            fwd = median_time(lambda: fmoe.combine(fmoe.dispatch(x, r), r), repeats)
            xg = x.clone().requires_grad_(True)
            wg = r.weights.clone().requires_grad_(True)
            rg = fmoe.Routing(r.expert_ids, r.slots, wg, r.counts, r.capacity, r.num_experts)
            gy = torch.randn(tokens, c.model_dim, generator=g)

            def bwd_only():
                xg.grad = wg.grad = None
                y = fmoe.combine(fmoe.dispatch(xg, rg), rg)
                t0 = time.perf_counter()
                y.backward(gy)
                return time.perf_counter() - t0

            bwd_only()
            bwd = statistics.median(bwd_only() for _ in range(repeats))
        res["backends"][name] = {"fwd_seconds": fwd, "bwd_seconds": bwd,
                                 "fwd_vs_bound": fwd / res["bound_seconds"]["fwd"],
                                 "bwd_vs_bound": bwd / res["bound_seconds"]["bwd"]}
        log(f"  {c.name} dispatch+combine {name}: fwd {fwd * 1e3:.2f} ms "
            f"({res['backends'][name]['fwd_vs_bound']:.2f}x bound), bwd {bwd * 1e3:.2f} ms "
            f"({res['backends'][name]['bwd_vs_bound']:.2f}x bound)")
    return res


def run(quick: bool, only: Optional[str], log: Callable[[str], None] = print) -> dict:
    """Run the core suite; returns a JSON-able dict."""
    repeats = 2 if quick else 5
    numba_cpu.warmup()
    # The machine is shared: the dense rate is re-measured next to every config and the
    # best measurement is the denominator, so "vs dense" can only be understated.
    dense_runs = [dense_gemm_rate(repeats)]
    copy_runs = [copy_bandwidth(repeats)]
    out = {"configs": {}}
    log(f"  dense GEMM fwd+bwd: {dense_runs[0]['gflops']:.1f} GFLOP/s; "
        f"copy: {copy_runs[0]['gb_per_s']:.1f} GB/s")
    for c in CONFIGS:
        if only and only not in (c.name, "core"):
            continue
        tokens = c.quick_tokens if quick and c.quick_tokens else c.tokens
        dense_runs.append(dense_gemm_rate(repeats))
        copy_runs.append(copy_bandwidth(repeats))
        bw = max(r["gb_per_s"] for r in copy_runs) * 1e9
        res = bench_layer(c, tokens, repeats, log)
        res["dispatch_combine"] = bench_dispatch_combine(c, tokens, repeats, bw, log)
        hf = res["variants"].get("transformers", {}).get("seconds")
        if hf:
            res["speedup_vs_transformers"] = {k: hf / v["seconds"] for k, v in res["variants"].items()
                                              if k != "transformers" and "seconds" in v}
        out["configs"][c.name] = res
    out["dense_gemm"] = dict(max(dense_runs, key=lambda r: r["gflops"]),
                             measurements=[r["gflops"] for r in dense_runs])
    out["copy_bandwidth"] = dict(max(copy_runs, key=lambda r: r["gb_per_s"]),
                                 measurements=[r["gb_per_s"] for r in copy_runs])
    dense = out["dense_gemm"]["gflops"]
    for res in out["configs"].values():
        res["vs_dense"] = {k: v["useful_gflops"] / dense for k, v in res["variants"].items() if "useful_gflops" in v}
    return out
