"""The streamed gated-expert op (fmoe.ops.streamed) against the staged pipeline and finite
differences: both layouts, capacity modes, weight forms, dtypes, both accumulation orders,
the three places backward gets the projections from (the gradient buffers, recompute, a separate
buffer), retained graphs, double backward, saved memory, and its errors."""
import dataclasses

import pytest
import torch
from torch.utils import _pytree as pytree

import fmoe
from fmoe.layout import padded_layout, ragged_layout
from fmoe.ops import streamed as S
from fmoe.ops import tuning
from tests.test_pipeline import _saved_bytes

DT = torch.float64


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _spec(expert_type="gated_ffn", cf=0.0, k=3, E=6, M=12, H=10, **kw):
    return fmoe.MoESpec(model_dim=M, num_experts=E, gate=fmoe.GateSpec(k=k, capacity_factor=cf, fp32_gate=False),
                        experts=fmoe.ExpertSpec(type=expert_type, hidden_size=H), **kw)


def _params(spec, dtype=DT, split=False, seed=0):
    p = fmoe.init_params(spec, generator=_gen(seed), dtype=dtype)
    p = pytree.tree_map(lambda t: (t.double() * 20).to(dtype), p)  # O(1) activations, not 1e-3
    g = _gen(seed + 100)
    for name in ("gate_up_proj_bias", "down_proj_bias"):   # GPT-OSS: non-zero biases, some |z| > limit
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


def _count_streamed(monkeypatch):
    calls = []
    real = S._StreamedGlu.apply
    monkeypatch.setattr(S._StreamedGlu, "apply", lambda *a: calls.append(1) or real(*a))
    return calls


def _record_modes(monkeypatch, keep=False):
    """The save mode (and with ``keep``, the per-expert keep list) each streamed forward ran with."""
    modes = []
    real = S._StreamedGlu.forward

    def forward(ctx, *a):
        y = real(ctx, *a)
        modes.append((ctx.save, ctx.keep) if keep else ctx.save)
        return y
    monkeypatch.setattr(S._StreamedGlu, "forward", staticmethod(forward))
    return modes


def _assert_grads_match_staged(spec, p, x, got):
    """dx and every parameter gradient of ``got`` (from _step) equal the staged pipeline's."""
    _, gxs, gps = got
    _, gxr, gpr = _step(dataclasses.replace(spec, streamed=False), p, x)
    torch.testing.assert_close(gxs, gxr, rtol=1e-11, atol=1e-11)
    for a, b in zip(gps, gpr):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)


CASES = [("gated_ffn", 0.0, False), ("gated_ffn", 1.25, False), ("gated_ffn", 2.0, False), ("gated_ffn", -0.5, False),
         ("swiglu", 0.0, False), ("swiglu", 1.0, True), ("swiglu", 0.0, True),
         ("gpt_oss", 0.0, False), ("gpt_oss", 1.25, False)]


@pytest.mark.parametrize("save", S.SAVES)
@pytest.mark.parametrize("expert_type,cf,split", CASES)
def test_streamed_equals_the_staged_pipeline(expert_type, cf, split, save, monkeypatch):
    spec = _spec(expert_type, cf, M=32, save=save)    # M = 32 >= every expert's rows: 'in_grad' fits
    p = _params(spec, split=split)
    x = torch.randn(40, 32, generator=_gen(1), dtype=DT)
    calls = _count_streamed(monkeypatch)
    modes = _record_modes(monkeypatch)
    ys, gxs, gps = _step(spec, p, x)
    assert calls, "the streamed op did not run"
    assert modes == [save]
    yr, gxr, gpr = _step(dataclasses.replace(spec, streamed=False), p, x)
    assert len(calls) == 1
    torch.testing.assert_close(ys, yr, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gxs, gxr, rtol=1e-11, atol=1e-11)
    for a, b in zip(gps, gpr):       # router weights too: the gate-weight gradient path
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)


STORED = {"gated_ffn": (("gate_w", "up_w"), "down_w", False), "swiglu": (("gate_up_proj",), "down_proj", True),
          "swiglu_split": (("gate_proj", "up_proj"), "down_proj", True),
          "gpt_oss": (("gate_up_proj",), "down_proj", False)}


@pytest.mark.parametrize("form", list(STORED))
def test_weights_given_as_transposed_views_run_in_their_storage_order(form, monkeypatch):
    """Expert weights given as transposed views of contiguous storage (as MoELayer holds gated_ffn:
    out x in, handed out as x @ W views) reach the op as that storage (no copy, each flag flipped),
    and equal the weights as given in values and gradients."""
    from fmoe.experts import streamed_weights
    expert_type = form.split("_split")[0]
    spec = _spec(expert_type, 1.25, M=32)
    p = _params(spec, split=form.endswith("_split"))
    x = torch.randn(40, 32, generator=_gen(1), dtype=DT)
    names_in, name_out, transposed = STORED[form]
    store = {k: (v.transpose(1, 2).contiguous() if v.dim() == 3 else v.clone()).requires_grad_(True)
             for k, v in p["experts"].items()}
    views = {k: v.transpose(1, 2) if v.dim() == 3 else v for k, v in store.items()}
    kw = streamed_weights(spec.experts, views)
    assert (kw["fmt"].in_transposed, kw["fmt"].out_transposed) == (not transposed, not transposed)
    assert [w.data_ptr() for w in (*kw["w_in"], kw["w_out"])] == [store[k].data_ptr()
                                                                  for k in (*names_in, name_out)]
    assert all(w.is_contiguous() for w in (*kw["w_in"], kw["w_out"]))
    as_given = streamed_weights(spec.experts, p["experts"])["fmt"]
    assert (as_given.in_transposed, as_given.out_transposed) == (transposed, transposed)
    if len(names_in) == 2:     # one in-projection in each order: both as given
        mixed = dict(p["experts"], **{names_in[1]: views[names_in[1]]})
        assert streamed_weights(spec.experts, mixed)["fmt"].in_transposed == transposed
    calls = _count_streamed(monkeypatch)
    xx = x.clone().requires_grad_(True)
    y, aux = fmoe.moe({"gate": p["gate"], "experts": views}, xx, spec)
    c = torch.linspace(-1, 1, y.numel(), dtype=DT).reshape(y.shape)
    ((y * c).sum() + aux.l_aux).backward()
    assert len(calls) == 1
    q = pytree.tree_map(lambda t: t.detach().clone().requires_grad_(True), p)
    xr = x.clone().requires_grad_(True)
    yr, aux = fmoe.moe(q, xr, dataclasses.replace(spec, streamed=False))
    ((yr * c).sum() + aux.l_aux).backward()
    torch.testing.assert_close(y, yr, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(xx.grad, xr.grad, rtol=1e-11, atol=1e-11)
    for k, t in store.items():
        assert t.grad.is_contiguous()
        g = t.grad.transpose(1, 2) if t.dim() == 3 else t.grad
        torch.testing.assert_close(g, q["experts"][k].grad, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("combine", ["fmoe", "eager"])
def test_streamed_low_precision_within_rounding_and_eager_order_bit_exact(dtype, combine):
    spec = _spec("swiglu", 0.0, k=4, E=8, M=32, H=16, combine=combine)
    p = _params(spec, dtype)
    x = torch.randn(64, 32, generator=_gen(2)).to(dtype)
    ys, gxs, gps = _step(spec, p, x)
    yr, gxr, gpr = _step(dataclasses.replace(spec, streamed=False), p, x)
    if combine == "eager":   # transformers' eager order: expert-ascending dt running sums, bit for bit
        assert torch.equal(ys, yr)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=2e-5, atol=2e-5)
    scale = lambda t: t.float() / t.float().abs().max()  # noqa: E731
    torch.testing.assert_close(scale(ys), scale(yr), **tol)
    torch.testing.assert_close(scale(gxs), scale(gxr), **tol)
    for a, b in zip(gps, gpr):
        torch.testing.assert_close(a.float() / b.float().abs().max(), scale(b), **tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("combine", ["fmoe", "eager"])
def test_streamed_forward_equals_the_out_of_place_reference_bit_for_bit(dtype, combine, monkeypatch):
    # The per-call buffers the products are widened into (bf16/fp16 'fmoe': y in fp32) change
    # no value: the op's forward, on its small path and per expert, is the out-of-place
    # reference's, bit for bit (with BLAS GEMMs: the numba few-row kernels of
    # tuning.NUMBA_SMALL_GEMMS agree within rounding, tested below).
    monkeypatch.setattr(tuning, "NUMBA_SMALL_GEMMS", False)
    x, w_rows, rows, w_in, w_out, fmt = _direct_inputs(False, E=4, T=40, M=24, H=16)
    x, w_in, w_out = x.detach().to(dtype), tuple(w.detach().to(dtype) for w in w_in), w_out.detach().to(dtype)
    w_rows = w_rows.detach().float()
    ref = S._reference(x, w_rows, rows, w_out, None, None, w_in, fmt, combine)
    assert torch.equal(S.streamed_glu(x, w_rows, rows, w_in, w_out, fmt, order=combine), ref)
    monkeypatch.setattr(tuning, "STREAMED_SMALL_PAIRS", 0)   # every order and dtype per expert
    assert torch.equal(S.streamed_glu(x, w_rows, rows, w_in, w_out, fmt, order=combine), ref)


def _direct_inputs(fused_in, E=4, T=9, M=5, H=3, seed=3, gpt=False):
    g = _gen(seed)
    scores = torch.rand(T, E, generator=g, dtype=DT)
    ids, w = fmoe.top_k(scores, 2)
    r = fmoe.make_routing(ids, w, E, 0.0)
    rows = S.expert_rows(ragged_layout(r))
    w_rows = torch.rand(rows.bounds[-1], generator=g, dtype=DT, requires_grad=True)
    x = torch.randn(T, M, generator=g, dtype=DT, requires_grad=True)
    if gpt:   # GPT-OSS: [E, M, 2H] interleaved, clamped, biases; weights large enough to clamp
        w_in = (torch.randn(E, M, 2 * H, generator=g, dtype=DT).mul(4).requires_grad_(),)
        fmt = S.GluSpec(True, False, False, interleaved=True, activation="gpt_oss", limit=2.0)
        w_out = torch.randn(E, H, M, generator=g, dtype=DT, requires_grad=True)
    elif fused_in:
        w_in = (torch.randn(E, 2 * H, M, generator=g, dtype=DT, requires_grad=True),)
        fmt = S.GluSpec(True, True, True)
        w_out = torch.randn(E, M, H, generator=g, dtype=DT, requires_grad=True)
    else:
        w_in = tuple(torch.randn(E, M, H, generator=g, dtype=DT, requires_grad=True) for _ in range(2))
        fmt = S.GluSpec(False, False, False)
        w_out = torch.randn(E, H, M, generator=g, dtype=DT, requires_grad=True)
    return x, w_rows, rows, w_in, w_out, fmt


@pytest.mark.parametrize("save", S.SAVES)
@pytest.mark.parametrize("form", ["fused", "split", "gpt_oss"])
def test_streamed_glu_gradients_match_finite_differences(form, save):
    x, w_rows, rows, w_in, w_out, fmt = _direct_inputs(form == "fused", gpt=form == "gpt_oss")
    E, O = w_out.shape[0], x.shape[1]
    biases = ()
    if form == "gpt_oss":
        g = _gen(30)
        biases = (torch.randn(E, w_in[0].shape[2], generator=g, dtype=DT, requires_grad=True),
                  torch.randn(E, O, generator=g, dtype=DT, requires_grad=True))
        with torch.no_grad():     # the clamps are active on some rows, idle on others
            z = torch.einsum("tm,emn->etn", x, w_in[0]) + biases[0][:, None]
            assert (z > fmt.limit).any() and (z < fmt.limit).any()

    def f(x, w_rows, w_out, *rest):
        b_in, b_out = rest[:2] if biases else (None, None)
        return S.streamed_glu(x, w_rows, rows, tuple(rest[len(biases):]), w_out, fmt, b_in=b_in, b_out=b_out,
                              save=save)

    assert torch.autograd.gradcheck(f, (x, w_rows, w_out, *biases, *w_in))
    assert torch.autograd.gradgradcheck(f, (x, w_rows, w_out, *biases, *w_in))


def test_streamed_glu_matches_a_per_pair_loop_and_skips_unused_grads():
    x, w_rows, rows, w_in, w_out, fmt = _direct_inputs(False, seed=4)
    y = S.streamed_glu(x, w_rows, rows, w_in, w_out, fmt)
    want = torch.zeros_like(y)
    b = rows.bounds
    for e in range(rows.num_experts):
        for r in range(b[e], b[e + 1]):
            t = int(rows.tokens[r])
            h = torch.nn.functional.silu(x[t] @ w_in[0][e]) * (x[t] @ w_in[1][e])
            want[t] += w_rows[r] * (h @ w_out[e])
    torch.testing.assert_close(y, want, rtol=1e-13, atol=1e-13)
    with torch.no_grad():    # the inference path builds no graph and gives the same values
        torch.testing.assert_close(S.streamed_glu(x, w_rows, rows, w_in, w_out, fmt), y.detach(), rtol=1e-14,
                                   atol=1e-14)
    # only x needs a gradient: the weight grads are never formed
    gx, = torch.autograd.grad(S.streamed_glu(x, w_rows.detach(), rows, tuple(w.detach() for w in w_in),
                                             w_out.detach(), fmt).sum(), x)
    gx_all, = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(gx, gx_all, rtol=1e-13, atol=1e-13)


def _streamed_node(y):
    """The _StreamedGlu node behind y (its ctx attributes are the node's)."""
    todo, seen = [y.grad_fn], set()
    while todo:
        f = todo.pop()
        if f is None or id(f) in seen:
            continue
        seen.add(id(f))
        if type(f).__name__ == "_StreamedGluBackward":
            return f
        todo += [g for g, _ in f.next_functions]
    raise AssertionError("no streamed node in the graph")


def test_streamed_keeps_no_per_row_tensors_beyond_the_gradient_buffers():
    spec = _spec("gated_ffn", 1.25, k=2, E=4, M=32, H=8)   # C = 32 <= M: the projections fit
    p = pytree.tree_map(lambda t: t.requires_grad_(True), _params(spec))
    x = torch.randn(50, 32, generator=_gen(5), dtype=DT, requires_grad=True)

    def saved_bytes(s):
        return _saved_bytes(lambda: fmoe.moe(p, x, s)[0])

    base = sum(t.numel() * 8 for t in pytree.tree_leaves(p)) + x.numel() * 8
    (_, staged), (y, streamed) = (saved_bytes(dataclasses.replace(spec, streamed=False)), saved_bytes(spec))
    assert streamed - base < 100 * 8 * 8                         # routing-sized tensors only
    assert staged - streamed >= 2 * 100 * 32 * 8                 # staged keeps [R, M]-sized buffers
    stores = {m: _streamed_node(saved_bytes(dataclasses.replace(spec, save=m))[0]).stores for m in S.SAVES}
    assert stores["recompute"] == ()
    N = int(fmoe.moe(p, x, spec)[1].routing.kept().sum())
    assert [tuple(t.shape) for t in stores["separate"]] == [(N, 8), (N, 8)]
    assert [tuple(t.shape) for t in stores["in_grad"]] == [(4 * 32 * 8,), (4 * 32 * 8,)]   # no room in front
    # ... and those buffers are the gate/up gradients backward hands out: no memory of their own
    node = _streamed_node(y)
    ptrs = [t.data_ptr() for t in node.stores]
    y.sum().backward()
    assert [p["experts"][n].grad.data_ptr() for n in ("gate_w", "up_w")] == ptrs


def test_in_grad_pad_is_the_overshoot_clipped_to_a_quarter_of_m():
    assert S.in_grad_pad([0, 12, 20, 30, 48], 12) == 0
    assert S.in_grad_pad([0, 13, 26, 36, 48], 12) == 2          # expert 1 ends at 26 = 2·12 + 2
    assert S.in_grad_pad([0, 13, 26, 26, 26], 12) == 2          # idle experts do not count
    assert S.in_grad_pad([0, 40, 40, 40, 48], 12) == 3          # 28 over, clipped to 12 // 4
    assert S.in_grad_experts([0, 13, 26, 36, 48], 12, 2) == [True] * 4
    assert S.in_grad_experts([0, 40, 40, 41, 48], 12, 3) == [False, False, False, True]   # 41 > 3 + 3·12


def test_in_grad_room_in_front_keeps_overshooting_experts_and_hands_out_offset_gradients(monkeypatch):
    # k = 2, M = 8: tokens 0..8 pick experts 0 and 1, tokens 9..15 experts 2 and 3, so the bounds
    # are [0, 9, 18, 25, 32]: experts 0..2 overshoot (e+1)·M by up to 2 rows. Without room in
    # front they would recompute; with pad = 2 rows every expert keeps its projections.
    spec = _spec("gated_ffn", 0.0, k=2, E=4, M=8, H=6)
    p = _params(spec)
    p["gate"]["wg"] = torch.zeros_like(p["gate"]["wg"])
    p["gate"]["wg"][0], p["gate"]["wg"][1] = 1.0, 0.5          # wg is [E, M]
    x = torch.rand(16, 8, generator=_gen(21), dtype=DT) + 0.5
    x[9:] *= -1
    q = pytree.tree_map(lambda t: t.detach().clone().requires_grad_(True), p)
    node = _streamed_node(y := fmoe.moe(q, x, spec)[0])
    assert node.rows.bounds == (0, 9, 18, 25, 32)
    assert S.in_grad_pad(node.rows.bounds, 8) == 2 and node.keep == [True] * 4
    assert S.in_grad_experts(node.rows.bounds, 8) == [False, False, False, True]
    assert [t.numel() for t in node.stores] == [2 * 6 + 4 * 8 * 6] * 2
    ptrs = [t.data_ptr() + 2 * 6 * t.element_size() for t in node.stores]
    y.sum().backward()
    grads = [q["experts"][n].grad for n in ("gate_w", "up_w")]
    assert [g.data_ptr() for g in grads] == ptrs                 # the views themselves, not copies
    assert all(g.is_contiguous() and g.shape == (4, 8, 6) for g in grads)
    modes = _record_modes(monkeypatch, keep=True)
    got = _step(spec, p, x)
    assert modes == [("in_grad", [True] * 4)]
    _assert_grads_match_staged(spec, p, x, got)


@pytest.mark.parametrize("expert_type", ["gated_ffn", "swiglu"])
def test_in_grad_projections_become_the_gradients_and_retained_graphs_recompute(expert_type):
    spec = _spec(expert_type, 0.0, k=2, E=4, M=32, H=10)
    p = _params(spec)
    x = torch.randn(30, 32, generator=_gen(11), dtype=DT)
    assert S.in_grad_experts([0, 12, 20, 30, 48], 12) == [True] * 4
    assert S.in_grad_experts([0, 13, 20, 30, 30, 61], 12) == [False, True, True, False, False]
    want = _step(dataclasses.replace(spec, streamed=False), p, x)
    q = pytree.tree_map(lambda t: t.detach().clone().requires_grad_(True), p)
    y, _ = fmoe.moe(q, x, spec)
    assert len(_streamed_node(y).stores) == (2 if expert_type == "gated_ffn" else 1)   # 'in_grad' ran
    c = torch.linspace(-1, 1, y.numel(), dtype=DT).reshape(y.shape)
    (y * c).sum().backward(retain_graph=True)
    first = [t.grad.clone() for t in pytree.tree_leaves(q["experts"])]
    for a, b in zip(first, want[2][-len(first):]):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)
    (y * c).sum().backward()      # the buffers now hold gradients: this pass must recompute
    for t, a in zip(pytree.tree_leaves(q["experts"]), first):
        torch.testing.assert_close(t.grad, 2 * a, rtol=1e-11, atol=1e-11)


def test_in_grad_falls_back_to_recompute_for_uneven_loads(monkeypatch):
    # Every token on expert 0: 60 rows > M = 12, so the projections cannot share its gradient slice.
    spec = _spec("gated_ffn", 0.0, k=1, E=4, M=12, H=10)
    p = _params(spec)
    p["gate"]["wg"] = torch.zeros_like(p["gate"]["wg"])
    p["gate"]["wg"][:, 0] = 5.0
    x = torch.rand(60, 12, generator=_gen(12), dtype=DT) + 1
    modes = _record_modes(monkeypatch)
    got = _step(spec, p, x)
    assert modes == ["recompute"]
    _assert_grads_match_staged(spec, p, x, got)


def test_streamed_falls_back_under_vmap_compile_and_for_other_experts(monkeypatch):
    calls = _count_streamed(monkeypatch)
    spec = _spec("gated_ffn", 0.0)
    p = _params(spec)
    xs = torch.randn(2, 10, 12, generator=_gen(6), dtype=DT)
    ys = torch.func.vmap(lambda x: fmoe.moe(p, x, spec)[0])(xs)
    assert not calls
    want = torch.stack([fmoe.moe(p, x, dataclasses.replace(spec, streamed=False))[0] for x in xs])
    torch.testing.assert_close(ys, want, rtol=1e-12, atol=1e-12)
    for s in (_spec("ffn", 0.0), dataclasses.replace(spec, combine="grouped"),
              dataclasses.replace(spec, is_postscore=False)):
        x = xs[0].clone().requires_grad_(True)
        fmoe.moe(_params(s), x, s)[0].sum().backward()
    assert not calls


def test_streamed_errors_name_the_problem():
    x, w_rows, rows, w_in, w_out, fmt = _direct_inputs(True)
    with pytest.raises(ValueError, match="order must be one of"):
        S.streamed_glu(x, w_rows, rows, w_in, w_out, fmt, order="grouped")
    with pytest.raises(ValueError, match="save must be one of"):
        S.streamed_glu(x, w_rows, rows, w_in, w_out, fmt, save="remat")
    with pytest.raises(ValueError, match="MoESpec.save must be one of"):
        _spec(save="nowhere")
    with pytest.raises(ValueError, match="kept pairs"):
        S.streamed_glu(x, w_rows[:-1], rows, w_in, w_out, fmt)
    with pytest.raises(ValueError, match="takes 1 in-projection"):
        S.streamed_glu(x, w_rows, rows, w_in * 2, w_out, fmt)
    with pytest.raises(ValueError, match=r"\[E=4"):
        S.streamed_glu(x, w_rows, rows, w_in, w_out[:3], fmt)
    with pytest.raises(ValueError, match=r"x must be \[T, M\]"):
        S.streamed_glu(x[None], w_rows, rows, w_in, w_out, fmt)
    r = fmoe.make_routing(*fmoe.top_k(torch.rand(6, 4, generator=_gen(7)), 2), 4, 1.0)
    with pytest.raises(ValueError, match="ragged layout"):
        S.expert_rows(padded_layout(r))


@pytest.mark.parametrize("cf", [0.0, 1.0, 1.25, -1.0])
@pytest.mark.parametrize("T,E,k", [(1, 1, 1), (5, 3, 2), (16, 8, 4), (100, 33, 2), (64, 4, 4)])
def test_routing_rows_equal_the_ragged_layouts_rows(T, E, k, cf):
    # The numba walk against expert_rows(ragged_layout(.)): masked pairs, capacity drops and
    # importance-ordered slots (which put pairs out of token order inside an expert).
    g = _gen(T * 131 + E)
    for importance in (None, torch.rand(T, generator=g)):
        ids = torch.topk(torch.rand(T, E, generator=g), k, dim=1).indices.t().contiguous()
        ids[torch.rand(k, T, generator=g) < 0.15] = -1
        r = fmoe.make_routing(ids, torch.rand(k, T, generator=g), E, cf, importance=importance)
        want, got = S._routing_rows_torch(r), S.routing_rows(r)   # the off-CPU path is the reference
        assert got.bounds == want.bounds
        assert torch.equal(got.pairs, want.pairs) and torch.equal(got.tokens, want.tokens)
        assert got.dropped.dtype == want.dropped.dtype == torch.int64 and int(got.dropped) == int(want.dropped)
        if (T, E, cf) == (100, 33, 1.0):
            assert int(got.dropped) > 0, "the grid must exercise capacity drops"


def test_routing_rows_refuse_counts_that_disagree_with_the_slots():
    ids, w = fmoe.top_k(torch.rand(6, 4, generator=_gen(8)), 2)
    r = fmoe.make_routing(ids, w, 4, 0.0)
    mk = lambda i, s, c: fmoe.Routing(i, s, r.weights, c, r.capacity, 4)  # noqa: E731
    e = int(r.expert_ids[0, 0])
    # expert e keeps its count but loses its last pair: a row nobody fills
    last = ((r.expert_ids == e) & (r.slots == r.counts[e] - 1)).nonzero()[0].tolist()
    ids2, slots2 = r.expert_ids.clone(), r.slots.clone()
    ids2[last[0], last[1]], slots2[last[0], last[1]] = -1, -1
    with pytest.raises(ValueError, match="fewer kept pairs"):
        S.routing_rows(mk(ids2, slots2, r.counts))
    # one count moved from e to another expert: e's last slot lies past its rows
    counts = r.counts.clone()
    counts[e] -= 1
    counts[(e + 1) % 4] += 1
    with pytest.raises(ValueError, match="slot is outside"):
        S.routing_rows(mk(r.expert_ids, r.slots, counts))
    # two of e's pairs in one slot (e's last pair moved into slot 0)
    assert r.counts[e] >= 2
    slots3 = r.slots.clone()
    slots3[last[0], last[1]] = 0
    with pytest.raises(ValueError, match="share an expert and a slot"):
        S.routing_rows(mk(r.expert_ids, slots3, r.counts))


@pytest.mark.parametrize("expert_type", ["gated_ffn", "swiglu", "gpt_oss"])
@pytest.mark.parametrize("M,H", [(6, 8), (8, 5), (6, 5), (50, 20)])
def test_inference_small_batch_path_takes_rows_grouped_mm_refuses(expert_type, M, H):
    # torch._grouped_mm refuses rows whose stride is not a multiple of 16 bytes (fp32: 6 or 5
    # columns); the small path then runs a GEMM per expert instead of raising.
    spec = _spec(expert_type, 0.0, k=2, E=4, M=M, H=H)
    p = _params(spec, torch.float32)
    x = torch.randn(16, M, generator=_gen(9))
    with torch.no_grad():
        small = fmoe.moe(p, x, spec)[0]
        staged = fmoe.moe(p, x, dataclasses.replace(spec, streamed=False))[0]
    scale = staged.abs().max()
    torch.testing.assert_close(small / scale, staged / scale, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("expert_type,split", [("gated_ffn", False), ("swiglu", False), ("swiglu", True),
                                               ("gpt_oss", False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("T", [16, 200])
def test_inference_small_path_numba_gemms_equal_the_staged_pipeline(expert_type, split, dtype, T, monkeypatch):
    # Where MKL's few-row GEMMs are slow (tuning.NUMBA_SMALL_GEMMS, the CPU vendor's rule),
    # the small path multiplies through fmoe.ops.ragged's kernels: experts with at most
    # RAGGED_SMALL_ROWS rows in one numba call (T 16: 4 rows each), the others by BLAS (T 200:
    # 50 rows each); equal to the staged pipeline within float rounding, biases included.
    from fmoe.ops import ragged
    monkeypatch.setattr(tuning, "NUMBA_SMALL_GEMMS", True)
    spec = _spec(expert_type, 0.0, k=2, E=8, M=24, H=16)
    p = _params(spec, dtype, split=split)
    x = torch.randn(T, 24, generator=_gen(21)).to(dtype)
    with torch.no_grad():
        staged = fmoe.moe(p, x, dataclasses.replace(spec, streamed=False))[0]
    numba_calls = []
    real = ragged._small_groups
    monkeypatch.setattr(ragged, "_small_groups", lambda *a: (numba_calls.append(a[2]), real(*a))[1])
    with torch.no_grad():
        got = fmoe.moe(p, x, spec)[0]
    projections = 2 if split or expert_type == "gated_ffn" else 1
    assert len(numba_calls) == (projections + 1 if T == 16 else 0)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    scale = staged.abs().max()
    torch.testing.assert_close(got / scale, staged / scale, rtol=tol, atol=tol)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch has no _grouped_mm")
def test_grouped_layout_check_matches_torch():
    # the predicate accepts exactly the operands torch._grouped_mm accepts
    offs = torch.tensor([2, 4], dtype=torch.int32)
    cases = [torch.randn(4, 8), torch.randn(4, 6), torch.randn(4, 4).t(), torch.randn(6, 4).t(),
             torch.randn(4, 16)[:, ::2], torch.randn(4, 1), torch.randn(4, 8).to(torch.bfloat16),
             torch.randn(4, 12).to(torch.bfloat16)]
    for a in cases:
        w = torch.randn(2, a.shape[1], 8, dtype=a.dtype)
        try:
            torch._grouped_mm(a, w, offs=offs)
            accepted = True
        except RuntimeError:
            accepted = False
        assert S._grouped_layout_ok(a) == accepted, (a.shape, a.stride(), a.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("combine", ["fmoe", "eager"])
def test_inference_small_batch_path_equals_the_per_expert_loop(dtype, combine, monkeypatch):
    # No grad and few pairs: GEMMs per expert into one row buffer, elementwise steps once
    # (BLAS GEMMs; the numba few-row kernels of tuning.NUMBA_SMALL_GEMMS are tested below).
    monkeypatch.setattr(tuning, "NUMBA_SMALL_GEMMS", False)
    spec = _spec("swiglu", 0.0, k=4, E=8, M=32, H=16, combine=combine)
    p = _params(spec, dtype)
    x = torch.randn(64, 32, generator=_gen(8)).to(dtype)
    with torch.no_grad():
        assert 4 * 64 <= tuning.STREAMED_SMALL_PAIRS
        small = fmoe.moe(p, x, spec)[0]
        with monkeypatch.context() as m:    # the same path without torch._grouped_mm: a GEMM per expert
            m.setattr(S, "_grouped_ok", lambda *ts: False)
            small_loop = fmoe.moe(p, x, spec)[0]
        assert torch.equal(small, small_loop)
        monkeypatch.setattr(tuning, "STREAMED_SMALL_PAIRS", 0)
        loop = fmoe.moe(p, x, spec)[0]
        staged = fmoe.moe(p, x, dataclasses.replace(spec, streamed=False))[0]
    if dtype == torch.float32:   # bf16: silu over all rows splits its threads elsewhere
        assert torch.equal(small, loop)
    if combine == "eager":
        assert torch.equal(small, staged)    # transformers' order, bit for bit, in bf16 too
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    scale = staged.float().abs().max()
    torch.testing.assert_close(small.float() / scale, staged.float() / scale, rtol=tol, atol=tol)
    torch.testing.assert_close(loop.float() / scale, staged.float() / scale, rtol=tol, atol=tol)


@pytest.mark.parametrize("expert_type", ["gated_ffn", "swiglu", "gpt_oss"])
def test_in_grad_with_some_experts_recomputing_equals_the_staged_pipeline(expert_type, monkeypatch):
    # M = 12 and ~12 rows per expert: some experts' projections fit their gradient slices,
    # the later ones do not and are recomputed, in the same backward.
    spec = _spec(expert_type, 0.0, M=12)
    p = _params(spec)
    x = torch.randn(24, 12, generator=_gen(13), dtype=DT)
    keeps = _record_modes(monkeypatch, keep=True)
    got = _step(spec, p, x)
    (mode, keep), = keeps
    assert mode == "in_grad" and any(keep) and not all(keep)
    _assert_grads_match_staged(spec, p, x, got)


@pytest.mark.parametrize("expert_type", ["gated_ffn", "swiglu"])
def test_in_grad_with_more_rows_than_the_gradient_holds(expert_type, monkeypatch):
    # N = 60 kept pairs > E * M = 48 rows of gradient storage: the heavy last expert recomputes,
    # the light ones before it keep their projections in the buffer.
    spec = _spec(expert_type, 0.0, k=2, E=4, M=12)
    p = _params(spec)
    p["gate"]["wg"] = p["gate"]["wg"].clone()
    p["gate"]["wg"][:, 3] += 50.0
    x = torch.rand(30, 12, generator=_gen(14), dtype=DT) + 0.5
    keeps = _record_modes(monkeypatch, keep=True)
    got = _step(spec, p, x)
    (mode, keep), = keeps
    assert mode == "in_grad" and keep[-1] is False and any(keep)
    _assert_grads_match_staged(spec, p, x, got)
