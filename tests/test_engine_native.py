"""The native CPU grouped GEMM (fmoe.ops.native) against its pure-torch references.

Where a C++ compiler is present the extension must build and be active (no silent skip).

Serial regime: bit for bit equal to the reference in every dtype (same at::mm calls on
the same operands with the same intra-op threads, same roundings in the scatter): this holds by
construction, so on any host and at any thread count.

Parallel-over-experts regime: each at::mm runs single-threaded, and MKL's single-threaded
small GEMM/GEMV splits the K-term reduction differently from its multi-threaded one
(measured on the 2-core Xeon: float32 x @ W with 1 row per expert, float64 with 1-2 rows,
differ in the last bits); float32 experts with 1-8 rows run fmoe's own loops instead of BLAS
(another order of the same sum). There the tests allow the forward-error bound of a K-term dot
product, ``K * eps_acc * (|x| @ |op(w)|)`` (eps_acc: float32's for bfloat16/float16, which
accumulate in float32), plus a few roundings of the result's own dtype. That bound is itself
tested to fail a wrong row, a wrong expert or one dropped K term. Other CPUs (an AMD EPYC's MKL
paths) differ elsewhere, so no test asserts bit-exactness of the parallel regime, or of the
'auto' one, which may pick it; both regimes run at 1 and 2 threads here.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch

from fmoe.engine import wisdom
from fmoe.ops import native

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_COMPILER = native._compiler() is not None


@pytest.fixture(scope="module", autouse=True)
def built():
    if HAS_COMPILER:
        native.build(verbose=False)  # a no-op when already built for this key
    yield


def test_active_when_a_compiler_is_present():
    if HAS_COMPILER:
        assert native.AVAILABLE, native.status()
        assert native.status().startswith("native CPU grouped GEMM: active (")
        assert os.path.exists(native.library_path())
    else:
        assert not native.AVAILABLE
        assert "no C++ compiler" in native.status()


def test_status_command_prints_active():
    r = subprocess.run([sys.executable, "-m", "fmoe", "info"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert ("active" if HAS_COMPILER else "no C++ compiler") in r.stdout


def test_build_command_without_a_compiler_exits_0():
    r = subprocess.run([sys.executable, "-m", "fmoe", "build"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PATH": ""})
    assert r.returncode == 0, r.stderr
    assert "no C++ compiler" in r.stdout


def test_missing_or_broken_library_is_inactive_not_an_error(monkeypatch, tmp_path):
    missing = str(tmp_path / "none" / "x.so")
    broken = tmp_path / "broken.so"
    broken.write_bytes(b"not an ELF file")
    try:
        monkeypatch.setattr(native, "library_path", lambda: missing)
        native._try_load()
        assert not native.AVAILABLE
        assert ("not built: run `python -m fmoe build`" if HAS_COMPILER
                else "no C++ compiler") in native.status()
        with pytest.raises(RuntimeError, match=r"python -m fmoe build"):
            native.gather_mm(torch.ones(1, 2), torch.ones(1, 2, 3), torch.tensor([0, 1]), impl="native")
        # 'auto' falls back to the reference
        y = native.gather_mm(torch.ones(1, 2), torch.ones(1, 2, 3), torch.tensor([0, 1]))
        assert torch.equal(y, torch.full((1, 3), 2.0))
        monkeypatch.setattr(native, "library_path", lambda: str(broken))
        native._try_load()
        assert not native.AVAILABLE and "failed" in native.status()
    finally:
        monkeypatch.undo()
        native._try_load()
    assert native.AVAILABLE == HAS_COMPILER


# --------------------------------------------------------------------------- cases

def _bounds(counts):
    off = torch.zeros(len(counts) + 1, dtype=torch.int64)
    off[1:] = torch.tensor(counts, dtype=torch.int64).cumsum(0)
    return off


def _rows(counts, T, g):
    """Token of each row: distinct tokens within an expert (a token meets an expert once)."""
    parts = [torch.randperm(T, generator=g)[:n] for n in counts]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def _counts(name, g):
    if name == "decode":       # 64 experts, 1-4 rows each: the parallel regime under 'auto'
        return torch.randint(1, 5, (64,), generator=g).tolist(), 64
    if name == "train":        # thousands of rows over 8 experts: the serial regime
        return torch.randint(300, 500, (8,), generator=g).tolist(), 600
    return {"empty_experts": ([0, 5, 0, 0, 7, 0], 16), "one_expert": ([0, 0, 40, 0, 0], 40),
            "E1": ([33], 50), "R0": ([0, 0, 0, 0], 8)}[name]


_DIMS = {"decode": (128, 96), "train": (64, 48)}  # others: odd K, N (misaligned row starts)
SHAPES = ["decode", "train", "empty_experts", "one_expert", "E1", "R0"]
DTYPES = [torch.float32, torch.float64, torch.bfloat16]
# (shape, regime, dtype): with one busy expert or none the parallel regime runs as the serial
# one, so it is not repeated; the degenerate shapes test structure, float32 is enough there.
CASES = [(s, r, d) for s in SHAPES for r in ("serial", "parallel") for d in DTYPES
         if (r == "serial" or s in SHAPES[:3]) and (d == torch.float32 or s in SHAPES[:3])]
CASE_IDS = [f"{s}-{r}-{str(d)[6:]}" for s, r, d in CASES]


def _make(shape, dtype, transposed, seed=0):
    g = torch.Generator().manual_seed(seed)
    counts, T = _counts(shape, g)
    K, N = _DIMS.get(shape, (37, 29))
    E = len(counts)
    w = torch.randn(E, N, K, generator=g) if transposed else torch.randn(E, K, N, generator=g)
    x = torch.randn(T, K, generator=g)
    return dict(x=x.to(dtype), w=w.to(dtype), off=_bounds(counts), rows=_rows(counts, T, g),
                T=T, K=K, N=N, E=E, g=g)


def _eps(dtype):
    return torch.finfo(dtype).eps


def _acc_eps(dtype):
    # bfloat16/float16 GEMMs accumulate in float32
    return _eps(torch.float32) if dtype in (torch.bfloat16, torch.float16) else _eps(dtype)


def _within(got, want, bound, terms, dtype, rounding_steps=2):
    """(ok, worst): whether |got - want| <= (terms * acc_eps + steps * eps) * bound + tiny
    everywhere (bound: the reference on |inputs|, float64), and the largest |got - want| / tol."""
    tol = (terms * _acc_eps(dtype) + rounding_steps * _eps(dtype)) * bound + torch.finfo(dtype).tiny
    err = (got.double() - want.double()).abs()
    return bool((err <= tol).all()), float((err / tol).max()) if err.numel() else 0.0


def _check(got, want, bound, terms, dtype, exact, rounding_steps=2):
    """exact: bit for bit; else _within. bound: a callable giving the reference on |inputs| in
    float64 (built only when needed)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if exact:
        assert torch.equal(got, want), (got.double() - want.double()).abs().max()
        return
    ok, worst = _within(got, want, bound(), terms, dtype, rounding_steps)
    assert ok, f"|got - want| reaches {worst:.3g} x the bound"


@contextlib.contextmanager
def _threads(n):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _abs(t):
    return t.double().abs()


# --------------------------------------------------------------------------- gather_mm

@pytest.mark.parametrize("gathered", [True, False], ids=["rows", "rows=None"])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("shape,regime,dtype", CASES, ids=CASE_IDS)
def test_gather_mm_matches_reference(shape, regime, dtype, transposed, gathered):
    c = _make(shape, dtype, transposed)
    x, rows = (c["x"], c["rows"]) if gathered else (c["x"][c["rows"]], None)
    got = native.gather_mm(x, c["w"], c["off"], rows=rows, transposed=transposed,
                           impl="native" if HAS_COMPILER else "auto", regime=regime)
    want = native.gather_mm_reference(x, c["w"], c["off"], rows=rows, transposed=transposed)
    bound = lambda: native.gather_mm_reference(_abs(x), _abs(c["w"]), c["off"], rows=rows, transposed=transposed)
    exact = regime == "serial" or not HAS_COMPILER
    _check(got, want, bound, c["K"], dtype, exact)
    assert got.shape == (c["rows"].numel(), c["N"])


@pytest.mark.parametrize("storage_swapped", [False, True])
@pytest.mark.parametrize("transposed", [False, True])
def test_gather_mm_weight_views_are_taken_as_they_are(transposed, storage_swapped):
    """Each expert's matrix contiguous or a transposed contiguous one: same results."""
    c = _make("train", torch.float32, transposed)
    w = c["w"].transpose(1, 2).contiguous().transpose(1, 2) if storage_swapped else c["w"]
    got = native.gather_mm(c["x"], w, c["off"], rows=c["rows"], transposed=transposed, regime="serial")
    want = native.gather_mm_reference(c["x"], w, c["off"], rows=c["rows"], transposed=transposed)
    assert torch.equal(got, want)


@pytest.mark.parametrize("regime", ["serial", "parallel"])
def test_gather_mm_out_is_written_and_returned(regime):
    # bit for bit in the serial regime; the parallel one (which 'auto' picks here at 2+ threads)
    # within the K-term bound
    c = _make("empty_experts", torch.float32, False)
    out = torch.full((c["rows"].numel(), c["N"]), float("nan"))
    y = native.gather_mm(c["x"], c["w"], c["off"], rows=c["rows"], out=out, regime=regime)
    assert y is out
    _check(y, native.gather_mm_reference(c["x"], c["w"], c["off"], rows=c["rows"]),
           lambda: native.gather_mm_reference(_abs(c["x"]), _abs(c["w"]), c["off"], rows=c["rows"]),
           c["K"], torch.float32, exact=regime == "serial" or not HAS_COMPILER)


@pytest.mark.parametrize("threads", [1, 2])
def test_auto_regime_parallel_for_decode_serial_for_training(threads):
    # the default thresholds (tests never see this machine's wisdom file: tests/conftest.py)
    with _threads(threads):
        for shape, expect in (("decode", "parallel"), ("train", "serial")):
            c = _make(shape, torch.float32, False)
            mat = c["K"] * c["N"] * 4
            picked = native.regime_for(c["off"].tolist(), mat)
            assert picked == (expect if threads > 1 else "serial")
            got = native.gather_mm(c["x"], c["w"], c["off"], rows=c["rows"])
            forced = native.gather_mm(c["x"], c["w"], c["off"], rows=c["rows"], regime=picked)
            assert torch.equal(got, forced)   # the same call
        # a big matrix runs side by side only below PARALLEL_BELOW_ROWS_BIG rows per expert
        big = native.PARALLEL_SMALL_MATRIX_BYTES + 1
        assert native.regime_for([0, 8, 16], big) == "serial"
        assert native.regime_for([0, 2, 4], big) == ("parallel" if threads > 1 else "serial")
        assert native.regime_for([0, 2, 4], big, "serial") == "serial"
        assert native.regime_for([0, 0, 4], 16) == "serial"   # one busy expert: nothing to spread


def test_recorded_calibration_changes_the_regime():
    """thresholds() and regime_for follow the wisdom file's measured thresholds (the path is this
    test's own, tests/conftest.py); never measured, or damaged: the defaults."""
    defaults = {"below_rows": native.PARALLEL_BELOW_ROWS, "below_rows_big": native.PARALLEL_BELOW_ROWS_BIG,
                "small_matrix_bytes": native.PARALLEL_SMALL_MATRIX_BYTES}
    decode, train = [0, 2, 5, 6, 9], [0, 300, 700]
    with _threads(2):
        assert native.thresholds() == defaults and wisdom.regime() is None
        assert (native.regime_for(decode, 4096), native.regime_for(train, 4096)) == ("parallel", "serial")
        wisdom.record_regime({"below_rows": 1, "below_rows_big": 1, "small_matrix_bytes": 4096}, {})
        assert native.thresholds() == {"below_rows": 1, "below_rows_big": 1, "small_matrix_bytes": 4096}
        assert native.regime_for(decode, 4096) == "serial"     # this machine: side by side never pays
        wisdom.record_regime({"below_rows": 1000, "below_rows_big": 3, "small_matrix_bytes": 4096},
                             {"E=64,D=512,r=1": [1e-3, 2e-3]})
        assert native.regime_for(train, 4096) == "parallel"    # ... pays up to 1000 rows an expert
        assert native.regime_for(train, 4097) == "serial"      # a bigger matrix: below_rows_big
        assert native.regime_for([0, 2, 4], 4097) == "parallel"
        assert json.load(open(wisdom.path()))[wisdom.REGIME_KEY]["seconds"] == {"E=64,D=512,r=1": [1e-3, 2e-3]}
        with open(wisdom.path(), "w") as f:
            json.dump({wisdom.REGIME_KEY: {"below_rows": "32", "below_rows_big": 4}}, f)
        os.utime(wisdom.path(), ns=(1, 1))   # a new mtime for the reader's cache
        assert wisdom.regime() is None and native.thresholds() == defaults
        wisdom.forget()
        assert native.thresholds() == defaults


def test_record_regime_names_a_bad_field():
    with pytest.raises(ValueError, match=r"thresholds\['below_rows_big'\] must be an int >= 0, got -1"):
        wisdom.record_regime({"below_rows": 8, "below_rows_big": -1, "small_matrix_bytes": 1}, {})
    with pytest.raises(ValueError, match=r"thresholds\['small_matrix_bytes'\] must be an int >= 0, got None"):
        wisdom.record_regime({"below_rows": 8, "below_rows_big": 1}, {})
    assert not os.path.exists(wisdom.path())


@pytest.mark.skipif(not HAS_COMPILER, reason="calibrate times the native kernel; no C++ compiler here")
def test_warmup_calibrate_records_the_thresholds(monkeypatch, capsys):
    """`python -m fmoe warmup --calibrate` (in process, on tiny experiments) writes what calibrate
    found into the wisdom file, and regime_for follows it; at one thread it records nothing, exit 1."""
    from fmoe.__main__ import main
    monkeypatch.setattr(native, "_CALIBRATION_SHAPES", ((4, 8), (4, 16)))
    monkeypatch.setattr(native, "_CALIBRATION_ROWS", (1, 2))
    with _threads(1):
        assert main(["warmup", "--calibrate"]) == 1
    assert "not calibrated: calibrate: one intra-op thread" in capsys.readouterr().err
    assert wisdom.regime() is None
    with _threads(2):
        assert main(["warmup", "--calibrate"]) == 0
        got = wisdom.regime()
        assert got is not None and native.thresholds() == got and got["small_matrix_bytes"] == 512
        assert got["below_rows"] in (1, 2, 4) and got["below_rows_big"] in (1, 2, 4)
        assert f"regime thresholds {got} recorded in {wisdom.path()}" in capsys.readouterr().out
        busy2 = [0, 1, 2]                       # two experts, one row each, 256-byte matrices
        assert native.regime_for(busy2, 256) == ("parallel" if got["below_rows"] > 1 else "serial")


@pytest.mark.skipif(not HAS_COMPILER, reason="calibrate times the native kernel; no C++ compiler here")
def test_calibrate_measures_thresholds_on_this_machine():
    # tiny shapes: the structure and the rule, not the speed (benchmarks/ measure that)
    shapes, rows = ((4, 8), (4, 16)), (1, 2, 4)
    with _threads(2):
        found, seconds = native.calibrate(shapes=shapes, rows=rows, repeats=1)
    assert set(found) == {"below_rows", "below_rows_big", "small_matrix_bytes"}
    assert found["small_matrix_bytes"] == 512                      # sqrt(8*8*4 * 16*16*4)
    for (E, D), below in zip(shapes, (found["below_rows"], found["below_rows_big"])):
        measured = [r for r in rows if f"E={E},D={D},r={r}" in seconds]
        assert measured == list(rows[:len(measured)]) and measured
        par, ser = seconds[f"E={E},D={D},r={measured[-1]}"]
        # the first row count where side by side was no faster, else twice the largest tried
        assert below == (measured[-1] if par >= ser else 2 * rows[-1])
        assert all(p < s for p, s in (seconds[f"E={E},D={D},r={r}"] for r in measured[:-1]))
    with _threads(1), pytest.raises(RuntimeError, match=r"one intra-op thread"):
        native.calibrate(shapes=shapes, rows=rows, repeats=1)
    with _threads(2), pytest.raises(ValueError, match=r"shapes must be two \(E, D\) with the first D smaller"):
        native.calibrate(shapes=shapes[::-1], rows=rows, repeats=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_both_regimes_at_1_and_2_threads(threads, dtype):
    """gather_mm, mm_scatter and gather_wgrad forced into each regime at 1 and 2 intra-op threads,
    against the reference at the same thread count: the serial regime bit for bit (same calls,
    same threads), the parallel one within the K-term bound (its GEMMs are single-threaded, and a
    BLAS may split their sums otherwise: MKL on an AMD EPYC does, and the Xeon for float64 decode).
    'auto' equals the regime regime_for names, bit for bit (the same call)."""
    impl = "native" if HAS_COMPILER else "auto"
    with _threads(threads):
        for transposed in (False, True):
            c = _make("decode", dtype, transposed, seed=3)
            R, K, N, T = c["rows"].numel(), c["K"], c["N"], c["T"]
            a = torch.randn(R, K, generator=c["g"]).to(dtype)
            scale = torch.rand(R, generator=c["g"])
            b = torch.randn(R, N, generator=c["g"]).to(dtype)
            want_mm = native.gather_mm_reference(c["x"], c["w"], c["off"], rows=c["rows"], transposed=transposed)
            want_sc = native.mm_scatter_reference(a, c["w"], c["off"], c["rows"], torch.zeros(T, N, dtype=dtype),
                                                  scale=scale, transposed=transposed)
            want_wg = native.gather_wgrad_reference(c["x"], b, c["off"], rows=c["rows"])
            bound_mm = lambda: native.gather_mm_reference(_abs(c["x"]), _abs(c["w"]), c["off"],  # noqa: E731
                                                          rows=c["rows"], transposed=transposed)
            bound_sc = lambda: _scatter_bound(a, c["w"], c["off"], c["rows"],  # noqa: E731
                                              torch.zeros(T, N, dtype=dtype), scale, transposed)
            bound_wg = lambda: native.gather_wgrad_reference(_abs(c["x"]), _abs(b), c["off"],  # noqa: E731
                                                             rows=c["rows"])
            most = int(c["off"].diff().max())
            reach = int(torch.bincount(c["rows"]).max())   # experts adding into one token
            got = {}
            for regime in ("serial", "parallel", "auto"):
                got[regime] = (
                    native.gather_mm(c["x"], c["w"], c["off"], rows=c["rows"], transposed=transposed,
                                     impl=impl, regime=regime),
                    native.mm_scatter(a, c["w"], c["off"], c["rows"], torch.zeros(T, N, dtype=dtype), scale=scale,
                                      transposed=transposed, impl=impl, regime=regime),
                    native.gather_wgrad(c["x"], b, c["off"], rows=c["rows"], impl=impl, regime=regime))
                if regime == "auto":
                    break
                exact = regime == "serial" or not HAS_COMPILER
                _check(got[regime][0], want_mm, bound_mm, K, dtype, exact)
                _check(got[regime][1], want_sc, bound_sc, K, dtype, exact, rounding_steps=4 + reach)
                _check(got[regime][2], want_wg, bound_wg, most, dtype, exact)
            picked = native.regime_for(c["off"].tolist(), K * N * c["x"].element_size())
            assert picked == ("parallel" if threads > 1 else "serial")   # the defaults at 1-4 rows an expert
            for g_auto, g_forced in zip(got["auto"], got[picked]):
                assert torch.equal(g_auto, g_forced)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_bound_catches_a_wrong_row_an_expert_or_a_dropped_term(dtype):
    """The K-term bound the parallel regime is held to passes the parallel result and fails: one
    row's product taken from another token, one expert's rows multiplied by the next expert's
    weight, one K term left out of one output element (float32/64), and in gather_wgrad one
    expert given its neighbour's gradient."""
    c = _make("decode", dtype, False, seed=5)
    x, w, off, rows, K = c["x"], c["w"], c["off"], c["rows"], c["K"]
    want = native.gather_mm_reference(x, w, off, rows=rows)
    bound = native.gather_mm_reference(_abs(x), _abs(w), off, rows=rows)
    par = native.gather_mm(x, w, off, rows=rows, regime="parallel")
    assert _within(par, want, bound, K, dtype)[0]
    wrong_row = want.clone()
    wrong_row[0] = (x[(rows[0] + 1) % c["T"]].double() @ w[0].double()).to(dtype)   # row 0 is expert 0's
    assert not _within(wrong_row, want, bound, K, dtype)[0]
    wrong_expert = want.clone()
    lo, hi = int(off[5]), int(off[6])
    wrong_expert[lo:hi] = x[rows[lo:hi]] @ w[6]
    assert not _within(wrong_expert, want, bound, K, dtype)[0]
    if dtype != torch.bfloat16:   # bfloat16's own rounding of the output is larger than one term
        r, n = 0, 0
        k = int((x[rows[r]].double() * w[0, :, n].double()).abs().argmax())   # the largest term
        dropped = want.clone()
        dropped[r, n] = want[r, n] - x[rows[r], k] * w[0, k, n]
        assert not _within(dropped, want, bound, K, dtype)[0]
    b = torch.randn(rows.numel(), c["N"], generator=c["g"]).to(dtype)
    z = native.gather_wgrad_reference(x, b, off, rows=rows)
    zb = native.gather_wgrad_reference(_abs(x), _abs(b), off, rows=rows)
    most = int(off.diff().max())
    assert _within(native.gather_wgrad(x, b, off, rows=rows, regime="parallel"), z, zb, most, dtype)[0]
    swapped = z.clone()
    swapped[[2, 3]] = z[[3, 2]]
    assert not _within(swapped, z, zb, most, dtype)[0]


@pytest.mark.skipif(not HAS_COMPILER, reason="the extension needs a C++ compiler")
@pytest.mark.parametrize("transposed", [False, True])
def test_few_rows_loops_every_isa_path(transposed):
    """The parallel regime's float32 products of 1-8 rows an expert (fmoe's own loops): within
    the K-term bound of a float64 product on every ISA path this CPU runs, the AVX2 and AVX-512
    paths bit for bit equal (one fixed order of operations per output element, by construction),
    a row's result independent of the rows beside it, tails of K and N below a vector; a path the
    CPU lacks and a row count outside 1-8 raise."""
    ext = native._EXT
    paths = [isa for isa in (2, 3) if ext.few_rows_isa(isa)]
    if not paths:
        pytest.skip("no AVX2 + FMA on this CPU: BLAS runs these products")
    g = torch.Generator().manual_seed(11)
    for n, K, N in _FEW_SHAPES:
        a = torch.randn(n, K, generator=g)
        w = torch.randn(N, K, generator=g) if transposed else torch.randn(K, N, generator=g)
        op = w.t() if transposed else w
        want = a.double() @ op.double()
        bound = K * torch.finfo(torch.float32).eps * (a.abs().double() @ op.abs().double())
        got = [ext.few_rows(a, w, transposed, isa) for isa in paths]
        for r in got:
            assert ((r.double() - want).abs() <= bound).all(), (n, K, N)
        assert all(torch.equal(r, got[0]) for r in got)
        for i in range(n):
            assert torch.equal(ext.few_rows(a[i:i + 1].contiguous(), w, transposed, paths[-1]), got[0][i:i + 1])
    assert ext.few_rows_isa(1) == 0
    if not ext.few_rows_isa(3):
        with pytest.raises(ValueError, match="does not run on this CPU"):
            ext.few_rows(a, w, transposed, 3)
    for bad in (0, 9):
        with pytest.raises(ValueError, match="takes 1 to 8 rows"):
            ext.few_rows(torch.randn(bad, 4), torch.randn(4, 4), transposed, paths[0])


_FEW_SHAPES = [(1, 2048, 48), (2, 37, 29), (3, 16, 8), (5, 130, 70), (8, 1, 1), (8, 512, 33), (4, 8, 17), (6, 96, 5)]


@pytest.mark.skipif(not HAS_COMPILER, reason="the extension needs a C++ compiler")
@pytest.mark.parametrize("transposed", [False, True])
def test_few_rows_loops_for_bf16_rows_and_weights(transposed):
    """bf16 rows and weights of 1-8 rows an expert: on the AVX2 and AVX-512 paths the float32
    loops on the operands' exact float32 values, each output rounded once to bf16, so bit for bit
    the float32 loops' result rounded (by construction); with AVX-512 BF16 (path 4) x @ W^T by
    vdpbf16ps: another order of the same exact products, within the K-term bound plus the
    output's rounding, a row independent of the rows beside it, and a denormal weight counted as
    zero (as vdpbf16ps does; the FMA loops keep it); x @ W on path 4 is path 3's."""
    ext = native._EXT
    paths = [isa for isa in (2, 3) if ext.few_rows_isa(isa)]
    if not paths:
        pytest.skip("no AVX2 + FMA on this CPU: at::mm runs these products")
    dp = ext.few_rows_isa(4) == 4
    g = torch.Generator().manual_seed(12)
    for n, K, N in _FEW_SHAPES:
        a = torch.randn(n, K, generator=g).bfloat16()
        w = (torch.randn(N, K, generator=g) if transposed else torch.randn(K, N, generator=g)).bfloat16()
        op = w.t() if transposed else w
        f32 = ext.few_rows(a.float(), w.float(), transposed, paths[0])
        for isa in paths:
            got = ext.few_rows(a, w, transposed, isa)
            assert got.dtype == torch.bfloat16 and torch.equal(got, f32.bfloat16()), (isa, n, K, N)
        if dp:
            got = ext.few_rows(a, w, transposed, 4)
            if not transposed:
                assert torch.equal(got, f32.bfloat16())
                continue
            want = a.double() @ op.double()
            bound = (K * torch.finfo(torch.float32).eps * (a.abs().double() @ op.abs().double())
                     + want.abs() * 2.0 ** -8)   # the sum's order, then one bf16 rounding
            assert ((got.double() - want).abs() <= bound).all(), (n, K, N)
            for i in range(n):
                assert torch.equal(ext.few_rows(a[i:i + 1].contiguous(), w, transposed, 4), got[i:i + 1])
    if not dp:
        with pytest.raises(ValueError, match="does not run on this CPU"):
            ext.few_rows(a, w, transposed, 4)
    elif transposed:   # vdpbf16ps counts a denormal weight as zero (documented); the FMA loops keep it
        one, tiny = torch.ones(1, 64).bfloat16(), torch.zeros(2, 64).bfloat16()
        tiny[0] = 2.0 ** -130
        assert ext.few_rows(one, tiny, True, 4)[0, 0].item() == 0.0
        assert ext.few_rows(one, tiny, True, 3)[0, 0].item() == 2.0 ** -124
    with pytest.raises(ValueError, match="of one dtype"):
        ext.few_rows(a, w.float(), transposed, paths[0])


def test_native_ignores_autograd_state():
    """The kernels write into out= buffers from worker threads: requires_grad must not matter."""
    c = _make("decode", torch.float32, False)
    w = c["w"].clone().requires_grad_()
    for regime in ("serial", "parallel"):
        y = native.gather_mm(c["x"], w, c["off"], rows=c["rows"], regime=regime)
        assert not y.requires_grad
        with torch.inference_mode():  # inference tensors written from worker threads
            yi = native.gather_mm(c["x"], w, c["off"], rows=c["rows"], regime=regime)
            native.mm_scatter(yi, w.transpose(1, 2), c["off"], c["rows"], torch.zeros(c["T"], c["K"]),
                              regime=regime)
            native.gather_wgrad(c["x"], yi, c["off"], rows=c["rows"], regime=regime)
        assert torch.equal(yi, y)
        _check(y, native.gather_mm_reference(c["x"], w.detach(), c["off"], rows=c["rows"]),
               lambda: native.gather_mm_reference(_abs(c["x"]), _abs(w.detach()), c["off"], rows=c["rows"]),
               c["K"], torch.float32, exact=regime == "serial")


# --------------------------------------------------------------------------- mm_scatter

def _scatter_bound(a, w, off, index, out0, scale, transposed):
    """|out0| + sum_r |scale[r]| |a[r]| @ |op(w[e])| in float64, one dense product (the
    reference's per-expert index_add_ is slow on a busy machine; this is only the bound)."""
    y = native.gather_mm_reference(_abs(a), _abs(w), off, transposed=transposed)
    S = torch.zeros(out0.shape[0], a.shape[0], dtype=torch.float64)
    S[index, torch.arange(a.shape[0])] = 1.0 if scale is None else _abs(scale)
    return _abs(out0) + S @ y


_SCATTER_WANT = {}  # the reference result, shared by the two regimes of one case


@pytest.mark.parametrize("scaled", [True, False], ids=["scale", "scale=None"])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("shape,regime,dtype", CASES, ids=CASE_IDS)
def test_mm_scatter_matches_reference(shape, regime, dtype, transposed, scaled):
    c = _make(shape, dtype, transposed)
    R, g = c["rows"].numel(), c["g"]
    a = torch.randn(R, c["K"], generator=g).to(dtype)
    scale = torch.rand(R, generator=g) if scaled else None
    out0 = torch.randn(c["T"], c["N"], generator=g).to(dtype)  # accumulates into what is there
    out = out0.clone()
    got = native.mm_scatter(a, c["w"], c["off"], c["rows"], out, scale=scale, transposed=transposed,
                            impl="native" if HAS_COMPILER else "auto", regime=regime)
    assert got is out
    key = (shape, dtype, transposed, scaled)
    if key not in _SCATTER_WANT:
        _SCATTER_WANT[key] = native.mm_scatter_reference(a, c["w"], c["off"], c["rows"], out0.clone(),
                                                         scale=scale, transposed=transposed)
    want = _SCATTER_WANT[key]
    bound = lambda: _scatter_bound(a, c["w"], c["off"], c["rows"], out0, scale, transposed)
    exact = regime == "serial" or not HAS_COMPILER
    # roundings: product, cast, scale, and one add per expert reaching a token
    reach = int(torch.bincount(c["rows"]).max()) if R else 0
    _check(got, want, bound, c["K"], dtype, exact, rounding_steps=4 + reach)


def test_mm_scatter_sums_a_token_over_experts_deterministically():
    """k experts per token: every run gives the same bits (ascending expert order)."""
    g = torch.Generator().manual_seed(1)
    T, E, k, K, N = 48, 16, 4, 40, 24
    eid = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])  # [T, k] distinct
    tok = torch.arange(T).repeat_interleave(k)
    order = torch.sort(eid.reshape(-1), stable=True).indices
    index = tok[order]
    off = _bounds(torch.bincount(eid.reshape(-1), minlength=E).tolist())
    a = torch.randn(T * k, K, generator=g)
    w = torch.randn(E, K, N, generator=g)
    scale = torch.rand(T * k, generator=g)
    runs = [native.mm_scatter(a, w, off, index, torch.zeros(T, N), scale=scale, regime=r)
            for r in ("parallel", "parallel", "serial", "serial")]
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[2], runs[3])
    assert torch.equal(runs[2], native.mm_scatter_reference(a, w, off, index, torch.zeros(T, N), scale=scale))


@pytest.mark.parametrize("regime", ["serial", "parallel"])
def test_mm_scatter_bf16_products_into_fp32_out(regime):
    c = _make("decode", torch.bfloat16, True)
    R = c["rows"].numel()
    a = torch.randn(R, c["K"], generator=c["g"]).bfloat16()
    scale = torch.rand(R, generator=c["g"]).bfloat16()
    got = native.mm_scatter(a, c["w"], c["off"], c["rows"], torch.ones(c["T"], c["N"]), scale=scale,
                            transposed=True, regime=regime)
    want = native.mm_scatter_reference(a, c["w"], c["off"], c["rows"], torch.ones(c["T"], c["N"]),
                                       scale=scale, transposed=True)
    assert got.dtype == torch.float32
    bound = lambda: native.mm_scatter_reference(_abs(a), _abs(c["w"]), c["off"], c["rows"],
                                                torch.ones(c["T"], c["N"], dtype=torch.float64),
                                                scale=_abs(scale), transposed=True)
    # the products are bfloat16: allow their rounding on top of the fp32 accumulation
    _check(got, want, bound, c["K"], torch.float32, exact=regime == "serial" or not HAS_COMPILER,
           rounding_steps=int(4 * _eps(torch.bfloat16) / _eps(torch.float32)))


def test_half_precision_float16():
    c = _make("empty_experts", torch.float16, False)
    for regime in ("serial", "parallel"):
        got = native.gather_mm(c["x"], c["w"], c["off"], rows=c["rows"], regime=regime)
        want = native.gather_mm_reference(c["x"], c["w"], c["off"], rows=c["rows"])
        bound = lambda: native.gather_mm_reference(_abs(c["x"]), _abs(c["w"]), c["off"], rows=c["rows"])
        _check(got, want, bound, c["K"], torch.float16, exact=regime == "serial")


# --------------------------------------------------------------------------- gather_wgrad

@pytest.mark.parametrize("gathered", [True, False], ids=["rows", "rows=None"])
@pytest.mark.parametrize("shape,regime,dtype", CASES, ids=CASE_IDS)
def test_gather_wgrad_matches_reference(shape, regime, dtype, gathered):
    c = _make(shape, dtype, False)
    R = c["rows"].numel()
    a, rows = (c["x"], c["rows"]) if gathered else (c["x"][c["rows"]], None)
    b = torch.randn(R, c["N"], generator=c["g"]).to(dtype)
    got = native.gather_wgrad(a, b, c["off"], rows=rows, impl="native" if HAS_COMPILER else "auto",
                              regime=regime)
    want = native.gather_wgrad_reference(a, b, c["off"], rows=rows)
    bound = lambda: native.gather_wgrad_reference(_abs(a), _abs(b), c["off"], rows=rows)
    most_rows = int(c["off"].diff().max()) if c["E"] else 0
    _check(got, want, bound, most_rows, dtype, exact=regime == "serial" or not HAS_COMPILER)
    assert got.shape == (c["E"], c["K"], c["N"])
    empty = c["off"].diff() == 0
    assert bool((got[empty] == 0).all())


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("shape,regime,dtype", CASES, ids=CASE_IDS)
def test_bias_and_gathered_b_match_reference(shape, regime, dtype, transposed):
    # the in-call epilogue and gathers: gather_mm's and mm_scatter's per-expert bias, and
    # gather_wgrad's rows_b, equal the reference's separate add / index_select (bit for bit in
    # the serial regime; the parallel one within the product's rounding, as above)
    c = _make(shape, dtype, transposed)
    R, E, N, T = c["rows"].numel(), c["E"], c["N"], c["T"]
    impl = "native" if HAS_COMPILER else "auto"
    exact = regime == "serial" or not HAS_COMPILER
    bias = torch.randn(E, N, generator=c["g"]).to(dtype)
    got = native.gather_mm(c["x"], c["w"], c["off"], rows=c["rows"], transposed=transposed, bias=bias, impl=impl,
                           regime=regime)
    want = native.gather_mm_reference(c["x"], c["w"], c["off"], rows=c["rows"], transposed=transposed, bias=bias)
    bound = lambda: native.gather_mm_reference(_abs(c["x"]), _abs(c["w"]), c["off"], rows=c["rows"],  # noqa: E731
                                               transposed=transposed, bias=_abs(bias))
    _check(got, want, bound, c["K"], dtype, exact)
    a = c["x"][c["rows"]]
    scale = torch.rand(R, generator=c["g"])
    out, out_ref = torch.zeros(T, N), torch.zeros(T, N)
    native.mm_scatter(a, c["w"], c["off"], c["rows"], out, scale=scale, transposed=transposed, bias=bias, impl=impl,
                      regime=regime)
    native.mm_scatter_reference(a, c["w"], c["off"], c["rows"], out_ref, scale=scale, transposed=transposed, bias=bias)
    bound = lambda: native.mm_scatter_reference(_abs(a), _abs(c["w"]), c["off"], c["rows"],  # noqa: E731
                                                torch.zeros(T, N, dtype=torch.float64), scale=scale.double(),
                                                transposed=transposed, bias=_abs(bias))
    _check(out, out_ref, bound, c["K"], dtype, exact, rounding_steps=4)
    b = torch.randn(T, 7, generator=c["g"]).to(dtype)
    got = native.gather_wgrad(a, b, c["off"], rows_b=c["rows"], impl=impl, regime=regime)
    want = native.gather_wgrad_reference(a, b, c["off"], rows_b=c["rows"])
    assert torch.equal(want, native.gather_wgrad_reference(a, b[c["rows"]], c["off"]))
    bound = lambda: native.gather_wgrad_reference(_abs(a), _abs(b), c["off"], rows_b=c["rows"])  # noqa: E731
    _check(got, want, bound, int(c["off"].diff().max()) if E else 0, dtype, exact)


def test_gather_wgrad_out_is_overwritten_and_empty_experts_zeroed():
    c = _make("empty_experts", torch.float32, False)
    b = torch.randn(c["rows"].numel(), c["N"], generator=c["g"])
    out = torch.full((c["E"], c["K"], c["N"]), float("nan"))
    z = native.gather_wgrad(c["x"], b, c["off"], rows=c["rows"], out=out)
    assert z is out
    assert torch.equal(z, native.gather_wgrad_reference(c["x"], b, c["off"], rows=c["rows"]))


# --------------------------------------------------------------------------- errors

def _base():
    x = torch.randn(10, 4)
    w = torch.randn(3, 4, 5)
    off = torch.tensor([0, 2, 2, 6])
    rows = torch.tensor([0, 9, 1, 2, 3, 4])
    return x, w, off, rows


def _gm(**kw):
    x, w, off, rows = _base()
    args = dict(x=x, w=w, offsets=off, rows=rows)
    args.update(kw)
    return lambda impl: native.gather_mm(impl=impl, **args)


def _ms(**kw):
    x, w, off, rows = _base()
    args = dict(a=torch.randn(6, 4), w=w, offsets=off, index=rows, out=torch.zeros(10, 5))
    args.update(kw)
    return lambda impl: native.mm_scatter(impl=impl, **args)


def _wg(**kw):
    x, w, off, rows = _base()
    args = dict(a=x, b=torch.randn(6, 5), offsets=off, rows=rows)
    args.update(kw)
    return lambda impl: native.gather_wgrad(impl=impl, **args)


BAD = [
    ("offsets_len", _gm(offsets=torch.tensor([0, 2, 6])), ValueError,
     r"gather_mm: offsets must be \[E \+ 1\] = \[4\] for E = 3 experts \(w.shape\[0\]\), got \(3,\)"),
    ("offsets_end", _gm(offsets=torch.tensor([0, 2, 2, 5])), ValueError,
     r"offsets\[-1\] = 5 must equal R = 6"),
    ("offsets_start", _gm(offsets=torch.tensor([1, 2, 2, 6])), ValueError, r"offsets\[0\] must be 0, got 1"),
    ("offsets_monotone", _gm(offsets=torch.tensor([0, 3, 2, 6])), ValueError,
     r"non-decreasing: offsets\[1\] = 3 > offsets\[2\] = 2"),
    ("offsets_dtype", _gm(offsets=torch.tensor([0, 2, 2, 6], dtype=torch.int32)), TypeError,
     r"offsets has dtype torch.int32; expected one of torch.int64"),
    ("rows_high", _gm(rows=torch.tensor([0, 10, 1, 2, 3, 4])), ValueError,
     r"rows holds values in \[0, 10\] but must lie in \[0, 10\) \(x has 10 rows\)"),
    ("rows_negative", _gm(rows=torch.tensor([0, -1, 1, 2, 3, 4])), ValueError,
     r"rows holds values in \[-1, 4\] but must lie in \[0, 10\)"),
    ("rows_len", _gm(rows=torch.tensor([0, 1, 2])), ValueError, r"offsets\[-1\] = 6 must equal R = 3"),
    ("x_w_dtype", _gm(w=torch.randn(3, 4, 5, dtype=torch.float64)), TypeError,
     r"w has dtype torch.float64 but x has torch.float32; cast one"),
    ("int_x", _gm(x=torch.ones(10, 4, dtype=torch.int64), w=torch.ones(3, 4, 5, dtype=torch.int64)),
     TypeError, r"x has dtype torch.int64; expected one of torch.float32"),
    ("device", _gm(x=torch.randn(10, 4, device="meta")), ValueError,
     r"x is on meta; this grouped GEMM is CPU-only: pass x.cpu\(\)"),
    ("K", _gm(x=torch.randn(10, 3)), ValueError, r"x is \(10, 3\) but op\(w\[e\]\) is \[K, N\] = \[4, 5\]"),
    ("w_ndim", _gm(w=torch.randn(4, 5)), ValueError, r"w must be 3-D, got shape \(4, 5\)"),
    ("out_shape", _gm(out=torch.empty(6, 4)), ValueError, r"out must be \[6, 5\]"),
    ("out_strided", _gm(out=torch.empty(5, 6).t()), ValueError, r"out must be contiguous"),
    ("not_tensor", _gm(x=[[1.0]]), TypeError, r"x must be a torch.Tensor, got list"),
    ("ms_index", _ms(index=torch.tensor([0, 1, 2, 3, 4, 10])), ValueError,
     r"mm_scatter: index holds values in \[0, 10\] but must lie in \[0, 10\) \(out has 10 rows\)"),
    ("ms_index_len", _ms(index=torch.tensor([0, 1])), ValueError, r"index must be \[R\] = \[6\]"),
    ("ms_scale", _ms(scale=torch.ones(5)), ValueError, r"scale must be \[R\] = \[6\]"),
    ("ms_out_N", _ms(out=torch.zeros(10, 4)), ValueError, r"out must be \[T, N\] with N = 5"),
    ("ms_a_w_dtype", _ms(a=torch.randn(6, 4, dtype=torch.bfloat16)), TypeError,
     r"w has dtype torch.float32 but a has torch.bfloat16"),
    ("ms_offsets", _ms(offsets=torch.tensor([0, 2, 2, 7])), ValueError, r"offsets\[-1\] = 7 must equal R = 6"),
    ("ms_device", _ms(out=torch.zeros(10, 5, device="meta")), ValueError, r"out is on meta"),
    ("wg_rows", _wg(rows=torch.tensor([0, 1, 2, 3, 4, 11])), ValueError,
     r"gather_wgrad: rows holds values in \[0, 11\] but must lie in \[0, 10\) \(a has 10 rows\)"),
    ("wg_a_rows", _wg(rows=None), ValueError, r"a is \(10, 4\) but must have R = 6 rows when rows is None"),
    ("wg_dtype", _wg(b=torch.randn(6, 5, dtype=torch.float64)), TypeError, r"b has dtype torch.float64"),
    ("wg_out", _wg(out=torch.zeros(3, 5, 4)), ValueError, r"out must be \[3, 4, 5\]"),
    ("wg_offsets_2d", _wg(offsets=torch.zeros(2, 2, dtype=torch.int64)), ValueError, r"offsets must be 1-D"),
    ("wg_offsets_empty", _wg(offsets=torch.zeros(0, dtype=torch.int64)), ValueError,
     r"offsets must be \[E \+ 1\] with at least one entry"),
    ("bias_shape", _gm(bias=torch.randn(3, 4)), ValueError, r"gather_mm: bias must be \[E, N\] = \[3, 5\]"),
    ("bias_dtype", _gm(bias=torch.randn(3, 5, dtype=torch.float64)), TypeError,
     r"bias has dtype torch.float64 but the operand has torch.float32"),
    ("ms_bias", _ms(bias=torch.randn(2, 5)), ValueError, r"mm_scatter: bias must be \[E, N\] = \[3, 5\]"),
    ("wg_rows_b", _wg(b=torch.randn(8, 5), rows_b=torch.tensor([0, 1, 2, 3, 4, 8])), ValueError,
     r"gather_wgrad: rows_b holds values in \[0, 8\] but must lie in \[0, 8\) \(b has 8 rows\)"),
    ("impl", _gm(), ValueError, r"impl must be 'auto', 'native' or 'reference'"),
]


@pytest.mark.parametrize("impl", ["native", "reference"])
@pytest.mark.parametrize("case", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_a_clear_error(case, impl):
    _, call, exc, match = case
    if case[0] == "impl":
        impl = "fastest"
    elif impl == "native" and not HAS_COMPILER:
        impl = "auto"
    with pytest.raises(exc, match=match):
        call(impl)


@pytest.mark.parametrize("impl", ["native", "reference"])
def test_bad_regime_raises(impl):
    x, w, off, rows = _base()
    impl = impl if HAS_COMPILER else "auto"
    with pytest.raises(ValueError, match=r"regime must be 'auto', 'serial' or 'parallel'"):
        native.gather_mm(x, w, off, rows=rows, regime="threads", impl=impl)
    with pytest.raises(ValueError, match=r"regime must be"):
        native.mm_scatter(torch.randn(6, 4), w, off, rows, torch.zeros(10, 5), regime="x", impl=impl)
    with pytest.raises(ValueError, match=r"regime must be"):
        native.gather_wgrad(x, torch.randn(6, 5), off, rows=rows, regime="x", impl=impl)


@pytest.mark.skipif(not HAS_COMPILER, reason="the planned entries call the extension")
@pytest.mark.parametrize("regime", ["serial", "parallel", "auto"])
@pytest.mark.parametrize("transposed", [False, True])
def test_planned_entries_equal_the_checked_ones_and_the_extension_refuses_bad_plans(regime, transposed):
    # the engine's entries skip the Python checks for a plan's host bounds: the same extension call
    # (bit for bit), and the extension's own checks still stop a bad plan before a row is read
    c = _make("decode", torch.float32, transposed)
    bounds = tuple(c["off"].tolist())
    bias = torch.randn(c["E"], c["N"], generator=c["g"])
    got = native.planned_mm(c["x"], c["w"], c["off"], bounds, rows=c["rows"], transposed=transposed, bias=bias,
                            regime=regime)
    want = native.gather_mm(c["x"], c["w"], c["off"], rows=c["rows"], transposed=transposed, bias=bias,
                            impl="native", regime=regime)
    assert torch.equal(got, want)
    a = torch.randn(bounds[-1], c["K"], generator=c["g"])
    scale = torch.rand(bounds[-1], generator=c["g"])
    out0 = torch.randn(c["T"], c["N"], generator=c["g"])
    got = native.planned_scatter(a, c["w"], c["off"], bounds, c["rows"], out0.clone(), scale=scale,
                                 transposed=transposed, bias=bias, regime=regime)
    want = native.mm_scatter(a, c["w"], c["off"], c["rows"], out0.clone(), scale=scale, transposed=transposed,
                             bias=bias, impl="native", regime=regime)
    assert torch.equal(got, want)
    bad_rows = c["rows"].clone()
    bad_rows[-1] = c["T"]
    with pytest.raises(ValueError, match=r"rows\[\d+\] = \d+ is outside"):
        native.planned_mm(c["x"], c["w"], c["off"], bounds, rows=bad_rows, transposed=transposed, bias=None,
                          regime=regime)
    with pytest.raises(ValueError, match=r"index\[\d+\] = \d+ is outside"):
        native.planned_scatter(a, c["w"], c["off"], bounds, bad_rows, out0.clone(), scale=None,
                               transposed=transposed, bias=None, regime=regime)
    shifted = c["off"].clone()
    shifted[1:] -= 1   # offsets that end one row short of the bounds' R
    with pytest.raises(ValueError, match="offsets must start at 0 and end at R"):
        native.planned_mm(c["x"], c["w"], shifted, bounds, rows=c["rows"], transposed=transposed, bias=None,
                          regime=regime)
