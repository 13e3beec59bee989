"""Interleaved A/B of the streamed expert op between git revisions, in one process.

    python -m benchmarks.bench_ab --rev 58caab1 --rev WORKTREE [--only coarse,fine_cf125] [--blocks gpt_oss]
                                  [--repeats 12] [--out benchmarks/out]

Each ``--rev``'s ``fmoe/ops/streamed.py`` (``WORKTREE``: the file as it is on disk) is loaded as
its own module inside the current ``fmoe.ops`` package, so its relative imports resolve to the
working tree's other modules, and is swapped in as the op ``fmoe.moe`` calls. Only that one file
differs between the variants: a revision whose op needs other changed modules fails to load
and is reported. Every variant of a config runs one training step (bench_layer's / bench_blocks'
step: forward + backward with a fixed upstream gradient) per repeat, the order reversed every
other repeat; medians of wall and process CPU time, ratios against the first ``--rev``.

This measures one change to the op against the machine's noise far better than two runs of
``benchmarks.run`` minutes apart (the machine's GEMM rate moves +-20% between minutes).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys

import fmoe  # noqa: F401  (binds fmoe.moe, the module that calls the op)

from . import bench_common as bc

OP_PATH = "fmoe/ops/streamed.py"
WORKTREE = "WORKTREE"


def load_op(rev: str):
    """The streamed op module of ``rev`` (a git revision or WORKTREE)."""
    if rev == WORKTREE:
        with open(os.path.join(bc.REPO, OP_PATH), encoding="utf-8") as f:
            src = f.read()
    else:
        src = subprocess.run(["git", "show", f"{rev}:{OP_PATH}"], cwd=bc.REPO, capture_output=True, text=True,
                             check=True).stdout
    name = "fmoe.ops._ab_" + "".join(c if c.isalnum() else "_" for c in rev)
    spec = importlib.util.spec_from_loader(name, loader=None)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "fmoe.ops"
    sys.modules[name] = mod          # dataclasses look their module up while the class is built
    exec(compile(src, f"{rev}:{OP_PATH}", "exec"), mod.__dict__)
    return mod


def _time(step, mods: dict, repeats: int) -> dict:
    """One ``step`` per revision per repeat, each with that revision's op swapped in."""
    moe_mod = sys.modules["fmoe.moe"]

    def with_op(mod):
        def call():
            moe_mod._streamed = mod
            step()
        return call

    t = bc.round_robin({k: with_op(m) for k, m in mods.items()}, repeats, alternate=True)
    first = t[next(iter(mods))]
    return {k: {"seconds": m["seconds"], "cpu_seconds": m["cpu_seconds"], "vs_first": m["seconds"] / first["seconds"],
                "cpu_vs_first": m["cpu_seconds"] / first["cpu_seconds"]} for k, m in t.items()}


def run(revs: list, layer_configs: list, archs: list, repeats: int) -> dict:
    from . import bench_blocks as bb
    from . import bench_layer as bl
    mods = {rev: load_op(rev) for rev in revs}
    moe_mod = sys.modules["fmoe.moe"]
    real = moe_mod._streamed
    out = {"revs": revs, "repeats": repeats, "layer": {}, "blocks": {}}
    try:
        for name in layer_configs:
            c = bl.BY_NAME[name]
            layer, x = bl.build(c, c.tokens, "fmoe")
            step, _ = bl.step_fns(layer, x, c.train)
            out["layer"][name] = _time(step, mods, repeats)
            _print(name, out["layer"][name])
        for arch in archs:
            block, cfg, params, bcfg, mod = bb.build(arch, bb.SHAPE)
            x = bb._input(bb.SHAPE, bb.PHASES["train"], True)
            step, _ = bb.step_fns("fmoe", "train", block, cfg, params, bcfg, mod, x)
            out["blocks"][arch] = _time(step, mods, repeats)
            _print(f"{arch} train", out["blocks"][arch])
    finally:
        moe_mod._streamed = real
    return out


def _print(label: str, res: dict) -> None:
    cells = [f"{k}: {v['seconds'] * 1e3:.1f} ms ({v['vs_first']:.3f}, CPU {v['cpu_vs_first']:.3f})" for k, v in res.items()]
    print(f"{label:22s} " + "  ".join(cells), flush=True)


def main(argv=None) -> int:
    from . import bench_blocks as bb
    from . import bench_layer as bl
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_ab", description=__doc__.splitlines()[0])
    ap.add_argument("--rev", action="append", required=True,
                    help=f"a git revision, or {WORKTREE} for the file on disk; the first is the baseline")
    ap.add_argument("--only", default="coarse,fine_cf125,dropless,fine_e64k8",
                    help="comma-separated bench_layer training configs ('' for none)")
    ap.add_argument("--blocks", default="", help=f"comma-separated archs of {bb.ARCHS} (train phase)")
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--out", default=os.path.join("benchmarks", "out"))
    args = ap.parse_args(argv)
    if len(args.rev) < 2:
        ap.error("give at least two --rev")
    configs = [n for n in args.only.split(",") if n]
    archs = [a for a in args.blocks.split(",") if a]
    for n in configs:
        if n not in bl.BY_NAME or not bl.BY_NAME[n].train:
            ap.error(f"--only: {n!r} is not a training config of bench_layer ({sorted(bl.BY_NAME)})")
    for a in archs:
        if a not in bb.ARCHS:
            ap.error(f"--blocks: unknown arch {a!r}; known: {bb.ARCHS}")
    try:
        res = run(args.rev, configs, archs, args.repeats)
    except subprocess.CalledProcessError as exc:
        print(f"bench_ab: cannot read {OP_PATH} at that revision: {exc.stderr.strip()}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "ab.json")
    bc.write_json(path, res)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
