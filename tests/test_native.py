"""native/: the CUDA library builds with nvcc and exports the C ABI; the loader stays lazy.

Skipped when nvcc is absent. GPU execution is checked by benchmarks/gpu_check.py, not here.
"""
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NATIVE = os.path.join(ROOT, "native")
SYMBOLS = ["fmoe_native_version", "fmoe_native_error_string", "fmoe_w4a16_grouped_matmul",
           "fmoe_w4a16_rows_matmul", "fmoe_fp8_block_grouped_gemm", "fmoe_dispatch", "fmoe_combine"]


_LAZY = """
import torch
import fmoe.quant as Q
from fmoe import _native
from fmoe.quant import native
assert _native._LIB is None, "importing fmoe loaded the CUDA library"
w = Q.quantize_mxfp4(torch.randn(1, 4, 32))
x = torch.randn(1, 2, 32).to(torch.bfloat16)
try:
    native.w4a16_matmul(x, w)
except ValueError as e:
    assert "w4a16_matmul: x must be a CUDA tensor, got one on cpu" in str(e), e
else:
    raise AssertionError("a CPU tensor was not rejected")
assert _native._LIB is None, "the rejection loaded the CUDA library"
"""


def test_loader_is_lazy_and_cpu_tensors_are_rejected():
    # In a fresh process: importing never loads the library, and a CPU tensor is rejected before
    # any load is needed (tests earlier in this process may have loaded it on purpose).
    proc = subprocess.run([sys.executable, "-c", _LAZY], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_header_declares_every_symbol():
    header = open(os.path.join(NATIVE, "fmoe_native.h")).read()
    for s in SYMBOLS:
        assert re.search(rf"FMOE_API\s+\w[\w\s\*]*\b{s}\(", header), s


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found: native build not tested")
@pytest.mark.skipif(shutil.which("nm") is None, reason="nm not found")
def test_build_and_exported_symbols():
    # All three architectures (about 35 s on 2 cores; the one-arch fallback is `build.sh 90`).
    # scripts/test.sh builds the library first when nvcc is present; rebuild only if a source
    # is newer than it.
    so = os.path.join(NATIVE, "build", "libfmoe_native.so")
    sources = [os.path.join(NATIVE, f) for f in os.listdir(NATIVE) if f.endswith((".cu", ".cuh", ".h", ".sh"))]
    if not os.path.exists(so) or os.path.getmtime(so) < max(map(os.path.getmtime, sources)):
        proc = subprocess.run(["bash", os.path.join(NATIVE, "build.sh")], capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    nm = subprocess.run(["nm", "-D", "--defined-only", so], capture_output=True, text=True,
                        check=True).stdout
    exported = {line.split()[-1] for line in nm.splitlines() if " T " in line}
    fmoe_syms = {s for s in exported if s.startswith("fmoe")}
    assert fmoe_syms == set(SYMBOLS)
    # The library must embed SASS for each arch; the arch names survive in the fatbin.
    blob = open(so, "rb").read()
    for arch in (b"sm_80", b"sm_90", b"sm_100"):
        assert arch in blob, arch


def test_missing_library_error_names_the_build_script(monkeypatch, tmp_path):
    from fmoe import _native as native

    monkeypatch.setattr(native, "_LIB", None)
    monkeypatch.setattr(native, "library_path", lambda: str(tmp_path / "libfmoe_native.so"))
    with pytest.raises(RuntimeError, match="native/build.sh"):
        native.lib()


def test_dispatch_combine_cuda_kernels_are_registered_on_the_ops():
    # fmoe.dispatch / fmoe.combine on CUDA tensors reach the native kernels (fmoe.ops.cuda),
    # not the reference; gate_grad has no native kernel.
    import fmoe  # noqa: F401  (registers the kernels)
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    assert has("fmoe::dispatch", "CUDA") and has("fmoe::combine", "CUDA")
    assert has("fmoe::dispatch", "CPU") and not has("fmoe::gate_grad", "CUDA")
    from fmoe import _native
    assert _native.library_path() == os.path.join(NATIVE, "build", "libfmoe_native.so")


def test_gpu_check_dry_run_passes_on_cpu(capsys):
    # benchmarks/gpu_check.py must run the first time a GPU is there: its CPU-checkable part (every
    # CUDA table entry and the grouped ragged route on CPU tensors, a tiny char-LM step per
    # precision) runs here and passes; the table section covers every CUDA key of the table.
    import json

    from benchmarks import gpu_check
    from fmoe.engine.table import TABLE
    from fmoe.examples.charlm import PRECISIONS

    assert gpu_check.dry_run() == 0
    report = json.loads(capsys.readouterr().out)
    cuda_keys = [k for k in TABLE if k[0] == "cuda"]
    assert len(report["table"]) == len(cuda_keys) > 0
    assert all(v["ok"] for sec in ("table", "ragged", "rows", "charlm") for v in report[sec].values())
    assert set(report["charlm"]) == {f"charlm_{p}" for p in PRECISIONS}
