"""Routing against the spec's worked example R1 (routing.md §7.4) and its rules."""
from fractions import Fraction

import pytest
import torch

import fmoe
from fmoe.routing import assign_slots, capacity_for, make_routing, top_k_routing, validate_routing

S = torch.tensor([
    [0.5, 0.25, 0.125, 0.125],
    [0.4375, 0.125, 0.3125, 0.125],
    [0.25, 0.625, 0.0625, 0.0625],
    [0.375, 0.1875, 0.125, 0.3125],
    [0.125, 0.0625, 0.75, 0.0625],
    [0.5625, 0.25, 0.125, 0.0625],
    [0.15625, 0.125, 0.3125, 0.40625],
    [0.1875, 0.6875, 0.0625, 0.0625],
], dtype=torch.float64)


def test_r1_ids_locations_gates():
    r = top_k_routing(S, 2, 1.0)
    assert r.expert_ids.tolist() == [[0, 0, 1, 0, 2, 0, 3, 1], [1, 2, 0, 3, 0, 1, 2, 0]]
    assert r.slots.tolist() == [[0, 1, 0, 2, 0, 3, 0, 1], [2, 1, 4, 1, 5, 3, 2, 6]]
    g0 = [Fraction(2, 3), Fraction(7, 12), Fraction(5, 7), Fraction(6, 11), Fraction(6, 7), Fraction(9, 13),
          Fraction(13, 23), Fraction(11, 14)]
    g1 = [1 - g for g in g0]
    torch.testing.assert_close(r.weights, torch.tensor([[float(g) for g in g0], [float(g) for g in g1]],
                                                       dtype=torch.float64))
    assert r.counts.tolist() == [7, 4, 3, 2]
    assert r.capacity == 4
    assert int(r.num_dropped()) == 3


@pytest.mark.parametrize("cf,alignment,expected", [
    (1, 1, 4), (2, 1, 8), (1.5, 1, 6), (0.5, 1, 2), (0, 1, 7), (0, 3, 9), (0, 8, 8), (-1, 1, 4), (-0.5, 1, 2),
])
def test_r1_capacity_table(cf, alignment, expected):
    assert top_k_routing(S, 2, cf, alignment=alignment).capacity == expected


def test_r1_zero_capacity_is_a_clear_error():
    with pytest.raises(ValueError, match=r"capacity is 0.*capacity_factor=0.25, T=8, E=4"):
        top_k_routing(S, 2, 0.25)


def test_r1_buffers_cf1_and_capped():
    r = top_k_routing(S, 2, 1.0)
    assert r.reversed_ids().tolist() == [[0, 1, 3, 5], [2, 7, 0, 5], [4, 1, 6, -1], [6, 3, -1, -1]]
    assert r.reversed_ids("top_id").tolist() == [[0, 0, 0, 0], [0, 0, 1, 1], [0, 1, 1, -1], [0, 1, -1, -1]]
    r = top_k_routing(S, 2, -0.5)
    assert r.capacity == 2
    assert r.reversed_ids().tolist() == [[0, 1], [2, 7], [4, 1], [6, 3]]


def test_r1_decode_first_feature():
    r = top_k_routing(S, 2, 1.0)
    x = torch.stack([torch.arange(1, 9.0), -torch.arange(1, 9.0)], 1).double()
    y = fmoe.combine(fmoe.dispatch(x, r), r)
    expected = [1, 2, 15 / 7, 4, 30 / 7, 6, 7, 44 / 7]
    torch.testing.assert_close(y[:, 0], torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-15)


def test_r1_batch_prioritized():
    r = top_k_routing(S, 2, 1.0, batch_prioritized=True)
    assert r.slots.tolist() == [[1, 2, 1, 3, 0, 0, 0, 0], [3, 1, 6, 1, 4, 2, 2, 5]]
    # Unlike Tutel (§16.8), counts stay the true per-expert counts, so dropless never drops.
    assert r.counts.tolist() == [7, 4, 3, 2]
    r0 = top_k_routing(S, 2, 0, batch_prioritized=True)
    assert r0.capacity == 7 and int(r0.num_dropped()) == 0
    assert top_k_routing(S, 2, 0, batch_prioritized=True, alignment=3).capacity == 9
    r2 = top_k_routing(S, 2, 0.5, batch_prioritized=True)
    assert r2.capacity == 2
    assert r2.reversed_ids()[0].tolist() == [5, 0]


def test_batch_prioritized_ties_are_stable():
    scores = torch.full((6, 2), 0.5, dtype=torch.float64)
    r = top_k_routing(scores, 1, 0, batch_prioritized=True)
    # All importances tie: token order must be kept.
    assert r.slots.tolist() == [[0, 1, 2, 3, 4, 5]]


def test_r1_k1():
    r = top_k_routing(S, 1, 1.0)
    assert r.capacity == 2
    assert r.slots.tolist() == [[0, 1, 0, 2, 0, 3, 0, 1]]
    assert r.weights[0].tolist() == [0.5, 0.4375, 0.625, 0.375, 0.75, 0.5625, 0.40625, 0.6875]
    assert r.counts.tolist() == [4, 2, 1, 1]
    x = torch.stack([torch.arange(1, 9.0), -torch.arange(1, 9.0)], 1).double()
    r2 = top_k_routing(S, 2, 1.0)
    d = fmoe.dispatch(x, r2, weighted=True)
    torch.testing.assert_close(d[0, :, 0], torch.tensor([2 / 3, 7 / 6, 24 / 11, 54 / 13], dtype=torch.float64))


def test_normalize_false_keeps_raw_scores():
    r = top_k_routing(S, 2, 1.0, normalize=False)
    assert r.weights[:, 0].tolist() == [0.5, 0.25]


def test_k_clipped_to_num_experts():
    r = top_k_routing(S, 9, 0)
    assert r.k == 4
    assert r.counts.tolist() == [8, 8, 8, 8]


def test_negative_ids_are_masked():
    ids = torch.tensor([[0, -1, 1, 0], [1, 0, -1, -1]])
    w = torch.ones(2, 4)
    r = make_routing(ids, w, 2, 0)
    assert r.counts.tolist() == [3, 2]
    assert r.slots.tolist() == [[0, -1, 0, 1], [1, 2, -1, -1]]
    x = torch.arange(4.0).reshape(4, 1)
    d = fmoe.dispatch(x, r)
    assert d[:, :, 0].tolist() == [[0.0, 3.0, 1.0], [2.0, 0.0, 0.0]]
    y = fmoe.combine(d, r)
    assert y[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_external_routing_via_minus_one_matrix():
    # spec §5: put the weights in a -1-filled matrix; normalize off, dropless.
    scores = torch.full((3, 4), -1.0, dtype=torch.float64)
    scores[0, 2], scores[0, 1] = 0.7, 0.3
    scores[1, 0], scores[1, 3] = 0.9, 0.6
    scores[2, 3], scores[2, 2] = 0.8, 0.1
    r = top_k_routing(scores, 2, 0, normalize=False)
    assert r.expert_ids.t().tolist() == [[2, 1], [0, 3], [3, 2]]
    assert r.weights.t().tolist() == [[0.7, 0.3], [0.9, 0.6], [0.8, 0.1]]


def test_capacity_for_large_alignment_rounds_to_128():
    assert capacity_for(0, num_tokens=10, num_experts=2, k=1, max_load=5, alignment=300) == 384


def test_assign_slots_matches_loop():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 5, (3, 40), generator=g)
    slots, counts = assign_slots(ids, 5)
    counter = [0] * 5
    for j in range(3):
        for t in range(40):
            e = int(ids[j, t])
            assert int(slots[j, t]) == counter[e]
            counter[e] += 1
    assert counts.tolist() == counter


def test_routing_is_a_pytree_and_saves(tmp_path):
    from torch.utils import _pytree as pytree
    r = top_k_routing(S, 2, 1.0)
    leaves, spec = pytree.tree_flatten(r)
    assert len(leaves) == 4
    r2 = pytree.tree_unflatten(leaves, spec)
    assert r2.capacity == 4 and r2.num_experts == 4
    r.save(tmp_path / "r.pt")
    r3 = fmoe.Routing.load(tmp_path / "r.pt")
    for a, b in zip(pytree.tree_leaves(r), pytree.tree_leaves(r3)):
        assert torch.equal(a, b)
    assert r3.capacity == r.capacity


def test_numba_slot_walk_equals_torch_reference():
    from fmoe.routing import assign_slots_torch
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(-1, 7, (4, 300), generator=g)
    order = torch.randperm(300, generator=g)
    for o in (None, order):
        a_slots, a_counts = assign_slots(ids, 7, order=o)
        b_slots, b_counts = assign_slots_torch(ids, 7, order=o)
        assert torch.equal(a_slots, b_slots) and torch.equal(a_counts, b_counts)


def test_make_routing_refuses_what_validate_routing_refuses():
    # make_routing builds its Routing without re-checking what it built (slots, counts), but the
    # caller's weights and a caller's capacity still get validate_routing's errors
    ids = torch.tensor([[0, 1, 2, 0, 1]])
    with pytest.raises(TypeError, match="Routing.weights must be floating point, got torch.int64"):
        make_routing(ids, torch.ones(1, 5, dtype=torch.int64), 3)
    with pytest.raises(ValueError, match=r"Routing.capacity=10000000 exceeds the bound 64\*max\(k\*T, 1\) \+ 65536"):
        make_routing(ids, torch.ones(1, 5), 3, capacity=10 ** 7)
    r = make_routing(ids, torch.ones(1, 5), 3, capacity=4)
    validate_routing(r)   # and what it builds passes the full check, values included
    assert r.capacity == 4 and r.num_experts == 3 and r.counts.tolist() == [2, 2, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_gshard_fraction_equals_the_one_hot_reference(dtype):
    # the host bincount of eager CPU ids gives the one-hot column sums' values bit for bit (ids
    # < 0 and >= E count nowhere), and the loss is the same bits as the reference formula
    from fmoe import losses
    g = torch.Generator().manual_seed(0)
    for T, E in ((1, 64), (4, 64), (0, 8), (300, 8)):
        ids = torch.randint(-1, E + 2, (T,), generator=g)
        scores = torch.rand(T, E, generator=g).softmax(1).to(dtype)
        ref = (ids.reshape(-1, 1) == torch.arange(E)).to(dtype).sum(0) / max(T, 0)
        frac = losses._fraction_routed(ids, E, dtype)
        assert frac.dtype == dtype and torch.equal(frac.isnan(), ref.isnan())
        assert torch.equal(frac.nan_to_num(), ref.nan_to_num())
        if T:
            assert torch.equal(losses.gshard_loss(scores, ids), E * (scores.mean(0) * ref).sum())
    # under a transform (no host values) the one-hot path runs: the same loss, and its gradient
    scores = torch.rand(4, 8, generator=g).softmax(1)
    ids = torch.randint(0, 8, (4,), generator=g)
    grad = torch.func.grad(lambda s: losses.gshard_loss(s, ids))(scores)
    frac = (ids.reshape(-1, 1) == torch.arange(8)).float().sum(0) / 4
    assert torch.allclose(grad, (8 * frac / 4).expand(4, 8))


def test_make_plan_sets_every_plan_field():
    # make_plan's CPU walk builds the ExpertPlan without plan_from_bounds' checks: every field
    # equals the checked constructor's over the reference rows
    import dataclasses

    from fmoe.engine import plan as P
    g = torch.Generator().manual_seed(1)
    r = top_k_routing(torch.rand(7, 5, generator=g).softmax(1), 2, 1.0)
    for needs_grad in (False, True):
        fast = P.make_plan(r, needs_grad=needs_grad, dtype=torch.float32)
        tokens, pairs, bounds, dropped = P.rows_reference(r)
        ref = P.plan_from_bounds(tokens, pairs, bounds, r.num_tokens, needs_grad=needs_grad, dtype=torch.float32,
                                 dropped=dropped, num_slots=r.k)
        for f in dataclasses.fields(P.ExpertPlan):
            a, b = getattr(fast, f.name), getattr(ref, f.name)
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, f.name
        assert fast.busy == ref.busy and torch.equal(fast.experts, ref.experts)
