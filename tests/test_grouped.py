"""The expert-GEMM seam (fmoe.engine.GroupedGemm) over both layouts: the layout kernels."""
import dataclasses

import pytest
import torch

from fmoe.experts import ExpertSpec, ffn, gated_ffn, init_experts
from fmoe.layout import Layout
from fmoe.engine import GroupedGemm
from fmoe.ops.ragged import ragged_mm_reference, ragged_wgrad_reference

ROWS = [64, 10, 0, 33, 1, 5, 12, 4]  # full, small, empty
SPARSE = [0, 10, 0, 0, 1, 0, 0, 64]  # few busy experts


def _padded(rows, C):
    E = len(rows)
    sizes = torch.tensor(rows)
    return GroupedGemm.over(Layout(torch.empty(0, 0, dtype=torch.int64), torch.arange(E) * C, sizes, "padded", E * C, E, C))


def _ragged(rows, pad=3):
    sizes = torch.tensor(rows)
    starts = torch.cumsum(sizes, 0) - sizes
    R = int(sizes.sum()) + pad
    return GroupedGemm.over(Layout(torch.empty(0, 0, dtype=torch.int64), starts, sizes, "ragged", R, len(rows), max(rows)))


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
def test_padded_seam_is_the_full_buffer_bmm(typ, fn, row_counts):
    # The padded seam multiplies every row (Tutel's arithmetic): bit for bit the expert function
    # without a seam, forward and gradients.
    g, x, mask, rows = _buffers(rows=row_counts)
    p = init_experts(ExpertSpec(type=typ, hidden_size=80), 8, 48, generator=g)
    seam = _padded(row_counts, x.shape[1])
    assert torch.equal(fn(p, x), fn(p, x, seam))

    def loss(p, x, gemm=None):  # only combined rows reach the loss, as in moe()
        return (fn(p, x, gemm) * mask).square().sum()

    g_pad = torch.func.grad(loss, argnums=(0, 1))(p, x)
    g_seam = torch.func.grad(loss, argnums=(0, 1))(p, x, seam)
    torch.testing.assert_close(g_seam, g_pad, rtol=0, atol=0)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("row_counts", [ROWS, SPARSE])
def test_ragged_seam_equals_the_per_expert_reference(transposed, row_counts):
    # The ragged seam's kernel (one native grouped-GEMM call, serial regime) is the reference's
    # torch.mm per expert: bit for bit, padding rows 0; the weight gradient too.
    seam = _ragged(row_counts)
    g = torch.Generator().manual_seed(4)
    R = seam.layout.num_rows
    x = torch.randn(R, 48, generator=g)
    w = torch.randn(8, 80, 48, generator=g) if transposed else torch.randn(8, 48, 80, generator=g)
    offsets = seam.layout.offsets
    y = seam.mm(x, w, transposed=transposed)
    assert torch.equal(y, ragged_mm_reference(x, w, offsets, transposed=transposed))
    assert torch.all(y[int(offsets[-1]):] == 0)
    b = torch.randn(R, 24, generator=g)
    assert torch.equal(seam.wgrad(x, b), ragged_wgrad_reference(x, b, offsets))


def test_padded_seam_under_vmap():
    # vmap batches the seam's bmm into other GEMM shapes than the unbatched call, and a BLAS may
    # split their K sums otherwise (host-dependent), so: within the forward-error bound of the two
    # GEMMs through relu (1-Lipschitz), |d| <= (K1 + K2 + 2) eps (|x| |W1^T| + |b1|) |W2| + |b2|,
    # which a wrong expert's weights exceed.
    g, x, mask, rows = _buffers()
    p = init_experts(ExpertSpec(type="ffn", hidden_size=16), 8, 48, generator=g)
    xs = torch.stack([x, 2 * x])
    ys = torch.func.vmap(lambda xx: ffn(p, xx, _padded(ROWS, x.shape[1])))(xs)
    a = {k: v.double().abs() for k, v in p.items()}
    mag = torch.bmm(torch.bmm(2 * x.double().abs(), a["fc1_w"].transpose(1, 2)) + a["fc1_b"][:, None], a["fc2_w"])
    tol = (48 + 16 + 2) * torch.finfo(x.dtype).eps * (mag + a["fc2_b"][:, None])
    want = ffn(p, 2 * x)
    assert bool(((ys[1].double() - want.double()).abs() <= tol).all())
    swapped = dict(p, fc2_w=p["fc2_w"].roll(1, 0))
    assert not bool(((ffn(swapped, 2 * x).double() - want.double()).abs() <= tol).all())


def test_ragged_bias_rows_and_membership():
    # Ragged rows get their expert's bias; rows past the last group get 0.
    from fmoe.ops.grouped import layout_bias
    seam = _ragged([2, 0, 3], pad=2)
    b = torch.arange(3 * 4, dtype=torch.float32).reshape(3, 4)
    want = torch.cat([b[0].expand(2, 4), b[2].expand(3, 4), torch.zeros(2, 4)])
    assert torch.equal(layout_bias(b, torch.empty(seam.layout.num_rows, 4), seam.layout), want)
    # through the seam: zero rows times any weight, plus the bias
    x = torch.zeros(seam.layout.num_rows, 5)
    assert torch.equal(seam.mm(x, torch.randn(3, 4, 5), transposed=True, bias=b), want)


def test_storage_order_bmm_is_bmm_with_the_weight_gradient_in_the_storages_order():
    # The padded layout kernel's full-buffer bmm for x @ W weights that are transposed views of contiguous
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


def _rows_plan(row_counts, T=20, seed=3):
    # a rows plan whose rows gather tokens at random (sorted by expert, as make_plan sorts them)
    from fmoe.engine.plan import plan_from_bounds
    g = torch.Generator().manual_seed(seed)
    bounds = [0]
    for n in row_counts:
        bounds.append(bounds[-1] + n)
    tokens = torch.randint(0, T, (bounds[-1],), generator=g)
    return plan_from_bounds(tokens, torch.arange(bounds[-1]), bounds, T, needs_grad=True, dtype=torch.float64)


@pytest.mark.parametrize("transposed", [False, True])
def test_rows_plan_seam_is_the_per_expert_product_with_its_gradients(transposed):
    # The same seam on a rows plan: x's rows gathered through `rows`, the bias per row's expert,
    # differentiable in x, w and the bias; fp64 products within rounding of torch.mm's
    from fmoe.engine import GroupedGemm, select
    plan = _rows_plan([5, 0, 3, 9, 1])
    seam = GroupedGemm(plan, select(plan))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(plan.num_tokens, 12, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn((5, 7, 12) if transposed else (5, 12, 7), dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(5, 7, dtype=torch.float64, generator=g, requires_grad=True)
    y = seam.mm(x, w, transposed=transposed, bias=b, rows=plan.tokens)
    bnd = plan.bounds
    want = torch.cat([x[plan.tokens[bnd[e]:bnd[e + 1]]] @ (w[e].T if transposed else w[e]) + b[e]
                      for e in range(5)])
    torch.testing.assert_close(y, want, rtol=1e-13, atol=1e-13)
    gy = torch.randn_like(y)
    got, ref = torch.autograd.grad(y, (x, w, b), gy), torch.autograd.grad(want, (x, w, b), gy)
    for a, r in zip(got, ref):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="a rows plan has no layout"):
        seam.layout


def test_packed_weights_take_the_tables_packed_kernel():
    # Packed weights are a table entry too: on a rows plan the seam hands them to it, and it
    # equals the dequantize-and-multiply reference within the FP32 reorder of the K-term sums
    from fmoe.engine import GroupedGemm, select
    from fmoe.quant import dequantize, quantize
    from fmoe.quant.packed import grouped_matmul_reference
    plan = _rows_plan([2, 0, 4, 1], T=6)
    plan = dataclasses.replace(plan, dtype=torch.float32)
    kern = select(plan, packed=True)
    assert kern.name == "cpu-packed" and kern.wgrad is None and kern.scatter is None
    g = torch.Generator().manual_seed(6)
    w = quantize(torch.randn(4, 16, 64, generator=g), "mxfp4")
    x = torch.randn(plan.num_tokens, 64, generator=g)
    seam = GroupedGemm(plan, select(plan))
    y = seam.mm(x, w, rows=plan.tokens)
    want = grouped_matmul_reference(x[plan.tokens], w, plan.offsets)
    bound = 64 * torch.finfo(torch.float32).eps * (x.abs()[plan.tokens] @ dequantize(w).abs().amax(0).T)
    assert bool(((y - want).abs() <= bound).all())
    with pytest.raises(TypeError, match="takes no weight gradient"):
        GroupedGemm(plan, kern).wgrad(x, x)


def test_a_layout_seam_refuses_gathered_rows():
    seam = _ragged([2, 3])
    with pytest.raises(ValueError, match="multiplies its buffer as it is"):
        seam.mm(torch.zeros(seam.layout.num_rows, 4), torch.zeros(2, 4, 4), rows=torch.zeros(5, dtype=torch.int64))
