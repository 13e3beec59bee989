"""The expert engine (fmoe.engine): the plan, the kernel table and the expert kinds' autograd
Function against the staged pipeline, the per-expert reference, per-pair loops and finite
differences, for every expert kind (ffn with relu / gelu / a user's callable, gated_ffn,
swiglu fused and split, gpt_oss), both layouts, capacity modes, dtypes, both accumulation
orders, both save modes, weights given as transposed views, retained graphs, double backward,
saved memory and errors."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

import fmoe
from fmoe import engine
from fmoe.engine import kinds as K
from fmoe.engine import table
from fmoe.ops import native
from fmoe.engine.plan import make_plan, plan_from_bounds, rows_reference
from fmoe.experts import expert_form
from fmoe.layout import ragged_layout
from tests.test_engine_native import _threads
from tests.test_pipeline import _saved_bytes

DT = torch.float64


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _softplus_sq(z):   # a user's elementwise callable
    return F.softplus(z) ** 2


ACTS = {"relu": F.relu, "gelu": F.gelu, "user": _softplus_sq}


def _spec(expert_type="gated_ffn", cf=0.0, k=3, E=6, M=12, H=10, act=None, **kw):
    return fmoe.MoESpec(model_dim=M, num_experts=E, gate=fmoe.GateSpec(k=k, capacity_factor=cf, fp32_gate=False),
                        experts=fmoe.ExpertSpec(type=expert_type, hidden_size=H, activation=ACTS.get(act)), **kw)


def _params(spec, dtype=DT, split=False, seed=0):
    p = fmoe.init_params(spec, generator=_gen(seed), dtype=dtype)
    scale = 1.0 if spec.experts.type == "ffn" else 20.0   # O(1) activations, not 1e-3
    p = pytree.tree_map(lambda t: (t.double() * scale).to(dtype), p)
    g = _gen(seed + 100)
    for name in ("gate_up_proj_bias", "down_proj_bias", "fc1_b", "fc2_b"):   # non-zero biases
        if name in p["experts"]:
            b = p["experts"][name]
            p["experts"][name] = (torch.randn(b.shape, generator=g, dtype=torch.float64) * 4).to(dtype)
    if split:
        gu = p["experts"].pop("gate_up_proj")
        H = gu.shape[1] // 2
        p["experts"]["gate_proj"], p["experts"]["up_proj"] = gu[:, :H].contiguous(), gu[:, H:].contiguous()
    return p


def _step(spec, p, x):
    """y, dx and every parameter gradient (gate included) of sum(y * c) + l_aux."""
    q = pytree.tree_map(lambda t: t.detach().clone().requires_grad_(True), p)
    xx = x.detach().clone().requires_grad_(True)
    y, aux = fmoe.moe(q, xx, spec)
    c = torch.linspace(-1, 1, y.numel(), dtype=torch.float64).reshape(y.shape).to(y.dtype)
    ((y * c).sum() + aux.l_aux).backward()
    return y.detach(), xx.grad, [t.grad for t in pytree.tree_leaves(q)]


def _count_engine(monkeypatch):
    calls = []
    real = K._ExpertOp.apply
    monkeypatch.setattr(K._ExpertOp, "apply", lambda *a: calls.append(a[4]) or real(*a))   # a[4]: save
    return calls


CASES = [("ffn", "relu", 0.0, False), ("ffn", "gelu", 1.25, False), ("ffn", "user", -0.5, False),
         ("ffn", "relu", 2.0, False), ("gated_ffn", None, 0.0, False), ("gated_ffn", None, 1.25, False),
         ("swiglu", None, 0.0, False), ("swiglu", None, 1.0, True), ("swiglu", "gelu", 0.0, True),
         ("gpt_oss", None, 0.0, False), ("gpt_oss", None, 1.25, False)]


@pytest.mark.parametrize("save", K.SAVES)
@pytest.mark.parametrize("expert_type,act,cf,split", CASES)
def test_engine_equals_the_staged_pipeline(expert_type, act, cf, split, save, monkeypatch):
    spec = _spec(expert_type, cf, M=32, act=act, save=save)
    p = _params(spec, split=split)
    x = torch.randn(40, 32, generator=_gen(1), dtype=DT)
    calls = _count_engine(monkeypatch)
    ys, gxs, gps = _step(spec, p, x)
    assert calls == [save], "the engine did not run"
    yr, gxr, gpr = _step(dataclasses.replace(spec, plan="layout"), p, x)
    assert len(calls) == 1
    torch.testing.assert_close(ys, yr, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gxs, gxr, rtol=1e-11, atol=1e-11)
    for a, b in zip(gps, gpr):       # router weights too: the gate-weight gradient path
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)


def test_engine_runs_on_the_padded_layout_and_counts_drops(monkeypatch):
    spec = _spec("ffn", 1.0, k=2, M=16, act="relu", layout="padded")
    p = _params(spec)
    x = torch.randn(50, 16, generator=_gen(2), dtype=DT)
    calls = _count_engine(monkeypatch)
    ys, gxs, gps = _step(spec, p, x)
    yr, gxr, gpr = _step(dataclasses.replace(spec, plan="layout"), p, x)
    assert calls
    torch.testing.assert_close(ys, yr, rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        a, b = fmoe.moe(p, x, spec)[1], fmoe.moe(p, x, dataclasses.replace(spec, plan="layout"))[1]
    assert int(a.dropped) == int(b.dropped) > 0


STORED = {"gated_ffn": (("gate_w", "up_w"), "down_w", False), "swiglu": (("gate_up_proj",), "down_proj", True),
          "swiglu_split": (("gate_proj", "up_proj"), "down_proj", True),
          "gpt_oss": (("gate_up_proj",), "down_proj", False), "ffn": (("fc1_w",), "fc2_w", True)}


@pytest.mark.parametrize("form", list(STORED))
def test_weights_given_as_transposed_views_run_in_their_storage_order(form, monkeypatch):
    """Expert weights given as transposed views of contiguous storage (as MoELayer holds gated_ffn:
    out x in, handed out as x @ W views) reach the engine as that storage (no copy, each flag
    flipped), and equal the weights as given in values and gradients."""
    expert_type = form.split("_split")[0]
    spec = _spec(expert_type, 1.25, M=32, act="relu" if expert_type == "ffn" else None)
    p = _params(spec, split=form.endswith("_split"))
    x = torch.randn(40, 32, generator=_gen(1), dtype=DT)
    names_in, name_out, in_t = STORED[form]
    out_t = in_t if expert_type != "ffn" else False
    store = {k: (v.transpose(1, 2).contiguous() if v.dim() == 3 else v.clone()).requires_grad_(True)
             for k, v in p["experts"].items()}
    views = {k: v.transpose(1, 2) if v.dim() == 3 else v for k, v in store.items()}
    kw = expert_form(spec.experts, views)
    form_s, w_in, w_out = K.as_stored(kw["form"], kw["w_in"], kw["w_out"])
    assert (form_s.in_transposed, form_s.out_transposed) == (not in_t, not out_t)
    assert [w.data_ptr() for w in (*w_in, w_out)] == [store[k].data_ptr() for k in (*names_in, name_out)]
    assert all(w.is_contiguous() for w in (*w_in, w_out))
    kw = expert_form(spec.experts, p["experts"])
    as_given = K.as_stored(kw["form"], kw["w_in"], kw["w_out"])[0]
    assert (as_given.in_transposed, as_given.out_transposed) == (in_t, out_t)
    calls = _count_engine(monkeypatch)
    xx = x.clone().requires_grad_(True)
    y, aux = fmoe.moe({"gate": p["gate"], "experts": views}, xx, spec)
    c = torch.linspace(-1, 1, y.numel(), dtype=DT).reshape(y.shape)
    ((y * c).sum() + aux.l_aux).backward()
    assert len(calls) == 1
    q = pytree.tree_map(lambda t: t.detach().clone().requires_grad_(True), p)
    xr = x.clone().requires_grad_(True)
    yr, aux = fmoe.moe(q, xr, dataclasses.replace(spec, plan="layout"))
    ((yr * c).sum() + aux.l_aux).backward()
    torch.testing.assert_close(y, yr, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(xx.grad, xr.grad, rtol=1e-11, atol=1e-11)
    for k, t in store.items():
        assert t.grad.is_contiguous()
        g = t.grad.transpose(1, 2) if t.dim() == 3 else t.grad
        torch.testing.assert_close(g, q["experts"][k].grad, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("expert_type", ["ffn", "swiglu", "gpt_oss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("combine", ["fmoe", "eager"])
def test_low_precision_within_rounding_and_eager_order_bit_exact(expert_type, dtype, combine):
    spec = _spec(expert_type, 0.0, k=4, E=8, M=32, H=16, combine=combine, act="gelu" if expert_type == "ffn" else None)
    p = _params(spec, dtype)
    x = torch.randn(64, 32, generator=_gen(2)).to(dtype)
    ys, gxs, gps = _step(spec, p, x)
    yr, gxr, gpr = _step(dataclasses.replace(spec, plan="layout"), p, x)
    if combine == "eager" and expert_type == "swiglu":   # transformers' eager order, bit for bit
        assert torch.equal(ys, yr)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=2e-5, atol=2e-5)
    scale = lambda t: t.float() / t.float().abs().max()  # noqa: E731
    torch.testing.assert_close(scale(ys), scale(yr), **tol)
    torch.testing.assert_close(scale(gxs), scale(gxr), **tol)
    for a, b in zip(gps, gpr):
        torch.testing.assert_close(a.float() / b.float().abs().max(), scale(b), **tol)


def _direct(form, E=4, T=9, M=5, H=3, seed=3, dtype=DT, cf=0.0):
    """(ExpertForm, x, w_rows, plan, w_in, b_in, w_out, b_out) with every tensor a leaf."""
    g = _gen(seed)
    scores = torch.rand(T, E, generator=g, dtype=DT)
    ids, w = fmoe.top_k(scores, 2)
    r = fmoe.make_routing(ids, w, E, cf)
    plan = make_plan(r, needs_grad=True, dtype=dtype)
    leaf = lambda t: t.to(dtype).requires_grad_()  # noqa: E731
    w_rows = leaf(torch.rand(plan.num_rows, generator=g, dtype=DT))
    x = leaf(torch.randn(T, M, generator=g, dtype=DT))
    b_in = b_out = None
    if form == "gpt_oss":   # [E, M, 2H] interleaved, clamped, biases; weights large enough to clamp
        f = K.ExpertForm("gpt_oss", False, False, limit=2.0)
        w_in = (leaf(torch.randn(E, M, 2 * H, generator=g, dtype=DT) * 4),)
        b_in, b_out = leaf(torch.randn(E, 2 * H, generator=g, dtype=DT)), leaf(torch.randn(E, M, generator=g, dtype=DT))
        w_out = leaf(torch.randn(E, H, M, generator=g, dtype=DT))
    elif form == "fused":
        f = K.ExpertForm("glu", True, True)
        w_in = (leaf(torch.randn(E, 2 * H, M, generator=g, dtype=DT)),)
        w_out = leaf(torch.randn(E, M, H, generator=g, dtype=DT))
    elif form == "split":
        f = K.ExpertForm("glu", False, False)
        w_in = tuple(leaf(torch.randn(E, M, H, generator=g, dtype=DT)) for _ in range(2))
        w_out = leaf(torch.randn(E, H, M, generator=g, dtype=DT))
    else:   # ffn: fc1 out x in, fc2 x @ W, both biases
        f = K.ExpertForm("ffn", True, False, activation=ACTS[form])
        w_in = (leaf(torch.randn(E, H, M, generator=g, dtype=DT)),)
        b_in, b_out = leaf(torch.randn(E, H, generator=g, dtype=DT)), leaf(torch.randn(E, M, generator=g, dtype=DT))
        w_out = leaf(torch.randn(E, H, M, generator=g, dtype=DT))
    return f, x, w_rows, plan, w_in, b_in, w_out, b_out


FORMS = ["relu", "gelu", "user", "fused", "split", "gpt_oss"]


@pytest.mark.parametrize("save", K.SAVES)
@pytest.mark.parametrize("form", FORMS)
def test_gradients_match_finite_differences_and_double_backward(form, save):
    f, x, w_rows, plan, w_in, b_in, w_out, b_out = _direct(form)
    n = len(w_in)

    def fn(x, w_rows, w_out, b_in, b_out, *w_in):
        return engine.run(f, x, w_rows, plan, w_in, w_out, b_in=b_in, b_out=b_out, save=save)

    args = (x, w_rows, w_out, b_in, b_out, *w_in)
    assert len(args) == 5 + n
    assert torch.autograd.gradcheck(fn, args)
    if form != "relu":   # relu's second derivative is 0 almost everywhere, a kink gradgradcheck trips on
        assert torch.autograd.gradgradcheck(fn, args)


@pytest.mark.parametrize("form", FORMS)
def test_run_matches_a_per_pair_loop_and_skips_unused_grads(form):
    f, x, w_rows, plan, w_in, b_in, w_out, b_out = _direct(form, seed=4)
    y = engine.run(f, x, w_rows, plan, w_in, w_out, b_in=b_in, b_out=b_out)
    want = torch.zeros_like(y)
    b = plan.bounds
    for e in range(plan.num_experts):
        for r in range(b[e], b[e + 1]):
            t = int(plan.tokens[r])
            z = [x[t] @ (w[e].t() if f.in_transposed else w[e]) for w in w_in]
            if b_in is not None:
                z[0] = z[0] + b_in[e]
            h = f.hidden(*[zi[None] for zi in z])[0]
            o = h @ (w_out[e].t() if f.out_transposed else w_out[e])
            want[t] += w_rows[r] * (o + (0 if b_out is None else b_out[e]))
    torch.testing.assert_close(y, want, rtol=1e-13, atol=1e-13)
    with torch.no_grad():    # the inference path builds no graph and gives the same values
        assert torch.equal(engine.run(f, x, w_rows, plan, w_in, w_out, b_in=b_in, b_out=b_out), y.detach())
    # only x needs a gradient: the weight grads are never formed
    det = lambda t: None if t is None else t.detach()  # noqa: E731
    gx, = torch.autograd.grad(engine.run(f, x, det(w_rows), plan, tuple(det(w) for w in w_in), det(w_out),
                                         b_in=det(b_in), b_out=det(b_out)).sum(), x)
    gx_all, = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(gx, gx_all, rtol=1e-13, atol=1e-13)




@pytest.mark.parametrize("save", K.SAVES)
@pytest.mark.parametrize("order", ["fmoe", "eager"])
@pytest.mark.parametrize("form", FORMS)
def test_no_gates_equal_gates_of_one_bit_for_bit(form, order, save):
    """w_rows=None (expert parallel's received rows) skips the products by the gates: the same
    output and gradients as gates of 1 (x * 1 is x), bit for bit, in every order and save."""
    f, x, _, plan, w_in, b_in, w_out, b_out = _direct(form, seed=5)
    leaves = [t for t in (x, w_out, b_in, b_out, *w_in) if t is not None]
    got, want = [], []
    for w_rows, out in ((None, got), (torch.ones(plan.num_rows, dtype=x.dtype), want)):
        y = engine.run(f, x, w_rows, plan, w_in, w_out, b_in=b_in, b_out=b_out, order=order, save=save)
        gy = torch.randn(y.shape, generator=_gen(6), dtype=y.dtype)
        out += [y, *torch.autograd.grad(y, leaves, gy)]
        with torch.no_grad():
            out.append(engine.run(f, x, w_rows, plan, w_in, w_out, b_in=b_in, b_out=b_out, order=order))
        out.append(K.reference(f, x, w_rows, plan, w_in, b_in, w_out, b_out, order))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_no_gates_are_refused_off_a_host_rows_plan():
    f, x, w_rows, plan, w_in, b_in, w_out, b_out = _direct("fused")
    r = fmoe.top_k_routing(torch.rand(x.shape[0], plan.num_experts, generator=_gen(7), dtype=DT), 2, 0.0)
    dev = engine.plan.device_plan(r.expert_ids, r.slots, r.num_experts, r.capacity, needs_grad=False, dtype=DT)
    with pytest.raises(ValueError, match="w_rows=None .* need a host plan"):
        engine.run(f, x, None, dev, w_in, w_out)
    lay = make_plan(r, needs_grad=False, dtype=DT, layout=ragged_layout(r))
    with pytest.raises(ValueError, match="w_rows=None is for rows plans"):
        engine.run(f, x, None, lay, w_in, w_out)


def _per_hidden(f, parts):
    """Sum the per-element values of the in-projection output(s) that feed each hidden unit [N, H]."""
    if f.form == "ffn":
        return parts[0]
    if f.form == "glu":
        g, u = parts if len(parts) == 2 else parts[0].chunk(2, dim=-1)
        return g + u
    return parts[0][..., 0::2] + parts[0][..., 1::2]


@torch.enable_grad()
def _forward_bound(f, x, w_rows, plan, w_in, b_in, w_out, b_out):
    """A first-order bound on |run - reference| when the two differ only in how each GEMM splits
    its K-term sums (the native parallel regime: within ``K * eps_acc * (|a| @ |w|)`` a GEMM, see
    fmoe.ops.native), in float64 [T, O]. Per row r (expert e, token t), elementwise:

        dz  = (K1 eps_acc + 2 eps) (|x_t| @ |op(W_in)| + |b_in|)      each in-projection output
        dh  = sum over the z_i feeding h of D_i dz_i + 4 eps |h|      D_i: max |dh/dz_i| at z_i and z_i +- dz_i
        |d| <= sum over t's rows r of |w_r| (dh @ |op(W_out)| + (K2 eps_acc + 4 eps) (|h| @ |op(W_out)| + |b_out|))
               + (k + 2) eps sum over t's rows r of |w_r| (|h| @ |op(W_out)| + |b_out|)     (the combine)
    eps: the dtype's; eps_acc: float32's for bfloat16/float16 (their GEMMs accumulate in float32)."""
    dt = x.dtype
    eps = torch.finfo(dt).eps
    acc = torch.finfo(torch.float32).eps if dt in (torch.bfloat16, torch.float16) else eps
    d = lambda t: None if t is None else t.detach().double()  # noqa: E731
    op = lambda w, e, tr: w[e].t() if tr else w[e]  # noqa: E731
    xs, wr, wi, bi, wo, bo = d(x), d(w_rows), [d(w) for w in w_in], d(b_in), d(w_out), d(b_out)
    K1, K2 = xs.shape[1], (wo.shape[2] if f.out_transposed else wo.shape[1])
    y_abs = torch.zeros(xs.shape[0], wo.shape[1] if f.out_transposed else wo.shape[2], dtype=torch.float64)
    err = torch.zeros_like(y_abs)
    b = plan.bounds
    for e in range(plan.num_experts):
        lo, hi = b[e], b[e + 1]
        if hi == lo:
            continue
        xe = xs[plan.tokens[lo:hi]]
        z = [xe @ op(w, e, f.in_transposed) for w in wi]
        Z = [xe.abs() @ op(w, e, f.in_transposed).abs() for w in wi]
        if bi is not None:
            z[0], Z[0] = z[0] + bi[e], Z[0] + bi[e].abs()
        dz = [(K1 * acc + 2 * eps) * Zi for Zi in Z]
        D = [torch.zeros_like(zi) for zi in z]
        for sgn in (-1, 0, 1):   # the derivative's largest value over [z - dz, z + dz] (kinks at the ends)
            zs = [(zi + sgn * dzi).requires_grad_() for zi, dzi in zip(z, dz)]
            for Di, gi in zip(D, torch.autograd.grad(f.hidden(*zs).sum(), zs)):
                torch.maximum(Di, gi.abs(), out=Di)
        h = f.hidden(*z).detach()
        dh = _per_hidden(f, [Di * dzi for Di, dzi in zip(D, dz)]) + 4 * eps * h.abs()
        wabs = op(wo, e, f.out_transposed).abs()
        mag = h.abs() @ wabs + (0 if bo is None else bo[e].abs())
        s = wr[lo:hi, None].abs()
        err.index_add_(0, plan.tokens[lo:hi], s * (dh @ wabs + (K2 * acc + 4 * eps) * mag))
        y_abs.index_add_(0, plan.tokens[lo:hi], s * mag)
    k = int(torch.bincount(plan.tokens).max())
    return err + (k + 2) * eps * y_abs


def _within(got, want, tol):
    return bool(((got.double() - want.double()).abs() <= tol).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("order", K.ORDERS)
@pytest.mark.parametrize("form", ["gelu", "fused", "split", "gpt_oss"])
def test_forward_equals_the_reference_bit_for_bit_where_the_gemms_are_its_own(form, dtype, order):
    # The fast path differs from the oracle only in who issues the GEMMs (the kernel table's
    # grouped call against one torch.mm per expert from Python). Where each expert's GEMM is the
    # reference's torch.mm call with the same threads (the native serial regime: the train entry,
    # and every entry at one thread, where native.regime_for never picks 'parallel'), the result
    # is the reference's bit for bit. Where experts run side by side (the decode entry at 2+
    # threads may), each GEMM is single-threaded and may split its K sums otherwise (MKL on other
    # CPUs does): there the stated first-order bound holds (_forward_bound).
    f, x, w_rows, plan, w_in, b_in, w_out, b_out = _direct(form, E=6, T=40, M=24, H=16, seed=7, dtype=dtype)
    with torch.no_grad():
        w_rows = w_rows.float()
        train = table.kernel_for("cpu", "train", dtype)
        kernels = {table.select(plan), table.kernel_for("cpu", "decode", dtype), train}
        for n in sorted({1, 2, torch.get_num_threads()}):
            with _threads(n):
                ref = engine.reference(f, x, w_rows, plan, w_in, b_in, w_out, b_out, order)
                for kern in kernels:
                    got = engine.run(f, x, w_rows, plan, w_in, w_out, b_in=b_in, b_out=b_out, order=order, kernel=kern)
                    serial = n == 1 or kern is train or not native.AVAILABLE
                    if serial:
                        assert torch.equal(got, ref), (kern.name, n)
                    else:
                        tol = _forward_bound(f, x, w_rows, plan, w_in, b_in, w_out, b_out)
                        worst = float(((got.double() - ref.double()).abs() / tol).max())
                        assert _within(got, ref, tol), (kern.name, n, worst)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("form", ["gelu", "fused", "gpt_oss"])
def test_the_forward_bound_catches_a_wrong_row_or_expert(form, dtype):
    # The bound above is tight enough to fail a result with one row dropped, one row sent to the
    # next expert, one expert given another's weights, or (float32/64) one weight changed by 1e-3
    # of the largest; and it passes the reference at one thread and the native parallel regime.
    f, x, w_rows, plan, w_in, b_in, w_out, b_out = _direct(form, E=6, T=40, M=24, H=16, seed=7, dtype=dtype)
    with torch.no_grad():
        w_rows = w_rows.float()
        ref = engine.reference(f, x, w_rows, plan, w_in, b_in, w_out, b_out)
        tol = _forward_bound(f, x, w_rows, plan, w_in, b_in, w_out, b_out)
        with _threads(1):
            assert _within(engine.reference(f, x, w_rows, plan, w_in, b_in, w_out, b_out), ref, tol)
        par = table.Kernel("parallel", "", *table._native_kernel("native", "parallel")) if native.AVAILABLE else None
        if par is not None:
            assert _within(engine.run(f, x, w_rows, plan, w_in, w_out, b_in=b_in, b_out=b_out, kernel=par), ref, tol)
        dropped = w_rows.clone()
        dropped[5] = 0
        assert not _within(engine.reference(f, x, dropped, plan, w_in, b_in, w_out, b_out), ref, tol)
        b = list(plan.bounds)
        e = next(i for i in range(1, len(b) - 1) if b[i] > b[i - 1])   # the first busy expert's last row
        b[e] -= 1                                                     # ... goes to the next expert
        moved = plan_from_bounds(plan.tokens, plan.pairs, b, x.shape[0], needs_grad=False, dtype=dtype)
        assert not _within(engine.reference(f, x, w_rows, moved, w_in, b_in, w_out, b_out), ref, tol)
        w2 = w_out.detach().clone()
        w2[plan.experts[0]] = w_out[plan.experts[-1]]                # one expert runs another's weights
        assert not _within(engine.reference(f, x, w_rows, plan, w_in, b_in, w2, b_out), ref, tol)
        if dtype != torch.bfloat16:                                  # one weight off by 1e-3 of the largest
            w2 = w_out.detach().clone()
            w2[plan.experts[0], 0, 0] += 1e-3 * w2.abs().max()
            assert not _within(engine.reference(f, x, w_rows, plan, w_in, b_in, w2, b_out), ref, tol)


def test_gradients_equal_the_reference_within_rounding():
    # Backward forms the gate-weight gradient as <dy D^T, h> instead of autograd's <dy, h D>:
    # equal within float rounding (and every other gradient is the reference's products).
    f, x, w_rows, plan, w_in, b_in, w_out, b_out = _direct("gpt_oss", E=6, T=40, M=24, H=16, seed=8,
                                                           dtype=torch.float32)
    args = (x, w_rows, b_in, w_out, b_out, *w_in)
    c = torch.randn(40, 24, generator=_gen(9))
    fast = torch.autograd.grad((engine.run(f, x, w_rows, plan, w_in, w_out, b_in=b_in, b_out=b_out) * c).sum(), args)
    ref = torch.autograd.grad((engine.reference(f, x, w_rows, plan, w_in, b_in, w_out, b_out) * c).sum(), args)
    for a, b in zip(fast, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_saved_memory_is_the_projections_or_nothing():
    spec = _spec("ffn", 1.25, k=2, E=4, M=32, H=8, act="relu")
    p = pytree.tree_map(lambda t: t.requires_grad_(True), _params(spec))
    x = torch.randn(50, 32, generator=_gen(5), dtype=DT, requires_grad=True)

    def saved(s):
        return _saved_bytes(lambda: fmoe.moe(p, x, s)[0])[1]

    base = sum(t.numel() * 8 for t in pytree.tree_leaves(p)) + x.numel() * 8
    N = int(fmoe.moe(p, x, spec)[1].routing.kept().sum())
    routing_sized = 100 * 8 * 8
    projections = saved(spec) - base
    recompute = saved(dataclasses.replace(spec, save="recompute")) - base
    staged = saved(dataclasses.replace(spec, plan="layout")) - base
    assert recompute < routing_sized
    assert N * 8 * 8 <= projections < N * 8 * 8 + routing_sized     # z [N, H] and routing-sized tensors
    assert staged - projections >= 2 * N * 32 * 8                     # staged keeps [R, M]-sized buffers


def test_retained_graph_backward_twice_gives_the_same_gradients():
    f, x, w_rows, plan, w_in, b_in, w_out, b_out = _direct("fused", seed=11)
    y = engine.run(f, x, w_rows, plan, w_in, w_out)
    g1 = torch.autograd.grad(y.sum(), (x, *w_in), retain_graph=True)
    g2 = torch.autograd.grad(y.sum(), (x, *w_in))
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


def test_engine_falls_back_under_vmap_compile_and_for_custom_and_quantized(monkeypatch):
    spec = _spec("ffn", 0.0, act="relu")
    p = _params(spec)
    x = torch.randn(8, 12, generator=_gen(6), dtype=DT)
    calls = _count_engine(monkeypatch)
    torch.func.grad(lambda q: fmoe.moe(q, x, spec)[0].sum())(p)
    assert not calls                                  # torch.func: the staged pipeline
    xs = torch.randn(3, 8, 12, generator=_gen(7), dtype=DT)
    torch.func.vmap(lambda t: fmoe.moe(p, t, spec)[0])(xs)
    assert not calls
    fmoe.moe(p, x, dataclasses.replace(spec, experts=dataclasses.replace(spec.experts, precision="fp8_block")))
    assert not calls                                  # a quantized-training recipe
    fmoe.moe(pytree.tree_map(lambda t: t.requires_grad_(True), p), x, spec)
    assert calls


def test_plan_rows_equal_the_ragged_layouts_rows_and_print():
    for T, E, k, cf in [(1, 1, 1, 0.0), (5, 3, 2, 1.0), (16, 8, 4, 1.25), (100, 33, 2, -1.0), (64, 4, 4, 0.0)]:
        g = _gen(T + E)
        ids, w = fmoe.top_k(torch.rand(T, E, generator=g), k)
        r = fmoe.make_routing(ids, w, E, cf)
        plan = make_plan(r, needs_grad=False, dtype=torch.float32)
        tokens, pairs, bounds, dropped = rows_reference(r)
        assert torch.equal(plan.tokens, tokens) and torch.equal(plan.pairs, pairs) and plan.bounds == bounds
        assert int(plan.dropped) == int(dropped) == int(r.num_dropped())
        assert plan.offsets.tolist() == list(bounds)
        lay = ragged_layout(r)
        assert plan.sizes == lay.sizes.tolist()
        assert plan.phase == ("decode" if plan.num_rows <= 16 * max(plan.busy, 1) else "prefill")
        assert repr(plan).startswith(f"ExpertPlan(T={T}, E={E}, rows={plan.num_rows}, busy={plan.busy}")
    assert make_plan(r, needs_grad=True, dtype=torch.float32).phase == "train"
    # the expert of each row, and the gate of each row
    assert torch.equal(plan.experts, torch.repeat_interleave(torch.arange(E), torch.tensor(plan.sizes)))
    assert torch.equal(plan.row_weights(r.weights), r.weights.reshape(-1)[plan.pairs])


def test_a_layout_plan_runs_the_layout_kernel_and_equals_the_rows_plan():
    # a layout plan holds the routing and its layout (static shapes, no host rows) and runs its
    # layout's kernel through the same run(); either layout equals the rows plan's result
    from fmoe.layout import make_layout
    spec = _spec("ffn", 1.0, k=2, act="gelu")
    p = _params(spec)
    x = torch.randn(30, 12, generator=_gen(4), dtype=DT)
    r = fmoe.moe(p, x, spec)[1].routing
    kw = fmoe.experts.expert_form(spec.experts, p["experts"])
    rows = make_plan(r, needs_grad=False, dtype=DT)
    want = engine.run(kw["form"], x, rows.row_weights(r.weights), rows, kw["w_in"], kw["w_out"], b_in=kw["b_in"],
                      b_out=kw["b_out"])
    for kind in ("padded", "ragged"):
        plan = make_plan(r, needs_grad=False, dtype=DT, layout=make_layout(r, kind))
        assert isinstance(plan, engine.LayoutPlan) and not hasattr(plan, "tokens")
        assert plan.phase == "traced" and plan.num_rows == plan.layout.num_rows and plan.num_tokens == 30
        assert repr(plan).startswith(f"LayoutPlan(T=30, E=6, layout={kind}, rows={plan.layout.num_rows}, phase=traced")
        assert plan.row_weights(r.weights) is r.weights
        assert engine.select(plan).name == f"layout-{kind}"
        with pytest.raises(ValueError, match="no host row counts"):
            plan.sizes
        y = engine.run(kw["form"], x, r.weights, plan, kw["w_in"], kw["w_out"], b_in=kw["b_in"], b_out=kw["b_out"])
        torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
        half = engine.run(kw["form"], x, r.weights * 0.5, plan, kw["w_in"], kw["w_out"], b_in=kw["b_in"],
                          b_out=kw["b_out"])   # the weights passed, not the routing's own
        torch.testing.assert_close(half, want * 0.5, rtol=1e-12, atol=1e-12)
        with pytest.raises(ValueError, match="the routing's \\[k, T\\]"):
            engine.run(kw["form"], x, rows.row_weights(r.weights), plan, kw["w_in"], kw["w_out"])
    with pytest.raises(ValueError, match="order must be one of \\('fmoe', 'eager'\\) on a rows plan"):
        engine.run(kw["form"], x, rows.row_weights(r.weights), rows, kw["w_in"], kw["w_out"], order="grouped")
    with pytest.raises(ValueError, match="pre-scored gates"):
        engine.run(kw["form"], x, rows.row_weights(r.weights), rows, kw["w_in"], kw["w_out"], prescore=True)


def test_plan_and_run_errors_name_the_problem():
    f, x, w_rows, plan, w_in, b_in, w_out, b_out = _direct("split")
    with pytest.raises(TypeError, match="routing must be a fmoe.Routing"):
        make_plan("routing", needs_grad=False, dtype=DT)
    ids, w = fmoe.top_k(torch.rand(6, 4, generator=_gen(8)), 2)
    r = fmoe.make_routing(ids, w, 4, 0.0)
    mk = lambda i, s, c: fmoe.Routing(i, s, r.weights, c, r.capacity, 4)  # noqa: E731
    e = int(r.expert_ids[0, 0])
    # expert e keeps its count but loses its last pair: a row nobody fills
    last = ((r.expert_ids == e) & (r.slots == r.counts[e] - 1)).nonzero()[0].tolist()
    ids2, slots2 = r.expert_ids.clone(), r.slots.clone()
    ids2[last[0], last[1]], slots2[last[0], last[1]] = -1, -1
    with pytest.raises(ValueError, match="counts disagree with its slots: .*fewer kept pairs"):
        make_plan(mk(ids2, slots2, r.counts), needs_grad=False, dtype=DT)
    # one count moved from e to another expert: e's last slot lies past its rows
    counts = r.counts.clone()
    counts[e] -= 1
    counts[(e + 1) % 4] += 1
    with pytest.raises(ValueError, match="slot is outside"):
        make_plan(mk(r.expert_ids, r.slots, counts), needs_grad=False, dtype=DT)
    # two of e's pairs in one slot (e's last pair moved into slot 0)
    slots3 = r.slots.clone()
    slots3[last[0], last[1]] = 0
    with pytest.raises(ValueError, match="share an expert and a slot"):
        make_plan(mk(r.expert_ids, slots3, r.counts), needs_grad=False, dtype=DT)
    with pytest.raises(ValueError, match="plan bounds must start at 0"):
        plan_from_bounds(torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), [0, 3, 2], 4,
                         needs_grad=False, dtype=DT)
    with pytest.raises(ValueError, match=r"x must be \[T, M\] with T=9"):
        engine.run(f, x[:5], w_rows, plan, w_in, w_out)
    with pytest.raises(ValueError, match=r"gate weights must be \[N\]"):
        engine.run(f, x, w_rows[:-1], plan, w_in, w_out)
    with pytest.raises(ValueError, match="expert weights must be"):
        engine.run(f, x, w_rows, plan, w_in, w_out[:2])
    with pytest.raises(TypeError, match="in x's dtype"):
        engine.run(f, x, w_rows, plan, w_in, w_out.float())
    with pytest.raises(ValueError, match="order must be one of"):
        engine.run(f, x, w_rows, plan, w_in, w_out, order="grouped")
    with pytest.raises(ValueError, match="save must be one of"):
        engine.run(f, x, w_rows, plan, w_in, w_out, save="in_grad")
    with pytest.raises(ValueError, match="MoESpec.save must be one of"):
        _spec(save="in_grad")
    with pytest.raises(ValueError, match="ExpertForm.form must be one of"):
        K.ExpertForm("moe", False, False)
    with pytest.raises(ValueError, match="no kernel for device='tpu'"):
        table.kernel_for("tpu", "train", torch.float32)


def test_table_has_one_kernel_per_key_and_explains_a_step():
    assert len(table.TABLE) == 2 * 3 * 4
    for (dev, phase, dt, prec), kern in table.TABLE.items():
        assert prec is None and kern.name.startswith(dev)
    cpu = table.kernel_for("cpu", "train", torch.float32)
    assert cpu.name == ("cpu-native" if native.AVAILABLE else "cpu-torch")
    text = table.explain("T=4096,M=512,H=1024,E=8,k=2,kind=swiglu,phase=train")
    assert "phase: train" in text and text.count(f"-> {cpu.name}") == 6
    assert "[8192 x 512] @ [512 x 2048]" in text
    text = table.explain("T=16,M=512,H=1024,E=64")
    assert "phase: decode" in text and text.count("->") == 2
    text = table.explain("T=64,M=32,H=16,E=4,phase=traced")   # a layout plan: the padded layout's kernel
    assert "phase: traced" in text and text.count("-> layout-padded") == 6
    assert "kernel: layout-padded: one torch.bmm over every row of every expert buffer" in text
    text = table.explain("T=1,M=64,H=32,E=8,k=2,kind=swiglu,weights=mxfp4")   # packed: the packed kernel
    assert "weights=mxfp4" in text and "phase: decode" in text and text.count("-> cpu-packed") == 2
    with pytest.raises(ValueError, match="weights must be 'float' or one of"):
        table.explain("T=1,M=64,H=32,E=8,weights=int4")
    with pytest.raises(ValueError, match="packed weights \\(nvfp4\\) run inference only"):
        table.explain("T=1,M=64,H=32,E=8,weights=nvfp4,phase=train")
    for bad, msg in [("T=1,M=2", "needs H, E"), ("T=x,M=1,H=1,E=1", "T must be int"),
                     ("T=1,M=1,H=1,E=1,kind=moe", "kind must be"), ("T=1,M=1,H=1,E=1,dtype=int8", "dtype must be"),
                     ("T=1,M=1,H=1,E=1,phase=warm", "phase must be"), ("Q=1", "bad field")]:
        with pytest.raises(ValueError, match=msg):
            table.explain(bad)


def test_grouped_mm_kernel_equals_the_reference():
    # The CUDA bf16 entry's torch._grouped_mm form, run on the CPU (where torch has it too).
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch has no _grouped_mm")
    f, x, w_rows, plan, w_in, b_in, w_out, b_out = _direct("split", E=4, T=40, M=16, H=16, dtype=torch.float32)
    with torch.no_grad():
        for w in w_in:
            got = table._grouped_mm(x, w, plan, rows=plan.tokens, transposed=False)
            ref = native.gather_mm_reference(x, w, plan.offsets, rows=plan.tokens)
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


def test_grouped_wgrad_kernel_equals_the_reference():
    # The CUDA entry's weight gradient (one torch._grouped_mm, empty experts zeroed), on the CPU.
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch has no _grouped_mm")
    g = _gen(21)
    x, dy = torch.randn(12, 16, generator=g), torch.randn(20, 8, generator=g)
    bounds = [0, 7, 7, 20, 20]   # experts 1 and 3 have no rows
    tokens = torch.randint(0, 12, (20,), generator=g)
    plan = plan_from_bounds(tokens, tokens, bounds, 12, needs_grad=True, dtype=torch.float32)
    with torch.no_grad():
        got = table._grouped_wgrad(x, dy, plan, rows=plan.tokens)
        ref = native.gather_wgrad_reference(x, dy, plan.offsets, rows=plan.tokens)
    assert got.shape == (4, 16, 8) and torch.equal(got[1], torch.zeros(16, 8)) and torch.equal(got[3], got[1])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert table.kernel_for("cuda", "train", torch.float32).name == "cuda-grouped-mm"


def test_a_stochastic_activation_runs_once_and_equals_the_staged_pipeline(monkeypatch):
    # Tutel's examples put dropout inside the activation: the engine calls it once, in forward,
    # on the ragged layout's rows, and keeps its graph (the same mask in backward, the same RNG draws)
    drop = torch.nn.Dropout(0.5)
    spec = fmoe.MoESpec(model_dim=16, num_experts=4, gate=fmoe.GateSpec(k=2, capacity_factor=0.0),
                        experts=fmoe.ExpertSpec(type="ffn", hidden_size=8, activation=lambda z: drop(F.relu(z))))
    assert not expert_form(spec.experts, _params(spec)["experts"])["form"].pure
    p = _params(spec)
    x = torch.randn(30, 16, generator=_gen(12), dtype=DT)
    calls = _count_engine(monkeypatch)
    torch.manual_seed(3)
    got = _step(spec, p, x)
    after = torch.get_rng_state()
    torch.manual_seed(3)
    want = _step(dataclasses.replace(spec, plan="layout"), p, x)
    assert calls and torch.equal(after, torch.get_rng_state())
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], want[1], rtol=1e-11, atol=1e-11)
    for a, b in zip(got[2], want[2]):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)


def _plan_swiglu(params, x, plan):
    """A custom expert on the plan: gated_ffn written with the engine's differentiable grouped GEMM."""
    g = engine.grouped_mm(x, params["gate_w"], plan, rows=plan.tokens)
    u = engine.grouped_mm(x, params["up_w"], plan, rows=plan.tokens)
    return engine.grouped_mm(F.silu(g) * u, params["down_w"], plan)


@pytest.mark.parametrize("cf", [0.0, 1.25])
def test_custom_experts_on_the_plan_equal_the_built_in_kind(cf, monkeypatch):
    builtin = _spec("gated_ffn", cf, M=16)
    p = _params(builtin)
    init = lambda n, m, s, g, d: fmoe.init_params(builtin, generator=g, dtype=d)["experts"]  # noqa: E731
    custom = dataclasses.replace(builtin, experts=fmoe.ExpertSpec(type="custom", fn=_plan_swiglu, init=init,
                                                                 takes_plan=True))
    x = torch.randn(40, 16, generator=_gen(13), dtype=DT)
    got, want = _step(custom, p, x), _step(builtin, p, x)
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], want[1], rtol=1e-11, atol=1e-11)
    for a, b in zip(got[2], want[2]):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)


def test_grouped_mm_gradients_and_custom_plan_errors():
    f, x, w_rows, plan, w_in, b_in, w_out, b_out = _direct("split", seed=14)
    assert torch.autograd.gradcheck(lambda a, w: engine.grouped_mm(a, w, plan, rows=plan.tokens), (x, w_in[0]))
    h = torch.randn(plan.num_rows, 3, generator=_gen(15), dtype=DT, requires_grad=True)
    wt = torch.randn(4, 5, 3, generator=_gen(16), dtype=DT, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, w: engine.grouped_mm(a, w, plan, transposed=True), (h, wt))
    with pytest.raises(ValueError, match="without rows x must be"):
        engine.grouped_mm(x, w_in[0], plan)
    with pytest.raises(TypeError, match="share a dtype"):
        engine.grouped_mm(x, w_in[0].float(), plan, rows=plan.tokens)
    with pytest.raises(ValueError, match="takes_plan is for custom experts"):
        fmoe.ExpertSpec(type="ffn", hidden_size=4, takes_plan=True)
    bad = fmoe.MoESpec(model_dim=5, num_experts=4, gate=fmoe.GateSpec(k=2, capacity_factor=0.0),
                       experts=fmoe.ExpertSpec(type="custom", fn=lambda p, x, plan: x, init=lambda *a: {},
                                               takes_plan=True))
    params = fmoe.init_params(bad, generator=_gen(17))
    with pytest.raises(ValueError, match="must return \\[N, O\\] with N="):
        fmoe.moe(params, torch.randn(9, 5), bad)
    with pytest.raises(ValueError, match="run on one process in eager mode"):
        torch.func.grad(lambda q: fmoe.moe(q, torch.randn(9, 5), bad)[0].sum())(params)


def test_custom_experts_take_a_host_plan():
    # routed_experts makes a custom expert's rows plan with host bounds (fn may loop over experts in
    # Python); run_custom handed a device rows plan says how to make the one it takes
    f, x, w_rows, plan, w_in, b_in, w_out, b_out = _direct("split", seed=18)
    seen = []

    def fn(params, xs, p):
        seen.append(p.bounds)
        return engine.grouped_mm(xs, params, p, rows=p.tokens)

    ids, w = fmoe.top_k(torch.rand(x.shape[0], 4, generator=_gen(19), dtype=DT), 2)
    routing = fmoe.make_routing(ids, w, 4, 0.0)
    host = engine.make_plan(routing, needs_grad=False, dtype=DT)
    dev = engine.make_plan(routing, needs_grad=False, dtype=DT, device_rows=True)
    assert host.bounds is not None and dev.bounds is None
    y = engine.run_custom(fn, w_in[0], x, host.row_weights(routing.weights), host)
    assert seen == [host.bounds] and y.shape == (x.shape[0], w_in[0].shape[-1])
    with pytest.raises(ValueError, match="run_custom: a custom expert takes a rows plan with host bounds; make it "
                                         "with make_plan\(\.\.\., device_rows=False\)"):
        engine.run_custom(fn, w_in[0], x, dev.row_weights(routing.weights), dev)
    want = engine.run_custom(fn, w_in[0], x, dev.on_host().row_weights(routing.weights), dev.on_host())
    assert torch.equal(y, want)


def engine_and_staged(monkeypatch, spec, params, x, hook: str, *, expert_grads: bool = False, seed=None):
    """(y, grads) of ``fmoe.moe`` on the engine and on the staged pipeline (``plan='layout'``), with
    ``fmoe.engine.kinds.<hook>`` spied on to prove the first ran on the engine and the second did not.
    grads: of ``sum(y * dy)`` w.r.t. x (and the expert leaves with ``expert_grads``); ``seed`` seeds
    the recipe's generator identically for both."""
    import dataclasses
    import fmoe
    from fmoe.engine import kinds
    calls = []
    real = getattr(kinds, hook)
    monkeypatch.setattr(kinds, hook, lambda *a: (calls.append(1), real(*a))[1])
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))

    def run(s):
        xx = x.clone().requires_grad_()
        p = params
        if expert_grads:
            p = dict(params, experts={n: t.clone().requires_grad_() for n, t in params["experts"].items()})
        gen = None if seed is None else torch.Generator().manual_seed(seed)
        y, _ = fmoe.moe(p, xx, s, generator=gen)
        leaves = [xx, *p["experts"].values()] if expert_grads else [xx]
        return y, torch.autograd.grad((y * dy).sum(), leaves)

    on_engine = run(spec)
    assert calls, f"kinds.{hook} did not run: the call did not take the engine"
    calls.clear()
    staged = run(dataclasses.replace(spec, plan="layout"))
    assert not calls, f"kinds.{hook} ran with plan='layout'"
    return on_engine, staged


@pytest.mark.parametrize("known_k", [True, False])
def test_bf16_eager_sum_is_transformers_expert_by_expert_loop(known_k):
    # combine_rows' 'eager' order in bf16 (no Python per expert) equals transformers' loop: one
    # bf16 index_add_ per expert in ascending id, bit for bit; at a capacity that drops pairs (tokens
    # with fewer than k rows) and with k read from the plan's pairs where the plan does not know it
    g = _gen(11)
    E, T, O = 7, 40, 24
    ids, w = fmoe.top_k(torch.rand(T, E, generator=g, dtype=DT), 3)
    r = fmoe.make_routing(ids, w, E, 1.0)
    plan = make_plan(r, needs_grad=False, dtype=torch.bfloat16)
    assert plan.num_slots == 3 and int(r.num_dropped()) > 0
    if not known_k:
        plan = dataclasses.replace(plan, num_slots=0)
    y_r = (torch.randn(plan.num_rows, O, generator=g) * 3).bfloat16()
    w_rows = plan.row_weights(r.weights).bfloat16()
    want = torch.zeros(T, O, dtype=torch.bfloat16)
    b = plan.bounds
    for e in range(E):
        s = slice(b[e], b[e + 1])
        want.index_add_(0, plan.tokens[s], (y_r[s] * w_rows[s].unsqueeze(1)).bfloat16())
    got = K.combine_rows(y_r, w_rows, plan, "eager")
    assert torch.equal(got, want)
    # the order matters: the same terms summed all at once in fp32 round differently somewhere
    once = torch.zeros(T, O).index_add_(0, plan.tokens, (y_r * w_rows.unsqueeze(1)).bfloat16().float()).bfloat16()
    assert not torch.equal(once, want)
