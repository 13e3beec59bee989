"""The engine's in-order rows plan (``ExpertPlan.in_order``: every row is its own token, as expert
parallel's received rows placed in expert order): the output projection and dx's first product
written straight into [R, .] (no zero fill, no scatter) and rows lying 64-byte aligned read in
place (no gather copy).

Checked against the same rows on a plan without the flag (the gather-and-scatter path): forward
and every gradient bit for bit (the same GEMMs on operands of the same shape, strides and
alignment; 0 + v is v), over the forms, one and two in-projections, biases, float32 and float64,
aligned and unaligned rows, no gates and gates; and the flag on tokens that are not in order is
refused.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fmoe.engine import kinds as K
from fmoe.engine.plan import plan_from_bounds
from fmoe.engine.table import select

FORMS = {
    "ffn": (K.ExpertForm("ffn", False, False, activation=F.relu), 1, False),
    "glu_split": (K.ExpertForm("glu", True, True), 2, False),     # gate and up weights: dx's second product scatters
    "gpt_oss_bias": (K.ExpertForm("gpt_oss", False, False, limit=2.0), 1, True),
}


def _case(form_name, dtype, M, gates, seed=0):
    form, n_in, bias = FORMS[form_name]
    g = torch.Generator().manual_seed(seed)
    E, H, O = 4, 6, M
    sizes = [5, 0, 9, 3]
    R = sum(sizes)
    bounds = [0]
    for c in sizes:
        bounds.append(bounds[-1] + c)
    x = torch.randn(R, M, generator=g, dtype=torch.float64).to(dtype)
    Hin = 2 * H if form.form == "gpt_oss" else H
    shape_in = (E, Hin, M) if form.in_transposed else (E, M, Hin)
    w_in = tuple(torch.randn(shape_in, generator=g, dtype=torch.float64).to(dtype) * 0.3 for _ in range(n_in))
    w_out = torch.randn((E, O, H) if form.out_transposed else (E, H, O), generator=g, dtype=torch.float64).to(dtype) * 0.3
    b_in = torch.randn(E, Hin, generator=g, dtype=torch.float64).to(dtype) if bias else None
    b_out = torch.randn(E, O, generator=g, dtype=torch.float64).to(dtype) if bias else None
    w_rows = torch.rand(R, generator=g, dtype=torch.float64).to(dtype) if gates else None
    tokens = torch.arange(R)
    plans = [plan_from_bounds(tokens, tokens, bounds, R, needs_grad=True, dtype=dtype, in_order=flag)
             for flag in (True, False)]
    return form, x, w_rows, w_in, w_out, b_in, b_out, plans


def _step(form, x, w_rows, w_in, w_out, b_in, b_out, plan, gy):
    leaves = [t.clone().requires_grad_(True) if t is not None else None for t in (x, w_rows, b_in, w_out, b_out, *w_in)]
    xx, ww, bi, wo, bo, *wi = leaves
    y = K.run(form, xx, ww, plan, tuple(wi), wo, b_in=bi, b_out=bo)
    y.backward(gy)
    return [y.detach()] + [t.grad for t in leaves if t is not None]


@pytest.mark.parametrize("form_name", list(FORMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("M", [16, 10])   # rows of 64 / 128 bytes (read in place) and of 40 / 80 bytes (gathered)
@pytest.mark.parametrize("gates", [False, True])
def test_in_order_plan_equals_the_gather_and_scatter_path_bit_for_bit(form_name, dtype, M, gates):
    form, x, w_rows, w_in, w_out, b_in, b_out, (p_in, p_idx) = _case(form_name, dtype, M, gates)
    gy = torch.randn(x.shape[0], w_out.shape[1] if form.out_transposed else w_out.shape[2],
                     generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
    a = _step(form, x, w_rows, w_in, w_out, b_in, b_out, p_in, gy)
    b = _step(form, x, w_rows, w_in, w_out, b_in, b_out, p_idx, gy)
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        assert torch.equal(u, v), f"{form_name} {dtype} M={M} gates={gates}: tensor {i} differs"
    # the values are the experts' own: against the per-expert reference (its own roundings)
    want = K.reference(form, x, w_rows, p_idx, w_in, b_in, w_out, b_out)
    tol = 1e-12 if dtype == torch.float64 else 1e-4
    assert (a[0] - want).abs().max().item() <= tol * max(1.0, want.abs().max().item())


def test_in_order_forward_writes_no_zero_filled_output(monkeypatch):
    """The in-order forward without gates never scatters into a [R, O] output (the products are y's rows)."""
    form, x, _, w_in, w_out, b_in, b_out, (p_in, p_idx) = _case("ffn", torch.float32, 16, False)
    kern = select(p_in)
    scattered = []
    real = kern.scatter
    patched = type(kern)(kern.name, kern.why, kern.mm, kern.wgrad,
                         lambda *a, **kw: scattered.append(1) or real(*a, **kw), kern.static_rows)
    y_in = K.run(form, x, None, p_in, w_in, w_out, b_in=b_in, b_out=b_out, kernel=patched)
    assert not scattered
    y_idx = K.run(form, x, None, p_idx, w_in, w_out, b_in=b_in, b_out=b_out, kernel=patched)
    assert scattered and torch.equal(y_in, y_idx)


def test_in_order_flag_on_other_tokens_is_refused():
    tokens = torch.tensor([1, 0, 2])
    with pytest.raises(ValueError, match=r"in_order=True needs tokens == arange\(num_tokens\)"):
        plan_from_bounds(tokens, tokens, [0, 3], 3, needs_grad=False, dtype=torch.float32, in_order=True)
    with pytest.raises(ValueError, match="in_order=True needs tokens"):
        plan_from_bounds(torch.arange(3), torch.arange(3), [0, 3], 4, needs_grad=False, dtype=torch.float32,
                         in_order=True)
