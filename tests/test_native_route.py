"""A small eager no-grad CPU call's routing in one native call (fmoe.routers.route_native,
walks.cpp route_rows) against the torch path (fmoe.routers.route): the same ids, slots, counts,
capacity and gates bit for bit (the selection is torch.topk's algorithm with its tie order, the
normalisation torch.sum's order of additions and one division), the same plan rows, the same layer
output and balance loss; NaN logits raise the torch path's error."""
import dataclasses

import pytest
import torch

import fmoe
from fmoe import _slots
from fmoe.engine import plan as _plan
from fmoe.losses import gshard_loss
from fmoe.routers import GateSpec, init_router, native_applies, route, route_native

pytestmark = pytest.mark.skipif(_slots.extension() is None or not _slots.TOPK_AS_TORCH,
                                reason="the C++ routing walks are not built, or torch is not the version whose "
                                       "top-k they repeat (the torch ops run instead)")

M = 24


def _gate(kind, k, E, cf, dtype=torch.float32, ties=False, seed=0, **kw):
    spec = GateSpec(type=kind, k=k, capacity_factor=cf, **kw)
    g = torch.Generator().manual_seed(seed)
    params = init_router(spec, E, M, generator=g, dtype=dtype if kind != "top" else torch.float32)
    if kind == "deepseek":   # a non-zero correction bias: selection and gates read different values
        params["correction_bias"] = torch.randn(E, generator=g) * 0.1
        if ties:
            params["correction_bias"] = params["correction_bias"][: E // 2].repeat(2)
    if ties and kind == "cosine_top":   # twin columns of the similarity matrix
        params["sim_matrix"] = params["sim_matrix"][:, : E // 2].repeat(1, 2)
    elif ties:   # every expert has a twin with the same weights: equal logits, equal scores
        params["wg"] = params["wg"][: E // 2].repeat(2, 1)
        if "bias" in params:
            params["bias"] = params["bias"][: E // 2].repeat(2)
    return spec, params, g


def _pair(spec, params, x, E, normalize=True, alignment=1):
    ref, ref_out = route(params, x, spec, num_experts=E, normalize=normalize, alignment=alignment)
    got = route_native(params, x, spec, num_experts=E, normalize=normalize, alignment=alignment, fraction=True)
    assert got is not None, "route_native did not run"
    return ref, ref_out, got


def _assert_same(ref, ref_out, got):
    routing, out, loss, rows = got
    for name in ("expert_ids", "slots", "counts"):
        assert torch.equal(getattr(routing, name), getattr(ref, name)), name
    assert routing.weights.dtype == ref.weights.dtype
    assert torch.equal(routing.weights, ref.weights), (routing.weights - ref.weights).abs().max()
    assert routing.capacity == ref.capacity
    assert torch.equal(out.logits, ref_out.logits) and torch.equal(out.scores, ref_out.scores)
    # the plan's rows, taken from the native call, against the walk over the torch routing
    p = _plan.make_plan(routing, needs_grad=False, dtype=torch.float32, rows=rows)
    q = _plan.make_plan(ref, needs_grad=False, dtype=torch.float32)
    assert p.tokens is rows.tokens   # the plan took the native rows rather than walking the routing
    assert p.bounds == q.bounds and torch.equal(p.offsets, q.offsets)
    assert torch.equal(p.tokens, q.tokens) and torch.equal(p.pairs, q.pairs) and int(p.dropped) == int(q.dropped)
    assert p.phase == q.phase
    assert torch.equal(p.row_weights(routing.weights), q.row_weights(ref.weights))
    if rows.row_gates is not None:
        assert torch.equal(rows.row_gates, q.row_weights(ref.weights))
    # the GShard loss (route_native asked for it): wherever the scores are float32, bit for bit
    assert (loss is None) == (out.scores.dtype != torch.float32)
    if loss is not None:
        assert loss.dtype == torch.float32 and loss.dim() == 0
        assert torch.equal(loss, gshard_loss(ref_out.scores, ref.expert_ids[0]))


CASES = [("top", {}), ("top", {"score_fn": "sigmoid"}), ("cosine_top", {}), ("qwen", {}), ("mixtral", {}),
         ("gpt_oss", {}), ("deepseek", {}), ("deepseek", {"n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5})]


@pytest.mark.parametrize("kind,kw", CASES, ids=[c[0] + "-" + "-".join(map(str, c[1].values())) for c in CASES])
@pytest.mark.parametrize("cf", [0.0, 1.25, -1.0])
def test_native_route_equals_torch_route(kind, kw, cf):
    E = 16
    for T in (1, 3, 16, 64):
        for k in (1, 2, 6):
            for ties in (False, True):
                spec, params, g = _gate(kind, k, E, cf, ties=ties, seed=T * 10 + k, **kw)
                x = torch.randn(T, M, generator=g)
                if ties:   # integer logits too: equal scores across experts of one token
                    x = x.round()
                with torch.no_grad():
                    _assert_same(*_pair(spec, params, x, E))


@pytest.mark.parametrize("kind", ["top", "qwen", "mixtral", "deepseek"])
def test_native_route_unnormalised_and_wide_k(kind):
    # k past the four running sums (8 <= k < 16 adds in torch's vector order), E where top-k is a
    # partial sort (k * 64 <= E) and where it is nth_element, normalize off
    for E, k, T in ((64, 1, 5), (128, 2, 9), (64, 8, 16), (32, 10, 7), (64, 15, 3)):
        for normalize in (True, False):
            for ties in (False, True):
                spec, params, g = _gate(kind, k, E, 0.0, ties=ties, seed=E + k)
                x = torch.randn(T, M, generator=g)
                x = x.round() if ties else x
                with torch.no_grad():
                    _assert_same(*_pair(spec, params, x, E, normalize=normalize))


@pytest.mark.parametrize("kind", ["qwen", "gpt_oss", "mixtral", "deepseek"])
def test_native_route_bfloat16(kind):
    # half-precision logits: gpt_oss selects on bf16 logits (many ties), qwen casts its gates to bf16
    for T, k in ((1, 4), (16, 2), (64, 6)):
        spec, params, g = _gate(kind, k, 32, 0.0, dtype=torch.bfloat16, seed=T)
        x = torch.randn(T, M, generator=g).to(torch.bfloat16)
        with torch.no_grad():
            _assert_same(*_pair(spec, params, x, 32))


def test_native_route_alignment_and_drops():
    spec, params, g = _gate("top", 2, 8, 1.25)
    x = torch.randn(16, M, generator=g)
    with torch.no_grad():
        ref, ref_out, got = _pair(spec, params, x, 8, alignment=4)
        _assert_same(ref, ref_out, got)
        spec0 = dataclasses.replace(spec, capacity_factor=0.0)
        _assert_same(*_pair(spec0, params, x, 8, alignment=300))
    assert int(ref.num_dropped()) > 0   # the padded capacity drops pairs here: the rows skip them


def test_native_route_topk_ties_as_torch():
    # the selection alone on rows of few distinct values, against torch.topk's indices and order
    g = torch.Generator().manual_seed(3)
    for E, k in ((64, 1), (128, 2), (256, 4), (64, 6), (16, 15)):
        for dt in (torch.float32, torch.bfloat16):
            v = torch.randint(0, 3, (40, E), generator=g).to(dt)
            res = _slots.route_rows(v, v, k, _slots.ROUTE_RAW, dt, True, -1, -1, 1, False)
            vals, ids = torch.topk(v, k, dim=-1)
            assert res[0] == 0 and torch.equal(res[1], ids.t()) and torch.equal(res[2], vals)


def test_native_route_sums_as_torch():
    # the normalisation's sum in torch.sum's order for every k it takes (exact division after it)
    g = torch.Generator().manual_seed(4)
    top = _slots.sum_orders()[0]
    for k in range(1, top + 1):
        s = torch.rand(200, 32, generator=g) * torch.exp(torch.randn(200, 32, generator=g) * 4)
        res = _slots.route_rows(s, s, k, _slots.ROUTE_SUM, torch.float32, False, -1, -1, 1, False)
        vals = torch.topk(s, k, dim=-1)[0]
        assert torch.equal(res[2], (vals / vals.sum(dim=-1, keepdim=True)).t()), k


def test_native_route_layer_equals_replayed_torch_routing():
    # the whole layer: moe() on the native route against moe() replaying the torch route's routing
    spec = fmoe.MoESpec(model_dim=M, num_experts=8, gate=GateSpec(k=2, capacity_factor=0.0),
                        experts=fmoe.ExpertSpec(type="swiglu", hidden_size=16))
    params = fmoe.init_params(spec, generator=torch.Generator().manual_seed(5))
    for T in (1, 4, 16):
        x = torch.randn(T, M, generator=torch.Generator().manual_seed(T))
        with torch.no_grad():
            y, aux = fmoe.moe(params, x, spec)
            ref, ref_out = route(params["gate"], x, spec.gate, num_experts=8)
            y_ref, _ = fmoe.moe(params, x, spec, routing=ref)
        assert torch.equal(y, y_ref)
        assert torch.equal(aux.l_aux, gshard_loss(ref_out.scores, ref.expert_ids[0]))
        assert torch.equal(aux.routing.expert_ids, ref.expert_ids) and torch.equal(aux.routing.weights, ref.weights)
        assert int(aux.dropped) == 0 and aux.capacity == ref.capacity


def test_native_route_nan_logits_raise_torch_error():
    for kind in ("top", "qwen", "gpt_oss", "deepseek"):
        spec, params, g = _gate(kind, 2, 8, 0.0)
        x = torch.randn(3, M, generator=g)
        x[1, 4] = float("nan")
        with torch.no_grad(), pytest.raises(ValueError, match=r"router logits \[T, E\] holds non-finite values \(NaN\) "
                                            r"in 1 of 3 rows"):
            route_native(params, x, spec, num_experts=8, normalize=True, alignment=1, fraction=False)


def test_native_route_applies_only_to_small_eager_no_grad_calls():
    spec, params, g = _gate("top", 2, 8, 0.0)
    x = torch.randn(4, M, generator=g)
    assert native_applies(params, x, spec, False)   # no parameter requires grad
    params["wg"].requires_grad_()
    assert not native_applies(params, x, spec, False)
    with torch.no_grad():
        assert native_applies(params, x, spec, False)
        assert not native_applies(params, torch.randn(65, M), spec, False)   # past NATIVE_MAX_TOKENS
        assert not native_applies(params, x, GateSpec(type="sinkhorn", k=2), False)
        assert not native_applies(params, x, GateSpec(k=2, gate_noise=1.0), True)
        assert torch.func.vmap(lambda xx: torch.tensor(native_applies(params, xx, spec, False)))(x[None]).item() is False


def test_native_route_steps_aside_on_a_torch_whose_topk_it_does_not_repeat(monkeypatch):
    # another torch version may order ties otherwise: the torch ops run, with the same layer output
    spec = fmoe.MoESpec(model_dim=M, num_experts=8, gate=GateSpec(k=2, capacity_factor=0.0),
                        experts=fmoe.ExpertSpec(type="swiglu", hidden_size=16))
    params = fmoe.init_params(spec, generator=torch.Generator().manual_seed(6))
    x = torch.randn(4, M, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        y_native, _ = fmoe.moe(params, x, spec)
        monkeypatch.setattr(_slots, "TOPK_AS_TORCH", False)
        assert route_native(params["gate"], x, spec.gate, num_experts=8, normalize=True, alignment=1,
                            fraction=False) is None
        y_torch, _ = fmoe.moe(params, x, spec)
    assert torch.equal(y_native, y_torch)


# --------------------------------------------------------------------------- the GShard loss in the native call

LOSS_T = (1, 2, 3, 7, 16, 33, 64)
LOSS_E = (8, 60, 64, 128, 257)


def _loss_cases(T, E, g):
    """(name, float32 scores [T, E], fraction [E]): softmax scores and adversarial ones."""
    ids = torch.randint(0, E, (T,), generator=g)
    frac = torch.bincount(ids, minlength=E).float() / T
    wide = torch.rand(E, generator=g) * torch.exp2(torch.randint(-20, 21, (E,), generator=g).float())
    yield "softmax", torch.softmax(torch.randn(T, E, generator=g) * 3, dim=-1), frac
    yield "equal", torch.randint(0, 3, (T, E), generator=g).float() / 4, frac   # many equal values
    yield "uniform", torch.full((T, E), 1.0 / E), frac
    yield "tiny", torch.rand(T, E, generator=g) * 2.0 ** -100, wide
    yield "huge", torch.rand(T, E, generator=g) * 2.0 ** 100, frac
    yield "mixed", torch.rand(T, E, generator=g) * torch.exp2(torch.randint(-40, 41, (T, E), generator=g).float()), wide
    signs = torch.randint(0, 2, (T, E), generator=g).float() * 2 - 1
    yield "signed", signs * torch.rand(T, E, generator=g) * torch.exp2(torch.randint(-12, 13, (T, E), generator=g).float()), wide


def _check_losses(shapes_t=LOSS_T, shapes_e=LOSS_E):
    ext = _slots.extension()
    g = torch.Generator().manual_seed(11)
    for T in shapes_t:
        for E in shapes_e:
            w = _slots.loss_width(T, E)
            assert w in _slots._LOSS_WIDTHS, (T, E, w)
            for name, s, f in _loss_cases(T, E, g):
                ref = gshard_loss(s, None, fraction=f)
                got = ext.gshard_loss(s, f, w)
                assert got.dtype == torch.float32 and got.dim() == 0
                assert torch.equal(got, ref), (T, E, name, got.item(), ref.item())
            # route_rows' loss from its own slot-0 counts, against the torch ops on its ids
            s = torch.softmax(torch.randn(T, E, generator=g), dim=-1)
            res = _slots.route_rows(s, s, 2, _slots.ROUTE_SUM, torch.float32, False, -1, -1, 1, True,
                                    loss_scores=s, loss_width=w)
            assert res[0] == 0 and torch.equal(res[12], gshard_loss(s, res[1][0])), (T, E)


def test_native_loss_equals_torch_ops():
    _check_losses()


@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_native_loss_equals_torch_ops_on_other_cpu_capabilities(capability):
    # torch picks its reduction kernels by the CPU capability: the orders loss_width finds there
    import os
    import subprocess
    import sys
    code = ("import torch, tests.test_native_route as t; "
            "assert torch.backends.cpu.get_cpu_capability() == %r, torch.backends.cpu.get_cpu_capability(); "
            "t._check_losses(); print('ok')" % capability.upper())
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


def test_loss_width_refuses_an_order_torch_does_not_use(monkeypatch):
    # only the width whose orders torch's ops give passes the check; with it struck out, none does
    T, E = 33, 60
    w = _slots.loss_width(T, E)
    g = torch.Generator().manual_seed(12)
    s, f = torch.rand(T, E, generator=g), torch.rand(E, generator=g)
    other = [v for v in _slots._LOSS_WIDTHS if v != w]
    assert other and not torch.equal(_slots.extension().mean0(s, other[0]), s.mean(0))   # the orders differ
    monkeypatch.setattr(_slots, "_LOSS_WIDTHS", tuple(other))
    assert _slots._check_loss_width(T, E) == 0
    assert _slots._check_loss_width(1, 1) == 0 and _slots._check_loss_width(64, 512) == 0   # E < 2, past one thread


def test_native_route_loss_falls_back_to_torch_ops(monkeypatch):
    # where no width is vouched for, route_native's loss comes from the torch ops on its counts
    from fmoe import routers
    spec, params, g = _gate("top", 2, 16, 0.0)
    x = torch.randn(5, M, generator=g)
    monkeypatch.setattr(_slots, "_LOSS_WIDTH", {(5, 16): 0})
    monkeypatch.setattr(routers, "_NATIVE_STATICS", {})
    with torch.no_grad():
        ref, ref_out, got = _pair(spec, params, x, 16)
        _assert_same(ref, ref_out, got)
    # (the statics' ninth entry is the loss width)
    assert routers._NATIVE_STATICS and all(st[8] == 0 for _, d in routers._NATIVE_STATICS.values() for st in d.values())


def test_native_route_checks_params_on_every_call():
    # the statics are cached per (spec, E, x's shape): parameters are checked on every call
    for kind, bad, msg in (("top", {"wg": torch.zeros(16, M + 1)}, r"gate.wg must be \[E, M\] = \[16, 24\]"),
                           ("qwen", {}, r"qwen router needs 'wg'"),
                           ("gpt_oss", "nobias", r"gpt_oss router needs 'bias' \[E\]"),
                           ("deepseek", "badbias", r"gate.correction_bias must be \[E\] = \[16\]")):
        spec, params, g = _gate(kind, 2, 16, 0.0)
        x = torch.randn(3, M, generator=g)
        with torch.no_grad():
            assert route_native(params, x, spec, num_experts=16, normalize=True, alignment=1, fraction=True)
            if bad == "nobias":
                bad = {"wg": params["wg"]}
            elif bad == "badbias":
                bad = {"wg": params["wg"], "correction_bias": torch.zeros(15)}
            with pytest.raises(ValueError, match=msg):
                route_native(bad, x, spec, num_experts=16, normalize=True, alignment=1, fraction=True)
            with pytest.raises(ValueError, match="router params must be a dict"):
                route_native([params], x, spec, num_experts=16, normalize=True, alignment=1, fraction=True)


def test_native_route_linear_gate_in_one_call_or_cast():
    # 'top' whose gate weight has x's dtype runs the gate in the native call (route_gate); a cast (fp32_gate
    # over bf16 tokens, or a weight of another dtype) runs linear_gate's ops first: the same values either way
    for fp32_gate, wdt, xdt, k in ((False, torch.bfloat16, torch.bfloat16, 1), (True, torch.float32, torch.bfloat16, 2),
                                   (False, torch.float32, torch.float32, 2), (True, torch.bfloat16, torch.float32, 2)):
        spec = GateSpec(type="top", k=k, capacity_factor=0.0, fp32_gate=fp32_gate)
        g = torch.Generator().manual_seed(k)
        params = init_router(spec, 16, M, generator=g, dtype=wdt)
        x = torch.randn(5, M, generator=g).to(xdt)
        with torch.no_grad():
            _assert_same(*_pair(spec, params, x, 16))


def test_loss_width_check_ignores_the_callers_defaults():
    # the check's own tensors are float32 CPU whatever default dtype or device the calling code has set
    prev = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        with torch.device("meta"):
            assert _slots._check_loss_width(5, 64) == _slots.loss_width(5, 64) != 0
    finally:
        torch.set_default_dtype(prev)


@pytest.mark.parametrize("kind", ["top", "qwen"])
def test_native_route_capacity_errors_are_the_torch_paths(kind):
    # a capped capacity of 0 (route_rows' status) and an alignment past the capacity bound (checked after
    # the call): route_native raises what route raises ('top' through route_gate, qwen through route_rows)
    for cf, alignment in ((-0.01, 1), (0.0, 10 ** 6)):
        spec, params, g = _gate(kind, 2, 16, cf)
        x = torch.randn(5, M, generator=g)
        with torch.no_grad():
            with pytest.raises(ValueError) as ref:
                route(params, x, spec, num_experts=16, alignment=alignment)
            with pytest.raises(ValueError) as got:
                route_native(params, x, spec, num_experts=16, normalize=True, alignment=alignment, fraction=True)
        assert str(got.value) == str(ref.value) and ("capacity is 0" in str(ref.value) or "bound" in str(ref.value))
