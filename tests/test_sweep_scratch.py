"""The vmapped sweep's fold writes every block's GEMMs into one scratch buffer (the kernels' ``out=``)
and runs them experts side by side (``regime=``): the kernels' outputs there are the bits of a
fresh output, and the fold's outputs stay each setting's own eager call's."""
from __future__ import annotations

import pytest
import torch

import fmoe
from fmoe.engine import traced
from fmoe.engine.plan import plan_from_bounds
from fmoe.engine import table
from fmoe.engine.table import kernel_for

M, H, E = 24, 20, 5


def _kernels():
    """The CPU entry and, where that is the native kernel, its per-expert torch.mm twin ('cpu-torch')."""
    ks = [kernel_for("cpu", "prefill", torch.float32)]
    if ks[0].name == "cpu-native":
        ks.append(table.Kernel("cpu-torch", "reference", *table._native_kernel("reference"), writes_out=True))
    return ks


def _k_term_bound(x, w, tokens, bounds, transposed, bias):
    """Per element, twice the forward-error bound of a K-term dot product plus the bias's rounding:
    2 K eps (|x_r| @ |op(w_e)| + |b_e|), in float64. Two computations of one product in different
    orders of summation differ by at most this."""
    eps, K = torch.finfo(x.dtype).eps, x.shape[1]
    out = []
    for e in range(len(bounds) - 1):
        we = (w[e].t() if transposed else w[e]).double().abs()
        b = bias[e].double().abs() if bias is not None else 0.0
        out.append(2 * K * eps * (x[tokens[bounds[e]:bounds[e + 1]]].double().abs() @ we + b))
    return torch.cat(out).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("transposed", [False, True])
def test_mm_into_a_reused_buffer_equals_a_fresh_output(dtype, transposed):
    """mm(..., out=) returns out holding the bits of a fresh output of the same regime, at an
    aligned and an unaligned offset of a larger buffer; rows the call does not own stay as they
    were. Across regimes the products agree within the K-term bound (grouped_gemm.cpp: the
    parallel regime calls BLAS on one thread where the serial one calls at::mm on all, so bits
    across regimes hold only where those are the same kernel)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, M, generator=g, dtype=dtype)
    w = torch.randn(E, H, M, generator=g, dtype=dtype) if transposed else torch.randn(E, M, H, generator=g,
                                                                                       dtype=dtype)
    bias = torch.randn(E, H, generator=g, dtype=dtype)
    bounds = [0, 7, 7, 19, 30, 33]   # an idle expert
    tokens = torch.randint(0, 40, (33,), generator=g)
    plan = plan_from_bounds(tokens, torch.arange(33), bounds, 40, needs_grad=False, dtype=dtype)
    for kern in _kernels():
        assert kern.writes_out
        ref = kern.mm(x, w, plan, rows=tokens, transposed=transposed, bias=bias)
        bound = _k_term_bound(x, w, tokens, bounds, transposed, bias)
        for regime in (None, "serial", "parallel", "auto"):
            fresh = kern.mm(x, w, plan, rows=tokens, transposed=transposed, bias=bias, regime=regime)
            assert ((fresh - ref).abs() <= bound).all(), (kern.name, regime)
            for start in (0, 3):   # 3 elements: an output not on a 64-byte boundary
                buf = torch.full((start + 33 * H + 5,), 7.0, dtype=dtype)
                out = buf[start:start + 33 * H].view(33, H)
                got = kern.mm(x, w, plan, rows=tokens, transposed=transposed, bias=bias, out=out, regime=regime)
                assert got.data_ptr() == out.data_ptr() and torch.equal(got, fresh), (kern.name, start, regime)
                assert (buf[:start] == 7).all() and (buf[start + 33 * H:] == 7).all()


def test_mm_into_refuses_a_wrong_out_or_regime():
    kern = kernel_for("cpu", "prefill", torch.float32)
    x, w = torch.randn(6, M), torch.randn(E, M, H)
    plan = plan_from_bounds(torch.arange(6), torch.arange(6), [0, 2, 2, 4, 6, 6], 6, needs_grad=False,
                            dtype=torch.float32)
    with pytest.raises(ValueError, match=r"out must be \[6, 20\]"):
        kern.mm(x, w, plan, rows=None, transposed=False, out=torch.empty(5, H))
    with pytest.raises(ValueError, match="out must be contiguous"):
        kern.mm(x, w, plan, rows=None, transposed=False, out=torch.empty(H, 6).t())
    with pytest.raises(TypeError, match="out has dtype torch.float64"):
        kern.mm(x, w, plan, rows=None, transposed=False, out=torch.empty(6, H, dtype=torch.float64))
    with pytest.raises(ValueError, match="regime must be 'auto', 'serial' or 'parallel', got 'fast'"):
        kern.mm(x, w, plan, rows=None, transposed=False, out=torch.empty(6, H), regime="fast")


@pytest.mark.parametrize("threads", [1, 2])
def test_fp32_sweep_in_blocks_through_the_scratch_equals_each_call(monkeypatch, threads):
    """fp32 (the GEMMs' own kernels, not float64's): a sweep folded into several blocks through
    one scratch, at one thread (serial regime) and two (experts side by side), equals each
    setting's eager call within fp32 rounding of its terms, and its blocks share one buffer."""
    made = []
    real = traced._BlockScratch.__init__

    def init(self, *a, **k):
        made.append(1)
        real(self, *a, **k)
    monkeypatch.setattr(traced._BlockScratch, "__init__", init)
    monkeypatch.setattr(traced, "_BLOCK_BYTES", 2048)   # several blocks
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        spec = fmoe.MoESpec(model_dim=M, num_experts=E, gate=fmoe.GateSpec(k=2, capacity_factor=1.0),
                            experts=fmoe.ExpertSpec(type="ffn", hidden_size=H, has_fc1_bias=True,
                                                    has_fc2_bias=True))
        p = fmoe.init_params(spec, generator=torch.Generator().manual_seed(0))
        x = torch.randn(64, M, generator=torch.Generator().manual_seed(1))
        wgs = torch.randn(4, E, M, generator=torch.Generator().manual_seed(2))
        one = lambda wg: fmoe.moe({"gate": {"wg": wg}, "experts": p["experts"]}, x, spec)[0]  # noqa: E731
        with torch.no_grad():
            ys = torch.func.vmap(one)(wgs)
            for i, wg in enumerate(wgs):
                torch.testing.assert_close(ys[i], one(wg), rtol=0, atol=1e-6)
    finally:
        torch.set_num_threads(before)
    assert made == [1]   # one scratch for the call's blocks
