"""fmoe::ragged_mm / fmoe::ragged_wgrad: values vs the pure-torch reference, derivatives,
transforms, torch.compile, and bad input."""
import itertools
import re

import pytest
import torch
from torch.func import grad, jacrev, jvp, vjp, vmap
from torch.utils._python_dispatch import TorchDispatchMode

from fmoe.ops import _ragged_kernels as RK
from fmoe.ops import ragged as RG
from fmoe.ops import numba_cpu, tuning
from fmoe.ops.ragged import ragged_mm, ragged_mm_reference, ragged_wgrad, ragged_wgrad_reference


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def counts_to_offsets(counts):
    return torch.tensor([0] + list(counts), dtype=torch.int64).cumsum(0)


def weights(E, K, N, transposed, dtype=torch.float32, g=None):
    shape = (E, N, K) if transposed else (E, K, N)
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype)


# Every group is one at::mm inside the native grouped GEMM (serial regime), the reference's
# own call: bit-identical at every group size.
S = 16
BIG = [S + 3, 0, S + 8, S + 1, 0, S + 5]  # idle experts in the middle, one at the end


# --------------------------------------------------------------------------- forward values

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("transposed", [False, True])
def test_mm_bit_exact_vs_reference_with_padding(dtype, transposed):
    g = gen(1)
    off = counts_to_offsets(BIG)
    R, K, N = int(off[-1]) + 5, 24, 20  # 5 padding rows
    x = torch.randn(R, K, generator=g).to(dtype)
    x[int(off[-1]):] = float("nan")  # padding rows must never be read
    w = weights(len(BIG), K, N, transposed, dtype, g)
    y = ragged_mm(x, w, off, transposed=transposed)
    ref = ragged_mm_reference(x, w, off, transposed=transposed)
    assert y.dtype == dtype and y.shape == (R, N)
    assert torch.equal(y, ref)
    assert torch.equal(y[int(off[-1]):], torch.zeros(5, N, dtype=dtype))
    # And the reference is what it says: one matmul per expert.
    e = 2
    lo, hi = int(off[e]), int(off[e + 1])
    op = w[e].t() if transposed else w[e]
    torch.testing.assert_close(y[lo:hi].double(), x[lo:hi].double() @ op.double(),
                               rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-1 if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("K,N", [(24, 20), (64, 1100)])
def test_mm_small_groups_bit_exact_vs_reference(dtype, transposed, K, N):
    g = gen(2)
    counts = [1, 0, 2, 3, 4, 7, S + 1, 0, 1]   # decode-sized groups and one larger
    off = counts_to_offsets(counts)
    R = int(off[-1]) + 3
    x = torch.randn(R, K, generator=g, dtype=dtype)
    x[int(off[-1]):] = float("nan")
    w = weights(len(counts), K, N, transposed, dtype, g)
    w[1] = float("nan")  # idle experts' weights are never read
    w[7] = float("nan")
    y = ragged_mm(x, w, off, transposed=transposed)
    assert torch.equal(y, ragged_mm_reference(x, w, off, transposed=transposed))
    assert torch.equal(y[int(off[-1]):], torch.zeros(3, N, dtype=dtype))


def test_mm_idle_expert_weights_never_read_on_blas_path():
    g = gen(3)
    off = counts_to_offsets(BIG)
    x = torch.randn(int(off[-1]), 8, generator=g, dtype=torch.float64)
    w = torch.randn(len(BIG), 8, 5, generator=g, dtype=torch.float64)
    w[1] = w[4] = float("nan")
    assert torch.isfinite(ragged_mm(x, w, off)).all()


@pytest.mark.parametrize("counts,R", [([], 4), ([0, 0, 0], 6), ([0, 0, 0], 0), ([13], 13), ([6], 10), ([2], 2)])
def test_mm_edge_layouts(counts, R):
    """No experts, all experts idle (all padding), zero rows, E = 1 with and without padding."""
    g = gen(4)
    off = counts_to_offsets(counts)
    x = torch.randn(R, 6, generator=g)
    w = torch.randn(len(counts), 6, 3, generator=g)
    y = ragged_mm(x, w, off)
    assert y.shape == (R, 3)
    assert torch.equal(y, ragged_mm_reference(x, w, off))
    z = ragged_wgrad(x, torch.randn(R, 4, generator=g), off)
    assert z.shape == (len(counts), 6, 4)
    for e, c in enumerate(counts):
        if c == 0:
            assert torch.equal(z[e], torch.zeros(6, 4))


@pytest.mark.parametrize("rows", [3, S + 3])
def test_views_of_larger_buffers_are_read_only_inside_their_rows(rows):
    g = gen(17)
    E, K, N = 3, 8, 5
    big = torch.full((3 * rows + 4, K), float("nan"))
    big[:3 * rows] = torch.randn(3 * rows, K, generator=g)
    x = big[:3 * rows]  # R = offsets[E]: the last group ends at the view's last row
    off = counts_to_offsets([rows] * E)
    wbig = torch.full((E + 2, K, N), float("nan"))
    wbig[1:E + 1] = torch.randn(E, K, N, generator=g)
    w = wbig[1:E + 1]  # weights a view in the middle of a larger buffer
    y = ragged_mm(x, w, off)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y, ragged_mm_reference(x, w, off))
    assert torch.isfinite(ragged_wgrad(x, x, off)).all()
    with pytest.raises(ValueError, match=re.escape(f"offsets[E] = {3 * rows + 1} exceeds the {3 * rows} rows")):
        ragged_mm(x, w, counts_to_offsets([rows, rows, rows + 1]))


def test_mm_non_contiguous_inputs():
    g = gen(5)
    off_full = torch.stack([counts_to_offsets(BIG), torch.zeros(len(BIG) + 1, dtype=torch.int64)], 1)
    off = off_full[:, 0]  # strided offsets
    assert not off.is_contiguous()
    R = int(off[-1]) + 2
    x = torch.randn(16, R, generator=g).t()  # [R, 16], column-major
    w = torch.randn(len(BIG), 12, 16, generator=g).transpose(1, 2)  # [E, K=16, N=12], strided
    assert not x.is_contiguous() and not w.is_contiguous()
    ref = ragged_mm_reference(x.contiguous(), w.contiguous(), off.contiguous())
    torch.testing.assert_close(ragged_mm(x, w, off), ref, rtol=1e-6, atol=1e-5)
    # w^T read as the nn.Linear layout, still strided
    torch.testing.assert_close(ragged_mm(x, w.transpose(1, 2), off, transposed=True), ref, rtol=1e-6, atol=1e-5)
    b = torch.randn(8, R, generator=g).t()
    torch.testing.assert_close(ragged_wgrad(x, b, off), ragged_wgrad_reference(x.contiguous(), b.contiguous(), off),
                               rtol=1e-6, atol=1e-5)




@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("counts", [[1, 0, 3, 2], [20, 0, 18, 25]], ids=["few_rows", "many_rows"])
def test_weight_gradient_of_a_transposed_view_comes_out_in_the_storages_order(transposed, counts):
    """w a transposed view of contiguous storage (fmoe.nn.MoELayer's x @ W views): eager
    backward hands the storage a gradient in its own strides (no copy by AccumulateGrad), equal
    to the reference's; under torch.func.grad (wrapped tensors) the same values."""
    g = gen(23)
    off = counts_to_offsets(counts)
    E, K, N = len(counts), 6, 5
    x = torch.randn(int(off[-1]), K, generator=g, dtype=torch.float64)
    dy = torch.randn(int(off[-1]), N, generator=g, dtype=torch.float64)
    storage = (torch.randn(E, K, N, generator=g, dtype=torch.float64) if transposed else
               torch.randn(E, N, K, generator=g, dtype=torch.float64)).requires_grad_(True)
    arrived = []
    hook = storage.register_hook(lambda gr: arrived.append(gr.stride()))
    ragged_mm(x, storage.transpose(1, 2), off, transposed=transposed).backward(dy)
    hook.remove()
    assert arrived == [storage.stride()]
    ref = storage.detach().transpose(1, 2).contiguous().requires_grad_(True)
    ragged_mm_reference(x, ref, off, transposed=transposed).backward(dy)
    torch.testing.assert_close(storage.grad, ref.grad.transpose(1, 2), rtol=1e-12, atol=1e-12)
    loss = lambda s: (ragged_mm(x, s.transpose(1, 2), off, transposed=transposed) * dy).sum()  # noqa: E731
    torch.testing.assert_close(grad(loss)(storage.detach()), storage.grad, rtol=1e-12, atol=1e-12)

@pytest.mark.parametrize("stored_transposed", [False, True])
def test_few_rows_mm_reads_transposed_views_as_their_storage(stored_transposed):
    """fmoe.nn.MoELayer hands out x @ W views of out x in storage: the numba few-row kernel (the
    engine's decode candidate) reads that storage in its own order (the same bits as passing
    the storage itself)."""
    g = gen(21)
    counts = [1, 0, 3, 5, 2]
    bounds = counts_to_offsets(counts).tolist()
    E, K, N = len(counts), 40, 24
    x = torch.randn(bounds[-1], K, generator=g)
    storage = torch.randn(E, K, N, generator=g) if stored_transposed else torch.randn(E, N, K, generator=g)
    view = storage.transpose(1, 2)                         # [E, N, K] or [E, K, N], not contiguous
    y = numba_cpu.few_rows_mm(x, view, bounds, stored_transposed)
    assert torch.equal(y, numba_cpu.few_rows_mm(x, storage, bounds, not stored_transposed))
    torch.testing.assert_close(y, ragged_mm_reference(x, view.contiguous(), torch.tensor(bounds),
                                                      transposed=stored_transposed), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_wgrad_bit_exact_vs_reference_ignores_padding(dtype):
    g = gen(6)
    counts = [3, 0, 8, 1, 0]
    off = counts_to_offsets(counts)
    R = int(off[-1]) + 4
    a = torch.randn(R, 10, generator=g).to(dtype)
    b = torch.randn(R, 7, generator=g).to(dtype)
    a[int(off[-1]):] = float("nan")
    b[int(off[-1]):] = float("inf")
    z = ragged_wgrad(a, b, off)
    assert z.shape == (5, 10, 7) and z.dtype == dtype
    assert torch.equal(z, ragged_wgrad_reference(a, b, off))
    assert torch.equal(z[1], torch.zeros(10, 7, dtype=dtype)) and torch.equal(z[4], torch.zeros(10, 7, dtype=dtype))
    torch.testing.assert_close(z[2].double(), (a[3:11].t().double() @ b[3:11].double()),
                               rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=2e-1 if dtype == torch.bfloat16 else 1e-5)


# --------------------------------------------------------------------------- derivatives

def _f64(counts, R, K, N, transposed, seed):
    g = gen(seed)
    off = counts_to_offsets(counts)
    x = torch.randn(R, K, generator=g, dtype=torch.float64, requires_grad=True)
    w = weights(len(counts), K, N, transposed, torch.float64, g).requires_grad_()
    return x, w, off


@pytest.mark.parametrize("transposed", [False, True])
def test_mm_gradcheck_and_gradgradcheck(transposed):
    # groups of 2 (numba) and S + 2 (BLAS), an idle expert, 2 padding rows
    x, w, off = _f64([2, 0, S + 2], S + 6, 3, 4, transposed, 7)
    f = lambda x, w: ragged_mm(x, w, off, transposed=transposed)  # noqa: E731
    assert torch.autograd.gradcheck(f, (x, w))
    assert torch.autograd.gradgradcheck(f, (x, w))


def test_wgrad_gradcheck_and_gradgradcheck():
    g = gen(8)
    off = counts_to_offsets([2, 0, 6])
    a = torch.randn(10, 3, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(10, 4, generator=g, dtype=torch.float64, requires_grad=True)
    f = lambda a, b: ragged_wgrad(a, b, off)  # noqa: E731
    assert torch.autograd.gradcheck(f, (a, b))
    assert torch.autograd.gradgradcheck(f, (a, b))


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket).replace("aten.", "").replace("fmoe.", "fmoe::"))
        return func(*args, **(kwargs or {}))


VIEWS = {"unsqueeze", "squeeze", "view", "t", "transpose", "detach", "alias", "expand", "ones_like", "empty_like",
         "zeros_like", "fill_", "sum"}  # autograd's own bookkeeping; no copies


@pytest.mark.parametrize("transposed", [False, True])
def test_backward_is_ragged_ops_only(transposed):
    """Closed under differentiation: dgrad is ragged_mm, wgrad is ragged_wgrad in w's layout
    (no transposed copy of anything); grad of ragged_wgrad is ragged_mm."""
    x, w, off = _f64([S + 1, 0, S + 2], 2 * S + 5, 4, 3, transposed, 9)  # BLAS groups: bit-exact
    y = ragged_mm(x, w, off, transposed=transposed)
    gy = torch.randn_like(y).requires_grad_()
    with _Ops() as mode:
        gx, gw = torch.autograd.grad(y, (x, w), gy, create_graph=True)
    heavy = [n for n in mode.names if n not in VIEWS]
    assert sorted(heavy) == ["fmoe::ragged_mm", "fmoe::ragged_wgrad"], mode.names
    assert gw.shape == w.shape and gw.is_contiguous()
    ref_gw = ragged_wgrad_reference(gy, x, off) if transposed else ragged_wgrad_reference(x, gy, off)
    assert torch.equal(gw, ref_gw)
    assert torch.equal(gx, ragged_mm_reference(gy, w, off, transposed=not transposed))
    with _Ops() as mode:
        torch.autograd.grad(gw, (x, gy), torch.ones_like(gw))
    assert [n for n in mode.names if n not in VIEWS] == ["fmoe::ragged_mm", "fmoe::ragged_mm"], mode.names


def test_jvp_vjp_grad_jacrev_match_reference():
    x, w, off = _f64([2, 0, 6], 10, 3, 4, True, 10)
    x, w = x.detach(), w.detach()
    tx, tw = torch.randn_like(x), torch.randn_like(w)
    f = lambda x, w: ragged_mm(x, w, off, transposed=True)  # noqa: E731
    fr = lambda x, w: ragged_mm_reference(x, w, off, transposed=True)  # noqa: E731
    y, ty = jvp(f, (x, w), (tx, tw))
    ry, rty = torch.autograd.functional.jvp(fr, (x, w), (tx, tw))
    torch.testing.assert_close(y, ry)
    torch.testing.assert_close(ty, rty)
    assert ty.abs().sum() > 0  # not the silent zero tangent of a bare custom op
    _, pull = vjp(f, x, w)
    gy = torch.randn_like(y)
    for got, want in zip(pull(gy), torch.autograd.functional.vjp(fr, (x, w), gy)[1]):
        torch.testing.assert_close(got, want)
    jac = jacrev(f, argnums=(0, 1))(x, w)
    rjac = torch.autograd.functional.jacobian(fr, (x, w))
    for got, want in zip(jac, rjac):
        torch.testing.assert_close(got, want)
    loss = lambda x, w: f(x, w).sin().sum()  # noqa: E731
    gx, gw = grad(loss, argnums=(0, 1))(x, w)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    fr(xr, wr).sin().sum().backward()
    torch.testing.assert_close(gx, xr.grad)
    torch.testing.assert_close(gw, wr.grad)
    # forward over reverse (Hessian-vector product) runs the jvp of the backward ops
    hvp = jvp(lambda w: grad(loss, argnums=1)(x, w), (w,), (tw,))[1]
    rhvp = torch.autograd.functional.hvp(lambda w: fr(x, w).sin().sum(), w, tw)[1]
    torch.testing.assert_close(hvp, rhvp)


def test_jacfwd_and_hessian_match_reference():
    """vmap over jvp (jacfwd) and forward-over-reverse (hessian) through both ops."""
    from torch.func import hessian, jacfwd

    x, w, off = _f64([2, 0, 10], 14, 3, 4, True, 18)
    x, w = x.detach(), w.detach()
    f = lambda x, w: ragged_mm(x, w, off, transposed=True)  # noqa: E731
    fr = lambda x, w: ragged_mm_reference(x, w, off, transposed=True)  # noqa: E731
    for got, want in zip(jacfwd(f, argnums=(0, 1))(x, w), torch.autograd.functional.jacobian(fr, (x, w))):
        torch.testing.assert_close(got, want)
    h = hessian(lambda w: f(x, w).sin().sum())(w)
    torch.testing.assert_close(h, torch.autograd.functional.hessian(lambda w: fr(x, w).sin().sum(), w))
    b = torch.randn(14, 2, generator=gen(19), dtype=torch.float64)
    jw = jacfwd(lambda a, b: ragged_wgrad(a, b, off), argnums=(0, 1))(x, b)
    for got, want in zip(jw, torch.autograd.functional.jacobian(lambda a, b: ragged_wgrad_reference(a, b, off), (x, b))):
        torch.testing.assert_close(got, want)


def test_wgrad_jvp_matches_reference():
    g = gen(11)
    off = counts_to_offsets([3, 0, 5])
    a, b = torch.randn(9, 3, generator=g, dtype=torch.float64), torch.randn(9, 2, generator=g, dtype=torch.float64)
    ta, tb = torch.randn_like(a), torch.randn_like(b)
    _, t = jvp(lambda a, b: ragged_wgrad(a, b, off), (a, b), (ta, tb))
    want = ragged_wgrad_reference(ta, b, off) + ragged_wgrad_reference(a, tb, off)
    torch.testing.assert_close(t, want)


# --------------------------------------------------------------------------- vmap

B = 3
OFFS = torch.stack([counts_to_offsets(c) for c in ([5, 0, 6, 0], [0, 0, 11, 2], [13, 0, 0, 0])])  # N = 11, 13, 13
R0 = 15


def _mixes():
    return [(ix, iw, io) for ix in (None, 0) for iw in (None, 0) for io in (None, 0) if (ix, iw, io) != (None,) * 3]


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dims", _mixes())
def test_mm_vmap_every_mix_is_one_call_and_matches_loop(transposed, dims):
    g = gen(12)
    ix, iw, io = dims
    xs = torch.randn(B, R0, 6, generator=g, dtype=torch.float64)
    ws = torch.randn(B, 4, *((5, 6) if transposed else (6, 5)), generator=g, dtype=torch.float64)
    # an unbatched argument is example 0's (its dim moved when vmapped at 1)
    args = [xs if ix == 0 else xs[0], ws if iw == 0 else ws[0], OFFS if io == 0 else OFFS[0]]
    if ix == 0:
        args[0] = xs.movedim(0, 1)  # batched at dim 1: the rule moves it
    in_dims = (1 if ix == 0 else None, iw, io)
    with _Ops() as mode:
        y = vmap(lambda x, w, o: ragged_mm(x, w, o, transposed=transposed), in_dims=in_dims)(*args)
    assert mode.names.count("fmoe::ragged_mm") == 1
    for b in range(B):
        want = ragged_mm_reference(xs[b if ix == 0 else 0], ws[b if iw == 0 else 0], OFFS[b if io == 0 else 0],
                                   transposed=transposed)
        torch.testing.assert_close(y[b], want)  # rows past each example's own N are 0


@pytest.mark.parametrize("dims", _mixes())
def test_wgrad_vmap_every_mix_matches_loop(dims):
    g = gen(13)
    ia, ib, io = dims
    as_ = torch.randn(B, R0, 3, generator=g, dtype=torch.float64)
    bs = torch.randn(B, R0, 2, generator=g, dtype=torch.float64)
    args = [as_ if ia == 0 else as_[0], bs if ib == 0 else bs[0], OFFS if io == 0 else OFFS[0]]
    with _Ops() as mode:
        z = vmap(ragged_wgrad, in_dims=dims)(*args)
    assert mode.names.count("fmoe::ragged_wgrad") == 1
    for b in range(B):
        want = ragged_wgrad_reference(as_[b if ia == 0 else 0], bs[b if ib == 0 else 0], OFFS[b if io == 0 else 0])
        torch.testing.assert_close(z[b], want)


def test_nested_vmap_and_vmap_of_grad():
    g = gen(14)
    xs = torch.randn(2, B, R0, 6, generator=g, dtype=torch.float64)
    w = torch.randn(4, 6, 5, generator=g, dtype=torch.float64)
    ws = torch.randn(B, 4, 6, 5, generator=g, dtype=torch.float64)
    # outer over x only, inner over x, w and offsets: the inner segments get tiled
    y = vmap(vmap(ragged_mm, in_dims=(0, 0, 0)), in_dims=(0, None, None))(xs, ws, OFFS)
    for i in range(2):
        for b in range(B):
            torch.testing.assert_close(y[i, b], ragged_mm_reference(xs[i, b], ws[b], OFFS[b]))
    # per-example gradients: vmap(grad) over examples with their own layouts
    loss = lambda w, x, o: ragged_mm(x, w, o).square().sum()  # noqa: E731
    pg = vmap(grad(loss), in_dims=(None, 0, 0))(w, xs[0], OFFS)
    for b in range(B):
        wr = w.clone().requires_grad_()
        ragged_mm_reference(xs[0, b], wr, OFFS[b]).square().sum().backward()
        torch.testing.assert_close(pg[b], wr.grad)


# --------------------------------------------------------------------------- opcheck, compile

def test_opcheck():
    g = gen(15)
    off = counts_to_offsets([2, 0, 6]).unsqueeze(0)
    x = torch.randn(1, 10, 3, generator=g, requires_grad=True)
    w = torch.randn(1, 3, 4, 3, generator=g, requires_grad=True)
    torch.library.opcheck(torch.ops.fmoe.ragged_mm, (x, w, off, True))
    torch.library.opcheck(torch.ops.fmoe.ragged_mm, (x, w.transpose(2, 3).contiguous(), off, False))
    # segment broadcasting: x shared, w and offsets per segment
    w2 = torch.randn(2, 3, 3, 4, generator=g, requires_grad=True)
    off2 = torch.cat([off, counts_to_offsets([0, 9, 1]).unsqueeze(0)])
    torch.library.opcheck(torch.ops.fmoe.ragged_mm, (x, w2, off2, False))
    b = torch.randn(2, 10, 5, generator=g, requires_grad=True)
    torch.library.opcheck(torch.ops.fmoe.ragged_wgrad, (x, b, off2))


def test_compile_fullgraph_forward_backward_matches_eager():
    g = gen(16)
    off = counts_to_offsets([5, 0, 3, 6])
    x = torch.randn(16, 8, generator=g)
    w1 = torch.randn(4, 12, 8, generator=g)  # nn.Linear layout
    w2 = torch.randn(4, 12, 8, generator=g)  # x @ W layout

    def step(x, w1, w2, off):
        h = torch.relu(ragged_mm(x, w1, off, transposed=True))
        return ragged_mm(h, w2, off).square().sum()

    def run(fn):
        ps = [t.clone().requires_grad_() for t in (x, w1, w2)]
        loss = fn(*ps, off)
        loss.backward()
        return [loss.detach()] + [p.grad for p in ps]

    torch._dynamo.reset()
    got = run(torch.compile(step, fullgraph=True, dynamic=False))
    want = run(step)
    for a, b in zip(got, want):  # inductor's fused square-sum may reorder the final reduction
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # a new layout with the same shapes reuses the graph and the values follow the data
    off2 = counts_to_offsets([0, 16, 0, 0])
    c = torch.compile(step, fullgraph=True, dynamic=False)
    torch.testing.assert_close(c(x, w1, w2, off2), step(x, w1, w2, off2), rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- bad input

def _bad(fn, exc, msg):
    with pytest.raises(exc, match=re.escape(msg)):
        fn()


def test_bad_inputs_raise_clear_errors():
    x = torch.randn(8, 4)
    w = torch.randn(3, 4, 5)
    good = counts_to_offsets([2, 3, 1])
    _bad(lambda: ragged_mm(x, w, good[:-1]), ValueError,
         "ragged_mm: offsets must be [E + 1] = [4] (E = 3 experts), got shape (3,)")
    _bad(lambda: ragged_mm(x, w, good.to(torch.int32)), TypeError, "ragged_mm: offsets must be int64, got torch.int32")
    _bad(lambda: ragged_mm(x, w, torch.tensor([0, 3, 2, 6])), ValueError,
         "ragged_mm: offsets must be non-decreasing, got offsets[1] = 3 > offsets[2] = 2")
    _bad(lambda: ragged_mm(x, w, torch.tensor([0, 3, 4, 9])), ValueError,
         "ragged_mm: offsets[E] = 9 exceeds the 8 rows of the input")
    _bad(lambda: ragged_mm(x, w, torch.tensor([1, 3, 4, 6])), ValueError, "ragged_mm: offsets[0] must be 0, got 1")
    _bad(lambda: ragged_mm(x, torch.randn(3, 5, 5), good), ValueError,
         "ragged_mm: w must be [E, K, N] with K = x.shape[1] = 4, got shape (3, 5, 5) (transposed=False)")
    _bad(lambda: ragged_mm(x, w, good, transposed=True), ValueError,
         "ragged_mm: w must be [E, N, K] with K = x.shape[1] = 4, got shape (3, 4, 5) (transposed=True)")
    _bad(lambda: ragged_mm(x, w.double(), good), TypeError, "ragged_mm: w must have x's dtype torch.float32, got torch.float64")
    _bad(lambda: ragged_mm(x.long(), w, good), TypeError, "ragged_mm: x must be a floating-point tensor, got torch.int64")
    _bad(lambda: ragged_mm(x[0], w, good), ValueError, "ragged_mm: x must be [R, K], got shape (4,)")
    a, b = torch.randn(8, 3), torch.randn(8, 2)
    _bad(lambda: ragged_wgrad(a, b, torch.tensor([0, 5, 4])), ValueError,
         "ragged_wgrad: offsets must be non-decreasing, got offsets[1] = 5 > offsets[2] = 4")
    _bad(lambda: ragged_wgrad(a, b, torch.tensor([0, 5, 10])), ValueError,
         "ragged_wgrad: offsets[E] = 10 exceeds the 8 rows of the input")
    _bad(lambda: ragged_wgrad(a, b[:7], good), ValueError,
         "ragged_wgrad: a and b must be [R, P] and [R, Q] with the same R, got shapes (8, 3) and (7, 2)")
    _bad(lambda: ragged_wgrad(a, b, good.float()), TypeError, "ragged_wgrad: offsets must be int64, got torch.float32")
    # data errors are found where the data is: inside vmap (naming the segment) and compile
    offs = torch.stack([good, torch.tensor([0, 4, 3, 5])])
    _bad(lambda: vmap(ragged_mm, in_dims=(None, None, 0))(x, w, offs), ValueError,
         "ragged_mm: offsets must be non-decreasing, got offsets[1] = 4 > offsets[2] = 3 (segment 1)")
    # the raw op checks its own shapes too (no read outside a buffer from a direct call)
    _bad(lambda: torch.ops.fmoe.ragged_mm(x[None], w[None], good[None, :3], False), ValueError,
         "ragged_mm: shapes do not match")


# --------------------------------------------------------------------------- warm-up signatures

def test_kernel_signatures_run_and_compute():
    import numpy as np

    for name, kern, args in RK.signatures():
        x, w, tasks, transposed, zero, y = args
        kern(*args)
        for s, e, lo, hi in tasks:
            op = w[0, e].T if transposed else w[0, e]
            np.testing.assert_allclose(y[0, lo:hi], x[0, lo:hi] @ op, err_msg=name)


@pytest.mark.parametrize("transposed", [False, True])
def test_balanced_groups_are_the_references_calls_bit_for_bit(transposed):
    # Balanced training loads run one torch.mm per group (a padded batched GEMM was slower,
    # see BENCHMARKS.md, "Ragged expert GEMMs"): bit for bit the reference; rows past N are
    # NaN and must never be read, idle experts get zero weight gradient.
    g = torch.Generator().manual_seed(5)
    E, K, N = 10, 24, 12
    sizes = [20, 25, 0, 22, 30, 21, 28, 24, 26, 23]
    off = torch.tensor([0] + list(itertools.accumulate(sizes)))
    R = int(off[-1]) + 7
    x = torch.randn(R, K, generator=g, dtype=torch.float64)
    x[int(off[-1]):] = float("nan")
    w = torch.randn(E, N, K, generator=g, dtype=torch.float64) if transposed else \
        torch.randn(E, K, N, generator=g, dtype=torch.float64)
    y = RG.ragged_mm(x, w, off, transposed=transposed)
    assert torch.equal(y, RG.ragged_mm_reference(x, w, off, transposed=transposed))
    assert torch.all(y[int(off[-1]):] == 0)
    b = torch.randn(R, 5, generator=g, dtype=torch.float64)
    b[int(off[-1]):] = float("nan")
    z = RG.ragged_wgrad(x, b, off)
    assert torch.equal(z, RG.ragged_wgrad_reference(x, b, off))
    assert torch.all(z[2] == 0)
    small = torch.tensor([0] + list(itertools.accumulate([17, 18, 17, 19, 17, 18, 17, 18])))
    xs = torch.randn(int(small[-1]), 3, generator=g, dtype=torch.float64, requires_grad=True)
    ws = torch.randn(8, 2, 3, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, c: RG.ragged_mm(a, c, small, transposed=True), (xs, ws))


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("counts", [[3, 0, 20, 1], [0, 0, 0, 5], [17, 16]])
def test_few_rows_mm_equals_the_reference(transposed, counts):
    # the engine's measured decode candidate: every busy expert in one numba call (serial and
    # parallel twins by the weight bytes streamed), every row written
    g = torch.Generator().manual_seed(4)
    E, K, N = len(counts), 12, 20
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    x = torch.randn(bounds[-1], K, generator=g)
    w = torch.randn(E, N, K, generator=g) if transposed else torch.randn(E, K, N, generator=g)
    ref = ragged_mm_reference(x, w, torch.tensor(bounds), transposed=transposed)
    torch.testing.assert_close(numba_cpu.few_rows_mm(x, w, bounds, transposed), ref, rtol=1e-5, atol=1e-5)
