"""Issue 36 under mpiexec: input one rank alone can see (NaN/Inf in x or the router, a replayed routing that
does not fit the spec, params that do not fit it) makes every rank raise before any collective (the bad rank
its own error, the others InconsistentRanksError quoting it), and the job goes on: the next clean call equals
one process, and close() is clean. Runs under mpiexec -n 2 (and -n 4)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import fmoe
from fmoe.comm.agreement import InconsistentRanksError
from mpi_backend import MPIComm

from _helpers import allclose, distributed, full_params, local_batch, local_params, make_spec, reference


def _last(comm):
    return comm.rank == comm.size - 1


def _raises_everywhere(c, call, want):
    """The last rank raises ValueError matching want, every other rank InconsistentRanksError quoting it."""
    if _last(c):
        with pytest.raises(ValueError, match=want) as err:
            call()
        assert not isinstance(err.value, InconsistentRanksError), err.value
    else:
        with pytest.raises(InconsistentRanksError, match=rf"invalid input on rank\(s\) {c.size - 1}: ValueError: .*{want}"):
            call()


def _clean_call_matches_one_process(c, spec, full, x):
    y, _ = distributed(spec, local_params(spec, full, c), x, c)
    ref, _ = reference(spec, full, x, c.size)   # each rank routes its own tokens
    allclose(y, ref, "clean call after the error")


@pytest.mark.parametrize("k,normalize,bad", [(1, True, float("nan")), (2, True, float("nan")),
                                             (2, False, float("inf")), (2, True, float("-inf"))])
def test_non_finite_x_on_one_rank_raises_everywhere_and_the_job_goes_on(comm, k, normalize, bad):
    spec = dataclasses.replace(make_spec(2 * comm.size, k, 1.0), normalize_gate=normalize)
    full = full_params(spec)
    c = MPIComm(comm.mpi_comm, timeout=60)
    x = local_batch(c.rank)
    xb = x.clone()
    if _last(c):
        xb[5, 3] = bad
    _raises_everywhere(c, lambda: fmoe.moe(local_params(spec, full, c), xb, spec, comm=c),
                       r"moe: x holds non-finite values \((NaN|Inf)\) in 1 of 16 rows .*first: row 5")
    _clean_call_matches_one_process(c, spec, full, x)
    c.close()   # the end-of-job check passes: every rank made the same calls


def test_non_finite_gate_weight_on_one_rank_raises_everywhere(comm):
    spec = make_spec(2 * comm.size, 1, 1.0)
    full = full_params(spec)
    c = MPIComm(comm.mpi_comm, timeout=60)
    params = local_params(spec, full, c)
    if _last(c):
        params = dict(params, gate={"wg": params["gate"]["wg"].clone().index_fill_(0, torch.tensor([1]), float("nan"))})
    _raises_everywhere(c, lambda: fmoe.moe(params, local_batch(c.rank), spec, comm=c),
                       r"moe: params\['gate'\]\['wg'\] holds non-finite values \(NaN\)")
    _clean_call_matches_one_process(c, spec, full, local_batch(c.rank))
    c.close()


def test_bias_flag_against_held_bias_on_one_rank_raises_everywhere(comm):
    spec = make_spec(2 * comm.size, 2, 1.0)
    full = full_params(spec)
    c = MPIComm(comm.mpi_comm, timeout=60)
    nob = dataclasses.replace(spec, experts=dataclasses.replace(spec.experts, has_fc2_bias=False))
    params = local_params(spec, full, c)   # holds fc2_b on every rank; only the last rank's spec drops it
    # the spec differs across ranks too, but each rank's own pytree check comes first and is quoted
    _raises_everywhere(c, lambda: fmoe.moe(params, local_batch(c.rank), nob if _last(c) else spec, comm=c),
                       r"has_fc2_bias=False but params hold experts\['fc2_b'\]: drop the key or set has_fc2_bias=True")
    _clean_call_matches_one_process(c, spec, full, local_batch(c.rank))


def test_replayed_routing_that_does_not_fit_the_spec_raises_everywhere(comm):
    spec = make_spec(2 * comm.size, 2, 1.0)
    full = full_params(spec)
    c = MPIComm(comm.mpi_comm, timeout=60)
    params = local_params(spec, full, c)
    x = local_batch(c.rank)
    _, aux = fmoe.moe(params, x, spec, comm=c)
    routing = aux.routing
    if _last(c):   # a k=1 routing on the last rank only, the others replay their own k=2 one
        routing = fmoe.top_k_routing(torch.softmax(x.float() @ full["gate"]["wg"].t(), 1), 1, 1.0)
    _raises_everywhere(c, lambda: fmoe.moe(params, x, spec, comm=c, routing=routing),
                       r"injected routing has k=1 pairs per token; this spec's gate has k=2")
    # the routing recorded under the spec replays (the next call works on every rank)
    y1, _ = fmoe.moe(params, x, spec, comm=c)
    y2, _ = fmoe.moe(params, x, spec, comm=c, routing=aux.routing)
    assert torch.equal(y1, y2)
