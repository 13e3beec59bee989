"""Expert parallel on the expert engine: each rank's received rows form a rows plan, and only the
rows that hold pairs are multiplied (padded buffers: the fill mask travels with the data).

Checked for every built-in kind at capacity 1.25, 2.0 and dropless, in data ('adaptive:0'),
plain and overlapped (d = 2) expert parallel: outputs and expert gradients equal one process
on the global parameters (float64, 1e-10), and the rows the engine multiplied, summed over
ranks, are exactly the pairs the routings kept.
"""
from __future__ import annotations

import pytest
import torch

import fmoe
from fmoe.engine import kinds as _kinds
from fmoe.engine.plan import ExpertPlan
from fmoe.parallel import ParallelSpec, shard_experts, sharding
from _helpers import allclose, distributed, full_params, local_batch, local_params, make_spec, reference

KINDS = ("ffn", "gated_ffn", "swiglu", "gpt_oss")


@pytest.fixture
def engine_rows(monkeypatch):
    """Rows of every rows plan the engine runs during the test (a list of ints)."""
    seen = []
    real = _kinds.run

    def run(form, x, w_rows, plan, *a, **kw):
        if isinstance(plan, ExpertPlan):
            seen.append(plan.num_rows)
        return real(form, x, w_rows, plan, *a, **kw)

    monkeypatch.setattr(_kinds, "run", run)
    return seen


def _kept(routing) -> int:
    return int(((routing.expert_ids >= 0) & (routing.slots < routing.capacity)).sum())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cf", [1.25, 2.0, 0.0])
def test_engine_runs_the_kept_rows_and_equals_one_process(comm, engine_rows, kind, cf):
    W = comm.size
    E = 2 * W
    spec = make_spec(E, 2, cf, expert_type=kind)
    full = full_params(spec)
    x = local_batch(comm.rank)
    cot = torch.randn(x.shape[0], spec.output_dim, generator=torch.Generator().manual_seed(7 + comm.rank),
                      dtype=torch.float64)
    for par in (ParallelSpec(), ParallelSpec(mode="adaptive:0")) + (
            (ParallelSpec(overlap_degree=2),) if cf > 0 else ()):
        local = local_params(spec, full, comm)
        engine_rows.clear()
        with torch.no_grad():
            _, aux = fmoe.moe(local, x, spec, comm=comm, parallel=par)
        kept = comm.all_reduce(torch.tensor([_kept(aux.routing)]), "sum").item()
        rows = comm.all_reduce(torch.tensor([sum(engine_rows)]), "sum").item()
        tag = f"{kind} cf={cf} {par}"
        assert engine_rows, f"{tag}: the engine did not run"
        # adaptive:0 runs every expert on this rank's own rows, the others on the received ones
        assert rows == kept, f"{tag}: the engine multiplied {rows} rows for {kept} kept pairs"
        yd, gd = distributed(spec, local, x, comm, par, cot)
        yr, gr = reference(spec, full, x, W, par, cot)
        allclose(yd, yr, f"output {tag}")
        summed = {k: comm.all_reduce(v, "sum") for k, v in gr["experts"].items() if v is not None}
        mine = shard_experts(kind, summed, E, comm.rank, W)
        for k in mine:
            allclose(gd["experts"][k], mine[k], f"grad experts.{k} {tag}")


def test_sharded_experts_run_on_the_engine(comm, engine_rows):
    """E < W (s ranks per expert, model mode r = s): each rank multiplies its hidden slice for the
    filled rows of its expert's r copies only."""
    W = comm.size
    if W < 2:
        pytest.skip("needs 2 ranks")
    E = W // 2
    _, s = sharding(E, W)
    spec = make_spec(E, 2, 1.25)
    full = full_params(spec)
    x = local_batch(comm.rank)
    for par in (ParallelSpec(mode="model"), ParallelSpec(mode="data")):
        engine_rows.clear()
        yd, _ = distributed(spec, local_params(spec, full, comm), x, comm, par)
        yr, _ = reference(spec, full, x, W, par)
        assert engine_rows, f"{par}: the engine did not run"
        allclose(yd, yr, f"sharded output {par}")


@pytest.fixture
def traced_calls(monkeypatch):
    from fmoe.engine import traced
    seen = []
    real = traced.run
    monkeypatch.setattr(traced, "run", lambda *a, **kw: seen.append(1) or real(*a, **kw))
    return seen


def _case(spec, comm):
    """(full params, this rank's x, a cotangent for y, this rank's params) of one expert-parallel case."""
    full = full_params(spec)
    x = local_batch(comm.rank)
    cot = torch.randn(x.shape[0], spec.output_dim, generator=torch.Generator().manual_seed(9 + comm.rank),
                      dtype=torch.float64)
    return full, x, cot, local_params(spec, full, comm)


@pytest.mark.parametrize("kind,cf", [("ffn", 1.25), ("swiglu", 2.0), ("gpt_oss", 0.0)])
def test_torch_func_grad_runs_the_eager_engine_and_equals_one_process(comm, engine_rows, traced_calls, kind, cf):
    """Under torch.func.grad (one grad level) each rank's received rows run the eager engine beneath
    the level (fmoe.parallel._BelowGrad: a rows plan through kinds.run, the traced op not at all),
    in plain, data and sharded modes; outputs and expert gradients equal one process, and x's
    gradient equals eager autograd's."""
    W = comm.size
    for E, par in ((2 * W, ParallelSpec()), (2 * W, ParallelSpec(mode="adaptive:0")),
                   (max(1, W // 2), ParallelSpec(mode="model"))):
        if E < W and (cf == 0.0 or kind not in ("ffn", "gated_ffn")):
            continue   # dropless routes ragged (whole experts per rank); only ffn kinds shard
        spec = make_spec(E, 2, cf, expert_type=kind)
        full, x, cot, local = _case(spec, comm)

        def loss(experts, xs):
            y, _ = fmoe.moe({**local, "experts": experts}, xs, spec, comm=comm, parallel=par)
            return (y * cot).sum(), y

        traced_calls.clear()
        engine_rows.clear()
        (g, gx), yd = torch.func.grad(loss, argnums=(0, 1), has_aux=True)(local["experts"], x)
        tag = f"{kind} cf={cf} E={E} {par}"
        assert engine_rows and not traced_calls, f"{tag}: engine calls {engine_rows}, traced op calls {traced_calls}"
        yr, gr = reference(spec, full, x, W, par, cot)
        allclose(yd, yr, f"output {tag}")
        summed = {k: comm.all_reduce(v, "sum") for k, v in gr["experts"].items() if v is not None}
        mine = shard_experts(kind, summed, E, comm.rank, W)
        for k in mine:
            allclose(g[k], mine[k], f"grad experts.{k} {tag}")
        xe = x.clone().requires_grad_(True)
        ye, _ = fmoe.moe(local, xe, spec, comm=comm, parallel=par)
        (ye * cot).sum().backward()
        allclose(gx, xe.grad, f"grad x {tag}")


@pytest.mark.parametrize("kind,cf", [("ffn", 1.25), ("swiglu", 0.0)])
def test_torch_func_vjp_runs_the_eager_engine_and_equals_grad(comm, engine_rows, traced_calls, kind, cf):
    """torch.func.vjp (one grad level) takes the eager engine beneath the level too, and its function,
    called after the level has ended (no functorch interpreter left to lower to), gives torch.func.grad's
    expert and x gradients bit for bit."""
    W = comm.size
    spec = make_spec(2 * W, 2, cf, expert_type=kind)
    full, x, cot, local = _case(spec, comm)

    def f(experts, xs):
        return fmoe.moe({**local, "experts": experts}, xs, spec, comm=comm)[0]

    traced_calls.clear()
    y, pull = torch.func.vjp(f, local["experts"], x)
    gv, gxv = pull(cot)
    assert engine_rows and not traced_calls, f"engine calls {engine_rows}, traced op calls {traced_calls}"
    (g, gx), yd = torch.func.grad(lambda e, xs: ((f(e, xs) * cot).sum(), f(e, xs)), argnums=(0, 1),
                                  has_aux=True)(local["experts"], x)
    assert torch.equal(y, yd)
    assert torch.equal(gxv, gx)
    for k in g:
        assert torch.equal(gv[k], g[k]), f"grad experts.{k}"


@pytest.mark.parametrize("cf", [1.25, 0.0])
def test_torch_func_grad_with_a_plain_input_requiring_grad_keeps_the_traced_op(comm, engine_rows, traced_calls, cf):
    """A plain (unwrapped) x that requires grad outside the torch.func grad level wants a gradient
    from the outer autograd too, which the eager engine beneath the level would not record: the
    received rows keep the traced op (fmoe.parallel._grad_level). The level's expert gradients
    equal one process's, and x's gradient through the returned output equals eager autograd's."""
    W = comm.size
    E = 2 * W
    spec = make_spec(E, 2, cf, expert_type="swiglu")
    full = full_params(spec)
    x = local_batch(comm.rank)
    cot = torch.randn(x.shape[0], spec.output_dim, generator=torch.Generator().manual_seed(11 + comm.rank),
                      dtype=torch.float64)
    local = local_params(spec, full, comm)
    xp = x.clone().requires_grad_(True)

    def loss(experts):
        y, _ = fmoe.moe({**local, "experts": experts}, xp, spec, comm=comm)
        return (y * cot).sum(), y

    traced_calls.clear()
    engine_rows.clear()
    g, yd = torch.func.grad(loss, has_aux=True)(local["experts"])
    assert traced_calls, "the traced op did not run beneath a grad level with a plain input requiring grad"
    yr, gr = reference(spec, full, x, W, ParallelSpec(), cot)
    allclose(yd, yr, f"output cf={cf}")
    summed = {k: comm.all_reduce(v, "sum") for k, v in gr["experts"].items() if v is not None}
    mine = shard_experts("swiglu", summed, E, comm.rank, W)
    for k in mine:
        allclose(g[k], mine[k], f"grad experts.{k} cf={cf}")
    (yd * cot).sum().backward()
    xe = x.clone().requires_grad_(True)
    ye, _ = fmoe.moe(local, xe, spec, comm=comm)
    (ye * cot).sum().backward()
    allclose(xp.grad, xe.grad, f"grad x (outer autograd) cf={cf}")


@pytest.mark.parametrize("cf", [1.25, 0.0])
def test_forward_mode_ad_runs_the_plan_reference_and_equals_one_process(comm, cf, monkeypatch):
    """torch.func.jvp (which the traced op does not serve): each rank's received rows through the
    plan's per-expert reference under plain autograd; the tangent equals one process's, whose
    experts hold the same tangent directions."""
    W = comm.size
    E = 2 * W
    spec = make_spec(E, 2, cf, expert_type="swiglu")
    full = full_params(spec)
    x = local_batch(comm.rank)
    gen = torch.Generator().manual_seed(21)
    v_full = {k: torch.randn(t.shape, generator=gen, dtype=t.dtype) for k, t in full["experts"].items()}
    local = local_params(spec, full, comm)
    v_local = shard_experts("swiglu", v_full, E, comm.rank, W)

    def dist(ex):
        return fmoe.moe({**local, "experts": ex}, x, spec, comm=comm)[0]

    ref_spec = make_spec(E, 2, cf, expert_type="swiglu")
    from fmoe.parallel import capacity_alignment
    import dataclasses
    ref_spec = dataclasses.replace(ref_spec, alignment=capacity_alignment(E, W, ParallelSpec()))

    def one(ex):
        return fmoe.moe({**full, "experts": ex}, x, ref_spec)[0]

    calls = []
    real = _kinds.reference
    monkeypatch.setattr(_kinds, "reference", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    yd, td = torch.func.jvp(dist, (local["experts"],), (v_local,))
    assert calls, "the received rows did not run the plan's reference"
    monkeypatch.setattr(_kinds, "reference", real)
    yr, tr = torch.func.jvp(one, (full["experts"],), (v_full,))
    allclose(yd, yr, f"jvp output cf={cf}")
    allclose(td, tr, f"jvp tangent cf={cf}")
    assert tr.abs().max() > 0


@pytest.mark.parametrize("cf", [1.0, 0.5])
def test_eager_exchange_carries_only_the_kept_rows(comm, monkeypatch, cf):
    """Eager expert parallel at a capacity that drops pairs routes ragged rows cut to the kept pairs:
    the dispatch buffer, and so both exchanges, hold exactly this rank's kept pairs (no zero rows up
    to k*T); the output and the gradients of x, the gate and the experts equal one process. The
    rows leave straight from x and land in expert order, and the outputs leave from where they lie
    (MPIComm's exchange_rows: no dispatch buffer, no copy of the rows on either side)."""
    W = comm.size
    E = 2 * W
    spec = make_spec(E, 2, cf)
    full = full_params(spec)
    x = local_batch(comm.rank, T=32)
    cot = torch.randn(x.shape[0], spec.output_dim, generator=torch.Generator().manual_seed(5 + comm.rank),
                      dtype=torch.float64)
    # (rows sent, rows received, sent from an index, placed by an index) of each exchange on this rank
    exchanged = []
    real_rows, real_a2av = type(comm).exchange_rows, type(comm).all_to_all_v

    def rows_spy(self, x, s, r, *, rows=None, place=None):
        exchanged.append((sum(s), sum(r), rows is not None, place is not None))
        return real_rows(self, x, s, r, rows=rows, place=place)
    monkeypatch.setattr(type(comm), "exchange_rows", rows_spy)
    monkeypatch.setattr(type(comm), "all_to_all_v", lambda self, x, s, r: exchanged.append(
        (sum(s), sum(r), False, False)) or real_a2av(self, x, s, r))

    def run(params, xs, s, **kw):
        p = {g: {k: v.detach().clone().requires_grad_(True) for k, v in d.items()} for g, d in params.items()}
        xs = xs.clone().requires_grad_(True)
        y, aux = fmoe.moe(p, xs, s, **kw)
        (y * cot).sum().backward()
        return y.detach(), xs.grad, p, aux

    yd, gxd, pd, aux = run(local_params(spec, full, comm), x, spec, comm=comm, parallel=ParallelSpec())
    kept = _kept(aux.routing)
    mine = exchanged[0][1] if exchanged else -1   # rows this rank's experts got
    # forward: the kept rows out from x into expert order, the outputs back from it; backward: the
    # output gradient out into expert order, the rows' x gradient back from it
    assert exchanged == [(kept, mine, True, True), (mine, kept, True, False), (kept, mine, False, True),
                         (mine, kept, True, False)], \
        f"cf={cf}: exchanges (sent, received, from an index, to an index) {exchanged} for {kept} kept pairs"
    assert comm.all_reduce(torch.tensor([mine - kept]), "sum").item() == 0
    dropped = comm.all_reduce(torch.tensor([x.shape[0] * 2 - kept]), "sum").item()
    assert dropped > 0, f"cf={cf}: no pair dropped on any rank, the cut is not exercised"
    from fmoe.parallel import capacity_alignment
    import dataclasses
    ref_spec = dataclasses.replace(spec, alignment=capacity_alignment(E, W, ParallelSpec()))
    yr, gxr, pr, _ = run(full, x, ref_spec)
    allclose(yd, yr, f"output cf={cf}")
    allclose(gxd, gxr, f"grad x cf={cf}")
    for k, v in pr["gate"].items():
        allclose(pd["gate"][k].grad, v.grad, f"grad gate.{k} cf={cf}")
    summed = {k: comm.all_reduce(v.grad, "sum") for k, v in pr["experts"].items()}
    mine = shard_experts("ffn", summed, E, comm.rank, W)
    for k in mine:
        allclose(pd["experts"][k].grad, mine[k], f"grad experts.{k} cf={cf}")


def test_compiled_training_step_runs_the_traced_op_and_equals_one_process(comm, traced_calls):
    """A training step under torch.compile (AOT autograd, graph breaks at the exchanges, whose
    row counts are data): each rank's received rows run the traced op; the output and the expert
    gradients equal one process."""
    W = comm.size
    E = 2 * W
    spec = make_spec(E, 2, 1.25, expert_type="swiglu")
    full = full_params(spec)
    x = local_batch(comm.rank)
    cot = torch.randn(x.shape[0], spec.output_dim, generator=torch.Generator().manual_seed(11 + comm.rank),
                      dtype=torch.float64)
    local = local_params(spec, full, comm)

    def step(experts):
        experts = {k: v.detach().requires_grad_() for k, v in experts.items()}
        y, _ = fmoe.moe({**local, "experts": experts}, x, spec, comm=comm)
        return dict(zip(experts, torch.autograd.grad((y * cot).sum(), list(experts.values())))), y

    torch._dynamo.reset()
    g, yd = torch.compile(step, backend="aot_eager")(local["experts"])
    assert traced_calls, "the traced op did not run under torch.compile"
    yr, gr = reference(spec, full, x, W, None, cot)
    allclose(yd, yr, "compiled output")
    summed = {k: comm.all_reduce(v, "sum") for k, v in gr["experts"].items() if v is not None}
    mine = shard_experts("swiglu", summed, E, comm.rank, W)
    for k in mine:
        allclose(g[k], mine[k], f"compiled grad experts.{k}")
