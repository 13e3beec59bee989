"""Command line: ``python -m fmoe <command>``.

Commands:
    warmup   compile (or load from numba's cache) every CPU kernel signature
             ahead of time, so the first real call is fast; prints one line
             per kernel and the threading layer.
    info     print the threading layer, thread counts, the TBB library and the decode GEMM kernels.
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
    return 0


def _info(args) -> int:
    import numba
    import torch

    from . import _numba
    from .ops import numba_cpu, tuning

    numba_cpu.warmup()  # the layer is only known after a parallel launch
    print(f"threading layer: {_numba.threading_layer()}")
    print(f"tbb library: {_numba.tbb_library() or 'not loaded: ' + str(_numba.TBB_ERROR)}")
    print(f"torch threads: {torch.get_num_threads()}; numba threads: {numba.get_num_threads()} "
          f"(max {numba.config.NUMBA_NUM_THREADS})")
    kernels = "numba few-row kernels" if tuning.NUMBA_SMALL_GEMMS else "BLAS (torch._grouped_mm / torch.mm)"
    print(f"decode GEMMs: {kernels} (CPU vendor: {tuning.CPU_VENDOR or 'unknown'}; tuning.NUMBA_SMALL_GEMMS)")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fmoe", description="fmoe utilities")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("warmup", help="compile every CPU kernel signature ahead of time").set_defaults(fn=_warmup)
    sub.add_parser("info", help="threading layer and thread counts").set_defaults(fn=_info)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
