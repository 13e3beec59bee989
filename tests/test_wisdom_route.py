"""A kernel choice recorded in the wisdom file changes what ``fmoe.moe`` runs: the call's plan
and one expert matrix's bytes name the same shape class ``python -m fmoe warmup --tune``
records (tests/conftest.py gives every test its own wisdom file)."""
from __future__ import annotations

import torch

import fmoe
from fmoe.engine import kinds, table, wisdom
from fmoe.engine.plan import make_plan
from fmoe.ops import numba_cpu


def _decode_call():
    spec = fmoe.MoESpec(model_dim=64, num_experts=8, gate=fmoe.GateSpec(k=2, capacity_factor=0.0),
                        experts=fmoe.ExpertSpec(hidden_size=32))
    params = fmoe.init_params(spec, generator=torch.Generator().manual_seed(0))
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    return spec, params, x


def test_recorded_choice_reaches_moe(monkeypatch):
    spec, params, x = _decode_call()
    calls = []
    real = numba_cpu.few_rows_mm
    monkeypatch.setattr(numba_cpu, "few_rows_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        y0, aux = fmoe.moe(params, x, spec)
    assert not calls, "a class never measured takes the table's own entry"
    plan = make_plan(aux.routing, needs_grad=False, dtype=x.dtype)
    assert plan.phase == "decode"
    w_out = params["experts"]["fc2_w"]
    cls = wisdom.shape_class(x.dtype, plan.num_rows / plan.busy, kinds._matrix_bytes(w_out))
    assert cls.endswith(f"|b{32 * 64 * 4}"), cls     # one [H, O] fp32 matrix, not |b1
    wisdom.record(cls, "cpu-numba-rows", {"cpu-native": 2e-3, "cpu-numba-rows": 1e-3})
    with torch.no_grad():
        y1, _ = fmoe.moe(params, x, spec)
    assert len(calls) == 2, f"the recorded winner ran {len(calls)} of the call's 2 GEMMs"
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-6)
    # another class (a larger matrix) is unaffected
    assert table.select(plan, 4 * kinds._matrix_bytes(w_out)).name == table.kernel_for("cpu", "decode", x.dtype).name
