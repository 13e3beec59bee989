"""Shared measurement pieces of the issue-11 suites (``layer``, ``blocks``).

* :func:`round_robin` times several step functions one step each per repeat (a shared
  2-core machine has load bursts; interleaving makes them hit every variant alike).
* :func:`dense_ffn_steps` gives the roofline of an expert FFN: the 9 float32 GEMMs of a
  SwiGLU FFN forward + backward (3 forward, 6 backward) on the same [rows, M] x [M, H]
  shapes, batched per expert (the target's denominator) and as one flat matrix; no
  routing, no activation. The suites time them inside the same round-robin.
* The decode bound ("busy experts' weights read once") is timed by the suites the same way:
  a sum over the weight tensors themselves reads each byte once.
* :func:`isolated_peak` runs one training step in a fresh subprocess
  (``python -m benchmarks.bench_common CASE_JSON``; glibc's mmap threshold fixed at 1 MiB so
  freed large tensors leave RSS, see :func:`_fix_mmap_threshold`): warm-up step, free grads, gc,
  ``malloc_trim(0)`` so RSS is the live set, reset VmHWM (write "5" to
  /proc/self/clear_refs), one step, read VmHWM. Each variant runs alone, so one variant's
  freed-but-resident pages never count for another.
* :func:`write_json` writes atomically (temp file in the same folder, fsync, os.replace).
"""
from __future__ import annotations

import ctypes
import gc
import importlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Optional

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 2 ** 20


# --------------------------------------------------------------------------- timing

def round_robin(steps: dict[str, Callable[[], object]], repeats: int, warmup: int = 1,
                max_seconds: Optional[float] = None, alternate: bool = False) -> dict[str, dict]:
    """Time each step function, interleaved one step each per repeat; per variant
    {"seconds": median wall, "all_seconds", "steps", "cpu_seconds": median process CPU time}.

    CPU time counts all threads of this process: under heavy load the wall time is mostly
    waiting for a core, the CPU time much less so (it still includes spin-waiting).
    ``max_seconds``: a variant whose timed steps already add up to this stops being timed
    (it keeps at least one step), so that one very slow peer (transformers' eager training
    loop, 30 s a step under load) does not stretch the run. ``alternate``: every other repeat runs
    the variants in reverse order, so that none always follows the same neighbour (whose caches
    and allocator state it would inherit).
    """
    for _ in range(warmup):
        for fn in steps.values():
            fn()
    wall = {name: [] for name in steps}
    cpu = {name: [] for name in steps}
    order = list(steps)
    for r in range(repeats):
        for name in (order[::-1] if alternate and r % 2 else order):
            fn = steps[name]
            if max_seconds is not None and wall[name] and sum(wall[name]) >= max_seconds:
                continue
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    return {name: {"seconds": statistics.median(wall[name]), "all_seconds": wall[name], "steps": len(wall[name]),
                   "cpu_seconds": statistics.median(cpu[name])} for name in steps}


def geomean(xs) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


# --------------------------------------------------------------------------- rooflines

def upstream_grad(x: torch.Tensor) -> torch.Tensor:
    """A fixed upstream gradient dL/dy for a layer whose output has x's shape and dtype (seed 2).

    Training steps run ``y.backward(dy)``: the layer's own forward and backward, no loss (a
    ``y.square().mean()`` loss added ~20 ms of [T, M] elementwise work per fine_cf125 step, the
    same for every variant)."""
    g = torch.Generator().manual_seed(2)
    return torch.randn(x.shape, generator=g).div_(math.sqrt(x.numel())).to(x.dtype)


def _ffn_gemms(a, h, gy, gh, w1, w2, w3, t) -> list:
    """The 9 GEMMs of a SwiGLU FFN step as (lhs, rhs, is_weight_gradient): a [.., r, M] inputs,
    h [.., r, H] hidden state, gy [.., r, M] output gradient, gh [.., r, H] hidden gradient;
    ``t`` transposes the last two dims."""
    return [(a, w1, False), (a, w2, False), (h, w3, False),                                # forward
            (gy, t(w3), False), (t(h), gy, True),                                          # down: dX, dW
            (gh, t(w1), False), (t(a), gh, True), (gh, t(w2), False), (t(a), gh, True)]    # gate, up


def dense_ffn_steps(rows: int, model_dim: int, hidden: int, experts: int) -> tuple[dict, dict]:
    """Step functions (and their FLOPs) for the dense GEMMs of a SwiGLU FFN fwd+bwd.

    ``flat``: one [rows, M] matrix through [M, H], [M, H], [H, M] (the best case: one big GEMM);
    ``batched``: the same rows split evenly over ``experts`` ([E, ceil(rows/E), M], torch.bmm),
    i.e. the per-expert shapes with perfect balance; ``loop``: the batched shapes as one torch.mm
    per GEMM and expert, expert by expert (an expert's operands stay in cache between its GEMMs),
    the calls a per-expert MoE makes: MKL threads each call on its own, where bmm spreads whole
    GEMMs over the threads. Each step runs the 3 forward and 6 backward GEMMs explicitly (no
    autograd, no activation), so it is the GEMM roofline only. The activation-shaped outputs
    are written into buffers made once (a MoE's come from its scratch or the allocator's cache);
    the weight gradients are fresh every step, as ``zero_grad(set_to_none=True)`` makes them,
    so reference and MoE pay the same page faults for them.
    """
    g = torch.Generator().manual_seed(7)
    M, H = model_dim, hidden
    steps, flops = {}, {}

    def make(gemms, mm):
        acts = {i: mm(p, q) for i, (p, q, wgrad) in enumerate(gemms) if not wgrad}

        def step():
            for i, (p, q, wgrad) in enumerate(gemms):
                if wgrad:
                    mm(p, q)
                else:
                    mm(p, q, out=acts[i])
        return step

    r = max(rows, 1)
    a, h = torch.randn(r, M, generator=g), torch.randn(r, H, generator=g)
    gy, gh = torch.randn(r, M, generator=g), torch.randn(r, H, generator=g)
    w1, w2, w3 = torch.randn(M, H, generator=g), torch.randn(M, H, generator=g), torch.randn(H, M, generator=g)
    steps["dense_flat"] = make(_ffn_gemms(a, h, gy, gh, w1, w2, w3, lambda t: t.t()), torch.mm)
    flops["dense_flat"] = 3 * r * 6 * M * H
    c = max(1, -(-rows // experts))
    ab, hb = torch.randn(experts, c, M, generator=g), torch.randn(experts, c, H, generator=g)
    gyb, ghb = torch.randn(experts, c, M, generator=g), torch.randn(experts, c, H, generator=g)
    w1b, w2b = torch.randn(experts, M, H, generator=g), torch.randn(experts, M, H, generator=g)
    w3b = torch.randn(experts, H, M, generator=g)
    batched = _ffn_gemms(ab, hb, gyb, ghb, w1b, w2b, w3b, lambda t: t.transpose(1, 2))
    steps["dense_batched"] = make(batched, torch.bmm)
    flops["dense_batched"] = 3 * experts * c * 6 * M * H
    shapes = [(experts, p.shape[1], q.shape[2]) for p, q, _ in batched]
    acts = {i: ab.new_empty(shapes[i]) for i, (_, _, wgrad) in enumerate(batched) if not wgrad}

    def loop_step():
        outs = [ab.new_empty(shapes[i]) if wgrad else acts[i] for i, (_, _, wgrad) in enumerate(batched)]
        for e in range(experts):
            for o, (p, q, _) in zip(outs, batched):
                torch.mm(p[e], q[e], out=o[e])

    steps["dense_loop"] = loop_step
    flops["dense_loop"] = flops["dense_batched"]
    return steps, flops


def weight_stream(weights) -> tuple[Callable[[], object], int]:
    """(step, bytes): one read of every tensor in ``weights`` (a sum each: each byte read once)
    and their total size. The stream bound is the bytes a step must read / this step's rate."""
    ws = [w.detach() for w in weights]
    return (lambda: [w.sum() for w in ws]), sum(w.numel() * w.element_size() for w in ws)


def expert_gemms_step(counts, kw: dict, order: str = "fmoe", num_tokens: Optional[int] = None) -> Callable[[], object]:
    """The routed experts' GEMMs of one inference call alone: its GEMM floor.

    The expert engine's own calls (:func:`fmoe.engine.select`'s kernel for the call's plan,
    one grouped call per projection, rows gathered by the kernel) on the same weights and per-
    expert row counts, with random rows and no activation or routing (the biases added inside the calls, as the engine adds them). ``counts``:
    kept rows per expert (ints, length E); ``kw``: what :func:`fmoe.experts.expert_form`
    returns for the experts (read as the engine reads them, :func:`fmoe.engine.kinds.as_stored`);
    ``order``: the call's combine order (whether the output projection
    scatters straight into y, :func:`fmoe.engine.kinds.scatters_output`); ``num_tokens``: the T
    rows gathered from and scattered into (default: one per pair).
    """
    from fmoe import engine
    from fmoe.engine.kinds import as_stored, scatters_output
    from fmoe.engine.plan import plan_from_bounds
    counts = [int(c) for c in counts]
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    N = bounds[-1]
    form, w_in, w_out = as_stored(kw["form"], tuple(w.detach() for w in kw["w_in"]), kw["w_out"].detach())
    b_in, b_out = (None if b is None else b.detach() for b in (kw.get("b_in"), kw.get("b_out")))
    K = w_in[0].shape[2 if form.in_transposed else 1]
    H = w_out.shape[2 if form.out_transposed else 1]
    dt = w_out.dtype
    T = N if num_tokens is None else num_tokens
    tokens = torch.randint(max(T, 1), (N,), generator=torch.Generator().manual_seed(1))
    plan = plan_from_bounds(tokens, tokens.clone(), bounds, T, needs_grad=False, dtype=dt)
    kern = engine.select(plan, w_out[0].numel() * w_out.element_size())
    x = torch.randn(T, K, dtype=dt, generator=torch.Generator().manual_seed(2))
    h = torch.randn(N, H, dtype=dt, generator=torch.Generator().manual_seed(3))

    out_dim = w_out.shape[1] if form.out_transposed else w_out.shape[2]
    scatter = scatters_output(order, dt)   # the out-projection straight into y, as the engine does
    scale = torch.rand(N, generator=torch.Generator().manual_seed(4)).to(dt)
    y = torch.zeros(T, out_dim, dtype=dt)

    def step():
        outs = [kern.mm(x, w, plan, rows=plan.tokens, transposed=form.in_transposed, bias=b_in if i == 0 else None)
                for i, w in enumerate(w_in)]
        if scatter:
            return outs + [kern.scatter(h, w_out, plan, index=plan.tokens, out=y.zero_(), scale=scale,
                                        transposed=form.out_transposed, bias=b_out)]
        return outs + [kern.mm(h, w_out, plan, transposed=form.out_transposed, bias=b_out)]
    return step


def gemm_floor(r: dict) -> str:
    """Decode's bound line: the call's expert GEMMs alone (``expert_gemms``) against the stream."""
    t = r["variants"]["expert_gemms"]["seconds"]
    return (f"its expert GEMMs alone (expert_gemms: the same calls on the same weights and rows, nothing else) "
            f"take {t * 1e3:.1f} ms = {r['gemms_vs_stream']:.2f}x the stream, and the step is "
            f"{r['fmoe_vs_gemms']:.2f}x them")


def t1_bound(name: str, r: dict) -> str:
    """Where a training config's time goes against the dense roofline (T1's bound line): the
    step, its useful GEMMs at the batched rate, and at the per-expert-call rate (dense_loop)."""
    t_f = r["variants"]["fmoe"]["seconds"]
    t_d = r["useful_gflop"] / r["dense_gflops"]
    out = (f"{name}'s step takes {t_f * 1e3:.0f} ms where its useful GEMMs at the dense (batched) rate take "
           f"{t_d * 1e3:.0f} ms")
    if "dense_loop_vs_dense" in r:
        t_l = t_d / r["dense_loop_vs_dense"]
        out += (f"; as one GEMM call per expert (dense_loop, {r['dense_loop_vs_dense']:.2f} of the batched rate) "
                f"they take {t_l * 1e3:.0f} ms, and the other {(t_f - t_l) * 1e3:.0f} ms are outside the GEMMs")
    return out


# --------------------------------------------------------------------------- memory

def _status(key: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def measure_peak(step: Callable[[], object], reset: Callable[[], None], warmup: int = 1) -> dict:
    """Peak RSS of one ``step()`` after ``warmup`` steps, in this process (bytes).

    ``reset()`` drops what a training loop drops between steps (gradients). Returns rest
    (VmRSS just before the step: params, inputs, libraries), peak (VmHWM during it) and
    peak - rest; ``ok`` is False where /proc/self/clear_refs cannot be written.
    """
    for _ in range(warmup):
        step()
        reset()
    _trim()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := current RSS
        ok = True
    except OSError:
        ok = False
    rest = _status("VmRSS")
    t0 = time.perf_counter()
    step()
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM")
    return {"ok": ok and rest is not None and peak is not None, "rest_bytes": rest, "peak_bytes": peak,
            "above_rest_bytes": (peak - rest) if ok and rest is not None and peak is not None else None,
            "step_seconds": seconds}


def isolated_peak(module: str, case: dict, timeout: float = 300) -> dict:
    """Run ``module.memory_case(case)`` -> (step, reset) in a fresh Python process; its peak RSS.

    Returns :func:`measure_peak`'s dict (plus MiB figures), or {"error": ...} when the child
    failed or timed out (the caller reports it; a benchmark never crashes on one variant).
    """
    cmd = [sys.executable, "-m", "benchmarks.bench_common", json.dumps({"module": module, "case": case})]
    try:
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in p.stdout.splitlines()[::-1]:
        if line.startswith("PEAK "):
            r = json.loads(line[5:])
            for k in ("rest", "peak", "above_rest"):
                v = r.get(f"{k}_bytes")
                r[f"{k}_mib"] = None if v is None else v / MIB
            return r
    tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
    return {"error": f"child exited {p.returncode}: {' | '.join(tail)}"}


# --------------------------------------------------------------------------- output

def write_json(path: str, obj) -> None:
    """Write JSON atomically: a temp file in the same folder, fsync, then os.replace."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def report(lines: list, res: dict, path: Optional[str]) -> None:
    """A benchmark's end: its tables printed, and its results written to ``path`` (atomically) when given."""
    print("\n".join(lines))
    if path:
        write_json(path, res)


def status(name: str, measured: Optional[float], threshold: float, higher_is_better: bool, detail: str,
           why_missing: str = "") -> dict:
    """One target's status line: met / missed with the measured ratio, or not measured."""
    if measured is None:
        state = "not measured"
    elif (measured >= threshold) if higher_is_better else (measured <= threshold):
        state = "met"
    else:
        state = "missed"
    op = ">=" if higher_is_better else "<="
    return {"target": name, "status": state, "measured": measured, "threshold": threshold,
            "line": f"{name}: {state} ({'-' if measured is None else format(measured, '.2f')} vs {op} "
                    f"{threshold:g}; {detail})" + (f" {why_missing}" if state == "missed" and why_missing else "")}


M_MMAP_THRESHOLD = -3   # glibc mallopt parameter number (malloc.h)


def _fix_mmap_threshold(nbytes: int = 1 << 20) -> bool:
    """Serve every allocation >= nbytes by its own mmap, returned to the OS when freed.

    glibc otherwise raises its mmap threshold each time a large block is freed (up to 32 MiB),
    after which such blocks come from the heap and stay resident once freed; whether they do
    depends on which thread freed what first, so the same step's VmHWM moved by ~120 MiB between
    runs (Tutel dropless: +570 and +449 MiB). A fixed threshold makes VmHWM follow the live
    tensors. Only the memory subprocesses call this; the timed runs keep glibc's defaults.
    """
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, nbytes))
    except (OSError, AttributeError):
        return False


def _child(arg: str) -> int:
    fixed = _fix_mmap_threshold()
    spec = json.loads(arg)
    mod = importlib.import_module(spec["module"])
    step, reset = mod.memory_case(spec["case"])
    print("PEAK " + json.dumps(dict(measure_peak(step, reset), mmap_threshold_fixed=fixed)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1]))
