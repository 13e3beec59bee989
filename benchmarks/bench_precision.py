"""Low-precision training benchmark: the char-LM example trained once per expert precision.

    python -m benchmarks.bench_precision                      # charlm defaults (600 steps)
    python -m benchmarks.bench_precision --steps 200 --model_dim 64 --hidden_size 128 \
        --out runs/precision                                  # smaller, same comparison
    python -m benchmarks.bench_precision --ranks 2 --a2a_only # a2a wire formats under mpiexec

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
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG")
        return False
    fig, (ax, axv) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in rows:
        curve = r["train_curve"]
        w = max(1, len(curve) // 30)  # running mean: single batches are noisy
        smooth = [sum(curve[max(0, i - w + 1):i + 1]) / len(curve[max(0, i - w + 1):i + 1]) for i in range(len(curve))]
        ax.plot(range(len(curve)), smooth, label=r["name"], lw=1.2)
        axv.plot([s for s, _ in r["val_curve"]], [v for _, v in r["val_curve"]], "o-", label=r["name"], ms=3)
    ax.set_title(f"train loss (running mean over {w} steps)")
    axv.set_title("validation loss (files held out)")
    for a in (ax, axv):
        a.set_xlabel("step")
        a.set_ylabel("nats/char")
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    lo = min(min(v for _, v in r["val_curve"]) for r in rows)
    axv.set_ylim(lo - 0.05, lo + 0.6)
    fig.suptitle("fmoe char-LM: expert GEMMs trained in low precision (same seed, same data)")
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)
    plt.close(fig)
    return True


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    p.add_argument("--save_fp8", action="store_true",
                   help="also run fp32 and fp8_block with --save_activations fp8 (activation compression)")
    p.add_argument("--ranks", type=int, default=1, help="> 1: also run each a2a wire format under mpiexec")
    p.add_argument("--a2a_only", action="store_true", help="with --ranks: only the a2a runs")
    p.add_argument("--out", default="runs/bench_precision")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    args, charlm_args = p.parse_known_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    if not args.a2a_only:
        plan = [(prec, ["--expert_precision", prec]) for prec in args.precisions]
        if args.save_fp8:
            plan += [(f"{prec}+save_fp8", ["--expert_precision", prec, "--save_activations", "fp8"])
                     for prec in ("fp32", "fp8_block")]
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


if __name__ == "__main__":
    main()
