"""The rows plan under torch.compile (fmoe.engine.traced): one custom op with a fake kernel and
autograd, the same kernels as eager mode.

Checked: torch.library.opcheck of the op (fake shapes, schema, autograd registration); a
compiled training step of every built-in kind equals eager mode (forward and every gradient, both
orders, biases, save='recompute', transposed weight views); the compiled call runs the op
(not the layout plan's staged kernel); what the op does not take falls back with equal results.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import fmoe
from fmoe.engine import traced
from fmoe.experts import expert_form

M, E = 16, 4


def _spec(kind, cf=1.25, k=2, **kw):
    ex = {k_: kw.pop(k_) for k_ in ("activation", "has_fc1_bias", "has_fc2_bias") if k_ in kw}
    # fp64 gates: inductor may fuse an fp32 gate's softmax in another order than eager (1e-7)
    return fmoe.MoESpec(model_dim=M, num_experts=E, gate=fmoe.GateSpec(k=k, capacity_factor=cf, fp32_gate=False),
                        experts=fmoe.ExpertSpec(type=kind, hidden_size=8, **ex), **kw)


def _params(spec, dtype=torch.float64):
    p = fmoe.init_params(spec, generator=torch.Generator().manual_seed(0), dtype=dtype)
    g = torch.Generator().manual_seed(5)
    for key, v in p["experts"].items():   # non-zero biases, so their gradients are tested
        if key.endswith(("_b", "_bias")) and v is not None:
            p["experts"][key] = torch.randn(v.shape, generator=g, dtype=v.dtype)
    return p


def _grads(fn, p, x):
    leaves = [v for d in p.values() for v in d.values() if v is not None]
    leaves = [t.detach().requires_grad_(True) for t in leaves]
    it = iter(leaves)
    q = {g: {k: (next(it) if v is not None else None) for k, v in d.items()} for g, d in p.items()}
    xx = x.detach().requires_grad_(True)
    loss = fn(q, xx)
    return (loss.detach(), *torch.autograd.grad(loss, [xx, *leaves]))


def _step(spec):
    def step(p, x):
        y, aux = fmoe.moe(p, x, spec)
        return (y * torch.linspace(-1, 1, y.shape[-1], dtype=y.dtype)).square().sum() + aux.l_aux
    return step


@pytest.fixture
def op_calls(monkeypatch):
    calls = []
    real = traced.run
    monkeypatch.setattr(traced, "run", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


CASES = [("ffn", {}), ("ffn", {"activation": F.gelu, "cf": 0.0}), ("gated_ffn", {}), ("swiglu", {"cf": 0.0}),
         ("gpt_oss", {}), ("ffn", {"combine": "eager"}), ("swiglu", {"save": "recompute", "cf": -1.0}),
         ("ffn", {"has_fc1_bias": True, "has_fc2_bias": True})]


@pytest.mark.parametrize("kind,kw", CASES, ids=[f"{k}-{'-'.join(map(str, v.values())) or 'default'}" for k, v in CASES])
def test_compiled_step_equals_eager(kind, kw, op_calls):
    kw = dict(kw)
    cf = kw.pop("cf", 1.25)
    spec = _spec(kind, cf, **kw)
    p = _params(spec)
    x = torch.randn(24, M, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    torch._dynamo.reset()
    got = _grads(torch.compile(_step(spec), fullgraph=True), p, x)
    assert op_calls, "the compiled call did not take the traced op"
    want = _grads(_step(spec), p, x)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def _op_case():
    """(x, routing, expert form dict, form) of one float32 ffn call with both biases."""
    spec = _spec("ffn", has_fc1_bias=True, has_fc2_bias=True)
    p = _params(spec, torch.float32)
    x = torch.randn(12, M, generator=torch.Generator().manual_seed(2))
    _, aux = fmoe.moe(p, x, spec)
    w = expert_form(spec.experts, p["experts"])
    return x, aux.routing, w, w["form"]


def test_opcheck_of_the_op():
    x, r, w, f = _op_case()
    args = (x.requires_grad_(), r.weights.detach().requires_grad_(), r.expert_ids, r.slots, r.counts, r.capacity,
            [w["w_in"][0].detach().requires_grad_()], w["w_out"].detach().requires_grad_(),
            w["b_in"].detach().requires_grad_(), w["b_out"].detach().requires_grad_(), f.form, f.in_transposed,
            f.out_transposed, "relu", f.alpha, f.limit, "fmoe", True, True)
    torch.library.opcheck(torch.ops.fmoe.expert_rows.default, args)


def test_backward_fake_strides_are_the_real_ones():
    """The backward op's weight gradients come out as the stored weights' orientation flipped back
    (views of transposed storage); its fake kernel gives the same strides, which a compiled graph
    checks the real outputs against (a plain weight and a transposed view of each)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    x, r, w, f = _op_case()
    flipped = lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)  # noqa: E731  same values, other storage
    for view in (False, True):
        w_in = [flipped(w["w_in"][0]) if view else w["w_in"][0]]
        w_out = flipped(w["w_out"]) if view else w["w_out"]
        args = (torch.randn(12, M), x, r.weights, r.expert_ids, r.slots, r.counts, r.capacity, w_in, w_out,
                w["b_in"], w["b_out"], [], f.form, f.in_transposed, f.out_transposed, "relu", f.alpha, f.limit,
                "fmoe", [True] * 6)
        real = torch.ops.fmoe.expert_rows_backward(*args)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = torch.ops.fmoe.expert_rows_backward(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else
                                                         [mode.from_tensor(t) for t in a] if isinstance(a, list)
                                                         and a and isinstance(a[0], torch.Tensor) else a
                                                         for a in args))
        assert [(tuple(t.shape), t.stride()) for t in fake] == [(tuple(t.shape), t.stride()) for t in real]
        assert (real[3].stride() != w["w_out"].stride()) == view   # the view case does flip


def test_fallbacks_equal_eager(op_calls):
    """What the op does not take runs the layout plan under compile, with the same numbers: an
    activation that is no known function, and a torch.func transform around the step."""
    spec = _spec("ffn", activation=lambda z: F.relu(z) * 0.5)
    p = _params(spec)
    x = torch.randn(20, M, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    torch._dynamo.reset()
    got = _grads(torch.compile(_step(spec), fullgraph=True), p, x)
    want = _grads(_step(spec), p, x)
    assert not op_calls
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    spec = _spec("ffn")
    wgs = torch.randn(3, E, M, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    one = lambda wg: fmoe.moe({"gate": {"wg": wg}, "experts": p["experts"]}, x, spec)[0]  # noqa: E731
    torch._dynamo.reset()
    ys = torch.compile(torch.func.vmap(one), fullgraph=True)(wgs)
    assert not op_calls
    for i in range(3):
        torch.testing.assert_close(ys[i], one(wgs[i]), rtol=1e-10, atol=1e-12)


def test_transposed_weight_views_compile(op_calls):
    """fmoe.nn.MoELayer holds gated weights out x in and hands x @ W views: the op reads the
    storage as it lies and returns each gradient in its parameter's shape."""
    from fmoe.nn import MoELayer
    layer = MoELayer({"type": "top", "k": 2}, M, {"type": "llama_ffn", "num_experts_per_device": E,
                                                  "hidden_size_per_expert": 8}, dtype=torch.float64,
                     comm=fmoe.comm.LocalComm())
    x = torch.randn(20, M, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)
    out = []
    for f in (compiled, layer):
        layer.zero_grad()
        f(x).square().sum().backward()
        out.append([q.grad.clone() for q in layer.parameters()])
    assert op_calls
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_the_door_is_decided_in_one_place():
    """fmoe.engine.traced.door: 'rows' in eager mode, 'traced' under torch.compile and under vmap /
    grad transforms, 'layout' for what only the staged kernel takes (forward-mode AD among it)."""
    from fmoe.engine.traced import door
    spec = _spec("ffn")
    w = expert_form(spec.experts, _params(spec)["experts"])
    x = torch.randn(6, M, dtype=torch.float64)
    ts = (x, *w["w_in"], w["w_out"])
    assert door(w["form"], ts) == "rows"
    assert door(w["form"], ts, plan="layout") == door(w["form"], ts, prescore=True) == "layout"
    assert door(w["form"], ts, order="grouped") == "layout"
    assert torch.func.vmap(lambda t: t + (door(w["form"], (t, *ts[1:])) == "traced"))(x).equal(x + 1)
    grad_door = torch.func.grad(lambda t: t.sum() * (door(w["form"], (t, *ts[1:])) == "traced"))(x)
    assert grad_door.equal(torch.ones_like(x))
    tangent = torch.func.jvp(lambda t: t * (door(w["form"], (t, *ts[1:])) == "layout"), (x,), (x,))[1]
    assert tangent.equal(x)
    seen = torch.compile(lambda t: t + (1.0 if door(w["form"], (t, *ts[1:])) == "traced" else 0.0),
                         fullgraph=True)
    torch._dynamo.reset()
    assert seen(x).equal(x + 1)
    odd = dataclasses.replace(w["form"], activation=lambda z: z.relu() * 2)   # no known name: no custom op
    torch._dynamo.reset()
    assert torch.compile(lambda t: t + (door(odd, (t, *ts[1:])) == "layout"), fullgraph=True)(x).equal(x + 1)


# --------------------------------------------------------------------------- torch.func on the op

def _per_example_grads_equal_the_loop(loss, p, xs):
    """vmap(grad) over xs (parameters shared) equals one torch.func.grad per example."""
    per = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(p, xs)
    for i, x in enumerate(xs):
        single = torch.func.grad(loss)(p, x)
        for part in single:
            for key, v in single[part].items():
                if v is not None:
                    torch.testing.assert_close(per[part][key][i], v, rtol=1e-12, atol=1e-13)


SWEEPS = [("ffn", 1.25, {"has_fc1_bias": True, "has_fc2_bias": True}), ("swiglu", 0.0, {}), ("gpt_oss", -1.0, {}),
          ("gated_ffn", 0.5, {"combine": "eager"})]


@pytest.mark.parametrize("kind,cf,kw", SWEEPS, ids=[f"{k}-{cf}" for k, cf, _ in SWEEPS])
def test_vmapped_gate_sweep_runs_the_op_and_equals_the_loop(kind, cf, kw, op_calls):
    """A sweep of gate settings (the ablation use): one folded call, each (token, expert) pair
    any setting keeps multiplied once, each setting's output its own eager call's. Capacity
    dropped, dropless and negative (Tutel's bounded dropless) capacity; biases; both orders."""
    spec = _spec(kind, cf, **kw)
    p = _params(spec)
    x = torch.randn(24, M, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    wgs = torch.randn(5, E, M, generator=torch.Generator().manual_seed(8), dtype=torch.float64)

    def one(wg):
        y, aux = fmoe.moe({"gate": {"wg": wg}, "experts": p["experts"]}, x, spec)
        return y, aux.dropped

    ys, dropped = torch.func.vmap(one)(wgs)
    assert op_calls, "the vmapped call did not take the traced op"
    if cf > 0 and cf < 1:
        assert int(dropped.sum()) > 0   # the capacity drops pairs, which the fold must drop too
    for i, wg in enumerate(wgs):
        y, d = one(wg)
        torch.testing.assert_close(ys[i], y, rtol=0, atol=1e-14)
        assert int(dropped[i]) == int(d)


def test_vmapped_fold_in_token_blocks_equals_the_loop(monkeypatch):
    """The sweep's fold runs its rows in blocks of key tokens (traced._BLOCK_BYTES of transient
    buffers each): at one token a block, on every fold layout (shared x, batched x, batched
    expert weights, both), blocks with no kept pair, and grad of a vmapped sweep through the
    blocks, each element's output equals its own call's, as in one block."""
    blocks = []
    real = traced.plan_from_bounds
    monkeypatch.setattr(traced, "plan_from_bounds", lambda *a, **k: blocks.append(1) or real(*a, **k))
    monkeypatch.setattr(traced, "_BLOCK_BYTES", 1)   # every key token its own block
    spec = _spec("gated_ffn", 0.25, k=1, has_fc1_bias=True, has_fc2_bias=True)
    p = _params(spec)
    x = torch.randn(24, M, generator=torch.Generator().manual_seed(21), dtype=torch.float64)
    wgs = torch.randn(2, E, M, generator=torch.Generator().manual_seed(22), dtype=torch.float64)
    one = lambda wg: fmoe.moe({"gate": {"wg": wg}, "experts": p["experts"]}, x, spec)[0]  # noqa: E731
    ys = torch.func.vmap(one)(wgs)
    # capacity 1/4 keeps a quarter of each setting's tokens: some token is dropped by both, an empty block
    assert (ys == 0).all(-1).all(0).any() and len(blocks) > 1
    for i, wg in enumerate(wgs):
        torch.testing.assert_close(ys[i], one(wg), rtol=0, atol=1e-14)
    spec = _spec("swiglu", 1.0)
    p = _params(spec)
    xs = torch.randn(3, 20, M, generator=torch.Generator().manual_seed(23), dtype=torch.float64)
    f = lambda x_: fmoe.moe(p, x_, spec)[0]  # noqa: E731
    torch.testing.assert_close(torch.func.vmap(f)(xs), torch.stack([f(x_) for x_ in xs]), rtol=0, atol=1e-14)
    ensembles = [{kk: v * (1 + 0.25 * i) for kk, v in p["experts"].items()} for i in range(3)]
    stacked = {kk: torch.stack([q[kk] for q in ensembles]) for kk in ensembles[0]}
    g = lambda ex, x_: fmoe.moe({"gate": p["gate"], "experts": ex}, x_, spec)[0]  # noqa: E731
    for i, y in enumerate(torch.func.vmap(g, in_dims=(0, None))(stacked, xs[0])):
        torch.testing.assert_close(y, g(ensembles[i], xs[0]), rtol=0, atol=1e-14)
    for i, y in enumerate(torch.func.vmap(g)(stacked, xs)):
        torch.testing.assert_close(y, g(ensembles[i], xs[i]), rtol=0, atol=1e-14)
    wgs = torch.randn(3, E, M, generator=torch.Generator().manual_seed(24), dtype=torch.float64)

    def swept(ex):
        h = lambda wg: fmoe.moe({"gate": {"wg": wg}, "experts": ex}, xs[0], spec)[0].square().sum()  # noqa: E731
        return torch.func.vmap(h)(wgs).sum()

    def looped(ex):
        return sum(fmoe.moe({"gate": {"wg": wg}, "experts": ex}, xs[0], spec)[0].square().sum() for wg in wgs)

    got, want = torch.func.grad(swept)(p["experts"]), torch.func.grad(looped)(p["experts"])
    for kk in want:
        torch.testing.assert_close(got[kk], want[kk], rtol=1e-10, atol=1e-12)


def test_vmap_over_tokens_and_over_expert_weights_equals_the_loop(op_calls):
    """Batched tokens fold into more tokens, batched expert weights (an ensemble) into more
    experts: one op call either way, equal to the loop."""
    spec = _spec("swiglu", 1.0)
    p = _params(spec)
    xs = torch.randn(3, 20, M, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    f = lambda x: fmoe.moe(p, x, spec)[0]  # noqa: E731
    torch.testing.assert_close(torch.func.vmap(f)(xs), torch.stack([f(x) for x in xs]), rtol=0, atol=1e-14)
    ensembles = [_params(spec) for _ in range(3)]
    for i, q in enumerate(ensembles):
        q["experts"] = {kk: v * (1 + 0.25 * i) for kk, v in q["experts"].items()}
    stacked = {kk: torch.stack([q["experts"][kk] for q in ensembles]) for kk in ensembles[0]["experts"]}
    g = lambda ex: fmoe.moe({"gate": p["gate"], "experts": ex}, xs[0], spec)[0]  # noqa: E731
    got = torch.func.vmap(g)(stacked)
    for i, q in enumerate(ensembles):
        torch.testing.assert_close(got[i], g(q["experts"]), rtol=0, atol=1e-14)
    assert len(op_calls) >= 2


def test_vmap_over_tokens_and_expert_weights_at_once_and_all_pairs_dropped():
    """x and the expert weights batched together (each element's pairs its own: no key of one
    element is another's), and a sweep in which no element keeps any pair (every token 0)."""
    spec = _spec("gated_ffn", 1.0, has_fc1_bias=True, has_fc2_bias=True)
    ensembles = [_params(spec) for _ in range(3)]
    for i, q in enumerate(ensembles):
        q["experts"] = {kk: v * (1 + 0.25 * i) for kk, v in q["experts"].items()}
    stacked = {kk: torch.stack([q["experts"][kk] for q in ensembles]) for kk in ensembles[0]["experts"]}
    xs = torch.randn(3, 20, M, generator=torch.Generator().manual_seed(19), dtype=torch.float64)
    g = lambda ex, x: fmoe.moe({"gate": ensembles[0]["gate"], "experts": ex}, x, spec)[0]  # noqa: E731
    got = torch.func.vmap(g)(stacked, xs)
    for i, q in enumerate(ensembles):
        torch.testing.assert_close(got[i], g(q["experts"], xs[i]), rtol=0, atol=1e-14)
    w = expert_form(spec.experts, ensembles[0]["experts"])
    r = fmoe.moe(ensembles[0], xs[0], spec)[1].routing
    masked = lambda gates: traced.run(w["form"], xs[0], fmoe.Routing(  # noqa: E731
        torch.full_like(r.expert_ids, -1), r.slots, gates, torch.zeros_like(r.counts), r.capacity, r.num_experts),
        w["w_in"], w["w_out"], b_in=w["b_in"], b_out=w["b_out"])
    y = torch.func.vmap(masked)(torch.stack([r.weights, 2 * r.weights]))
    assert y.shape == (2, 20, M) and not y.any()


@pytest.mark.parametrize("kind", ["ffn", "gpt_oss"])
def test_grad_and_per_example_grads_run_the_op(kind, op_calls):
    """torch.func.grad through the op's Function front equals plain autograd in eager mode; vmap
    of grad (per-example gradients) equals the loop."""
    spec = _spec(kind, 1.25, **({"has_fc1_bias": True, "has_fc2_bias": True} if kind == "ffn" else {}))
    p = _params(spec)
    xs = torch.randn(3, 16, M, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    loss = _step(spec)
    g = torch.func.grad(loss, argnums=(0, 1))(p, xs[0])
    assert op_calls
    want = _grads(loss, p, xs[0])
    got = [g[1], *(v for d in g[0].values() for v in d.values() if v is not None)]
    for a, b in zip(got, want[1:]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
    _per_example_grads_equal_the_loop(loss, p, xs)


def test_per_example_grads_with_dropped_pairs_keep_the_weights_shared(op_calls, monkeypatch):
    """vmap(grad) with shared expert weights folds the batch into more tokens over the same E
    experts (no weight copied): each element's kept pairs renumbered after the earlier elements'
    within an expert, its dropped pairs masked; each element's weight and bias gradients are its
    own (expert, element) group's. A capacity that drops pairs, biases, equal to the loop."""
    spec = _spec("ffn", 0.5, has_fc1_bias=True, has_fc2_bias=True)
    p = _params(spec)
    xs = torch.randn(3, 16, M, generator=torch.Generator().manual_seed(20), dtype=torch.float64)
    assert all(int(fmoe.moe(p, x, spec)[1].dropped) > 0 for x in xs)
    groups = []
    real = traced._per_element
    monkeypatch.setattr(traced, "_per_element", lambda *a: groups.append(a[2]) or real(*a))
    _per_example_grads_equal_the_loop(_step(spec), p, xs)
    assert op_calls and groups == [3]
    w = expert_form(spec.experts, p["experts"])
    f = w["form"]
    # expert 0's slot 0 is token 8 (element 1), its slot 1 token 0 (element 0): element 1 first
    ids, slots = torch.full((1, 16), -1), torch.zeros(1, 16, dtype=torch.int64)
    ids[0, [0, 8]], slots[0, 0] = 0, 1
    with pytest.raises(ValueError, match="element by element within each expert"):
        torch.ops.fmoe.expert_rows_backward(
            torch.ones(16, M, dtype=torch.float64), xs[0], torch.ones(1, 16, dtype=torch.float64), ids, slots,
            torch.tensor([2, 0, 0, 0]), 2, list(w["w_in"]), w["w_out"], w["b_in"], w["b_out"], [], f.form,
            f.in_transposed, f.out_transposed, "relu", f.alpha, f.limit, "fmoe", [False] * 3 + [True, False, True], 2)


def test_second_derivatives_and_bf16_under_vmap(op_calls):
    """A second grad level takes the layout plan (the op's backward is first order) and stays
    correct; bf16 under vmap runs the op once per element, bit for bit each element's call."""
    spec = _spec("ffn", 1.0)
    p = _params(spec)
    x = torch.randn(12, M, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    v = torch.randn(12, M, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    f = lambda t: fmoe.moe(p, t, spec)[0].square().sum()  # noqa: E731
    hvp = torch.func.grad(lambda t: (torch.func.grad(f)(t) * v).sum())(x)
    assert not op_calls
    xx = x.clone().requires_grad_()
    (gx,) = torch.autograd.grad(f(xx), xx, create_graph=True)
    (want,) = torch.autograd.grad((gx * v).sum(), xx)
    torch.testing.assert_close(hvp, want, rtol=1e-10, atol=1e-12)
    eps = 1e-6   # both against central differences of the first derivative
    fd = (torch.func.grad(f)(x + eps * v) - torch.func.grad(f)(x - eps * v)) / (2 * eps)
    torch.testing.assert_close(hvp, fd, rtol=1e-6, atol=1e-8)
    pb = _params(spec, torch.bfloat16)
    xs = torch.randn(3, 12, M, generator=torch.Generator().manual_seed(13)).to(torch.bfloat16)
    ys, rs = torch.func.vmap(lambda t: (lambda y, aux: (y, aux.routing))(*fmoe.moe(pb, t, spec)))(xs)
    assert op_calls
    w = expert_form(spec.experts, pb["experts"])
    for i, t in enumerate(xs):
        # the vmapped call's own routing of element i (a separate unbatched gate GEMM may round
        # otherwise on another BLAS): the same op call on the same operands as the per-element loop
        r = fmoe.Routing(rs.expert_ids[i], rs.slots[i], rs.weights[i], rs.counts[i], rs.capacity, rs.num_experts)
        y = traced.run(w["form"], t, r, w["w_in"], w["w_out"], b_in=w["b_in"], b_out=w["b_out"])
        assert torch.equal(ys[i], y)


@pytest.mark.parametrize("kind", ["ffn", "swiglu"])
def test_eager_first_derivative_with_create_graph_is_the_plain_one(kind):
    """The rows plan's create_graph backward (the reference under autograd) takes partial
    derivatives: a gate weight computed from x must not add its path to x's gradient twice."""
    spec = _spec(kind, 1.0)
    p = _params(spec)
    x = torch.randn(12, M, generator=torch.Generator().manual_seed(14), dtype=torch.float64)
    c = torch.randn(12, M, generator=torch.Generator().manual_seed(15), dtype=torch.float64)
    got = []
    for create_graph in (False, True):
        xx = x.clone().requires_grad_()
        got.append(torch.autograd.grad((fmoe.moe(p, xx, spec)[0] * c).sum(), xx, create_graph=create_graph)[0])
    torch.testing.assert_close(got[1], got[0], rtol=1e-12, atol=1e-14)


def test_jacrev_and_ensemble_gradients_through_the_op(op_calls):
    """jacrev (vjp, then vmap over cotangents: the backward op batched alone) equals the layout
    plan's Jacobian; vmap(grad) over an ensemble of expert weights (B*E experts in one call,
    each element's weight gradient its own) equals the loop."""
    spec = _spec("gpt_oss", 1.0)
    p = _params(spec)
    x = torch.randn(6, M, generator=torch.Generator().manual_seed(16), dtype=torch.float64)
    f = lambda t: fmoe.moe(p, t, spec)[0]  # noqa: E731
    jac = torch.func.jacrev(f)(x)
    assert op_calls
    lay = dataclasses.replace(spec, plan="layout")
    want = torch.func.jacrev(lambda t: fmoe.moe(p, t, lay)[0])(x)
    torch.testing.assert_close(jac, want, rtol=1e-10, atol=1e-12)
    ensembles = [_params(spec) for _ in range(3)]
    for i, q in enumerate(ensembles):
        q["experts"] = {kk: v * (1 + 0.5 * i) for kk, v in q["experts"].items()}
    stacked = {kk: torch.stack([q["experts"][kk] for q in ensembles]) for kk in ensembles[0]["experts"]}
    loss = lambda ex: fmoe.moe({"gate": p["gate"], "experts": ex}, x, spec)[0].square().sum()  # noqa: E731
    got = torch.func.vmap(torch.func.grad(loss))(stacked)
    for i, q in enumerate(ensembles):
        single = torch.func.grad(loss)(q["experts"])
        for kk, v in single.items():
            torch.testing.assert_close(got[kk][i], v, rtol=1e-12, atol=1e-13)


def test_recompute_under_vmap_of_grad_and_grad_of_a_vmapped_sweep(op_calls):
    """save='recompute' keeps no projections: vmap(grad) runs the shared-pair fold forward and the
    B*E fold backward; grad of a vmapped sweep differentiates through the fold itself (the op's
    own autograd and the weighted embedding bag). Both equal the loop."""
    spec = _spec("swiglu", 1.0, save="recompute")
    p = _params(spec)
    xs = torch.randn(3, 16, M, generator=torch.Generator().manual_seed(17), dtype=torch.float64)
    loss = _step(spec)
    _per_example_grads_equal_the_loop(loss, p, xs)
    wgs = torch.randn(4, E, M, generator=torch.Generator().manual_seed(18), dtype=torch.float64)

    def swept(ex):
        f = lambda wg: fmoe.moe({"gate": {"wg": wg}, "experts": ex}, xs[0], spec)[0].square().sum()  # noqa: E731
        return torch.func.vmap(f)(wgs).sum()

    def looped(ex):
        return sum(fmoe.moe({"gate": {"wg": wg}, "experts": ex}, xs[0], spec)[0].square().sum() for wg in wgs)

    g, want = torch.func.grad(swept)(p["experts"]), torch.func.grad(looped)(p["experts"])
    assert op_calls
    for kk in want:
        torch.testing.assert_close(g[kk], want[kk], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("form,act,parts", [("ffn", F.relu, 1), ("ffn", torch.relu, 1), ("ffn", F.silu, 1),
                                            ("ffn", F.gelu, 1), ("glu", F.silu, 1), ("glu", F.relu, 1),
                                            ("glu", F.gelu, 1), ("glu", F.silu, 2), ("glu", F.gelu, 2),
                                            ("gpt_oss", F.silu, 1)])
def test_the_in_place_elementwise_step_equals_hidden_bit_for_bit(form, act, parts):
    # the vmapped sweep's fold runs hidden_ over its dead projections (one fused z, or gate and up):
    # the same bits as hidden, written over z where the activation has an in-place twin
    from fmoe.engine.kinds import ExpertForm
    f = ExpertForm(form, True, False, activation=act)
    g = torch.Generator().manual_seed(3)
    z = [torch.randn(37, 24 if parts == 1 else 12, generator=g) * 4 for _ in range(parts)]
    want = f.hidden(*z)
    zc = [t.clone() for t in z]
    got = f.hidden_(*zc)
    assert torch.equal(got, want) and got.dtype == want.dtype
    overwritten = not torch.equal(zc[0], z[0])
    assert overwritten == (act in (F.relu, torch.relu, F.silu) and form != "gpt_oss")
