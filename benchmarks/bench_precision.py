"""Low-precision training benchmark: the char-LM example trained once per expert precision.

    python -m benchmarks.bench_precision                      # charlm defaults (600 steps)
    python -m benchmarks.bench_precision --steps 200 --model_dim 64 --hidden_size 128 \
        --out runs/precision                                  # smaller, same comparison
    python -m benchmarks.bench_precision --ranks 2 --a2a_only # a2a wire formats under mpiexec
    python -m benchmarks.bench_precision --timing_only --threads 1   # round-robin step times

Every run is its own subprocess (``python -m fmoe.examples.charlm``, same seed and data, so
the precision is the only difference); its peak RSS is that process's own. Reported per run:
final validation loss and its gap to the fp32 run, step time (median after warmup), bytes
autograd saved for backward in one step (the activation memory), peak RSS, and the bytes one
dispatch all-to-all puts on the wire. With ``--ranks N`` each a2a wire format runs under
``mpiexec -n N`` (fp32 experts). Writes ``<out>/results.json`` (atomically), ``<out>/table.md``
and ``<out>/loss_curves.png``. Nothing is reported that was not measured in this run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

PRECISIONS = ("fp32", "bf16", "fp8_row", "fp8_block", "mxfp8", "mxfp4", "nvfp4")
A2A = ("fp32", "bf16", "fp8", "mxfp8")
TARGET_GAP = {"bf16": 0.01, "fp8_row": 0.01, "fp8_block": 0.01, "mxfp8": 0.01, "mxfp4": 0.03, "nvfp4": 0.03}


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def run_one(name: str, charlm_args: list, out: Path, ranks: int, timeout: float) -> dict:
    run_dir = out / name
    cmd = [sys.executable, "-m", "fmoe.examples.charlm", *charlm_args, "--out", str(run_dir),
           "--no_progress", "--no_plot"]
    if ranks > 1:
        launcher = shutil.which("mpiexec") or str(Path(sys.executable).parent / "mpiexec")
        cmd = [launcher, "-n", str(ranks), *cmd]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: charlm failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["name"] = name
    summary["command"] = " ".join(cmd[cmd.index("-m"):] if ranks == 1 else cmd)
    summary["wall_seconds"] = time.perf_counter() - t0
    return summary


def table(rows: list, ref: dict) -> str:
    lines = ["| run | val loss | gap vs fp32 | target | step time (s) | x fp32 | saved for backward (MB) | "
             "peak RSS (MB) | bytes / dispatch a2a |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gap = r["final_val_loss"] / ref["final_val_loss"] - 1
        prec = r["expert_precision"]
        tgt = TARGET_GAP.get(prec)
        status = "" if tgt is None or r is ref else (f"<= {tgt:.0%}: " + ("met" if abs(gap) <= tgt else "MISSED"))
        a2a = r["a2a_bytes_per_call"] if r.get("a2a_precision") else None
        lines.append(
            f"| {r['name']} | {r['final_val_loss']:.4f} | {gap:+.2%} | {status} | {r['step_seconds']:.3f} | "
            f"{r['step_seconds'] / ref['step_seconds']:.2f} | {r['saved_activation_bytes'] / 1e6:.2f} | "
            f"{(r['peak_rss_bytes'] or 0) / 1e6:.0f} | "
            + (f"{a2a:,} ({r['a2a_bytes_per_call_fp32'] / a2a:.2f}x fewer than fp32)" if a2a else "no a2a (1 rank)")
            + " |")
    return "\n".join(lines)


def plot(rows: list, path: Path) -> bool:
    """Left: train loss (running mean, zoomed past the initial drop); right: validation loss
    of every run relative to the first fp32 run, in percent (the quantity the targets bound)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG")
        return False
    ref = next((r for r in rows if r["name"] == "fp32"), rows[0])
    ref_val = dict((s, v) for s, v in ref["val_curve"])
    fig, (ax, axv) = plt.subplots(1, 2, figsize=(13, 4.8))
    lo, hi = float("inf"), -float("inf")
    for r in rows:
        curve = r["train_curve"]
        w = max(1, len(curve) // 30)  # running mean: single batches are noisy
        smooth = [sum(curve[max(0, i - w + 1):i + 1]) / len(curve[max(0, i - w + 1):i + 1]) for i in range(len(curve))]
        start = len(curve) // 5
        ax.plot(range(start, len(curve)), smooth[start:], label=r["name"], lw=1.1)
        lo, hi = min(lo, min(smooth[start:])), max(hi, max(smooth[start:]))
        pts = [(s, 100 * (v / ref_val[s] - 1)) for s, v in r["val_curve"] if s in ref_val]
        axv.plot([s for s, _ in pts], [g for _, g in pts], "o-", label=r["name"], ms=3, lw=1.1)
    ax.set_ylim(lo - 0.02, hi + 0.02)
    ax.set_title(f"train loss (running mean over {w} steps)")
    ax.set_ylabel("nats/char")
    axv.axhline(0, color="k", lw=0.8)
    for t, style in ((1, ":"), (3, "--")):
        axv.axhline(t, color="gray", lw=0.8, ls=style)
    axv.set_title("validation loss vs fp32 (%); dotted 1%, dashed 3% targets")
    axv.set_ylabel("gap (%)")
    for a in (ax, axv):
        a.set_xlabel("step")
        a.grid(alpha=0.3)
        a.legend(fontsize=7, ncol=2)
    fig.suptitle("fmoe char-LM, expert GEMMs trained in low precision (same seed and data unless named)")
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)
    plt.close(fig)
    return True


def time_round_robin(precisions, cfg_args: dict, rounds: int = 5, steps: int = 4, batch_size: int = 32,
                     save_fp8: bool = False) -> dict:
    """Training-step time per precision, measured round-robin in one process (every round times
    ``steps`` full steps of every model in turn, so load bursts of a shared machine hit all of
    them alike). Returns name -> {"median_s", "all_s"} (per-step medians of each round)."""
    import statistics

    import torch

    from fmoe.examples import charlm
    from fmoe.quant.training import recipe_from_name

    cfg = charlm.CharLMConfig(**cfg_args)
    data = charlm.load_corpus(1_000_000)
    names = list(precisions) + (["fp32+save_fp8", "fp8_block+save_fp8"] if save_fp8 else [])
    models, opts, its = {}, {}, {}
    for name in names:
        prec, _, save = name.partition("+save_")
        models[name] = charlm.CharLM(cfg, seed=0, precision=recipe_from_name(prec, save_activations=save or None))
        opts[name] = torch.optim.AdamW(models[name].parameters(), lr=1e-3)
        its[name] = charlm.batches(data, batch_size, cfg.context, torch.Generator().manual_seed(0))

    def step(name):
        inputs, targets = next(its[name])
        loss, l_aux = models[name].loss(inputs, targets)
        opts[name].zero_grad(set_to_none=True)
        (loss + cfg.aux_weight * l_aux).backward()
        opts[name].step()

    for name in names:  # warmup: numba kernels load, allocator settles
        step(name)
        step(name)
    per = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            t0 = time.perf_counter()
            for _ in range(steps):
                step(name)
            per[name].append((time.perf_counter() - t0) / steps)
    return {name: {"median_s": statistics.median(v), "all_s": v} for name, v in per.items()}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    p.add_argument("--save_fp8", action="store_true",
                   help="also run fp32 and fp8_block with --save_activations fp8 (activation compression)")
    p.add_argument("--noise_seeds", type=int, nargs="*", default=[],
                   help="also run fp32 with these training seeds (run-to-run noise)")
    p.add_argument("--ranks", type=int, default=1, help="> 1: also run each a2a wire format under mpiexec")
    p.add_argument("--a2a_only", action="store_true", help="with --ranks: only the a2a runs")
    p.add_argument("--out", default="runs/bench_precision")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    p.add_argument("--timing_only", action="store_true",
                   help="only the round-robin step timing (in this process), no training runs")
    p.add_argument("--rounds", type=int, default=5, help="round-robin timing rounds")
    args, charlm_args = p.parse_known_args(argv)
    if args.timing_only:
        return timing_main(args, charlm_args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    if not args.a2a_only:
        plan = [(prec, ["--expert_precision", prec]) for prec in args.precisions]
        if args.save_fp8:
            plan += [(f"{prec}+save_fp8", ["--expert_precision", prec, "--save_activations", "fp8"])
                     for prec in ("fp32", "fp8_block")]
        # fp32 again with other training seeds (same validation files): the run-to-run noise
        # the precision gaps are to be read against
        plan += [(f"fp32_seed{sd}", ["--expert_precision", "fp32", "--seed", str(sd)]) for sd in args.noise_seeds]
        runs += [(n, a, 1) for n, a in plan]
    if args.ranks > 1:
        runs += [(f"ep{args.ranks}_a2a_{w}", ["--a2a_precision", w], args.ranks) for w in A2A]
    results = []
    for name, extra, ranks in runs:
        r = run_one(name, charlm_args + extra, out, ranks, args.timeout)
        results.append(r)
        print(f"{name}: val {r['final_val_loss']:.4f}, step {r['step_seconds']:.3f} s, "
              f"saved {r['saved_activation_bytes'] / 1e6:.2f} MB, peak RSS {(r['peak_rss_bytes'] or 0) / 1e6:.0f} MB",
              flush=True)
        _write_atomic(out / "results.json", json.dumps({"argv": charlm_args, "runs": results}, indent=1))
    md = []
    single = [r for r in results if r["ranks"] == 1]
    if single:
        ref = next((r for r in single if r["name"] == "fp32"), single[0])
        md.append(table(single, ref))
    multi = [r for r in results if r["ranks"] > 1]
    if multi:
        ref = next((r for r in multi if r["a2a_precision"] == "fp32"), multi[0])
        md.append(table(multi, ref))
    text = "\n\n".join(md)
    _write_atomic(out / "table.md", text + "\n")
    print(text)
    if plot(single or multi, out / "loss_curves.png"):
        print(f"wrote {out / 'loss_curves.png'}")
    return {"runs": results}


def timing_main(args, charlm_args: list) -> dict:
    import dataclasses

    import torch

    from fmoe.examples import charlm
    ns = charlm.parse_args(charlm_args)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    cfg_args = {f.name: getattr(ns, f.name) for f in dataclasses.fields(charlm.CharLMConfig)}
    res = time_round_robin(args.precisions, cfg_args, rounds=args.rounds, batch_size=ns.batch_size,
                           save_fp8=args.save_fp8)
    ref = res.get("fp32", next(iter(res.values())))["median_s"]
    lines = ["| run | step time (s, median of round medians) | x fp32 | round medians (s) |", "|---|---|---|---|"]
    for name, r in res.items():
        lines.append(f"| {name} | {r['median_s']:.3f} | {r['median_s'] / ref:.2f} | "
                     + ", ".join(f"{t:.3f}" for t in r["all_s"]) + " |")
    text = "\n".join(lines)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _write_atomic(out / "timing.json", json.dumps({"argv": charlm_args, "config": cfg_args,
                                                   "threads": torch.get_num_threads(), "timing": res}, indent=1))
    _write_atomic(out / "timing.md", text + "\n")
    print(text)
    return res


if __name__ == "__main__":
    main()
