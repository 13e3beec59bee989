"""Quantized expert training (fmoe.quant.training): quantizers, dgrad/wgrad, SR, Hadamard, torch.func."""
from __future__ import annotations


import sys

import pytest
import torch

from fmoe.layout import Layout
from fmoe.engine import GroupedGemm
from fmoe.quant import _codecs as C
from fmoe.quant import formats as F
from fmoe.quant import training as QT
from fmoe.quant.training import TrainPrecision, quantized_mm, recipe_from_name
from tests.test_engine import engine_and_staged

MM, WGRAD = QT.bmm_layout()
QFORMATS = ("fp8_row", "fp8_block", "mxfp8", "mxfp4", "nvfp4")
E, CAP, K, N = 2, 40, 64, 96  # CAP not a multiple of 16/32: the token axis gets padded


def _data(transposed, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(E, CAP, K, generator=g).to(dtype)
    w = torch.randn((E, N, K) if transposed else (E, K, N), generator=g) * 0.1
    gy = torch.randn(E, CAP, N, generator=g)
    return x, w, gy


def _spec_fq(t, fmt, role):
    """Dequantize-after-quantize straight from fmoe.quant.formats (the spec quantizers)."""
    if fmt == "fp8_block" and role == "act":
        return F.dequantize(F.quantize_fp8_act_tiles(t, 128))
    return F.dequantize(F.quantize(t, fmt))


def _by_hand(x, w, gy, fmt, transposed):
    """Dequantize-then-matmul reference written from the spec quantizers alone (RNE everywhere:
    use with stochastic_rounding=False and hadamard=False)."""
    w_nk = w if transposed else w.transpose(1, 2)
    xq = _spec_fq(x, fmt, "act")
    y = torch.bmm(xq, _spec_fq(w_nk.contiguous(), fmt, "weight").transpose(1, 2))
    gq = _spec_fq(gy, fmt, "act")
    dx = torch.bmm(gq, _spec_fq(w_nk.transpose(1, 2).contiguous(), fmt, "weight").transpose(1, 2))
    pad = (-CAP) % 32
    xT = torch.nn.functional.pad(x.transpose(1, 2), (0, pad)).contiguous()
    gT = torch.nn.functional.pad(gy.transpose(1, 2), (0, pad)).contiguous()
    dw_nk = torch.bmm(_spec_fq(gT, fmt, "act"), _spec_fq(xT, fmt, "act").transpose(1, 2))
    return y, dx, (dw_nk if transposed else dw_nk.transpose(1, 2))


# --- quantizers ------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", QFORMATS)
def test_fake_quantize_is_the_spec_round_trip(fmt):
    t = torch.randn(3, 48, 64, generator=torch.Generator().manual_seed(1))
    for role in ("weight", "act"):
        assert torch.equal(QT.fake_quantize(t, fmt, role), _spec_fq(t, fmt, role))
    qt = QT.quantize_operand(t, fmt, "act")
    ref = F.quantize_fp8_act_tiles(t, 128) if fmt == "fp8_block" else F.quantize(t, fmt)
    assert torch.equal(qt.data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(qt.scales.view(torch.uint8), ref.scales.view(torch.uint8))
    assert QT.fake_quantize(t, "bf16", "act").equal(t.bfloat16().float())


@pytest.mark.parametrize("fmt", ("mxfp4", "nvfp4"))
def test_stochastic_rounding_keeps_scales_and_brackets_rne(fmt):
    t = torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(2))
    rne = F.quantize(t, fmt)
    sr = QT.quantize_sr(t, fmt, generator=torch.Generator().manual_seed(3))
    assert torch.equal(sr.scales.view(torch.uint8), rne.scales.view(torch.uint8))
    if fmt == "nvfp4":
        assert torch.equal(sr.global_scale, rne.global_scale)
    # every SR value is one of the two grid neighbours of the exact value, so it is within one
    # grid step (<= 2 * block scale) of the RNE value
    d_sr, d_rne = F.dequantize(sr), F.dequantize(rne)
    step = (d_rne - t).abs().max()
    assert (d_sr - t).abs().max() <= 4 * step
    assert not torch.equal(d_sr, d_rne)


def test_stochastic_rounding_is_unbiased_and_rne_is_not():
    # values between grid points of one MXFP4 block (scale 1: amax 6 -> shared exp 0)
    v = torch.tensor([6.0, 0.1, 0.3, 1.1, 1.3, 2.2, 2.6, 3.3, 4.4, 5.1, -0.4, -1.2, -2.9, -3.7, -4.2, -5.5] * 2)
    x = v.reshape(1, 32).repeat(4000, 1)  # 4000 independent draws of the same block
    g = torch.Generator().manual_seed(7)
    mean_sr = F.dequantize(QT.quantize_sr(x, "mxfp4", generator=g)).mean(0)
    mean_rne = F.dequantize(F.quantize(x, "mxfp4")).mean(0)
    # grid gaps <= 2, so each draw's error has std <= 1: 4000 draws -> standard error <= 0.016
    assert (mean_sr - v).abs().max() < 0.07
    assert (mean_rne - v).abs().max() > 0.3


def test_sr_e2m1_codes_and_errors():
    g = torch.Generator().manual_seed(0)
    grid = C.E2M1_VALUES
    exact = torch.cat([grid, torch.tensor([7.0, -9.0])])  # on the grid, or saturating
    codes = QT._sr_e2m1(exact, g)
    assert torch.equal(C.decode_e2m1(codes), torch.cat([grid, torch.tensor([6.0, -6.0])]))
    assert torch.equal(codes[[0, 8]], torch.tensor([0x0, 0x8], dtype=torch.uint8))  # sign of zero
    with pytest.raises(ValueError, match="NaN"):
        QT._sr_e2m1(torch.tensor([float("nan")]), g)
    with pytest.raises(TypeError, match="explicit torch.Generator"):
        QT.quantize_sr(torch.randn(2, 32), "mxfp4", generator=None)
    with pytest.raises(ValueError, match="FP4"):
        QT.quantize_sr(torch.randn(2, 32), "mxfp8", generator=g)


def _fq_cases():
    g = torch.Generator().manual_seed(0)
    yield torch.randn(3, 40, 64, generator=g)
    yield torch.randn(2, 130, 160, generator=g) * 1e-3          # ragged 128-blocks, two 128-row tiles
    t = torch.randn(2, 16, 64, generator=g)
    t[0, 3] = 0
    t[1, :, :16] = 0                                            # zero rows and blocks
    yield t
    yield torch.randint(-60, 60, (4, 8, 64), generator=g).float() * 0.25   # E2M1/E4M3 ties
    yield torch.randn(1, 32, 256, generator=g) * 1e-30          # subnormal scales and codes
    yield torch.randn(2, 7, 96, generator=g) * 1e5


@pytest.mark.parametrize("fmt", QFORMATS)
def test_numba_fake_quantize_is_bit_exact_with_the_spec_codecs(fmt):
    for t in _fq_cases():
        if fmt in ("mxfp8", "mxfp4") and t.shape[-1] % 32:
            continue
        for role in ("weight", "act"):
            a = QT.fake_quantize(t, fmt, role, impl="torch")
            b = QT.fake_quantize(t, fmt, role, impl="numba")
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (fmt, role, tuple(t.shape))
        if fmt in ("mxfp4", "nvfp4"):  # the same uniforms in the same order: the same SR codes
            a = QT.fake_quantize(t, fmt, "act", sr=True, generator=torch.Generator().manual_seed(3), impl="torch")
            b = QT.fake_quantize(t, fmt, "act", sr=True, generator=torch.Generator().manual_seed(3), impl="numba")
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    bad = torch.randn(2, 4, 64)
    bad[1, 2, 3] = float("inf")
    with pytest.raises(ValueError, match="inf or NaN"):
        QT.fake_quantize(bad, fmt, "act", impl="numba")


def test_hadamard_is_orthogonal():
    signs = torch.randint(0, 2, (16,), generator=torch.Generator().manual_seed(1)).float() * 2 - 1
    R = QT._hadamard_matrix(signs)
    assert torch.allclose(R @ R.T, torch.eye(16), atol=1e-6)
    assert torch.equal(R.abs(), torch.full((16, 16), 0.25))
    a, b = torch.randn(3, 5, 48), torch.randn(3, 7, 48)
    ha, hb = QT.hadamard_along_tokens(a, signs), QT.hadamard_along_tokens(b, signs)
    assert torch.allclose(ha @ hb.transpose(1, 2), a @ b.transpose(1, 2), atol=1e-4)


# --- the GEMMs --------------------------------------------------------------------------------

@pytest.mark.parametrize("transposed", (True, False))
@pytest.mark.parametrize("fmt", QFORMATS)
def test_dgrad_wgrad_equal_dequantize_then_matmul(fmt, transposed):
    x, w, gy = _data(transposed)
    r = TrainPrecision(weights=fmt, activations=True, grads=True, stochastic_rounding=False)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = quantized_mm(xr, wr, r, transposed=transposed, mm=MM, wgrad=WGRAD, path="reference")
    dx, dw = torch.autograd.grad(y, (xr, wr), gy)
    y_h, dx_h, dw_h = _by_hand(x, w, gy, fmt, transposed)
    # same decoded operands, same torch.bmm: bit-exact
    assert torch.equal(y, y_h) and torch.equal(dx, dx_h) and torch.equal(dw, dw_h)
    assert dw.shape == w.shape
    # "auto" (numba quantize-dequantize, then the same bmm): bit-exact as well
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    ya = quantized_mm(xa, wa, r, transposed=transposed, mm=MM, wgrad=WGRAD, path="auto")
    for a, b in zip((ya,) + torch.autograd.grad(ya, (xa, wa), gy), (y, dx, dw)):
        assert torch.equal(a, b)
    # the fused numba kernels decode the same values; only the summation order differs
    xf, wf = x.clone().requires_grad_(), w.clone().requires_grad_()
    yf = quantized_mm(xf, wf, r, transposed=transposed, mm=MM, wgrad=WGRAD, path="fused")
    dxf, dwf = torch.autograd.grad(yf, (xf, wf), gy)
    for a, b in ((yf, y), (dxf, dx), (dwf, dw)):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("name", ("mxfp4", "nvfp4"))
def test_recipes_with_randomness_match_reference_with_equal_generators(name):
    r = recipe_from_name(name)
    assert r.uses_sr and r.uses_hadamard == (name == "nvfp4")
    for transposed in (True, False):
        x, w, gy = _data(transposed, seed=4)
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = quantized_mm(xr, wr, r, transposed=transposed, mm=MM, wgrad=WGRAD,
                         generator=torch.Generator().manual_seed(11), path="reference")
        dx, dw = torch.autograd.grad(y, (xr, wr), gy)
        ref = QT.quantized_mm_reference(x, w, r, transposed=transposed, gy=gy,
                                        generator=torch.Generator().manual_seed(11))
        for a, b in zip((y, dx, dw), ref):
            assert torch.equal(a, b)
        # a different seed gives different gradients (the randomness is really used)
        y2 = quantized_mm(xr, wr, r, transposed=transposed, mm=MM, wgrad=WGRAD,
                          generator=torch.Generator().manual_seed(12), path="reference")
        assert not torch.equal(torch.autograd.grad(y2, wr, gy)[0], dw)


def test_low_precision_wgrad_is_close_to_fp32():
    x, w, gy = _data(True, seed=5)
    exact = torch.bmm(gy.transpose(1, 2), x)
    rel = {}
    for name in ("bf16", "fp8_row", "fp8_block", "mxfp8", "mxfp4", "nvfp4"):
        wr = w.clone().requires_grad_()
        y = quantized_mm(x, wr, recipe_from_name(name), transposed=True, mm=MM, wgrad=WGRAD,
                         generator=torch.Generator().manual_seed(0))
        (dw,) = torch.autograd.grad(y, wr, gy)
        rel[name] = float((dw - exact).norm() / exact.norm())
    assert rel["bf16"] < 0.01
    assert all(rel[n] < 0.06 for n in ("fp8_row", "fp8_block", "mxfp8")), rel
    assert all(rel[n] < 0.35 for n in ("mxfp4", "nvfp4")), rel


def test_fp32_recipe_and_none_are_the_float_gemm():
    x, w, gy = _data(True)
    for r in (None, TrainPrecision(weights="fp32", activations=True, grads=True)):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = quantized_mm(xr, wr, r, transposed=True, mm=MM, wgrad=WGRAD)
        dx, dw = torch.autograd.grad(y, (xr, wr), gy)
        assert torch.equal(y, torch.bmm(x, w.transpose(1, 2)))
        assert torch.equal(dx, torch.bmm(gy, w))
        assert torch.equal(dw, torch.bmm(gy.transpose(1, 2), x))


def test_ragged_layout_through_callables():
    # [R, K] rows with offsets: the layout lives in mm / wgrad only
    sizes = [13, 0, 27]
    offs = [0, 13, 13, 40]
    g = torch.Generator().manual_seed(8)
    x = torch.randn(40, 64, generator=g)
    w = torch.randn(3, 32, 64, generator=g)
    gy = torch.randn(40, 32, generator=g)

    def mm(a, b, t):
        return torch.cat([a[offs[e]:offs[e + 1]] @ (b[e].T if t else b[e]) for e in range(3)])

    def wgrad(a, b):
        return torch.stack([a[offs[e]:offs[e + 1]].T @ b[offs[e]:offs[e + 1]] for e in range(3)])

    r = TrainPrecision(weights="fp8_row", activations=True, grads=True)
    wr = w.clone().requires_grad_()
    y = quantized_mm(x, wr, r, transposed=True, mm=mm, wgrad=wgrad)
    (dw,) = torch.autograd.grad(y, wr, gy)
    xq = QT.fake_quantize(x, "fp8_row", "act")
    for e in range(3):
        sl = slice(offs[e], offs[e + 1])
        wq = QT.fake_quantize(w[e:e + 1], "fp8_row", "weight")[0]
        assert torch.equal(y[sl], xq[sl] @ wq.T)
    assert torch.equal(dw[1], torch.zeros(32, 64))  # an empty expert gets no gradient
    gq = QT.fake_quantize(gy.T.contiguous(), "fp8_row", "act").T
    xq_t = QT.fake_quantize(x.T.contiguous(), "fp8_row", "act").T
    assert torch.equal(dw[2], gq[13:].T @ xq_t[13:])
    assert sizes[1] == 0


def test_saved_activations_in_fp8():
    x, w, gy = _data(True, seed=9)
    saved = {}
    for mode in (None, "fp8"):
        r = TrainPrecision(weights="fp8_block", save_activations=mode)
        wr = w.clone().requires_grad_()
        xr = x.clone().requires_grad_()
        nbytes = []
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: (nbytes.append(t.numel() * t.element_size()), t)[1], lambda t: t):
            y = quantized_mm(xr, wr, r, transposed=True, mm=MM, wgrad=WGRAD)
        saved[mode] = sum(nbytes)
        (dw,) = torch.autograd.grad(y, wr, gy)
        xs = x if mode is None else F.dequantize(F.quantize_fp8_rowwise(x, amax_floor=0.0))
        assert torch.equal(dw, torch.bmm(gy.transpose(1, 2), xs))
    x_bytes = x.numel() * 4
    assert saved[None] - saved["fp8"] == x_bytes - (x.numel() + E * CAP * 4)


def test_torch_func_grad_and_vmap_through_a_quantized_expert():
    g = torch.Generator().manual_seed(10)
    x = torch.randn(E, CAP, K, generator=g)
    p = {"w1": torch.randn(E, N, K, generator=g) * 0.1, "w2": torch.randn(E, N, K, generator=g) * 0.1}
    r = recipe_from_name("fp8_block")

    def expert(params, inp):
        h = torch.nn.functional.gelu(quantized_mm(inp, params["w1"], r, transposed=True, mm=MM, wgrad=WGRAD))
        return quantized_mm(h, params["w2"], r, transposed=False, mm=MM, wgrad=WGRAD)

    def loss(params, inp):
        return (expert(params, inp) ** 2).mean()

    grads = torch.func.grad(loss)(p, x)
    pl = {k: v.clone().requires_grad_() for k, v in p.items()}
    loss(pl, x).backward()
    for k in p:  # eager may take the fused kernels, torch.func the decoded mm: rounding only
        torch.testing.assert_close(grads[k], pl[k].grad, rtol=1e-5, atol=1e-8)
    xb = torch.randn(3, E, CAP, K, generator=g)
    yb = torch.func.vmap(expert, in_dims=(None, 0))(p, xb)
    for b in range(3):
        torch.testing.assert_close(yb[b], expert(p, xb[b]), rtol=1e-5, atol=1e-6)


def test_errors_name_the_problem():
    x, w, _ = _data(True)
    with pytest.raises(ValueError, match="pass generator=torch.Generator"):
        quantized_mm(x, w, recipe_from_name("mxfp4"), transposed=True, mm=MM, wgrad=WGRAD)
    with pytest.raises(ValueError, match="has K = 64 but w"):
        quantized_mm(x, w, recipe_from_name("fp8_row"), transposed=False, mm=MM, wgrad=WGRAD)
    with pytest.raises(ValueError, match="multiples of 32"):
        quantized_mm(x[..., :48], torch.randn(2, 48, 48), recipe_from_name("mxfp8"), transposed=True,
                     mm=MM, wgrad=WGRAD)
    with pytest.raises(ValueError, match="padded \\[E, C, K\\] buffers"):
        quantized_mm(x[0], w, recipe_from_name("nvfp4"), transposed=True, mm=MM, wgrad=WGRAD,
                     generator=torch.Generator())
    with pytest.raises(ValueError, match="unknown precision 'fp6'"):
        recipe_from_name("fp6")
    with pytest.raises(ValueError, match="weights must be one of"):
        TrainPrecision(weights="int8")
    with pytest.raises(ValueError, match="path must be one of"):
        quantized_mm(x, w, recipe_from_name("fp8_row"), transposed=True, mm=MM, wgrad=WGRAD, path="gpu")
    assert hash(recipe_from_name("nvfp4")) == hash(recipe_from_name("nvfp4"))


def test_bf16_master_weights_and_activations():
    x, w, gy = _data(True, dtype=torch.bfloat16)
    wb = w.bfloat16().requires_grad_()
    xr = x.clone().requires_grad_()
    y = quantized_mm(xr, wb, recipe_from_name("fp8_row"), transposed=True, mm=MM, wgrad=WGRAD,
                     path="reference")
    dx, dw = torch.autograd.grad(y, (xr, wb), gy.bfloat16())
    assert y.dtype == dx.dtype == dw.dtype == torch.bfloat16
    ref = QT.quantized_mm_reference(x, wb.detach(), recipe_from_name("fp8_row"), transposed=True,
                                    gy=gy.bfloat16())
    for a, b in zip((y, dx, dw), ref):
        assert torch.equal(a, b)


# --- charlm smoke: 50 steps per precision through ExpertSpec.precision ----------------------

_SMOKE = ["--steps", "50", "--model_dim", "32", "--hidden_size", "64", "--num_layers", "1", "--context", "16",
          "--batch_size", "2", "--corpus_bytes", "200000", "--eval_every", "50", "--eval_batches", "2",
          "--no_progress", "--no_plot"]


@pytest.fixture(scope="module")
def fp32_charlm(tmp_path_factory):
    from fmoe.examples import charlm
    return charlm.main(_SMOKE + ["--out", str(tmp_path_factory.mktemp("fp32"))])


@pytest.mark.parametrize("name", ("bf16", "fp8_row", "fp8_block", "mxfp8", "mxfp4", "nvfp4", "fp32+save_fp8"))
def test_charlm_50_steps_per_precision(name, fp32_charlm, tmp_path, monkeypatch):
    from fmoe.examples import charlm
    prec, _, save = name.partition("+save_")
    extra = ["--expert_precision", prec] + (["--save_activations", save] if save else [])
    s = charlm.main(_SMOKE + extra + ["--out", str(tmp_path)])
    ref = fp32_charlm
    assert s["expert_precision"] == prec
    assert all(map(torch.isfinite, torch.tensor(s["train_curve"])))
    assert s["final_train_loss"] < s["initial_loss"] - 1.0  # it learns
    # same seed and data: the precision is what moves the trajectory, and only a little
    assert s["train_curve"] != ref["train_curve"]
    assert abs(s["final_val_loss"] - ref["final_val_loss"]) < 0.1 * ref["final_val_loss"]
    if save:  # activation compression: the expert GEMM inputs are kept as FP8 rows
        # against fp32 on the same (staged) pipeline: plain fp32 runs on the expert engine, which
        # keeps only the in-projection outputs and saves less than either
        monkeypatch.setattr(sys.modules["fmoe.engine.traced"], "_eager", lambda *a: False)
        staged = charlm.main(_SMOKE + ["--out", str(tmp_path / "staged")])
        assert s["saved_activation_bytes"] < staged["saved_activation_bytes"]
        assert ref["saved_activation_bytes"] < staged["saved_activation_bytes"]


# --- per-expert quantization blocks: no scale block spans two experts -------------------------

# uneven experts: not multiples of 16/32/128, an empty one, a 1-row one, one longer than a
# 128-token tile; rows 211..219 are the ragged layout's padding rows (no expert)
SIZES = (37, 0, 1, 150, 23)
R_ROWS = 220
KR, NR = 64, 96
SEG_RECIPES = [TrainPrecision(weights=f, activations=True, grads=True, stochastic_rounding=False)
               for f in ("bf16",) + QFORMATS]
SEG_RECIPES.append(TrainPrecision(weights="nvfp4", activations=True, grads=True,
                                  stochastic_rounding=False, hadamard=True))


def _ragged(sizes, rows):
    sizes_t = torch.tensor(sizes, dtype=torch.int64)
    starts = torch.cumsum(sizes_t, 0) - sizes_t
    return Layout(torch.zeros(1, 1, dtype=torch.int64), starts, sizes_t, "ragged", rows,
                  len(sizes), max(max(sizes), 1))


def _padded(sizes, cap):
    E_ = len(sizes)
    return Layout(torch.zeros(1, 1, dtype=torch.int64), torch.arange(E_) * cap,
                  torch.tensor(sizes, dtype=torch.int64), "padded", E_ * cap, E_, cap)


def _seg_data(transposed, seed=20):
    g = torch.Generator().manual_seed(seed)
    n_rows = sum(SIZES)
    x = torch.randn(R_ROWS, KR, generator=g)
    x[n_rows:] = 0                     # padding rows (dispatch leaves them zero)
    x[:37] *= 50                       # experts of very different magnitudes: a shared scale
    x[38:188] *= 1e-3                  # block would flush the small one
    gy = torch.randn(R_ROWS, NR, generator=g)
    gy[n_rows:] = 0                    # combine sends padding rows no gradient
    gy[38:188] *= 1e-3
    w = torch.randn((len(SIZES), NR, KR) if transposed else (len(SIZES), KR, NR), generator=g) * 0.1
    return x, w, gy


def _run_gemm(gemm, x, w, gy, transposed, seed=5):
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    gemm = GroupedGemm.over(gemm.layout, precision=gemm.plan.precision, generator=torch.Generator().manual_seed(seed))
    y = gemm.mm(xr, wr, transposed=transposed)
    dx, dw = torch.autograd.grad(y, (xr, wr), gy)
    return y, dx, dw


def _name(r):
    return r.weights + ("+hadamard" if r.hadamard else "")


@pytest.mark.parametrize("transposed", (True, False))
@pytest.mark.parametrize("recipe", SEG_RECIPES, ids=_name)
def test_ragged_blocks_never_span_two_experts(recipe, transposed):
    """quantized_mm on ragged rows == the same recipe run expert by expert on its rows alone
    (forward, dgrad and wgrad; bit for bit: the same decoded operands, the same GEMM calls)."""
    x, w, gy = _seg_data(transposed)
    y, dx, dw = _run_gemm(GroupedGemm.over(_ragged(SIZES, R_ROWS), precision=recipe), x, w, gy, transposed)
    assert dw.shape == w.shape
    s = 0
    for e, n in enumerate(SIZES):
        sl = slice(s, s + n)
        s += n
        if n == 0:
            assert torch.equal(dw[e], torch.zeros_like(dw[e]))  # an empty expert: no gradient
            continue
        one = GroupedGemm.over(_ragged((n,), n), precision=recipe)
        y_e, dx_e, dw_e = _run_gemm(one, x[sl], w[e:e + 1], gy[sl], transposed)
        assert torch.equal(y[sl], y_e), (e, "y")
        assert torch.equal(dx[sl], dx_e), (e, "dx")
        assert torch.equal(dw[e], dw_e[0]), (e, "dw")
    assert torch.equal(y[s:], torch.zeros_like(y[s:]))  # padding rows
    assert torch.equal(dx[s:], torch.zeros_like(dx[s:]))


@pytest.mark.parametrize("recipe", SEG_RECIPES, ids=_name)
def test_padded_blocks_are_per_expert(recipe):
    """The padded [E, C, K] buffers already quantize per expert: expert e's results are those
    of a buffer holding expert e alone, and of its rows alone (an n-row buffer): the same decoded
    operands, so they agree up to the BLAS summation order of a bmm over E vs 1 experts and C vs
    n rows (host-dependent: a BLAS may thread a batch of E otherwise than one matrix), far below
    the quantization error a block spanning two experts would add."""
    transposed = True
    cap = 160
    x_r, w, gy_r = _seg_data(transposed)
    x = torch.zeros(len(SIZES), cap, KR)
    gy = torch.zeros(len(SIZES), cap, NR)
    s = 0
    for e, n in enumerate(SIZES):
        x[e, :n], gy[e, :n] = x_r[s:s + n], gy_r[s:s + n]
        s += n
    y, dx, dw = _run_gemm(GroupedGemm.over(_padded(SIZES, cap), precision=recipe), x, w, gy, transposed)
    for e, n in enumerate(SIZES):
        if n == 0:
            assert torch.equal(dw[e], torch.zeros_like(dw[e]))
            continue
        alone = GroupedGemm.over(_padded((n,), cap), precision=recipe)
        y_a, dx_a, dw_a = _run_gemm(alone, x[e:e + 1], w[e:e + 1], gy[e:e + 1], transposed)
        for got, alone_e in ((y[e], y_a[0]), (dx[e], dx_a[0]), (dw[e], dw_a[0])):
            torch.testing.assert_close(got, alone_e, rtol=1e-5, atol=1e-5, msg=str(e))
        rows = GroupedGemm.over(_padded((n,), n), precision=recipe)
        y_e, dx_e, dw_e = _run_gemm(rows, x[e:e + 1, :n], w[e:e + 1], gy[e:e + 1, :n], transposed)
        torch.testing.assert_close(y[e, :n], y_e[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dx[e, :n], dx_e[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dw[e], dw_e[0], rtol=1e-5, atol=1e-5)


def _pad_tok(tT, mult):
    return torch.nn.functional.pad(tT, (0, (-tT.shape[-1]) % mult))


@pytest.mark.parametrize("name", ("mxfp4", "nvfp4"))
def test_ragged_stochastic_rounding_and_hadamard_go_expert_by_expert(name):
    """The full FP4 recipes (stochastic rounding; nvfp4 also the random Hadamard transform) on
    ragged rows: dw[e] is expert e's rows alone, transformed, padded and quantized on their
    own, the draws taken expert by expert (written here from the public quantizers)."""
    r = recipe_from_name(name)
    x, w, gy = _seg_data(True, seed=21)
    _, _, dw = _run_gemm(GroupedGemm.over(_ragged(SIZES, R_ROWS), precision=r), x, w, gy, True, seed=9)
    g = torch.Generator().manual_seed(9)
    # backward draws: dgrad's gradient quantization first (NVFP4: one global scale per expert)
    n_rows, s = sum(SIZES), 0
    if name == "nvfp4":
        for n in SIZES + (R_ROWS - n_rows,):
            if n:
                QT.fake_quantize(gy[s:s + n], name, "act", sr=True, generator=g)
            s += n
    else:
        QT.fake_quantize(gy, name, "act", sr=True, generator=g)
    signs = None
    if r.uses_hadamard:
        signs = torch.randint(0, 2, (16,), generator=g).float().mul_(2).sub_(1)
    s = 0
    for e, n in enumerate(SIZES):
        lo, s = s, s + n
        if n == 0:
            assert torch.equal(dw[e], torch.zeros_like(dw[e]))
            continue
        mult = 32 if name == "mxfp4" else 16   # the block (and Hadamard) size
        gT, xT = _pad_tok(gy[lo:s].T, mult), _pad_tok(x[lo:s].T, mult)
        if signs is not None:
            gT, xT = QT.hadamard_along_tokens(gT, signs), QT.hadamard_along_tokens(xT, signs)
        gq = QT.fake_quantize(gT.contiguous(), name, "act", sr=True, generator=g)
        xq = QT.fake_quantize(xT.contiguous(), name, "act")
        if signs is None:  # cropped back to the expert's rows for the layout's wgrad
            ref = gq[:, :n] @ xq[:, :n].T
        else:              # the transform mixed the padding in: the whole padded axis
            ref = gq @ xq.T
        assert torch.equal(dw[e], ref), e


def test_ragged_offsets_with_plain_callables():
    """offsets= gives plain mm / wgrad callables the same per-expert blocks as a GroupedGemm
    (over a ragged layout, which passes its offsets itself); without offsets [R, K] rows are one group."""
    r = TrainPrecision(weights="fp8_block", activations=True, grads=True)
    x, w, gy = _seg_data(True)
    lay = _ragged(SIZES, R_ROWS)
    offs = lay.offsets.tolist()

    def mm(a, b, t):
        out = torch.cat([a[offs[e]:offs[e + 1]] @ (b[e].T if t else b[e]) for e in range(len(SIZES))])
        return torch.cat([out, a.new_zeros(a.shape[0] - offs[-1], out.shape[1])])

    def wgrad(a, b):
        return torch.stack([a[offs[e]:offs[e + 1]].T @ b[offs[e]:offs[e + 1]] for e in range(len(SIZES))])

    _, _, dw_gemm = _run_gemm(GroupedGemm.over(lay, precision=r), x, w, gy, True)
    for offsets, same, path in ((lay.offsets, True, "auto"), (lay.offsets, True, "reference"),
                                (None, False, "auto")):
        wr = w.clone().requires_grad_()
        y = quantized_mm(x, wr, r, transposed=True, mm=mm, wgrad=wgrad, offsets=offsets, path=path)
        (dw,) = torch.autograd.grad(y, wr, gy)
        assert torch.equal(dw, dw_gemm) == same
    with pytest.raises(ValueError, match="offsets has 4 experts"):
        quantized_mm(x, w, r, transposed=True, mm=mm, wgrad=wgrad, offsets=lay.offsets[:-1])
    with pytest.raises(ValueError, match="non-decreasing"):
        quantized_mm(x, w.requires_grad_(), r, transposed=True, mm=mm, wgrad=wgrad,
                     offsets=torch.tensor([0, 40, 30, 100, 200, 211]))
    with pytest.raises(ValueError, match="offsets are for ragged rows"):
        quantized_mm(torch.zeros(5, 8, KR), w, r, transposed=True, mm=MM, wgrad=WGRAD, offsets=lay.offsets)


@pytest.mark.parametrize("name", ["bf16", "fp8_block", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("typ", ["ffn", "gated_ffn", "swiglu", "gpt_oss"])
def test_recipes_on_the_engine_equal_the_staged_ragged_pipeline(name, typ, monkeypatch):
    # fmoe.moe runs a quantized-training recipe on the expert engine (one plan, quantize blocks
    # per expert over the plan's rows, the table's float GEMMs); the staged pipeline on the
    # ragged layout quantizes the same rows in the same blocks, with the same randomness order:
    # equal up to the order in which a token's k terms are summed, gradients too
    import fmoe
    spec = fmoe.MoESpec(model_dim=32, num_experts=4, gate=fmoe.GateSpec(k=2, capacity_factor=0.0),
                        experts=fmoe.ExpertSpec(type=typ, hidden_size=32, precision=name))
    params = fmoe.init_params(spec, generator=torch.Generator().manual_seed(0))
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(1))
    (y_e, g_e), (y_s, g_s) = engine_and_staged(monkeypatch, spec, params, x, "_rows_mm", expert_grads=True,
                                               seed=5)
    torch.testing.assert_close(y_e, y_s, rtol=1e-5, atol=1e-6)
    for a, b in zip(g_e, g_s):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
