"""expert_matmul: fused numba and per-expert paths against the reference; autograd and torch.func."""
import pytest
import torch

import fmoe.quant as Q
from tests.test_engine import engine_and_staged

FMTS = ["mxfp4", "nvfp4", "mxfp8", "fp8_block", "fp8_row"]


@pytest.fixture(scope="module")
def weights():
    g = torch.Generator().manual_seed(0)
    # N not a multiple of 128 exercises the ragged FP8 block edge.
    w = torch.randn(3, 40, 256, generator=g) * 0.05
    return {f: Q.quantize(w, f) for f in FMTS}


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("c", [1, 5, 16])
def test_fused_matches_reference_fp32(weights, fmt, c):
    w = weights[fmt]
    x = torch.randn(3, c, 256, generator=torch.Generator().manual_seed(c))
    ref = Q.expert_matmul_reference(x, w)
    for path in ("fused", "dequant", "auto"):
        y = Q.expert_matmul(x, w, path=path)
        assert y.shape == (3, c, 40) and y.dtype == torch.float32
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def test_bf16_input_and_errors(weights):
    w = weights["mxfp4"]
    x = torch.randn(3, 2, 256).to(torch.bfloat16)
    y = Q.expert_matmul(x, w, path="fused")
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, Q.expert_matmul_reference(x, w), rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match=r"x \[E, C, K\]"):
        Q.expert_matmul(torch.randn(3, 2, 128), w)
    with pytest.raises(ValueError, match="path"):
        Q.expert_matmul(torch.randn(3, 2, 256), w, path="gpu")
    with pytest.raises(TypeError):
        Q.expert_matmul(torch.randn(3, 2, 256), torch.randn(3, 40, 256))


def test_fused_propagates_nan_scale():
    w = Q.quantize_mxfp4(torch.randn(1, 4, 64))
    scales = w.scales.clone()
    scales[0, 1, 0] = 0xFF
    bad = Q.QuantizedTensor(w.data, scales, None, "mxfp4", w.shape, w.block)
    y = Q.expert_matmul(torch.randn(1, 2, 64), bad, path="fused")
    assert torch.isnan(y[0, :, 1]).all() and torch.isfinite(y[0, :, [0, 2, 3]]).all()


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8_block"])
def test_grad_wrt_x_matches_reference_autograd(weights, fmt):
    w = weights[fmt]
    x = torch.randn(3, 4, 256, requires_grad=True)
    dy = torch.randn(3, 4, 40)
    (Q.expert_matmul(x, w, path="fused") * dy).sum().backward()
    xr = x.detach().clone().requires_grad_()
    (Q.expert_matmul_reference(xr, w) * dy).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:Input #0 requires gradient")
def test_gradcheck_finite_differences():
    w = Q.quantize_mxfp4(torch.randn(2, 3, 32, dtype=torch.float32))
    x = torch.randn(2, 2, 32, dtype=torch.float32, requires_grad=True)
    # float32 forward, so loose finite-difference tolerances.
    assert torch.autograd.gradcheck(lambda x: Q.expert_matmul(x, w, path="fused"), (x,),
                                    eps=1e-2, atol=1e-2, rtol=1e-2)


def test_torch_func_grad_and_vmap(weights):
    w = weights["nvfp4"]
    x = torch.randn(3, 2, 256)
    g = torch.func.grad(lambda x, w: Q.expert_matmul(x, w, path="fused").sum())(x, w)
    dense = Q.dequantize(w)
    torch.testing.assert_close(g, dense.sum(1, keepdim=True).expand(3, 2, 256), rtol=1e-5,
                               atol=1e-5)
    # vmap over a batch of inputs, and over a stacked batch of quantized weights.
    xb = torch.randn(2, 3, 2, 256)
    yb = torch.func.vmap(lambda x: Q.expert_matmul(x, w, path="fused"))(xb)
    torch.testing.assert_close(yb, torch.stack([Q.expert_matmul_reference(v, w) for v in xb]),
                               rtol=1e-5, atol=1e-5)
    wb = Q.stack([w, w])
    yw = torch.func.vmap(lambda x, w: Q.expert_matmul(x, w, path="fused"))(xb, wb)
    torch.testing.assert_close(yw, yb, rtol=1e-5, atol=1e-5)


def test_crossover_controls_auto(weights):
    w = weights["mxfp4"]
    before = Q.crossover("mxfp4")
    x = torch.randn(3, 2, 256)
    fused = Q.expert_matmul(x, w, path="fused")
    dequant = Q.expert_matmul(x, w, path="dequant")
    assert torch.equal(Q.expert_matmul(x, w, crossover=0), dequant)
    assert torch.equal(Q.expert_matmul(x, w, crossover=2), fused)
    assert torch.equal(Q.expert_matmul(x, w), fused if 2 <= Q.crossover("mxfp4") else dequant)
    c = Q.calibrate_crossover(w, max_c=2, repeats=1)
    assert c in (0, 1, 2)
    assert Q.crossover("mxfp4") == before  # calibrating returns a value; it changes nothing global


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_numba_dequant_is_bit_exact(weights, fmt):
    from fmoe.quant import matmul as M

    w = weights[fmt]
    for e in range(3):
        assert torch.equal(M._dequant_one(w, e), Q.dequantize(w[e]))


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("c", [1, 2, 3, 7, 16, 17])
@pytest.mark.parametrize("n", [1, 4, 5, 67])
@pytest.mark.parametrize("k", ["small", 1216])
@pytest.mark.parametrize("chunk", [None, 40])
def test_fp4_fused_shapes(fmt, c, n, k, chunk, monkeypatch):
    """Row groups of 4 (short last group), 4-token blocks + remainder (odd C), several K chunks
    (40 bytes: 2 MX blocks, or 5 NVFP4 blocks so each chunk has an odd-block tail)."""
    from fmoe.quant import matmul as M

    if chunk is not None:
        monkeypatch.setattr(M, "_FP4_CHUNK", chunk)

    g = torch.Generator().manual_seed(100 * c + n)
    # 1216: > one K chunk, not a multiple of it; small: an odd number of blocks.
    k = {"mxfp4": 96, "nvfp4": 80}[fmt] if k == "small" else k
    w = Q.quantize(torch.randn(2, n, k, generator=g) * 0.1, fmt)
    x = torch.randn(2, c, k, generator=g)
    ref = Q.expert_matmul_reference(x, w)
    y = M._fused(x, w)
    assert y.shape == (2, c, n)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def test_fp4_fused_nvfp4_global_scale_and_bf16():
    from fmoe.quant import matmul as M

    g = torch.Generator().manual_seed(7)
    dense = torch.randn(3, 9, 64, generator=g)
    w = Q.quantize_nvfp4(dense, weight_scale_2=torch.tensor([1e-3, 0.5, 3.0]))
    x = torch.randn(3, 3, 64, generator=g)
    torch.testing.assert_close(M._fused(x, w), Q.expert_matmul_reference(x, w), rtol=1e-5, atol=1e-5)
    xb = x.to(torch.bfloat16)
    y = Q.expert_matmul(xb, w, path="fused")
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, Q.expert_matmul_reference(xb, w), rtol=1e-2, atol=1e-2)


def test_fp4_fused_generic_block_size():
    """The kernel's fallback branch (block size other than 32/16 elements)."""
    import numpy as np
    from fmoe.quant import _codecs as C, _cpu_kernels as K

    g = torch.Generator().manual_seed(3)
    E, N, KH, bk = 2, 6, 48, 12  # 12-element blocks = 6 bytes
    data = torch.randint(0, 256, (E, N, KH), dtype=torch.uint8, generator=g)
    scales = torch.randint(120, 130, (E, N, 2 * KH // bk), dtype=torch.uint8, generator=g)
    x = torch.randn(E, 3, 2 * KH, generator=g)
    vals = C.decode_e2m1(C.unpack_fp4(data))
    dense = vals.reshape(E, N, -1, bk) * C.decode_e8m0(scales).unsqueeze(-1)
    ref = torch.bmm(x, dense.reshape(E, N, 2 * KH).transpose(1, 2))
    out = np.empty((E, 3, N), np.float32)
    K.fp4_matmul(x.numpy(), data.numpy(), scales.numpy(), C.E8M0_TABLE.numpy(),
                 np.ones(E, np.float32), out, 4, 18)
    torch.testing.assert_close(torch.from_numpy(out), ref, rtol=1e-5, atol=1e-5)


def test_fp8_fused_decodes_every_e4m3_byte_exactly():
    """One-hot tokens read single decoded weights back: every finite E4M3 byte (subnormals,
    both zeros, negatives) times a non-power-of-two scale, bit-exact with dequantize()."""
    codes = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8)
    k = codes.numel()  # 254: not a multiple of 16, so the table tail runs too
    data = torch.stack([codes, codes.flip(0)]).unsqueeze(0).view(torch.float8_e4m3fn)
    scales = torch.tensor([[[0.3], [1.7]]], dtype=torch.float32)  # [E, N, 1]
    w = Q.QuantizedTensor(data, scales, None, "fp8_row", (1, 2, k), (1, k))
    x = torch.eye(k).unsqueeze(0)
    y = Q.expert_matmul(x, w, path="fused")
    assert torch.equal(y[0].T, Q.dequantize(w)[0])


@pytest.mark.parametrize("chunk", [None, 40])
def test_fp8_fused_nan_byte_and_ragged_shapes(chunk, monkeypatch):
    """Ragged N and K; chunk 40 -> 80 elements of K per pass, so scale blocks straddle chunks."""
    from fmoe.quant import matmul as M

    if chunk is not None:
        monkeypatch.setattr(M, "_FP4_CHUNK", chunk)

    g = torch.Generator().manual_seed(5)
    for fmt, n, k in (("fp8_row", 7, 100), ("fp8_block", 130, 200), ("mxfp8", 5, 96)):
        w = Q.quantize(torch.randn(2, n, k, generator=g), fmt)
        for c in (1, 3, 4, 9):
            x = torch.randn(2, c, k, generator=g)
            torch.testing.assert_close(M._fused(x, w), Q.expert_matmul_reference(x, w),
                                       rtol=1e-5, atol=1e-5)
    w = Q.quantize_fp8_rowwise(torch.randn(1, 3, 64, generator=g))
    data = w.data.view(torch.uint8).clone()
    data[0, 1, 17] = 0x7F
    bad = Q.QuantizedTensor(data.view(torch.float8_e4m3fn), w.scales, None, "fp8_row", w.shape, w.block)
    y = M._fused(torch.randn(1, 2, 64, generator=g), bad)
    assert torch.isnan(y[0, :, 1]).all() and torch.isfinite(y[0, :, [0, 2]]).all()


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8_block"])
@pytest.mark.parametrize("typ", ["swiglu", "gpt_oss", "gated_ffn"])
def test_packed_weights_run_on_the_engine_as_the_staged_pipeline(fmt, typ, monkeypatch):
    # fmoe.moe with packed (QuantizedTensor, out x in) expert weights runs on the expert engine:
    # one fused low-precision call per busy expert over the plan's rows, the same calls the staged
    # ragged seam makes; equal up to the order of a token's k terms, and the input gradient too
    import fmoe
    spec = fmoe.MoESpec(model_dim=64, num_experts=4, gate=fmoe.GateSpec(k=2, capacity_factor=0.0),
                        experts=fmoe.ExpertSpec(type=typ, hidden_size=64))
    params = fmoe.init_params(spec, generator=torch.Generator().manual_seed(0))
    ex = params["experts"]
    if typ == "gpt_oss":    # float x @ W [E, K, N] -> packed out x in [E, N, K]
        packed = {"gate_up_proj": Q.quantize(ex["gate_up_proj"].transpose(1, 2).contiguous(), fmt),
                  "down_proj": Q.quantize(ex["down_proj"].transpose(1, 2).contiguous(), fmt),
                  "gate_up_proj_bias": ex["gate_up_proj_bias"], "down_proj_bias": ex["down_proj_bias"]}
    elif typ == "gated_ffn":
        packed = {k: Q.quantize(v.transpose(1, 2).contiguous(), fmt) for k, v in ex.items()}
    else:                   # swiglu is out x in already
        packed = {k: Q.quantize(v, fmt) for k, v in ex.items()}
    params = dict(params, experts=packed)
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(1))
    (y_e, (g_e,)), (y_s, (g_s,)) = engine_and_staged(monkeypatch, spec, params, x, "_rows_mm")
    torch.testing.assert_close(y_e, y_s, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_e, g_s, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("typ", ["swiglu", "gpt_oss"])
def test_mixed_packed_and_float_projections_run_on_the_engine_as_the_staged_pipeline(typ, monkeypatch):
    # a packed in-projection beside a float out-projection (a partly quantized checkpoint): the
    # rows plan multiplies the packed one with the fused per-expert call and the float one with a
    # per-expert torch.mm, equal to the layout plan's staged kernel, the float weight's gradient too
    import dataclasses
    import fmoe
    from fmoe.engine import kinds
    spec = fmoe.MoESpec(model_dim=64, num_experts=4, gate=fmoe.GateSpec(k=2, capacity_factor=0.0),
                        experts=fmoe.ExpertSpec(type=typ, hidden_size=64))
    params = fmoe.init_params(spec, generator=torch.Generator().manual_seed(0))
    ex = dict(params["experts"])
    if typ == "gpt_oss":    # float gate_up [E, M, 2I] -> packed out x in
        ex["gate_up_proj"] = Q.quantize(ex["gate_up_proj"].transpose(1, 2).contiguous(), "mxfp4")
    else:
        ex["gate_up_proj"] = Q.quantize(ex["gate_up_proj"], "mxfp4")
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(1))
    dy = torch.randn(40, 64, generator=torch.Generator().manual_seed(2))
    calls = []
    real = kinds._rows_mm
    monkeypatch.setattr(kinds, "_rows_mm", lambda *a: (calls.append(1), real(*a))[1])

    def run(s):
        down = ex["down_proj"].clone().requires_grad_()
        xx = x.clone().requires_grad_()
        y, _ = fmoe.moe(dict(params, experts=dict(ex, down_proj=down)), xx, s)
        return (y, *torch.autograd.grad((y * dy).sum(), [xx, down]))

    on_rows = run(spec)
    assert calls
    calls.clear()
    staged = run(dataclasses.replace(spec, plan="layout"))
    assert not calls
    for a, b in zip(on_rows, staged):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_packed_shared_expert_multiplies_packed_in_eager_and_dequantizes_when_traced(monkeypatch, fmt, dt):
    """A shared SwiGLU (DeepSeek's) with packed weights: an eager CPU call multiplies them packed
    (fmoe.quant.packed.grouped_matmul, one expert: no dequantized copy, here made to fail), within
    each GEMM's float32 rounding of dequantize-then-linear; under vmap it dequantizes (the traced ops)."""
    from fmoe.experts import swiglu_mlp
    from fmoe.quant.tensor import QuantizedTensor
    g = torch.Generator().manual_seed(1)
    I, H = 64, 256
    p = {"gate_proj": Q.quantize(torch.randn(I, H, generator=g) * 0.05, fmt),
         "up_proj": Q.quantize(torch.randn(I, H, generator=g) * 0.05, fmt),
         "down_proj": Q.quantize(torch.randn(H, I, generator=g) * 0.05, fmt)}
    x = torch.randn(5, H, generator=g).to(dt)
    deq = {n: w.dequantize(torch.float64) for n, w in p.items()}

    def reference(xr):   # float64 composition, rounded to dt where the eager ops round
        def lin(a, w):
            return (a.double() @ w.T).to(dt)
        return lin((torch.nn.functional.silu(lin(xr, deq["gate_proj"])) * lin(xr, deq["up_proj"])), deq["down_proj"])
    traced = torch.func.vmap(lambda xb: swiglu_mlp(p, xb[None])[0])(x)
    with monkeypatch.context() as m:
        m.setattr(QuantizedTensor, "dequantize", lambda *a, **k: (_ for _ in ()).throw(AssertionError("dequantized")))
        y = swiglu_mlp(p, x)
    assert y.dtype == dt and y.shape == (5, H)
    ref = reference(x).double()
    # float32: each GEMM's sum in another order; bf16: a rounding of z or h to bf16 may land one ulp
    # (2^-8 relative) apart and carry through the down projection, so the bound is the output's scale
    tol = dict(rtol=1e-5, atol=1e-6) if dt is torch.float32 else dict(rtol=0, atol=2 ** -6 * float(ref.abs().max()))
    torch.testing.assert_close(y.double(), ref, **tol)
    torch.testing.assert_close(traced.double(), ref, **tol)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_packed_shared_swiglu_is_one_stage_call_with_the_compositions_bits(monkeypatch, fmt, dt):
    """Three packed weights and SiLU: swiglu_mlp is one native call (packed.run_stage, one expert,
    gates 1) whose output is the composition's (gate and up GEMMs, SiLU, product, down GEMM over the
    same packed kernels) bit for bit."""
    import torch.nn.functional as F
    import fmoe.experts as X
    from fmoe.quant import packed
    if not packed.AVAILABLE:
        pytest.skip(packed.status())
    g = torch.Generator().manual_seed(2)
    I, H = 128, 256
    p = {"gate_proj": Q.quantize(torch.randn(I, H, generator=g) * 0.05, fmt),
         "up_proj": Q.quantize(torch.randn(I, H, generator=g) * 0.05, fmt),
         "down_proj": Q.quantize(torch.randn(H, I, generator=g) * 0.05, fmt)}
    calls = []
    stage = packed.run_stage
    monkeypatch.setattr(packed, "run_stage", lambda *a, **k: calls.append(1) or stage(*a, **k))
    for T in (1, 7, 40):
        x = torch.randn(T, H, generator=g).to(dt)
        y = X.swiglu_mlp(p, x)
        composed = X.linear(F.silu(X.linear(x, p["gate_proj"])) * X.linear(x, p["up_proj"]), p["down_proj"])
        assert y.dtype == dt and torch.equal(y, composed), (T, float((y.float() - composed.float()).abs().max()))
    assert len(calls) == 3
    X.swiglu_mlp(p, x, activation=F.gelu)   # another activation: the composition
    xt = torch.randn(12, 2 * H, generator=g).to(dt)[:, ::2]   # columns strided: copied for the call
    assert torch.equal(X.swiglu_mlp(p, xt), X.swiglu_mlp(p, xt.contiguous()))
    assert len(calls) == 5
    # a gradient wanted: the composition (the stage is forward only), and dx flows
    xg = x.detach().float().requires_grad_()
    y = X.swiglu_mlp(p, xg)
    y.sum().backward()
    assert len(calls) == 5 and xg.grad is not None and bool(xg.grad.abs().sum() > 0)
    with torch.no_grad():
        assert torch.equal(y, X.swiglu_mlp(p, xg))
