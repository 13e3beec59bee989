"""fmoe.quant.packed: the grouped GEMM over packed expert weights against dequantize-then-matmul.

Where a C++ compiler is present the extension must build and be active (no silent skip). Every
format runs on every vector path the CPU has (forced through ``isa=``), on shapes that take the
register kernels (<= DENSE_FROM rows an expert), the decode-tile + at::mm path (more rows), empty
experts, a ragged tile of rows and a K that sends FP4 from the AVX-512 kernel to the AVX2 one.

Bound: the decoded weights are dequantize()'s products, only the summation order (and nvfp4's
global-scale rounding) differs, so |y - ref| <= (K + 2) * eps32 * (|a| @ |W|.T) elementwise: tight
enough that a wrong row, expert, scale block or nibble order fails it by orders of magnitude.
"""
from __future__ import annotations

import pytest
import torch

import fmoe.quant as Q
from fmoe.ops import native
from fmoe.quant import packed

HAS_COMPILER = native._compiler() is not None
FORMATS = ("mxfp4", "nvfp4", "mxfp8", "fp8_block", "fp8_row")


@pytest.fixture(scope="module", autouse=True)
def built():
    if HAS_COMPILER:
        packed.build(verbose=False)  # a no-op when already built for this key
    yield


def _isas():
    if not packed.AVAILABLE:
        return []
    best = packed.ISAS[packed.best_isa()]
    return [name for name in ("portable", "avx2", "avx512") if packed.ISAS[name] <= best]


def _offsets(counts):
    o = torch.zeros(len(counts) + 1, dtype=torch.int64)
    o[1:] = torch.tensor(counts).cumsum(0)
    return o


def _bound(a, w, o):
    W = Q.dequantize(w).abs()
    b = torch.zeros(a.shape[0], W.shape[1])
    for e in range(W.shape[0]):
        b[o[e]:o[e + 1]] = a[o[e]:o[e + 1]].float().abs() @ W[e].T
    return (a.shape[1] + 2) * torch.finfo(torch.float32).eps * b


def _within_the_bound_on_every_isa(w, o, K, g, isas, tag):
    """float32 rows [R, K] through every forced ISA path: within _bound of the reference."""
    a = torch.randn(int(o[-1]), K, generator=g)
    ref = packed.grouped_matmul_reference(a, w, o)
    bound = _bound(a, w, o)
    for isa in isas:
        y = packed.grouped_matmul(a, w, o, isa=isa, impl="native")
        assert y.dtype == torch.float32 and y.shape == ref.shape
        bad = (y - ref).abs() > bound
        assert not bad.any(), f"{tag} isa={isa}: rows {bad.any(1).nonzero().flatten().tolist()} outside the bound"


def test_active_when_a_compiler_is_present():
    if HAS_COMPILER:
        assert packed.AVAILABLE, packed.status()
        assert packed.status().startswith("native CPU packed-weight GEMM: active")
    else:
        assert not packed.AVAILABLE and "no C++ compiler" in packed.status()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("K", [256, 96])
def test_every_isa_path_matches_the_reference(fmt, K):
    isas = _isas()
    if not isas:
        pytest.skip(packed.status())
    g = torch.Generator().manual_seed(0)
    # rows per expert: register kernels (1, 3, 4, 5, 8), an empty expert, the decode + mm path (12)
    counts = [1, 0, 3, 12, 4, 5, 8]
    w = Q.quantize(torch.randn(len(counts), 70, K, generator=g), fmt)
    _within_the_bound_on_every_isa(w, _offsets(counts), K, g, isas, f"{fmt} K={K}")


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8_block"])
def test_bfloat16_rows_and_the_input_gradient(fmt):
    if not packed.AVAILABLE:
        pytest.skip(packed.status())
    g = torch.Generator().manual_seed(1)
    w = Q.quantize(torch.randn(3, 40, 128, generator=g), fmt)
    o = _offsets([2, 0, 11])
    a = torch.randn(13, 128, generator=g).bfloat16().requires_grad_()
    y = packed.grouped_matmul(a, w, o)
    assert y.dtype == torch.bfloat16
    ref = packed.grouped_matmul_reference(a.detach(), w, o)
    torch.testing.assert_close(y.float(), ref.float(), rtol=1e-2, atol=1e-2)
    dy = torch.randn(13, 40, generator=g).bfloat16()
    (da,) = torch.autograd.grad(y, a, dy)
    W = Q.dequantize(w)
    want = torch.cat([dy[:2].float() @ W[0], dy[2:].float() @ W[2]]).bfloat16()
    assert torch.equal(da, want)


def test_nan_weight_byte_gives_nan_on_every_path():
    isas = _isas()
    if not isas:
        pytest.skip(packed.status())
    w = Q.quantize_fp8_rowwise(torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(2)))
    data = w.data.view(torch.uint8).clone()
    data[0, 1, 17] = 0x7F
    bad = Q.QuantizedTensor(data.view(torch.float8_e4m3fn), w.scales, None, "fp8_row", w.shape, w.block)
    a = torch.randn(2, 64)
    for isa in isas:
        y = packed.grouped_matmul(a, bad, _offsets([2]), isa=isa, impl="native")
        assert torch.isnan(y[:, 1]).all() and torch.isfinite(y[:, [0, 2]]).all(), isa


def test_numba_fallback_matches_the_reference(monkeypatch):
    # where the extension is not built, impl="auto" runs the numba kernels per busy expert
    monkeypatch.setattr(packed, "AVAILABLE", False)
    monkeypatch.setattr(packed, "_WHY", "not built: run `python -m fmoe build`")
    g = torch.Generator().manual_seed(3)
    w = Q.quantize(torch.randn(3, 24, 64, generator=g), "nvfp4")
    o = _offsets([1, 0, 4])
    a = torch.randn(5, 64, generator=g)
    y = packed.grouped_matmul(a, w, o)
    ref = packed.grouped_matmul_reference(a, w, o)
    assert not ((y - ref).abs() > _bound(a, w, o)).any()
    with pytest.raises(RuntimeError, match="not built: run `python -m fmoe build`"):
        packed.grouped_matmul(a, w, o, impl="native")
    with pytest.raises(ValueError, match="offsets must start at 0, never decrease and end at R = 5"):
        packed.grouped_matmul(a, w, torch.tensor([0, 3, 2, 5]))   # the numba path checks the values it reads


def test_bad_arguments_name_themselves():
    w = Q.quantize(torch.randn(2, 8, 32), "mxfp4")
    a = torch.randn(3, 32)
    with pytest.raises(ValueError, match="offsets must start at 0, never decrease and end at R = 3"):
        packed.grouped_matmul(a, w, _offsets([1, 1]))
    # the values are checked where they are read (the extension's own check, the numba path's, the
    # reference's): a decreasing offset between a right first and last one, on every path
    for impl in ("auto", "reference") + (("native",) if packed.AVAILABLE else ()):
        with pytest.raises(ValueError, match="offsets must start at 0, never decrease and end at R = 3"):
            packed.grouped_matmul(a, w, torch.tensor([0, 4, 3]), impl=impl)
    with pytest.raises(ValueError, match="offsets must start at 0, never decrease and end at R = 3"):
        packed.grouped_matmul(a.requires_grad_(), w, torch.tensor([0, 4, 3]))
    a = a.detach()
    with pytest.raises(ValueError, match=r"offsets must be a CPU int64 \[E \+ 1\] = \[3\]"):
        packed.grouped_matmul(a, w, torch.tensor([0, 3]))
    with pytest.raises(ValueError, match=r"expected a \[R, K\] and w \[E, N, K\]"):
        packed.grouped_matmul(torch.randn(3, 16), w, _offsets([1, 2]))
    with pytest.raises(TypeError, match="a must be a float32 or bfloat16 tensor"):
        packed.grouped_matmul(a.half(), w, _offsets([1, 2]))
    with pytest.raises(TypeError, match="w must be a QuantizedTensor"):
        packed.grouped_matmul(a, torch.randn(2, 8, 32), _offsets([1, 2]))
    with pytest.raises(ValueError, match="isa must be one of"):
        packed.grouped_matmul(a, w, _offsets([1, 2]), isa="neon")


def test_moe_runs_packed_weights_in_one_call_per_projection(monkeypatch):
    # fmoe.moe on the engine (rows plan: no grad, fp32, so the whole stage is one expert_stage
    # call, kinds.fused_stage) and on the staged ragged layout (one grouped_matmul per
    # projection), and the layer equals the same layer over the dequantized (float) weights
    import dataclasses

    import fmoe
    spec = fmoe.MoESpec(model_dim=64, num_experts=4, gate=fmoe.GateSpec(k=2, capacity_factor=0.0),
                        experts=fmoe.ExpertSpec(type="swiglu", hidden_size=64), layout="ragged")
    params = fmoe.init_params(spec, generator=torch.Generator().manual_seed(0))
    packed_ex = {k: Q.quantize(v, "mxfp4") for k, v in params["experts"].items()}
    float_ex = {k: Q.dequantize(v) for k, v in packed_ex.items()}
    x = torch.randn(24, 64, generator=torch.Generator().manual_seed(1))
    calls = []
    real, real_stage = packed.grouped_matmul, packed.expert_stage
    monkeypatch.setattr(packed, "grouped_matmul", lambda *a, **k: (calls.append("mm"), real(*a, **k))[1])
    monkeypatch.setattr(packed, "expert_stage", lambda *a, **k: (calls.append("stage"), real_stage(*a, **k))[1])
    want, _ = fmoe.moe(dict(params, experts=float_ex), x, spec)
    for s, one_call in ((spec, ["stage"]), (dataclasses.replace(spec, plan="layout"), ["mm", "mm"])):
        calls.clear()
        with torch.no_grad():
            y, _ = fmoe.moe(dict(params, experts=packed_ex), x, s)
        assert calls == one_call, s.plan
        torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-5)


def test_a_broken_library_leaves_fmoe_on_the_numba_kernels(tmp_path, monkeypatch):
    broken = tmp_path / "fmoe_packed_gemm.so"
    broken.write_bytes(b"not a shared library")
    monkeypatch.setattr(packed, "library_path", lambda: str(broken))
    try:
        packed._try_load()
        assert not packed.AVAILABLE and "failed" in packed.status()
        w = Q.quantize(torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(4)), "mxfp4")
        o = _offsets([3, 1])
        a = torch.randn(4, 64, generator=torch.Generator().manual_seed(5))
        y = packed.grouped_matmul(a, w, o)
        assert not ((y - packed.grouped_matmul_reference(a, w, o)).abs() > _bound(a, w, o)).any()
    finally:
        monkeypatch.undo()
        packed._try_load()
    assert packed.AVAILABLE == HAS_COMPILER


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_int8_activations_within_the_rounding_of_their_blocks(fmt):
    # activations="int8": each 32-block of a row rounded to int8 (d = amax / 127), integer dot
    # products. |y - ref| <= |W| @ (d / 2) over the row's blocks, plus the float bound (taken
    # with |a| + d / 2, the rounded activations' magnitude)
    if not packed.AVAILABLE or not packed.has_int8_path():
        pytest.skip("no AVX-512 VNNI path here: " + packed.status())
    g = torch.Generator().manual_seed(6)
    counts = [1, 0, 2, 4, 3, 12]           # 12 rows: that expert takes the float decode + mm path
    w = Q.quantize(torch.randn(len(counts), 70, 256, generator=g), fmt)
    o = _offsets(counts)
    a = torch.randn(int(o[-1]), 256, generator=g)
    ref = packed.grouped_matmul_reference(a, w, o)
    y = packed.grouped_matmul(a, w, o, activations="int8")
    d = a.reshape(a.shape[0], -1, 32).abs().amax(-1) / 127
    half = (d / 2).repeat_interleave(32, dim=1)
    W = Q.dequantize(w).abs()
    bound = torch.zeros_like(ref)
    for e in range(len(counts)):
        rows = slice(int(o[e]), int(o[e + 1]))
        bound[rows] = half[rows] @ W[e].T + 258 * torch.finfo(torch.float32).eps * ((a[rows].abs() + half[rows]) @ W[e].T)
    assert not ((y - ref).abs() > bound).any()
    assert (y - ref).abs().max() > 0             # the int8 path did run (float would be far closer)
    big = slice(int(o[-2]), int(o[-1]))          # the many-rows expert stays on the float path
    assert not ((y[big] - ref[big]).abs() > _bound(a[big], w[-1:], _offsets([12]))).any()


def test_int8_activations_refuse_what_they_cannot_run():
    w = Q.quantize(torch.randn(2, 8, 96), "fp8_block")
    with pytest.raises(ValueError, match=r"int8 activations need MXFP4/NVFP4 weights .* \[\('fp8_block', 96\)\]"):
        packed.grouped_matmul(torch.randn(2, 96), w, _offsets([1, 1]), activations="int8")
    with pytest.raises(ValueError, match="activations must be 'float' or 'int8'"):
        packed.grouped_matmul(torch.randn(2, 96), w, _offsets([1, 1]), activations="int4")


@pytest.mark.parametrize("fmt,K", [("mxfp4", 256), ("nvfp4", 256), ("mxfp4", 96), ("mxfp8", 256), ("fp8_block", 200),
                                   ("fp8_row", 256)])
@pytest.mark.parametrize("dense_from", [8, 16])
def test_register_tiles_every_row_count(fmt, K, dense_from, monkeypatch):
    # every per-expert row count 1 .. 17 (and 0): one weight row group of 4 (1 row), pairs (up to
    # 4 rows, or every count for FP4 on AVX-512), single rows, passes of 4 / 8 rows within slices of
    # weight rows (9 .. 16 rows with dense_from = 16), the decode + mm path beyond; N = 71 leaves
    # rows outside the groups at the end of each 64-row tile; K = 200 ends fp8_block in a partial block
    isas = _isas()
    if not isas:
        pytest.skip(packed.status())
    monkeypatch.setattr(packed, "DENSE_FROM", dense_from)
    g = torch.Generator().manual_seed(7)
    counts = list(range(1, 18)) + [0]
    w = Q.quantize(torch.randn(len(counts), 71, K, generator=g), fmt)
    _within_the_bound_on_every_isa(w, _offsets(counts), K, g, isas, f"{fmt} K={K} dense_from={dense_from}")


def _nans_and_bound_on_every_isa(a, w, o, ref, isas):
    # NaN exactly where the reference has it (a NaN scale poisons its block's every sum, on any
    # path), every other entry within the K-term bound
    bound = _bound(a, w, o)
    fin = ~torch.isnan(ref)
    for isa in isas:
        y = packed.grouped_matmul(a, w, o, isa=isa, impl="native")
        assert torch.equal(torch.isnan(y), torch.isnan(ref)), isa
        assert not ((y - ref).abs() > bound)[fin].any(), isa


def _rescaled(fmt, shape, seed, edit):
    """(generator, FP4 weights of `shape` whose byte scales `edit` changed in place)."""
    g = torch.Generator().manual_seed(seed)
    w = Q.quantize(torch.randn(*shape, generator=g), fmt)
    sc = w.scales.view(torch.uint8).clone()
    edit(sc)
    return g, Q.QuantizedTensor(w.data, sc.view(w.scales.dtype), w.global_scale, fmt, w.shape, w.block)


def test_nvfp4_every_scale_byte_on_every_path():
    # nvfp4's E4M3 block scales decode by arithmetic on AVX-512 (not the table): every one of the 256
    # bytes (subnormals, negatives, the NaN codes 0x7F and 0xFF) as some row's scale, on every path
    isas = _isas()
    if not isas:
        pytest.skip(packed.status())

    def every_byte(sc):
        sc[0] = torch.arange(256, dtype=torch.uint8)[:, None] ^ torch.arange(sc.shape[2], dtype=torch.uint8)

    g, w = _rescaled("nvfp4", (1, 256, 128), 9, every_byte)
    o = _offsets([3])
    a = torch.randn(3, 128, generator=g)
    ref = packed.grouped_matmul_reference(a, w, o)
    assert torch.isnan(ref).any() and ref.isfinite().any()
    _nans_and_bound_on_every_isa(a, w, o, ref, isas)


def test_mxfp4_scale_bytes_0_and_255_on_every_path():
    # E8M0 byte 0 is 2^-127 (not the bit pattern 0) and 255 is NaN: a 64-row tile holding either
    # leaves the AVX-512 kernel's E8M0 bit path for the table; the other tiles keep it
    isas = _isas()
    if not isas:
        pytest.skip(packed.status())

    def tiny_and_nan(sc):
        sc[0, 5, 3] = 0        # tile 0 of expert 0: a tiny block
        sc[1, 130, 1] = 255    # tile 2 of expert 1: a NaN block

    g, w2 = _rescaled("mxfp4", (2, 200, 256), 8, tiny_and_nan)
    o = _offsets([1, 3])
    a = torch.randn(4, 256, generator=g)
    a[0, 96:128] *= 2.0 ** 120   # makes the 2^-127 block count
    ref = packed.grouped_matmul_reference(a, w2, o)
    assert torch.isnan(ref[1:, 130]).all() and ref[:, :130].isfinite().all()
    _nans_and_bound_on_every_isa(a, w2, o, ref, isas)


@pytest.mark.parametrize("fmt,K", [("mxfp4", 256), ("nvfp4", 256), ("fp8_block", 256), ("fp8_block", 200),
                                   ("fp8_block", 96), ("fp8_row", 256), ("mxfp8", 256)])
def test_bfloat16_rows_round_once(fmt, K):
    """bf16 rows (FP4 experts past DENSE_FROM rows take a bf16 GEMM over their exactly decoded
    weights): each output is the reference's fp32 sum within the K-term bound, rounded to bf16
    once, on every ISA path and on both sides of DENSE_FROM (and, on AVX-512 BF16, of dot_rows and of
    the 64 rows an expert past which MXFP4's tile takes at::mm instead of fmoe's GEMM)."""
    isas = _isas()
    if not isas:
        pytest.skip(packed.status())
    g = torch.Generator().manual_seed(4)
    counts = [3, 0, packed.DENSE_FROM + 1, 40, 70]
    w = Q.quantize(torch.randn(len(counts), 160, K, generator=g), fmt)   # fp8_block: 2 row blocks, one partial
    o = _offsets(counts)
    a = torch.randn(int(o[-1]), K, generator=g).bfloat16()
    ref = packed.grouped_matmul_reference(a.float(), w, o)          # exact bf16 inputs, fp32 sums
    slack = _bound(a, w, o) + ref.abs() * 2.0 ** -8                  # + one bf16 rounding
    for isa in isas:
        y = packed.grouped_matmul(a, w, o, isa=isa, impl="native")
        # without MKL's bf16 GEMM (a torch build that lacks it): at::mm (mxfp4) or float32 GEMMs
        y_fallback = packed._native(a, w, o, isa, blas=False)
        # without the bf16 dot-product tiles (which take FP4 experts of up to dot_rows rows on AVX-512 BF16)
        y_tile = packed._native(a, w, o, isa, dot_bf16=False)
        for path, got in (("default", y), ("no blas", y_fallback), ("decoded tiles", y_tile)):
            assert got.dtype == torch.bfloat16
            bad = (got.float() - ref).abs() > slack
            assert not bad.any(), f"{fmt} isa={isa} {path}: {int(bad.sum())} entries outside one bf16 rounding"
    wrong = packed.grouped_matmul(a, Q.quantize(torch.randn(len(counts), 160, K, generator=g), fmt), o)
    assert ((wrong.float() - ref).abs() > slack).any()   # the bound catches other weights


_DOT_BF16 = 4   # packed_grouped_mm's return where the bf16 dot-product tiles ran


def _raw_out(a, w, o, dot_bf16, path=False, blas=True):
    """The kernel's float32 output for bf16 rows a (before packed._native rounds it to bf16);
    path: also the path it reports (the ISA run, or _DOT_BF16; _GEMM_BF16 or'ed in)."""
    from fmoe.quant import _codecs as C
    data, scales, table, fp4, bn, bk, gs = packed._operands(w)
    out = torch.empty(a.shape[0], w.logical_shape[1])
    b16 = a.contiguous() if fp4 or scales.dtype == torch.float32 else None   # as packed._native passes them
    ran = packed._EXT.packed_grouped_mm(a.float().contiguous(), o, data, scales, table, C.E4M3_TABLE, gs, fp4, bn, bk,
                                        out, packed.ISAS["auto"], packed.DENSE_FROM, False, b16, blas, dot_bf16)
    return (out, ran) if path else out


@pytest.mark.parametrize("fmt,K,N", [("mxfp4", 256, 199), ("mxfp4", 384, 64), ("nvfp4", 256, 199), ("nvfp4", 128, 3)])
def test_bfloat16_rows_bf16_dot_tiles(fmt, K, N):
    """bf16 rows of FP4 weights at decode on an AVX-512 BF16 CPU: the bf16 dot-product tiles (exact
    products, vdpbf16ps) give the reference's fp32 sum within the K-term bound, for 1 to dot_rows()
    rows an expert (past DENSE_FROM too, where float32 rows take the decoded tile), an odd number of
    weight rows, E8M0 scales on the bit path and (a 0 byte) through the
    table; they do run (the call reports their path: their sums often equal the float tiles' to
    the bit, as both sum a lane's k in the same order);
    a row with a nonzero value below 2^-100 (where vdpbf16ps's flush of denormals could matter)
    sends the call to the float tiles."""
    if not packed.AVAILABLE or not packed._EXT.has_bf16_dot():
        pytest.skip("no AVX-512 BF16 on this CPU: the float tiles run bf16 rows")
    g = torch.Generator().manual_seed(12)
    counts = [1, 2, 0, 3, 4, packed.DENSE_FROM, 13, packed._EXT.dot_rows(16 if fmt == "nvfp4" else 32)]
    w = Q.quantize(torch.randn(len(counts), N, K, generator=g), fmt)
    if fmt == "mxfp4":   # expert 3's scales through the table (a 2^-127 block), the others' on the bit path
        sc = w.scales.view(torch.uint8).clone()
        sc[3, 1, 0] = 0
        w = Q.QuantizedTensor(w.data, sc.view(w.scales.dtype), None, "mxfp4", w.shape, w.block)
    o = _offsets(counts)
    a = torch.randn(int(o[-1]), K, generator=g).bfloat16()
    ref = packed.grouped_matmul_reference(a.float(), w, o)
    bound = _bound(a, w, o)
    (dot, ran), (flt, ran_flt) = _raw_out(a, w, o, True, True), _raw_out(a, w, o, False, True)
    assert (ran, ran_flt) == (_DOT_BF16, packed.ISAS["avx512"])   # they do run
    assert ((dot - ref).abs() <= bound).all()
    # without them, the experts past DENSE_FROM take the decoded tile's bf16 GEMM, rounded to bf16 once
    assert ((flt - ref).abs() <= bound + ref.abs() * 2.0 ** -8).all()
    for tiny in (2.0 ** -110, 2.0 ** -130):   # normal and denormal bf16
        a2 = a.clone()
        a2[2, 7] = tiny
        assert _raw_out(a2, w, o, True, True)[1] == packed.ISAS["avx512"]
        assert torch.equal(_raw_out(a2, w, o, True), _raw_out(a2, w, o, False))
    y = packed.grouped_matmul(a, w, o)   # the public call takes them: one bf16 rounding of the kernel's sum
    assert torch.equal(y, dot.bfloat16())


_GEMM_BF16 = 8   # or'ed into packed_grouped_mm's return where fmoe's bf16 tile GEMM ran a job


@pytest.mark.parametrize("fmt,K,block", [("fp8_block", 256, None), ("fp8_block", 200, None), ("fp8_block", 200, (8, 48)),
                                         ("fp8_row", 256, None), ("nvfp4", 256, None), ("mxfp4", 256, None)])
def test_bfloat16_rows_tile_gemm_with_block_scales(fmt, K, block):
    """bf16 rows of FP8 weights past DENSE_FROM, and of FP4 past dot_rows (MXFP4: up to the 64 rows
    an expert it takes before at::mm), on an AVX-512 BF16 CPU without AMX: the decoded tile (bare E4M3
    values; FP4 values times their E8M0 or E4M3 scales) times the rows by fmoe's vdpbf16ps GEMM, each
    scale block's sum scaled once in float32 (FP8's block scales, NVFP4's global one): within the
    K-term bound of the reference, as the other paths of these jobs (MKL's GEMM or, for MXFP4, at::mm,
    whose bf16 sum adds one rounding; the float32 path); K = 200 ends blocks mid-chunk (masked
    loads), (8, 48) blocks are thinner than MKL's path takes; it does run (the call reports it), and
    a NaN byte gives NaN where the reference has it."""
    if not packed.AVAILABLE or not packed._EXT.has_bf16_dot() or packed._EXT.has_amx_bf16():
        pytest.skip("fmoe's bf16 tile GEMM runs on AVX-512 BF16 CPUs without AMX")
    g = torch.Generator().manual_seed(14)
    fp4_bk = {"nvfp4": 16, "mxfp4": 32}.get(fmt)
    many = (packed._EXT.dot_rows(fp4_bk) if fp4_bk else packed.DENSE_FROM) + 5
    counts = [many, 0, 2, many + 14]   # expert 2: the small-rows tiles, beside the GEMM's jobs
    kw = {} if block is None else {"block": block}
    w = Q.quantize(torch.randn(len(counts), 70, K, generator=g), fmt, **kw)
    if not fp4_bk:   # a NaN weight (E4M3 0x7F) in expert 3's row 9
        d = w.data.view(torch.uint8).clone()
        d[3, 9, 17] = 0x7F
        w = Q.QuantizedTensor(d.view(w.data.dtype), w.scales, w.global_scale, fmt, w.shape, w.block)
    o = _offsets(counts)
    a = torch.randn(int(o[-1]), K, generator=g).bfloat16()
    ref = packed.grouped_matmul_reference(a.float(), w, o)
    fin = ~torch.isnan(ref)
    bound = _bound(a, w, o)
    (own, ran), (mkl, _), (flt, ran_flt) = (_raw_out(a, w, o, True, True), _raw_out(a, w, o, False, True),
                                            _raw_out(a, w, o, False, True, blas=False))
    assert ran & _GEMM_BF16 and not ran_flt & _GEMM_BF16
    for out, rounded in ((own, False), (mkl, fmt == "mxfp4"), (flt, fmt == "mxfp4")):   # at::mm: a bf16 sum
        assert torch.equal(torch.isnan(out), ~fin)
        assert not ((out - ref).abs() > bound + (ref.abs() * 2.0 ** -8 if rounded else 0))[fin].any()
    assert int((~fin).sum()) == (0 if fp4_bk else counts[3])


_MAPPINGS = []


def _before_an_unreadable_page(t):
    """A copy of the uint8 tensor t whose last byte is the last of a readable page, the next page
    PROT_NONE: a read past t's end is a segfault, not a silent read. The mapping stays for the session
    (_MAPPINGS): a view of the tensor outlives the tensor object."""
    import ctypes
    import mmap
    page = mmap.PAGESIZE
    pages = -(-t.numel() // page) + 1
    m = mmap.mmap(-1, pages * page, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mprotect(ctypes.c_void_p(base + (pages - 1) * page), ctypes.c_size_t(page), 0) == 0   # PROT_NONE
    buf = (ctypes.c_uint8 * t.numel()).from_address(base + (pages - 1) * page - t.numel())
    assert (base + (pages - 1) * page - t.numel()) % 64 == 0   # as aligned as a torch allocation
    out = torch.frombuffer(buf, dtype=torch.uint8).view(t.shape)
    out.copy_(t)
    _MAPPINGS.append((m, buf))
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_weights_ending_at_a_page_end(fmt):
    # the AVX-512 FP4 tiles read a chunk's indices by loads 1 to 3 bytes further (all but the
    # tensor's last chunk): with data ending where an unreadable page starts, the last expert's last
    # row (in a group of 4 rows at one activation row, and a single row) must not read past it
    isas = _isas()
    if not isas:
        pytest.skip(packed.status())
    g = torch.Generator().manual_seed(9)
    w = Q.quantize(torch.randn(2, 9, 256, generator=g), fmt)
    data = _before_an_unreadable_page(w.data.view(torch.uint8)).view(w.data.dtype)
    w2 = Q.QuantizedTensor(data, w.scales, w.global_scale, fmt, w.shape, w.block)
    for counts in ([1, 1], [0, 3]):
        _within_the_bound_on_every_isa(w2, _offsets(counts), 256, g, isas, f"{fmt} counts={counts}")


def test_nvfp4_scale_bytes_nan_negative_subnormal_on_every_path():
    # nvfp4's E4M3 scale bytes at the edges of the code: the NaN codes 0x7F / 0xFF give NaN outputs,
    # a negative scale (0xB8), a subnormal one (0x01) and 0 count as dequantize()'s values, on every path
    isas = _isas()
    if not isas:
        pytest.skip(packed.status())
    g = torch.Generator().manual_seed(10)
    w = Q.quantize(torch.randn(2, 72, 256, generator=g), "nvfp4")
    sc = w.scales.view(torch.uint8).clone()
    sc[0, 3, 2], sc[1, 70, 5] = 0x7F, 0xFF     # NaN blocks
    sc[0, 5, 0], sc[1, 8, 15], sc[1, 9, 1] = 0xB8, 0x01, 0x00
    w2 = Q.QuantizedTensor(w.data, sc.view(w.scales.dtype), w.global_scale, "nvfp4", w.shape, w.block)
    o = _offsets([1, 3])
    a = torch.randn(4, 256, generator=g)
    a[1:, 240:256] *= 2.0 ** 20   # makes the subnormal block count
    ref = packed.grouped_matmul_reference(a, w2, o)
    assert torch.isnan(ref[0, 3]) and torch.isnan(ref[1:, 70]).all() and int(torch.isnan(ref).sum()) == 4
    _nans_and_bound_on_every_isa(a, w2, o, ref, isas)
    if packed._EXT.has_bf16_dot():   # bf16 rows: the dot-product tiles' own scale decode (two chunks at a time)
        a16 = a.bfloat16()
        out, ran = _raw_out(a16, w2, o, True, True)
        ref16 = packed.grouped_matmul_reference(a16.float(), w2, o)
        assert ran == _DOT_BF16 and torch.equal(torch.isnan(out), torch.isnan(ref16))
        assert not ((out - ref16).abs() > _bound(a16, w2, o))[~torch.isnan(ref16)].any()


@pytest.mark.parametrize("fmt,K", [("mxfp4", 1152), ("nvfp4", 1152), ("mxfp8", 1184), ("fp8_block", 1100),
                                   ("fp8_row", 1100)])
def test_long_rows_in_k_slices(fmt, K):
    """float32 rows past DENSE_FROM with K > 1024: the AVX-512 path decodes and multiplies 1024-k
    slices and sums them in the output (the last slice shorter; fp8_block's 1100 ends inside a
    scale block, fp8_row keeps whole rows); every ISA path within the K-term bound."""
    isas = _isas()
    if not isas:
        pytest.skip(packed.status())
    g = torch.Generator().manual_seed(11)
    counts = [packed.DENSE_FROM + 1, 2, 20]
    w = Q.quantize(torch.randn(len(counts), 40, K, generator=g), fmt)
    _within_the_bound_on_every_isa(w, _offsets(counts), K, g, isas, f"{fmt} K={K}")


def _times(w, by: float):
    """w with every weight times ``by`` (a power of two) exactly: through the scales (MXFP4's E8M0
    bytes, FP8's float block scales) or NVFP4's global scale."""
    if w.fmt == "mxfp4":
        b = w.scales.view(torch.uint8).to(torch.int32) + int(torch.tensor(by).log2())
        assert 0 <= int(b.min()) and int(b.max()) <= 252
        return Q.QuantizedTensor(w.data, b.to(torch.uint8).view(w.scales.dtype), None, w.fmt, w.shape, w.block)
    if w.fmt == "nvfp4":
        return Q.QuantizedTensor(w.data, w.scales, w.global_scale * by, w.fmt, w.shape, w.block)
    return Q.QuantizedTensor(w.data, w.scales * by, None, w.fmt, w.shape, w.block)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8_block"])
@pytest.mark.parametrize("tiny", ["activations", "weights"])
def test_bfloat16_rows_where_bf16_arithmetic_would_flush_denormals(fmt, tiny):
    """vdpbf16ps, and the bf16 GEMMs that run on it on an AVX-512 BF16 CPU (oneDNN's at::mm, MKL's),
    read denormal bf16 inputs (below 2^-126) as zero. bf16 rows with a nonzero value below 2^-100
    ("activations": rows of 2^-124 randn, some of them denormal, against weights 2^124 larger), and
    MXFP4 tiles whose scales make denormal bf16 weights ("weights": the reverse), take the float32
    paths: every path (dot-product tiles on or off, MKL or not, every ISA; experts past DENSE_FROM and
    past dot_rows) stays within the K-term bound and one bf16 rounding of the reference, which the
    flushed products miss (by up to 3.5 on outputs of about 10 in "activations")."""
    isas = _isas()
    if not isas:
        pytest.skip(packed.status())
    if tiny == "weights" and fmt != "mxfp4":
        pytest.skip("only E8M0 scales make denormal bf16 weights (E4M3 values and scales are at least 2^-9; "
                    "NVFP4's global and FP8's block scales multiply float32 sums)")
    g = torch.Generator().manual_seed(13)
    K = 256
    bk = 16 if fmt == "nvfp4" else 32
    o = _offsets([packed.DENSE_FROM + 1, packed._EXT.dot_rows(bk) + 3])
    w = Q.quantize(torch.randn(2, 24, K, generator=g), fmt)
    a = torch.randn(int(o[-1]), K, generator=g)
    if tiny == "activations":
        w, a = _times(w, 2.0 ** 124), a * 2.0 ** -124
    else:   # rows of 2^100, not 2^124: the AVX-512 tiles' unscaled block sums would overflow (packed.py's docstring)
        w, a = _times(w, 2.0 ** -124), a * 2.0 ** 100
    a = a.bfloat16()
    if tiny == "activations":
        assert ((a.float().abs() < 2.0 ** -126) & (a != 0)).any()
    else:
        assert ((Q.dequantize(w).abs() < 2.0 ** -126) & (Q.dequantize(w) != 0)).any()
    ref = packed.grouped_matmul_reference(a.float(), w, o)
    assert ref.isfinite().all() and (ref != 0).all()
    slack = _bound(a, w, o) + ref.abs() * 2.0 ** -8
    for isa in isas:
        for dot in (True, False):
            for blas in (True, False):
                y = packed._native(a, w, o, isa, blas=blas, dot_bf16=dot).float()
                bad = (y - ref).abs() > slack
                assert not bad.any(), (isa, dot, blas, float((y - ref).abs().max()))


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8_block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_of_huge_values_against_tiny_scales(fmt, dtype):
    """Rows of 2^124 randn against weights 2^-124 smaller (through MXFP4's E8M0 scales, NVFP4's
    global scale, FP8's block scales): the reference's products are about 1, but a tile that sums a
    block's unscaled products (FP4 values up to 6, E4M3 up to 448), or multiplies NVFP4's global
    scale into the finished sum, passes float32's limit. Such rows (a value of 2^90 or more) run
    scaled by a power of two: every path (register tiles, dot-product tiles, the tile GEMMs, every
    ISA; experts of one row, within dot_rows and past DENSE_FROM) stays within the K-term bound (and
    one bf16 rounding for bf16 rows) and finite; rows of ordinary values in the same call too."""
    isas = _isas()
    if not isas:
        pytest.skip(packed.status())
    g = torch.Generator().manual_seed(14)
    K = 256
    bk = 16 if fmt == "nvfp4" else 32
    o = _offsets([1, packed._EXT.dot_rows(bk) - 1, packed.DENSE_FROM + 2])
    w = _times(Q.quantize(torch.randn(3, 24, K, generator=g), fmt), 2.0 ** -124)
    a = torch.randn(int(o[-1]), K, generator=g) * 2.0 ** 124
    a[1::3] *= 2.0 ** -124   # ordinary rows beside them
    a = a.to(dtype)
    ref = packed.grouped_matmul_reference(a.float(), w, o)
    assert ref.isfinite().all() and (ref[::3].abs() > 2.0 ** -10).any()
    slack = _bound(a, w, o) + (ref.abs() * 2.0 ** -8 if dtype == torch.bfloat16 else 0)
    for isa in isas:
        for dot in (True, False):
            y = packed._native(a, w, o, isa, dot_bf16=dot).float()
            assert y.isfinite().all(), (isa, dot)
            assert not ((y - ref).abs() > slack).any(), (isa, dot, float((y - ref).abs().max()))


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8_block"])
@pytest.mark.parametrize("activations", ["float", "int8"])
def test_rows_past_2_to_the_90_give_the_bits_of_rows_2_to_the_100_smaller(fmt, activations):
    """Rows with a value of 2^90 or more run scaled by 2^-40 inside the kernel and their outputs are
    scaled back. Rows times 2^100 against in-projection weights times 2^-100 (every factor a power
    of two, every value and product far from float32's limits) are then the same arithmetic as the
    rows against the weights: the grouped GEMM and the fused stage (whose two GEMMs run it) give the
    same bits, on every ISA path and with int8 activations (the same int8 codes, block scales 2^100
    apart); a mutation that scales the wrong rows back, or not at all, fails here."""
    isas = _isas()
    if not isas:
        pytest.skip(packed.status())
    if activations == "int8" and (fmt == "fp8_block" or not packed.has_int8_path()):
        pytest.skip("int8 activations: FP4 weights on an AVX-512 VNNI CPU")
    g = torch.Generator().manual_seed(15)
    M, H = 128, 128
    o = _offsets([1, 0, 3, 2])   # the register tiles (at most DENSE_FROM rows an expert)
    N = int(o[-1])
    w_in = Q.quantize(torch.randn(4, 2 * H, M, generator=g), fmt)
    w_out = Q.quantize(torch.randn(4, M, H, generator=g), fmt)
    w_small = _times(w_in, 2.0 ** -100)
    a = torch.randn(N, M, generator=g)
    a[1:] *= 2.0 ** 100   # row 0 stays ordinary beside them
    x = torch.randn(5, M, generator=g) * 2.0 ** 100
    tokens, gates = torch.randint(5, (N,), generator=g), torch.rand(N, generator=g)
    for isa in isas if activations == "float" else ["auto"]:
        kw = dict(isa=isa, activations=activations)
        ref = packed.grouped_matmul(a[1:] * 2.0 ** -100, w_in, o - torch.clamp(o, max=1), **kw)
        big = packed.grouped_matmul(a, w_small, o, **kw)
        assert torch.equal(big[1:], ref), isa
        o_first = torch.tensor([0, 1, 1, 1, 1])
        assert torch.equal(big[:1], packed.grouped_matmul(a[:1], w_in, o_first, **kw) * 2.0 ** -100), isa
        y = packed.expert_stage(x * 2.0 ** -100, tokens, o, gates, (w_in,), w_out, act="glu", **kw)
        y_big = packed.expert_stage(x, tokens, o, gates, (w_small,), w_out, act="glu", **kw)
        assert torch.equal(y_big, y), isa


def test_bfloat16_rows_mxfp4_scales_at_the_exponent_add_edges():
    """bf16 rows of mxfp4 experts past DENSE_FROM: rows whose E8M0 scales all lie in [2, 252] are
    decoded to bf16 by an exponent add, the others (a byte 0, 1, 253 or 255) through floats; both
    equal the reference within the K-term bound and one bf16 rounding, NaN where it has NaN."""
    isas = _isas()
    if not isas:
        pytest.skip(packed.status())
    g = torch.Generator().manual_seed(12)
    K = 256
    w = Q.quantize(torch.randn(2, 12, K, generator=g), "mxfp4")
    sc = w.scales.view(torch.uint8).clone()
    sc[0, 0, 4] = 2          # the exponent add's smallest scale
    sc[0, 1, 3] = 252        # its largest (blocks 2 and 3: the activations are scaled down below)
    sc[0, 2, 1] = 1          # out of the add's range: the float decode
    sc[0, 3, 2] = 253        # 6 * 2^126 overflows: infinite weights (NaN or inf sums, as the reference's)
    sc[1, 4, 5] = 0
    sc[1, 5, 6] = 255        # NaN
    w2 = Q.QuantizedTensor(w.data, sc.view(w.scales.dtype), None, "mxfp4", w.shape, w.block)
    o = _offsets([packed.DENSE_FROM + 1, packed.DENSE_FROM + 3])
    a = torch.randn(int(o[-1]), K, generator=g)
    a[:, 64:128] *= 2.0 ** -120   # keeps the 2^125 and 2^126 blocks' products finite
    a = a.bfloat16()
    ref = packed.grouped_matmul_reference(a.float(), w2, o)
    assert torch.isnan(ref[o[1]:, 5]).all() and ref[:, [0, 1, 2, 4]].isfinite().all()
    fin = ~torch.isnan(ref)
    slack = _bound(a, w2, o) + ref.abs() * 2.0 ** -8
    for isa in isas:
        # the decoded tile's path (with AVX-512 BF16 these rows would take the dot-product tiles)
        y = packed._native(a, w2, o, isa, dot_bf16=False).float()
        assert torch.equal(torch.isnan(y), torch.isnan(ref)), isa
        assert not ((y - ref).abs() > slack)[fin].any(), isa
