"""What the decode call's trimmed host work relies on (issue 35): the router's Routing skips checks
that its own output holds by construction, and every routing a user makes, injects or loads keeps
them; the shortcuts (numpy fractions, cached expert forms, flat-dict dtype walk, no reshape of a
[T, M] input) give the same bits as the paths they replace."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

import fmoe
from fmoe import experts, losses, routers
from fmoe.routing import Routing, check_finite, make_routing

E, M = 16, 24


def _gate(spec, seed=0):
    return routers.init_router(spec, E, M, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("gtype,k", [("top", 1), ("top", 3), ("qwen", 4), ("deepseek", 4), ("gpt_oss", 2),
                                     ("mixtral", 2), ("sinkhorn", 2)])
@pytest.mark.parametrize("cf", [0.0, 1.0, -2.0])
@pytest.mark.parametrize("T", [1, 4, 37])
def test_router_routing_equals_make_routing(gtype, k, cf, T):
    kw = dict(n_group=4, topk_group=2) if gtype == "deepseek" else {}
    spec = routers.GateSpec(type=gtype, k=k, capacity_factor=cf, **kw)
    p = _gate(spec)
    x = torch.randn(T, M, generator=torch.Generator().manual_seed(T))
    for bp in (False, True):
        r, out = routers.route(p, x, spec, num_experts=E, batch_prioritized=bp, alignment=2)
        full = routers.router_forward(p, x, spec, num_experts=E)
        # importance: only where batch-prioritized placement reads it, then the router_forward's value
        assert (out.importance is None) != bp
        if bp:
            assert torch.equal(out.importance, full.importance)
        ref = make_routing(full.expert_ids, full.weights, E, cf, importance=full.importance if bp else None,
                           alignment=2)
        assert type(r) is Routing and (r.capacity, r.num_experts) == (ref.capacity, ref.num_experts)
        for n in ("expert_ids", "slots", "weights", "counts"):
            a, b = getattr(r, n), getattr(ref, n)
            assert a.dtype == b.dtype and torch.equal(a, b), n


def test_user_routings_keep_every_check():
    x = torch.randn(5, M)
    spec = routers.GateSpec(type="top", k=2, capacity_factor=0.0)
    r, out = routers.route(_gate(spec), x, spec, num_experts=E)
    bad = r.expert_ids.clone()
    bad[0, 0] = E
    with pytest.raises(ValueError, match=r"Routing.expert_ids has id 16, outside \[-1, E\)"):
        dataclasses.replace(r, expert_ids=bad)              # an injected or replaced routing
    with pytest.raises(IndexError, match="an expert id is >= num_experts=16"):
        make_routing(bad, r.weights, E, 0.0)                 # the slot walk
    with pytest.raises(TypeError, match="Routing.weights must be floating point"):
        make_routing(r.expert_ids, torch.ones(r.expert_ids.shape, dtype=torch.int64), E, 0.0)
    with pytest.raises(ValueError, match="Routing.capacity=1000000 exceeds the bound"):
        make_routing(r.expert_ids, r.weights, E, 0.0, capacity=10 ** 6)
    with pytest.raises(ValueError, match="Routing.capacity=1000000 exceeds the bound"):
        routers.route(_gate(spec), x, spec, num_experts=E, capacity=10 ** 6)   # a given capacity is checked
    with pytest.raises(ValueError, match=r"at least one expert column \(E >= 1\)"):
        routers.route({"wg": torch.zeros(0, M)}, x, spec, num_experts=0)
    # and fmoe.moe with an injected routing for other tokens
    mspec = fmoe.MoESpec(model_dim=M, num_experts=E, gate=spec, experts=fmoe.ExpertSpec(type="ffn", hidden_size=8))
    params = fmoe.init_params(mspec, generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="injected routing is for T=5"):
        fmoe.moe(params, torch.randn(4, M), mspec, routing=r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gshard_fractions_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(0)
    for T in list(range(1, 41)) + [97, 1000, 4099]:
        for n_exp in (3, 16, 64):
            ids = torch.randint(-1, n_exp, (T,), generator=g)
            want = (ids.reshape(-1, 1) == torch.arange(n_exp)).to(dtype).sum(0) / T   # the one-hot reference
            got = losses._fraction_routed(ids, n_exp, dtype)
            assert got.dtype == dtype and torch.equal(got, want), (T, n_exp)
            scores = torch.softmax(torch.randn(T, n_exp, generator=g, dtype=dtype), 1)
            assert torch.equal(losses.gshard_loss(scores, ids), n_exp * (scores.mean(0) * want).sum())


def test_check_finite_with_grad_records_nothing_and_still_raises():
    w = torch.randn(3, 4, requires_grad=True)
    t = w * 2
    check_finite(t, "t", "fix")
    assert t.grad_fn.name().startswith("Mul")
    bad = w * torch.tensor([1.0, float("nan"), 1.0, 1.0])
    with pytest.raises(ValueError, match=r"t holds non-finite values \(NaN\) in 3 of 3 rows"):
        check_finite(bad, "t", "fix")
    spec = fmoe.MoESpec(model_dim=M, num_experts=E, gate=routers.GateSpec(k=2, capacity_factor=0.0),
                        experts=fmoe.ExpertSpec(type="ffn", hidden_size=8))
    params = fmoe.init_params(spec, generator=torch.Generator().manual_seed(2))
    params["gate"]["wg"].requires_grad_()
    x = torch.randn(3, M)
    x[1, 0] = float("inf")
    with pytest.raises(ValueError, match="router logits"):
        fmoe.moe(params, x, spec)


class _Act:
    """An activation object without a hash (its spec cannot key a cache)."""
    __hash__ = None

    def __call__(self, z):
        return F.silu(z)


def test_expert_form_cached_per_spec_and_unhashable_activations():
    spec = experts.ExpertSpec(type="swiglu", hidden_size=8)
    p = experts.init_experts(spec, 4, M)
    a, b = experts.expert_form(spec, p)["form"], experts.expert_form(dataclasses.replace(spec), p)["form"]
    assert a is b and (a.form, a.in_transposed, a.out_transposed, a.activation) == ("glu", True, True, F.silu)
    act = _Act()
    spec2 = experts.ExpertSpec(type="gated_ffn", hidden_size=8, activation=act)
    f = experts.expert_form(spec2, experts.init_experts(spec2, 4, M))["form"]
    assert f.activation is act and (f.form, f.in_transposed, f.out_transposed) == ("glu", False, False)


def test_expert_dtype_flat_and_nested():
    def walk(params, fallback):   # the tree_leaves walk the flat-dict path stands in for
        for leaf in pytree.tree_leaves(params, is_leaf=lambda t: not isinstance(t, (dict, list, tuple))):
            if isinstance(leaf, torch.Tensor) and leaf.dtype in experts._COMPUTE_DTYPES:
                return leaf.dtype
        return fallback
    cases = [{"a": torch.zeros(1, dtype=torch.int64), "b": torch.zeros(1, dtype=torch.bfloat16)},
             {"a": None, "b": torch.zeros(1, dtype=torch.float64)}, {"a": 3},
             {"n": {"w": torch.zeros(1, dtype=torch.float16)}, "b": torch.zeros(1)},
             [torch.zeros(1, dtype=torch.bfloat16)]]
    for c in cases:
        assert experts.expert_dtype(c, torch.float32) == walk(c, torch.float32)


def test_moe_on_tokens_equals_moe_on_batches():
    spec = fmoe.MoESpec(model_dim=M, num_experts=E, gate=routers.GateSpec(k=2, capacity_factor=0.0),
                        experts=fmoe.ExpertSpec(type="swiglu", hidden_size=8))
    params = fmoe.init_params(spec, generator=torch.Generator().manual_seed(3))
    x = torch.randn(2, 3, M)
    y3, a3 = fmoe.moe(params, x, spec)
    y2, a2 = fmoe.moe(params, x.reshape(6, M), spec)
    assert y3.shape == (2, 3, M) and y2.shape == (6, M) and torch.equal(y3.reshape(6, M), y2)
    assert torch.equal(a3.l_aux, a2.l_aux) and torch.equal(a3.counts, a2.counts)
