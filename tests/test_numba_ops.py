"""numba CPU kernels of the fmoe ops against fmoe.ops.reference.

dispatch and combine must be bit-for-bit equal (float32/float64, and bf16/fp16
which compute in fp32 and round once); gate_grad is a reassociated dot product,
so it is checked to a tight tolerance. Also: under torch.func.vmap / grad and
inside torch.compile(fullgraph=True) the ops really run the numba kernels.
"""
import pytest
import torch

import fmoe
from fmoe.ops import numba_cpu, reference, tuning
from fmoe.ops import _numba_kernels as K

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _case(T=37, M=19, E=5, k=3, cf=1.0, seed=0, mask=True):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(T, E, generator=g).softmax(1)
    r = fmoe.top_k_routing(scores, k, cf)
    pos = r.positions().clone()
    if mask:  # masked pairs (negative expert ids) are skipped
        pos[0, ::7] = -1
    return g, r, pos, E * r.capacity


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weighted", [False, True])
def test_dispatch_combine_bit_exact(dtype, weighted):
    g, r, pos, R = _case()
    T, M = pos.shape[1], 19
    x = torch.randn(T, M, generator=g).to(dtype)
    x[3, :4] = -0.0  # index_add_ into zeros turns -0.0 into +0.0; so must the kernel
    y = torch.randn(R, M, generator=g).to(dtype)
    w = r.weights if weighted else None
    got = numba_cpu.dispatch(x, pos, w, R)
    want = reference.dispatch(x, pos, w, R)
    assert got.dtype == dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    got = numba_cpu.combine(y, pos, w)
    want = reference.combine(y, pos, w)
    assert got.dtype == dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gate_grad_close(dtype):
    g, r, pos, R = _case(M=300)
    a = torch.randn(pos.shape[1], 300, generator=g).to(dtype)
    b = torch.randn(R, 300, generator=g).to(dtype)
    got, want = numba_cpu.gate_grad(a, b, pos), reference.gate_grad(a, b, pos)
    assert got.dtype == dtype
    assert torch.equal(got == 0, want == 0)  # skipped pairs are exactly 0
    # |error| <= M * eps * sum|a*b| bounds any summation order; in practice far smaller.
    scale = (a.double().abs() @ b.double().abs().t()).max().item()
    tol = {torch.float32: 1e-6, torch.float64: 1e-14, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    assert (got.double() - want.double()).abs().max().item() <= tol * scale


def test_ops_use_numba_and_disabled_restores_reference(monkeypatch):
    calls = []
    real = K.combine_rows

    def spy(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(K, "combine_rows", spy)
    monkeypatch.setattr(tuning, "NUMBA_SERIAL_ELEMENTS", 0)  # small case: force the parallel kernel
    g, r, pos, R = _case()
    y = torch.randn(R, 8, generator=g)
    torch.ops.fmoe.combine(y, pos, r.weights)
    assert len(calls) == 1
    with numba_cpu.disabled():
        torch.ops.fmoe.combine(y, pos, r.weights)
    assert len(calls) == 1
    torch.ops.fmoe.combine(y, pos, r.weights)
    assert len(calls) == 2


@pytest.mark.parametrize("serial", [0, 1 << 30])
def test_bad_positions_raise(serial, monkeypatch):
    monkeypatch.setattr(tuning, "NUMBA_SERIAL_ELEMENTS", serial)
    x = torch.randn(4, 3)
    pos = torch.tensor([[0, 1, 2, 9]])
    with pytest.raises(IndexError):
        numba_cpu.dispatch(x, pos, None, 4)
    with pytest.raises(IndexError):
        numba_cpu.combine(torch.randn(4, 3), pos, None)


def _moe_like(x, r, E, C, weighted_in):
    D = fmoe.dispatch(x, r, weighted=weighted_in)
    return fmoe.combine(torch.tanh(D), r, weighted=not weighted_in)


@pytest.mark.parametrize("weighted_in", [False, True])
def test_grad_matches_reference(weighted_in):
    g, r, pos, R = _case(T=24, E=4, k=2)
    x = torch.randn(24, 16, generator=g, dtype=torch.float64)
    E, C = r.num_experts, r.capacity

    def loss(x, w):
        rr = fmoe.Routing(r.expert_ids, r.slots, w, r.counts, C, E)
        return _moe_like(x, rr, E, C, weighted_in).square().sum()

    w = r.weights.double()
    got = torch.func.grad(loss, argnums=(0, 1))(x, w)
    with numba_cpu.disabled():
        want = torch.func.grad(loss, argnums=(0, 1))(x, w)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_vmap_matches_loop(monkeypatch):
    calls = []
    real = K.dispatch_rows
    monkeypatch.setattr(K, "dispatch_rows", lambda *a: (calls.append(1), real(*a))[1])
    monkeypatch.setattr(tuning, "NUMBA_SERIAL_ELEMENTS", 0)  # small case: force the parallel kernel
    g, r, pos, R = _case(T=20, E=4, k=2, mask=False)
    xs = torch.randn(3, 20, 8, generator=g)
    out = torch.func.vmap(lambda x: fmoe.combine(fmoe.dispatch(x, r) * 2, r))(xs)
    assert len(calls) == 1  # the vmap rule folds the batch into rows: one kernel call
    for i in range(3):
        assert torch.equal(out[i], reference.combine(reference.dispatch(xs[i], pos, None, R) * 2, pos, r.weights))


def test_compile_fullgraph_runs_numba(monkeypatch):
    calls = []
    real = K.dispatch_rows
    monkeypatch.setattr(K, "dispatch_rows", lambda *a: (calls.append(1), real(*a))[1])
    monkeypatch.setattr(tuning, "NUMBA_SERIAL_ELEMENTS", 0)  # small case: force the parallel kernel
    g, r, pos, R = _case(T=20, E=4, k=2, mask=False)
    x = torch.randn(20, 8, generator=g)

    def f(x, pos, w):
        return torch.ops.fmoe.combine(torch.ops.fmoe.dispatch(x, pos, None, R).sin(), pos, w)

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="eager")(x, pos, r.weights)
    assert calls, "the compiled graph did not call the numba kernel"
    want = reference.combine(reference.dispatch(x, pos, None, R).sin(), pos, r.weights)
    assert torch.equal(got, want)


@pytest.mark.parametrize("prioritized", [False, True])
def test_assign_slots_matches_routing(prioritized):
    from fmoe.routing import assign_slots, assign_slots_torch as torch_assign_slots
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(-1, 6, (3, 50), generator=g)  # includes masked (-1) pairs
    order = torch.randperm(50, generator=g) if prioritized else None
    got = assign_slots(ids, 6, order=order)
    want = torch_assign_slots(ids, 6, order=order)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    # R1 (spec §7.4): loc_0 / loc_1 and dispatch_count
    r1 = torch.tensor([[0, 0, 1, 0, 2, 0, 3, 1], [1, 2, 0, 3, 0, 1, 2, 0]])
    slots, counts = assign_slots(r1, 4)
    assert slots.tolist() == [[0, 1, 0, 2, 0, 3, 0, 1], [2, 1, 4, 1, 5, 3, 2, 6]]
    assert counts.tolist() == [7, 4, 3, 2]
    with pytest.raises(IndexError):
        assign_slots(torch.tensor([[0, 9]]), 4)


def test_assign_slots_under_transforms():
    from fmoe.routing import assign_slots, assign_slots_torch as torch_assign_slots
    s = torch.rand(20, 5, generator=torch.Generator().manual_seed(4))

    def f(s):  # under grad the ids are wrapped tensors: the kernel must still run
        ids = torch.topk(s, 2, dim=1).indices.t()
        order = torch.argsort(-s.amax(1), stable=True)
        got, want = assign_slots(ids, 5, order=order), torch_assign_slots(ids, 5, order=order)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        return (s * got[1].to(s.dtype)).sum()

    torch.func.grad(f)(s)
    xs = torch.rand(3, 20, 5)
    got = torch.func.vmap(lambda x: assign_slots(torch.topk(x, 2, dim=1).indices.t(), 5)[1])(xs)
    for i in range(3):
        assert torch.equal(got[i], torch_assign_slots(torch.topk(xs[i], 2, dim=1).indices.t(), 5)[1])
    ids = torch.randint(0, 5, (2, 9))
    compiled = torch.compile(lambda x: assign_slots(x, 5)[0], fullgraph=True, backend="eager")
    assert torch.equal(compiled(ids), torch_assign_slots(ids, 5)[0])


def test_forward_only_fast_path_is_the_function_path():
    # No grad / nothing requires grad: the raw ops skip Function.apply; same values. Any
    # autograd, forward-AD or torch.func context keeps the Function front (tangents flow).
    from fmoe.ops.primitives import combine_raw, dispatch_raw, forward_only
    import torch.autograd.forward_ad as fwAD
    g, r, pos, R = _case()
    x = torch.randn(pos.shape[1], 19, generator=g)
    with torch.no_grad():
        assert forward_only(x, pos, r.weights)
        d = dispatch_raw(x, pos, r.weights, R)
    assert torch.equal(d, numba_cpu.dispatch(x, pos, r.weights, R))
    assert torch.equal(combine_raw(d, pos, r.weights), numba_cpu.combine(d, pos, r.weights))
    xg = x.clone().requires_grad_(True)
    assert not forward_only(xg, pos, None)
    tx = torch.randn_like(x)
    with fwAD.dual_level():
        assert not forward_only(x, pos, None)
        out = dispatch_raw(fwAD.make_dual(x, tx), pos, None, R)
        assert torch.equal(fwAD.unpack_dual(out).tangent, numba_cpu.dispatch(tx, pos, None, R))
    seen = []
    torch.func.grad(lambda z: seen.append(forward_only(z, pos, None)) or dispatch_raw(z, pos, None, R).sum())(x)
    assert seen == [False]


@pytest.mark.parametrize("ydt,wdt", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                     (torch.bfloat16, torch.bfloat16), (torch.float64, torch.float64)])
def test_grouped_combine_shortcut_bit_exact(ydt, wdt):
    # models.common.grouped_combine skips the weighted [E, C, H] copy when combine's own
    # weighted sum forms the same products; must equal the explicit per-row product path.
    from fmoe.layout import padded_layout
    from fmoe.ops.orders import grouped_combine
    from fmoe.routing import make_routing
    g = torch.Generator().manual_seed(4)
    T, E, k, H = 13, 6, 3, 17
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g).to(wdt)
    r = make_routing(ids.t().contiguous(), w.t().contiguous(), E, 0.0)
    y = torch.randn(E, r.capacity, H, generator=g).to(ydt)
    pos = r.positions().reshape(-1)
    w_rows = torch.zeros(E * r.capacity, dtype=wdt)
    w_rows[pos[pos >= 0]] = r.weights.reshape(-1)[pos >= 0]
    want = fmoe.combine(y * w_rows.reshape(E, r.capacity, 1), r, weighted=False).to(ydt)
    got = grouped_combine(y, r, padded_layout(r), ydt)
    assert got.dtype == ydt and torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weighted", [False, True])
def test_serial_kernels_equal_parallel(dtype, weighted, monkeypatch):
    # Small problems run serial twins (no TBB region); bit-identical to the parallel kernels.
    g, r, pos, R = _case(T=53, M=23, E=7, k=3)
    x = torch.randn(pos.shape[1], 23, generator=g).to(dtype)
    y = torch.randn(R, 23, generator=g).to(dtype)
    w = r.weights if weighted else None
    out = {}
    for name, lim in (("parallel", 0), ("serial", 1 << 30)):
        monkeypatch.setattr(tuning, "NUMBA_SERIAL_ELEMENTS", lim)
        out[name] = (numba_cpu.dispatch(x, pos, w, R), numba_cpu.combine(y, pos, w))
    for a, b in zip(out["parallel"], out["serial"]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert torch.equal(out["serial"][0], reference.dispatch(x, pos, w, R))
