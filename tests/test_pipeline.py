"""The one pipeline: both layouts from one Routing, every router x layout against a per-token
loop, the ragged ops under torch.func / compile / opcheck, architecture blocks with a finite
capacity factor."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

import fmoe
from fmoe.layout import make_layout, padded_layout, ragged_layout
from fmoe.ops import primitives, reference
from fmoe.models import deepseek_v3, gpt_oss, mixtral, qwen2_moe, qwen3_moe

DT = torch.float64


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _routing(T=11, E=5, k=2, cf=0.0, seed=0, masked=False):
    g = _gen(seed)
    scores = torch.rand(T, E, generator=g, dtype=DT)
    ids, w = fmoe.top_k(scores, k)
    if masked:
        ids = ids.clone()
        ids[1, ::3] = -1
    return fmoe.make_routing(ids, w, E, cf)


# --------------------------------------------------------------------------- layouts

@pytest.mark.parametrize("cf,masked", [(0.0, False), (0.0, True), (0.6, False), (-0.5, True)])
def test_ragged_layout_is_sorted_contiguous_and_unpadded(cf, masked):
    r = _routing(cf=cf, masked=masked)
    lay = ragged_layout(r)
    kept = r.kept()
    N = int(kept.sum())
    assert lay.num_rows == r.k * r.num_tokens and lay.kind == "ragged"
    assert lay.offsets.tolist() == [0] + torch.cumsum(r.counts.clamp(max=r.capacity), 0).tolist()
    assert int(lay.offsets[-1]) == N
    rows = lay.positions[kept]
    assert sorted(rows.tolist()) == list(range(N))            # every kept pair one row, no gaps
    assert torch.all(lay.positions[~kept] == -1)
    # rows sorted by expert, and within an expert in Tutel's slot-major order (the padded slots)
    order = torch.argsort(rows)
    ids, slots = r.expert_ids[kept][order], r.slots[kept][order]
    assert torch.all(ids[1:] >= ids[:-1])
    for e in range(r.num_experts):
        assert slots[ids == e].tolist() == list(range(int((ids == e).sum())))
    pad = padded_layout(r)
    assert pad.num_rows == r.num_experts * r.capacity
    assert torch.equal(pad.positions, r.positions())


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_ragged_dispatch_combine_equal_reference_bit_for_bit(weighted, dtype):
    r = _routing(T=23, E=6, k=3, masked=True, seed=3)
    lay = ragged_layout(r)
    x = torch.randn(23, 9, generator=_gen(4)).to(dtype)
    w = r.weights.to(dtype) if weighted else None
    d = fmoe.dispatch(x, dataclasses.replace(r, weights=r.weights.to(dtype)), weighted=weighted, layout=lay)
    assert d.shape == (lay.num_rows, 9)
    assert torch.equal(d, reference.dispatch(x, lay.positions, w, lay.num_rows))
    assert torch.all(d[int(lay.offsets[-1]):] == 0)           # rows past the last group stay zero
    y = torch.randn(lay.num_rows, 9, generator=_gen(5)).to(dtype)
    c = fmoe.combine(y, dataclasses.replace(r, weights=r.weights.to(dtype)), weighted=weighted, layout=lay)
    assert torch.equal(c, reference.combine(y, lay.positions, w))
    # the ragged buffer holds the padded buffer's filled rows, in order
    pad = fmoe.dispatch(x, dataclasses.replace(r, weights=r.weights.to(dtype)), weighted=weighted)
    for e in range(r.num_experts):
        n = int(lay.sizes[e])
        s = int(lay.starts[e])
        assert torch.equal(d[s:s + n], pad[e, :n])


def test_ragged_ops_gradcheck_gradgradcheck_and_opcheck():
    r = _routing(T=7, E=4, k=2, masked=True, seed=6)
    lay = ragged_layout(r)
    x = torch.randn(7, 3, dtype=DT, generator=_gen(7), requires_grad=True)
    w = r.weights.clone().requires_grad_(True)
    y = torch.randn(lay.num_rows, 3, dtype=DT, generator=_gen(8), requires_grad=True)

    def rr(weights):
        return dataclasses.replace(r, weights=weights)

    assert torch.autograd.gradcheck(lambda x, w: fmoe.dispatch(x, rr(w), weighted=True, layout=lay), (x, w))
    assert torch.autograd.gradgradcheck(lambda x, w: fmoe.dispatch(x, rr(w), weighted=True, layout=lay), (x, w))
    assert torch.autograd.gradcheck(lambda y, w: fmoe.combine(y, rr(w), layout=lay), (y, w))
    assert torch.autograd.gradgradcheck(lambda y, w: fmoe.combine(y, rr(w), layout=lay), (y, w))
    assert torch.autograd.gradcheck(lambda a, b: fmoe.gate_grad(a, b, r, layout=lay), (x, y))
    pos = lay.positions
    torch.library.opcheck(primitives._dispatch_op, (x.detach(), pos, w.detach(), lay.num_rows))
    torch.library.opcheck(primitives._combine_op, (y.detach(), pos, w.detach()))
    torch.library.opcheck(primitives._gate_grad_op, (x.detach(), y.detach(), pos))


def _moe_spec(gate, expert_type="ffn", layout="auto", postscore=True, E=6, M=8):
    experts = fmoe.ExpertSpec(type=expert_type, hidden_size=10)
    return fmoe.MoESpec(model_dim=M, num_experts=E, gate=gate, experts=experts, layout=layout,
                        is_postscore=postscore, normalize_gate=gate.type != "expert_choice")


def test_ragged_moe_under_vmap_jvp_and_compile():
    # fp64 gate: finite differences through a float32 gate would measure its rounding
    spec = _moe_spec(fmoe.GateSpec(k=2, capacity_factor=0.0, fp32_gate=False))
    assert spec.layout_kind() == "ragged"
    p = fmoe.init_params(spec, generator=_gen(9), dtype=DT)
    xs = torch.randn(3, 10, 8, dtype=DT, generator=_gen(10))
    f = lambda x: fmoe.moe(p, x, spec)[0]  # noqa: E731
    ys = torch.func.vmap(f)(xs)
    for i in range(3):
        torch.testing.assert_close(ys[i], f(xs[i]), rtol=0, atol=1e-12)
    t = torch.randn_like(xs[0])
    _, jv = torch.func.jvp(f, (xs[0],), (t,))
    eps = 1e-6
    torch.testing.assert_close(jv, (f(xs[0] + eps * t) - f(xs[0] - eps * t)) / (2 * eps), rtol=1e-5, atol=1e-6)
    x = xs[0].float()
    p32 = pytree.tree_map(lambda a: a.float(), p)
    g = lambda p, x: torch.func.grad(lambda q: fmoe.moe(q, x, spec)[0].square().sum())(p)  # noqa: E731
    compiled = torch.compile(lambda x: fmoe.moe(p32, x, spec)[0], fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), fmoe.moe(p32, x, spec)[0], rtol=1e-6, atol=1e-6)
    gv = torch.func.vmap(g, in_dims=(None, 0))(p, xs)
    for i in range(3):
        for a, b in zip(pytree.tree_leaves(gv), pytree.tree_leaves(g(p, xs[i]))):
            torch.testing.assert_close(a[i], b, rtol=1e-9, atol=1e-12)


# --------------------------------------------------------------------------- every router x layout vs a loop

def _expert_row(spec, ep, e, v):
    """One expert on one token row v [M] with plain matmuls (the obviously-correct reference)."""
    t = spec.experts.type
    if t == "ffn":
        h = F.relu(ep["fc1_w"][e] @ v + ep["fc1_b"][e])
        return h @ ep["fc2_w"][e] + ep["fc2_b"][e]
    if t == "gated_ffn":
        return (F.silu(v @ ep["gate_w"][e]) * (v @ ep["up_w"][e])) @ ep["down_w"][e]
    if t == "swiglu":
        gate, up = (ep["gate_up_proj"][e] @ v).chunk(2)
        return ep["down_proj"][e] @ (F.silu(gate) * up)
    z = v @ ep["gate_up_proj"][e] + ep["gate_up_proj_bias"][e]
    gate, up = z[0::2].clamp(max=spec.experts.limit), z[1::2].clamp(-spec.experts.limit, spec.experts.limit)
    return ((up + 1) * gate * torch.sigmoid(gate * spec.experts.alpha)) @ ep["down_proj"][e] + ep["down_proj_bias"][e]


def _loop(spec, params, x, routing):
    """y[t] = sum over kept pairs (j, t) of w[j, t] * expert_e(x[t]) (or expert_e(w x[t]) pre-score)."""
    kept = routing.kept()
    y = torch.zeros(x.shape[0], spec.output_dim, dtype=x.dtype)
    for t in range(x.shape[0]):
        for j in range(routing.k):
            if kept[j, t]:
                e, w = int(routing.expert_ids[j, t]), routing.weights[j, t]
                if spec.is_postscore:
                    y[t] += w * _expert_row(spec, params["experts"], e, x[t])
                else:
                    y[t] += _expert_row(spec, params["experts"], e, w * x[t])
    return y


ROUTERS = [
    fmoe.GateSpec(type="top", k=2), fmoe.GateSpec(type="top", k=2, score_fn="sigmoid"),
    fmoe.GateSpec(type="cosine_top", k=2, proj_dim=4), fmoe.GateSpec(type="qwen", k=2),
    fmoe.GateSpec(type="deepseek", k=2, n_group=3, topk_group=2, routed_scaling_factor=1.5),
    fmoe.GateSpec(type="gpt_oss", k=2), fmoe.GateSpec(type="mixtral", k=2), fmoe.GateSpec(type="sinkhorn", k=2),
]


@pytest.mark.parametrize("layout", ["padded", "ragged"])
@pytest.mark.parametrize("cf", [0.0, 0.5])
@pytest.mark.parametrize("gate", ROUTERS, ids=lambda g: f"{g.type}-{g.score_fn}")
def test_every_router_and_layout_equals_token_loop(gate, cf, layout):
    spec = _moe_spec(dataclasses.replace(gate, capacity_factor=cf), layout=layout)
    p = fmoe.init_params(spec, generator=_gen(11), dtype=DT)
    p["experts"]["fc1_b"] = torch.randn(p["experts"]["fc1_b"].shape, generator=_gen(12), dtype=DT)
    p["experts"]["fc2_b"] = torch.randn(p["experts"]["fc2_b"].shape, generator=_gen(13), dtype=DT)
    x = torch.randn(30, 8, generator=_gen(14), dtype=DT)
    y, aux = fmoe.moe(p, x, spec)
    if cf > 0:
        assert int(aux.dropped) > 0                            # tight capacity: the drop path is exercised
    else:
        assert int(aux.dropped) == 0
    out = fmoe.routers.router_forward(p["gate"], x, spec.gate, num_experts=6, normalize=spec.normalize_gate)
    assert torch.equal(aux.routing.expert_ids, out.expert_ids) and torch.equal(aux.routing.weights, out.weights)
    torch.testing.assert_close(y, _loop(spec, p, x, aux.routing), rtol=1e-12, atol=1e-12)


def test_expert_choice_padded_equals_token_loop():
    spec = _moe_spec(fmoe.GateSpec(type="expert_choice", k=2, capacity_factor=1.0))
    assert spec.layout_kind() == "padded"
    p = fmoe.init_params(spec, generator=_gen(15), dtype=DT)
    x = torch.randn(30, 8, generator=_gen(16), dtype=DT)
    y, aux = fmoe.moe(p, x, spec)
    assert aux.routing.k == 6 and torch.all(aux.routing.counts == aux.routing.counts[0])
    torch.testing.assert_close(y, _loop(spec, p, x, aux.routing), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("expert_type", ["ffn", "gated_ffn", "swiglu", "gpt_oss"])
@pytest.mark.parametrize("postscore", [True, False])
def test_every_expert_type_ragged_equals_padded_and_loop(expert_type, postscore):
    gate = fmoe.GateSpec(type="top", k=3, capacity_factor=0.0)
    base = _moe_spec(gate, expert_type=expert_type, postscore=postscore)
    p = fmoe.init_params(base, generator=_gen(17), dtype=DT)
    p = pytree.tree_map(lambda t: t + 0.05 * torch.randn(t.shape, generator=_gen(18), dtype=DT), p)
    x = torch.randn(25, 8, generator=_gen(19), dtype=DT)
    outs, grads = {}, {}
    for layout in ("padded", "ragged"):
        spec = dataclasses.replace(base, layout=layout)
        q = pytree.tree_map(lambda t: t.clone().requires_grad_(True), p)
        y, aux = fmoe.moe(q, x, spec)
        y.square().sum().backward()
        outs[layout], grads[layout] = y.detach(), pytree.tree_map(lambda t: t.grad, q)
    torch.testing.assert_close(outs["ragged"], outs["padded"], rtol=1e-12, atol=1e-12)
    for a, b in zip(pytree.tree_leaves(grads["ragged"]), pytree.tree_leaves(grads["padded"])):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(outs["ragged"], _loop(base, p, x, aux.routing), rtol=1e-12, atol=1e-12)


def test_custom_experts_take_padded_buffers_and_refuse_ragged():
    def fn(params, x):
        return torch.einsum("ecm,emo->eco", x, params["w"])

    def init(E, M, spec, generator, dtype):
        return {"w": torch.randn(E, M, M, generator=generator, dtype=dtype)}

    ex = fmoe.ExpertSpec(type="custom", fn=fn, init=init)
    spec = fmoe.MoESpec(model_dim=8, num_experts=4, gate=fmoe.GateSpec(k=2, capacity_factor=0.0), experts=ex)
    assert spec.layout_kind() == "padded"
    p = fmoe.init_params(spec, generator=_gen(20), dtype=DT)
    x = torch.randn(9, 8, generator=_gen(21), dtype=DT)
    y, aux = fmoe.moe(p, x, spec)
    want = torch.zeros_like(y)
    for t in range(9):
        for j in range(2):
            e = int(aux.routing.expert_ids[j, t])
            want[t] += aux.routing.weights[j, t] * (x[t] @ p["experts"]["w"][e])
    torch.testing.assert_close(y, want)
    with pytest.raises(ValueError, match="custom experts take padded buffers"):
        dataclasses.replace(spec, layout="ragged")


def test_bad_layout_and_combine_settings_are_clear():
    gate = fmoe.GateSpec(k=2)
    with pytest.raises(ValueError, match="layout must be 'auto', 'padded' or 'ragged'"):
        _moe_spec(gate, layout="sparse")
    with pytest.raises(ValueError, match="combine must be one of"):
        dataclasses.replace(_moe_spec(gate), combine="fast")
    with pytest.raises(ValueError, match="needs is_postscore=True"):
        dataclasses.replace(_moe_spec(gate, postscore=False), combine="eager")
    r = _routing()
    with pytest.raises(ValueError, match=r"combine: y must be \[R, M\] = \[22, M\] \(ragged layout\)"):
        fmoe.combine(torch.randn(21, 3, dtype=DT), r, layout=ragged_layout(r))
    with pytest.raises(ValueError, match="unknown layout"):
        make_layout(r, "sparse")


# --------------------------------------------------------------------------- architecture blocks, finite capacity

def _block_case(arch, E=6, H=8, I=6, seed=30):
    g = _gen(seed)

    def rn(*s, scale=0.3):
        return torch.randn(*s, generator=g, dtype=DT) * scale

    swi = {"gate_up_proj": rn(E, 2 * I, H), "down_proj": rn(E, H, I)}
    if arch == "qwen3":
        return qwen3_moe, qwen3_moe.Qwen3MoeBlockConfig(hidden_size=H, num_experts=E, top_k=2, moe_intermediate_size=I,
                                                        norm_topk_prob=True), {"router": {"weight": rn(E, H)},
                                                                               "experts": swi}
    if arch == "qwen2":
        cfg = qwen2_moe.Qwen2MoeBlockConfig(hidden_size=H, num_experts=E, top_k=2, moe_intermediate_size=I,
                                            shared_expert_intermediate_size=5)
        return qwen2_moe, cfg, {"router": {"weight": rn(E, H)}, "experts": swi,
                                "shared": {"gate_proj": rn(5, H), "up_proj": rn(5, H), "down_proj": rn(H, 5)},
                                "shared_gate": {"weight": rn(1, H)}}
    if arch == "deepseek":
        cfg = deepseek_v3.DeepseekV3BlockConfig(hidden_size=H, num_experts=E, top_k=2, moe_intermediate_size=I,
                                                n_group=3, topk_group=2, routed_scaling_factor=2.0)
        return deepseek_v3, cfg, {"router": {"weight": rn(E, H), "e_score_correction_bias": rn(E, scale=0.1)},
                                  "experts": swi,
                                  "shared": {"gate_proj": rn(I, H), "up_proj": rn(I, H), "down_proj": rn(H, I)}}
    if arch == "mixtral":
        return mixtral, mixtral.MixtralBlockConfig(hidden_size=H, num_experts=E, top_k=2, intermediate_size=I), \
            {"router": {"weight": rn(E, H)}, "experts": swi}
    return gpt_oss, gpt_oss.GptOssBlockConfig(hidden_size=H, num_experts=E, top_k=2, intermediate_size=I), \
        {"router": {"weight": rn(E, H), "bias": rn(E)},
         "experts": {"gate_up_proj": rn(E, H, 2 * I), "gate_up_proj_bias": rn(E, 2 * I), "down_proj": rn(E, I, H),
                     "down_proj_bias": rn(E, H)}}


@pytest.mark.parametrize("layout", ["padded", "ragged"])
@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "deepseek", "mixtral", "gpt_oss"])
def test_architecture_blocks_with_finite_capacity(arch, layout):
    mod, cfg, params = _block_case(arch)
    x = torch.randn(40, 8, generator=_gen(31), dtype=DT)
    y0, aux0 = mod.moe_block(params, x, cfg)
    assert int(aux0.routing.num_dropped()) == 0
    capped = dataclasses.replace(cfg, capacity_factor=0.5, layout=layout)
    y, aux = mod.moe_block(params, x, capped)
    r = aux.routing
    assert int(r.num_dropped()) > 0 and torch.equal(r.expert_ids, aux0.routing.expert_ids)
    # the kept pairs' contributions, the dropped ones absent: y - y_capped is the dropped pairs' sum
    spec = mod.moe_spec(capped)
    dropped = dataclasses.replace(r, slots=torch.where(r.kept(), torch.full_like(r.slots, r.capacity), r.slots * 0))
    rest = _loop(spec, {"experts": params["experts"]}, x, dropped)
    torch.testing.assert_close(y + rest, y0, rtol=1e-10, atol=1e-10)


def _saved_bytes(fn):
    """Bytes of the distinct storages autograd keeps for backward while ``fn()`` builds its graph."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())
