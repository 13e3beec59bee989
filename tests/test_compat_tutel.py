"""fmoe.compat.tutel on one process: Tutel's example code paths reproduce Tutel's numbers, and the
surface Tutel scripts use (constructor arguments, attributes, helpers, custom modules, from-scratch
primitives) behaves as Tutel's or as documented where fmoe deliberately differs.

Golden values: Tutel commit ac0e51b built for CPU (``NO_CUDA=1 pip install --no-build-isolation .``),
one result per scenario of tests/test_compat_tutel_scenarios.py, printed by

    cd /work/main && .venv/bin/python /tmp/tutel_golden.py NAME

where /tmp/tutel_golden.py (not committed) is::

    import json, os, sys; sys.path.insert(0, "/work/main")
    import torch; torch.set_num_threads(1)
    from tests.test_compat_tutel_scenarios import SCENARIOS
    import tutel as T; from tutel import moe, net, system
    print("RESULT " + json.dumps(SCENARIOS[sys.argv[1]](T))); sys.stdout.flush(); os._exit(0)

``init`` is the sha256 prefix of the initial state dict (bit-for-bit weights); trajectories are
compared at rtol 1e-5 (float rounding of fp32 CPU kernels), everything else exactly.
"""
from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F

import fmoe
import fmoe.compat.tutel as tutel
from fmoe.compat.tutel import moe, net, system
from fmoe.nn import MoELayer
from tests.test_compat_tutel_scenarios import SCENARIOS, from_scratch

GOLDEN = {
    "helloworld": {"init": "889de584584e6943", "losses": [2.309614, 2.119357, 1.946152, 1.787181], "l_aux": [0.9999999, 1.0, 1.0, 1.0], "local_count": 2144, "shared_count": 32, "num_global_experts": 2, "dispatch_count": [16, 16]},
    "helloworld_k1_e4": {"init": "e420f7a0f4635f77", "losses": [1.979869, 1.883813, 1.793628, 1.705364], "l_aux": [0.9998487, 0.9999068, 1.000009, 1.000153], "local_count": 4288, "shared_count": 64, "num_global_experts": 4, "dispatch_count": [3, 4, 5, 4]},
    "helloworld_l_aux": {"init": "889de584584e6943", "losses": [2.409614, 2.219357, 2.046152, 1.887181], "l_aux": [0.9999999, 1.0, 1.0, 1.0], "local_count": 2144, "shared_count": 32, "num_global_experts": 2, "dispatch_count": [16, 16]},
    "helloworld_overlap3": {"init": "d5986ed2baa9d495", "losses": [2.082892, 1.856721, 1.659672, 1.490394], "l_aux": [1.005729, 1.005971, 1.006266, 1.006595], "local_count": 3216, "shared_count": 48, "num_global_experts": 3, "dispatch_count": [12, 11, 9]},
    "helloworld_dropless": {"init": "e420f7a0f4635f77", "losses": [2.081404, 1.858408, 1.66256, 1.4929], "l_aux": [0.9998487, 0.9999539, 1.00007, 1.000193], "local_count": 4288, "shared_count": 64, "num_global_experts": 4, "dispatch_count": [6, 7, 7, 12]},
    "helloworld_capped": {"init": "e420f7a0f4635f77", "losses": [1.932765, 1.727417, 1.545771, 1.385785], "l_aux": [0.9998487, 0.9999009, 1.000011, 1.000169], "local_count": 4288, "shared_count": 64, "num_global_experts": 4, "dispatch_count": [7, 7, 7, 11]},
    "helloworld_fp64": {"init": "422e5f07c598878f", "losses": [2.349922, 2.158892, 1.982784, 1.819708], "l_aux": [1.025888, 1.025433, 1.024966, 1.02448], "local_count": 2144, "shared_count": 32, "num_global_experts": 2, "dispatch_count": [16, 16]},
    "ddp_tutel_auto": {"init": "889de584584e6943", "losses": [2.309614, 2.119357, 1.946152, 1.787181], "l_aux": [0.9999999, 1.0, 1.0, 1.0], "local_count": 2144, "shared_count": 32, "num_global_experts": 2, "dispatch_count": [16, 16]},
    "llama": {"init": "ac855067bfc640e7", "losses": [2.079448, 2.078505, 1.95665], "l_aux": [0.9999999, 1.0, 1.0], "local_count": 768, "shared_count": 32, "num_global_experts": 2, "dispatch_count": [16, 16]},
    "switch": {"init": "889de584584e6943", "losses": [2.309614, 2.119357, 1.946152, 1.787181, 1.639861, 1.502273], "r_o": [[1, 8], [0, 1], [0, 2], [0, 3], [0, 4], [0, 5]], "valid_rs": [0, 1]},
    "custom_gate_expert": {"init": "d6a557b7a4261076", "losses": [2.818203, 2.57861, 2.357446, 2.154496], "keys": ["_num_global_experts", "experts.W", "gates.0.proj.weight"]},
    "custom_expert_sharded": {"init": "39645de74377faa1", "losses": [2.808203, 2.56861, 2.347446, 2.144496], "local_count": 512},
    "from_scratch": {"losses": [2.770304, 2.767473, 2.764639, 2.761801], "topk_ids": [[3, 2], [3, 2], [1, 2], [3, 0], [1, 3], [0, 1], [2, 0], [0, 2], [2, 1], [0, 3], [1, 0], [0, 1]], "total": [7, 6, 6, 5], "capacity": 7, "locations": [[0, 1, 0, 2, 1, 0, 0, 1, 1, 2, 2, 3], [2, 3, 4, 4, 3, 3, 5, 5, 4, 4, 6, 5]]},
    "mnist_like": {"init": "4c8db5615cf4ca69", "losses": [2.238243, 2.337182, 2.296453], "eval": [2.295944, 2.295944, 2.295944], "expert_params": 4},
    "options": {"init": "c17134effdf684fb", "keys": ["_num_global_experts", "experts.batched_fc1_w", "experts.batched_fc2_bias", "experts.batched_fc2_w", "gates.0.cosine_projector.bias", "gates.0.cosine_projector.weight", "gates.0.sim_matrix", "gates.0.temperature", "gates.1.wg.weight"], "losses": [0.0113246, 0.00653953, 0.008633118], "shape": [2, 8, 6]},
}

_FLOAT_KEYS = ("losses", "l_aux", "eval")


def _close(a, b, rtol=1e-5):
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=rtol, abs_tol=1e-7) for x, y in zip(a, b))


@pytest.fixture(autouse=True)
def _restore_global_state():
    dtype, rng = torch.get_default_dtype(), torch.get_rng_state()
    yield
    torch.set_default_dtype(dtype)
    torch.set_rng_state(rng)


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_example_code_path_equals_tutel(name):
    got, want = SCENARIOS[name](tutel), GOLDEN[name]
    assert set(got) == set(want)
    for key in want:
        if key in _FLOAT_KEYS:
            assert _close(got[key], want[key]), (key, got[key], want[key])
        else:
            assert (list(map(list, got[key])) if key == "r_o" else got[key]) == want[key], key


def test_reverse_maps_match_a_pure_reference():
    got = from_scratch(tutel, steps=1, reverse_maps=True)
    E, C = len(got["total"]), got["capacity"]
    sid, tid = [[-1] * C for _ in range(E)], [[-1] * C for _ in range(E)]
    for j, locs in enumerate(got["locations"]):
        for t, loc in enumerate(locs):
            e = got["topk_ids"][t][j]
            if loc < C:
                sid[e][loc], tid[e][loc] = t, j
    assert got["sample_ids"] == sid and got["top_ids"] == tid
    assert got["inner"] == [[s % 4 if s >= 0 else -1 for s in row] for row in sid]
    assert got["total"] == [sum(row[j] == e for row in got["topk_ids"] for j in range(2)) for e in range(E)]


# --------------------------------------------------------------------------- layer surface

def _layer(**kw):
    cfg = dict(gate_type={"type": "top", "k": 2, "fp32_gate": True}, model_dim=8,
               experts={"type": "ffn", "num_experts_per_device": 4, "hidden_size_per_expert": 8,
                        "activation_fn": F.relu}, seeds=(1, 2, 3))
    cfg.update(kw)
    return moe.moe_layer(**cfg)


def test_layer_equals_functional_core_and_fmoe_nn_layer():
    layer = _layer()
    x = torch.randn(3, 5, 8)
    y = layer(x)
    spec = fmoe.MoESpec(model_dim=8, num_experts=4, gate=fmoe.GateSpec(type="top", k=2, fp32_gate=True),
                        experts=fmoe.ExpertSpec(type="ffn", hidden_size=8, activation=F.relu))
    params = {"gate": {"wg": layer.gates[0].wg.weight},
              "experts": {"fc1_w": layer.experts.batched_fc1_w, "fc2_w": layer.experts.batched_fc2_w,
                          "fc1_b": layer.experts.batched_fc1_bias, "fc2_b": layer.experts.batched_fc2_bias}}
    y2, aux = fmoe.moe(params, x, spec)
    assert torch.equal(y, y2) and torch.equal(layer.l_aux, aux.l_aux) and torch.equal(y.l_aux, aux.l_aux)
    assert torch.equal(layer.dispatch_count, aux.counts)
    # The same checkpoint (Tutel's names and shapes) loads into fmoe.nn.MoELayer and gives the same output.
    nn_layer = MoELayer({"type": "top", "k": 2, "fp32_gate": True}, model_dim=8,
                        experts={"type": "ffn", "num_experts_per_device": 4, "hidden_size_per_expert": 8,
                                 "activation_fn": F.relu})
    nn_layer.load_state_dict(layer.state_dict())
    assert torch.equal(nn_layer(x), y)


def test_attributes_scripts_read_and_sticky_per_call_settings():
    layer = _layer(a2a_ffn_overlap_degree=2)
    assert (layer.num_global_experts, layer.sharded_count, layer.valid_rs, layer.adaptive_degree) == (4, 1, [0, 1], 1)
    assert layer.a2a_ffn_overlap_degree == 2 and layer.world_size == 1
    x = torch.randn(2, 6, 8)
    y = layer(x, a2a_ffn_overlap_degree=3, adaptive_r=0)
    assert layer.a2a_ffn_overlap_degree == 3 and layer.adaptive_degree == 0  # Tutel: per-call values stick
    assert torch.equal(y.l_aux, layer.l_aux) and layer.dispatch_count.tolist() and int(layer.dispatch_count.sum()) == 24
    with pytest.raises(ValueError, match=r"adaptive_r=2 is not one of \[0, 1\]"):
        layer(x, adaptive_r=2)
    assert moe.moe_layer.global_expert_count(3) == 3 and moe.moe_layer.global_expert_count(-1) == 1
    with pytest.raises(ValueError, match="num_experts_per_device must be a non-zero int"):
        moe.moe_layer.global_expert_count(0.5)  # Tutel mis-converts fractions


def test_overlap_degree_rounds_capacity_on_one_process():
    # k=1, E=2, T=16, cf=0.25: capacity 2; Tutel rounds it up to a multiple of the degree (3), keeping more tokens.
    x = torch.randn(16, 8)
    outs = {}
    for d in (1, 3):
        layer = _layer(gate_type={"type": "top", "k": 1, "capacity_factor": 0.25},
                       experts={"type": "ffn", "num_experts_per_device": 2, "hidden_size_per_expert": 8},
                       a2a_ffn_overlap_degree=d)
        outs[d] = layer(x)
        spec = fmoe.MoESpec(model_dim=8, num_experts=2, gate=fmoe.GateSpec(k=1, capacity_factor=0.25, fp32_gate=False),
                            experts=fmoe.ExpertSpec(hidden_size=8), alignment=d)
        params = {"gate": {"wg": layer.gates[0].wg.weight}, "experts": layer.experts.params()}
        y, aux = fmoe.moe(params, x, spec)
        assert torch.equal(outs[d], y) and aux.capacity == (2 if d == 1 else 3)
    assert (outs[3].abs().sum(1) > 0).sum() > (outs[1].abs().sum(1) > 0).sum()


def test_tags_scan_expert_func_and_parameter_iterator():
    layer = _layer(scan_expert_func=lambda name, p: setattr(p, "skip_allreduce", True))
    experts = dict(layer.get_parameter_iterator("local_experts"))
    gates = dict(layer.get_parameter_iterator("gate"))
    assert sorted(experts) == ["batched_fc1_bias", "batched_fc1_w", "batched_fc2_bias", "batched_fc2_w"]
    assert sorted(gates) == ["0.wg.weight"]
    assert all(getattr(p, "_tutel_expert", False) and p.skip_allreduce for p in experts.values())
    assert not any(hasattr(p, "_tutel_expert") or hasattr(p, "skip_allreduce") for p in gates.values())
    with pytest.raises(ValueError, match="param_type must be 'gate' or 'local_experts'"):
        layer.get_parameter_iterator("shared")


def test_accepted_and_rejected_constructor_arguments(caplog):
    x = torch.randn(4, 8)
    with caplog.at_level(logging.WARNING):
        a = _layer(pad_samples=True, megablocks_size=4, inequivalent_tokens=True, use_2dh=True,
                   parallel_type="auto")
    assert "pad_samples" in caplog.text
    assert a.adaptive_degree == 1
    b = _layer()
    assert torch.equal(a(x, megablocks_size=2, inequivalent_tokens=True), b(x))  # documented no-ops on CPU
    for mode, r in (("data", 1), ("model", 1), ("adaptive:0", 0)):
        assert _layer(parallel_type=mode).adaptive_degree == r
    with pytest.raises(ValueError, match="parallel_type must be 'adaptive:<r>', 'data', 'model' or 'auto'"):
        _layer(parallel_type="fast")
    with pytest.raises(TypeError, match=r"unrecognized argument\(s\) \['bogus'\]"):
        _layer(bogus=1)
    with pytest.raises(ValueError, match=r"unknown keys \['top_k'\] for gate type 'top'"):
        _layer(gate_type={"type": "top", "top_k": 2})
    with pytest.raises(ValueError, match=r"gate k must be an int >= 1"):
        _layer(gate_type={"type": "top", "k": -2})
    with pytest.raises(ValueError, match="unknown experts type 'moe'"):
        _layer(experts={"type": "moe", "num_experts_per_device": 1})


def test_config_dicts_are_not_mutated():
    class Expert(torch.nn.Module):
        def __init__(self, model_dim, num_experts_per_device, sharded_count):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(num_experts_per_device, model_dim, model_dim))

        def forward(self, x, ctx):
            return x @ self.w

    gate = {"type": "top", "k": 1}
    experts = {"type": "custom", "module": Expert, "num_experts_per_device": 2}
    moe.moe_layer(gate_type=gate, model_dim=4, experts=experts)
    assert gate == {"type": "top", "k": 1} and experts == {"type": "custom", "module": Expert,
                                                           "num_experts_per_device": 2}


def test_custom_modules_contract():
    seen = {}

    class Gate(torch.nn.Module):
        def __init__(self, model_dim, num_global_experts, top_k, scale):
            super().__init__()
            self.top_k, self.scale = top_k, scale
            self.w = torch.nn.Parameter(torch.randn(num_global_experts, model_dim))

        def forward(self, x):
            return self.scale * F.linear(x, self.w)

    class Expert(torch.nn.Module):  # returns [n, C, 2, 3] for reserve_dims=2 inputs [..., 2, 3]
        def __init__(self, model_dim, num_experts_per_device, sharded_count):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(num_experts_per_device, 1, 1, 3))

        def forward(self, x, ctx):
            seen.update(shape=tuple(x.shape), sharded=ctx.sharded_count, E=ctx.num_global_experts,
                        r=ctx.adaptive_degree)
            return x * self.w

    layer = moe.moe_layer(gate_type={"type": "custom", "module": Gate, "top_k": 1, "scale": 2.0}, model_dim=6,
                          experts={"type": "custom", "module": Expert, "num_experts_per_device": 3})
    assert layer.gates[0].gate_noise == 0.0 and layer.gates[0].capacity_factor == 1.0
    x = torch.randn(4, 5, 2, 3, requires_grad=True)
    y = layer(x, reserve_dims=2)
    assert y.shape == (4, 5, 2, 3) and layer.protected_shape[-2:] == (2, 3)
    assert seen["sharded"] == 1 and seen["E"] == 3 and seen["r"] == 1 and seen["shape"][2:] == (2, 3)
    # Reference: route with the custom gate's logits, run each token through its chosen expert, scale by the gate.
    tokens = x.detach().reshape(20, 6)
    scores = torch.softmax(2.0 * F.linear(tokens, layer.gates[0].w), dim=1)
    routing = fmoe.top_k_routing(scores, 1, 1.0)
    ref = torch.zeros(20, 6)
    for t in range(20):
        e, s = int(routing.expert_ids[0, t]), int(routing.slots[0, t])
        if s < routing.capacity:
            ref[t] = (tokens[t].view(2, 3) * layer.experts.w[e, 0]).reshape(6) * routing.weights[0, t]
    assert torch.allclose(y.detach().reshape(20, 6), ref, atol=1e-6)
    (y.square().sum() + layer.l_aux).backward()  # gradients reach the custom gate through the gates
    assert layer.gates[0].w.grad is not None and layer.gates[0].w.grad.abs().sum() > 0
    assert layer.experts.w.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="custom gate Bare must set self.top_k"):
        class Bare(torch.nn.Module):
            def __init__(self, model_dim, num_global_experts):
                super().__init__()

        moe.moe_layer(gate_type={"type": "custom", "module": Bare}, model_dim=6,
                      experts={"type": "custom", "module": Expert})


def test_result_func_sees_l_aux_in_compat_and_fmoe_nn():
    x = torch.randn(6, 8)
    y, l_aux = _layer(result_func=lambda out: (out, out.l_aux))(x)
    assert l_aux is not None and torch.equal(l_aux, y.l_aux)
    nn_layer = MoELayer({"type": "top", "k": 1}, model_dim=8,
                        experts={"type": "ffn", "num_experts_per_device": 2, "hidden_size_per_expert": 4},
                        result_func=lambda out: out.l_aux)
    assert torch.equal(nn_layer(x), nn_layer(x, return_aux=True)[1].l_aux)


def test_checkpoints_round_trip_and_legacy_checkpoint_loads(caplog):
    a, b = _layer(), _layer(seeds=(5, 6, 7))
    x = torch.randn(3, 8)
    assert not torch.equal(a(x), b(x))
    sd = a.state_dict()
    b.load_state_dict(sd)
    assert torch.equal(a(x), b(x))
    legacy = {k: v for k, v in sd.items() if k != "_num_global_experts"}
    with caplog.at_level(logging.WARNING):
        _layer(seeds=(8, 9, 10)).load_state_dict(legacy)
    assert "legacy Tutel checkpoint" in caplog.text
    with pytest.raises(RuntimeError, match="checkpoint has 4 global experts"):
        _layer(experts={"type": "ffn", "num_experts_per_device": 2, "hidden_size_per_expert": 8}).load_state_dict(sd)


def test_llama_ffn_layout_equals_a_loop_reference():
    layer = _layer(experts={"type": "llama_ffn", "num_experts_per_device": 2, "hidden_size_per_expert": 4})
    assert {k: tuple(v.shape) for k, v in layer.state_dict().items() if k.startswith("experts.")} == {
        "experts.W_fc1": (64,), "experts.W_fc2": (64,), "experts.W_fc3": (64,)}
    x = torch.randn(5, 8)
    p = layer.experts.params()
    ref = torch.zeros(5, 8)
    scores = torch.softmax(F.linear(x, layer.gates[0].wg.weight), dim=1)
    r = fmoe.top_k_routing(scores, 2, 1.0)
    for j in range(2):
        for t in range(5):
            e = int(r.expert_ids[j, t])
            h = F.silu(x[t] @ p["gate_w"][e]) * (x[t] @ p["up_w"][e])
            ref[t] += r.weights[j, t] * (h @ p["down_w"][e])
    assert torch.allclose(layer(x), ref, atol=1e-6)


# --------------------------------------------------------------------------- net / system

def test_net_helpers_on_one_process():
    x = torch.arange(12.0).reshape(3, 4)
    assert net.get_world_size() == 1 and net.get_world_rank() == 0
    for fn in (net.simple_all_reduce, net.simple_all_to_all, net.simple_split, net.simple_reduce_scatter,
               net.simple_all_gather, net.simple_broadcast):
        assert torch.equal(fn(x), x)
    assert torch.equal(net.zero_gather(torch.arange(6.0), full_shape=(5,)), torch.arange(5.0))
    flat, shape = net.zero_scatter(x, net.simple_split)
    assert torch.equal(flat, x.reshape(-1)) and shape == (3, 4)
    w = torch.randn(2, 6, 4, requires_grad=True)
    y = net.all_to_all(w, 1, 0)
    assert torch.equal(y, w)
    y.sum().backward()
    assert torch.equal(w.grad, torch.ones_like(w))
    assert torch.equal(net.all_gather(x, 1), x) and torch.equal(net.reduce_scatter(x, 0), x)
    assert torch.equal(net.spatial_split(x, 0), x)
    net.barrier()


def test_tutel_distributed_optimizer_equals_sgd_on_one_process():
    def make():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), _layer(seeds=(1, 1, 1)))
        return m

    ref, m = make(), make()
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = net.TutelDistributedOptimizer(m.parameters(), group=None, average_shared=True).warp_local(
        torch.optim.SGD, lr=0.1)
    assert len(opt.expert_params) == 4 and len(opt.params) == 3  # Linear weight/bias + gate
    x = torch.randn(5, 8)
    for _ in range(3):
        for model, o in ((ref, opt_ref), (m, opt)):
            o.zero_grad()
            model(x).square().sum().backward()
            o.step()
    for (k, a), (_, b) in zip(ref.state_dict().items(), m.state_dict().items()):
        assert torch.equal(a, b), k


def test_system_session_and_helpers(tmp_path, caplog, capsys):
    env = system.init_data_model_parallel(group_count=1, backend="gloo")
    assert system.get_local_session() is env
    assert (env.global_size, env.global_rank, env.model_size, env.group_count, env.is_cuda) == (1, 0, 1, 1, False)
    assert env.local_device == torch.device("cpu") and env.model_group is None
    env.dist_print("hello")
    assert capsys.readouterr().out == "hello\n"
    t0 = system.record_time()
    assert system.record_time() >= t0
    path = system.apply_rank_size_from_pattern(str(tmp_path / "ckpt" / "{rank}-of-{size}.pt"), rank=1, size=4)
    assert path == str(tmp_path / "ckpt" / "1-of-4.pt") and (tmp_path / "ckpt").is_dir()
    with caplog.at_level(logging.WARNING):
        system.apply_rank_size_from_pattern("model.pt", rank=0, size=1, create_dir=False)
    assert "{rank}" in caplog.text
    with pytest.raises(ValueError, match="backend must be 'gloo', 'nccl' or 'mpi'"):
        system.init_data_model_parallel(backend="ucc")
    assert tutel.moe is moe and tutel.net is net and tutel.system is system


# --------------------------------------------------------------------------- fmoe.nn.MoELayer load faults

def _nn_layer(n=2, H=4):
    return MoELayer({"type": "top", "k": 1}, model_dim=6,
                    experts={"type": "ffn", "num_experts_per_device": n, "hidden_size_per_expert": H}, seeds=(1, 2, 3))


def test_nn_load_refuses_transposed_expert_tensor():
    sd = _nn_layer().state_dict()
    sd["experts.batched_fc1_w"] = sd["experts.batched_fc1_w"].transpose(1, 2).contiguous()  # [2, 6, 4], same numel
    with pytest.raises(RuntimeError, match=r"expert parameter 'experts.batched_fc1_w': checkpoint tensor has "
                                           r"shape \(2, 6, 4\), this layer expects \(2, 4, 6\) \(transposed"):
        _nn_layer().load_state_dict(sd)


@pytest.mark.parametrize("key,bad", [("experts.batched_fc1_bias", (1, 4)), ("experts.batched_fc1_bias", (2, 1)),
                                     ("experts.batched_fc2_bias", (1, 6))])
def test_nn_load_refuses_broadcastable_bias(key, bad):
    sd = _nn_layer().state_dict()
    sd[key] = torch.zeros(bad)
    expected = tuple(_nn_layer().state_dict()[key].shape)
    with pytest.raises(RuntimeError, match=rf"expert parameter '{key}': checkpoint tensor has shape "
                                           rf"\({bad[0]}, {bad[1]}\), this layer expects "
                                           rf"\({expected[0]}, {expected[1]}\) \(wrong shape"):
        _nn_layer().load_state_dict(sd)


def test_nn_load_still_accepts_flat_and_tutel_bias_layouts():
    a, b = _nn_layer(), _nn_layer()
    sd = {k: v.clone() for k, v in a.state_dict().items()}
    sd["experts.batched_fc1_bias"] = torch.arange(8.0).view(2, 1, 4)  # helloworld_from_scratch's [n, 1, H]
    sd["experts.batched_fc2_w"] = sd["experts.batched_fc2_w"].reshape(-1)  # flat (converted) layout
    b.load_state_dict(sd)
    assert torch.equal(b.experts.batched_fc1_bias, torch.arange(8.0).view(2, 4))
    assert torch.equal(b.experts.batched_fc2_w, a.experts.batched_fc2_w)


def test_load_importance_loss_needs_noise_at_construction():
    with pytest.raises(ValueError, match=r"is_gshard_loss=False .* needs gate_noise > 0; gate\(s\) \[0\] have none"):
        _layer(is_gshard_loss=False)
    assert _layer(is_gshard_loss=False, gate_type={"type": "top", "k": 2, "gate_noise": 0.5}).is_gshard_loss is False


def test_fast_cumsum_sub_one_gives_slots_of_a_one_hot_mask():
    mask = torch.tensor([[1, 0], [0, 1], [1, 0], [1, 0]])
    assert moe.fast_cumsum_sub_one(mask).tolist() == [[0, -1], [0, 0], [1, 0], [2, 0]]
    with pytest.raises(ValueError, match="only dim=0"):
        moe.fast_cumsum_sub_one(mask, dim=1)


def test_nccl_backend_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(RuntimeError, match="backend='nccl' needs CUDA"):
        net.create_groups_from_world(group_count=1, include_init="nccl")


def test_deprecated_gate_type_string():
    a, b = _layer(gate_type="Top2Gate"), _layer(gate_type={"type": "top", "k": 2})
    assert a.gates[0].top_k == 2 and torch.equal(a.gates[0].wg.weight, b.gates[0].wg.weight)
    with pytest.raises(ValueError, match="gate_type string must look like 'Top2Gate'"):
        _layer(gate_type="Switch")
