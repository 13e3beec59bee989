"""Kernel-choice thresholds, each with the measurement that chose it: the one place for them.

All were measured on the 2-vCPU development machine (Intel Xeon with AVX-512, torch 2.13
CPU build with MKL, numba 0.68 with TBB, torch's default 2 threads). Where two kernels of
the expert engine compete, the choice is measured on the machine itself instead
(:mod:`fmoe.engine.wisdom`). The kernels read these
at call time (``tuning.NAME``), so a test or a benchmark can patch them here. The
benchmarks named below re-measure them; BENCHMARKS.md has the tables.

The machine is shared: under other jobs' load (load average 3-10) MKL's small threaded
calls stall on a descheduled thread, and several of these were first chosen in such runs.
The values below are for a quiet machine (load < 2), as the benchmarks run.

Not here: the numba kernels' compile-time chunk sizes (``_ragged_kernels.NK_CHUNK`` /
``KN_CHUNK``), since numba freezes globals into the compiled code and keys its on-disk
cache on the kernel's own file.
"""
from __future__ import annotations


# fmoe.ops.numba_cpu.few_rows_mm: below this many weight bytes the serial numba twin runs.
# Chosen so that a TBB region's start (~50 us, see NUMBA_SERIAL_ELEMENTS) stays under about
# a third of one core's read time of those bytes (1 MiB at 4-10 GB/s: 100-250 us). Checked
# above it: at 2-3 MiB the parallel kernel took 0.68-0.82x the serial one's time (ad hoc,
# 2026-12-01, quiet machine).
RAGGED_SERIAL_BYTES = 1 << 20

# fmoe.ops.numba_cpu dispatch / combine: below this many buffer elements (rows x M, both
# sides) the serial kernels run, since a parallel region costs more than the copy
# (~50 us per op at T 1, M 256).
NUMBA_SERIAL_ELEMENTS = 1 << 15
