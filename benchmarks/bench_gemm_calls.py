"""How expert GEMMs are issued on CPU: per expert, batched over B experts, and which weight order
(the analysis behind issue 11's T1 and T2 bound lines; ``python -m benchmarks.run --only gemm_calls``).

Two tables, every variant of a case timed round-robin in one process, medians:

* ``calls`` (training shapes): for E experts with n rows each, the forward GEMM ``x_e @ W_e``
  ([n, M] x [M, H]) and the weight gradient ``x_eᵀ d_e`` ([M, n] x [n, H]) of every expert,
  issued as one ``torch.mm`` per expert (B = 1, what fmoe's streamed op does) or as
  ``torch.bmm`` over B consecutive experts at a time (what equal row counts would allow). The
  gap between B = 1 and B > 1 is MKL threading each call on its own.
* ``decode`` (no grad): n rows per expert times every expert's [K, N] weight, with the weights in
  the ``x @ W`` order ([E, K, N], MoELayer's Tutel order) or nn.Linear's ``x @ Wᵀ`` order
  ([E, N, K], the architecture blocks'), through ``torch._grouped_mm`` and ``torch.bmm``, against
  a sum over the same weights (each byte read once: the stream bound). Equal rows per expert, so
  only the call and the weight order differ; ``benchmarks.bench_ragged --only decode`` measures
  fmoe's ragged kernels on routed, unequal loads instead.
* ``storage`` (the layer): a ``MoELayer`` step (the layer suite's configs and inputs) through
  ``fmoe.moe`` with the gated experts' weights as the layer holds them (out x in, nn.Linear's
  order; ``params()`` gives x @ W views of them) against contiguous x @ W copies of the same
  values (the order before session 6), which the streamed op then multiplies as ``x @ W``.
  This is the measurement behind that storage choice.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from . import bench_common as bc

CALLS = {  # name: (E, n rows per expert, M, H)
    "e128_n128": (128, 128, 768, 384),    # fine_e128k8's per-expert shapes
    "e32_n256": (32, 256, 768, 384),      # the blocks' training shapes
    "e32_n512": (32, 512, 768, 384),      # fine_cf125 / dropless
}
QUICK_CALLS = {"e16_n32": (16, 32, 128, 64)}
BATCHES = (1, 2, 4, 8)
DECODE = {"E": 64, "K": 1024, "N": 512, "rows": (1, 2, 4, 6)}
QUICK_DECODE = {"E": 8, "K": 128, "N": 64, "rows": (1, 2)}
STORAGE = tuple(f"{b}.gated_ffn" for b in ("decode_16", "decode_64", "coarse", "fine_cf125", "fine_e64k8", "fine_e128k8"))
QUICK_STORAGE = ("smoke",)


def _calls_case(E: int, n: int, M: int, H: int, repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    x, d = torch.randn(E, n, M, generator=g), torch.randn(E, n, H, generator=g)
    w = torch.randn(E, M, H, generator=g)
    y, gw = torch.empty(E, n, H), torch.empty(E, M, H)
    xt = x.transpose(1, 2)

    def issue(B: int) -> Callable[[], None]:
        if B == 1:
            def step():
                for e in range(E):
                    torch.mm(x[e], w[e], out=y[e])
                    torch.mm(xt[e], d[e], out=gw[e])
        else:
            def step():
                for e in range(0, E, B):
                    torch.bmm(x[e:e + B], w[e:e + B], out=y[e:e + B])
                    torch.bmm(xt[e:e + B], d[e:e + B], out=gw[e:e + B])
        return step

    steps = {f"B{b}": issue(b) for b in BATCHES if b < E}
    steps["Ball"] = issue(E)
    t = bc.round_robin(steps, repeats)
    flop = 2 * 2 * E * n * M * H
    out = {"E": E, "rows": n, "M": M, "H": H, "variants": {}}
    for name, m in t.items():
        m["gflops"] = flop / m["seconds"] / 1e9
        m["vs_per_expert"] = t["B1"]["seconds"] / m["seconds"]
        out["variants"][name] = m
    return out


def _decode_case(E: int, K: int, N: int, n: int, repeats: int) -> dict:
    g = torch.Generator().manual_seed(1)
    w_kn, w_nk = torch.randn(E, K, N, generator=g), torch.randn(E, N, K, generator=g)
    x = torch.randn(E * n, K, generator=g)
    xb = x.view(E, n, K)
    offs = torch.arange(1, E + 1, dtype=torch.int32) * n
    steps = {"stream": lambda: w_kn.sum()}
    if hasattr(torch, "_grouped_mm"):
        steps["kn_grouped"] = lambda: torch._grouped_mm(x, w_kn, offs=offs)
        steps["nk_grouped"] = lambda: torch._grouped_mm(x, w_nk.transpose(1, 2), offs=offs)
    steps["kn_bmm"] = lambda: torch.bmm(xb, w_kn)
    steps["nk_bmm"] = lambda: torch.bmm(xb, w_nk.transpose(1, 2))
    t = bc.round_robin(steps, repeats)
    for m in t.values():
        m["vs_stream"] = m["seconds"] / t["stream"]["seconds"]
    return {"E": E, "K": K, "N": N, "rows": n, "weight_bytes": w_kn.numel() * w_kn.element_size(), "variants": t}


def _storage_case(name: str, quick: bool, repeats: int) -> dict:
    import fmoe

    from . import bench_layer
    c = bench_layer.BY_NAME[name]
    tokens = (c.quick_tokens or c.tokens) if quick else c.tokens
    layer, x = bench_layer.build(c, tokens, "fmoe")
    spec = layer.spec()
    held = layer.params()
    copy = {"gate": held["gate"],
            "experts": {k: v.detach().contiguous().requires_grad_(c.train) for k, v in held["experts"].items()}}
    leaves = [*layer.parameters(), *copy["experts"].values(), x]
    dy = bc.upstream_grad(x)

    def step(params) -> Callable[[], torch.Tensor]:
        def run_once():
            for t in leaves:
                t.grad = None
            if not c.train:
                with torch.no_grad():
                    return fmoe.moe(params, x, spec, training=False)[0]
            y = fmoe.moe(params, x, spec, training=True)[0]
            y.backward(dy)
            return y.detach()
        return run_once

    steps = {"held": step(held), "xw_copy": step(copy)}
    diff = float((steps["held"]() - steps["xw_copy"]()).abs().max())
    t = bc.round_robin(steps, repeats, alternate=True)
    return {"config": name, "tokens": tokens, "train": c.train, "max_abs_diff": diff, "variants": t,
            "held_vs_copy": t["held"]["seconds"] / t["xw_copy"]["seconds"]}


def run(quick: bool, only: Optional[str], log: Callable[[str], None] = print) -> dict:
    repeats = 3 if quick else 15
    out = {"calls": {}, "decode": {}, "storage": {}}
    for name, (E, n, M, H) in (QUICK_CALLS if quick else CALLS).items():
        r = out["calls"][name] = _calls_case(E, n, M, H, repeats)
        log(f"  gemm_calls {name}: " + ", ".join(f"{k} {m['gflops']:.0f} GF/s ({m['vs_per_expert']:.2f}x)"
                                                 for k, m in r["variants"].items()))
    dec = QUICK_DECODE if quick else DECODE
    for n in dec["rows"]:
        r = out["decode"][f"n{n}"] = _decode_case(dec["E"], dec["K"], dec["N"], n, repeats)
        log(f"  gemm_calls decode n={n}: " + ", ".join(f"{k} {m['seconds'] * 1e3:.2f} ms ({m['vs_stream']:.2f}x)"
                                                       for k, m in r["variants"].items()))
    for name in QUICK_STORAGE if quick else STORAGE:
        r = out["storage"][name] = _storage_case(name, quick, 2 if quick else 8)
        v = r["variants"]
        log(f"  gemm_calls storage {name}: held {v['held']['seconds'] * 1e3:.1f} ms, x @ W copy "
            f"{v['xw_copy']['seconds'] * 1e3:.1f} ms ({r['held_vs_copy']:.2f}x)")
    return out


def tables(res: dict) -> list[str]:
    """Markdown tables of :func:`run`'s result."""
    L = []
    if res["calls"]:
        names = list(next(iter(res["calls"].values()))["variants"])
        L += ["Forward + weight-gradient GEMMs of every expert, GFLOP/s (x the per-expert `mm` rate): B1 = one "
              "`torch.mm` per expert, BN = `torch.bmm` over N experts at a time, Ball = one bmm over all.", "",
              "| case | E | rows per expert | M | H | " + " | ".join(names) + " |",
              "|" + "---|" * (5 + len(names))]
        for name, r in res["calls"].items():
            v = r["variants"]
            cells = [f"{v[k]['gflops']:.0f} ({v[k]['vs_per_expert']:.2f})" if k in v else "-" for k in names]
            L.append(f"| {name} | {r['E']} | {r['rows']} | {r['M']} | {r['H']} | " + " | ".join(cells) + " |")
    if res["decode"]:
        first = next(iter(res["decode"].values()))
        names = [k for k in first["variants"] if k != "stream"]
        L += ["", f"Decode: E {first['E']} experts of [K {first['K']}, N {first['N']}] float32 "
              f"({first['weight_bytes'] / 2**20:.1f} MiB), ms (x the stream); kn = `x @ W` order [E, K, N], "
              "nk = nn.Linear order [E, N, K].", "",
              "| rows per expert | stream ms | " + " | ".join(names) + " |",
              "|" + "---|" * (2 + len(names))]
        for r in res["decode"].values():
            v = r["variants"]
            L.append(f"| {r['rows']} | {v['stream']['seconds'] * 1e3:.2f} | "
                     + " | ".join(f"{v[k]['seconds'] * 1e3:.2f} ({v[k]['vs_stream']:.2f})" for k in names) + " |")
    if res.get("storage"):
        L += ["", "MoELayer step with its gated weights as held (out x in) vs contiguous x @ W copies of them, "
              "through `fmoe.moe`, interleaved; ms, medians.", "",
              "| config | T | phase | held ms | x @ W copy ms | held / copy | max abs diff |", "|---|---|---|---|---|---|---|"]
        for r in res["storage"].values():
            v = r["variants"]
            L.append(f"| {r['config']} | {r['tokens']} | {'train' if r['train'] else 'decode'} | "
                     f"{v['held']['seconds'] * 1e3:.1f} | {v['xw_copy']['seconds'] * 1e3:.1f} | "
                     f"{r['held_vs_copy']:.2f} | {r['max_abs_diff']:.1e} |")
    return L
