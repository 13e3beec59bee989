"""Issue 36: the edges a new user meets in the first hour give the right result or a clear error.

One test (or a few) per item of the issue, with the siblings found: params that do not fit the spec
(bias flags, every dim, unknown keys, one swiglu form), settings that drop every token, NaN/Inf input
for every router / k / normalize, the launchers (mpiexec, torchrun) without a communicator, replayed
routings against k and capacity, vmap over dropless/capped capacity, MoEAux out of a vmap, the compat
layer's inputs and fmoe.nn's Tutel options, and the short reprs. The multi-rank agreement of the same
errors is in tests/mpi/test_edges_mpi.py.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys

import pytest
import torch
from torch.utils import _pytree as pytree

import fmoe
from fmoe import ExpertSpec, GateSpec, MoESpec
from fmoe.nn import MoELayer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
M, E, H = 16, 4, 32


def _spec(k=2, cf=1.0, etype="ffn", **kw):
    return MoESpec(model_dim=M, num_experts=E, gate=GateSpec(k=k, capacity_factor=cf),
                   experts=ExpertSpec(etype, H), **kw)


def _params(spec, seed=0):
    p = fmoe.init_params(spec, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed + 1)
    for key in ("fc1_b", "fc2_b"):   # non-zero biases: an ignored flag would change y
        if key in p["experts"]:
            p["experts"][key] = torch.randn(p["experts"][key].shape, generator=g)
    return p


def _x(T=64, seed=2):
    return torch.randn(T, M, generator=torch.Generator().manual_seed(seed))


def _no_bias(spec, fc1=True, fc2=True):
    return dataclasses.replace(spec, experts=dataclasses.replace(spec.experts, has_fc1_bias=not fc1,
                                                                 has_fc2_bias=not fc2))


# ------------------------------------------------------------------ 1, 2: params against the spec

@pytest.mark.parametrize("fc1,fc2,key", [(True, True, "fc1_b"), (False, True, "fc2_b"), (True, False, "fc1_b")])
def test_bias_flag_off_while_params_hold_the_bias_raises(fc1, fc2, key):
    spec = _spec()
    p = _params(spec)
    flag = {"fc1_b": "has_fc1_bias", "fc2_b": "has_fc2_bias"}[key]
    with pytest.raises(ValueError, match=rf"{flag}=False but params hold experts\['{key}'\]: drop the key or "
                                         rf"set {flag}=True"):
        fmoe.moe(p, _x(), _no_bias(spec, fc1, fc2))
    # the no-bias ablation done right: drop the keys; then y equals the biased layer with zero biases
    nob = {"gate": p["gate"], "experts": {k: v for k, v in p["experts"].items() if not k.endswith("_b")}}
    y, _ = fmoe.moe(nob, _x(), _no_bias(spec))
    zero = {"gate": p["gate"], "experts": {k: v if not k.endswith("_b") else torch.zeros_like(v)
                                           for k, v in p["experts"].items()}}
    torch.testing.assert_close(y, fmoe.moe(zero, _x(), spec)[0], rtol=1e-6, atol=1e-6)


def test_bias_flag_on_without_the_bias_raises():
    spec = _spec()
    p = _params(spec)
    p["experts"].pop("fc2_b")
    with pytest.raises(ValueError, match=r"has_fc2_bias=True but experts\['fc2_b'\] is missing: add it or set "
                                         r"has_fc2_bias=False"):
        fmoe.moe(p, _x(), spec)


@pytest.mark.parametrize("etype", ["ffn", "gated_ffn", "swiglu", "gpt_oss"])
@pytest.mark.parametrize("change", ["hidden", "experts", "output"])
def test_every_dim_of_every_kind_is_checked(etype, change):
    small = _spec(etype=etype)
    p0 = _params(small)
    p = dict(p0)
    if change == "hidden":
        other = dataclasses.replace(small, experts=dataclasses.replace(small.experts, hidden_size=2 * H))
    elif change == "experts":
        other = dataclasses.replace(small, num_experts=2 * E)
        p["gate"] = _params(other)["gate"]   # the router fits: only the experts are wrong
    else:
        other = dataclasses.replace(small, experts=dataclasses.replace(small.experts, output_dim=M + 4))
    with pytest.raises(ValueError, match=rf"parameter pytree does not match the MoESpec: experts\['\w+'\] has shape "
                                         rf"\[.*\]; this spec \(num_experts={other.num_experts}, model_dim={M}, "
                                         rf"hidden_size={other.experts.hidden_size}.* needs \[.*\] for a {etype} expert"):
        fmoe.moe(p, _x(), other)
    fmoe.moe(p0, _x(), small)   # the matching spec runs


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_expert_count_mismatch_inside_transforms_names_the_parameter(transform):
    spec4 = _spec()
    p = _params(spec4)
    spec8 = dataclasses.replace(spec4, num_experts=8)
    p["gate"] = _params(spec8)["gate"]
    want = r"experts\['fc1_w'\] has shape \[4, 32, 16\]; this spec \(num_experts=8.* needs \[8, 32, 16\]"
    with pytest.raises(ValueError, match=want):
        if transform == "grad":
            torch.func.grad(lambda ex: fmoe.moe({"gate": p["gate"], "experts": ex}, _x(), spec8)[0].sum())(p["experts"])
        else:
            torch.func.vmap(lambda x: fmoe.moe(p, x, spec8)[0])(_x().reshape(4, 16, M))


def test_unknown_expert_key_and_two_swiglu_forms_raise():
    spec = _spec()
    p = _params(spec)
    p["experts"]["fc3_w"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"experts\['fc3_w'\] is not a ffn parameter; ffn experts take"):
        fmoe.moe(p, _x(), spec)
    sw = _spec(etype="swiglu")
    q = _params(sw)
    gu = q["experts"]["gate_up_proj"]
    q["experts"]["gate_proj"], q["experts"]["up_proj"] = gu[:, :H], gu[:, H:]
    with pytest.raises(ValueError, match="swiglu experts take 'gate_up_proj' or both 'gate_proj' and 'up_proj' "
                                         r"\(one form, not both\)"):
        fmoe.moe(q, _x(), sw)


def test_shared_expert_model_dim_is_checked():
    spec = _spec(etype="swiglu", shared="swiglu")
    p = _params(spec)
    p["shared"]["down_proj"] = torch.zeros(M + 1, H)
    with pytest.raises(ValueError, match=r"shared experts need gate_proj/up_proj \[I, M=16\] and down_proj "
                                         r"\[M=16, I\], got \[32, 16\], \[32, 16\], \[17, 32\]"):
        fmoe.moe(p, _x(), spec)


def test_packed_weights_are_checked_by_their_logical_shape():
    from fmoe import quant
    spec = _spec(etype="swiglu")
    p = _params(spec)
    p["experts"] = {k: quant.quantize_mxfp4(v) if k == "down_proj" else v for k, v in p["experts"].items()}
    fmoe.moe(p, _x(), spec)   # [E, M, I] out x in fits
    big = dataclasses.replace(spec, experts=dataclasses.replace(spec.experts, output_dim=2 * M))
    with pytest.raises(ValueError, match=r"experts\['down_proj'\] has shape \[4, 16, 32\].*needs \[4, 32, 32\].*"
                                         r"\(packed weights: out x in\)"):
        fmoe.moe(p, _x(), big)


# ------------------------------------------------------------------ 3: settings that drop every token

def test_small_negative_capacity_factor_raises_like_the_positive_one():
    for cf in (0.01, -0.01):
        spec = _spec(k=2, cf=cf)
        p = _params(spec)
        with pytest.raises(ValueError, match=r"capacity is 0: int\((-capacity_factor|capacity_factor) \* ceil\(T / E\)\) "
                                             r"= int\(0.01 \* ceil\(128 / 4\)\) = 0"):
            fmoe.moe(p, _x(128), spec)
    # the smallest capped factor that keeps a row: -1/ceil(T/E)
    spec = _spec(k=2, cf=-1 / 32)
    y, aux = fmoe.moe(_params(spec), _x(128), spec)
    assert aux.capacity == 2 and int(aux.dropped) == 256 - int(aux.counts.clamp(max=2).sum())
    # no tokens: nothing to drop, no error
    assert fmoe.routing.capacity_for(-0.01, num_tokens=0, num_experts=E, k=2, max_load=0) == 0


def test_zero_capacity_siblings_raise():
    from fmoe import ablate
    spec = _spec()
    with pytest.raises(ValueError, match="capacity is 0"):   # ablation points go through the same formula
        ablate.sweep_moe(_params(spec), _x(128), spec, [ablate.Point(capacity_factor=-0.01)])
    with pytest.raises(ValueError, match="capacity is 0"):   # the Tutel layer's per-call override too
        layer = MoELayer({"type": "top", "k": 2}, M, {"type": "ffn", "num_experts_per_device": E,
                                                            "hidden_size_per_expert": H})
        layer(_x(128), capacity_factor=-0.01)


# ------------------------------------------------------------------ 4: NaN / Inf

_ROUTERS = [dict(type="top"), dict(type="cosine_top"), dict(type="sinkhorn"), dict(type="qwen"),
            dict(type="mixtral"), dict(type="deepseek"), dict(type="gpt_oss")]


@pytest.mark.parametrize("k,normalize", [(1, True), (2, True), (2, False)])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_x_raises_for_every_k_and_normalize(k, normalize, bad):
    spec = dataclasses.replace(_spec(k=k), normalize_gate=normalize)
    x = _x()
    x[7, 3] = bad
    with pytest.raises(ValueError, match=r"router logits \[T, E\] holds non-finite values \((NaN|Inf)\) in 1 of 64 "
                                         r"rows \[\.\.\., 4\] \(first: row 7\); the router's input x or its "
                                         r"parameters hold NaN/Inf"):
        fmoe.moe(_params(spec), x, spec)


@pytest.mark.parametrize("gate", _ROUTERS, ids=lambda g: g["type"])
def test_non_finite_x_raises_for_every_router(gate):
    spec = dataclasses.replace(_spec(k=2, cf=0.0), gate=GateSpec(k=2, capacity_factor=0.0, **gate))
    p = _params(spec)
    x = _x()
    x[3, 0] = float("nan")
    with pytest.raises(ValueError, match=r"router logits \[T, E\] holds non-finite values \(NaN\).*first: row 3"):
        fmoe.moe(p, x, spec)
    p["gate"] = {k: v.clone() for k, v in p["gate"].items()}
    w = next(iter(p["gate"]))
    p["gate"][w].view(-1)[0] = float("inf")   # a corrupt router weight is named the same way
    with pytest.raises(ValueError, match=r"router logits \[T, E\] holds non-finite values"):
        fmoe.moe(p, _x(), spec)


def test_finite_check_is_exact_when_the_sum_overflows():
    from fmoe.routing import check_finite
    big = torch.full((64, 8), 60000.0, dtype=torch.float16)   # finite, but their sum is inf in fp16
    check_finite(big, "x", "")
    big[9, 2] = float("nan")
    with pytest.raises(ValueError, match=r"x holds non-finite values \(NaN\) in 1 of 64 rows \[\.\.\., 8\] \(first: row 9\)"):
        check_finite(big, "x", "")


def test_non_finite_x_raises_inside_vmap_and_grad():
    spec = _spec(k=1)
    p = _params(spec)
    xs = _x().reshape(4, 16, M).clone()
    xs[2, 5, 1] = float("nan")   # one example of the batch
    with pytest.raises(ValueError, match=r"router logits \[T, E\] holds non-finite values \(NaN\)"):
        torch.func.vmap(lambda x: fmoe.moe(p, x, spec)[0])(xs)
    with pytest.raises(ValueError, match=r"router logits \[T, E\] holds non-finite values \(NaN\)"):
        torch.func.grad(lambda gp: fmoe.moe({"gate": gp, "experts": p["experts"]}, xs[2], spec)[0].sum())(p["gate"])
    # clean examples still run under the same transforms
    torch.func.vmap(lambda x: fmoe.moe(p, x, spec)[0])(xs[:2])


# ------------------------------------------------------------------ 5: launchers without a communicator

def _tool(name):
    path = os.path.join(os.path.dirname(sys.executable), name)
    return path if os.path.exists(path) else shutil.which(name)


def _launch_worker():
    """Under a 2-rank launch with no communicator set up: both layers refuse, LocalComm runs."""
    import fmoe.compat.tutel as T
    from fmoe.comm.launch import launched_world
    launcher, size = launched_world()
    assert size == 2, (launcher, size)
    cfg = dict(gate_type={"type": "top", "k": 1}, model_dim=8,
               experts={"type": "ffn", "num_experts_per_device": 1, "hidden_size_per_expert": 8})
    with pytest.raises(RuntimeError, match=rf"one of 2 ranks started by {launcher}, but no comm= was given.*"
                                           r"comm=fmoe.comm.from_env\(\)"):
        MoELayer(**cfg)
    with pytest.raises(RuntimeError, match=rf"group=None is the job's world, but this process is one of 2 ranks "
                                           rf"started by {launcher}.*init_data_model_parallel\(\)"):
        T.moe.moe_layer(**cfg)
    y = MoELayer(**cfg, comm=fmoe.comm.LocalComm())(torch.randn(4, 8))
    assert y.shape == (4, 8)
    print(f"WORKER OK {launcher}", flush=True)


@pytest.mark.parametrize("launcher", ["mpiexec", "torchrun"])
def test_layers_refuse_to_run_silently_local_under_a_launcher(launcher):
    tool = _tool(launcher)
    if tool is None:
        pytest.skip(f"{launcher} not found")
    if launcher == "torchrun":
        cmd = [tool, "--standalone", "--nproc_per_node=2", __file__, "worker"]
    else:
        cmd = [tool, "-n", "2", sys.executable, __file__, "worker"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.count(f"WORKER OK {launcher}") == 2, proc.stdout[-3000:]
    assert "FutureWarning" not in proc.stderr, proc.stderr[-3000:]


def test_one_process_is_not_a_launch(monkeypatch):
    from fmoe.comm.launch import launched_world
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS",
                "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "RANK"):
        monkeypatch.delenv(var, raising=False)
    assert launched_world() == ("", 1)
    monkeypatch.setenv("PMI_SIZE", "1")   # mpiexec -n 1: one process, nothing to share
    monkeypatch.setenv("SLURM_NTASKS", "8")   # an allocation, not a launch: `python` inside sbatch is one process
    assert launched_world() == ("", 1)
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")
    assert launched_world() == ("srun", 4)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "3")
    assert launched_world() == ("mpiexec", 3)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert launched_world() == ("torchrun", 2)


# ------------------------------------------------------------------ 6: replayed routings

def test_replayed_routing_is_checked_against_k_and_capacity():
    spec = _spec(k=2, cf=1.0)
    p = _params(spec)
    x = _x(128)
    y, aux = fmoe.moe(p, x, spec)
    assert torch.equal(fmoe.moe(p, x, spec, routing=aux.routing)[0], y)   # the recording spec replays
    with pytest.raises(ValueError, match=r"injected routing has k=2 pairs per token; this spec's gate has k=1"):
        fmoe.moe(p, x, _spec(k=1, cf=1.0), routing=aux.routing)
    assert int(aux.dropped) > 0
    with pytest.raises(ValueError, match=rf"injected routing has capacity {aux.capacity}, which drops pairs of its "
                                         r"largest expert load \d+; this spec's dropless capacity is \d+"):
        fmoe.moe(p, x, _spec(k=2, cf=0.0), routing=aux.routing)
    with pytest.raises(ValueError, match=rf"injected routing has capacity {aux.capacity}; this spec "
                                         r"\(capacity_factor=2.0, T=128, E=4, k=2, alignment=1\) gives 128"):
        fmoe.moe(p, x, _spec(k=2, cf=2.0), routing=aux.routing)
    with pytest.raises(ValueError, match=r"injected routing is for T=128, E=4; this call has T=64, E=4"):
        fmoe.moe(p, x[:64], spec, routing=aux.routing)
    # a dropless routing replays under a capped spec whose cap it does not exceed, and under dropless
    dl = fmoe.moe(p, x, _spec(k=2, cf=0.0))[1].routing
    fmoe.moe(p, x, _spec(k=2, cf=0.0), routing=dl)
    fmoe.moe(p, x, _spec(k=2, cf=-100.0), routing=dl)


# ------------------------------------------------------------------ 7, 8: vmap

@pytest.mark.parametrize("cf,layout", [(-1.0, "padded"), (-0.5, "auto"), (0.0, "padded")])
def test_vmap_over_dropless_and_capped_capacity_equals_the_loop(cf, layout):
    spec = _spec(k=2, cf=cf, layout=layout)
    p = _params(spec)
    xs = _x(96).reshape(3, 32, M)
    ref = torch.stack([fmoe.moe(p, x, spec)[0] for x in xs])
    torch.testing.assert_close(torch.func.vmap(lambda x: fmoe.moe(p, x, spec)[0])(xs), ref, rtol=1e-6, atol=1e-6)
    # the same through grad (per-example gradients) and vmap over gate weights
    wgs = torch.stack([p["gate"]["wg"], 2 * p["gate"]["wg"]])
    ys = torch.func.vmap(lambda wg: fmoe.moe({"gate": {"wg": wg}, "experts": p["experts"]}, xs[0], spec)[0])(wgs)
    for i in range(2):
        torch.testing.assert_close(ys[i], fmoe.moe({"gate": {"wg": wgs[i]}, "experts": p["experts"]}, xs[0], spec)[0],
                                   rtol=1e-6, atol=1e-6)


def test_compile_runs_capped_padded_fullgraph_and_checks_params():
    spec = _spec(k=2, cf=-1.0, layout="padded")   # the max load cannot be read: C from the load bound T
    p = _params(spec)
    x = _x(32)
    f = torch.compile(lambda p, x: fmoe.moe(p, x, spec)[0], fullgraph=True)
    torch.testing.assert_close(f(p, x), fmoe.moe(p, x, spec)[0], rtol=1e-5, atol=1e-6)
    g = torch.compile(lambda p, x: fmoe.moe(p, x, _no_bias(spec))[0])   # fullgraph: torch wraps the raise
    with pytest.raises(ValueError, match=r"has_fc1_bias=False but params hold experts\['fc1_b'\]"):
        g(p, x)


def test_moe_aux_leaves_a_vmap():
    spec = _spec(k=2, cf=1.0)
    p = _params(spec)
    x = _x()
    wgs = torch.stack([p["gate"]["wg"], -p["gate"]["wg"]])
    ys, aux = torch.func.vmap(lambda wg: fmoe.moe({"gate": {"wg": wg}, "experts": p["experts"]}, x, spec))(wgs)
    assert aux.logits.shape == (2, 64, E) and aux.shared_gate is None and aux.counts.shape == (2, E)
    assert aux.routing.expert_ids.shape == (2, 2, 64) and "batch=[2]" in repr(aux.routing)
    for i in range(2):
        y1, a1 = fmoe.moe({"gate": {"wg": wgs[i]}, "experts": p["experts"]}, x, spec)
        torch.testing.assert_close(ys[i], y1)
        assert torch.equal(aux.routing.expert_ids[i], a1.routing.expert_ids) and torch.equal(aux.counts[i], a1.counts)
    # a replayed call's aux (scores/logits None) leaves a vmap too, and round-trips as a pytree
    _, a2 = torch.func.vmap(lambda xx: fmoe.moe(p, xx, spec, routing=fmoe.moe(p, x, spec)[1].routing))(
        torch.stack([x, x]))
    assert a2.scores is None and a2.l_aux.shape == (2,)
    leaves, tree = pytree.tree_flatten(a1)
    back = pytree.tree_unflatten(leaves, tree)
    assert back.shared_gate is None and torch.equal(back.scores, a1.scores) and back.capacity == a1.capacity


# ------------------------------------------------------------------ 9: compat layer and fmoe.nn

def _compat(**kw):
    import fmoe.compat.tutel as T
    return T.moe.moe_layer(gate_type={"type": "top", "k": 2}, model_dim=8,
                           experts={"type": "ffn", "num_experts_per_device": 4, "hidden_size_per_expert": 16}, **kw)


def test_compat_refuses_integer_input_and_a_wrong_feature_size():
    layer = _compat()
    with pytest.raises(TypeError, match="moe_layer: input must be floating point, got dtype torch.int64"):
        layer(torch.ones(4, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"input's feature size is 9 \(shape \(4, 9\), reserve_dims=1 .*model_dim=8"):
        layer(torch.randn(4, 9))
    assert layer(torch.randn(4, 2, 4), reserve_dims=2).shape == (4, 2, 4)   # 2 x 4 = model_dim


def test_nn_layer_takes_the_compat_options():
    cfg = dict(gate_type={"type": "top", "k": 2}, model_dim=8,
               experts={"type": "ffn", "num_experts_per_device": 4, "hidden_size_per_expert": 16})
    a = MoELayer(**cfg, generator=torch.Generator().manual_seed(0), parallel_type="auto", pad_samples=True)
    b = MoELayer(**cfg, generator=torch.Generator().manual_seed(0), parallel_type="data")
    x = torch.randn(6, 8)
    assert a.parallel_type == "data" and torch.equal(a(x), b(x))
    with pytest.raises(ValueError, match="parallel_type must be 'data', 'model', 'auto' or 'adaptive:<int>'"):
        MoELayer(**cfg, parallel_type="fast")


def test_negative_experts_per_device_on_one_process_raises_in_both_layers():
    exp = {"type": "ffn", "num_experts_per_device": -2, "hidden_size_per_expert": 16}
    with pytest.raises(ValueError, match=r"num_experts_per_device=-2: 2 ranks cannot share an expert evenly in a "
                                         r"group of 1 rank"):
        MoELayer({"type": "top", "k": 1}, 8, exp)
    with pytest.raises(ValueError, match="2 ranks cannot share an expert evenly in a group of 1 ranks"):
        import fmoe.compat.tutel as T
        T.moe.moe_layer(gate_type={"type": "top", "k": 1}, model_dim=8, experts=exp)
    # -1 is Tutel's "one expert per device"
    assert MoELayer({"type": "top", "k": 1}, 8, dict(exp, num_experts_per_device=1)).num_global_experts == 1


# ------------------------------------------------------------------ 10: reprs and the CLI

def test_reprs_are_short():
    spec = _spec()
    y, aux = fmoe.moe(_params(spec), _x(128), spec)
    assert len(repr(aux.routing)) < 200 and len(repr(aux)) < 500, repr(aux)
    assert repr(aux.routing) == ("Routing(k=2, T=128, num_experts=4, capacity=64, expert_ids=int64[2, 128], "
                                 "slots=int64[2, 128], weights=float32[2, 128], counts=int64[4])")
    assert f"dropped={int(aux.dropped)}," in repr(aux) and "scores=float32[128, 4]" in repr(aux)


def test_explain_with_a_bad_shape_prints_the_message_without_a_traceback():
    proc = subprocess.run([sys.executable, "-m", "fmoe", "info", "--explain", "T=64,M=64"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "python -m fmoe info: explain: the shape needs H, E (e.g. T=4096,M=512,H=1024,E=8)" in proc.stderr


if __name__ == "__main__":
    if sys.argv[1:] == ["worker"]:
        _launch_worker()
