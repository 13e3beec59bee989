"""The packed expert stage in one native call (fmoe.quant.packed.expert_stage, taken by
kinds.run where kinds.fused_stage says so) against the unfused composition it replaces:
kinds.reference over fmoe.quant.packed.grouped_matmul, in fp32 and bf16.

What is equal bit for bit, and why. GEMM 1 and GEMM 2 are the same kernel call on the same
operands and thread count (z is read from the call's own buffer). The activation makes torch's
float operations in torch's order, exp through the Sleef functions torch's vectorized loops call
(on the pieces TensorIterator cuts), so h equals ExpertForm.hidden(z) here; the gate products
and a token's sums are single float roundings in the unfused order. Each step is checked on its
own (z, h, then y from the stage's own h), then the whole output, for every format, kind,
ISA path, T, with and without capacity drops, with and without biases; bf16 rows (the
whole-model path: every op's bf16 rounding) in each combine order.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import fmoe
from fmoe import quant as Q
from fmoe.engine import kinds, make_plan
from fmoe.experts import expert_form
from fmoe.quant import packed

pytestmark = pytest.mark.skipif(not packed.AVAILABLE, reason="the packed-weight extension is not built")

_BEST = packed.best_isa() if packed.AVAILABLE else "portable"
ISAS = [i for i in ("portable", "avx2", "avx512") if packed.ISAS[i] <= packed.ISAS[_BEST]]
M, E, K_SLOTS = 128, 6, 3


def _case(typ: str, fmt: str, T: int, *, cf: float = 0.0, bias: bool = True, hidden: int = 128,
          activation=None, seed: int = 0, dt: torch.dtype = torch.float32, gate_dt: torch.dtype = None):
    """(form, x, w_rows, plan, w_in, w_out, b_in, b_out) of one packed layer call."""
    spec = fmoe.ExpertSpec(type=typ, hidden_size=hidden, activation=activation)
    mspec = fmoe.MoESpec(model_dim=M, num_experts=E, gate=fmoe.GateSpec(k=K_SLOTS, capacity_factor=cf), experts=spec)
    ex = fmoe.init_params(mspec, generator=torch.Generator().manual_seed(seed))["experts"]
    g = torch.Generator().manual_seed(seed + 1)
    if typ == "gpt_oss":   # float x @ W [E, K, N] -> packed out x in [E, N, K]
        experts = {"gate_up_proj": Q.quantize(ex["gate_up_proj"].transpose(1, 2).contiguous(), fmt),
                   "down_proj": Q.quantize(ex["down_proj"].transpose(1, 2).contiguous(), fmt),
                   # biases large enough to move the clamps' outcomes
                   "gate_up_proj_bias": torch.randn(ex["gate_up_proj_bias"].shape, generator=g) if bias else None,
                   "down_proj_bias": torch.randn(ex["down_proj_bias"].shape, generator=g) if bias else None}
    elif typ == "ffn":     # fc1 out x in; packed fc2 is out x in too
        experts = {"fc1_w": Q.quantize(ex["fc1_w"], fmt), "fc2_w": Q.quantize(ex["fc2_w"].transpose(1, 2).contiguous(), fmt)}
        if bias:
            experts.update(fc1_b=torch.randn(E, hidden, generator=g), fc2_b=torch.randn(E, M, generator=g))
    elif typ == "gated_ffn":   # x @ W -> packed out x in
        experts = {n: Q.quantize(v.transpose(1, 2).contiguous(), fmt) for n, v in ex.items()}
    else:                  # swiglu: out x in already
        experts = {n: Q.quantize(v, fmt) for n, v in ex.items()}
    experts = {n: v.to(dt) if isinstance(v, torch.Tensor) else v for n, v in experts.items()}
    kw = expert_form(spec, experts)
    # z of the order of 10 so that gpt_oss's clamps at +-7 and silu's saturation both happen
    x = (8 * torch.randn(T, M, generator=g)).to(dt)
    ids = torch.stack([torch.randperm(E, generator=g)[:K_SLOTS] for _ in range(T)])
    w = torch.softmax(torch.randn(T, K_SLOTS, generator=g), -1).to(gate_dt or dt)
    r = fmoe.make_routing(ids.t().contiguous(), w.t().contiguous(), E, cf)
    plan = make_plan(r, needs_grad=False, dtype=dt)
    return kw["form"], x, plan.row_weights(r.weights), plan, tuple(kw["w_in"]), kw["w_out"], kw["b_in"], kw["b_out"]


def _unfused(form, x, w_rows, plan, w_in, w_out, b_in, b_out, order, isa):
    mm = lambda a, w, transposed: packed.grouped_matmul(a, w, plan.offsets, isa=isa)   # noqa: E731
    return kinds.reference(form, x, w_rows, plan, w_in, b_in, w_out, b_out, order, mm=mm)


FORMATS = ["mxfp4", "nvfp4", "fp8_block", "mxfp8", "fp8_row"]
KINDS = ["swiglu", "gpt_oss", "gated_ffn", "ffn"]


# every format and kind on the widest path; the narrower paths on the two gated kinds
_STEP_CASES = [(t, f, i) for t in KINDS for f in FORMATS for i in ISAS if i == _BEST or t in ("swiglu", "gpt_oss")]


@pytest.mark.parametrize("typ,fmt,isa", _STEP_CASES)
def test_stage_equals_the_unfused_composition_step_by_step(typ, fmt, isa):
    for T, cf, bias in ((1, 0.0, True), (3, 1.25, False), (16, 1.25, True), (64, 0.0, True)):
        if (T, cf) == (1, 0.0) and typ in ("swiglu", "gated_ffn") and not bias:
            continue
        form, x, w_rows, plan, w_in, w_out, b_in, b_out = _case(typ, fmt, T, cf=cf, bias=bias)
        act = kinds.fused_stage(form, x, w_rows, plan, w_in, w_out, b_in, b_out)
        assert act is not None
        N = plan.num_rows
        bufs = tuple(torch.empty(N, w.logical_shape[1]) for w in w_in) + (torch.empty(N, w_out.logical_shape[2]),)
        y = kinds.run_fused(act, form, x, w_rows, plan, w_in, w_out, b_in, b_out, "fmoe", isa=isa, buffers=bufs)
        x_r = x.index_select(0, plan.tokens)
        z = [packed.grouped_matmul(x_r, w, plan.offsets, isa=isa) for w in w_in]
        if b_in is not None:
            z[0] = z[0] + b_in.index_select(0, plan.experts)
        for got, want in zip(bufs, z):   # GEMM 1 (and the bias): the same call, the same bits
            assert torch.equal(got, want), (T, cf)
        h = form.hidden(*z)
        assert torch.equal(bufs[-1], h), (T, cf, (bufs[-1] != h).sum())   # the activation: torch's bits
        y_r = packed.grouped_matmul(h, w_out, plan.offsets, isa=isa)
        if b_out is not None:
            y_r = y_r + b_out.index_select(0, plan.experts)
        want = torch.zeros(x.shape[0], y_r.shape[1]).index_add_(0, plan.tokens, y_r * w_rows.unsqueeze(1))
        assert torch.equal(y, want), (T, cf)
        assert torch.equal(y, _unfused(form, x, w_rows, plan, w_in, w_out, b_in, b_out, "fmoe", isa)), (T, cf)


@pytest.mark.parametrize("order", ["fmoe", "eager", "grouped"])
@pytest.mark.parametrize("typ,fmt", [("gpt_oss", "mxfp4"), ("swiglu", "nvfp4"), ("ffn", "fp8_block")])
def test_run_takes_the_stage_in_every_order_with_the_same_bits(typ, fmt, order):
    # kinds.run (the engine's door) against today's composition over the table's packed kernel
    for T, cf in ((1, 0.0), (16, 1.25), (64, 0.0)):
        form, x, w_rows, plan, w_in, w_out, b_in, b_out = _case(typ, fmt, T, cf=cf)
        y = kinds.run(form, x, w_rows, plan, w_in, w_out, b_in=b_in, b_out=b_out, order=order)
        want = kinds.reference(form, x, w_rows, plan, w_in, b_in, w_out, b_out, order,
                               mm=kinds._rows_mm(None, plan, None))
        assert torch.equal(y, want), (T, cf)


@pytest.mark.parametrize("order", ["fmoe", "eager", "grouped"])
@pytest.mark.parametrize("gate_dt", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("typ,fmt", [("gpt_oss", "mxfp4"), ("swiglu", "nvfp4"), ("gated_ffn", "fp8_block"),
                                     ("ffn", "mxfp8"), ("swiglu", "fp8_row")])
def test_bf16_rows_in_every_order_equal_the_unfused_composition(typ, fmt, gate_dt, order):
    # bf16 rows (the whole-model path): each torch op's bf16 rounding, the bf16 GEMM rows where
    # grouped_matmul hands them to the kernel, and each order's sums and casts (every ISA path in
    # one order; the orders differ only after GEMM 2)
    for isa in (ISAS if order == "fmoe" else ["auto"]):
        for T, cf, bias in ((1, 0.0, True), (5, 1.25, False), (64, 0.0, True)):
            form, x, w_rows, plan, w_in, w_out, b_in, b_out = _case(typ, fmt, T, cf=cf, bias=bias, dt=torch.bfloat16,
                                                                    gate_dt=gate_dt)
            act = kinds.fused_stage(form, x, w_rows, plan, w_in, w_out, b_in, b_out)
            assert act is not None
            N = plan.num_rows
            bufs = tuple(torch.empty(N, w.logical_shape[1]) for w in w_in) + (torch.empty(N, w_out.logical_shape[2]),)
            y = kinds.run_fused(act, form, x, w_rows, plan, w_in, w_out, b_in, b_out, order, isa=isa, buffers=bufs)
            z = [packed.grouped_matmul(x.index_select(0, plan.tokens), w, plan.offsets, isa=isa) for w in w_in]
            if b_in is not None:
                z[0] = z[0] + b_in.index_select(0, plan.experts)
            for got, want in zip(bufs, z):
                assert torch.equal(got, want.float()), (isa, T)
            assert torch.equal(bufs[-1], form.hidden(*z).float()), (isa, T)
            want = _unfused(form, x, w_rows, plan, w_in, w_out, b_in, b_out, order, isa)
            assert y.dtype == torch.bfloat16 and torch.equal(y, want), (isa, T, (y != want).sum())


def test_hidden_sizes_off_the_vector_width_and_threads():
    # rows of 80 (nvfp4's 16-blocks): every silu row ends in a scalar tail of torch's loop; T = 163
    # (489 rows, 39120 hidden values, past TensorIterator's 32768 grain): on two threads it splits
    # them at 19560, inside a vector step; and one thread, where it never splits
    for threads in (1, torch.get_num_threads()):
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            for typ in ("swiglu", "gated_ffn", "gpt_oss", "ffn"):
                for T, dt in ((1, torch.float32), (163, torch.float32), (163, torch.bfloat16)):
                    args = _case(typ, "nvfp4", T, hidden=80, activation=F.silu if typ == "ffn" else None, dt=dt)
                    assert torch.equal(kinds.run(*args[:5], args[5], b_in=args[6], b_out=args[7]),
                                       _unfused(*args, "fmoe", "auto")), (typ, T, dt, threads)
        finally:
            torch.set_num_threads(old)


_OTHER_CAPABILITY = """
import sys, torch
sys.path.insert(0, {tests!r})
import test_packed_fused as t
assert torch.backends.cpu.get_cpu_capability() == {cap!r}, torch.backends.cpu.get_cpu_capability()
for typ in ("swiglu", "gpt_oss"):
    for T, dt in ((163, torch.float32), (163, torch.bfloat16)):
        args = t._case(typ, "nvfp4", T, hidden=80, dt=dt)
        got = t.kinds.run(*args[:5], args[5], b_in=args[6], b_out=args[7])
        assert torch.equal(got, t._unfused(*args, "fmoe", "auto")), (typ, T, dt)
print("ok")
"""


@pytest.mark.parametrize("cap", ["AVX2", "DEFAULT"])
def test_the_activation_follows_torchs_own_vector_width(cap):
    # torch run at a narrower CPU capability (ATEN_CPU_CAPABILITY, read at its start: a child
    # process) vectorizes silu / sigmoid at that width (or not at all); the stage's exp follows it
    import os
    import subprocess
    import sys
    if cap == "AVX2" and packed.ISAS[_BEST] < packed.ISAS["avx2"]:
        pytest.skip("this CPU has no AVX2")
    env = dict(os.environ, ATEN_CPU_CAPABILITY=cap.lower())
    code = _OTHER_CAPABILITY.format(tests=os.path.dirname(os.path.abspath(__file__)), cap=cap)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_moe_layer_takes_the_stage_and_keeps_its_output():
    # fmoe.moe under no_grad on packed experts: the default (fused) path against the same call with
    # the stage refused (grad enabled on x, which sends it through today's composition)
    spec = fmoe.MoESpec(model_dim=M, num_experts=E, gate=fmoe.GateSpec(k=K_SLOTS),
                        experts=fmoe.ExpertSpec(type="swiglu", hidden_size=64))
    p = fmoe.init_params(spec, generator=torch.Generator().manual_seed(3))
    p["experts"] = {n: Q.quantize(v, "mxfp4") for n, v in p["experts"].items()}
    x = torch.randn(5, M, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        y, _ = fmoe.moe(p, x, spec)
    y_ref, _ = fmoe.moe(p, x.clone().requires_grad_(), spec)
    assert torch.equal(y, y_ref.detach())


def test_non_contiguous_packed_weights_are_read_as_their_values():
    # a QuantizedTensor whose data and scales are strided views (every other expert of a larger
    # one) runs the stage as the unfused path runs it (which copies them contiguous)
    form, x, w_rows, plan, w_in, w_out, b_in, b_out = _case("swiglu", "mxfp4", 9)
    big = Q.quantize(torch.randn(2 * E, 2 * 128, M, generator=torch.Generator().manual_seed(9)), "mxfp4")
    view = Q.QuantizedTensor(big.data[::2], big.scales[::2], None, "mxfp4", (E, 2 * 128, M), big.block)
    assert not view.data.is_contiguous()
    act = kinds.fused_stage(form, x, w_rows, plan, (view,), w_out, b_in, b_out)
    y = kinds.run_fused(act, form, x, w_rows, plan, (view,), w_out, b_in, b_out, "fmoe")
    assert torch.equal(y, _unfused(form, x, w_rows, plan, (view,), w_out, b_in, b_out, "fmoe", "auto"))


def test_what_keeps_todays_path():
    form, x, w_rows, plan, w_in, w_out, b_in, b_out = _case("swiglu", "mxfp4", 4)
    assert kinds.fused_stage(form, x, w_rows, plan, w_in, w_out, b_in, b_out) == "glu"
    custom = dataclasses.replace(form, activation=lambda t: F.silu(t) * 2)
    assert kinds.fused_stage(custom, x, w_rows, plan, w_in, w_out, b_in, b_out) is None     # a user's activation
    assert kinds.fused_stage(form, x.half(), w_rows, plan, w_in, w_out, b_in, b_out) is None   # fp16 rows
    assert kinds.fused_stage(form, x.bfloat16(), w_rows, plan, w_in, w_out, b_in, b_out) == "glu"   # bf16 rows
    assert kinds.fused_stage(form, x, None, plan, w_in, w_out, b_in, b_out) is None         # gate-free (EP) rows
    assert kinds.fused_stage(form, x.requires_grad_(), w_rows, plan, w_in, w_out, b_in, b_out) is None   # grad
    assert kinds.fused_stage(form, x.detach(), w_rows, plan, w_in, w_out, b_in, b_out) == "glu"
    gelu = dataclasses.replace(form, form="ffn", activation=F.gelu)
    assert kinds.fused_stage(gelu, x.detach(), w_rows, plan, w_in[:1], w_out, b_in, b_out) is None


def test_bad_inputs_raise_before_any_row_is_read():
    form, x, w_rows, plan, w_in, w_out, b_in, b_out = _case("gpt_oss", "mxfp4", 4)
    kw = dict(act="gpt_oss", b_in=b_in, b_out=b_out)
    bad_tokens = plan.tokens.clone()
    bad_tokens[-1] = 4   # T = 4: one past the last token
    with pytest.raises(ValueError, match=r"tokens must lie in \[0, T = 4\)"):
        packed.expert_stage(x, bad_tokens, plan.offsets, w_rows, w_in, w_out, **kw)
    bad_offsets = plan.offsets.clone()
    bad_offsets[-1] += 1
    with pytest.raises(ValueError, match="offsets must start at 0 and end at R"):
        packed.expert_stage(x, plan.tokens, bad_offsets, w_rows, w_in, w_out, **kw)
    with pytest.raises(ValueError, match=r"gates must be contiguous float32 \[N\]"):
        packed.expert_stage(x, plan.tokens, plan.offsets, w_rows[:-1], w_in, w_out, **kw)
    with pytest.raises(ValueError, match=r"b_out must be contiguous \[E, 128\] in x's dtype"):
        packed.expert_stage(x, plan.tokens, plan.offsets, w_rows, w_in, w_out, act="gpt_oss", b_in=b_in,
                            b_out=b_out[:, :64].contiguous())
    with pytest.raises(ValueError, match="data's last dim does not match K = 64"):   # H = 64: w_out's K is 128
        packed.expert_stage(x, plan.tokens, plan.offsets, w_rows, (w_out,), w_out, act="gpt_oss")
    with pytest.raises(ValueError, match="act must be one of"):
        packed.expert_stage(x, plan.tokens, plan.offsets, w_rows, w_in, w_out, act="gelu")
    with pytest.raises(TypeError, match="x must be a float32 or bfloat16 CPU tensor, got torch.float64"):
        packed.expert_stage(x.double(), plan.tokens, plan.offsets, w_rows, w_in, w_out, **kw)
    with pytest.raises(ValueError, match="pairs must be contiguous int64"):
        packed.expert_stage(x, plan.tokens, plan.offsets, w_rows, w_in, w_out, order="grouped", pairs=plan.pairs[:1],
                            **kw)
    with pytest.raises(ValueError, match="order must be one of"):
        packed.expert_stage(x, plan.tokens, plan.offsets, w_rows, w_in, w_out, order="slots", **kw)
    with pytest.raises(ValueError, match=r"num_slots \(k\) must be at least a token's rows \(3\), got 2"):
        packed.expert_stage(x.bfloat16(), plan.tokens, plan.offsets, w_rows, w_in, w_out, act="gpt_oss",
                            order="eager", num_slots=2)
