"""A research sweep under torch.compile: one step function compiled once with fullgraph=True and
called for several expert kinds, capacity modes (negative ones included) and batch sizes in
turn. Recompiles must work (a spec number that changed between calls must not turn symbolic
where it sizes a buffer) and every call must equal eager mode.
"""
from __future__ import annotations

import pytest
import torch

import fmoe

M, E = 16, 4


def _step(p, x, spec):
    y, aux = fmoe.moe(p, x, spec)
    return y.square().mean() + aux.l_aux, aux.capacity


# the order matters: the kind changes after ffn (the first failure seen), then the capacity
# factor (dropless, capped dropless, a larger factor), then the batch size under each
SWEEP = [("ffn", 1.25, 8), ("ffn", 1.25, 16), ("swiglu", 1.25, 8), ("ffn", 0.0, 8), ("ffn", -1.0, 16),
         ("gated_ffn", 2.0, 8), ("gpt_oss", -0.5, 8)]


def test_one_compiled_step_serves_a_sweep():
    torch._dynamo.reset()
    step = torch.compile(_step, fullgraph=True)
    with torch._dynamo.config.patch(recompile_limit=len(SWEEP) + 4):
        for kind, cf, T in SWEEP:
            spec = fmoe.MoESpec(model_dim=M, num_experts=E, gate=fmoe.GateSpec(k=2, capacity_factor=cf),
                                experts=fmoe.ExpertSpec(type=kind, hidden_size=8))
            p = fmoe.init_params(spec, generator=torch.Generator().manual_seed(0))
            x = torch.randn(T, M, generator=torch.Generator().manual_seed(T))
            leaves = [v for d in p.values() for v in d.values() if v is not None]
            for t in leaves:
                t.requires_grad_(True)
            loss, cap = step(p, x, spec)
            grads = torch.autograd.grad(loss, leaves)
            ref, ref_cap = _step(p, x, spec)
            ref_grads = torch.autograd.grad(ref, leaves)
            tag = f"{kind} cf={cf} T={T}"
            torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6, msg=tag)
            for g, r in zip(grads, ref_grads):
                torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6, msg=tag)
            if cf > 0:   # finite capacity: the compiled call's C is eager's, a constant
                assert cap == ref_cap, f"{tag}: compiled capacity {cap}, eager {ref_cap}"


def test_capacity_factor_is_static_under_compile():
    """A spec's capacity factor reaches the routing as a constant: text of the float, guarded
    by value (a recompile for another factor specializes on it)."""
    g = fmoe.GateSpec(k=2, capacity_factor=1.25)
    assert g.static_capacity_factor == 1.25 and isinstance(g.static_capacity_factor, float)
    import dataclasses
    assert dataclasses.replace(g, capacity_factor=-0.5).static_capacity_factor == -0.5
    assert fmoe.GateSpec(k=2, capacity_factor=2).static_capacity_factor == 2.0
    with pytest.raises(TypeError, match="capacity_factor must be a real number"):
        fmoe.moe(fmoe.init_params(fmoe.MoESpec(model_dim=M, num_experts=E, experts=fmoe.ExpertSpec(hidden_size=8))),
                 torch.randn(4, M), fmoe.MoESpec(model_dim=M, num_experts=E, experts=fmoe.ExpertSpec(hidden_size=8),
                                                 gate=fmoe.GateSpec(capacity_factor="1.0")))
