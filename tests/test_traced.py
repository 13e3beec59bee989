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


def test_opcheck_of_the_op():
    spec = _spec("ffn", has_fc1_bias=True, has_fc2_bias=True)
    p = _params(spec, torch.float32)
    x = torch.randn(12, M, generator=torch.Generator().manual_seed(2))
    _, aux = fmoe.moe(p, x, spec)
    r, w = aux.routing, expert_form(spec.experts, p["experts"])
    f = w["form"]
    args = (x.requires_grad_(), r.weights.detach().requires_grad_(), r.expert_ids, r.slots, r.counts, r.capacity,
            [w["w_in"][0].detach().requires_grad_()], w["w_out"].detach().requires_grad_(),
            w["b_in"].detach().requires_grad_(), w["b_out"].detach().requires_grad_(), f.form, f.in_transposed,
            f.out_transposed, "relu", f.alpha, f.limit, "fmoe", True, True)
    torch.library.opcheck(torch.ops.fmoe.expert_rows.default, args)


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
    """fmoe.engine.traced.door: 'rows' in eager mode, 'compiled' under torch.compile, 'layout' for what
    only the staged kernel takes (and under a torch.func transform)."""
    from fmoe.engine.traced import door
    spec = _spec("ffn")
    w = expert_form(spec.experts, _params(spec)["experts"])
    x = torch.randn(6, M, dtype=torch.float64)
    ts = (x, *w["w_in"], w["w_out"])
    assert door(w["form"], ts) == "rows"
    assert door(w["form"], ts, plan="layout") == door(w["form"], ts, prescore=True) == "layout"
    assert door(w["form"], ts, order="grouped") == "layout"
    assert torch.func.vmap(lambda t: t + (door(w["form"], (t, *ts[1:])) == "layout"))(x).equal(x + 1)
    seen = torch.compile(lambda t: t + (1.0 if door(w["form"], (t, *ts[1:])) == "compiled" else 0.0),
                         fullgraph=True)
    torch._dynamo.reset()
    assert seen(x).equal(x + 1)
    odd = dataclasses.replace(w["form"], activation=lambda z: z.relu() * 2)   # no known name: no custom op
    torch._dynamo.reset()
    assert torch.compile(lambda t: t + (door(odd, (t, *ts[1:])) == "layout"), fullgraph=True)(x).equal(x + 1)
