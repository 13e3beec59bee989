"""fmoe.stats on the spec's golden example R1 (routing.md §7.4)."""
import math

import torch

import fmoe
from fmoe import stats

from tests.test_routing import S  # the spec's R1 score matrix


def _cv(v):
    mean = sum(v) / len(v)
    return math.sqrt(sum((a - mean) ** 2 for a in v) / len(v)) / mean


def _ent(v):
    tot = sum(v)
    return -sum(a / tot * math.log(a / tot) for a in v if a > 0)


def test_r1_cf1():
    r = fmoe.top_k_routing(S, 2, 1.0)
    st = stats.routing_stats(r, S)
    assert st.routed.tolist() == [7, 4, 3, 2]  # dispatch_count
    assert st.load.tolist() == [4, 4, 3, 2]  # buffers e0..e3 of §7.4
    assert st.dropped.item() == 3 and st.dropped_fraction.item() == 3 / 16
    assert st.load_cv.item() == math.sqrt(3.5) / 4  # population var of [7,4,3,2] is 3.5 exactly
    assert st.load_cv.item() == _cv([7, 4, 3, 2])
    assert st.importance.tolist() == [2.59375 / 8, 2.3125 / 8, 1.875 / 8, 1.21875 / 8]  # §10.1 column sums
    assert math.isclose(st.load_entropy.item(), _ent([7, 4, 3, 2]), rel_tol=1e-15)
    rows = [_ent(row) for row in S.tolist()]
    assert math.isclose(st.score_entropy.item(), sum(rows) / 8, rel_tol=1e-14)


def test_r1_capped_and_k1():
    r = fmoe.top_k_routing(S, 2, -0.5)  # C = 2: every buffer full, half the pairs dropped
    st = stats.routing_stats(r)
    assert r.capacity == 2
    assert st.load.tolist() == [2, 2, 2, 2] and st.dropped_fraction.item() == 0.5
    assert math.isnan(st.score_entropy.item()) and torch.isnan(st.importance).all()
    r1 = fmoe.top_k_routing(S, 1, 1.0)
    st1 = stats.routing_stats(r1)
    assert st1.routed.tolist() == [4, 2, 1, 1] and st1.load.tolist() == [2, 2, 1, 1]
    assert st1.dropped_fraction.item() == 2 / 8
    assert st1.load_cv.item() == math.sqrt(1.5) / 2  # mean 2, population var 6/4


def test_masked_ids_and_active_experts():
    ids = torch.tensor([[0, 1, -1, -1], [1, 0, -1, -1]])
    r = fmoe.make_routing(ids, torch.ones(2, 4), 3, capacity=1)
    st = stats.routing_stats(r, active=torch.tensor([True, True, False]))
    assert st.routed.tolist() == [2, 2, 0]  # masked pairs count nowhere
    assert st.dropped.item() == 2 and st.dropped_fraction.item() == 2 / 4
    assert st.load_cv.item() == 0.0  # balanced over the two active experts
    assert st.load_entropy.item() == math.log(2)


def test_summarize_moe_aux_vmap_and_table():
    spec = fmoe.MoESpec(model_dim=8, num_experts=4, gate=fmoe.GateSpec(k=2),
                        experts=fmoe.ExpertSpec(hidden_size=8))
    params = fmoe.init_params(spec, generator=torch.Generator().manual_seed(0))
    x = torch.randn(3, 16, 8, generator=torch.Generator().manual_seed(1))
    _, aux = fmoe.moe(params, x[0], spec)
    st = stats.summarize(aux)
    assert torch.equal(st.routed, aux.counts.double())
    assert st.dropped.item() == aux.dropped.item()
    # Pure torch: one stats row per vmapped call.
    batched = torch.func.vmap(lambda xb: stats.summarize(fmoe.moe(params, xb, spec)[1]))(x)
    assert batched.load_cv.shape == (3,) and torch.equal(batched.routed[0], st.routed)
    text = stats.format_table({"layer0": st})
    assert "layer0" in text and "load_cv" in text and len(text.splitlines()) == 4 + 4 + 1
