"""Kernel-choice thresholds, each with the measurement that chose it: the one place for them.

All were measured on the 2-vCPU development machine (Intel Xeon with AVX-512, torch 2.13
CPU build with MKL, numba 0.68 with TBB, torch's default 2 threads), except where a value
depends on the CPU's vendor (``NUMBA_SMALL_GEMMS``): those were measured on both an Intel
Xeon and an AMD EPYC host of the same size. The kernels read them
at call time (``tuning.NAME``), so a test or a benchmark can patch them here. The
benchmarks named below re-measure them; BENCHMARKS.md has the tables.

The machine is shared: under other jobs' load (load average 3-10) MKL's small threaded
calls stall on a descheduled thread, and several of these were first chosen in such runs.
The values below are for a quiet machine (load < 2), as the benchmarks run.

Not here: the numba kernels' compile-time chunk sizes (``_ragged_kernels.NK_CHUNK`` /
``KN_CHUNK``), since numba freezes globals into the compiled code and keys its on-disk
cache on the kernel's own file; ``streamed.IN_GRAD_PAD_DIV``, a memory bound rather than a
measured speed.
"""
from __future__ import annotations

__all__ = ["CPU_VENDOR", "NUMBA_SMALL_GEMMS", "STREAMED_SMALL_PAIRS", "RAGGED_SMALL_ROWS", "RAGGED_NUMBA_MAX_BYTES",
           "RAGGED_SERIAL_BYTES", "NUMBA_SERIAL_ELEMENTS", "MATVEC_BYTES", "GEMV_ROWS"]


def cpu_vendor(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The first ``vendor_id`` in ``cpuinfo`` ("GenuineIntel", "AuthenticAMD"); "" where there
    is none (not Linux, or not x86)."""
    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


CPU_VENDOR = cpu_vendor()

# Few-row GEMMs (decode: 1-16 rows per expert) by the numba kernels of fmoe.ops.ragged
# instead of MKL, on AMD CPUs. MKL's few-row sgemm is fast on Intel and slow on AMD; which
# one wins is the CPU's, so the choice is the vendor's (one rule, the same every run):
# * AMD EPYC (Zen 4, AVX-512, 2 vCPUs, 2026-12-02, ad hoc, medians of 20): over E 64 x
#   [1024 x 512] / [512 x 1024] and E 32 x [768 x 768] fp32 weights, both orders, n = 1-8 rows
#   per expert, the numba kernel took 0.22-0.83x the time of one torch._grouped_mm (1.0-4.4x
#   the time of a sum over the same weights, against 2.7-9.9x for grouped_mm); at 16 rows
#   0.70-1.03x, at 32-64 rows 0.93-1.52x (MKL level or ahead). In the decode steps: 0.42-0.86x
#   (BENCHMARKS.md, session 10).
# * Intel Xeon (Emerald Rapids, the same 2 vCPUs, sessions 6 and 8, BENCHMARKS.md "Tried and
#   dropped"): MKL was level or ahead. Over [64, 1024, 1024] weights a numba kernel took 12.7 /
#   14.4 / 18.0 / 20.0 ms at 1 / 4 / 6 / 8 rows per expert against MKL's 11.2 / 16.2 / 18.2 /
#   20.0, and the ragged kernel 1.35-2.2x MKL's time at 72 MiB (RAGGED_NUMBA_MAX_BYTES below).
NUMBA_SMALL_GEMMS = CPU_VENDOR == "AuthenticAMD"

# fmoe.ops.streamed, inference: calls with at most this many kept pairs run the elementwise
# steps once over all rows and the GEMMs as one call per projection (torch._grouped_mm, or
# the numba kernels where NUMBA_SMALL_GEMMS), leaving no per-expert Python loop. At decode (T 16, E 64, k 6, M 1024, H 512: 96 pairs over ~50
# experts) the per-expert loop took 26 ms, this 19 ms, against 14 ms to read the busy
# experts' weights (ad hoc, 2026-12-01, quiet machine). Above it the [pairs, O] row buffer
# is not worth its memory.
STREAMED_SMALL_PAIRS = 1024

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
# On AMD (NUMBA_SMALL_GEMMS) the numba kernel won at every weight size measured there, up to
# 128 MiB (E 64 x [1024 x 512] fp32, 1-8 rows per expert, see above): no byte cap.
RAGGED_SMALL_ROWS = 16
RAGGED_NUMBA_MAX_BYTES = 1 << 62 if NUMBA_SMALL_GEMMS else 4 << 20

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
