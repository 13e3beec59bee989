"""Whole-model resident memory only, fmoe-patched (packed experts) vs transformers, at a chosen depth.

The memory columns of ``python -m benchmarks.bench_inference --model-only`` without its timings, so a
deeper model fits in minutes: the gpt-oss layout checkpoint of ``--size`` (fmoe.examples.generate)
with ``--layers`` MoE layers, each variant in its own process; resident memory (VmRSS = anonymous +
file-backed, /proc/self/status) after load and at decode b1's steady state (after ``--tokens`` new
tokens, twice: the weights decode reads are paged in, its libraries loaded), and the peak (VmHWM).
Shows how the ratio moves with the weights' share of the process: both variants carry the same
floor of imported code (torch, transformers' model code: ~340 MiB here).

Run: ``python -m benchmarks.bench_model_memory [--size small] [--layers 4 16] [--tokens 17]``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

from benchmarks.bench_common import report
from benchmarks.bench_inference import _memory


def child(variant: str, path: str, tokens: int) -> dict:
    from fmoe.examples import generate as G
    import gc
    if variant == "fmoe":
        model, _ = G.load_patched(path, "gpt_oss", dtype=torch.bfloat16)
    else:
        model = G.load_reference(path, dtype=torch.bfloat16)
    gc.collect()
    out = {"load": _memory()}
    prompt = torch.randint(1, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        G.greedy(model, prompt, tokens)
    out["decode"] = _memory()
    out["numba_loaded"] = "numba" in sys.modules
    return out


def run(size: str, layers: list, tokens: int, log=print) -> dict:
    from fmoe.examples import generate as G
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = {"size": size, "threads": torch.get_num_threads(), "by_layers": {}}
    base = G.SIZES[size]
    for n in layers:
        name = f"{size}-{n}L"
        G.SIZES[name] = dict(base, layers=n)   # this process's table only: the checkpoint carries its config
        with tempfile.TemporaryDirectory(prefix="fmoe-bench-memory-") as path:
            G.write_checkpoint(path, "gpt_oss", name)
            r = {"checkpoint_bytes": os.path.getsize(os.path.join(path, "model.safetensors"))}
            for variant in ("fmoe", "transformers"):
                p = subprocess.run([sys.executable, "-m", "benchmarks.bench_model_memory", "--child", variant,
                                    "--checkpoint", path, "--tokens", str(tokens)], cwd=root, capture_output=True,
                                   text=True, timeout=1800)
                if p.returncode:
                    raise RuntimeError(f"{variant} at {n} layers failed:\n{p.stderr[-2000:]}")
                r[variant] = json.loads(p.stdout.strip().splitlines()[-1])
                m = r[variant]
                log(f"  {name} {variant}: MiB after load {m['load']['rss'] / 2**20:.0f}, at decode b1 "
                    f"{m['decode']['rss'] / 2**20:.0f} (anon {m['decode']['anon'] / 2**20:.0f} + file "
                    f"{m['decode']['file'] / 2**20:.0f}), peak {m['decode']['hwm'] / 2**20:.0f}")
        res["by_layers"][n] = r
    return res


def tables(res: dict) -> list[str]:
    mib = 2 ** 20
    lines = [f"gpt-oss layout '{res['size']}' with more layers, bf16, {res['threads']} threads; MiB: total (anon + "
             "file); ratio = fmoe / transformers", "",
             "| layers | checkpoint MiB | variant | after load | **at decode b1** | peak | numba loaded |",
             "|---|---|---|---|---|---|---|"]
    for n, r in res["by_layers"].items():
        for v in ("fmoe", "transformers"):
            m = r[v]
            cell = [f"{m[w]['rss'] / mib:.0f} ({m[w]['anon'] / mib:.0f} + {m[w]['file'] / mib:.0f})"
                    for w in ("load", "decode")]
            lines.append(f"| {n} | {r['checkpoint_bytes'] / mib:.0f} | {v} | {cell[0]} | **{cell[1]}** | "
                         f"{m['decode']['hwm'] / mib:.0f} | {'yes' if m['numba_loaded'] else 'no'} |")
        f, t = r["fmoe"], r["transformers"]
        lines.append(f"| {n} | | ratio | {f['load']['rss'] / t['load']['rss']:.2f}x | "
                     f"**{f['decode']['rss'] / t['decode']['rss']:.2f}x** | "
                     f"{f['decode']['hwm'] / t['decode']['hwm']:.2f}x | |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="small")
    p.add_argument("--layers", nargs="+", type=int, default=[4, 16])
    p.add_argument("--tokens", type=int, default=17)
    p.add_argument("--json", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.checkpoint, args.tokens)))
        return 0
    res = run(args.size, args.layers, args.tokens)
    report(tables(res), res, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
