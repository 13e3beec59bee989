"""fmoe.moe against a slow, obviously-correct per-token loop."""
import dataclasses
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

import fmoe
import fmoe.routers  # noqa: F401  (fmoe.routers.* below)


def loop_moe(params, x, spec):
    """Token-by-token MoE following routing.md §5-§9 literally."""
    gs, es = spec.gate, spec.experts
    T, E, k = x.shape[0], spec.num_experts, min(gs.k, spec.num_experts)
    wg = params["gate"]["wg"]
    probs = []
    for t in range(T):
        logits = [float((x[t] * wg[e]).sum()) for e in range(E)]
        m = max(logits)
        z = [math.exp(v - m) for v in logits]
        probs.append([v / sum(z) for v in z])
    choices = []
    for t in range(T):
        order = sorted(range(E), key=lambda e: -probs[t][e])[:k]
        g = [probs[t][e] for e in order]
        if spec.normalize_gate and k > 1:
            s = sum(g)
            g = [v / s for v in g]
        choices.append(list(zip(order, g)))
    counts = [sum(1 for t in range(T) for e, _ in choices[t] if e == ex) for ex in range(E)]
    cf, spe = gs.capacity_factor, -(-T // E)
    if cf > 0:
        C = k * int(cf * spe)
    else:
        C = max(counts)
        if cf < 0:
            C = min(C, k * int(-cf * spe))
    token_order = list(range(T))
    if spec.batch_prioritized:
        token_order = sorted(range(T), key=lambda t: -max(probs[t]))
    counter = [0] * E
    kept = set()
    for j in range(k):
        for t in token_order:
            e = choices[t][j][0]
            if counter[e] < C:
                kept.add((t, j))
            counter[e] += 1
    ex = params["experts"]

    def f(e, v):
        h = F.relu(ex["fc1_w"][e] @ v + ex["fc1_b"][e])
        return ex["fc2_w"][e].t() @ h + ex["fc2_b"][e]

    out = torch.zeros(T, spec.output_dim, dtype=x.dtype)
    for t in range(T):
        for j, (e, g) in enumerate(choices[t]):
            if (t, j) in kept:
                out[t] += g * f(e, x[t]) if spec.is_postscore else f(e, g * x[t])
    dropped = T * k - len(kept)
    return out, counts, C, dropped


def _spec(k, cf, post, bp):
    return fmoe.MoESpec(model_dim=6, num_experts=4, gate=fmoe.GateSpec(k=k, capacity_factor=cf, fp32_gate=False),
                        experts=fmoe.ExpertSpec(hidden_size=5), is_postscore=post, batch_prioritized=bp)


@pytest.mark.parametrize("k,cf,post,bp", list(itertools.product([1, 2, 3], [1.0, 0.5, 0, -0.5], [True, False],
                                                                [False, True])))
def test_moe_matches_token_loop(k, cf, post, bp):
    spec = _spec(k, cf, post, bp)
    g = torch.Generator().manual_seed(k * 100 + int(cf * 10) + 7 * post + 3 * bp)
    params = fmoe.init_params(spec, generator=g, dtype=torch.float64)
    params["experts"]["fc1_b"] = torch.randn(4, 5, generator=g, dtype=torch.float64) * 0.1
    params["experts"]["fc2_b"] = torch.randn(4, 6, generator=g, dtype=torch.float64) * 0.1
    # Skewed gate so that some experts overflow and drops happen.
    params["gate"]["wg"] = params["gate"]["wg"] * 3 + torch.tensor([1.0, 0.5, 0, 0], dtype=torch.float64)[:, None]
    x = torch.randn(24, 6, generator=g, dtype=torch.float64)
    y, aux = fmoe.moe(params, x, spec)
    ref, counts, C, dropped = loop_moe(params, x, spec)
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    assert aux.counts.tolist() == counts
    assert aux.capacity == C
    assert int(aux.dropped) == dropped
    if cf == 0:
        assert dropped == 0
    if cf == 0.5:
        assert dropped > 0, "the grid must exercise dropping"


@pytest.mark.parametrize("gshard", [True, False])
def test_balance_loss_off_leaves_everything_else(gshard):
    gate = fmoe.GateSpec(k=2, capacity_factor=0.0, gate_noise=0.0 if gshard else 1.0)
    spec = fmoe.MoESpec(model_dim=8, num_experts=4, gate=gate, experts=fmoe.ExpertSpec(type="gated_ffn", hidden_size=8),
                        is_gshard_loss=gshard)
    params = fmoe.init_params(spec, generator=torch.Generator().manual_seed(0))
    x = torch.randn(10, 8, generator=torch.Generator().manual_seed(1))
    off = dataclasses.replace(spec, balance_loss=False)
    kw = lambda: dict(training=True, generator=torch.Generator().manual_seed(2))  # noqa: E731
    (y1, a1), (y0, a0) = fmoe.moe(params, x, spec, **kw()), fmoe.moe(params, x, off, **kw())
    assert float(a1.l_aux) > 0 and a0.l_aux.shape == () and float(a0.l_aux) == 0.0
    assert torch.equal(y1, y0) and torch.equal(a1.counts, a0.counts) and torch.equal(a1.scores, a0.scores)


def test_architecture_blocks_compute_no_balance_loss():
    from fmoe.models import qwen3_moe
    cfg = qwen3_moe.Qwen3MoeBlockConfig(hidden_size=8, num_experts=4, top_k=2, moe_intermediate_size=4)
    assert not qwen3_moe.moe_spec(cfg).balance_loss   # their models take the loss from the router logits


def test_moe_keeps_input_shape_and_dtype():
    spec = fmoe.MoESpec(model_dim=8, num_experts=4, gate=fmoe.GateSpec(k=2), experts=fmoe.ExpertSpec(hidden_size=8))
    params = fmoe.init_params(spec, generator=torch.Generator().manual_seed(0))
    x = torch.randn(2, 3, 5, 8).to(torch.bfloat16)
    y, aux = fmoe.moe(params, x, spec)
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    assert aux.routing.weights.dtype == torch.float32  # fp32 gate


def test_gated_ffn_and_custom_experts():
    spec = fmoe.MoESpec(model_dim=8, num_experts=3, gate=fmoe.GateSpec(k=2, capacity_factor=0),
                        experts=fmoe.ExpertSpec(type="gated_ffn", hidden_size=6))
    g = torch.Generator().manual_seed(1)
    params = fmoe.init_params(spec, generator=g, dtype=torch.float64)
    x = torch.randn(10, 8, generator=g, dtype=torch.float64)
    y, aux = fmoe.moe(params, x, spec)
    ex = params["experts"]
    r = aux.routing
    ref = torch.zeros_like(x)
    for t in range(10):
        for j in range(2):
            e = int(r.expert_ids[j, t])
            h = F.silu(x[t] @ ex["gate_w"][e]) * (x[t] @ ex["up_w"][e])
            ref[t] += r.weights[j, t] * (h @ ex["down_w"][e])
    torch.testing.assert_close(y, ref)

    def scale_init(n, m, spec, generator, dtype):
        return {"scale": torch.arange(1.0, n + 1, dtype=dtype)}

    def scale_fn(p, buf):
        return buf * p["scale"][:, None, None]

    cspec = fmoe.MoESpec(model_dim=8, num_experts=3, gate=fmoe.GateSpec(k=1, capacity_factor=0),
                         experts=fmoe.ExpertSpec(type="custom", fn=scale_fn, init=scale_init))
    cp = fmoe.init_params(cspec, generator=g, dtype=torch.float64)
    y, aux = fmoe.moe(cp, x, cspec)
    e0 = aux.routing.expert_ids[0]
    torch.testing.assert_close(y, x * (e0 + 1).double()[:, None] * aux.routing.weights[0][:, None])


def test_gate_noise_uses_explicit_generator():
    spec = fmoe.MoESpec(model_dim=8, num_experts=4, gate=fmoe.GateSpec(k=2, gate_noise=1.0),
                        experts=fmoe.ExpertSpec(hidden_size=8))
    params = fmoe.init_params(spec, generator=torch.Generator().manual_seed(0))
    x = torch.randn(16, 8)
    a, _ = fmoe.moe(params, x, spec, training=True, generator=torch.Generator().manual_seed(5))
    b, _ = fmoe.moe(params, x, spec, training=True, generator=torch.Generator().manual_seed(5))
    c, _ = fmoe.moe(params, x, spec, training=False)
    assert torch.equal(a, b)
    eps = torch.randn(16, 4, generator=torch.Generator().manual_seed(5))
    d, _ = fmoe.moe(params, x, spec, training=True, noise=eps)
    assert torch.equal(a, d)
    assert not torch.equal(a, c)


def test_cosine_gate_formula():
    g = torch.Generator().manual_seed(3)
    p = fmoe.routers.init_cosine_gate(5, 8, proj_dim=4, generator=g, dtype=torch.float64)
    x = torch.randn(3, 8, generator=g, dtype=torch.float64)
    logits = fmoe.routers.cosine_gate(p, x)
    u = x @ p["proj_w"].t() + p["proj_b"]
    u = u / u.norm(dim=1, keepdim=True)
    v = p["sim_matrix"] / p["sim_matrix"].norm(dim=0, keepdim=True)
    torch.testing.assert_close(logits, (u @ v) * 2.0)  # temperature starts at ln 2
    p["temperature"] = torch.tensor([10.0], dtype=torch.float64)
    torch.testing.assert_close(fmoe.routers.cosine_gate(p, x), (u @ v) * 100.0)  # capped at ln 100
