"""dispatch/combine/gate_grad and moe under autograd, torch.func and torch.compile."""
import pytest
import torch
from torch.func import grad, jacrev, jvp, vjp, vmap

import fmoe
from fmoe.ops import reference
from fmoe.routing import top_k_routing


def _routing(T=10, E=4, k=2, cf=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    scores = torch.softmax(torch.randn(T, E, generator=g, dtype=torch.float64) * 2, dim=1)
    return top_k_routing(scores, k, cf)


def _with_weights(r, w):
    return fmoe.Routing(r.expert_ids, r.slots, w, r.counts, r.capacity, r.num_experts)


def _inputs(T=10, E=4, k=2, M=3, cf=1.0, seed=0):
    r = _routing(T, E, k, cf, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(T, M, generator=g, dtype=torch.float64)
    y = torch.randn(E, r.capacity, M, generator=g, dtype=torch.float64)
    return r, x, y


def test_routing_has_drops():
    r = _routing(cf=0.5)
    assert int(r.num_dropped()) > 0


@pytest.mark.parametrize("cf", [1.0, 0.5])
def test_gradcheck_and_gradgradcheck(cf):
    r, x, y = _inputs(cf=cf)
    w = r.weights.clone().requires_grad_()
    x.requires_grad_()
    y.requires_grad_()

    def disp(x, w):
        return fmoe.dispatch(x, _with_weights(r, w), weighted=True)

    def comb(y, w):
        return fmoe.combine(y, _with_weights(r, w))

    def gg(x, y):
        return fmoe.gate_grad(x, y, r)

    for fn, args in ((disp, (x, w)), (comb, (y, w)), (gg, (x, y))):
        assert torch.autograd.gradcheck(fn, args)
        assert torch.autograd.gradgradcheck(fn, args)


def test_opcheck_each_custom_op():
    r, x, y = _inputs()
    pos = r.positions()
    R = y.shape[0] * y.shape[1]
    w = r.weights.clone().requires_grad_()
    xr = x.clone().requires_grad_()
    yr = y.reshape(R, -1).clone().requires_grad_()
    torch.library.opcheck(torch.ops.fmoe.dispatch.default, (xr, pos, w, R))
    torch.library.opcheck(torch.ops.fmoe.dispatch.default, (x, pos, None, R))
    torch.library.opcheck(torch.ops.fmoe.combine.default, (yr, pos, w))
    torch.library.opcheck(torch.ops.fmoe.combine.default, (yr, pos, None))
    torch.library.opcheck(torch.ops.fmoe.gate_grad.default, (xr, yr, pos))


def _loss(x, w, r):
    rr = _with_weights(r, w)
    d = fmoe.dispatch(x, rr, weighted=True)
    return (fmoe.combine(torch.tanh(d) * 1.5, rr) ** 2).sum()


def _finite_diff(f, args, i, eps=1e-6):
    base = [a.clone() for a in args]
    out = torch.zeros_like(base[i])
    flat = out.view(-1)
    for n in range(flat.numel()):
        plus = [a.clone() for a in base]
        minus = [a.clone() for a in base]
        plus[i].view(-1)[n] += eps
        minus[i].view(-1)[n] -= eps
        flat[n] = (f(*plus) - f(*minus)) / (2 * eps)
    return out


def test_func_grad_against_finite_differences():
    r, x, _ = _inputs()
    w = r.weights.clone()
    f = lambda x, w: _loss(x, w, r)  # noqa: E731
    gx, gw = grad(f, argnums=(0, 1))(x, w)
    torch.testing.assert_close(gx, _finite_diff(f, (x, w), 0), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(gw, _finite_diff(f, (x, w), 1), rtol=1e-6, atol=1e-7)


def test_func_jvp_against_finite_differences():
    r, x, _ = _inputs()
    w = r.weights.clone()
    g = torch.Generator().manual_seed(9)
    tx, tw = torch.randn(x.shape, generator=g, dtype=torch.float64), torch.randn(w.shape, generator=g,
                                                                                 dtype=torch.float64)
    f = lambda x, w: _loss(x, w, r)  # noqa: E731
    _, tangent = jvp(f, (x, w), (tx, tw))
    eps = 1e-6
    fd = (f(x + eps * tx, w + eps * tw) - f(x - eps * tx, w - eps * tw)) / (2 * eps)
    assert abs(float(tangent) - float(fd)) < 1e-6 * max(1.0, abs(float(fd)))
    assert float(tangent) != 0.0


def test_vjp_and_jacrev_agree_with_autograd():
    r, x, _ = _inputs()
    w = r.weights.clone()
    f = lambda x: fmoe.combine(torch.sin(fmoe.dispatch(x, r)), r)  # noqa: E731
    out, pull = vjp(f, x)
    ct = torch.ones_like(out)
    (gx,) = pull(ct)
    xa = x.clone().requires_grad_()
    f(xa).backward(ct)
    torch.testing.assert_close(gx, xa.grad)
    jac = jacrev(f)(x)
    assert jac.shape == (*out.shape, *x.shape)
    torch.testing.assert_close(jac.sum((0, 1)), xa.grad)
    del w


def _moe_spec(cf=1.0, k=2):
    return fmoe.MoESpec(model_dim=6, num_experts=4, gate=fmoe.GateSpec(k=k, capacity_factor=cf, fp32_gate=False),
                        experts=fmoe.ExpertSpec(hidden_size=5))


def test_vmap_over_inputs_equals_loop():
    spec = _moe_spec()
    params = fmoe.init_params(spec, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    xs = torch.randn(5, 12, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    f = lambda x: fmoe.moe(params, x, spec)[0]  # noqa: E731
    torch.testing.assert_close(vmap(f)(xs), torch.stack([f(x) for x in xs]), rtol=0, atol=1e-14)


def test_vmap_over_gate_weights_equals_loop():
    spec = _moe_spec(cf=0.5)
    params = fmoe.init_params(spec, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x = torch.randn(12, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    wgs = torch.randn(6, 4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def f(wg):
        y, aux = fmoe.moe({"gate": {"wg": wg}, "experts": params["experts"]}, x, spec)
        return y, aux.l_aux, aux.dropped

    ys, ls, ds = vmap(f)(wgs)
    for i, wg in enumerate(wgs):
        y, l_aux, d = f(wg)
        torch.testing.assert_close(ys[i], y, rtol=0, atol=1e-14)
        torch.testing.assert_close(ls[i], l_aux)
        assert int(ds[i]) == int(d)


def test_vmap_of_grad_equals_loop():
    spec = _moe_spec()
    params = fmoe.init_params(spec, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    xs = torch.randn(4, 12, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def loss(p, x):
        y, aux = fmoe.moe(p, x, spec)
        return (y ** 2).sum() + aux.l_aux

    per_example = vmap(grad(loss), in_dims=(None, 0))(params, xs)
    for i, x in enumerate(xs):
        single = grad(loss)(params, x)
        for part in ("gate", "experts"):
            for key in single[part]:
                torch.testing.assert_close(per_example[part][key][i], single[part][key], rtol=1e-12, atol=1e-12)


def test_grad_of_moe_matches_autograd():
    spec = _moe_spec()
    params = fmoe.init_params(spec, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x = torch.randn(12, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def loss(p):
        y, aux = fmoe.moe(p, x, spec)
        return (y ** 2).sum() + 0.1 * aux.l_aux

    g = grad(loss)(params)
    leaves = {k: {kk: v.clone().requires_grad_() for kk, v in d.items()} for k, d in params.items()}
    loss(leaves).backward()
    for part in g:
        for key in g[part]:
            torch.testing.assert_close(g[part][key], leaves[part][key].grad)
    assert g["gate"]["wg"].abs().sum() > 0


def test_torch_compile_fullgraph_forward_backward():
    torch._dynamo.reset()
    spec = _moe_spec(cf=1.0)
    params = fmoe.init_params(spec, generator=torch.Generator().manual_seed(0))
    x = torch.randn(2, 8, 6, generator=torch.Generator().manual_seed(1))

    def loss(p, x):
        y, aux = fmoe.moe(p, x, spec)
        return (y ** 2).sum() + aux.l_aux

    eager = {k: {kk: v.clone().requires_grad_() for kk, v in d.items()} for k, d in params.items()}
    comp = {k: {kk: v.clone().requires_grad_() for kk, v in d.items()} for k, d in params.items()}
    le = loss(eager, x)
    le.backward()
    lc = torch.compile(loss, fullgraph=True, backend="aot_eager")(comp, x)
    lc.backward()
    torch.testing.assert_close(lc, le)
    for part in eager:
        for key in eager[part]:
            torch.testing.assert_close(comp[part][key].grad, eager[part][key].grad, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_torch_compile_inductor():
    torch._dynamo.reset()
    r, x, _ = _inputs()
    x = x.float()
    w = r.weights.float()
    f = torch.compile(lambda x, w: _loss(x, w, r), fullgraph=True)
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    le, lc = _loss(xe, w, r), f(xc, w)
    le.backward()
    lc.backward()
    torch.testing.assert_close(lc, le)
    torch.testing.assert_close(xc.grad, xe.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_public_ops_equal_reference(dtype):
    """Whatever kernel is registered for CPU, the public ops agree with the reference."""
    r, x, y = _inputs()
    x, y = x.to(dtype), y.to(dtype)
    pos, R = r.positions(), y.shape[0] * y.shape[1]
    w = r.weights.to(dtype)
    assert torch.equal(fmoe.dispatch(x, r, weighted=True).to(dtype),
                       reference.dispatch(x, pos, r.weights, R).reshape(y.shape))
    assert torch.equal(fmoe.combine(y, _with_weights(r, w)), reference.combine(y.reshape(R, -1), pos, w))
    # gate_grad is a reduction over M: backends may sum in another order.
    torch.testing.assert_close(fmoe.gate_grad(x, y, r), reference.gate_grad(x, y.reshape(R, -1), pos))
