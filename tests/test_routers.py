"""fmoe.routers and fmoe.losses against slow per-token loops written here from the specs
(routing.md §3-§10, architectures.md §2-§8) and from hand formulas."""
import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import fmoe
from fmoe import losses, routers
from fmoe.routers import GateSpec, init_router, route, router_forward


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _params(spec, E, M, seed=0, dtype=torch.float32, scale=1.0):
    """init_router's keys, with N(0, scale) router weights and non-zero biases (no ties)."""
    p = init_router(spec, E, M, generator=_gen(seed), dtype=dtype)
    g = _gen(seed + 100)
    if "wg" in p:
        p["wg"] = (torch.randn(E, M, generator=g) * scale).to(dtype)
    if "correction_bias" in p:
        p["correction_bias"] = (torch.randn(E, generator=g) * 0.1).to(torch.promote_types(dtype, torch.float32))
    if "bias" in p:
        p["bias"] = torch.randn(E, generator=g).to(dtype)
    return p


# --------------------------------------------------------------------------- per-token references

def _sorted_desc(vals):
    """Indices of a 1-D list of floats, descending (ties would be unspecified: inputs avoid them)."""
    return sorted(range(len(vals)), key=lambda e: -vals[e])


def ref_tutel(p, x, spec, normalize, noise=None):
    """routing.md §3-§5, §8, one token at a time."""
    ids, ws = [], []
    E = p["wg"].shape[0] if "wg" in p else p["sim_matrix"].shape[1]
    k = min(spec.k, E)
    for t in range(x.shape[0]):
        xt = x[t].float() if spec.fp32_gate else x[t]
        if spec.type == "cosine_top":
            u = xt @ p["proj_w"].to(xt.dtype).t() + p["proj_b"].to(xt.dtype)
            u = u / max(u.norm().item(), 1e-12)
            sim = p["sim_matrix"].to(xt.dtype)
            v = sim / sim.norm(dim=0).clamp(min=1e-12)
            logit = (u @ v) * math.exp(min(p["temperature"].item(), math.log(100.0)))
        else:
            logit = p["wg"].to(xt.dtype) @ xt
        if noise is not None:
            logit = logit + noise[t].to(logit.dtype) * (spec.gate_noise / E)
        s = torch.softmax(logit, 0) if spec.score_fn == "softmax" else torch.sigmoid(logit)
        order = _sorted_desc(s.tolist())[:k]
        w = s[order]
        if normalize and k > 1:
            w = w / max(w.sum().item(), torch.finfo(w.dtype).eps)
        ids.append(order)
        ws.append(w)
    return torch.tensor(ids).t(), torch.stack(ws).t()


def ref_qwen(p, x, k, norm):
    ids, ws = [], []
    for t in range(x.shape[0]):
        s = torch.softmax((x[t:t + 1] @ p["wg"].t())[0].float(), 0)   # logits in dt, softmax fp32
        order = _sorted_desc(s.tolist())[:k]
        w = s[order]
        if norm:
            w = w / w.sum()
        ids.append(order)
        ws.append(w.to(x.dtype))
    return torch.tensor(ids).t(), torch.stack(ws).t()


def ref_mixtral(p, x, k, norm):
    ids, ws = [], []
    for t in range(x.shape[0]):
        s = torch.softmax((x[t:t + 1] @ p["wg"].t())[0].float(), 0)
        order = _sorted_desc(s.tolist())[:k]
        w = s[order]
        ids.append(order)
        ws.append(w / w.sum() if norm else w)
    return torch.tensor(ids).t(), torch.stack(ws).t()


def ref_deepseek(p, x, spec, norm):
    W, b = p["wg"], p["correction_bias"]
    E, k = W.shape[0], spec.k
    G = E // spec.n_group
    dt = torch.promote_types(x.dtype, torch.float32)
    ids, ws = [], []
    for t in range(x.shape[0]):
        s = torch.sigmoid(W.to(dt) @ x[t].to(dt))
        c = (s + b.to(dt)).tolist()
        gscore = [sum(sorted(c[g * G:(g + 1) * G])[-2:]) for g in range(spec.n_group)]
        keep = _sorted_desc(gscore)[:spec.topk_group]
        cand = [e for e in range(E) if e // G in keep]
        chosen = sorted(cand, key=lambda e: -c[e])[:k]
        w = s[chosen]
        if norm:
            w = w / (w.sum() + 1e-20)
        ids.append(chosen)
        ws.append(w * spec.routed_scaling_factor)
    return torch.tensor(ids).t(), torch.stack(ws).t()


def ref_gpt_oss(p, x, k):
    ids, ws = [], []
    for t in range(x.shape[0]):
        logits = F.linear(x[t:t + 1], p["wg"], p["bias"])[0]
        order = _sorted_desc(logits.tolist())[:k]
        ids.append(order)
        ws.append(torch.softmax(logits[order], 0))
    return torch.tensor(ids).t(), torch.stack(ws).t()


def ref_sinkhorn_matrix(logits, iters):
    """Sinkhorn-Knopp with plain multiplicative updates, scalar loops, float64."""
    T, E = logits.shape
    K = [[math.exp(v) for v in row] for row in logits.double().tolist()]
    v = [1.0] * E
    for _ in range(iters):
        u = [1.0 / sum(K[t][e] * v[e] for e in range(E)) for t in range(T)]
        v = [(T / E) / sum(K[t][e] * u[t] for t in range(T)) for e in range(E)]
    return torch.tensor([[u[t] * K[t][e] * v[e] for e in range(E)] for t in range(T)], dtype=torch.float64)


def ref_slots(ids, E, order=None):
    """routing.md §6: walk (j, t), j outer, t inner (in ``order``), one counter per expert."""
    k, T = ids.shape
    order = range(T) if order is None else order
    counters, slots = [0] * E, [[-1] * T for _ in range(k)]
    for j in range(k):
        for t in order:
            e = int(ids[j, t])
            if e >= 0:
                slots[j][t] = counters[e]
                counters[e] += 1
    return torch.tensor(slots), torch.tensor(counters)


def ref_capacity(cf, T, E, k, counts):
    spe = -(-T // E)
    if cf > 0:
        return k * int(cf * spe)
    C = max(counts)
    return C if cf == 0 else min(C, k * int(-cf * spe))


def ref_combine_identity(x, ids, slots, w, C):
    """y[t] = sum over kept pairs of w * x[t] (identity experts, post-score)."""
    y = torch.zeros_like(x)
    for j in range(ids.shape[0]):
        for t in range(x.shape[0]):
            if ids[j, t] >= 0 and slots[j, t] < C:
                y[t] += w[j, t].to(x.dtype) * x[t]
    return y


def by_expert(ids, w):
    """[k, T] pairs re-sorted by expert id per token: compare sets and their weights."""
    o = ids.argsort(dim=0)
    return ids.gather(0, o), w.gather(0, o)


# --------------------------------------------------------------------------- spec

def test_gatespec_keeps_the_moe_fields_defaults_and_messages():
    g = GateSpec()
    assert (g.type, g.k, g.capacity_factor, g.gate_noise, g.fp32_gate, g.score_fn, g.proj_dim, g.init_t) == \
        ("top", 1, 1.0, 0.0, True, "softmax", 256, 0.5)
    assert hash(GateSpec(k=2)) == hash(GateSpec(k=2)) and GateSpec(k=2) == GateSpec(k=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.k = 3
    with pytest.raises(ValueError, match="unknown gate type 'auto'; expected one of"):
        GateSpec(type="auto")
    with pytest.raises(ValueError, match="gate k must be an int >= 1, got 0"):
        GateSpec(k=0)
    with pytest.raises(ValueError, match="unknown score_fn 'relu'"):
        GateSpec(score_fn="relu")
    with pytest.raises(ValueError, match="gate_noise must be >= 0, got -1"):
        GateSpec(gate_noise=-1)
    # fmoe.GateSpec (moe.py) accepts the same settings with the same outcome.
    for kw in ({}, {"k": 2, "capacity_factor": 0.0}, {"type": "cosine_top", "proj_dim": 8, "gate_noise": 1.0}):
        old = fmoe.GateSpec(**kw)
        assert {f.name: getattr(old, f.name) for f in dataclasses.fields(old)} == \
            {f.name: getattr(GateSpec(**kw), f.name) for f in dataclasses.fields(old)}


@pytest.mark.parametrize("kw,msg", [
    ({"type": "qwen", "gate_noise": 0.1}, r"GateSpec.gate_noise=0.1 applies to .* not type='qwen'"),
    ({"type": "mixtral", "gate_noise": 0.1}, r"use jitter_eps"),
    ({"type": "deepseek", "score_fn": "sigmoid"}, r"GateSpec.score_fn='sigmoid' applies to"),
    ({"type": "top", "n_group": 2}, r"GateSpec.n_group=2 applies to type='deepseek' only, not 'top'"),
    ({"type": "qwen", "routed_scaling_factor": 2.5}, r"GateSpec.routed_scaling_factor=2.5 applies to type='deepseek'"),
    ({"type": "deepseek", "n_group": 0}, r"GateSpec.n_group must be an int >= 1, got 0"),
    ({"type": "deepseek", "n_group": 2, "topk_group": 3}, r"GateSpec.topk_group=3 must be in \[1, n_group=2\]"),
    ({"type": "deepseek", "routed_scaling_factor": 0.0}, r"routed_scaling_factor must be finite and > 0"),
    ({"type": "mixtral", "jitter_eps": 1.5}, r"GateSpec.jitter_eps must be in \[0, 1\), got 1.5"),
    ({"type": "top", "jitter_eps": 0.1}, r"GateSpec.jitter_eps=0.1 applies to type='mixtral' only"),
    ({"type": "sinkhorn", "sinkhorn_iters": 0}, r"GateSpec.sinkhorn_iters must be an int >= 1, got 0"),
    ({"type": "sinkhorn", "sinkhorn_tol": -1.0}, r"GateSpec.sinkhorn_tol must be >= 0"),
    ({"type": "top", "sinkhorn_iters": 4}, r"sinkhorn_iters/sinkhorn_tol apply to type='sinkhorn' only"),
    ({"type": "expert_choice", "capacity_factor": 0.0}, r"capacity_factor must be > 0 for type='expert_choice'"),
])
def test_gatespec_bad_settings_are_named(kw, msg):
    with pytest.raises(ValueError, match=msg):
        GateSpec(**kw)


def test_init_and_check_router_params():
    E, M = 4, 8
    top = GateSpec(k=2)
    # 'top' draws exactly Tutel's gate (fmoe.init_params stays bit-identical).
    assert torch.equal(init_router(top, E, M, generator=_gen(3))["wg"],
                       routers.init_linear_gate(E, M, generator=_gen(3))["wg"])
    cos = GateSpec(type="cosine_top", proj_dim=6)
    pc, ref = init_router(cos, E, M, generator=_gen(3)), routers.init_cosine_gate(E, M, proj_dim=6, generator=_gen(3))
    assert pc.keys() == ref.keys() and all(torch.equal(pc[n], ref[n]) for n in pc)
    ds = init_router(GateSpec(type="deepseek", k=2), E, M, generator=_gen(0), dtype=torch.bfloat16)
    assert ds["wg"].dtype == torch.bfloat16 and ds["correction_bias"].dtype == torch.float32
    assert torch.equal(ds["correction_bias"], torch.zeros(E))
    go = init_router(GateSpec(type="gpt_oss", k=2), E, M, generator=_gen(0))
    assert go["bias"].shape == (E,) and go["bias"].abs().max() <= 1 / math.sqrt(M)
    for t in routers.ROUTER_TYPES:
        spec = GateSpec(type=t, k=2)
        routers.check_router_params(init_router(spec, E, M, generator=_gen(0)), spec, E, M)
    with pytest.raises(ValueError, match=r"gate.wg must be \[E, M\] = \[4, 8\], got \(4, 9\)"):
        routers.check_router_params({"wg": torch.zeros(4, 9)}, top, E, M)
    with pytest.raises(ValueError, match=r"qwen router needs 'wg', got keys \['weight'\]"):
        routers.check_router_params({"weight": torch.zeros(4, 8)}, GateSpec(type="qwen"), E, M)
    with pytest.raises(ValueError, match=r"gpt_oss router needs 'bias' \[E\]"):
        routers.check_router_params({"wg": torch.zeros(4, 8)}, GateSpec(type="gpt_oss"), E, M)
    with pytest.raises(ValueError, match=r"gate.correction_bias must be \[E\] = \[4\], got \(5,\)"):
        routers.check_router_params({"wg": torch.zeros(4, 8), "correction_bias": torch.zeros(5)},
                                    GateSpec(type="deepseek"), E, M)
    with pytest.raises(ValueError, match=r"cosine gate needs"):
        routers.check_router_params({"wg": torch.zeros(4, 8)}, cos, E, M)
    with pytest.raises(ValueError, match=r"gate.sim_matrix must be \[Pd, 5\]"):
        routers.check_router_params(pc, cos, 5, M)


# --------------------------------------------------------------------------- token-choice routers vs loops

T, M = 24, 12


@pytest.mark.parametrize("gtype", ["top", "cosine_top"])
@pytest.mark.parametrize("score_fn", ["softmax", "sigmoid"])
@pytest.mark.parametrize("normalize", [True, False])
def test_tutel_routers_match_loop(gtype, score_fn, normalize):
    E = 6
    spec = GateSpec(type=gtype, k=3, score_fn=score_fn, proj_dim=8)
    p = _params(spec, E, M, seed=1)
    x = torch.randn(T, M, generator=_gen(2))
    out = router_forward(p, x, spec, num_experts=E, normalize=normalize)
    rid, rw = ref_tutel(p, x, spec, normalize)
    assert out.expert_ids.dtype == torch.int64 and torch.equal(out.expert_ids, rid)
    torch.testing.assert_close(out.weights, rw)            # GEMM vs per-token GEMV: ulp-level
    assert out.weights.dtype == torch.float32 and out.tokens is None and out.capacity is None
    torch.testing.assert_close(out.importance, out.scores.amax(1), rtol=0, atol=0)
    # Bit-identical to the pre-router pipeline: gate logits -> scores -> fmoe.top_k_routing.
    logits = routers.gate_logits(gtype, p, x, fp32=True)
    assert torch.equal(out.logits, logits)
    r, _ = route(p, x, spec, num_experts=E, normalize=normalize)
    old = fmoe.top_k_routing(routers.scores_from_logits(logits, score_fn), 3, 1.0, normalize=normalize)
    for n in ("expert_ids", "slots", "weights", "counts"):
        assert torch.equal(getattr(r, n), getattr(old, n))
    assert r.capacity == old.capacity


def test_tutel_k_is_clipped_to_E():
    spec = GateSpec(k=9)
    p = _params(spec, 4, M)
    out = router_forward(p, torch.randn(5, M, generator=_gen(0)), spec, num_experts=4)
    assert out.expert_ids.shape == (4, 5)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen_and_mixtral_match_loop(norm, dtype):
    E = 8
    x = torch.randn(T, M, generator=_gen(3)).to(dtype)
    for gtype, ref, wdt in (("qwen", ref_qwen, dtype), ("mixtral", ref_mixtral, torch.float32)):
        spec = GateSpec(type=gtype, k=3)
        p = _params(spec, E, M, seed=4, dtype=dtype)
        out = router_forward(p, x, spec, num_experts=E, normalize=norm)
        rid, rw = ref(p, x, 3, norm)
        assert torch.equal(out.expert_ids, rid)
        assert out.weights.dtype == wdt and out.logits.dtype == dtype and out.scores.dtype == torch.float32
        torch.testing.assert_close(out.weights, rw)
        # Bit-exact with the architecture functions the model adapters use.
        if gtype == "qwen":
            lg, w, ids = routers.qwen_topk(x, p["wg"], 3, norm_topk_prob=norm)
        else:
            lg, w, ids = routers.mixtral_topk(x, p["wg"], 3)
            if not norm:
                w = torch.softmax(lg.float(), -1).gather(1, ids)
        assert torch.equal(out.logits, lg) and torch.equal(out.weights, w.t()) and torch.equal(out.expert_ids, ids.t())


@pytest.mark.parametrize("n_group,topk_group", [(4, 2), (1, 1), (8, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deepseek_matches_loop(n_group, topk_group, dtype):
    E = 16
    spec = GateSpec(type="deepseek", k=4, n_group=n_group, topk_group=topk_group, routed_scaling_factor=2.5)
    p = _params(spec, E, M, seed=5, scale=0.3)
    x = torch.randn(T, M, generator=_gen(6)).to(dtype)
    out = router_forward(p, x, spec, num_experts=E)
    rid, rw = ref_deepseek(p, x, spec, True)
    i1, w1 = by_expert(out.expert_ids, out.weights)          # sorted=False: ids are a set
    i2, w2 = by_expert(rid, rw)
    assert torch.equal(i1, i2)
    torch.testing.assert_close(w1, w2, rtol=1e-6, atol=1e-7)
    assert out.weights.dtype == torch.float32 and out.logits.dtype == torch.float32
    torch.testing.assert_close(out.scores, torch.sigmoid(out.logits), rtol=0, atol=0)
    lg, w, ids = routers.deepseek_topk(x, p["wg"], p["correction_bias"], 4, n_group=n_group, topk_group=topk_group,
                                       routed_scaling_factor=2.5)
    assert torch.equal(out.weights, w.t()) and torch.equal(out.expert_ids, ids.t()) and torch.equal(out.logits, lg)
    # Without renormalisation the weights are rsf * the unbiased sigmoid scores.
    raw = router_forward(p, x, spec, num_experts=E, normalize=False)
    torch.testing.assert_close(raw.weights, 2.5 * out.scores.t().gather(0, raw.expert_ids), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_matches_loop(dtype):
    E = 8
    spec = GateSpec(type="gpt_oss", k=4)
    p = _params(spec, E, M, seed=7, dtype=dtype)
    x = torch.randn(T, M, generator=_gen(8)).to(dtype)
    out = router_forward(p, x, spec, num_experts=E)
    rid, rw = ref_gpt_oss(p, x, 4)
    assert torch.equal(out.expert_ids, rid) and out.weights.dtype == dtype
    torch.testing.assert_close(out.weights, rw)
    with pytest.raises(ValueError, match="normalize=False is not defined for type='gpt_oss'"):
        router_forward(p, x, spec, num_experts=E, normalize=False)


def test_mixtral_jitter_reaches_the_experts_and_leaves_x_alone():
    E = 8
    spec = GateSpec(type="mixtral", k=2, jitter_eps=0.2)
    p = _params(spec, E, M, seed=9)
    x = torch.randn(T, M, generator=_gen(10))
    x0 = x.clone()
    out = router_forward(p, x, spec, num_experts=E, training=True, generator=_gen(11))
    xj = routers.mixtral_jitter(x, 0.2, generator=_gen(11))
    assert torch.equal(x, x0) and torch.equal(out.tokens, xj) and not torch.equal(xj, x)
    _, w, ids = routers.mixtral_topk(xj, p["wg"], 2)
    assert torch.equal(out.expert_ids, ids.t()) and torch.equal(out.weights, w.t())
    # An explicit multiplier is the same as the drawn one; eval mode has no jitter.
    mult = xj / x
    out2 = router_forward(p, x, spec, num_experts=E, training=True, noise=mult)
    assert torch.equal(out2.tokens, x * mult)
    assert router_forward(p, x, spec, num_experts=E).tokens is None
    with pytest.raises(ValueError, match="mixtral jitter noise must have x's shape"):
        router_forward(p, x, spec, num_experts=E, training=True, noise=mult[:, :3])


def ref_from_logits(gtype, out, spec, bias=None):
    """The selection/weight math of each router, token by token, from the router's own logits
    (so GEMM rounding is out of the picture and the comparison can be bit for bit)."""
    k, ids, ws = spec.k, [], []
    for t in range(out.logits.shape[0]):
        lg = out.logits[t]
        if gtype == "top":
            s = torch.softmax(lg, 0)
        elif gtype in ("qwen", "mixtral"):
            s = torch.softmax(lg.float(), 0)
        elif gtype == "deepseek":
            # Elementwise, so the whole-matrix call is still per token (a single row would take
            # torch's scalar tail path and round differently).
            s = torch.sigmoid(out.logits)[t]
        else:
            s = lg
        if gtype == "deepseek":
            E, G = lg.shape[0], lg.shape[0] // spec.n_group
            c = (s + bias).tolist()
            gs = [sum(sorted(c[g * G:(g + 1) * G])[-2:]) for g in range(spec.n_group)]
            keep = _sorted_desc(gs)[:spec.topk_group]
            cand = [e for e in range(E) if e // G in keep]
            chosen = sorted(sorted(cand, key=lambda e: -c[e])[:k])
            # sorted=False: the slot order is the backend's, and the denominator is summed in
            # slot order (architectures.md §12.5), so take the router's order for the weights.
            assert sorted(out.expert_ids[:, t].tolist()) == chosen
            order = out.expert_ids[:, t].tolist()
        else:
            order = _sorted_desc(s.tolist())[:k]
        w = s[order]
        if gtype == "top":
            w = w / w.sum().clamp(min=torch.finfo(w.dtype).eps)
        elif gtype in ("qwen", "mixtral"):
            w = w / w.sum()
        elif gtype == "deepseek":
            w = w / (w.sum() + 1e-20) * spec.routed_scaling_factor
        else:
            w = torch.softmax(w, 0)
        ids.append(order)
        ws.append(w.to(lg.dtype) if gtype == "qwen" else w)
    return torch.tensor(ids).t(), torch.stack(ws).t()


@pytest.mark.parametrize("gtype", ["top", "qwen", "mixtral", "deepseek", "gpt_oss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_math_is_bit_exact_given_its_logits(gtype, dtype):
    E = 16
    kw = {"n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5} if gtype == "deepseek" else {}
    spec = GateSpec(type=gtype, k=3, **kw)
    p = _params(spec, E, M, seed=1, dtype=torch.float32 if gtype == "top" else dtype)
    x = torch.randn(T, M, generator=_gen(2)).to(dtype)
    out = router_forward(p, x, spec, num_experts=E)
    rid, rw = ref_from_logits(gtype, out, spec, p.get("correction_bias"))
    if gtype == "gpt_oss" and dtype == torch.bfloat16:
        # bf16 logits tie at the k-th place here and tie order is backend-defined (routing.md
        # §5): compare the selected logit values, which the weights depend on.
        lt = out.logits.t()
        assert torch.equal(lt.gather(0, out.expert_ids), lt.gather(0, rid))
    else:
        assert torch.equal(out.expert_ids, rid)
    assert out.weights.dtype == rw.dtype and torch.equal(out.weights, rw)


# --------------------------------------------------------------------------- capacity, slots, placement

@pytest.mark.parametrize("gtype", ["top", "qwen", "deepseek", "gpt_oss", "mixtral", "sinkhorn"])
@pytest.mark.parametrize("cf", [1.0, 0.0, -0.5])
def test_route_capacity_modes_match_loop(gtype, cf):
    E, k = 8, 2
    spec = GateSpec(type=gtype, k=k, capacity_factor=cf)
    p = _params(spec, E, M, seed=12)
    x = torch.randn(T, M, generator=_gen(13)) * 2
    r, out = route(p, x, spec, num_experts=E)
    slots, counts = ref_slots(out.expert_ids, E)
    C = ref_capacity(cf, T, E, k, counts.tolist())
    assert torch.equal(r.slots, slots) and torch.equal(r.counts, counts) and r.capacity == C
    assert torch.equal(r.expert_ids, out.expert_ids) and torch.equal(r.weights, out.weights)
    kept = (slots < C)
    assert int(r.num_dropped()) == int((~kept).sum())
    if cf == 0:
        assert int(r.num_dropped()) == 0
    y = fmoe.combine(fmoe.dispatch(x, r), r)
    torch.testing.assert_close(y, ref_combine_identity(x, out.expert_ids, slots, out.weights, C))


@pytest.mark.parametrize("gtype", ["top", "qwen", "deepseek"])
def test_batch_prioritized_placement_matches_loop(gtype):
    E, k = 4, 2
    spec = GateSpec(type=gtype, k=k, capacity_factor=0.5)
    p = _params(spec, E, M, seed=14)
    x = torch.randn(T, M, generator=_gen(15))
    r, out = route(p, x, spec, num_experts=E, batch_prioritized=True)
    imp = out.scores.amax(1).tolist()
    order = sorted(range(T), key=lambda t: (-imp[t], t))          # stable: ties by token index
    slots, counts = ref_slots(out.expert_ids, E, order)
    assert torch.equal(r.slots, slots) and torch.equal(r.counts, counts)
    plain, _ = route(p, x, spec, num_experts=E)
    assert not torch.equal(plain.slots, r.slots)                   # the order is exercised
    # The most important tokens keep their first choice when capacity is short.
    C = r.capacity
    first_kept = r.kept()[0]
    assert all(first_kept[t] for t in order[:C])


def test_route_alignment_and_static_capacity():
    spec = GateSpec(type="qwen", k=2, capacity_factor=0.0)
    p = _params(spec, 8, M, seed=16)
    x = torch.randn(T, M, generator=_gen(17))
    r0, _ = route(p, x, spec, num_experts=8)
    r3, _ = route(p, x, spec, num_experts=8, alignment=3)
    assert r3.capacity == -(-r0.capacity // 3) * 3
    r, _ = route(p, x, spec, num_experts=8, capacity=T)
    assert r.capacity == T and int(r.num_dropped()) == 0


# --------------------------------------------------------------------------- expert choice

def ref_expert_choice(scores, C):
    """Each expert (column) takes its C best tokens, best first."""
    E = scores.shape[1]
    chosen = []
    for e in range(E):
        col = scores[:, e].tolist()
        chosen.append(_sorted_desc(col)[:C])
    return chosen


@pytest.mark.parametrize("k,cf", [(1, 1.0), (2, 1.0), (2, 0.5), (2, 20.0)])
def test_expert_choice_matches_loop(k, cf):
    E = 4
    spec = GateSpec(type="expert_choice", k=k, capacity_factor=cf)
    p = _params(spec, E, M, seed=18)
    x = torch.randn(T, M, generator=_gen(19))
    r, out = route(p, x, spec, num_experts=E, alignment=4)
    C = min(T, int(cf * math.ceil(k * T / E)))
    assert out.capacity == C == routers.expert_choice_capacity(cf, k, T, E)
    chosen = ref_expert_choice(out.scores, C)
    ids = torch.full((E, T), -1)
    slots = torch.full((E, T), -1)
    w = torch.zeros(E, T)
    for e in range(E):
        for rank, t in enumerate(chosen[e]):
            ids[e, t], slots[e, t], w[e, t] = e, rank, out.scores[t, e]
    assert torch.equal(r.expert_ids, ids) and torch.equal(r.slots, slots)
    torch.testing.assert_close(r.weights, w, rtol=0, atol=0)
    # Invariants: every expert takes exactly C tokens; nothing is dropped; aligned buffer.
    assert r.counts.tolist() == [C] * E and int(r.num_dropped()) == 0
    assert r.capacity == -(-C // 4) * 4 and r.k == E
    y = fmoe.combine(fmoe.dispatch(x, r), r)
    torch.testing.assert_close(y, ref_combine_identity(x, ids, slots, w, r.capacity))
    if cf == 20.0:
        assert C == T and (r.expert_ids >= 0).all()                # every expert takes every token


def test_expert_choice_errors_and_capacity_override():
    E = 4
    spec = GateSpec(type="expert_choice", k=1, capacity_factor=1.0)
    p = _params(spec, E, M)
    x = torch.randn(8, M, generator=_gen(0))
    r, out = route(p, x, spec, num_experts=E, capacity=5)
    assert r.capacity == 5 and out.capacity == 2
    with pytest.raises(ValueError, match=r"capacity=1 is below the expert-choice C=2"):
        route(p, x, spec, num_experts=E, capacity=1)
    with pytest.raises(ValueError, match="batch_prioritized has no meaning for type='expert_choice'"):
        route(p, x, spec, num_experts=E, batch_prioritized=True)
    with pytest.raises(ValueError, match=r"expert-choice capacity is 0: .*int\(0.1 \* ceil\(1 \* 8 / 4\)\) = 0"):
        route(p, x, dataclasses.replace(spec, capacity_factor=0.1), num_experts=E)


# --------------------------------------------------------------------------- Sinkhorn

def test_sinkhorn_balance_matches_loop_and_converges():
    g = _gen(20)
    logits = torch.randn(16, 4, generator=g, dtype=torch.float64) * 2 + torch.tensor([3.0, 0, 0, -2], dtype=torch.float64)
    P = routers.sinkhorn_balance(logits, iters=12)
    torch.testing.assert_close(P, ref_sinkhorn_matrix(logits, 12), rtol=1e-10, atol=1e-12)
    P = routers.sinkhorn_balance(logits.float(), iters=200)
    assert P.dtype == torch.float32
    torch.testing.assert_close(P.sum(1), torch.ones(16), rtol=0, atol=1e-4)
    torch.testing.assert_close(P.sum(0), torch.full((4,), 4.0), rtol=0, atol=1e-4)
    # tol > 0 stops early once the rows are within tol; a huge logit does not overflow.
    Pt = routers.sinkhorn_balance(logits, iters=1000, tol=1e-6)
    assert (Pt.sum(1) - 1).abs().max() <= 1e-6
    big = routers.sinkhorn_balance(logits * 100, iters=50)
    assert torch.isfinite(big).all()


def test_sinkhorn_router_balances_a_skewed_batch():
    E, k, Tn = 4, 1, 64
    x = torch.randn(Tn, M, generator=_gen(21)) + 0.5
    wg = torch.randn(E, M, generator=_gen(22)) * 0.3
    wg[0] += 0.2                                           # expert 0 is everybody's favourite
    top = GateSpec(k=k, capacity_factor=0.0)
    sk = GateSpec(type="sinkhorn", k=k, capacity_factor=0.0, sinkhorn_iters=50)
    r_top, _ = route({"wg": wg}, x, top, num_experts=E)
    r_sk, out = route({"wg": wg}, x, sk, num_experts=E)
    assert r_top.counts.max() > 2 * Tn // E                 # plain top-k collapses
    assert r_sk.counts.max() < r_top.counts.max() and r_sk.counts.max() <= Tn // E + 4
    # ids: top-k of the balanced matrix (loop); weights: the unbalanced softmax at those ids.
    P = ref_sinkhorn_matrix(out.logits, 50)
    assert out.expert_ids[0].tolist() == [_sorted_desc(row)[0] for row in P.tolist()]
    torch.testing.assert_close(out.weights, out.scores.t().gather(0, out.expert_ids), rtol=0, atol=0)
    torch.testing.assert_close(out.scores, torch.softmax(out.logits, 1), rtol=0, atol=0)


def test_sinkhorn_k2_weights_match_loop():
    E = 6
    spec = GateSpec(type="sinkhorn", k=2, capacity_factor=0.0, sinkhorn_iters=8)
    p = _params(spec, E, M, seed=23)
    x = torch.randn(T, M, generator=_gen(24))
    out = router_forward(p, x, spec, num_experts=E)
    P = ref_sinkhorn_matrix(out.logits, 8)
    s = out.scores
    for t in range(T):
        order = _sorted_desc(P[t].tolist())[:2]
        assert out.expert_ids[:, t].tolist() == order
        w = s[t, order]
        torch.testing.assert_close(out.weights[:, t], w / w.sum())


# --------------------------------------------------------------------------- noise

def test_gate_noise_is_reproducible_with_a_generator():
    E = 6
    spec = GateSpec(k=2, gate_noise=1.0)
    p = _params(spec, E, M, seed=25)
    x = torch.randn(T, M, generator=_gen(26))
    a = router_forward(p, x, spec, num_experts=E, training=True, generator=_gen(7))
    b = router_forward(p, x, spec, num_experts=E, training=True, generator=_gen(7))
    c = router_forward(p, x, spec, num_experts=E, training=True, generator=_gen(8))
    assert torch.equal(a.weights, b.weights) and torch.equal(a.noisy_logits, b.noisy_logits)
    assert not torch.equal(a.noisy_logits, c.noisy_logits)
    eps = torch.randn((T, E), generator=_gen(7))
    d = router_forward(p, x, spec, num_experts=E, training=True, noise=eps)
    assert torch.equal(d.noisy_logits, a.noisy_logits)
    torch.testing.assert_close(d.noisy_logits, d.logits + eps * (1.0 / E), rtol=0, atol=0)
    rid, rw = ref_tutel(p, x, spec, True, noise=eps)
    assert torch.equal(d.expert_ids, rid)
    torch.testing.assert_close(d.weights, rw)
    ev = router_forward(p, x, spec, num_experts=E, generator=_gen(7))          # eval: no noise
    assert torch.equal(ev.noisy_logits, ev.logits)
    # Expert choice and Sinkhorn take the same noise.
    for gtype in ("expert_choice", "sinkhorn"):
        s2 = GateSpec(type=gtype, k=2, gate_noise=1.0)
        o = router_forward(p, x, s2, num_experts=E, training=True, noise=eps)
        torch.testing.assert_close(o.noisy_logits, o.logits + eps * (1.0 / E), rtol=0, atol=0)
    with pytest.raises(ValueError, match="noise= is for the Tutel-style routers"):
        router_forward(_params(GateSpec(type="qwen"), E, M), x, GateSpec(type="qwen"), num_experts=E, noise=eps)


# --------------------------------------------------------------------------- torch.func

def _fd_check(f, wg, entries, h=1e-6, rtol=1e-5):
    g = torch.func.grad(f)(wg)
    for idx in entries:
        e = torch.zeros_like(wg)
        e[idx] = h
        fd = (f(wg + e) - f(wg - e)) / (2 * h)
        assert abs(float(g[idx]) - float(fd)) <= rtol * max(1.0, abs(float(fd))), (idx, float(g[idx]), float(fd))
    return g


@pytest.mark.parametrize("gtype", ["top", "deepseek", "sinkhorn", "qwen", "expert_choice"])
def test_grad_through_router_weights_matches_finite_differences(gtype):
    E = 6
    kw = {"n_group": 3, "topk_group": 2, "routed_scaling_factor": 2.0} if gtype == "deepseek" else {}
    spec = GateSpec(type=gtype, k=2, fp32_gate=False, capacity_factor=1.0, **kw)
    p = _params(spec, E, M, seed=27, dtype=torch.float64)
    x = torch.randn(16, M, generator=_gen(28), dtype=torch.float64)
    coef = torch.randn(E if gtype == "expert_choice" else 2, 16, generator=_gen(29), dtype=torch.float64)

    def f(wg):
        out = router_forward({**p, "wg": wg}, x, spec, num_experts=E)
        return (out.weights * coef).sum() + 0.1 * losses.z_loss(out.logits)

    # Qwen's softmax runs in fp32 by the architecture's definition, so its check is fp32-accurate.
    h, rtol = (1e-3, 2e-3) if gtype == "qwen" else (1e-6, 1e-5)
    g = _fd_check(f, p["wg"], [(0, 0), (1, 3), (5, 11), (2, 7)], h=h, rtol=rtol)
    assert g.abs().sum() > 0


def test_vmap_over_gate_weights():
    E, S = 6, 3
    x = torch.randn(T, M, generator=_gen(30))
    for spec in (GateSpec(k=2), GateSpec(type="deepseek", k=2, n_group=3, topk_group=2),
                 GateSpec(type="sinkhorn", k=2), GateSpec(type="expert_choice", k=2)):
        stacked = torch.randn(S, E, M, generator=_gen(31))
        base = _params(spec, E, M)

        def weights(wg):
            out = router_forward({**base, "wg": wg}, x, spec, num_experts=E)
            return out.weights, out.expert_ids

        vw, vi = torch.func.vmap(weights)(stacked)
        for s in range(S):
            w, i = weights(stacked[s])
            assert torch.equal(vi[s], i), spec.type
            torch.testing.assert_close(vw[s], w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("spec,capacity", [
    (GateSpec(k=2, capacity_factor=0.0), 2 * T),                 # dropless needs a static capacity under vmap
    (GateSpec(type="deepseek", k=2, n_group=3, topk_group=2, capacity_factor=1.0), None),
    (GateSpec(type="expert_choice", k=2), 10),
])
def test_vmap_route_over_gate_weights(spec, capacity):
    E = 6
    x = torch.randn(T, M, generator=_gen(37))
    base = _params(spec, E, M)

    def f(wg):
        r, _ = route({**base, "wg": wg}, x, spec, num_experts=E, capacity=capacity)
        return r.expert_ids, r.slots, r.weights, r.counts

    stacked = torch.randn(3, E, M, generator=_gen(38))
    batched = torch.func.vmap(f)(stacked)
    for s in range(3):
        for b, one in zip(batched, f(stacked[s])):
            assert torch.equal(b[s], one)


def test_router_output_is_a_pytree():
    spec = GateSpec(type="expert_choice", k=2)
    p = _params(spec, 4, M)
    out = router_forward(p, torch.randn(8, M, generator=_gen(0)), spec, num_experts=4)
    leaves, tree = torch.utils._pytree.tree_flatten(out)
    back = torch.utils._pytree.tree_unflatten(leaves, tree)
    assert back.capacity == out.capacity == 4 and back.type == "expert_choice"
    assert torch.equal(back.slots, out.slots) and back.importance is None


# --------------------------------------------------------------------------- losses

S_R1 = torch.tensor([
    [0.5, 0.25, 0.125, 0.125], [0.4375, 0.125, 0.3125, 0.125], [0.25, 0.625, 0.0625, 0.0625],
    [0.375, 0.1875, 0.125, 0.3125], [0.125, 0.0625, 0.75, 0.0625], [0.5625, 0.25, 0.125, 0.0625],
    [0.15625, 0.125, 0.3125, 0.40625], [0.1875, 0.6875, 0.0625, 0.0625]], dtype=torch.float64)


def test_tutel_losses_golden_values():
    top1 = S_R1.argmax(1)
    assert float(losses.gshard_loss(S_R1, top1)) == 1.130859375            # routing.md §10.1, exact
    assert float(losses.switch_loss(S_R1, top1)) == 1.130859375
    lg = S_R1.log()
    torch.testing.assert_close(losses.load_importance_loss(lg, lg, 2, 1.0), torch.tensor(0.0448405, dtype=torch.float64),
                               rtol=0, atol=5e-7)
    torch.testing.assert_close(losses.load_importance_loss(lg, lg, 2, 4.0), torch.tensor(0.0448742, dtype=torch.float64),
                               rtol=0, atol=5e-7)
    z = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in lg.tolist()) / 8
    torch.testing.assert_close(losses.z_loss(lg), torch.tensor(z, dtype=torch.float64))


def test_balance_losses_hand_formulas():
    g = _gen(32)
    Tn, E, k = 12, 4, 2
    logits = torch.randn(Tn, E, generator=g, dtype=torch.float64)
    p = torch.softmax(logits, 1)
    ids = p.topk(k, 1).indices
    f = [sum(int(e in ids[t].tolist()) for t in range(Tn)) / Tn for e in range(E)]
    P = p.mean(0).tolist()
    hf = E * sum(f[e] * P[e] for e in range(E))
    torch.testing.assert_close(losses.load_balancing_loss(logits, k), torch.tensor(hf, dtype=torch.float32))
    # sequence_aux: two sequences of 6, sigmoid affinities, hand f/P per sequence.
    s = torch.sigmoid(logits)
    tot = 0.0
    for b in range(2):
        rows = range(6 * b, 6 * b + 6)
        fe = [E / (k * 6) * sum(int(e in ids[t].tolist()) for t in rows) for e in range(E)]
        Pe = [sum(s[t, e].item() / s[t].sum().item() for t in rows) / 6 for e in range(E)]
        tot += 0.3 * sum(fe[e] * Pe[e] for e in range(E))
    torch.testing.assert_close(losses.sequence_aux_loss(s.reshape(2, 6, E), ids.reshape(2, 6, k), alpha=0.3),
                               torch.tensor(tot / 2, dtype=torch.float64))
    # global_aux: counts from two micro-batches accumulated = one batch of both.
    counts = torch.tensor([9, 5, 7, 3])
    want = E * sum(counts[e].item() / (k * 12) * p[:, e].mean().item() for e in range(E))
    torch.testing.assert_close(losses.global_aux_loss(p, counts, k=k), torch.tensor(want, dtype=torch.float64))
    c1, c2 = torch.tensor([5, 2, 4, 1]), torch.tensor([4, 3, 3, 2])
    acc = losses.global_aux_loss(p[:6], c1 + c2, k=k, num_tokens=12, comm=fmoe.comm.LocalComm())
    want = E * sum((c1 + c2)[e].item() / (k * 12) * p[:6, e].mean().item() for e in range(E))
    torch.testing.assert_close(acc, torch.tensor(want, dtype=torch.float64))
    # Uniform scores with balanced counts: exactly 1.
    assert float(losses.global_aux_loss(torch.full((8, 4), 0.25), torch.tensor([4, 4, 4, 4]), k=2)) == 1.0
    with pytest.raises(ValueError, match=r"global_aux_loss: scores must be \[T, E\] and counts \[E\]"):
        losses.global_aux_loss(p, counts[:3], k=k)
    with pytest.raises(ValueError, match="covers? no tokens"):
        losses.global_aux_loss(p, counts, k=k, num_tokens=0)


def test_aux_free_bias_update():
    bias = torch.tensor([0.0, 0.1, -0.1, 0.0])
    load = torch.tensor([10, 2, 6, 6])                    # mean 6
    new = losses.aux_free_bias_update(bias, load, 0.01)
    torch.testing.assert_close(new, torch.tensor([-0.01, 0.11, -0.1, 0.0]), rtol=0, atol=0)
    assert torch.equal(bias, torch.tensor([0.0, 0.1, -0.1, 0.0]))   # not in place
    # Repeated steps with the DeepSeek router (bias steers selection only) even out the load.
    E, k = 8, 2
    spec = GateSpec(type="deepseek", k=k, capacity_factor=0.0)
    p = _params(spec, E, M, seed=33)
    p["correction_bias"] = torch.zeros(E)
    x = torch.randn(64, M, generator=_gen(34))
    p["wg"][0] += x.mean(0) * 2
    first = None
    for _ in range(60):
        r, out = route(p, x, spec, num_experts=E)
        load = losses.expert_load(out.expert_ids, E)
        assert torch.equal(load, r.counts)
        first = load if first is None else first
        p = {**p, "correction_bias": losses.aux_free_bias_update(p["correction_bias"], load, 0.01)}
    assert load.max() - load.min() < first.max() - first.min()
    with pytest.raises(ValueError, match=r"bias \(4,\) and load \(3,\) must both be \[E\]"):
        losses.aux_free_bias_update(bias, load[:3], 0.1)


@pytest.mark.parametrize("gtype", routers.ROUTER_TYPES)
def test_every_loss_for_every_router(gtype):
    E, k = 4, 2
    noise = 1.0 if gtype in ("top", "cosine_top", "expert_choice", "sinkhorn") else 0.0
    spec = GateSpec(type=gtype, k=k, gate_noise=noise, proj_dim=8)
    p = _params(spec, E, M, seed=35)
    x = torch.randn(16, M, generator=_gen(36))
    r, out = route(p, x, spec, num_experts=E, training=True, generator=_gen(1))
    top1 = out.scores.argmax(1) if gtype == "expert_choice" else r.expert_ids[0]
    assert torch.equal(losses.router_loss("gshard", out, r, k=k), losses.gshard_loss(out.scores, top1))
    assert torch.equal(losses.router_loss("switch", out, r, k=k), losses.gshard_loss(out.scores, top1))
    assert torch.equal(losses.router_loss("z", out, r, k=k), losses.z_loss(out.logits.float()))
    assert torch.equal(losses.router_loss("load_balancing", out, r, k=k), losses.load_balancing_loss(out.logits, k))
    li = losses.router_loss("load_importance", out, r, k=k, gate_noise=1.0)
    noisy = out.logits if out.noisy_logits is None else out.noisy_logits
    assert torch.equal(li, losses.load_importance_loss(out.logits, noisy, k, 1.0))
    ids = r.expert_ids.t()
    seq = losses.router_loss("sequence_aux", out, r, k=k, seq_len=8)
    assert torch.equal(seq, losses.sequence_aux_loss(out.scores.reshape(2, 8, E), ids.reshape(2, 8, -1), k=k))
    ga = losses.router_loss("global_aux", out, r, k=k)
    assert torch.equal(ga, losses.global_aux_loss(out.scores, r.counts, k=k))
    for kind in losses.LOSS_KINDS:
        v = losses.router_loss(kind, out, r, k=k, gate_noise=1.0, seq_len=8)
        assert v.dim() == 0 and torch.isfinite(v), kind
    with pytest.raises(ValueError, match="unknown loss kind 'l2'"):
        losses.router_loss("l2", out, r, k=k)
    with pytest.raises(ValueError, match=r"seq_len=5 must be an int >= 1 dividing T=16"):
        losses.router_loss("sequence_aux", out, r, k=k, seq_len=5)
    with pytest.raises(ValueError, match="needs gate_noise > 0"):
        losses.router_loss("load_importance", out, r, k=k)


def test_router_input_errors():
    spec = GateSpec(k=2)
    p = _params(spec, 4, M)
    with pytest.raises(ValueError, match=r"router input must be tokens \[T, M\], got shape \(2, 3, 12\)"):
        router_forward(p, torch.zeros(2, 3, M), spec, num_experts=4)
    with pytest.raises(TypeError, match="router input must be floating point"):
        router_forward(p, torch.zeros(3, M, dtype=torch.int64), spec, num_experts=4)
    with pytest.raises(ValueError, match=r"gate.wg must be \[E, M\] = \[4, 5\]"):
        router_forward(p, torch.zeros(3, 5), spec, num_experts=4)
    with pytest.raises(TypeError, match="expected a fmoe.routers.GateSpec"):
        router_forward(p, torch.zeros(3, M), {"type": "top"}, num_experts=4)
    ds = GateSpec(type="deepseek", k=3, n_group=2, topk_group=1)
    with pytest.raises(ValueError, match=r"k=3 exceeds the 2 experts of topk_group=1 groups of 2"):
        router_forward(_params(ds, 4, M), torch.zeros(3, M), ds, num_experts=4)
    q = GateSpec(type="qwen", k=5)
    with pytest.raises(ValueError, match=r"k must be an int in \[1, E=4\], got 5"):
        router_forward(_params(q, 4, M), torch.zeros(3, M), q, num_experts=4)


# --------------------------------------------------------------------------- Tutel golden values

# Measured with Tutel 0.4 (CosineTopKGate(fp32_gate=True) on these weights, softmax, then
# tutel.impls.fast_dispatch.extract_critical(scores, 2, capacity_factor=1.0,
# batch_prioritized_routing=bp)) on CPU; Tutel itself is not needed to run this test.
TUTEL_COSINE = {
    "ids": [[1, 3, 1, 1, 3, 2, 1, 3], [2, 0, 2, 0, 0, 1, 2, 0]],
    "loc": {False: [[0, 0, 1, 2, 1, 0, 3, 2], [1, 0, 2, 1, 2, 4, 3, 3]],
            True: [[2, 0, 3, 0, 1, 0, 1, 2], [2, 1, 3, 0, 2, 4, 1, 3]]},
    "gate0": [0.811863899230957, 0.650268018245697, 0.7541906237602234, 0.9207395315170288, 0.6527549624443054,
              0.5975350141525269, 0.8814035058021545, 0.634331464767456],
    "cap": 4,
    "l_aux": 1.3216021060943604,
}


@pytest.mark.parametrize("bp", [False, True])
def test_cosine_router_matches_tutel_golden(bp):
    Tn, Mn, E, P = 8, 4, 4, 3
    x = torch.tensor([[((t * 7 + m * 3) % 11 - 5) / 4 for m in range(Mn)] for t in range(Tn)])
    p = {"proj_w": torch.tensor([[((i * 5 + j) % 7 - 3) / 4 for j in range(Mn)] for i in range(P)]),
         "proj_b": torch.tensor([0.25, -0.5, 0.125]),
         "sim_matrix": torch.tensor([[((i * 3 + e * 2) % 5 - 2) / 2 for e in range(E)] for i in range(P)]),
         "temperature": torch.log(torch.full([1], 2.0))}
    spec = GateSpec(type="cosine_top", k=2, capacity_factor=1.0, proj_dim=P)
    r, out = route(p, x, spec, num_experts=E, batch_prioritized=bp)
    assert r.expert_ids.tolist() == TUTEL_COSINE["ids"] and r.capacity == TUTEL_COSINE["cap"]
    assert r.slots.tolist() == TUTEL_COSINE["loc"][bp]
    g0 = torch.tensor(TUTEL_COSINE["gate0"])
    assert torch.equal(r.weights[0], g0)                     # bit-exact with Tutel
    torch.testing.assert_close(r.weights[1], 1 - g0, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(losses.router_loss("gshard", out, r, k=2), torch.tensor(TUTEL_COSINE["l_aux"]),
                               rtol=1e-6, atol=0)


# --------------------------------------------------------------------------- two ranks (torchrun, gloo)

_TWO_RANKS = r'''
import json, sys, torch
from fmoe import losses
from fmoe.comm import from_env
from fmoe.routers import GateSpec, route
comm = from_env("torch", timeout=60)
x_all = torch.randn(20, 6, generator=torch.Generator().manual_seed(0))
x = x_all[:12] if comm.rank == 0 else x_all[12:]              # unequal local batches
p = {"wg": torch.randn(4, 6, generator=torch.Generator().manual_seed(1))}
r, out = route(p, x, GateSpec(k=2, capacity_factor=0.0), num_experts=4, comm=comm)
ga = losses.router_loss("global_aux", out, r, k=2, comm=comm)
r2, o2 = route(p, x, GateSpec(type="expert_choice", k=1, capacity_factor=1.0), num_experts=4, comm=comm)
# one write() per line: both ranks share torchrun's stdout pipe, and print() may split a line in two
sys.stdout.write("RESULT " + json.dumps({"rank": comm.rank, "ga": float(ga), "cap": r.capacity, "ec_C": o2.capacity,
                                         "ec_cap": r2.capacity}) + "\n")
sys.stdout.flush()
comm.close()
'''


@pytest.mark.skipif(not os.path.exists(os.path.join(os.path.dirname(sys.executable), "torchrun")),
                    reason="torchrun not found")
def test_global_aux_and_capacities_agree_over_two_ranks(tmp_path):
    script = tmp_path / "two_ranks.py"
    script.write_text(_TWO_RANKS)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    proc = subprocess.run([torchrun, "--standalone", "--nproc_per_node=2", str(script)], capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    got = {d["rank"]: d for d in (json.loads(line[7:]) for line in proc.stdout.splitlines()
                                  if line.startswith("RESULT "))}
    assert sorted(got) == [0, 1]
    # One process: the global fractions come from both ranks' counts, P from each rank's own tokens.
    x_all = torch.randn(20, 6, generator=torch.Generator().manual_seed(0))
    p = {"wg": torch.randn(4, 6, generator=torch.Generator().manual_seed(1))}
    parts = [route(p, xs, GateSpec(k=2, capacity_factor=0.0), num_experts=4) for xs in (x_all[:12], x_all[12:])]
    counts = parts[0][0].counts + parts[1][0].counts
    for rank, (r, out) in enumerate(parts):
        want = 4 * sum(counts[e].item() / (2 * 20) * out.scores[:, e].mean().item() for e in range(4))
        assert got[rank]["ga"] == pytest.approx(want, rel=1e-6)
        assert got[rank]["cap"] == max(int(parts[0][0].counts.max()), int(parts[1][0].counts.max()))
    # Expert choice: C from each rank's own T (ceil(12/4) = 3, ceil(8/4) = 2); buffers agree on the max.
    assert (got[0]["ec_C"], got[1]["ec_C"]) == (3, 2) and got[0]["ec_cap"] == got[1]["ec_cap"] == 3


def test_noisy_scores_keep_the_top_k_gate_check():
    # without noise the router's scores are a softmax of logits check_finite passed, and top-k skips
    # its non-negativity read; an explicit noise tensor holding NaN still gets a clear error
    from fmoe.routers import GateSpec, init_router, router_forward
    spec = GateSpec(type="top", k=2, gate_noise=1.0)
    g = torch.Generator().manual_seed(0)
    params = init_router(spec, 4, 8, generator=g)
    x = torch.randn(3, 8, generator=g)
    out = router_forward(params, x, spec, num_experts=4)   # eval: no noise
    vals, ids = torch.topk(out.scores, 2, dim=1)
    assert torch.equal(out.expert_ids, ids.t()) and torch.equal(out.weights, (vals / vals.sum(1, keepdim=True)).t())
    noise = torch.zeros(3, 4)
    noise[1, 2] = float("nan")
    with pytest.raises(ValueError, match="top_k: normalize=True divides the k gates by their sum"):
        router_forward(params, x, spec, num_experts=4, training=True, noise=noise)
