"""fmoe.prepare: a layer's prepared inference call equals fmoe.moe on the same parameters bit for
bit, takes its fast lane (no fmoe.moe call) where every routed expert weight is packed and the call
is a small eager CPU call, and is fmoe.moe itself everywhere else; the patched transformers block
runs through it and prepares again when its parameters change."""
from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
import torch

import fmoe
from fmoe import prepared as P
from fmoe import quant as Q
from fmoe.quant import packed
from fmoe.routers import NATIVE_MAX_TOKENS

pytestmark = pytest.mark.skipif(not packed.AVAILABLE, reason="the packed-weight extension is not built")

M, E, K = 128, 6, 3


def _layer(typ: str, fmt: str, gate: str, dt: torch.dtype = torch.float32, combine: str = "fmoe", *,
           int8: bool = False, seed: int = 0):
    """(params, spec): every routed expert weight packed, biases of the kind in dt, a router the
    native route runs (DeepSeek's with a shared SwiGLU expert)."""
    extra = dict(n_group=2, topk_group=2) if gate == "deepseek" else {}
    spec = fmoe.MoESpec(model_dim=M, num_experts=E, gate=fmoe.GateSpec(type=gate, k=K, **extra),
                        experts=fmoe.ExpertSpec(type=typ, hidden_size=128, int8_activations=int8), combine=combine,
                        shared="swiglu" if gate == "deepseek" else None)
    p = fmoe.init_params(spec, generator=torch.Generator().manual_seed(seed), dtype=dt)
    g = torch.Generator().manual_seed(seed + 1)
    out_in = {"gpt_oss": ("gate_up_proj", "down_proj"), "gated_ffn": ("gate_w", "up_w", "down_w"),
              "ffn": ("fc2_w",)}.get(typ, ())   # float x @ W leaves: packed weights are out x in
    ex = {}
    for n, v in p["experts"].items():
        if v.dim() == 3:
            ex[n] = Q.quantize((v.transpose(1, 2) if n in out_in else v).float().contiguous(), fmt)
        else:   # biases large enough to move gpt_oss's clamps
            ex[n] = torch.randn(v.shape, generator=g).to(dt)
    p["experts"] = ex
    return p, spec


CASES = [("gpt_oss", "mxfp4", "gpt_oss"), ("swiglu", "nvfp4", "qwen"), ("ffn", "fp8_block", "top"),
         ("gated_ffn", "mxfp8", "mixtral"), ("swiglu", "mxfp4", "deepseek"), ("swiglu", "fp8_row", "top")]


def _native_routes(p, spec, x) -> bool:
    """Whether the router's native call runs x (its extension built, the torch whose top-k it repeats):
    where it does not, the prepared call is fmoe.moe's, and only the bits are compared."""
    from fmoe.routers import route_native
    t = x.reshape(-1, M)
    return route_native(p["gate"], t, spec.gate, num_experts=E, normalize=spec.normalize_gate,
                        alignment=spec.alignment, fraction=spec.balance_loss and spec.is_gshard_loss) is not None


def _equal_aux(a, b, where):
    for name in ("l_aux", "counts", "dropped", "scores", "logits", "shared_gate"):
        u, v = getattr(a, name), getattr(b, name)
        assert (u is None and v is None) or (u.dtype == v.dtype and torch.equal(u, v)), (where, name)
    assert a.capacity == b.capacity, where
    for name in ("expert_ids", "slots", "weights", "counts"):
        assert torch.equal(getattr(a.routing, name), getattr(b.routing, name)), (where, name)


@pytest.mark.parametrize("combine", ["fmoe", "eager", "grouped"])
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("typ,fmt,gate", CASES)
def test_the_fast_lane_gives_fmoe_moes_bits(typ, fmt, gate, dt, combine, monkeypatch):
    p, spec = _layer(typ, fmt, gate, dt, combine)
    step = fmoe.prepare(p, spec)
    assert step.fast
    for shape in ((1, M), (5, M), (NATIVE_MAX_TOKENS, M), (2, 3, M)):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(shape[0])).to(dt)
        with torch.no_grad():
            want, want_aux = fmoe.moe(p, x, spec)
            with monkeypatch.context() as m:   # the lane makes no fmoe.moe call
                if _native_routes(p, spec, x):
                    m.setattr(P, "moe", lambda *a, **k: pytest.fail("the prepared call fell back to fmoe.moe"))
                y, aux = step(x)
        assert y.dtype == want.dtype and y.shape == want.shape and torch.equal(y, want), (shape, (y != want).sum())
        _equal_aux(aux, want_aux, shape)


@pytest.mark.parametrize("fmt", ["fp8_block", "nvfp4"])
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_packed_shared_experts_give_fmoe_moes_bits(fmt, dt, monkeypatch):
    """DeepSeek's shared SwiGLU packed too (as fmoe.examples.generate loads it): the lane and fmoe.moe
    both run it as one fused-stage call, and give the same bits."""
    p, spec = _layer("swiglu", fmt, "deepseek", dt)
    p["shared"] = {n: Q.quantize(w.float(), fmt) for n, w in p["shared"].items()}
    step = fmoe.prepare(p, spec)
    assert step.fast
    stages = []   # the stage calls of one expert (the shared one's)
    stage = packed.run_stage
    monkeypatch.setattr(packed, "run_stage",
                        lambda *a, **k: stages.append(a[0].weights[-1].logical_shape[0] == 1) or stage(*a, **k))
    for T in (1, 5):
        x = torch.randn(T, M, generator=torch.Generator().manual_seed(T)).to(dt)
        with torch.no_grad():
            want, want_aux = fmoe.moe(p, x, spec)
            y, aux = step(x)
        assert torch.equal(y, want), T
        _equal_aux(aux, want_aux, T)
    assert sum(stages) == 4   # the shared expert's stage call in both paths, both times
    made = []   # the prepared call made its stage weights, the shared expert's too, at prepare time
    weights = packed.stage_weights
    monkeypatch.setattr(packed, "stage_weights", lambda *a, **k: made.append(1) or weights(*a, **k))
    with torch.no_grad():
        step(x)
    assert not made


@pytest.mark.skipif(not packed.has_int8_path(), reason="int8 activations need AVX-512 VNNI")
def test_int8_activations_take_the_lane_too(monkeypatch):
    p, spec = _layer("gpt_oss", "mxfp4", "gpt_oss", torch.bfloat16, "grouped", int8=True)
    x = torch.randn(4, M, generator=torch.Generator().manual_seed(2)).bfloat16()
    with torch.no_grad():
        want, _ = fmoe.moe(p, x, spec)
        if _native_routes(p, spec, x):
            monkeypatch.setattr(P, "moe", lambda *a, **k: pytest.fail("fell back"))
        y, _ = fmoe.prepare(p, spec)(x)
    assert torch.equal(y, want)


def test_every_other_call_is_fmoe_moe_itself():
    p, spec = _layer("gpt_oss", "mxfp4", "gpt_oss")
    step = fmoe.prepare(p, spec)
    calls = []
    real = P.moe

    def counted(*a, **k):
        calls.append(a[1].shape)
        return real(*a, **k)
    P.moe, keep = counted, P.moe
    try:
        g = torch.Generator().manual_seed(0)
        # more tokens than the native route takes (prefill): fmoe.moe's doors
        x = torch.randn(NATIVE_MAX_TOKENS + 1, M, generator=g)
        with torch.no_grad():
            assert torch.equal(step(x)[0], real(p, x, spec)[0])
        # a bias that wants a gradient: the router's native call still applies, the fused stage does not
        pg = {"gate": p["gate"], "experts": dict(p["experts"])}
        pg["experts"]["down_proj_bias"] = p["experts"]["down_proj_bias"].clone().requires_grad_()
        y, _ = fmoe.prepare(pg, spec)(x[:3])
        assert y.requires_grad
        y.sum().backward()
        assert pg["experts"]["down_proj_bias"].grad is not None
        # vmap over x: fmoe.moe's traced door
        xs = torch.randn(2, 3, M, generator=g)
        with torch.no_grad():
            got = torch.func.vmap(lambda t: step(t)[0])(xs)
            want = torch.func.vmap(lambda t: real(p, t, spec)[0])(xs)
        assert torch.equal(got, want)
        assert [tuple(c) for c in calls] == [(NATIVE_MAX_TOKENS + 1, M), (3, M), (3, M)]   # each went to fmoe.moe
    finally:
        P.moe = keep
    # float experts: no lane at all
    qspec = dataclasses.replace(spec, experts=dataclasses.replace(spec.experts))
    q = fmoe.init_params(qspec, generator=torch.Generator().manual_seed(1))
    assert not fmoe.prepare(q, qspec).fast
    x = torch.randn(2, M)
    with torch.no_grad():
        assert torch.equal(fmoe.prepare(q, qspec)(x)[0], fmoe.moe(q, x, qspec)[0])


def test_bad_inputs_raise_fmoe_moes_errors():
    p, spec = _layer("gpt_oss", "mxfp4", "gpt_oss")
    step = fmoe.prepare(p, spec)
    with pytest.raises(ValueError, match="moe: x's last dim must be model_dim=128"):
        step(torch.randn(2, M + 1))
    with pytest.raises(TypeError, match="moe: x must be floating point"):
        step(torch.ones(2, M, dtype=torch.int64))
    x = torch.randn(2, M)
    x[1, 3] = float("nan")
    with torch.no_grad(), pytest.raises(ValueError) as got:
        step(x)
    with torch.no_grad(), pytest.raises(ValueError) as want:
        fmoe.moe(p, x, spec)
    assert str(got.value) == str(want.value)
    bad = {"gate": p["gate"], "experts": {k: v for k, v in p["experts"].items() if k != "down_proj_bias"}}
    with pytest.raises(ValueError, match="gpt_oss experts need 'down_proj_bias'"):
        fmoe.prepare(bad, spec)


def test_holds_names_the_pytrees_it_runs():
    p, spec = _layer("swiglu", "fp8_block", "qwen")
    step = fmoe.prepare(p, spec)
    assert step.holds(p)
    # the caller's dicts edited after prepare: the call keeps its own
    x = torch.randn(3, M, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        before = step(x)[0]
    p2 = {"gate": p["gate"], "experts": dict(p["experts"])}
    w = p["experts"]["down_proj"]
    # a QuantizedTensor made afresh over the same stored tensors (as a module's FP8 weights are): held
    p2["experts"]["down_proj"] = Q.QuantizedTensor(w.data, w.scales, w.global_scale, w.fmt, w.shape, w.block)
    assert step.holds(p2)
    # other storage with the same values: not held
    p2["experts"]["down_proj"] = Q.QuantizedTensor(w.data.clone(), w.scales, w.global_scale, w.fmt, w.shape, w.block)
    assert not step.holds(p2)
    p["experts"]["down_proj"] = p2["experts"]["down_proj"]
    assert not step.holds(p) and step.params["experts"]["down_proj"] is w
    with torch.no_grad():
        assert torch.equal(step(x)[0], before)
    p2["gate"] = {"wg": p["gate"]["wg"].clone()}
    assert not step.holds(p2)


def _patched_gpt_oss(tmp_path, dtype=torch.float32):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from fmoe.examples import generate as G
    path = G.write_checkpoint(str(tmp_path / "gpt_oss"), "gpt_oss", "tiny")
    model, _ = G.load_patched(path, "gpt_oss", dtype=dtype)
    return model


def test_patched_block_prepares_again_when_its_parameters_change(tmp_path):
    model = _patched_gpt_oss(tmp_path)
    block = model.model.layers[0].mlp
    H = block.block_config.hidden_size
    x = torch.randn(1, 2, H, generator=torch.Generator().manual_seed(0))

    def reference():
        y, aux = block._mod.moe_block(block._mod.params_from_module(block), x, block.block_config,
                                      combine=block.current_combine())
        return y, aux.routing.weights.t()
    with torch.no_grad():
        y, w = block(x)
        want = reference()
        assert torch.equal(y, want[0]) and torch.equal(w, want[1])
        first = block._fmoe_prepared
        block(x)
        assert block._fmoe_prepared is first   # the same parameters: the same prepared call
        # a new router weight: prepared again, the new weight's output
        block.router.weight = torch.nn.Parameter(block.router.weight.flip(0).clone())
        y2, _ = block(x)
        assert block._fmoe_prepared is not first and torch.equal(y2, reference()[0]) and not torch.equal(y2, y)
        # the biases converted in place (.data swapped to bf16): the lane reads them as they are now
        second = block._fmoe_prepared
        b = block.experts.down_proj_bias
        b.data = b.data.bfloat16().float() + 1
        y3, _ = block(x)
        assert block._fmoe_prepared is second and torch.equal(y3, reference()[0]) and not torch.equal(y3, y2)
        # another combine order (the experts back-end changed): prepared for that spec
        block.combine = "eager" if block.current_combine() == "grouped" else "grouped"
        y4, _ = block(x)
        assert block._fmoe_prepared.spec.combine == block.combine and torch.equal(y4, reference()[0])
    # copies and pickles carry the parameters, not the prepared call
    assert "_fmoe_prepared" not in block.__getstate__()
    twin = copy.deepcopy(block)
    assert "_fmoe_prepared" not in vars(twin)
    with torch.no_grad():
        assert torch.equal(twin(x)[0], y4)
    assert "_fmoe_prepared" not in vars(pickle.loads(pickle.dumps(block)))
