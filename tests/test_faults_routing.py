"""Malformed routings, capacities and scores end in clear errors; routing invariants hold (hypothesis).

Every case in the first half was accepted before (and some read outside a buffer in numba's combine).
"""
from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from hypothesis import given, settings, strategies as st

from fmoe import ops
from fmoe.ops import numba_cpu, reference
from fmoe.routing import Routing, capacity_bound, capacity_for, make_routing, top_k, top_k_routing, validate_routing


def _good(k=2, T=5, E=3, C=4):
    g = torch.Generator().manual_seed(0)
    return top_k_routing(torch.rand(T, E, generator=g).softmax(1), k, 0.0, capacity=C)


@pytest.mark.parametrize("change,error,match", [
    ({"weights": torch.ones(1, 5)}, ValueError, r"Routing.weights has shape \[1, 5\] but expert_ids is \[k, T\] = \[2, 5\]"),
    ({"slots": torch.zeros(3, 5, dtype=torch.int64)}, ValueError, r"Routing.slots has shape \[3, 5\]"),
    ({"counts": torch.zeros(4, dtype=torch.int64)}, ValueError, r"Routing.counts must be \[E\] = \[3\], got shape \[4\]"),
    ({"capacity": 10 ** 7}, ValueError, r"Routing.capacity=10000000 exceeds the bound"),
    ({"capacity": -1}, ValueError, "capacity must be an int >= 0"),
    ({"capacity": 2.5}, ValueError, "capacity must be an int >= 0"),
    ({"num_experts": 0}, ValueError, "num_experts must be an int >= 1"),
    ({"expert_ids": torch.full((2, 5), 3)}, ValueError, r"expert_ids has id 3, outside \[-1, E\) = \[-1, 3\)"),
    ({"slots": torch.full((2, 5), 10)}, ValueError, r"slots has 10 for a pair; slots of valid pairs lie in \[0, k\*T\) = \[0, 10\)"),
    ({"slots": torch.full((2, 5), -1)}, ValueError, r"slots has -1 for a valid pair"),
    ({"expert_ids": torch.full((2, 5), -1), "slots": torch.full((2, 5), -5)}, ValueError,
     r"slots has -5 for a masked pair"),
    ({"counts": torch.tensor([-1, 0, 0])}, ValueError, "counts must be >= 0"),
    ({"counts": torch.tensor([9, 9, 9])}, ValueError, r"sum <= k\*T = 10"),
    ({"weights": torch.ones(2, 5, dtype=torch.int64)}, TypeError, "weights must be floating point"),
    ({"expert_ids": torch.zeros(2, 5)}, TypeError, "expert_ids must be an integer tensor"),
    ({"expert_ids": [[0] * 5] * 2}, TypeError, "expert_ids must be a torch.Tensor, got list"),
    ({"expert_ids": torch.zeros(10, dtype=torch.int64)}, ValueError, r"expert_ids must be \[k, T\]"),
])
def test_malformed_routing_is_refused_by_replace_and_constructor(change, error, match):
    r = _good()
    with pytest.raises(error, match=match):
        dataclasses.replace(r, **change)
    fields = {f.name: getattr(r, f.name) for f in dataclasses.fields(r)} | change
    with pytest.raises(error, match=match):
        Routing(**fields)


def test_pytree_unflatten_and_load_validate(tmp_path):
    from torch.utils import _pytree as pytree
    r = _good()
    leaves, spec = pytree.tree_flatten(r)
    leaves[2] = torch.ones(1, 5)
    with pytest.raises(ValueError, match="Routing.weights has shape"):
        pytree.tree_unflatten(leaves, spec)
    bad = {f.name: getattr(r, f.name) for f in dataclasses.fields(r)} | {"counts": torch.zeros(7, dtype=torch.int64)}
    torch.save(bad, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match=r"Routing.load\('.*bad.pt'\): Routing.counts must be \[E\] = \[3\]"):
        Routing.load(tmp_path / "bad.pt")
    torch.save({"expert_ids": r.expert_ids}, tmp_path / "partial.pt")
    with pytest.raises(ValueError, match="not a saved Routing: expected the keys"):
        Routing.load(tmp_path / "partial.pt")
    r.save(tmp_path / "good.pt")
    back = Routing.load(tmp_path / "good.pt")
    assert torch.equal(back.slots, r.slots) and back.capacity == r.capacity
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.pt", "good.pt", "partial.pt"]  # no temp files


def test_validation_is_skipped_under_vmap_but_shapes_still_checked():
    r = _good()
    batched = torch.func.vmap(lambda ids: dataclasses.replace(r, expert_ids=ids).positions())(
        torch.stack([r.expert_ids, r.expert_ids]))
    assert torch.equal(batched[0], r.positions())
    with pytest.raises(ValueError, match="Routing.weights has shape"):
        torch.func.vmap(lambda w: dataclasses.replace(r, weights=w).positions())(torch.ones(2, 1, 5))


def test_numba_combine_refuses_weights_of_another_shape():
    r = _good()
    y = torch.randn(r.num_experts * r.capacity, 4)
    pos = r.positions()
    with pytest.raises(ValueError, match=r"weights must have the positions' shape \[k, T\] = \[2, 5\], got \[1, 5\]"):
        numba_cpu.combine(y, pos, torch.ones(1, 5))
    with pytest.raises(ValueError, match=r"dispatch: x has 3 rows but the positions are for T=5 tokens"):
        numba_cpu.dispatch(torch.randn(3, 4), pos, None, y.shape[0])
    with pytest.raises(ValueError, match=r"gate_grad: need a \[T, M\] and b \[R, M\] with T=5 .* got a \[3, 4\]"):
        numba_cpu.gate_grad(torch.randn(3, 4), y, pos)
    a = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(numba_cpu.gate_grad(a, y, pos), reference.gate_grad(a, y, pos), atol=1e-5)


def test_reference_dispatch_at_zero_tokens():
    pos = torch.zeros(2, 0, dtype=torch.int64)
    for w in (None, torch.zeros(2, 0)):
        out = reference.dispatch(torch.zeros(0, 4), pos, w, 6)
        assert out.shape == (6, 4) and not out.any()
    assert torch.equal(numba_cpu.dispatch(torch.zeros(0, 4), pos, None, 6), torch.zeros(6, 4))


@pytest.mark.parametrize("cf,error,match", [
    (float("inf"), ValueError, "capacity_factor must be finite, got inf"),
    (float("-inf"), ValueError, "capacity_factor must be finite, got -inf"),
    (float("nan"), ValueError, "capacity_factor must be finite, got nan"),
    ("1.0", TypeError, "capacity_factor must be a real number .* got str '1.0'"),
    (True, TypeError, "capacity_factor must be a real number"),
    (1e6, ValueError, r"capacity 6000000 \(capacity_factor=1000000.0, T=16, E=8, k=3, alignment=1\) exceeds the bound"),
])
def test_capacity_factor_bad_values(cf, error, match):
    with pytest.raises(error, match=match):
        capacity_for(cf, num_tokens=16, num_experts=8, k=3, max_load=4)


def test_capacity_bound_is_documented_value_and_generous():
    assert capacity_bound(2, 8) == 64 * 16 + 1024
    # capacity_factor 4 with one expert (Tutel allows it) and a large alignment stay inside the bound
    assert capacity_for(4.0, num_tokens=8, num_experts=1, k=2) == 64
    assert capacity_for(1.0, num_tokens=1, num_experts=1, k=1, alignment=1000) == 1024


def test_top_k_refuses_negative_scores_when_normalising():
    scores = torch.tensor([[-0.5, 0.5000001, 0.1]])
    with pytest.raises(ValueError, match=r"normalize=True .* non-negative scores; got a selected score of -0.5"):
        top_k(scores, 3)
    ids, w = top_k(scores, 3, normalize=False)  # raw logits are fine without normalisation
    assert w[:, 0].tolist() == pytest.approx([0.5000001, 0.1, -0.5])
    top_k(scores, 1)  # k = 1 is never normalised
    with pytest.raises(ValueError, match="got a selected score of nan"):
        top_k(torch.tensor([[float("nan"), 0.2]]), 2)


# ------------------------------------------------------------------ properties (bounded)

@settings(max_examples=40, deadline=None, derandomize=True)
@given(T=st.integers(0, 12), E=st.integers(1, 5), k=st.integers(1, 3), cf=st.sampled_from([-1.0, 0.0, 0.5, 1.0, 2.0]),
       prio=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_routing_invariants(T, E, k, cf, prio, seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(T, E, generator=g, dtype=torch.float64).softmax(1)
    try:
        r = top_k_routing(scores, k, cf, batch_prioritized=prio)
    except ValueError as e:
        assert "capacity is 0" in str(e) and cf > 0  # padded mode with too few tokens: a clear refusal
        return
    k = min(k, E)
    validate_routing(r)
    assert r.expert_ids.shape == r.slots.shape == r.weights.shape == (k, T) and r.counts.shape == (E,)
    assert torch.equal(r.counts, torch.bincount(r.expert_ids.reshape(-1), minlength=E))
    for e in range(E):  # each expert's pairs are numbered 0..count-1 (a permutation)
        got = sorted(r.slots[r.expert_ids == e].tolist())
        assert got == list(range(int(r.counts[e])))
    pos = r.positions()
    kept = pos[pos >= 0]
    assert kept.unique().numel() == kept.numel() and (kept < E * r.capacity).all()
    assert int(r.num_dropped()) == int(sum(max(int(c) - r.capacity, 0) for c in r.counts))
    if cf == 0:  # dropless
        assert int(r.num_dropped()) == 0
    # the fast kernels equal the reference on this routing, and nothing is lost silently
    x = torch.randn(T, 3, generator=g, dtype=torch.float64)
    buf = ops.dispatch(x, r)  # [E, C, M]
    assert torch.equal(buf.reshape(E * r.capacity, 3), reference.dispatch(x, pos, None, E * r.capacity))
    y = ops.combine(buf, r)
    assert torch.equal(y, reference.combine(buf.reshape(E * r.capacity, 3), pos, r.weights))
    want = (r.weights * r.kept()).sum(0, keepdim=True).t() * x
    assert torch.allclose(y, want, atol=1e-12)


def test_make_routing_still_checks_shapes():
    with pytest.raises(ValueError, match=r"counts must be \[E\]"):
        from fmoe.routing import _trusted_routing
        r = _good()
        _trusted_routing(r.expert_ids, r.slots, r.weights, r.counts[:2], r.capacity, r.num_experts)


def test_validation_cost_is_small():
    """Measured: Routing construction with full validation at T=4096, k=2, E=64 (printed; bounded loosely)."""
    g = torch.Generator().manual_seed(0)
    r = top_k_routing(torch.rand(4096, 64, generator=g).softmax(1), 2, 1.0)
    fields = {f.name: getattr(r, f.name) for f in dataclasses.fields(r)}
    t0 = time.perf_counter()
    for _ in range(50):
        Routing(**fields)
    per = (time.perf_counter() - t0) / 50
    print(f"Routing validation: {per * 1e6:.1f} us per construction (T=4096, k=2, E=64)")
    assert per < 0.05


@pytest.mark.parametrize("cf,match", [("abc", "capacity_factor must be a real number"),
                                      (float("inf"), "capacity_factor must be finite"),
                                      (1e6, "exceeds the bound")])
def test_bad_capacity_factor_through_moe(cf, match):
    import fmoe
    spec = fmoe.MoESpec(model_dim=4, num_experts=2, gate=fmoe.GateSpec(k=1, capacity_factor=cf),
                        experts=fmoe.ExpertSpec(type="ffn", hidden_size=4))
    p = fmoe.init_params(spec, generator=torch.Generator().manual_seed(0))
    with pytest.raises((TypeError, ValueError), match=match):
        fmoe.moe(p, torch.randn(8, 4), spec)


def test_validation_is_compile_and_grad_safe():
    r = _good()
    f = torch.compile(lambda w: dataclasses.replace(r, weights=w * 2).weights.sum(), backend="eager", fullgraph=True)
    assert f(r.weights).item() == pytest.approx(2 * r.weights.sum().item())
    g = torch.func.grad(lambda w: (dataclasses.replace(r, weights=w).weights ** 2).sum())(r.weights)
    assert torch.equal(g, 2 * r.weights)
