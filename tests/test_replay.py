"""Routing record/replay reproduces outputs bit for bit."""
import pytest
import torch

import fmoe
from fmoe import ablate


def _layer(k=2, cf=1.0, noise=1.0, E=4, M=16):
    spec = fmoe.MoESpec(model_dim=M, num_experts=E, gate=fmoe.GateSpec(k=k, capacity_factor=cf, gate_noise=noise),
                        experts=fmoe.ExpertSpec(hidden_size=32))
    return spec, fmoe.init_params(spec, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("cf", [1.0, 0.0, -0.5])
def test_replay_functional_bit_for_bit(tmp_path, cf):
    spec, params = _layer(cf=cf)
    x = torch.randn(2, 24, 16, generator=torch.Generator().manual_seed(1))
    # Noisy training-mode routing: only the recording can reproduce it.
    y, aux = fmoe.moe(params, x, spec, training=True, generator=torch.Generator().manual_seed(2))
    aux.routing.save(tmp_path / "r.pt")
    r = fmoe.Routing.load(tmp_path / "r.pt")
    y2, aux2 = fmoe.moe(params, x, spec, training=True, routing=r)
    assert torch.equal(y, y2)
    assert torch.equal(aux.counts, aux2.counts) and torch.equal(aux.dropped, aux2.dropped)
    assert aux2.capacity == aux.capacity
    # A fresh noise draw routes differently, which is why replay matters.
    y3, _ = fmoe.moe(params, x, spec, training=True, generator=torch.Generator().manual_seed(3))
    assert not torch.equal(y, y3)


def test_replay_expert_gradients_bit_for_bit():
    spec, params = _layer(noise=0.0)
    x = torch.randn(24, 16, generator=torch.Generator().manual_seed(1))

    def f(experts, routing=None):
        y, _ = fmoe.moe({"gate": params["gate"], "experts": experts}, x, spec, routing=routing)
        return y.square().sum()

    _, aux = fmoe.moe(params, x, spec)
    g1 = torch.func.grad(f)(params["experts"])
    g2 = torch.func.grad(f)(params["experts"], aux.routing)
    for key in g1:
        assert torch.equal(g1[key], g2[key]), key


def test_save_load_many_layers(tmp_path):
    spec, params = _layer(noise=0.0)
    x = torch.randn(24, 16, generator=torch.Generator().manual_seed(1))
    h, a0 = fmoe.moe(params, x, spec)
    out, a1 = fmoe.moe(params, h, spec)
    routings = ablate.record_routings({"l0": a0, "l1": a1})
    ablate.save_routings(tmp_path / "all.pt", routings)
    back = ablate.load_routings(tmp_path / "all.pt")
    h2, _ = fmoe.moe(params, x, spec, routing=back["l0"])
    out2, _ = fmoe.moe(params, h2, spec, routing=back["l1"])
    assert torch.equal(out, out2)
    torch.save({"x": 1}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="save_routings"):
        ablate.load_routings(tmp_path / "other.pt")


def test_record_replay_through_moelayer_model(tmp_path):
    nn_mod = pytest.importorskip("fmoe.nn")
    torch.manual_seed(0)

    def layer(seed):
        return nn_mod.MoELayer({"type": "top", "k": 2, "capacity_factor": 1.0, "gate_noise": 1.0}, model_dim=16,
                               experts={"type": "ffn", "num_experts_per_device": 4, "hidden_size_per_expert": 32},
                               seeds=(seed, seed + 1, seed))

    model = torch.nn.Sequential(layer(1), torch.nn.GELU(), layer(5)).train()
    x = torch.randn(3, 8, 16)
    with ablate.record_layers(model) as routings:
        y = model(x)
    assert sorted(routings) == ["0", "2"] and "forward" not in model[0].__dict__
    ablate.save_routings(tmp_path / "model.pt", routings)
    with ablate.replay_layers(model, ablate.load_routings(tmp_path / "model.pt")):
        y2 = model(x)
    assert torch.equal(y, y2)
    assert not torch.equal(y, model(x))  # live routing draws new noise
    with pytest.raises(KeyError, match="2"):
        with ablate.replay_layers(model, {"0": routings["0"]}):
            pass
