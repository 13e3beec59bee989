"""Command line: ``python -m fmoe <command>``.

Commands:
    warmup   compile (or load from numba's cache) every CPU kernel signature
             ahead of time, so the first real call is fast; prints one line
             per kernel and the threading layer. ``--tune SHAPE`` (repeatable) also
             times the kernels that compete for SHAPE's GEMMs and records the winner
             (:mod:`fmoe.engine.wisdom`). ``--calibrate`` also measures where the native grouped
             GEMM's experts-side-by-side regime stops paying on this machine and records the
             thresholds (:func:`fmoe.ops.native.calibrate`; a few seconds, once per machine;
             they change the speed only).
    build    build the native CPU extensions (the grouped GEMM, the packed-weight GEMM and the
             routing walks: torch C++ extensions, ~30 s each; the set-up scripts run it); without
             a C++ compiler it says so and fmoe runs the torch / numba fallbacks.
    info     print the threading layer, thread counts, the TBB library, whether the native
             CPU grouped GEMM is active, and the expert engine's kernel table;
             ``--explain SHAPE`` prints which kernel each GEMM of one step of SHAPE runs
             and why (SHAPE: ``T=4096,M=512,H=1024,E=8,k=2,kind=ffn,dtype=float32,phase=train``;
             phase train, prefill, decode, or traced: a step on a layout plan).
"""
from __future__ import annotations

import argparse
import sys
import time


def _warmup(args) -> int:
    from . import _numba
    from .ops import numba_cpu

    t0 = time.perf_counter()

    def line(msg: str) -> None:
        print(f"  {msg}", flush=True)

    times = numba_cpu.warmup(line)
    print(f"fmoe warmup: {len(times)} kernels in {time.perf_counter() - t0:.2f} s; "
          f"threading layer: {_numba.threading_layer()}", flush=True)
    if args.calibrate:
        from .engine import wisdom
        from .ops import native
        try:
            found, seconds = native.calibrate(log=line)
        except RuntimeError as e:
            print(f"fmoe warmup --calibrate: not calibrated: {e}", file=sys.stderr)
            return 1
        wisdom.record_regime(found, seconds)
        print(f"fmoe warmup: regime thresholds {found} recorded in {wisdom.path()}", flush=True)
    if args.tune:
        from .engine import table
        for shape in args.tune:
            table.tune(shape, log=line)
    return 0


def _info(args) -> int:
    import numba
    import torch

    from . import _numba
    from .ops import numba_cpu

    numba_cpu.warmup()  # the layer is only known after a parallel launch
    print(f"threading layer: {_numba.threading_layer()}")
    print(f"tbb library: {_numba.tbb_library() or 'not loaded: ' + str(_numba.TBB_ERROR)}")
    print(f"torch threads: {torch.get_num_threads()}; numba threads: {numba.get_num_threads()} "
          f"(max {numba.config.NUMBA_NUM_THREADS})")
    from . import _slots
    from .engine import table, wisdom
    from .ops import native
    from .quant import packed
    print(native.status())
    print(packed.status())
    print(_slots.status())
    if args.explain:
        try:
            text = table.explain(args.explain)
        except ValueError as e:   # a bad SHAPE: the message names the fix, no traceback
            print(f"python -m fmoe info: {e}", file=sys.stderr)
            return 2
        print(text)
        return 0
    for (dev, phase, dt, _), kern in table.TABLE.items():
        if dev == "cpu":
            print(f"expert GEMMs cpu/{phase}/{str(dt).replace('torch.', '')}: {kern.name}")
    measured = wisdom.regime()
    print(f"native regime thresholds: {native.thresholds()} "
          + ("(measured on this machine)" if measured else
             "(defaults; python -m fmoe warmup --calibrate measures this machine's)"))
    tuned = {k: v for k, v in wisdom.load().items() if k != wisdom.REGIME_KEY}
    print(f"measured choices: {len(tuned)} shape classes in {wisdom.path()}" if tuned else
          "measured choices: none (python -m fmoe warmup --tune SHAPE records some)")
    for cls, entry in sorted(tuned.items()):
        print(f"  {cls}: {entry.get('choice')}")
    return 0


def _build(args) -> int:
    from . import _slots   # the routing walks: their own extension too
    from .ops import native
    from .quant import packed   # its own extension: a failure there never touches the float GEMM
    rc = native.build_command()
    return max(rc, packed.build_command(), _slots.build_command())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fmoe", description="fmoe utilities")
    sub = parser.add_subparsers(dest="command", required=True)
    warm = sub.add_parser("warmup", help="compile every CPU kernel signature ahead of time")
    warm.add_argument("--tune", action="append", default=[], metavar="SHAPE",
                      help="also measure the competing kernels of SHAPE's GEMMs and record the winner")
    warm.add_argument("--calibrate", action="store_true",
                      help="also measure the native grouped GEMM's regime thresholds on this machine and record them")
    warm.set_defaults(fn=_warmup)
    sub.add_parser("build", help="build the native CPU grouped GEMM").set_defaults(fn=_build)
    info = sub.add_parser("info", help="threading layer, thread counts and the expert engine's kernels")
    info.add_argument("--explain", metavar="SHAPE", default=None,
                      help="which kernel each GEMM of one step of SHAPE runs, and why")
    info.set_defaults(fn=_info)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
