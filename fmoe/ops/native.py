"""Native CPU grouped GEMM: all experts of one projection in one C++ call.

The ragged layout (see :mod:`fmoe.ops.ragged`): expert ``e`` owns rows
``offsets[e]:offsets[e + 1]`` of a row space ``[0, R)``, ``offsets`` int64 ``[E + 1]``
on the CPU, non-decreasing, ``offsets[0] = 0``, ``offsets[E] = R``. ``op(w[e])`` is
``w[e]`` for ``w [E, K, N]`` (``x @ W``) and ``w[e].t()`` for ``w [E, N, K]``
(``transposed=True``, nn.Linear's out x in). Weights are never copied: each
expert's 2-D view goes to ``at::mm`` as it is.

    gather_mm(x, w, offsets, rows=None, transposed=False, out=None, bias=None)      -> y [R, N]
        y[r] = x[rows[r]] @ op(w[e]) (+ bias[e])     (rows=None: x is [R, K] in expert order)
    mm_scatter(a, w, offsets, index, out, scale=None, transposed=False, bias=None)  -> out [T, N]
        out[index[r]] += scale[r] * (a[r] @ op(w[e]) (+ bias[e]))
    gather_wgrad(a, b, offsets, rows=None, rows_b=None, out=None)                   -> z [E, P, Q]
        z[e] = sum over e's rows r of a[rows[r]]^T b[rows_b[r]]   (zeros for an expert with no rows)

Gathered rows and biases never leave the call: each expert's rows are gathered into a scratch
the size of the largest expert, and its bias is added to its output block while that is in
cache, so no [R, K] gathered copy or [R, N] bias-rows tensor is ever made.

Each has a ``*_reference`` twin, a Python loop of torch ops that is the oracle and the
fallback. ``impl="auto"`` (default) runs the extension when it is active and the
reference otherwise; ``"native"`` insists (RuntimeError naming the build command when
inactive); ``"reference"`` forces the loop. These are forward kernels: they do not
record autograd history (the expert engine wraps them in its autograd Functions).

Dtypes: float32, float64, bfloat16, float16; ``x``/``a``, ``w`` (and ``b``, ``out``
of gather_mm/gather_wgrad) share one dtype. mm_scatter's ``out`` may be any of the four
(accumulate in fp32 with a bf16 ``a``, say): the product ``a[r] @ W`` is computed in
``a``'s dtype, rounded to ``out``'s dtype, multiplied by ``scale[r]`` (cast to ``out``'s
dtype) with one rounding, then added to ``out`` with one rounding; a token reached by
several experts gets their terms in ascending expert id, the same order on every run.

Threading. When the busy experts hold few rows each (decode), the experts run side by side
(``at::parallel_for``, one single-threaded ``at::mm`` each); otherwise one after the other,
each ``at::mm`` using the intra-op threads. :func:`regime_for` makes the choice from
:func:`thresholds`: this machine's, measured once by ``python -m fmoe warmup --calibrate``
(:func:`calibrate`, kept in the wisdom file, :mod:`fmoe.engine.wisdom`), else the defaults
:data:`PARALLEL_BELOW_ROWS`, :data:`PARALLEL_BELOW_ROWS_BIG`, :data:`PARALLEL_SMALL_MATRIX_BYTES`
(measured on one Xeon). The thresholds choose only the speed: every regime is correct on any
host, within the bound below. ``regime="serial"|"parallel"`` forces one (tests, benchmarks).

Numerics. Each expert's product is the reference's ``torch.mm`` call on operands of
the same shape, strides and contiguity (a gathered row block is a byte copy, like
``index_select``), and the scatter-add does the reference's roundings in its order. So
the serial regime equals the reference bit for bit in every dtype (the same call on the same
operands with the same intra-op threads, so on any host). The parallel regime
runs each ``at::mm`` single-threaded, and MKL's single-threaded GEMV/small GEMM does not
always split the K-term reduction as its multi-threaded one does: on the 2-core Xeon
(AVX-512, MKL 2024.2) a float32 ``x @ W`` with one row per expert, and float64 with one
or two, differ from the reference in the last bits (other shapes, the transposed order and
bfloat16 matched exactly). Its float32 and bfloat16 products of 1-8 rows an expert run fmoe's
own loops instead (``csrc/grouped_gemm.cpp``, AVX2 + FMA or AVX-512, the same bits on both;
bfloat16 as the float32 loops on its exact values, rounded once; bf16 ``x @ W^T`` by ``vdpbf16ps``
on CPUs with AVX-512 BF16, another order of the same products, which counts denormal bf16 inputs and
partial sums as zero, as torch's bf16 GEMM does there for more than one row; BLAS / ``at::mm`` on a
CPU without AVX2): MKL's few-row kernels read the weights at half the memory rate or less on an AMD EPYC, and
its bf16 GEMM took as long as float32 for half the bytes. The parallel regime is therefore
specified, and tested, within
the forward-error bound of a K-term dot product, ``|native - reference| <= K * eps *
(|x| @ |op(w)|)`` (and ``|scale| *`` that, for mm_scatter), not bit for bit.

Build and load. ``python -m fmoe build`` compiles ``csrc/grouped_gemm.cpp``
(torch.utils.cpp_extension with ninja, ``-O3``, no ``-march=native``) into
``~/.cache/fmoe/native-cpu/<key>/``; the key holds the torch and Python versions and a
hash of the source and flags, so a stale build is never loaded. Import never compiles:
it loads the built library for the current key if there is one. ``python -m
fmoe info`` says whether it is active and why not.
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from typing import Callable, Optional

import torch
from torch import Tensor


# The defaults of thresholds() where this machine never ran `python -m fmoe warmup --calibrate`.
# Experts run side by side when the busy ones hold fewer rows each, on average, than
# PARALLEL_BELOW_ROWS (expert matrix of at most PARALLEL_SMALL_MATRIX_BYTES) or
# PARALLEL_BELOW_ROWS_BIG (larger matrices). Measured once on the 2-core Xeon (AVX-512,
# MKL 2024.2), fp32 gather_mm with rows, medians of 20, time parallel / serial:
#   E=64, K=N=512 (1 MiB a matrix):  1 row 0.83, 2: 0.75-0.86, 4: 0.81, 8: 0.89, 16: 0.64-0.75,
#                                    32: 0.71-0.91, 64: 0.67-0.74, 128: 0.73, 256: 1.01
#   E=32, K=N=1024 (4 MiB a matrix): 1 row 0.86-0.88, 2: 0.81-0.85, 4: 1.02-1.06, 8: 1.38-1.46,
#                                    16: 1.34-1.41, 32: 1.21
# A matrix that stays in cache pays only per-call overhead, which side by side hides; a big one
# is packed by MKL on every call, and one thread packing it alone is slower than two sharing
# it. 32 and 4 stay on the winning side with a margin. Another CPU (or BLAS) may have other
# crossovers, hence calibrate(); any value is correct, only slower or faster.
PARALLEL_BELOW_ROWS = 32
PARALLEL_BELOW_ROWS_BIG = 4
PARALLEL_SMALL_MATRIX_BYTES = 2 << 20

_NAME = "fmoe_grouped_gemm"
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "grouped_gemm.cpp")
# -ffp-contract=off: the scatter's multiply-add must round twice like the reference's
# separate mul and add (it would not on a target whose baseline has FMA, e.g. aarch64).
_CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off")
_LDFLAGS = ("-fopenmp",)
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_BUILD_CMD = "python -m fmoe build"

_EXT = None          # the loaded extension module, or None
_WHY = ""            # why it is not active (empty when active)


# --------------------------------------------------------------------------- build and load

def _compiler() -> Optional[str]:
    return shutil.which("c++") or shutil.which("g++")


def extension_path(name: str, source: str, cflags, ldflags) -> str:
    """Where the built extension ``name`` for this torch, Python, source and flags lives (may not
    exist): its folder is keyed by the torch and Python versions and a hash of the source and
    flags, so any change gets a new key and a stale build is never loaded."""
    h = hashlib.sha256()
    with open(source, "rb") as f:
        h.update(f.read())
    h.update(repr((tuple(cflags), tuple(ldflags))).encode())
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    key = f"torch{torch.__version__}-{py}-{h.hexdigest()[:16]}".replace("+", "_")
    return os.path.join(os.path.expanduser("~"), ".cache", "fmoe", "native-cpu", key, name + ".so")


def library_path() -> str:
    """Where the built extension for this torch, Python and source lives (may not exist)."""
    return extension_path(_NAME, _SOURCE, _CFLAGS, _LDFLAGS)


def load_extension(name: str, path: str):
    """The built extension module ``name`` at ``path`` (exceptions propagate: callers fall back)."""
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def find_extension(name: str, source: str, path: str, fallback: str) -> tuple:
    """(module, "") for the built extension ``name`` at ``path``, or (None, why not): its source
    missing from the install, not built (or no compiler), or a load that failed. Never
    compiles; a broken build never breaks the import of fmoe. ``fallback`` names what runs
    instead, for the message."""
    if not os.path.exists(source):
        return None, f"source {source} missing from the install: {fallback}"
    if not os.path.exists(path):
        return None, (f"not built: run `{_BUILD_CMD}`" if _compiler()
                      else f"no C++ compiler (c++/g++ not on PATH): {fallback}")
    try:
        return load_extension(name, path), ""
    except Exception as e:
        return None, f"load of {path} failed ({type(e).__name__}: {e}): {fallback}; rebuild with `{_BUILD_CMD}`"


def _try_load() -> None:
    """Load the built library for the current key if present; never compiles."""
    global _EXT, _WHY, AVAILABLE
    _EXT, _WHY = find_extension(_NAME, _SOURCE, library_path(), "torch fallback")
    AVAILABLE = _EXT is not None


def status() -> str:
    """One line: whether the extension is active, and its path or why not."""
    if AVAILABLE:
        return f"native CPU grouped GEMM: active ({library_path()})"
    return f"native CPU grouped GEMM: {_WHY}"


class _ninja_on_path:
    """cpp_extension runs `ninja` from PATH; the PyPI wheel's binary is not there unless the
    venv is activated. Prepended for the build only, then restored."""

    def __enter__(self):
        self._old = os.environ.get("PATH", "")
        try:
            import ninja
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + self._old
        except ImportError:
            pass  # cpp_extension then says ninja is missing
        return self

    def __exit__(self, *exc):
        os.environ["PATH"] = self._old


def compile_extension(name: str, source: str, path: str, *, cflags, ldflags, what: str, tag: str,
                      verbose: bool) -> None:
    """Compile ``source`` as the extension ``name`` into ``path`` (torch.utils.cpp_extension with
    ninja). Built in a temporary directory beside the final one and renamed into place, so a
    concurrent or interrupted build never leaves a partial file to load. RuntimeError naming
    ``what`` when no C++ compiler is on PATH."""
    from torch.utils import cpp_extension

    if not _compiler():
        raise RuntimeError(f"no C++ compiler (c++/g++) on PATH: cannot build {what}")
    final_dir = os.path.dirname(path)
    os.makedirs(final_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".build-", dir=os.path.dirname(final_dir))
    t0 = time.time()
    say = print if verbose else (lambda *a, **k: None)
    say(f"[{tag}] compiling {source}\n[{tag}] into {final_dir} (about a minute)", flush=True)
    try:
        with _ninja_on_path():
            cpp_extension.load(name, [source], extra_cflags=list(cflags), extra_ldflags=list(ldflags),
                               build_directory=tmp, verbose=verbose, with_cuda=False)
        os.replace(os.path.join(tmp, name + ".so"), path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"[{tag}] built {path} in {time.time() - t0:.0f} s", flush=True)


def build(verbose: bool = True) -> str:
    """Compile the extension for the current key (a no-op when built) and activate it
    (:func:`compile_extension`). Returns the library path. Raises RuntimeError when no C++
    compiler is on PATH."""
    path = library_path()
    if not os.path.exists(path):
        compile_extension(_NAME, _SOURCE, path, cflags=_CFLAGS, ldflags=_LDFLAGS, what="the native grouped GEMM",
                          tag="fmoe.native", verbose=verbose)
    if not AVAILABLE:
        _try_load()
        if not AVAILABLE:
            raise RuntimeError(status())
    return path


# --------------------------------------------------------------------------- validation

def _fail(fn: str, msg: str) -> None:
    raise ValueError(f"{fn}: {msg}")


def _check_tensor(fn: str, name: str, t, ndim: int, dtypes=_DTYPES) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        _fail(fn, f"{name} is on {t.device}; this grouped GEMM is CPU-only: pass {name}.cpu()")
    if t.dim() != ndim:
        _fail(fn, f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{fn}: {name} has dtype {t.dtype}; expected one of "
                        f"{', '.join(str(d) for d in dtypes)}")


def _check_same_dtype(fn: str, ref_name: str, ref: Tensor, name: str, t: Tensor) -> None:
    if t.dtype != ref.dtype:
        raise TypeError(f"{fn}: {name} has dtype {t.dtype} but {ref_name} has {ref.dtype}; "
                        f"cast one, e.g. {name}.to({ref_name}.dtype)")


def _check_offsets(fn: str, offsets, E: Optional[int], R: Optional[int]) -> list:
    """Return offsets as a list after checking int64 CPU [E + 1], 0-based, monotone, ending at R.
    E=None: any E (taken from offsets)."""
    _check_tensor(fn, "offsets", offsets, 1, dtypes=(torch.int64,))
    if E is None:  # the experts are counted by offsets itself (gather_wgrad)
        if offsets.shape[0] < 1:
            _fail(fn, "offsets must be [E + 1] with at least one entry (offsets[0] = 0), got (0,)")
        E = offsets.shape[0] - 1
    if offsets.shape[0] != E + 1:
        _fail(fn, f"offsets must be [E + 1] = [{E + 1}] for E = {E} experts (w.shape[0]), "
                  f"got {tuple(offsets.shape)}")
    o = offsets.tolist()
    if o[0] != 0:
        _fail(fn, f"offsets[0] must be 0, got {o[0]}")
    for e in range(E):
        if o[e + 1] < o[e]:
            _fail(fn, f"offsets must be non-decreasing: offsets[{e}] = {o[e]} > offsets[{e + 1}] = {o[e + 1]}")
    if R is not None and o[E] != R:
        _fail(fn, f"offsets[-1] = {o[E]} must equal R = {R}, the number of rows")
    return o


def _check_index(fn: str, name: str, idx, R: int, bound: int, bound_name: str) -> None:
    _check_tensor(fn, name, idx, 1, dtypes=(torch.int64,))
    if idx.shape[0] != R:
        _fail(fn, f"{name} must be [R] = [{R}] (offsets[-1]), got {tuple(idx.shape)}")
    if R:
        lo, hi = (int(v) for v in torch.aminmax(idx))
        if lo < 0 or hi >= bound:
            _fail(fn, f"{name} holds values in [{lo}, {hi}] but must lie in [0, {bound}) "
                      f"({bound_name} has {bound} rows)")


def _inner_dims(w: Tensor, transposed: bool) -> tuple:
    """(K, N) of op(w[e])."""
    return (w.shape[2], w.shape[1]) if transposed else (w.shape[1], w.shape[2])


def _check_operands(fn: str, name: str, x, w, transposed: bool) -> tuple:
    """(K, N) of op(w[e]) after checking x [., K] against w [E, ., .] (ranks, dtypes, the inner dim)."""
    _check_tensor(fn, name, x, 2)
    _check_tensor(fn, "w", w, 3)
    _check_same_dtype(fn, name, x, "w", w)
    K, N = _inner_dims(w, transposed)
    if x.shape[1] != K:
        _fail(fn, f"{name} is {tuple(x.shape)} but op(w[e]) is [K, N] = [{K}, {N}] "
                  f"(w {tuple(w.shape)}, transposed={transposed}): {name}.shape[1] must be K")
    return K, N


def _check_out(fn: str, out, shape: tuple, dtype: Optional[torch.dtype], how: str) -> None:
    _check_tensor(fn, "out", out, len(shape))
    if tuple(out.shape) != shape:
        _fail(fn, f"out must be {list(shape)} ({how}), got {tuple(out.shape)}")
    if dtype is not None and out.dtype != dtype:
        raise TypeError(f"{fn}: out has dtype {out.dtype}, expected {dtype}")
    if not out.is_contiguous():
        _fail(fn, "out must be contiguous (it is written in place); pass a fresh torch.empty or None")


def _check_bias(fn: str, bias, like: Tensor, E: int, N: int) -> None:
    if bias is None:
        return
    _check_tensor(fn, "bias", bias, 2)
    if tuple(bias.shape) != (E, N):
        _fail(fn, f"bias must be [E, N] = [{E}, {N}] (one row per expert), got {tuple(bias.shape)}")
    _check_same_dtype(fn, "the operand", like, "bias", bias)


def thresholds() -> dict:
    """The regime thresholds in force, ``{"below_rows", "below_rows_big", "small_matrix_bytes"}``:
    this machine's measured ones (:func:`calibrate`, recorded in the wisdom file by ``python -m fmoe
    warmup --calibrate``), else the defaults :data:`PARALLEL_BELOW_ROWS`,
    :data:`PARALLEL_BELOW_ROWS_BIG`, :data:`PARALLEL_SMALL_MATRIX_BYTES`."""
    from ..engine import wisdom   # here, not at the top: fmoe.engine imports this module
    return wisdom.regime() or {"below_rows": PARALLEL_BELOW_ROWS, "below_rows_big": PARALLEL_BELOW_ROWS_BIG,
                               "small_matrix_bytes": PARALLEL_SMALL_MATRIX_BYTES}


def regime_for(offsets_list: list, matrix_bytes: int, regime: str = "auto") -> str:
    """'parallel' or 'serial': the threading the native kernels use for these expert bounds
    (a list, ``offsets.tolist()``) and per-expert matrices of ``matrix_bytes`` (w[e], or z[e]).
    'auto': side by side when more than one expert is busy, there is more than one intra-op
    thread, and the busy experts hold fewer rows each on average than :func:`thresholds` says
    for this matrix size. The choice is a speed, never a result beyond the module's bound."""
    if regime not in ("auto", "serial", "parallel"):
        raise ValueError(f"regime must be 'auto', 'serial' or 'parallel', got {regime!r} "
                         "(it picks the threading, never the result)")
    if regime != "auto":
        return regime
    E = len(offsets_list) - 1
    busy = sum(1 for e in range(E) if offsets_list[e + 1] > offsets_list[e])
    if busy < 2 or torch.get_num_threads() < 2:
        return "serial"
    t = thresholds()
    below = t["below_rows"] if matrix_bytes <= t["small_matrix_bytes"] else t["below_rows_big"]
    return "parallel" if offsets_list[E] < below * busy else "serial"


# calibrate()'s experiments: fp32 (experts, K = N), one expert matrix 1 MiB (in cache) and 4 MiB
_CALIBRATION_SHAPES = ((64, 512), (32, 1024))
_CALIBRATION_ROWS = (1, 2, 4, 8, 16, 32, 64)


def calibrate(*, shapes: Optional[tuple] = None, rows: Optional[tuple] = None, repeats: int = 5,
              log=None) -> tuple:
    """Measure this machine's regime thresholds: float32 :func:`gather_mm` with gathered rows, both
    regimes, median of ``repeats`` each, at ``rows`` rows per expert (ascending) for each
    ``(E, D)`` of ``shapes`` (E experts, K = N = D; two sizes, the first smaller; None: 64 experts
    of 512 x 512 and 32 of 1024 x 1024, rows 1 to 64).

    For each shape the threshold is the first row count where the parallel regime is no faster
    than the serial one (twice the largest when it always is; 1, never side by side, when it
    never is); the matrix-size boundary is the geometric mean of the two shapes' matrix bytes.
    Takes some seconds (the defaults) and wants an otherwise idle machine: other work on the
    cores stalls the serial regime's threaded GEMMs and skews the result towards side by side.
    Needs the extension active and 2+ intra-op threads.

    Returns:
        (thresholds, seconds): thresholds as :func:`thresholds` gives them; seconds
        ``{"E=64,D=512,r=4": [parallel_s, serial_s], ...}`` for each point measured.
    """
    shapes = _CALIBRATION_SHAPES if shapes is None else shapes
    rows = _CALIBRATION_ROWS if rows is None else rows
    if not AVAILABLE:
        raise RuntimeError(f"calibrate: the native CPU grouped GEMM is not active ({_WHY}); "
                           f"build it with `{_BUILD_CMD}`")
    if torch.get_num_threads() < 2:
        raise RuntimeError("calibrate: one intra-op thread (torch.get_num_threads() == 1): the regime is "
                           "always serial, nothing to measure; run with 2 or more threads")
    if len(shapes) != 2 or shapes[0][1] >= shapes[1][1] or not rows or list(rows) != sorted(rows):
        raise ValueError(f"calibrate: shapes must be two (E, D) with the first D smaller, and rows "
                         f"ascending, got shapes={shapes!r}, rows={rows!r}")
    g = torch.Generator().manual_seed(0)
    below, seconds = [], {}
    for E, D in shapes:
        w = torch.randn(E, D, D, generator=g)
        x = torch.randn(2 * max(rows), D, generator=g)
        found = 2 * max(rows)
        for r in rows:
            off = torch.arange(0, E * r + 1, r, dtype=torch.int64)
            idx = torch.randint(0, x.shape[0], (E * r,), generator=g)
            out = torch.empty(E * r, D)
            t = {"parallel": [], "serial": []}
            for _ in range(repeats + 1):       # the first round warms caches and MKL's buffers
                for regime in t:
                    t0 = time.perf_counter()
                    gather_mm(x, w, off, rows=idx, out=out, impl="native", regime=regime)
                    t[regime].append(time.perf_counter() - t0)
            par, ser = (sorted(v[1:])[repeats // 2] for v in t.values())
            seconds[f"E={E},D={D},r={r}"] = [par, ser]
            if log is not None:
                log(f"regime E={E} K=N={D} rows/expert={r}: parallel {par * 1e3:.3f} ms, serial {ser * 1e3:.3f} ms")
            if par >= ser:
                found = r
                break
        below.append(found)
    small, big = (D * D * 4 for _, D in shapes)   # float32 [D, D]
    return ({"below_rows": below[0], "below_rows_big": below[1],
             "small_matrix_bytes": int(round((small * big) ** 0.5))}, seconds)


def _use_native(fn: str, impl: str) -> bool:
    if impl == "reference":
        return False
    if impl == "native":
        if not AVAILABLE:
            raise RuntimeError(f"{fn}(impl='native'): the native CPU grouped GEMM is not active "
                               f"({_WHY}); build it with `{_BUILD_CMD}`")
        return True
    if impl == "auto":
        return AVAILABLE
    raise ValueError(f"{fn}: impl must be 'auto', 'native' or 'reference', got {impl!r}")


# --------------------------------------------------------------------------- references

def _op(w: Tensor, e: int, transposed: bool) -> Tensor:
    return w[e].t() if transposed else w[e]


def gather_mm_reference(x: Tensor, w: Tensor, offsets: Tensor, *, rows: Optional[Tensor] = None,
                        transposed: bool = False, out: Optional[Tensor] = None,
                        bias: Optional[Tensor] = None) -> Tensor:
    """Oracle of :func:`gather_mm`: per expert ``torch.mm(x.index_select(0, rows[lo:hi]), op(w[e]))`` (a fresh
    tensor, copied into y's rows) ``+ bias[e]``."""
    o = offsets.tolist()
    N = _inner_dims(w, transposed)[1]
    y = torch.empty(o[-1], N, dtype=x.dtype, device=x.device) if out is None else out
    x = x.contiguous()
    for e in range(w.shape[0]):
        lo, hi = o[e], o[e + 1]
        if hi > lo:
            xe = x[lo:hi] if rows is None else x.index_select(0, rows[lo:hi])
            y[lo:hi] = torch.mm(xe, _op(w, e, transposed))
            if bias is not None:
                y[lo:hi] += bias[e]
    return y


def mm_scatter_reference(a: Tensor, w: Tensor, offsets: Tensor, index: Tensor, out: Tensor, *,
                         scale: Optional[Tensor] = None, transposed: bool = False,
                         bias: Optional[Tensor] = None) -> Tensor:
    """Oracle of :func:`mm_scatter`: per expert in ascending id, ``y = torch.mm(a[lo:hi], op(w[e]))``
    (``+ bias[e]`` in a's dtype), then ``out.index_add_(0, index[lo:hi], y.to(out.dtype) *
    scale[lo:hi, None].to(out.dtype))``."""
    o = offsets.tolist()
    a = a.contiguous()
    s = None if scale is None else scale.to(out.dtype)
    for e in range(w.shape[0]):
        lo, hi = o[e], o[e + 1]
        if hi > lo:
            y = torch.mm(a[lo:hi], _op(w, e, transposed))
            if bias is not None:
                y += bias[e]
            y = y.to(out.dtype)
            out.index_add_(0, index[lo:hi], y if s is None else y * s[lo:hi, None])
    return out


def gather_wgrad_reference(a: Tensor, b: Tensor, offsets: Tensor, *, rows: Optional[Tensor] = None,
                           out: Optional[Tensor] = None, rows_b: Optional[Tensor] = None) -> Tensor:
    """Oracle of :func:`gather_wgrad`: per expert ``torch.mm(a_e.t(), b_e)``, zeros when empty (a_e, b_e:
    the expert's rows, gathered by rows / rows_b where given)."""
    o = offsets.tolist()
    E = len(o) - 1
    z = torch.empty(E, a.shape[1], b.shape[1], dtype=a.dtype, device=a.device) if out is None else out
    a, b = a.contiguous(), b.contiguous()
    for e in range(E):
        lo, hi = o[e], o[e + 1]
        if hi > lo:
            ae = a[lo:hi] if rows is None else a.index_select(0, rows[lo:hi])
            be = b[lo:hi] if rows_b is None else b.index_select(0, rows_b[lo:hi])
            z[e] = torch.mm(ae.t(), be)
        else:
            z[e].zero_()
    return z


# --------------------------------------------------------------------------- public functions

def gather_mm(x: Tensor, w: Tensor, offsets: Tensor, *, rows: Optional[Tensor] = None,
              transposed: bool = False, out: Optional[Tensor] = None, impl: str = "auto",
              regime: str = "auto", bias: Optional[Tensor] = None) -> Tensor:
    """``y[r] = x[rows[r]] @ op(w[e])`` for every row r of every expert e, in one call.

    Args:
        x: float [T, K] (rows given) or [R, K] in expert order (rows=None).
        w: [E, K, N], or [E, N, K] with ``transposed``; x's dtype.
        offsets: int64 [E + 1] on the CPU; ``offsets[-1] = R``.
        rows: int64 [R] token index into x, or None.
        out: optional contiguous [R, N] of x's dtype to write into.
        impl: 'auto' | 'native' | 'reference'.  regime: 'auto' | 'serial' | 'parallel'.
        bias: optional [E, N] of x's dtype, added to each expert's rows after its product.
    Returns:
        y [R, N] in x's dtype (``out`` when given).
    """
    fn = "gather_mm"
    K, N = _check_operands(fn, "x", x, w, transposed)
    if rows is not None:
        _check_tensor(fn, "rows", rows, 1, dtypes=(torch.int64,))
    o = _check_offsets(fn, offsets, w.shape[0], x.shape[0] if rows is None else rows.shape[0])
    R = o[-1]
    if rows is not None:
        _check_index(fn, "rows", rows, R, x.shape[0], "x")
    if out is not None:
        _check_out(fn, out, (R, N), x.dtype, "R = offsets[-1], N of op(w[e])")
    _check_bias(fn, bias, x, w.shape[0], N)
    parallel = regime_for(o, K * N * x.element_size(), regime) == "parallel"
    if not _use_native(fn, impl):
        return gather_mm_reference(x, w, offsets, rows=rows, transposed=transposed, out=out, bias=bias)
    y = torch.empty(R, N, dtype=x.dtype) if out is None else out
    if R:
        _EXT.gather_mm(x.contiguous(), w, offsets.contiguous(),
                       None if rows is None else rows.contiguous(), transposed, y, parallel,
                       None if bias is None else bias.contiguous())
    return y


def planned_mm(x: Tensor, w: Tensor, offsets: Tensor, bounds: tuple, *, rows: Optional[Tensor],
               transposed: bool, bias: Optional[Tensor], regime: str = "auto") -> Tensor:
    """:func:`gather_mm` (impl 'native') for a plan fmoe built, whose ``bounds`` (offsets as host
    ints) it already holds. The extension checks offsets, rows, shapes and the bias itself before
    it reads a row; what is skipped is the Python pass over them for friendlier messages (a host
    list of the offsets, a loop over E, two host reads of the index range): about 10 us a call,
    which a decode step pays per projection."""
    K, N = _inner_dims(w, transposed)
    R = bounds[-1]
    y = torch.empty(R, N, dtype=x.dtype)
    if R:
        _EXT.gather_mm(x.contiguous(), w, offsets, None if rows is None else rows.contiguous(), transposed, y,
                       regime_for(bounds, K * N * x.element_size(), regime) == "parallel",
                       None if bias is None else bias.contiguous())
    return y


def planned_scatter(a: Tensor, w: Tensor, offsets: Tensor, bounds: tuple, index: Tensor, out: Tensor, *,
                    scale: Optional[Tensor], transposed: bool, bias: Optional[Tensor], regime: str = "auto"
                    ) -> Tensor:
    """:func:`mm_scatter` (impl 'native') for a plan fmoe built: the extension's own checks only,
    as :func:`planned_mm`."""
    K, N = _inner_dims(w, transposed)
    if bounds[-1]:
        _EXT.mm_scatter(a.contiguous(), w, offsets, index.contiguous(), out,
                        None if scale is None else scale.contiguous(), transposed,
                        regime_for(bounds, K * N * a.element_size(), regime) == "parallel",
                        None if bias is None else bias.contiguous())
    return out


def mm_scatter(a: Tensor, w: Tensor, offsets: Tensor, index: Tensor, out: Tensor, *,
               scale: Optional[Tensor] = None, transposed: bool = False, impl: str = "auto",
               regime: str = "auto", bias: Optional[Tensor] = None) -> Tensor:
    """``out[index[r]] += scale[r] * (a[r] @ op(w[e]) + bias[e])`` for every row r of every expert e.

    Args:
        a: float [R, K] in expert order.  w: [E, K, N] (or [E, N, K] with ``transposed``), a's dtype.
        offsets: int64 [E + 1] on the CPU; ``offsets[-1] = R``.
        index: int64 [R] into out's rows; distinct within an expert, repeated across experts.
        out: contiguous float [T, N], any of the four dtypes, updated in place.
        scale: optional float [R] (None = 1).
        bias: optional [E, N] of a's dtype, added to the product in a's dtype before the scale.
    Returns:
        out. Rounding (see the module docstring): product (and bias) in a's dtype, then out's dtype for the
        scale multiply and the add; a token's terms added in ascending expert id.
    """
    fn = "mm_scatter"
    K, N = _check_operands(fn, "a", a, w, transposed)
    o = _check_offsets(fn, offsets, w.shape[0], a.shape[0])
    R = o[-1]
    _check_tensor(fn, "out", out, 2)
    if out.shape[1] != N:
        _fail(fn, f"out must be [T, N] with N = {N} (op(w[e]) is [{K}, {N}]), got {tuple(out.shape)}")
    _check_out(fn, out, tuple(out.shape), None, "T tokens, N")
    _check_index(fn, "index", index, R, out.shape[0], "out")
    if scale is not None:
        _check_tensor(fn, "scale", scale, 1)
        if scale.shape[0] != R:
            _fail(fn, f"scale must be [R] = [{R}] (one weight per row), got {tuple(scale.shape)}")
    _check_bias(fn, bias, a, w.shape[0], N)
    parallel = regime_for(o, K * N * a.element_size(), regime) == "parallel"
    if not _use_native(fn, impl):
        return mm_scatter_reference(a, w, offsets, index, out, scale=scale, transposed=transposed, bias=bias)
    if R:
        _EXT.mm_scatter(a.contiguous(), w, offsets.contiguous(), index.contiguous(), out,
                        None if scale is None else scale.contiguous(), transposed, parallel,
                        None if bias is None else bias.contiguous())
    return out


def gather_wgrad(a: Tensor, b: Tensor, offsets: Tensor, *, rows: Optional[Tensor] = None,
                 out: Optional[Tensor] = None, impl: str = "auto", regime: str = "auto",
                 rows_b: Optional[Tensor] = None) -> Tensor:
    """``z[e] = sum over e's rows r of a[rows[r]]^T b[rows_b[r]]`` (the weight gradient), in one call.

    Args:
        a: float [T, P] (rows given) or [R, P] in expert order (rows=None).
        b: [T', Q] (rows_b given) or [R, Q] in expert order (rows_b=None), a's dtype.
        offsets: int64 [E + 1] on the CPU; ``offsets[-1] = R``.
        rows: int64 [R] index into a, or None.  rows_b: int64 [R] index into b, or None.
        out: optional contiguous [E, P, Q] of a's dtype, overwritten.
    Returns:
        z [E, P, Q] in a's dtype; an expert with no rows gets zeros.
    """
    fn = "gather_wgrad"
    _check_tensor(fn, "a", a, 2)
    _check_tensor(fn, "b", b, 2)
    _check_same_dtype(fn, "a", a, "b", b)
    if rows_b is not None:
        _check_tensor(fn, "rows_b", rows_b, 1, dtypes=(torch.int64,))
    o = _check_offsets(fn, offsets, None, b.shape[0] if rows_b is None else rows_b.shape[0])
    E, R = len(o) - 1, o[-1]
    if rows_b is not None:
        _check_index(fn, "rows_b", rows_b, R, b.shape[0], "b")
    if rows is None:
        if a.shape[0] != R:
            _fail(fn, f"a is {tuple(a.shape)} but must have R = {R} rows when rows is None "
                      f"(or pass rows [R] to gather a's rows)")
    else:
        _check_index(fn, "rows", rows, R, a.shape[0], "a")
    P, Q = a.shape[1], b.shape[1]
    if out is not None:
        _check_out(fn, out, (E, P, Q), a.dtype, "E experts, P = a.shape[1], Q = b.shape[1]")
    parallel = regime_for(o, P * Q * a.element_size(), regime) == "parallel"
    if not _use_native(fn, impl):
        return gather_wgrad_reference(a, b, offsets, rows=rows, out=out, rows_b=rows_b)
    z = torch.empty(E, P, Q, dtype=a.dtype) if out is None else out
    if E:
        _EXT.gather_wgrad(a.contiguous(), b.contiguous(), offsets.contiguous(),
                          None if rows is None else rows.contiguous(), z, parallel,
                          None if rows_b is None else rows_b.contiguous())
    return z


AVAILABLE = False
_try_load()


def build_step(tag: str, without: str, make: Callable[[], object], report: Callable[[], str]) -> int:
    """One extension's step of ``python -m fmoe build``: ``make()`` where a C++ compiler is on
    PATH, then ``report()`` printed. 0 when built, or with no compiler (``without`` says what runs
    instead); 1 when a present compiler fails (the error on stderr)."""
    if not _compiler():
        print(f"[{tag}] no C++ compiler (c++/g++) on PATH: not building; {without}")
        return 0
    try:
        make()
    except Exception as e:
        print(f"[{tag}] build failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(report())
    return 0


def build_command() -> int:
    """``python -m fmoe build``'s grouped-GEMM step (:func:`build_step`)."""
    return build_step("fmoe.native", "fmoe uses the pure-torch grouped GEMM", lambda: build(verbose=True), status)
