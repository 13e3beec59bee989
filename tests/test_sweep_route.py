"""The route of a vmapped sweep (fmoe._slots_vmap): under vmap the slot walk runs natively, one
walk over the batch, and each element's slots and counts are its own eager walk's, integer for
integer; the pure-torch reference stays where the op does not apply (nested vmap, an order)."""
from __future__ import annotations

import pytest
import torch

import fmoe
from fmoe import _slots_vmap
from fmoe.routing import assign_slots_torch

E, T, k = 6, 40, 3


@pytest.fixture
def walks(monkeypatch):
    """Records each batched walk the route asks for (None where it stepped aside)."""
    calls = []
    real = _slots_vmap.assign_slots_batched
    monkeypatch.setattr(_slots_vmap, "assign_slots_batched", lambda *a: calls.append(real(*a)) or calls[-1])
    return calls


def _ids(B, masked=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.rand(T, E, generator=g).topk(k, dim=1)[1].t() for _ in range(B)])
    if masked:   # negative ids: masked pairs, no slot, not counted
        ids = torch.where(torch.rand(ids.shape, generator=g) < 0.3, -1, ids)
    return ids


@pytest.mark.parametrize("cf", [1.0, 0.5, -1.0])
def test_vmapped_routing_equals_each_elements_routing(cf, walks):
    """make_routing under vmap: slots, counts and the kept pairs of every element equal its own
    eager call's (padded, capacity-dropping and capped dropless capacity; masked ids)."""
    ids = _ids(5, masked=True)
    w = torch.rand(ids.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    cap = None if cf > 0 else T * k

    def route(i, g):
        r = fmoe.make_routing(i, g, E, cf, capacity=cap)
        return r.slots, r.counts, r.weights

    slots, counts, gates = torch.func.vmap(route)(ids, w)
    assert walks and all(c is not None for c in walks), "the vmapped route did not take the native walk"
    for b in range(ids.shape[0]):
        r = fmoe.make_routing(ids[b], w[b], E, cf, capacity=cap)
        assert torch.equal(slots[b], r.slots) and torch.equal(counts[b], r.counts)
        assert torch.equal(gates[b], r.weights)
        ref_slots, ref_counts = assign_slots_torch(ids[b], E)
        assert torch.equal(slots[b], ref_slots) and torch.equal(counts[b], ref_counts)


def test_vmapped_gate_sweep_routes_as_its_eager_calls(walks):
    """fmoe.moe's route of a vmapped sweep of gate matrices (shared x): each setting's expert ids,
    slots, counts and gates are its eager call's, the batch dim anywhere the caller puts it."""
    spec = fmoe.MoESpec(model_dim=8, num_experts=E, gate=fmoe.GateSpec(k=2, capacity_factor=0.75),
                        experts=fmoe.ExpertSpec(type="ffn", hidden_size=4))
    p = fmoe.init_params(spec, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x = torch.randn(T, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    wgs = torch.randn(E, 4, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)   # batch at dim 1

    def route(wg):
        r, _ = fmoe.route({"gate": {"wg": wg}}, x, spec)
        return r.expert_ids, r.slots, r.counts, r.weights

    got = torch.func.vmap(route, in_dims=1)(wgs)
    assert walks and walks[-1] is not None
    for b in range(wgs.shape[1]):
        for a, want in zip(got, route(wgs[:, b])):
            assert torch.equal(a[b], want)


def test_grad_over_a_vmapped_route_and_nested_vmap(walks):
    """The walk under grad wrappers (vmap of grad: per-example gate gradients) equals the loop;
    a doubly vmapped route keeps the torch reference, with the same slots."""
    ids = _ids(3)

    def loss(w, i):
        r = fmoe.make_routing(i, w, E, 1.0)
        return (r.weights * (r.slots >= 0) * (r.slots + 1)).sum()

    w = torch.rand(ids.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    got = torch.func.vmap(torch.func.grad(loss))(w, ids)
    assert walks and walks[-1] is not None
    for b in range(3):
        assert torch.equal(got[b], torch.func.grad(loss)(w[b], ids[b]))
    nested = ids.view(3, 1, k, T).expand(3, 2, k, T)
    s = torch.func.vmap(torch.func.vmap(lambda i: fmoe.make_routing(i, i.double(), E, 1.0).slots))(nested)
    assert walks[-1] is None   # two vmap levels: the torch reference
    for b in range(3):
        for j in range(2):
            assert torch.equal(s[b, j], assign_slots_torch(ids[b], E)[0])


def test_vmapped_walk_refuses_an_expert_id_out_of_range():
    """An id >= E in one element is an error naming num_experts, as the eager walk's (the batch's
    walk over B*E experts would otherwise count it as the next element's expert)."""
    ids = _ids(3)
    ids[1, 0, 5] = E
    with pytest.raises(IndexError, match=f"expert id is >= num_experts={E}"):
        torch.func.vmap(lambda i: fmoe.make_routing(i, torch.ones(i.shape), E, 1.0).slots)(ids)
    with pytest.raises(IndexError, match=f"expert id is >= num_experts={E}"):
        fmoe.make_routing(ids[1], torch.ones(ids[1].shape), E, 1.0)


def test_public_assign_slots_under_vmap_takes_the_walk(walks):
    """fmoe.routing.assign_slots (the ablation sweep's masked route calls it under vmap): one walk
    over the batch, each element's slots and counts its own; with an order, the torch reference."""
    from fmoe.routing import assign_slots
    ids = _ids(4, masked=True, seed=3)
    slots, counts = torch.func.vmap(lambda i: assign_slots(i, E))(ids)
    assert walks and walks[-1] is not None
    order = torch.randperm(T, generator=torch.Generator().manual_seed(5))
    ordered = torch.func.vmap(lambda i: assign_slots(i, E, order=order))(ids)
    for b in range(4):
        assert torch.equal(slots[b], assign_slots(ids[b], E)[0]) and torch.equal(counts[b], assign_slots(ids[b], E)[1])
        want = assign_slots_torch(ids[b], E, order=order)
        assert torch.equal(ordered[0][b], want[0]) and torch.equal(ordered[1][b], want[1])
