"""The device rows plan (fmoe.engine.plan.device_plan): the CUDA route's plan, built with no host sync.

Its k*T rows are the host plan's kept rows, in the same order, then the dead rows (pairs not
kept). The CUDA entry ('cuda-grouped-mm': torch._grouped_mm) runs on it; torch 2.13 runs
torch._grouped_mm on the CPU too (float32 and bfloat16), so these tests force that entry and
the device plan on CPU tensors and compare with the host plan:

* Against the host plan on the same kernel: bit for bit, by construction. torch's CPU
  _grouped_mm loops over the groups with one ``mm_out`` per expert on that expert's rows (ATen
  ``_grouped_mm_fallback``), and those rows, their values, shapes and strides, are the same in
  both plans; every dead row adds an exact 0 to its token, to a bias gradient and to dx, and is
  never read by a weight gradient.
* Against the float64 oracle (the default CPU route): within ``BOUND`` of the output's largest
  magnitude, which a token that lost or gained one expert's term exceeds many times over.
* NaN safety: with torch's deterministic mode, fresh tensors (torch._grouped_mm's unwritten dead
  rows) are filled with NaN; routing weights of the dead pairs are NaN too. Results stay equal.
* No host sync: FakeTensorMode CUDA tensors (any .item()/.tolist()/nonzero raises) build the
  plan and run the engine's forward and the kernel's three calls up to the launch. (Autograd
  cannot run on fake CUDA tensors in a CPU-only torch build: the backward's pieces are the same
  kernel calls, checked one by one.)
"""
import contextlib
import dataclasses
import warnings

import pytest
import torch
from torch.utils import _pytree as pytree

import fmoe
from fmoe.engine import kinds as K
from fmoe.engine import plan as P
from fmoe.engine import table, traced
from tests.test_engine import _step as _engine_step

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch has no _grouped_mm")

# float32 against the float64 oracle, relative to the tensor's largest magnitude: the GEMMs sum
# at most 32 terms (K * 2^-24 ~ 2e-6) through two projections and the activation; one token's
# missing or extra expert term moves it by O(its magnitude)
BOUND = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _routing(T=24, E=6, k=2, cf=0.0, masked=False, seed=0):
    scores = torch.rand(T, E, generator=_gen(seed), dtype=torch.float64)
    ids, w = fmoe.top_k(scores, k)
    if masked:   # some pairs masked (id < 0): never kept
        ids = ids.clone()
        ids[k - 1, ::3] = -1
    return fmoe.make_routing(ids, w.float(), E, cf)


ROUTINGS = {"dropping": dict(cf=0.5), "dropless": dict(cf=0.0), "masked": dict(cf=1.0, masked=True)}


@pytest.mark.parametrize("case", ROUTINGS)
def test_the_device_plan_is_the_host_rows_then_the_dead_pairs(case):
    r = _routing(**ROUTINGS[case])
    host = P.make_plan(r, needs_grad=False, dtype=torch.float32)
    dev = P.make_plan(r, needs_grad=False, dtype=torch.float32, device_rows=True)
    assert host.bounds is not None and dev.bounds is None   # on the CPU the host plan by default
    k, T = r.expert_ids.shape
    N = host.num_rows
    assert dev.num_rows == k * T and dev.num_experts == host.num_experts and dev.num_slots == k
    assert dev.offsets.tolist() == list(host.bounds)
    assert torch.equal(dev.tokens[:N], host.tokens) and torch.equal(dev.pairs[:N], host.pairs)
    kept = ((r.expert_ids >= 0) & (r.slots < r.capacity)).reshape(-1)
    dead = torch.nonzero(~kept).squeeze(1)
    assert torch.equal(dev.pairs[N:], dead) and torch.equal(dev.tokens, dev.pairs % T)   # in pair order
    assert dev.dead.tolist() == [i >= N for i in range(k * T)]
    assert int(dev.dropped) == int(host.dropped) == int(r.num_dropped())
    assert case == "dropless" or N < k * T
    w = dev.row_weights(r.weights)
    assert torch.equal(w[:N], host.row_weights(r.weights)) and not w[N:].any()
    assert torch.equal(dev.experts[:N], host.experts) and bool((dev.experts < r.num_experts).all())
    on_host = dev.on_host()
    assert on_host.bounds == host.bounds and torch.equal(on_host.tokens, host.tokens)
    assert torch.equal(on_host.pairs, host.pairs) and on_host.offsets is dev.offsets
    for what in ("sizes", "busy"):
        with pytest.raises(ValueError, match=rf"ExpertPlan.{what}: a device rows plan keeps its row counts on the "
                                             r"device \(no host sync\); take plan.on_host\(\)"):
            getattr(dev, what)
    assert "device bounds" in repr(dev)


def test_the_device_plan_phase_comes_from_the_static_shapes():
    # no host counts: 'train' with a gradient, else decode where k*T / min(E, k*T) <= DECODE_ROWS
    for T, E, k, want in [(8, 4, 2, "decode"), (64, 8, 2, "decode"), (65, 8, 2, "prefill"), (32, 64, 4, "decode"),
                          (8, 1, 2, "decode"), (9, 1, 2, "prefill")]:
        ids = torch.zeros(k, T, dtype=torch.int64)
        plan = P.device_plan(ids, ids, E, 1, needs_grad=False, dtype=torch.float32)
        assert plan.phase == want == P.phase_of(False, k * T, min(E, k * T)), (T, E, k)
        assert P.device_plan(ids, ids, E, 1, needs_grad=True, dtype=torch.float32).phase == "train"


def test_make_plan_picks_the_device_plan_off_the_cpu_for_the_grouped_dtypes():
    cuda = torch.device("cuda")
    for dtype, precision, want in [(torch.float32, None, True), (torch.bfloat16, None, True),
                                   (torch.float16, None, True), (torch.float64, None, False),
                                   (torch.float32, "some-recipe", False)]:
        assert P.device_rows_by_default(cuda, dtype, precision) is want
    assert not P.device_rows_by_default(torch.device("cpu"), torch.float32, None)


# --------------------------------------------------------------------------- the engine on it

def _grouped_route(monkeypatch, device_plan: bool):
    """Force the CUDA route on CPU tensors: the table's 'cuda-grouped-mm' entry, and (with
    ``device_plan``) make_plan's device plan, as off the CPU."""
    monkeypatch.setattr(K, "select", lambda plan, *a, **kw: table.kernel_for("cuda", plan.phase, plan.dtype))
    if device_plan:
        monkeypatch.setattr(P, "device_rows_by_default", lambda device, dtype, precision: precision is None)


def _spec(kind, cf, combine, E=6, M=32, H=16, k=2):
    return fmoe.MoESpec(model_dim=M, num_experts=E, combine=combine,
                        gate=fmoe.GateSpec(k=k, capacity_factor=cf, fp32_gate=False),
                        experts=fmoe.ExpertSpec(type=kind, hidden_size=H))


def _params(spec, dtype):
    p = fmoe.init_params(spec, generator=_gen(3), dtype=torch.float64)
    g = _gen(4)
    scale = 1.0 if spec.experts.type == "ffn" else 20.0   # O(1) activations
    p = pytree.tree_map(lambda t: t * scale, p)
    for name in ("gate_up_proj_bias", "down_proj_bias", "fc1_b", "fc2_b"):   # non-zero biases
        if name in p["experts"]:
            p["experts"][name] = torch.randn(p["experts"][name].shape, generator=g, dtype=torch.float64)
    return pytree.tree_map(lambda t: t.to(dtype), p)


def _step(spec, p, x):
    """[y, dx, every parameter gradient (router included)] of sum(y * c) + l_aux (test_engine's step)."""
    y, dx, grads = _engine_step(spec, p, x)
    return [y, dx, *grads]


def _count_plans(monkeypatch):
    seen = []
    real = K._ExpertOp.apply
    monkeypatch.setattr(K._ExpertOp, "apply", lambda *a: seen.append((a[0].name, a[2].bounds is None)) or real(*a))
    return seen


def _close(got, want, bound):
    scale = want.double().abs().max().item()
    return float((got.double() - want.double()).abs().max()) <= bound * max(scale, 1e-30)


@pytest.mark.parametrize("combine", ["fmoe", "eager"])
@pytest.mark.parametrize("cf", [1.0, 0.0])
@pytest.mark.parametrize("kind", ["ffn", "swiglu", "gpt_oss"])
def test_fmoe_moe_on_the_device_plan_equals_the_host_plan(kind, cf, combine, monkeypatch):
    spec = _spec(kind, cf, combine)
    dtype = torch.float32
    p = _params(spec, dtype)
    x = torch.randn(40, spec.model_dim, generator=_gen(1), dtype=torch.float64)
    oracle = _step(spec, _params(spec, torch.float64), x)        # the default CPU route, float64
    seen = _count_plans(monkeypatch)
    _grouped_route(monkeypatch, device_plan=False)
    host = _step(spec, p, x.to(dtype))
    _grouped_route(monkeypatch, device_plan=True)
    dev = _step(spec, p, x.to(dtype))
    assert seen == [("cuda-grouped-mm", False), ("cuda-grouped-mm", True)]
    _, aux = fmoe.moe(p, x.to(dtype), spec)
    assert cf == 0.0 or int(aux.dropped) > 0   # the capacity drops pairs: dead rows are there
    for i, (d, h, o) in enumerate(zip(dev, host, oracle)):
        assert torch.equal(d, h), (i, float((d - h).abs().max()))
        assert _close(d, o, BOUND[dtype]), (i, float((d.double() - o).abs().max()))


def _kinds_case(kind, E, M, H, dtype, seed=5):
    """(form, w_in, b_in, w_out, b_out): weights of one expert kind as leaves."""
    g = _gen(seed)

    def leaf(*s, scale=1.0):
        return (torch.randn(*s, generator=g, dtype=torch.float64) * scale).to(dtype).requires_grad_()
    if kind == "gpt_oss":
        f = K.ExpertForm("gpt_oss", False, False, limit=2.0)
        return f, (leaf(E, M, 2 * H, scale=0.5),), leaf(E, 2 * H), leaf(E, H, M, scale=0.3), leaf(E, M)
    if kind == "swiglu":
        f = K.ExpertForm("glu", True, True)
        return f, (leaf(E, 2 * H, M, scale=0.5),), None, leaf(E, M, H, scale=0.3), None
    f = K.ExpertForm("ffn", True, False, activation=torch.sigmoid)   # sigmoid(0) != 0: a dead row's h is not 0
    return f, (leaf(E, H, M, scale=0.5),), leaf(E, H), leaf(E, H, M, scale=0.3), leaf(E, M)


def _run_grads(f, x, plan, w_rows_of, w_in, b_in, w_out, b_out, order, save="projections"):
    leaves = [t for t in (x, *w_in, b_in, w_out, b_out) if t is not None]
    gates = w_rows_of.detach().clone().requires_grad_()
    kern = table.kernel_for("cuda", plan.phase, plan.dtype)
    y = K.run(f, x, plan.row_weights(gates), plan, w_in, w_out, b_in=b_in, b_out=b_out, order=order, save=save,
              kernel=kern)
    c = torch.linspace(-1, 1, y.numel(), dtype=torch.float64).reshape(y.shape).to(y.dtype)
    grads = torch.autograd.grad((y * c).sum(), [gates, *leaves])
    return [y.detach(), *grads]


@pytest.mark.parametrize("order,dtype", [("fmoe", torch.float32), ("eager", torch.float32), ("eager", torch.bfloat16),
                                         ("fmoe", torch.bfloat16)])
@pytest.mark.parametrize("case", ROUTINGS)
@pytest.mark.parametrize("kind", ["ffn", "swiglu", "gpt_oss"])
def test_kinds_run_on_the_device_plan_equals_the_host_plan_and_is_nan_safe(kind, case, order, dtype):
    E, M, H, T = 6, 32, 16, 24
    r = _routing(T=T, E=E, **ROUTINGS[case])
    f, w_in, b_in, w_out, b_out = _kinds_case(kind, E, M, H, dtype)
    x = torch.randn(T, M, generator=_gen(2), dtype=torch.float64).to(dtype).requires_grad_()
    host = P.make_plan(r, needs_grad=True, dtype=dtype)
    dev = P.make_plan(r, needs_grad=True, dtype=dtype, device_rows=True)
    dead_pairs = ~((r.expert_ids >= 0) & (r.slots < r.capacity))
    poisoned = r.weights.masked_fill(dead_pairs, float("nan")).to(dtype)   # never read by the host plan
    want = _run_grads(f, x, host, poisoned, w_in, b_in, w_out, b_out, order)
    got = _run_grads(f, x, dev, poisoned, w_in, b_in, w_out, b_out, order, save="recompute")
    with _nan_filled():   # torch._grouped_mm's unwritten dead rows are NaN now
        a = x.detach().index_select(0, dev.tokens)
        raw = torch._grouped_mm(a, w_in[0].detach().transpose(1, 2) if f.in_transposed else w_in[0].detach(),
                                offs=dev.offsets[1:].to(torch.int32))
        assert bool(raw[host.num_rows:].isnan().all()) or host.num_rows == dev.num_rows
        nan_run = _run_grads(f, x, dev, poisoned, w_in, b_in, w_out, b_out, order)
    for i, (g, n, h) in enumerate(zip(got, nan_run, want)):
        if i == 1:   # the gate gradient: host plan's dead pairs get 0, as the device plan's
            assert not h[dead_pairs].any() and torch.isfinite(g).all()
        assert torch.equal(g, h) and torch.equal(n, h), (i, float((g.double() - h.double()).abs().nan_to_num(9).max()))


@contextlib.contextmanager
def _nan_filled():
    """torch's deterministic mode: every fresh float tensor (torch.empty, and the output torch._grouped_mm
    allocates) is filled with NaN, so a row the kernel does not write reads NaN."""
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert torch.utils.deterministic.fill_uninitialized_memory
        yield
    finally:
        torch.use_deterministic_algorithms(prev)


def test_the_traced_op_plans_on_the_device_off_the_cpu_and_weighs_dead_rows_zero(monkeypatch):
    # fmoe::expert_rows (torch.compile's op) builds its plan inside the kernel: a device plan
    # where the table's grouped kernel runs the call (forced here on CPU), whose forward and
    # backward equal the host plan's on the same kernel (gate gradient of dropped pairs 0)
    E, M, H, T, dtype = 6, 32, 16, 24, torch.float32
    r = _routing(T=T, E=E, cf=0.5, masked=True)
    f, w_in, b_in, w_out, b_out = _kinds_case("gpt_oss", E, M, H, dtype)
    x = torch.randn(T, M, generator=_gen(2), dtype=torch.float64).to(dtype).requires_grad_()
    monkeypatch.setattr(traced, "select", lambda plan, *a, **kw: table.kernel_for("cuda", plan.phase, plan.dtype))
    plans = []
    real = traced._plan
    monkeypatch.setattr(traced, "_plan", lambda *a, **kw: plans.append(real(*a, **kw)) or plans[-1])

    def step():
        gates = r.weights.to(dtype).detach().clone().requires_grad_()
        y = traced.run(f, x, dataclasses.replace(r, weights=gates), w_in, w_out, b_in=b_in, b_out=b_out)
        leaves = [gates, x, *w_in, b_in, w_out, b_out]
        return [y.detach(), *torch.autograd.grad(y.square().sum(), leaves)]

    host = step()
    monkeypatch.setattr(traced, "device_rows_by_default", lambda device, dtype, precision: True)
    dev = step()
    assert [p.bounds is None for p in plans] == [False, False, True, True]
    dead = ~((r.expert_ids >= 0) & (r.slots < r.capacity))
    assert not dev[1][dead].any()
    for i, (d, h) in enumerate(zip(dev, host)):
        assert torch.equal(d, h), i


def test_a_kernel_that_loops_over_experts_gets_the_host_plan():
    # fmoe.engine.kinds.run hands the per-expert kernels (CUDA float64, the CPU's) the device
    # plan's on_host(); the reference takes it too: the same results as the host plan
    E, M, H, T, dtype = 6, 32, 16, 24, torch.float64
    r = _routing(T=T, E=E, cf=0.5, masked=True)
    f, w_in, b_in, w_out, b_out = _kinds_case("ffn", E, M, H, dtype)
    x = torch.randn(T, M, generator=_gen(2), dtype=dtype)
    host = P.make_plan(r, needs_grad=False, dtype=dtype)
    dev = P.make_plan(r, needs_grad=False, dtype=dtype, device_rows=True)
    with torch.no_grad():
        for kern in (table.kernel_for("cuda", dev.phase, dtype), table.kernel_for("cpu", dev.phase, dtype)):
            assert not kern.static_rows
            want = K.run(f, x, host.row_weights(r.weights.double()), host, w_in, w_out, b_in=b_in, b_out=b_out,
                         kernel=kern)
            got = K.run(f, x, dev.row_weights(r.weights.double()), dev, w_in, w_out, b_in=b_in, b_out=b_out,
                        kernel=kern)
            assert torch.equal(got, want), kern.name
        ref = K.reference(f, x, dev.row_weights(r.weights.double()), dev, w_in, b_in, w_out, b_out)
        assert torch.equal(ref, K.reference(f, x, host.row_weights(r.weights.double()), host, w_in, b_in, w_out,
                                            b_out))


# --------------------------------------------------------------------------- no host sync on CUDA

@pytest.fixture
def fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # data_ptr() of a fake tensor warns
        yield FakeTensorMode(allow_non_fake_inputs=True)


@pytest.mark.parametrize("kind", ["ffn", "swiglu", "gpt_oss"])
def test_fake_cuda_tensors_plan_and_run_the_engine_with_no_host_sync(fake, kind):
    # Under FakeTensorMode a host read of a CUDA tensor's values (.item(), .tolist(), nonzero)
    # raises DataDependentOutputException: each call below passing shows that its route reads
    # nothing on the host up to the kernels' launches. bfloat16: torch's fake _grouped_mm on
    # CUDA takes bf16 only (its fast CUTLASS path; float32/float16 read the offsets on the host
    # inside torch, GroupedMMUtils.h _grouped_mm_fallback).
    from torch._subclasses.fake_tensor import DataDependentOutputException

    E, M, H, T, k, dtype = 8, 32, 16, 24, 2, torch.bfloat16
    cu = dict(device="cuda")
    with fake, torch.no_grad():
        ids = torch.empty(k, T, dtype=torch.int64, **cu)
        r = fmoe.Routing(ids, torch.empty_like(ids), torch.empty(k, T, dtype=dtype, **cu),
                         torch.empty(E, dtype=torch.int64, **cu), 5, E)
        plan = P.make_plan(r, needs_grad=False, dtype=dtype)   # off the CPU: the device plan by itself
        assert plan.bounds is None and plan.num_rows == k * T and plan.device.type == "cuda"
        kern = table.select(plan)
        assert kern.name == "cuda-grouped-mm" and kern.static_rows
        w = lambda *s: torch.empty(*s, dtype=dtype, **cu)  # noqa: E731
        f, w_in, b_in, w_out, b_out = {
            "ffn": (K.ExpertForm("ffn", True, False), (w(E, H, M),), w(E, H), w(E, H, M), w(E, M)),
            "swiglu": (K.ExpertForm("glu", True, True), (w(E, 2 * H, M),), None, w(E, M, H), None),
            "gpt_oss": (K.ExpertForm("gpt_oss", False, False), (w(E, M, 2 * H),), w(E, 2 * H), w(E, H, M), w(E, M)),
        }[kind]
        x = w(T, M)
        w_rows = plan.row_weights(r.weights)
        for order in K.ORDERS:
            y = K.run(f, x, w_rows, plan, w_in, w_out, b_in=b_in, b_out=b_out, order=order)
            assert y.shape == (T, M) and y.device.type == "cuda" and y.dtype == dtype
        # the backward's kernel calls: dgrad through the scatter, both weight gradients, the bias row read
        gz = w(k * T, w_in[0].shape[1] if f.in_transposed else w_in[0].shape[2])
        gx = kern.scatter(gz, w_in[0], plan, index=plan.tokens, out=torch.zeros_like(x), transposed=not f.in_transposed)
        g_w = kern.wgrad(x, gz, plan, rows=plan.tokens)
        assert gx.shape == (T, M) and g_w.shape == (E, M, gz.shape[1])
        assert plan.experts.shape == (k * T,) and plan.dead.shape == (k * T,)
        # off the CPU torch._grouped_mm also wants 16-byte aligned data: a weight 4 bytes off takes the reference
        flat = torch.empty(E * M * gz.shape[1] + 2, dtype=dtype, **cu)
        assert table._grouped_mm_ok(x, flat.narrow(0, 0, E * M * gz.shape[1]).view(E, M, -1))
        assert not table._grouped_mm_ok(x, flat.narrow(0, 2, E * M * gz.shape[1]).view(E, M, -1))
        # the traced op's plan (torch.compile's kernel) is the device plan too
        assert traced._plan(ids, r.slots, r.counts, 5, T, True, dtype).bounds is None
        # a host read is refused here: the consumers that loop over experts in Python
        with pytest.raises(DataDependentOutputException):
            plan.on_host()
        with pytest.raises(DataDependentOutputException):   # float64 has no grouped kernel: host bounds
            P.make_plan(r, needs_grad=False, dtype=torch.float64)


@pytest.mark.parametrize("kind", ["ffn", "gated_ffn", "swiglu", "gpt_oss"])
def test_fake_cuda_tensors_run_the_one_process_expert_stage_with_no_host_sync(fake, kind, monkeypatch):
    # fmoe.moe's expert stage (fmoe.experts.routed_experts) with an injected Routing: the door,
    # the expert form, make_plan's own choice and the engine, in both combine orders. (The router
    # before it reads a finiteness check on the host, and a CPU-only torch cannot copy fake CUDA
    # tensors, so fmoe.moe itself is not run here.) The door sees a fake tensor as the plain
    # CUDA tensor it stands for.
    from torch._subclasses.fake_tensor import FakeTensor

    from fmoe import experts as X

    monkeypatch.setattr(traced, "PLAIN_TENSORS", traced.PLAIN_TENSORS + (FakeTensor,))
    plans = []
    real = K.run
    monkeypatch.setattr(K, "run", lambda *a, **kw: plans.append(a[3]) or real(*a, **kw))
    E, M, T, k, dtype = 8, 32, 24, 2, torch.bfloat16
    spec = fmoe.ExpertSpec(type=kind, hidden_size=16)
    p = fmoe.init_params(fmoe.MoESpec(model_dim=M, num_experts=E, experts=spec), dtype=dtype)["experts"]
    cu = dict(device="cuda")
    with fake, torch.no_grad():
        params = pytree.tree_map(lambda t: torch.empty(t.shape, dtype=t.dtype, **cu), p)
        ids = torch.empty(k, T, dtype=torch.int64, **cu)
        r = fmoe.Routing(ids, torch.empty_like(ids), torch.empty(k, T, dtype=dtype, **cu),
                         torch.empty(E, dtype=torch.int64, **cu), 5, E)
        for order in K.ORDERS:
            y, dropped = X.routed_experts(spec, params, torch.empty(T, M, dtype=dtype, **cu), r, order=order)
            assert y.shape == (T, M) and y.device.type == "cuda" and dropped.device.type == "cuda"
    assert len(plans) == 2 and all(pl.bounds is None and pl.num_rows == k * T for pl in plans)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8_block"])
@pytest.mark.parametrize("cf", [1.0, 0.0])
def test_packed_weights_run_the_device_plan_as_it_is(fmt, cf, monkeypatch):
    """Packed swiglu experts on a device plan through the CUDA entry ('cuda-packed':
    fmoe.quant.matmul.rows_matmul over the device offsets, forced on CPU tensors, where it takes
    the dequantize + torch._grouped_mm route) with no host plan made: they equal the host plan
    through the CPU's native packed kernel within the float32 bound (other GEMM calls: not bit
    for bit), the dropped pairs' dead rows included."""
    from fmoe.quant import quantize
    spec = _spec("swiglu", cf, "fmoe", E=6, M=64, H=32)
    p = _params(spec, torch.float32)
    p["experts"] = {k: quantize(v, fmt) for k, v in p["experts"].items()}
    x = torch.randn(40, spec.model_dim, generator=_gen(1))
    with torch.no_grad():
        host, aux = fmoe.moe(p, x, spec)
        monkeypatch.setattr(table, "_PACKED", {"cpu": table._PACKED["cuda"], "cuda": table._PACKED["cuda"]})
        monkeypatch.setattr(P, "device_rows_by_default", lambda device, dtype, precision: precision is None)

        def no_host(self):
            raise AssertionError("the packed CUDA entry asked for the host plan")
        monkeypatch.setattr(P.ExpertPlan, "on_host", no_host)
        dev, _ = fmoe.moe(p, x, spec)
    assert cf == 0.0 or int(aux.dropped) > 0
    assert _close(dev, host, BOUND[torch.float32]), float((dev - host).abs().max())
