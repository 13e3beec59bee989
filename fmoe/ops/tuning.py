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

__all__ = ["RAGGED_SMALL_ROWS", "RAGGED_NUMBA_MAX_BYTES",
           "RAGGED_SERIAL_BYTES", "NUMBA_SERIAL_ELEMENTS", "MATVEC_BYTES", "GEMV_ROWS"]


# fmoe.ops.ragged: groups with at most RAGGED_SMALL_ROWS rows may run in the numba
# streaming kernel instead of one torch.mm each (float32/64 on CPU), and do when the busy
# experts' weights they read add up to at most RAGGED_NUMBA_MAX_BYTES.
# ``python -m benchmarks.bench_ragged --only groups`` (32 busy experts, equal groups of 1-16
# rows, K = N = 128-768, both weight orders; quiet machine, load 0.6-0.8, 2026-12-01 20:26
# UTC), numba's time over MKL's: 2 MiB of weights 0.43-0.97; 8 MiB 0.54-0.85 at 1-4 rows,
# 1.06-1.54 at 8-16; 18 MiB 0.79-2.6; 72 MiB 1.35-2.2. Small problems are per-call
# overhead, which one numba call saves; large ones are the weight read, where MKL's kernels
# are faster. (Under load 8-10 MKL stalled instead: 135 ms-2.3 s for 32 groups of 1-16 rows
# at 72 MiB, against 28-129 ms for numba.)
# (On an AMD EPYC host the numba kernel won at every weight size measured, up to 128 MiB;
# the expert engine measures its own decode choice per machine, :mod:`fmoe.engine.wisdom`.
# This staged-pipeline path keeps the one cap.)
RAGGED_SMALL_ROWS = 16
RAGGED_NUMBA_MAX_BYTES = 4 << 20

# fmoe.ops.ragged: below this many weight bytes the small groups take the serial numba twin.
# Chosen so that a TBB region's start (~50 us, see NUMBA_SERIAL_ELEMENTS) stays under about
# a third of one core's read time of those bytes (1 MiB at 4-10 GB/s: 100-250 us). Checked
# above it: at 2-3 MiB the parallel kernel took 0.68-0.82x the serial one's time (ad hoc,
# 2026-12-01, quiet machine).
RAGGED_SERIAL_BYTES = 1 << 20

# fmoe.ops.numba_cpu dispatch / combine: below this many buffer elements (rows x M, both
# sides) the serial kernels run, since a parallel region costs more than the copy
# (~50 us per op at T 1, M 256).
NUMBA_SERIAL_ELEMENTS = 1 << 15

# fmoe.ops.grouped, padded layout with exact=True: weight bytes streamed (filled rows x one
# expert matrix) up to which one serial numba matvec call beats BLAS (per-row GEMVs, or a
# batched GEMM over the padded rows). ``python -m benchmarks.bench_ragged --only matvec``
# (both weight orders, quiet machine, 2026-12-01 20:30 UTC, load 0.6-1.6, two runs): numba
# took 0.45-0.51x BLAS's time at 0.1 MiB, 0.77-0.86x at 8 MiB and 1.22-1.62x at 16-32 MiB.
# (It was 32 MiB, chosen on the loaded machine.)
MATVEC_BYTES = 8 << 20

# fmoe.ops.grouped, padded layout with exact=True: an expert with at most this many rows runs
# one matrix-vector product per row instead of a small GEMM. Chosen under load, where a 2-8
# row float32 MKL GEMM took 11-16 ms per [2048, 768] expert against 0.4 ms for one GEMV
# (2026-11-30). Quiet, the two are level: 0.97-1.07 at decode shapes (E 32-128, K 768-1024,
# ad hoc, 2026-12-01).
GEMV_ROWS = 4
