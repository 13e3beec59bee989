"""The routing walks (fmoe._slots): the C++ extension fmoe_walks against its numba twin and the
pure-torch references, and inference without numba.

Where a C++ compiler is present the extension must build and be active (no silent skip). The
walks are integer running counts: the twins and the references are equal by construction, so
every comparison here is exact (torch.equal), with the buffers' unwritten tails included.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import fmoe
from fmoe import _slots
from fmoe.engine import plan as P
from fmoe.ops import native
from fmoe.routing import assign_slots_torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_COMPILER = native._compiler() is not None
IMPLS = ("native", "numba") if HAS_COMPILER else ("numba",)


@pytest.fixture(scope="module", autouse=True)
def built():
    if HAS_COMPILER:
        _slots.build(verbose=False)   # a no-op when already built for this key


def test_extension_is_active_where_a_compiler_is():
    if HAS_COMPILER:
        assert _slots.extension() is not None, _slots.status()
        assert _slots.status().startswith("native routing walks: active")
    else:
        assert _slots.extension() is None and "no C++ compiler" in _slots.status()


# --------------------------------------------------------------------------- assign_slots

SHAPES = [(1, 0, 4), (1, 1, 1), (4, 1, 32), (2, 7, 3), (6, 16, 64), (8, 300, 64), (2, 50, 1)]


@pytest.mark.parametrize("k,T,E", SHAPES)
def test_assign_slots_twins_equal_the_torch_reference(k, T, E):
    g = torch.Generator().manual_seed(k * 1000 + T + E)
    ids = torch.randint(-2, E, (k, T), generator=g)   # negative ids (no expert), and ties: E small against k*T
    orders = [None, torch.randperm(T, generator=g), torch.arange(T - 1, -1, -1)]
    for order in orders:
        want = assign_slots_torch(ids, E, order=order)
        for impl in IMPLS:
            slots, counts = _slots.assign_slots_fast(ids, E, order, impl=impl)
            assert slots.dtype == counts.dtype == torch.int64
            assert torch.equal(slots, want[0]) and torch.equal(counts, want[1]), (impl, order)
        # the public function takes the same walk
        got = fmoe.assign_slots(ids, E, order=order)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_assign_slots_takes_int32_ids_and_non_contiguous_ones():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(-1, 6, (40, 3), generator=g).t()   # [3, 40], a transposed view
    order = torch.randperm(40, generator=g).to(torch.int32)
    want = assign_slots_torch(ids, 6, order=order.long())
    for impl in IMPLS:
        for i in (ids, ids.to(torch.int32)):
            slots, counts = _slots.assign_slots_fast(i, 6, order, impl=impl)
            assert torch.equal(slots, want[0]) and torch.equal(counts, want[1])


@pytest.mark.parametrize("impl", IMPLS)
def test_assign_slots_errors_are_the_same_in_both_twins(impl):
    ids = torch.tensor([[0, 3, 1], [2, -1, 0]])
    msg = r"assign_slots: an expert id is >= num_experts=3 \(the largest is 3\); ids must lie in \[0, num_experts\)"
    with pytest.raises(IndexError, match=msg):
        _slots.assign_slots_fast(ids, 3, None, impl=impl)
    with pytest.raises(IndexError, match=msg):
        _slots.assign_slots_fast(ids, 3, torch.tensor([2, 0, 1]), impl=impl)
    ok = torch.tensor([[0, 2, 1], [2, -1, 0]])
    for order, what in ((torch.tensor([0, 3, 1]), "order holds a token index outside \\[0, T\\)"),
                        (torch.tensor([0, -1, 1]), "order holds a token index outside \\[0, T\\)"),
                        (torch.tensor([0, 2, 0]), "order names a token twice")):
        with pytest.raises(ValueError, match=f"assign_slots: {what}: order must be a permutation of 0..2"):
            _slots.assign_slots_fast(ok, 3, order, impl=impl)
    with pytest.raises(ValueError, match=r"assign_slots: order must be \[T\] = \[3\] \(a permutation of the tokens\), "
                                         r"got shape \(2,\)"):
        _slots.assign_slots_fast(ok, 3, torch.tensor([0, 1]), impl=impl)
    with pytest.raises(ValueError, match=r"order must be \[T\] = \[3\] .*got shape \(1, 3\)"):
        _slots.assign_slots_fast(ok, 3, torch.tensor([[0, 1, 2]]), impl=impl)
    with pytest.raises(ValueError, match="assign_slots: num_experts must be >= 0, got -1"):
        _slots.assign_slots_fast(ok, -1, None, impl=impl)
    # no experts: only negative ids are valid
    slots, counts = _slots.assign_slots_fast(torch.full((2, 3), -1), 0, None, impl=impl)
    assert slots.tolist() == [[-1] * 3] * 2 and counts.shape == (0,)


def test_assign_slots_impl_is_checked():
    ids = torch.zeros(1, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="assign_slots: impl must be one of 'auto', 'native', 'numba', got 'cuda'"):
        _slots.assign_slots_fast(ids, 2, None, impl="cuda")
    with pytest.raises(ValueError, match="kept_rows: impl must be one of"):
        _slots.kept_rows(ids, ids, torch.tensor([2, 0]), 4, torch.empty(6, dtype=torch.int64),
                         torch.empty(2, dtype=torch.int64), impl="fast")


def test_assign_slots_leaves_traced_and_off_cpu_calls_to_the_reference():
    ids = torch.tensor([[0, 1]])
    assert _slots.assign_slots_fast(ids.to("meta"), 2, None) is None
    assert _slots.assign_slots_fast(torch.zeros(2, dtype=torch.int64), 2, None) is None   # not [k, T]
    # under vmap the ids are batched: the reference runs (and gives the per-sample slots)
    batched = torch.tensor([[[0, 1, 0]], [[1, 1, 0]]])
    slots, counts = torch.func.vmap(lambda i: fmoe.assign_slots(i, 2))(batched)
    assert slots.tolist() == [[[0, 0, 1]], [[0, 1, 0]]] and counts.tolist() == [[2, 1], [1, 2]]


# --------------------------------------------------------------------------- kept_rows

def _kept(impl, ids, slots, counts, C, fill=-7):
    k, T = ids.shape
    out = torch.full((counts.shape[0] + 2 + k * T,), fill, dtype=torch.int64)
    pairs = torch.full((k * T,), fill, dtype=torch.int64)
    return _slots.kept_rows(ids, slots, counts, C, out, pairs, impl=impl), out, pairs


@pytest.mark.parametrize("T,E,k,cf", [(1, 32, 4, 0.0), (1, 32, 4, 1.0), (16, 64, 6, 0.0), (16, 64, 6, 2.0),
                                      (300, 8, 2, 0.5), (300, 8, 2, 1.0), (300, 8, 2, 0.0), (5, 3, 3, 1.0),
                                      (5, 3, 2, 0.5)])
def test_kept_rows_twins_equal_the_torch_reference(T, E, k, cf):
    g = torch.Generator().manual_seed(T * 7 + E + k)
    r = fmoe.top_k_routing(torch.rand(T, E, generator=g).softmax(1), k, cf)
    tokens, pairs, bounds, dropped = P.rows_reference(r)
    assert cf != 0.5 or int(dropped) > 0   # a case with dropped pairs
    got = {impl: _kept(impl, r.expert_ids, r.slots, r.counts, r.capacity) for impl in IMPLS}
    for impl, (N, out, pr) in got.items():
        assert N == bounds[-1] == tokens.shape[0], impl
        assert out[:E + 1].tolist() == list(bounds) and int(out[E + 1]) == int(dropped)
        assert torch.equal(out[E + 2:E + 2 + N], tokens) and torch.equal(pr[:N], pairs)
        # nothing written past the kept rows
        assert (out[E + 2 + N:] == -7).all() and (pr[N:] == -7).all()
    if len(got) == 2:   # the whole buffers, tails included
        assert torch.equal(got["native"][1], got["numba"][1]) and torch.equal(got["native"][2], got["numba"][2])
    # make_plan's CPU walk gives the reference rows
    plan = P.make_plan(r, needs_grad=False, dtype=torch.float32)
    assert plan.bounds == tuple(bounds) and torch.equal(plan.tokens, tokens) and torch.equal(plan.pairs, pairs)


@pytest.mark.parametrize("impl", IMPLS)
def test_kept_rows_error_codes_are_the_same_in_both_twins(impl):
    t = lambda *v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    cases = [  # (ids, slots, counts, capacity, code)
        ([[0]], [[1]], t(1), 4, -1),            # slot past the expert's rows
        ([[2]], [[0]], t(1), 4, -1),            # expert id >= E
        ([[0]], [[-1]], t(1), 4, -1),           # a negative slot of a kept pair
        ([[0, 0]], [[0, 0]], t(2), 4, -2),      # two pairs in one slot
        ([[0, -1]], [[0, -1]], t(2), 4, -3),    # a row nobody fills
        ([[0, 1]], [[0, 0]], t(5, 1), 9, -3),   # more rows than pairs
        ([[0]], [[0]], t(1 << 62, 1 << 62), 1 << 62, -3),   # a sum that would overflow
        ([[0]], [[0]], t(-1), 4, -5),           # a negative count
        ([[0]], [[0]], t(1), -1, -5),           # a negative capacity
    ]
    for ids, slots, counts, C, code in cases:
        N, out, pairs = _kept(impl, t(*ids), t(*slots), counts, C)
        assert N == code, (ids, slots, counts.tolist(), C)
        assert code in _slots.KEPT_ROWS_ERRORS
    ids = t([0, 1])
    short = torch.empty(3, dtype=torch.int64)
    assert _slots.kept_rows(ids, ids * 0, t(1, 1), 4, short, torch.empty(2, dtype=torch.int64), impl=impl) == -4
    assert _slots.kept_rows(ids, ids * 0, t(1, 1), 4, torch.empty(6, dtype=torch.int64),
                            torch.empty(1, dtype=torch.int64), impl=impl) == -4
    # a dropped pair (slot >= capacity) is counted, not placed
    N, out, pairs = _kept(impl, t([0, 0, 1]), t([0, 1, 0]), t(2, 1), 1)
    assert N == 2 and out[:4].tolist() == [0, 1, 2, 1] and out[4:6].tolist() == [0, 2] and pairs[:2].tolist() == [0, 2]


@pytest.mark.parametrize("impl", IMPLS)
def test_kept_rows_refuses_bad_arguments_before_either_twin_runs(impl):
    ids = torch.tensor([[0, 1]])
    out, pairs = torch.empty(6, dtype=torch.int64), torch.empty(2, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"kept_rows: ids and slots must be \[k, T\] of one shape and counts \[E\], "
                                         r"got ids \(1, 2\), slots \(2, 1\), counts \(2,\)"):
        _slots.kept_rows(ids, ids.t(), torch.tensor([1, 1]), 4, out, pairs, impl=impl)
    with pytest.raises(ValueError, match=r"kept_rows: .*counts \(1, 2\)"):
        _slots.kept_rows(ids, ids, torch.tensor([[1, 1]]), 4, out, pairs, impl=impl)
    for bad in (out.to(torch.int32), out[::2], out.reshape(2, 3)):
        with pytest.raises(ValueError, match="kept_rows: out must be a contiguous 1-D int64 CPU tensor"):
            _slots.kept_rows(ids, ids * 0, torch.tensor([1, 1]), 4, bad, pairs, impl=impl)
    with pytest.raises(ValueError, match="kept_rows: pairs must be a contiguous 1-D int64 CPU tensor"):
        _slots.kept_rows(ids, ids * 0, torch.tensor([1, 1]), 4, out, pairs.float(), impl=impl)


@pytest.mark.skipif(not HAS_COMPILER, reason="the extension needs a C++ compiler")
def test_the_extension_checks_its_arguments_itself():
    # the backstop behind fmoe._slots' wrappers: a caller who skips them gets an error, never a read
    # or write outside a buffer
    ext = _slots.extension()
    ids, none = torch.tensor([[0, 1, 2]]), torch.empty(0, dtype=torch.int64)
    bad = [
        (lambda: ext.assign_slots(ids.int(), none, 3), "ids must be int64, got Int"),
        (lambda: ext.assign_slots(ids[0], none, 3), r"ids must be 2-D, got shape \[3\]"),
        (lambda: ext.assign_slots(torch.zeros(3, 2, dtype=torch.int64).t(), none, 3), "ids must be contiguous"),
        (lambda: ext.assign_slots(ids.to("meta"), none, 3), "ids must be a CPU tensor"),
        (lambda: ext.assign_slots(ids, torch.tensor([0, 1]), 3), "order must have 0 or T=3 entries, got 2"),
        (lambda: ext.assign_slots(ids, none, -1), "num_experts must be >= 0, got -1"),
        (lambda: ext.kept_rows(ids, ids.t().contiguous(), torch.tensor([1, 1, 1]), 4, torch.empty(8, dtype=torch.int64),
                               torch.empty(3, dtype=torch.int64)),
         r"slots must have ids' shape \[1, 3\], got \[3, 1\]"),
        (lambda: ext.kept_rows(ids, ids, torch.tensor([1, 1, 1]), 4, torch.empty(8), torch.empty(3, dtype=torch.int64)),
         "out must be int64, got Float"),
    ]
    for call, msg in bad:
        with pytest.raises(RuntimeError, match=f"fmoe walks: {msg}"):
            call()
    slots, counts, status = ext.assign_slots(ids, torch.tensor([0, 0, 1]), 3)
    assert status == 3 and slots.tolist() == [[-1, -1, -1]] and counts.tolist() == [0, 0, 0]


def test_both_twins_leave_the_same_buffers_on_a_bad_order():
    ids = torch.tensor([[0, 1, 2], [2, 2, -1]])
    for order, code in ((torch.tensor([0, 0, 1]), 3), (torch.tensor([2, 3, 0]), 2)):
        W = _slots.numba_walks()
        slots, counts = torch.full((2, 3), 9), torch.full((3,), 9)
        assert W.assign_slots_walk(ids.numpy(), order.numpy(), 3, slots.numpy(), counts.numpy()) == code
        assert (slots == -1).all() and (counts == 0).all()
        if HAS_COMPILER:
            s2, c2, status = _slots.extension().assign_slots(ids, order, 3)
            assert status == code and torch.equal(s2, slots) and torch.equal(c2, counts)


# --------------------------------------------------------------------------- numba stays out of inference

_NUMBA_WATCH = textwrap.dedent("""
    import importlib.abc, sys, traceback
    SEEN = []
    class Watch(importlib.abc.MetaPathFinder):   # records who imports numba or llvmlite, blocks nothing
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in ("numba", "llvmlite") and not SEEN:
                SEEN.append("".join(traceback.format_stack(limit=15)))
            return None
    sys.meta_path.insert(0, Watch())
    def report(what):
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("numba", "llvmlite"))
        print(what, "loaded:", loaded[:5], "first import from:", SEEN[0] if SEEN else None)
        assert not loaded, what
""")


def _run(code: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _NUMBA_WATCH + textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_import_and_a_packed_decode_through_moe_never_load_numba():
    from fmoe.quant import packed
    if HAS_COMPILER:   # the decode's kernels: every one of them native
        native.build(verbose=False)
        packed.build(verbose=False)
    code = """
        import torch, fmoe
        from fmoe import quant
        report("import fmoe")
        from fmoe.quant import packed
        if packed.AVAILABLE and fmoe._slots.extension() is not None:
            g = torch.Generator().manual_seed(0)
            for fmt in ("mxfp4", "fp8_block"):
                spec = fmoe.MoESpec(model_dim=128, num_experts=8, gate=fmoe.GateSpec(k=2, capacity_factor=0.0),
                                    experts=fmoe.ExpertSpec(type="swiglu", hidden_size=128))
                params = fmoe.init_params(spec, generator=g)
                params["experts"] = {n: quant.quantize(w, fmt) for n, w in params["experts"].items()}
                with torch.no_grad():
                    for T in (1, 4):
                        y, _ = fmoe.moe(params, torch.randn(T, 128, generator=g), spec)
                        assert y.shape == (T, 128) and bool(y.isfinite().all())
            report("packed decode")
        print("ran decode:", packed.AVAILABLE)
    """
    r = _run(code)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"ran decode: {HAS_COMPILER}" in r.stdout, r.stdout


def test_a_patched_transformers_model_generates_without_numba(tmp_path):
    pytest.importorskip("transformers")
    if not HAS_COMPILER:
        pytest.skip("the numba fallbacks run where the extensions cannot be built")
    from fmoe.examples import generate as G
    from fmoe.quant import packed
    packed.build(verbose=False)
    G.write_checkpoint(str(tmp_path), "gpt_oss", "tiny")
    code = f"""
        import torch
        from fmoe.examples import generate as G
        model, _ = G.load_patched({str(tmp_path)!r}, "gpt_oss", dtype=torch.bfloat16)
        out = G.greedy(model, torch.tensor([[1, 2, 3]]), 3)
        assert out.shape == (1, 3)
        report("generate")
    """
    r = _run(code)
    assert r.returncode == 0, r.stdout + r.stderr


def test_without_the_extension_the_numba_walks_run(tmp_path):
    # a fresh process whose extension cache is empty (HOME elsewhere): 'auto' falls back to numba,
    # 'native' names the build command, and the results are the reference's
    code = """
        import torch, fmoe
        from fmoe import _slots
        from fmoe.routing import assign_slots_torch
        why = _slots.status()
        assert _slots.extension() is None and ("not built: run `python -m fmoe build`" in why
                                               or "no C++ compiler" in why), why
        ids = torch.randint(-1, 5, (3, 40), generator=torch.Generator().manual_seed(0))
        slots, counts = fmoe.assign_slots(ids, 5)
        want = assign_slots_torch(ids, 5)
        assert torch.equal(slots, want[0]) and torch.equal(counts, want[1])
        import sys
        assert "numba" in sys.modules
        try:
            _slots.assign_slots_fast(ids, 5, None, impl="native")
        except RuntimeError as e:
            assert "assign_slots(impl='native'): the C++ routing walks are not active (" in str(e), e
            assert "build them with `python -m fmoe build`" in str(e), e
        else:
            raise AssertionError("impl='native' ran without the extension")
        print("fallback ok")
    """
    env = dict(os.environ, HOME=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and "fallback ok" in r.stdout, r.stdout + r.stderr
