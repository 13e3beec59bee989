"""MoELayer (Tutel names, shapes, overrides), losses' golden values, and bad-input errors."""
import math

import pytest
import torch

import fmoe
from fmoe.losses import gshard_loss, load_importance_loss, z_loss
from fmoe.nn import MoELayer
from tests.test_routing import S


def _layer(**kw):
    cfg = dict(gate_type={"type": "top", "k": 2, "capacity_factor": 1.0}, model_dim=16,
               experts={"type": "ffn", "num_experts_per_device": 4, "hidden_size_per_expert": 32}, seeds=(1, 2, 1))
    cfg.update(kw)
    return MoELayer(**cfg)


def test_state_dict_uses_tutel_names_and_shapes():
    sd = _layer().state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items()} == {
        "_num_global_experts": (), "experts.batched_fc1_w": (4, 32, 16), "experts.batched_fc2_w": (4, 32, 16),
        "experts.batched_fc1_bias": (4, 32), "experts.batched_fc2_bias": (4, 16), "gates.0.wg.weight": (4, 16)}
    assert int(sd["_num_global_experts"]) == 4
    sd = _layer(gate_type=[{"type": "cosine_top", "k": 1, "proj_dim": 8}, {"type": "top", "k": 2}],
                experts={"type": "llama_ffn", "num_experts_per_device": 2, "hidden_size_per_expert": 8,
                         }).state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items()} == {
        "_num_global_experts": (), "experts.W_fc1": (256,), "experts.W_fc2": (256,), "experts.W_fc3": (256,),
        "gates.0.cosine_projector.weight": (8, 16), "gates.0.cosine_projector.bias": (8,),
        "gates.0.sim_matrix": (8, 2), "gates.0.temperature": (1,), "gates.1.wg.weight": (2, 16)}


def test_state_dict_round_trip_reproduces_outputs(tmp_path):
    a = _layer()
    torch.save(a.state_dict(), tmp_path / "moe.pt")
    b = _layer(seeds=(7, 8, 9))
    x = torch.randn(3, 7, 16)
    assert not torch.equal(a(x), b(x))
    b.load_state_dict(torch.load(tmp_path / "moe.pt"))
    assert torch.equal(a(x), b(x))


def test_load_reshapes_flat_expert_tensors_and_rejects_missing():
    a = _layer()
    sd = {k: v.clone() for k, v in a.state_dict().items()}
    sd["experts.batched_fc1_w"] = sd["experts.batched_fc1_w"].reshape(64, 32)  # same numel, converted layout
    b = _layer(seeds=(3, 4, 5))
    b.load_state_dict(sd)
    assert torch.equal(b.experts.batched_fc1_w, a.experts.batched_fc1_w)
    del sd["experts.batched_fc2_bias"]
    with pytest.raises(RuntimeError, match="missing expert parameter 'experts.batched_fc2_bias'"):
        b.load_state_dict(sd, strict=False)
    sd2 = dict(a.state_dict())
    sd2["_num_global_experts"] = torch.tensor(8)
    with pytest.raises(RuntimeError, match="checkpoint has 8 global experts"):
        b.load_state_dict(sd2)


def test_gated_experts_stored_out_by_in_and_saved_flat_in_tutel_order(tmp_path):
    layer = _layer(experts={"type": "llama_ffn", "num_experts_per_device": 2, "hidden_size_per_expert": 8})
    n, M, H = 2, 16, 8
    stored = dict(layer.experts.named_parameters())
    assert {k: tuple(v.shape) for k, v in stored.items()} == {"W_fc1": (n, H, M), "W_fc2": (n, H, M),
                                                             "W_fc3": (n, M, H)}
    assert all(v.is_contiguous() for v in stored.values())
    p = layer.experts.params()
    assert {k: tuple(v.shape) for k, v in p.items()} == {"gate_w": (n, M, H), "up_w": (n, M, H), "down_w": (n, H, M)}
    for key, name in (("gate_w", "W_fc1"), ("up_w", "W_fc2"), ("down_w", "W_fc3")):
        assert p[key].data_ptr() == stored[name].data_ptr()       # views, not copies
        assert torch.equal(p[key], stored[name].transpose(1, 2))
    sd = layer.state_dict()
    for key, name in (("gate_w", "W_fc1"), ("up_w", "W_fc2"), ("down_w", "W_fc3")):
        assert torch.equal(sd["experts." + name], p[key].reshape(-1))  # Tutel's flat x @ W elements
    held = layer.state_dict(keep_vars=True)["experts.W_fc1"]
    assert held.grad_fn is None and not held.requires_grad              # a copy, never a graph node
    torch.save(sd, tmp_path / "m.pt")
    b = _layer(experts={"type": "llama_ffn", "num_experts_per_device": 2, "hidden_size_per_expert": 8},
               seeds=(5, 6, 7))
    x = torch.randn(9, M)
    assert not torch.equal(layer(x), b(x))
    b.load_state_dict(torch.load(tmp_path / "m.pt"))
    assert torch.equal(layer(x), b(x))
    # converted checkpoints hold the x @ W views as [n, M, H] tensors: the same elements
    c = _layer(experts={"type": "llama_ffn", "num_experts_per_device": 2, "hidden_size_per_expert": 8},
               seeds=(8, 9, 10))
    names = {"experts.W_fc1": "gate_w", "experts.W_fc2": "up_w", "experts.W_fc3": "down_w"}
    c.load_state_dict({k: v.reshape(p[names[k]].shape) if k in names else v for k, v in sd.items()})
    assert torch.equal(layer(x), c(x))
    # the storage order [n, H, M] is not what a checkpoint holds: refused, never reshaped
    bad = dict(sd, **{"experts.W_fc1": stored["W_fc1"].detach().clone()})
    with pytest.raises(RuntimeError, match=r"'experts.W_fc1': checkpoint tensor has shape \(2, 8, 16\), this "
                                           r"layer expects \(2, 16, 8\) \(transposed"):
        c.load_state_dict(bad)


def test_gated_experts_train_into_contiguous_gradients_equal_to_the_staged_pipeline():
    kw = dict(experts={"type": "llama_ffn", "num_experts_per_device": 4, "hidden_size_per_expert": 8},
              dtype=torch.float64)
    fast, slow = _layer(**kw), _layer(plan="layout", **kw)
    slow.load_state_dict(fast.state_dict())
    x = torch.randn(24, 16, dtype=torch.float64)
    dy = torch.randn(24, 16, dtype=torch.float64)
    for m in (fast, slow):
        m(x).backward(dy)
    for (name, a), (_, b) in zip(fast.named_parameters(), slow.named_parameters()):
        assert a.grad.shape == a.shape and a.grad.stride() == a.stride(), name
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)



@pytest.mark.parametrize("cf,tokens", [(1.0, 24), (0, 24), (1.0, 1)],
                         ids=["padded_full_buffers", "ragged_dropless", "padded_few_busy"])
def test_staged_pipeline_hands_gated_weight_gradients_over_in_the_parameters_strides(cf, tokens):
    """plan='layout' (and expert parallel) multiply the x @ W views of the out x in Parameters:
    the gradient each Parameter's AccumulateGrad receives already has its strides (no copy into
    them), and equals the gradient of contiguous x @ W weights through the same pipeline."""
    kw = dict(gate_type={"type": "top", "k": 2, "capacity_factor": cf},
              experts={"type": "llama_ffn", "num_experts_per_device": 4, "hidden_size_per_expert": 8},
              dtype=torch.float64, plan="layout")
    layer = _layer(**kw)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, 16, dtype=torch.float64, generator=g)
    dy = torch.randn(tokens, 16, dtype=torch.float64, generator=g)
    arrived = {}
    for name, p in layer.experts.named_parameters():
        p.register_hook(lambda gr, name=name: arrived.__setitem__(name, gr.stride()))
    layer(x).backward(dy)
    for name, p in layer.experts.named_parameters():
        assert arrived[name] == p.stride() == p.grad.stride(), name
    params = {k: v.detach().contiguous().requires_grad_(True) for k, v in layer.params()["experts"].items()}
    assert all(not v.is_contiguous() for v in layer.params()["experts"].values())
    pytree = dict(layer.params(), experts=params)
    spec = layer.spec()
    torch.autograd.backward(fmoe.moe(pytree, x, spec)[0], dy)
    views = dict(zip(("gate_w", "up_w", "down_w"), ("W_fc1", "W_fc2", "W_fc3")))
    for key, pname in views.items():
        got = getattr(layer.experts, pname).grad.transpose(1, 2)
        torch.testing.assert_close(got, params[key].grad, rtol=1e-12, atol=1e-12)


def test_layer_equals_functional_moe():
    layer = _layer()
    x = torch.randn(2, 5, 16)
    y, aux = layer(x, return_aux=True)
    y2, aux2 = fmoe.moe(layer.params(), x, layer.spec())
    assert torch.equal(y, y2)
    assert torch.equal(aux.counts, aux2.counts)
    assert torch.equal(layer(x).l_aux, aux.l_aux)


def test_per_call_overrides_are_not_sticky():
    layer = _layer()
    x = torch.randn(4, 8, 16)
    _, aux = layer(x, top_k=1, capacity_factor=0, return_aux=True)
    assert aux.routing.k == 1 and int(aux.dropped) == 0
    _, aux = layer(x, return_aux=True)
    assert aux.routing.k == 2 and aux.capacity == 2 * math.ceil(32 / 4)
    assert layer.specs[0].gate.k == 2 and layer.specs[0].gate.capacity_factor == 1.0
    _, aux = layer(x, top_k=0, return_aux=True)  # 0 means "the gate's k" as in Tutel
    assert aux.routing.k == 2


def test_gate_config_dicts_are_not_mutated():
    gate = {"type": "top", "k": 2}
    experts = {"type": "ffn", "num_experts_per_device": 2, "hidden_size_per_expert": 4}
    MoELayer(gate, model_dim=8, experts=experts)
    assert gate == {"type": "top", "k": 2}
    assert experts == {"type": "ffn", "num_experts_per_device": 2, "hidden_size_per_expert": 4}


def test_fp32_gate_stays_fp32_and_forward_has_no_side_effects():
    layer = _layer().to(torch.bfloat16)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    layer(torch.randn(2, 4, 16, dtype=torch.bfloat16))
    after = layer.state_dict()
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)


def test_reserve_dims():
    layer = _layer(model_dim=12)
    x = torch.randn(5, 3, 4)
    y = layer(x, reserve_dims=2)
    assert y.shape == x.shape


# --------------------------------------------------------------------------- losses

def test_gshard_loss_golden():
    top1 = torch.topk(S, 1, dim=1).indices[:, 0]
    assert float(gshard_loss(S, top1)) == 1.130859375


def test_load_importance_loss_golden():
    logits = torch.log(S)
    assert abs(float(load_importance_loss(logits, logits, 2, 1.0)) - 0.0448405) < 5e-7
    assert abs(float(load_importance_loss(logits, logits, 2, 4.0)) - 0.0448742) < 5e-7


def test_gshard_loss_is_one_when_balanced_uniform():
    scores = torch.full((8, 4), 0.25)
    assert float(gshard_loss(scores, torch.arange(8) % 4)) == 1.0


def test_z_loss():
    logits = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    assert abs(float(z_loss(logits)) - ((math.log(2)) ** 2 + (1 + math.log(2)) ** 2) / 2) < 1e-6


def test_moe_l_aux_is_gshard_of_scores():
    spec = fmoe.MoESpec(model_dim=4, num_experts=3, gate=fmoe.GateSpec(k=2), experts=fmoe.ExpertSpec(hidden_size=4))
    p = fmoe.init_params(spec, generator=torch.Generator().manual_seed(0))
    x = torch.randn(9, 4)
    _, aux = fmoe.moe(p, x, spec)
    scores = torch.softmax(x @ p["gate"]["wg"].t(), dim=1)
    torch.testing.assert_close(aux.l_aux, gshard_loss(scores, scores.argmax(1)))


# --------------------------------------------------------------------------- errors

@pytest.fixture
def setup():
    spec = fmoe.MoESpec(model_dim=8, num_experts=4, gate=fmoe.GateSpec(k=2), experts=fmoe.ExpertSpec(hidden_size=8))
    return spec, fmoe.init_params(spec, generator=torch.Generator().manual_seed(0))


def test_error_wrong_model_dim(setup):
    spec, p = setup
    with pytest.raises(ValueError, match=r"x's last dim must be model_dim=8, got shape \(4, 7\)"):
        fmoe.moe(p, torch.randn(4, 7), spec)


def test_error_rank_one_input(setup):
    spec, p = setup
    with pytest.raises(ValueError, match=r"at least 2 dims"):
        fmoe.moe(p, torch.randn(8), spec)


def test_error_non_floating_input(setup):
    spec, p = setup
    with pytest.raises(TypeError, match="x must be floating point, got dtype torch.int64"):
        fmoe.moe(p, torch.ones(4, 8, dtype=torch.long), spec)


def test_error_k_below_one():
    with pytest.raises(ValueError, match="gate k must be an int >= 1, got 0"):
        fmoe.GateSpec(k=0)
    with pytest.raises(ValueError, match="k must be >= 1, got k=-2"):
        fmoe.top_k_routing(S, -2)
    with pytest.raises(ValueError, match="top_k must be an int >= 0"):
        _layer()(torch.randn(2, 16), top_k=-1)


def test_error_zero_capacity(setup):
    spec, p = setup
    import dataclasses
    spec = dataclasses.replace(spec, gate=dataclasses.replace(spec.gate, capacity_factor=0.1))
    with pytest.raises(ValueError, match=r"capacity is 0.*capacity_factor=0.1, T=8, E=4"):
        fmoe.moe(p, torch.randn(8, 8), spec)


def test_error_mismatched_params(setup):
    spec, p = setup
    with pytest.raises(ValueError, match=r"gate.wg must be \[E, M\] = \[4, 8\], got \(4, 9\)"):
        fmoe.moe({"gate": {"wg": torch.randn(4, 9)}, "experts": p["experts"]}, torch.randn(4, 8), spec)
    with pytest.raises(ValueError, match="ffn experts need 'fc2_w'"):
        ex = {k: v for k, v in p["experts"].items() if k != "fc2_w"}
        fmoe.moe({"gate": p["gate"], "experts": ex}, torch.randn(4, 8), spec)
    with pytest.raises(ValueError, match="expected a dict with keys 'gate' and 'experts'"):
        fmoe.moe({"experts": p["experts"]}, torch.randn(4, 8), spec)
    with pytest.raises(ValueError, match=r"experts\['fc1_w'\] has shape \[4, 8, 5\]; .* needs \[4, 8, 8\]"):
        ex = dict(p["experts"], fc1_w=torch.randn(4, 8, 5))
        fmoe.moe({"gate": p["gate"], "experts": ex}, torch.randn(4, 8), spec)


def test_error_ops_shapes():
    r = fmoe.top_k_routing(S, 2, 1.0)
    with pytest.raises(ValueError, match=r"dispatch: x must be \[T, M\] with T=8"):
        fmoe.dispatch(torch.randn(7, 2), r)
    with pytest.raises(ValueError, match=r"combine: y must be \[E, C, M\] = \[4, 4, M\]"):
        fmoe.combine(torch.randn(4, 3, 2), r)
    with pytest.raises(TypeError, match="routing must be a fmoe.Routing"):
        fmoe.dispatch(torch.randn(8, 2), "not a routing")
    with pytest.raises(TypeError, match="scores must be floating point"):
        fmoe.top_k_routing(torch.ones(8, 4, dtype=torch.long), 1)


def test_error_bad_layer_config():
    with pytest.raises(ValueError, match="unknown gate_type keys"):
        _layer(gate_type={"type": "top", "k": 1, "bogus": 1})
    with pytest.raises(ValueError, match="unknown gate type 'auto'"):
        _layer(gate_type={"type": "auto"})
    with pytest.raises(ValueError, match="num_experts_per_device must be a non-zero int"):
        _layer(experts={"type": "ffn", "num_experts_per_device": 0.5, "hidden_size_per_expert": 4})
    with pytest.raises(ValueError, match="parallel_type must be"):   # 'auto' is Tutel's, accepted (issue 36)
        _layer(parallel_type="adaptive")
    with pytest.raises(ValueError, match="unknown expert type"):
        _layer(experts={"type": "moe", "num_experts_per_device": 1, "hidden_size_per_expert": 4})


def test_moelayer_seeds_draw_the_compat_layers_tutel_weights():
    # fmoe.init_experts draws Tutel's ffn weights expert by expert (fc1 then fc2 of each, Tutel's
    # formula): MoELayer(seeds=) equals the compat layer, whose weights are Tutel's bit for bit
    # (tests/test_compat_tutel.py checks those against Tutel's own hashes).
    from fmoe.compat.tutel import moe as tmoe
    from fmoe.nn import MoELayer
    kw = dict(gate_type={"type": "top", "k": 2}, model_dim=16,
              experts={"type": "ffn", "count_per_node": 3, "hidden_size_per_expert": 8}, seeds=(1, 2, 3))
    ours = MoELayer(gate_type=kw["gate_type"], model_dim=16, seeds=(1, 2, 3),
                    experts={"type": "ffn", "num_experts_per_device": 3, "hidden_size_per_expert": 8})
    theirs = tmoe.moe_layer(**kw)
    a, b = ours.state_dict(), theirs.state_dict()
    for key in ("experts.batched_fc1_w", "experts.batched_fc2_w"):
        assert torch.equal(a[key], b[key]), key
