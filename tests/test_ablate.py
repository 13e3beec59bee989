"""fmoe.ablate: a vmapped sweep equals the separate runs it replaces."""
import dataclasses

import pytest
import torch
import torch.utils._pytree as pytree

import fmoe
from fmoe import ablate

T, M, E = 40, 16, 6


def _setup(k=2, cf=1.0, batch_prioritized=False, hidden=24):
    spec = fmoe.MoESpec(model_dim=M, num_experts=E, gate=fmoe.GateSpec(k=k, capacity_factor=cf),
                        experts=fmoe.ExpertSpec(hidden_size=hidden), batch_prioritized=batch_prioritized)
    g = torch.Generator().manual_seed(0)
    params = fmoe.init_params(spec, generator=g)
    x = torch.randn(T, M, generator=g)
    target = torch.randn(T, M, generator=g)
    noise = torch.randn(T, E, generator=g)
    return spec, params, x, target, noise


# Shape settings (k, capacity incl. dropless and capped, E) mixed with tensor settings.
POINTS = [
    ablate.Point(),
    ablate.Point(k=1),
    ablate.Point(k=3, capacity_factor=0.5),
    ablate.Point(num_experts=4),
    ablate.Point(capacity_factor=0.0),
    ablate.Point(capacity_factor=-0.5, temperature=0.5),
    ablate.Point(gate_noise=1.0, aux_coef=0.01, z_coef=1e-3),
    ablate.Point(num_experts=3, k=4, temperature=2.0, gate_noise=0.5),  # k clipped to E_s
]

EXACT = ("l_aux", "z_loss", "dropped_fraction", "load_cv", "load_entropy", "load", "capacity")
# The losses pass through the expert GEMMs, which vmap batches into other shapes than a separate
# run's, and a BLAS may sum their K terms in another order for another shape (host-dependent):
# they agree to float32 rounding of those GEMMs, (M + H) eps ~ 5e-6 relative, here within 1e-5
# (a wrong row or expert moves the loss by far more). The routing statistics and gate losses
# come from the same unbatched gate GEMM in both: bit for bit.
THROUGH_GEMMS = ("loss", "task_loss")
LOSS_RTOL = 1e-5


def _assert_tables(a, b):
    """Bit for bit, except sums over the expert axis when a setting masks experts:
    torch reduces E_max (zero-padded) and E_s entries in different orders."""
    full = torch.tensor([r.num_experts == E for r in b.resolved])
    for key in EXACT:
        x, y = a.table[key], b.table[key]
        if key == "l_aux":
            assert torch.equal(x[full], y[full]), key
            torch.testing.assert_close(x, y, rtol=4e-7, atol=0)
        else:
            assert torch.equal(x, y), key
    for key in THROUGH_GEMMS:
        torch.testing.assert_close(a.table[key], b.table[key], rtol=LOSS_RTOL, atol=0, msg=key)
    torch.testing.assert_close(a.table["score_entropy"], b.table["score_entropy"], rtol=1e-12, atol=1e-7)


def _close_grads(a, b):
    for (path, x), y in zip(pytree.tree_leaves_with_path(a), pytree.tree_leaves(b)):
        assert x.shape == y.shape, pytree.keystr(path)
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7, msg=pytree.keystr(path))


@pytest.mark.parametrize("batch_prioritized", [False, True])
def test_masked_sweep_equals_separate_runs(batch_prioritized, monkeypatch):
    from fmoe.engine import traced
    calls = []
    real = traced.run
    monkeypatch.setattr(traced, "run", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    spec, params, x, target, noise = _setup(batch_prioritized=batch_prioritized)
    masked = ablate.sweep_moe(params, x, spec, POINTS, target=target, noise=noise, mode="masked")
    assert calls, "the vmapped sweep did not run the engine's op"   # the kept pairs only, folded
    loop = ablate.sweep_moe(params, x, spec, POINTS, target=target, noise=noise, mode="loop")
    _assert_tables(masked, loop)
    # Gradients go through batched matmuls of other shapes: equal up to float32 rounding.
    _close_grads(masked.grads, loop.grads)
    # Experts a setting does not have get exactly zero gradient.
    assert torch.all(masked.grads["experts"]["fc1_w"][3, 4:] == 0)
    assert torch.all(masked.grads["gate"]["wg"][7, 3:] == 0)


def test_grouped_equals_loop():
    spec, params, x, target, noise = _setup()
    grouped = ablate.sweep_moe(params, x, spec, POINTS, target=target, noise=noise, mode="grouped")
    loop = ablate.sweep_moe(params, x, spec, POINTS, target=target, noise=noise, mode="loop")
    for key in EXACT:  # grouped runs the same static shapes as the loop
        assert torch.equal(grouped.table[key], loop.table[key]), key
    for key in THROUGH_GEMMS:   # ... vmapped over the settings of one shape: see THROUGH_GEMMS
        torch.testing.assert_close(grouped.table[key], loop.table[key], rtol=LOSS_RTOL, atol=0, msg=key)
    # the tolerance is tight enough to see one expert run another's weights in every setting
    wrong = {**params, "experts": {**params["experts"], "fc2_w": params["experts"]["fc2_w"][[1, 0, 2, 3, 4, 5]]}}
    moved = ablate.sweep_moe(wrong, x, spec, POINTS, target=target, noise=noise, mode="loop").table["loss"]
    assert bool(((moved - loop.table["loss"]).abs() > LOSS_RTOL * loop.table["loss"].abs()).all())
    _close_grads(grouped.grads, loop.grads)


def test_masked_route_matches_static_routing():
    spec, params, x, _, noise = _setup()
    settings, limits, rs = ablate.stack_points(POINTS, spec, T)
    for i, r in enumerate(rs):
        rm, *_ = ablate.masked_route(params["gate"], x, spec, settings[i], limits, noise=noise)
        _, aux = ablate.static_moe(params, x, spec, r, noise=noise)
        rt = aux.routing
        assert torch.equal(rm.expert_ids[:r.k], rt.expert_ids)
        assert torch.all(rm.expert_ids[r.k:] == -1)
        if r.num_experts == E:
            assert torch.equal(rm.weights[:r.k], rt.weights)
        else:  # softmax over E_max (-inf padded) vs E_s columns: last-bit differences
            torch.testing.assert_close(rm.weights[:r.k], rt.weights, rtol=4e-7, atol=0)
        assert torch.equal(rm.counts[:r.num_experts], rt.counts)
        assert torch.all(rm.counts[r.num_experts:] == 0)
        assert torch.equal(rm.kept()[:r.k], rt.kept())
        assert torch.equal(rm.num_dropped(), rt.num_dropped())
        kept = rt.kept()
        assert torch.equal(rm.slots[:r.k][kept], rt.slots[kept])


def test_static_run_is_the_library_forward():
    for cf in (1.0, 0.0, -0.5):
        spec, params, x, _, _ = _setup(cf=cf)
        # the sweeps run padded buffers: the static and the masked run bit for bit alike; moe()'s
        # padded layout reaches the same products through other GEMM calls, so within float32
        # rounding (bit for bit on Intel's MKL paths, 1 ulp apart on those MKL takes on other CPUs)
        y, aux = fmoe.moe(params, x, dataclasses.replace(spec, layout="padded"))
        y2, aux2 = ablate.static_moe(params, x, spec, ablate.resolve(ablate.Point(), spec, T))
        y3, aux3 = ablate.masked_moe(params, x, spec, *_one(spec))
        assert torch.equal(y2, y3)
        torch.testing.assert_close(y2, y, rtol=1e-5, atol=1e-6)
        # and to the default layout (ragged when dropless) within float rounding
        torch.testing.assert_close(fmoe.moe(params, x, spec)[0], y, rtol=1e-5, atol=1e-6)
        assert torch.equal(aux.l_aux, aux2.l_aux) and torch.equal(aux.l_aux, aux3.l_aux)
        assert torch.equal(aux.dropped, aux3.routing.num_dropped())


def _one(spec):
    settings, limits, _ = ablate.stack_points([ablate.Point()], spec, T)
    return settings[0], limits


def test_stacked_gates_are_an_ensemble():
    spec, params, x, target, _ = _setup()
    S = 4
    gates = {"wg": torch.randn(S, E, M, generator=torch.Generator().manual_seed(1))}
    pts = [ablate.Point(k=1 + (i % 2)) for i in range(S)]
    res = ablate.sweep_moe(params, x, spec, pts, target=target, gates=gates)
    for i in range(S):
        p = {**params, "gate": {"wg": gates["wg"][i]}}
        one = ablate.sweep_moe(p, x, spec, [pts[i]], target=target, mode="loop")
        torch.testing.assert_close(res.table["loss"][i], one.table["loss"][0], rtol=LOSS_RTOL, atol=0)
        torch.testing.assert_close(res.grads["gate"]["wg"][i], one.grads["gate"]["wg"][0], rtol=1e-5, atol=1e-7)
    loop = ablate.sweep_moe(params, x, spec, pts, target=target, gates=gates, mode="loop")
    torch.testing.assert_close(res.table["loss"], loop.table["loss"], rtol=LOSS_RTOL, atol=0)
    _close_grads(res.grads, loop.grads)


def test_grid_and_errors():
    pts = ablate.grid(k=[1, 2], temperature=[0.5, 1.0, 2.0])
    assert len(pts) == 6 and pts[1] == ablate.Point(k=1, temperature=1.0)
    spec, params, x, _, _ = _setup()
    with pytest.raises(ValueError, match="num_experts"):
        ablate.sweep_moe(params, x, spec, [ablate.Point(num_experts=E + 1)])
    with pytest.raises(ValueError, match="noise"):
        ablate.sweep_moe(params, x, spec, [ablate.Point(gate_noise=1.0)])
    with pytest.raises(ValueError, match="capacity is 0"):
        ablate.sweep_moe(params, x, spec, [ablate.Point(capacity_factor=0.01)])
    with pytest.raises(ValueError, match="mode"):
        ablate.sweep_moe(params, x, spec, [ablate.Point()], mode="fast")


def test_generic_sweep_trains_many_models():
    # param_dims=0: every setting owns a full copy of the parameters.
    spec, params, x, target, _ = _setup()
    pts = [ablate.Point(k=1), ablate.Point(k=2)]
    settings, limits, _ = ablate.stack_points(pts, spec, T)
    stacked = pytree.tree_map(lambda t: torch.stack([t, t * 0.5]), params)

    def loss_fn(p, batch, s):
        y, aux = ablate.masked_moe(p, batch[0], spec, s, limits)
        return (y - batch[1]).square().mean(), {"l_aux": aux.l_aux}

    table, grads = ablate.sweep(loss_fn, stacked, (x, target), settings, param_dims=0)
    for i in range(2):
        p = pytree.tree_map(lambda t: t[i], stacked)
        g, (loss, _) = torch.func.grad_and_value(loss_fn, has_aux=True)(p, (x, target), settings[i])
        torch.testing.assert_close(table["loss"][i], loss, rtol=LOSS_RTOL, atol=0)   # vmapped: THROUGH_GEMMS
        _close_grads(pytree.tree_map(lambda t: t[i:i + 1], grads), pytree.tree_map(lambda t: t[None], g))
