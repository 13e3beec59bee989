"""The communicators' ``checks`` setting ('full' default, 'step', 'off'): what each catches, what it costs
in exchanges, and that the fused control exchange returns the same data. Runs under mpiexec -n 2 and -n 4."""
from __future__ import annotations

import pytest
import torch

import fmoe
from fmoe.comm import matching
from fmoe.comm.agreement import CollectiveMismatchError, InconsistentRanksError, StepMismatchError, end_of_job_check
from mpi_backend import MPIComm

from _helpers import full_params, init_gloo, local_batch, local_params, make_spec

_COLLECTIVES = {"Allgather", "Iallgather", "Alltoall", "Ialltoall", "Allreduce", "Iallreduce", "Alltoallv",
                "Ialltoallv", "Alltoallw", "Ialltoallw", "Barrier", "Ibarrier", "Split"}


class Counting:
    """An mpi4py communicator that counts the collectives started on it (one per MPI rendezvous)."""

    def __init__(self, mpi_comm):
        self._c, self.n = mpi_comm, 0

    def __getattr__(self, name):
        attr = getattr(self._c, name)
        if name not in _COLLECTIVES:
            return attr

        def counted(*a, **k):
            self.n += 1
            return attr(*a, **k)
        return counted


def _last(comm):
    return comm.rank == comm.size - 1


def _still_works(c):
    assert c.all_reduce(torch.ones(2), "sum").tolist() == [c.size] * 2


def _setup(comm, T=16):
    spec = make_spec(2 * comm.size, 2, 1.0)
    return spec, local_params(spec, full_params(spec), comm), local_batch(comm.rank, T=T)


def test_checks_setting_is_validated(comm):
    with pytest.raises(ValueError, match=r"checks must be one of \('full', 'step', 'off'\).*got 'none'"):
        MPIComm(comm.mpi_comm, checks="none")
    assert MPIComm(comm.mpi_comm).checks == "full"
    assert MPIComm(comm.mpi_comm, checks="step").split(0).checks == "step"  # sub-communicators inherit it


def test_default_and_step_cost_no_exchange_over_off_in_a_moe_forward(comm):
    """The agreement rides on the router's capacity all_reduce; the expert stage's all-to-alls move raw."""
    spec, params, x = _setup(comm)
    counts, outs = {}, {}
    for checks in ("off", "step", "full"):
        raw = Counting(comm.mpi_comm)
        c = MPIComm(raw, timeout=60, checks=checks)
        fmoe.moe(params, x, spec, comm=c)  # first call makes the sub-communicator caches etc.
        raw.n = 0
        outs[checks], _ = fmoe.moe(params, x, spec, comm=c)
        counts[checks] = raw.n
    assert counts["full"] == counts["step"] == counts["off"], counts
    assert torch.equal(outs["full"], outs["off"]) and torch.equal(outs["step"], outs["off"])


def test_full_matches_the_backward_exchanges(comm):
    """Outside the forward's agreed expert stage (here: autograd's all-to-alls) 'full' checks each collective."""
    spec, params, x = _setup(comm)
    grads = {}
    for checks in ("off", "full"):
        raw = Counting(comm.mpi_comm)
        c = MPIComm(raw, timeout=60, checks=checks)
        p = {"gate": params["gate"], "experts": {k: v.clone().requires_grad_(True) for k, v in params["experts"].items()}}
        y, _ = fmoe.moe(p, x, spec, comm=c)
        raw.n = 0
        y.square().sum().backward()
        grads[checks] = (raw.n, p["experts"]["fc1_w"].grad)
    assert grads["full"][0] == 2 * grads["off"][0]  # one control exchange before each backward all-to-all
    assert torch.equal(grads["full"][1], grads["off"][1])


@pytest.mark.parametrize("checks", ["full", "step"])
def test_a_rank_that_skips_a_step_is_caught(comm, checks):
    spec, params, x = _setup(comm)
    c = MPIComm(comm.mpi_comm, timeout=60, checks=checks)
    fmoe.moe(params, x, spec, comm=c)
    with pytest.raises(StepMismatchError) as e:
        if _last(c):
            end_of_job_check(c)  # skipped the second step and finished
        else:
            fmoe.moe(params, x, spec, comm=c)
    msg = str(e.value)
    assert "ranks are at different steps" in msg and "rank 0 is in fmoe call #2" in msg
    assert f"rank {c.size - 1} is in end-of-job check #2" in msg
    _still_works(c)


@pytest.mark.parametrize("checks", ["full", "step"])
def test_a_rank_one_call_ahead_is_caught_at_its_next_call(comm, checks):
    """The last rank skips a call and goes on to the next one: different call numbers at once, not at the end."""
    spec, params, x = _setup(comm)
    c = MPIComm(comm.mpi_comm, timeout=60, checks=checks)
    fmoe.moe(params, x, spec, comm=c)
    if _last(c):
        from fmoe.comm import registry
        registry.next_call(c)  # as if it had made call #2 on its own
    with pytest.raises(StepMismatchError, match=rf"rank 0 is in fmoe call #2.*rank {c.size - 1} is in fmoe call #3"):
        fmoe.moe(params, x, spec, comm=c)
    _still_works(c)


def test_off_makes_no_agreement_exchange(comm):
    raw = Counting(comm.mpi_comm)
    c = MPIComm(raw, timeout=60, checks="off")
    end_of_job_check(c)
    from fmoe.comm.agreement import agree_across_ranks
    agree_across_ranks(c, {"k": c.rank})  # would disagree: not checked
    assert raw.n == 0
    with pytest.raises(ValueError, match="local"):  # local checks still raise, on this rank
        agree_across_ranks(c, {}, lambda: (_ for _ in ()).throw(ValueError("local")))


@pytest.mark.parametrize("checks", ["full", "step"])
def test_bad_input_on_one_rank_raises_everywhere(comm, checks):
    spec, params, x = _setup(comm)
    c = MPIComm(comm.mpi_comm, timeout=60, checks=checks)
    if _last(c):
        x = x[:, :-1]
        with pytest.raises(ValueError, match="last dim must be model_dim"):
            fmoe.moe(params, x, spec, comm=c)
    else:
        with pytest.raises(InconsistentRanksError, match=rf"invalid input on rank\(s\) {c.size - 1}.*model_dim"):
            fmoe.moe(params, x, spec, comm=c)
    _still_works(c)


@pytest.mark.parametrize("checks", ["full", "step"])
def test_settings_that_differ_raise_everywhere(comm, checks):
    spec, params, x = _setup(comm)
    c = MPIComm(comm.mpi_comm, timeout=60, checks=checks)
    par = fmoe.parallel.ParallelSpec(overlap_degree=2 if _last(c) else 1)
    with pytest.raises(InconsistentRanksError, match="ranks disagree on parallel"):
        fmoe.moe(params, x, spec, comm=c, parallel=par)
    _still_works(c)


@pytest.mark.parametrize("small", [True, False])
def test_full_catches_mismatched_collectives_small_and_large(comm, small):
    n = 3 if small else 4 * matching.PAYLOAD  # inline in the control record, or not
    x = torch.ones(n)
    with pytest.raises(CollectiveMismatchError, match=r"ranks entered different collectives: rank 0: all_reduce"):
        comm.all_gather(x, 0) if _last(comm) else comm.all_reduce(x, "sum")
    with pytest.raises(CollectiveMismatchError, match="different dtypes/shapes/ops"):
        comm.all_gather(torch.ones(n + int(_last(comm))), 0)
    _still_works(comm)


def test_an_agreement_meeting_a_plain_collective_is_a_step_mismatch(comm):
    spec, params, x = _setup(comm)
    c = MPIComm(comm.mpi_comm, timeout=60)
    with pytest.raises(StepMismatchError, match=rf"rank 0 is in fmoe call #1.*rank {c.size - 1} is in all_reduce"
                                                r"\(max\) #\d+ int64 \[1\], outside any fmoe call"):
        if _last(c):
            c.all_reduce(torch.tensor([16]), "max")
        else:
            fmoe.moe(params, x, spec, comm=c)
    _still_works(c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.int32, torch.bool])
def test_inline_collectives_return_what_the_plain_ones_do(comm, dtype):
    full, off = MPIComm(comm.mpi_comm, checks="full"), MPIComm(comm.mpi_comm, checks="off")
    g = torch.Generator().manual_seed(comm.rank)
    x = (torch.randn(2, 3, generator=g) * 10).to(dtype)
    assert matching.fits(x)
    for op in ("sum", "max", "min"):
        a, b = full.all_reduce(x, op), off.all_reduce(x, op)
        assert a.dtype == b.dtype == dtype, (op, a.dtype, b.dtype)
        if op == "sum" and dtype.is_floating_point:  # summed in rank order, MPI in its own: rounding apart
            assert torch.allclose(a.double(), b.double(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-6), (a, b)
        else:
            assert torch.equal(a, b), (op, a, b)
        # the inline sum is taken from one table in one order: bit-identical on every rank
        assert torch.equal(off.all_reduce(a.double(), "max"), a.double())
    for axis in (0, 1, -1):
        assert torch.equal(full.all_gather(x, axis), off.all_gather(x, axis))
    assert torch.equal(full.all_gather(x[0, 0], 0), off.all_gather(x[0, 0], 0))  # 0-dim: stacked
    rows = torch.arange(comm.size * 2, dtype=torch.float32).reshape(-1, 1) + comm.rank
    cnt = [2] * comm.size
    assert torch.equal(full.all_to_all_v(rows, cnt, cnt), off.all_to_all_v(rows, cnt, cnt))


def test_gloo_checks(comm):
    """TorchDistComm takes the same setting: 'step' and 'full' forwards equal 'off'; 'full' matches collectives."""
    from fmoe.comm import TorchDistComm
    init_gloo(comm)
    with pytest.raises(ValueError, match="checks must be one of"):
        TorchDistComm(checks="partial")
    spec, params, x = _setup(comm)
    outs = {s: fmoe.moe(params, x, spec, comm=TorchDistComm(checks=s))[0] for s in ("off", "step", "full")}
    assert torch.equal(outs["full"], outs["off"]) and torch.equal(outs["step"], outs["off"])
    c = TorchDistComm(checks="step")
    fmoe.moe(params, x, spec, comm=c)
    with pytest.raises(StepMismatchError, match=rf"rank {comm.size - 1} is in end-of-job check #2"):
        end_of_job_check(c) if _last(comm) else fmoe.moe(params, x, spec, comm=c)
    t = TorchDistComm()
    with pytest.raises(CollectiveMismatchError, match="ranks entered different collectives"):
        t.all_gather(torch.ones(3), 0) if _last(comm) else t.all_reduce(torch.ones(3), "sum")
    assert t.all_reduce(torch.ones(2), "sum").tolist() == [comm.size] * 2
