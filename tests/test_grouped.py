"""Grouped expert GEMMs on filled rows (fmoe.ops.grouped: the padded layout's seam)."""
import pytest
import torch

from fmoe.experts import ExpertSpec, ffn, gated_ffn, init_experts
from fmoe.layout import Layout
from fmoe.ops.grouped import GroupedGemm, filled_rows, grouped_mm, grouped_wgrad

ROWS = [64, 10, 0, 33, 1, 5, 12, 4]  # full, small (MKL's odd small-M kernel), empty
SPARSE = [0, 10, 0, 0, 1, 0, 0, 64]  # few busy experts: the per-expert path


def _seam(rows, C):
    """The padded layout's seam with ``rows`` filled rows per expert buffer of C rows."""
    E = rows.shape[0]
    lay = Layout(torch.empty(0, 0, dtype=torch.int64), torch.arange(E) * C, rows, "padded", E * C, E, C)
    return GroupedGemm(lay)


def _buffers(E=8, C=64, M=48, seed=0, rows=ROWS):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(E, C, M, generator=g)
    mask = torch.zeros(E, C, 1)
    for e, n in enumerate(rows[:E]):
        x[e, n:] = 0  # dispatch leaves empty rows zero
        mask[e, :n] = 1
    return g, x, mask, torch.tensor(rows[:E])


@pytest.mark.parametrize("typ,fn", [("ffn", ffn), ("gated_ffn", gated_ffn)])
@pytest.mark.parametrize("row_counts", [ROWS, SPARSE])
def test_filled_rows_equal_padded_forward_and_grad(typ, fn, row_counts):
    g, x, mask, rows = _buffers(rows=row_counts)
    p = init_experts(ExpertSpec(type=typ, hidden_size=80), 8, 48, generator=g)
    y_pad, y_grp = fn(p, x), fn(p, x, _seam(rows, x.shape[1]))
    # Every row that combine reads is bit-identical to the padded computation.
    assert torch.equal(y_pad * mask, y_grp * mask)

    def loss(p, x, rows=None):  # only combined rows reach the loss, as in moe()
        return (fn(p, x, None if rows is None else _seam(rows, x.shape[1])) * mask).square().sum()

    gp_pad, gx_pad = torch.func.grad(loss, argnums=(0, 1))(p, x)
    gp_grp, gx_grp = torch.func.grad(loss, argnums=(0, 1))(p, x, rows)
    assert torch.equal(gx_pad * mask, gx_grp * mask)
    # Weight gradients sum fewer zero rows: equal up to the GEMM's summation order.
    torch.testing.assert_close(gp_grp, gp_pad, rtol=1e-5, atol=1e-6)


def test_vmap_falls_back_to_padded():
    g, x, mask, rows = _buffers()
    p = init_experts(ExpertSpec(type="ffn", hidden_size=16), 8, 48, generator=g)
    xs = torch.stack([x, 2 * x])
    ys = torch.func.vmap(lambda xx: ffn(p, xx, _seam(rows, x.shape[1])))(xs)
    assert torch.equal(ys[1], ffn(p, 2 * x))


def test_double_backward_and_transposed():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 6, 4, dtype=torch.float64, generator=g, requires_grad=True)
    rows = torch.tensor([6, 2, 0])
    for transposed, shape in ((False, (3, 4, 5)), (True, (3, 5, 4))):
        w = torch.randn(*shape, dtype=torch.float64, generator=g, requires_grad=True)
        f = lambda x, w: grouped_mm(x, w, rows, transposed=transposed)  # noqa: E731
        assert torch.autograd.gradcheck(f, (x, w))
        assert torch.autograd.gradgradcheck(f, (x, w))
    b = torch.randn(3, 6, 2, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: grouped_wgrad(a, b, rows), (x, b))
    y = grouped_mm(x, torch.randn(3, 4, 5, dtype=torch.float64), rows)
    assert torch.all(y[1, 2:] == 0) and torch.all(y[2] == 0)


def test_filled_rows_and_bad_rows():
    assert filled_rows(torch.tensor([0, 3, 9]), 4).tolist() == [0, 3, 4]
    with pytest.raises(ValueError):
        grouped_mm(torch.randn(2, 3, 4), torch.randn(2, 4, 5), torch.tensor([1, 2, 3]))


def test_jvp_and_jacrev_match_padded():
    g = torch.Generator().manual_seed(2)
    E, C, K, N = 3, 5, 4, 6
    x = torch.randn(E, C, K, dtype=torch.float64, generator=g)
    rows = torch.tensor([5, 2, 0])
    x = x * (torch.arange(C) < rows.unsqueeze(-1)).unsqueeze(-1)
    w = torch.randn(E, N, K, dtype=torch.float64, generator=g)
    mask = (torch.arange(C) < rows.unsqueeze(-1)).unsqueeze(-1).double()

    def grp(x, w):
        return grouped_mm(x, w, rows, transposed=True) * mask

    def pad(x, w):
        return torch.bmm(x, w.transpose(1, 2)) * mask

    tx, tw = torch.randn_like(x), torch.randn_like(w)
    _, jg = torch.func.jvp(grp, (x, w), (tx, tw))
    _, jp = torch.func.jvp(pad, (x, w), (tx, tw))
    torch.testing.assert_close(jg, jp)
    # jacrev vmaps the backward over cotangents: the padded fallback inside the backward.
    for argnum in (0, 1):
        torch.testing.assert_close(torch.func.jacrev(grp, argnums=argnum)(x, w),
                                   torch.func.jacrev(pad, argnums=argnum)(x, w))


@pytest.mark.parametrize("matvec_bytes", [0, 1 << 30], ids=["blas_gemv", "numba_matvec"])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("row_counts", [ROWS, SPARSE, [0, 1, 2, 0, 4, 0, 0, 3]])
def test_exact_rows_close_to_padded(transposed, row_counts, matvec_bytes, monkeypatch):
    # exact=True multiplies exactly n_e rows (GEMVs for <= 4 rows: torch.mv, or one numba call
    # when the busy weights are small): equal to the padded GEMM within float rounding on
    # filled rows, exactly 0 elsewhere; grads agree to rounding.
    from fmoe.ops import tuning
    monkeypatch.setattr(tuning, "MATVEC_BYTES", matvec_bytes)  # 0: never numba
    g, x, mask, rows = _buffers(rows=row_counts)
    w = torch.randn(8, 80, 48, generator=g) if transposed else torch.randn(8, 48, 80, generator=g)
    pad = torch.bmm(x, w.transpose(1, 2) if transposed else w) * mask
    got = grouped_mm(x, w, rows, transposed=transposed, exact=True)
    torch.testing.assert_close(got, pad, rtol=1e-5, atol=1e-5)
    assert torch.all(got[(mask == 0).expand_as(got)] == 0)

    def loss(x, w, exact):
        return (grouped_mm(x, w, rows, transposed=transposed, exact=exact) * mask).square().sum()

    ge = torch.func.grad(loss, argnums=(0, 1))(x, w, True)
    gp = torch.func.grad(loss, argnums=(0, 1))(x, w, False)
    torch.testing.assert_close(ge, gp, rtol=1e-4, atol=1e-4)



@pytest.mark.parametrize("stored_transposed", [False, True])
def test_exact_rows_numba_reads_transposed_views_as_their_storage(stored_transposed):
    # fmoe.nn.MoELayer's x @ W views of out x in storage: the serial numba matvec reads the
    # storage in its own order (bit for bit the storage passed directly), no fallback to BLAS.
    from fmoe.ops import numba_cpu
    g, x, mask, rows = _buffers(rows=[0, 1, 2, 0, 4, 0, 0, 3])
    storage = torch.randn(8, 48, 80, generator=g) if stored_transposed else torch.randn(8, 80, 48, generator=g)
    view = storage.transpose(1, 2)
    got = numba_cpu.rows_matvec(x, view, rows.tolist(), stored_transposed)
    assert got is not None
    assert torch.equal(got, numba_cpu.rows_matvec(x, storage, rows.tolist(), not stored_transposed))
    pad = torch.bmm(x, view.transpose(1, 2) if stored_transposed else view) * mask
    torch.testing.assert_close(got, pad, rtol=1e-5, atol=1e-5)



def test_storage_order_bmm_is_bmm_with_the_weight_gradient_in_the_storages_order():
    # GroupedGemm's full-buffer bmm for x @ W weights that are transposed views of contiguous
    # storage (fmoe.nn.MoELayer's): bmm's forward and data gradient, the weight gradient in the
    # storage's strides (what AccumulateGrad keeps without a copy), differentiable twice.
    from fmoe.ops.grouped import _StorageOrderBmm
    g = torch.Generator().manual_seed(9)
    E, C, K, N = 3, 5, 4, 6
    storage = torch.randn(E, N, K, generator=g, dtype=torch.float64, requires_grad=True)
    x = torch.randn(E, C, K, generator=g, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(E, C, N, generator=g, dtype=torch.float64)
    arrived = []
    hook = storage.register_hook(lambda gr: arrived.append(gr.stride()))
    y = _StorageOrderBmm.apply(x, storage.transpose(1, 2))
    ref = torch.bmm(x, storage.transpose(1, 2))
    assert torch.equal(y, ref)
    gx, gs = torch.autograd.grad(y, (x, storage), dy)
    rx, rs = torch.autograd.grad(ref, (x, storage), dy)
    hook.remove()
    assert torch.equal(gx, rx)
    torch.testing.assert_close(gs, rs, rtol=1e-12, atol=1e-12)
    # this op's gradient has the storage's strides; plain bmm's would be copied into them
    assert arrived[0] == storage.stride() != arrived[1]
    f = lambda a, s: _StorageOrderBmm.apply(a, s.transpose(1, 2))  # noqa: E731
    assert torch.autograd.gradcheck(f, (x, storage))
    assert torch.autograd.gradgradcheck(f, (x, storage))

def test_exact_rows_gradcheck_and_jvp():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 6, 4, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(3, 5, 4, dtype=torch.float64, generator=g, requires_grad=True)
    rows = torch.tensor([1, 3, 0])
    f = lambda x, w: grouped_mm(x, w, rows, transposed=True, exact=True)  # noqa: E731
    assert torch.autograd.gradcheck(f, (x, w))
    assert torch.autograd.gradgradcheck(f, (x, w))
    tx, tw = torch.randn_like(x), torch.randn_like(w)
    _, je = torch.func.jvp(f, (x.detach(), w.detach()), (tx, tw))
    _, jp = torch.func.jvp(lambda x, w: grouped_mm(x, w, rows, transposed=True), (x.detach(), w.detach()), (tx, tw))
    torch.testing.assert_close(je, jp)


@pytest.mark.parametrize("typ", ["ffn", "gated_ffn"])
def test_moe_exact_rows_option_close_to_default(typ):
    # ExpertSpec(exact_rows=True) is an explicit speed option: moe() equals the default
    # (bit-exact padded order) within float rounding, with gradients, and under vmap.
    import dataclasses
    import fmoe
    spec = fmoe.MoESpec(model_dim=32, num_experts=16, gate=fmoe.GateSpec(k=4, capacity_factor=0.0),
                        experts=fmoe.ExpertSpec(type=typ, hidden_size=24))
    fast = dataclasses.replace(spec, experts=dataclasses.replace(spec.experts, exact_rows=True))
    params = fmoe.init_params(spec, generator=torch.Generator().manual_seed(0))
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(1))
    y0, _ = fmoe.moe(params, x, spec)
    y1, _ = fmoe.moe(params, x, fast)
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-6)
    loss = lambda p, s: fmoe.moe(p, x, s)[0].square().sum()  # noqa: E731
    g0 = torch.func.grad(loss)(params, spec)
    g1 = torch.func.grad(loss)(params, fast)
    torch.testing.assert_close(g1, g0, rtol=1e-4, atol=1e-6)
