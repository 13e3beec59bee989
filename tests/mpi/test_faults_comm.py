"""Mismatched collectives and out-of-step ranks raise on every rank (no data returned, no hang),
and the communicator keeps working afterwards. Runs under mpiexec -n 2 and -n 4."""
from __future__ import annotations

import pytest
import torch

from fmoe.comm.agreement import (CollectiveMismatchError, InconsistentRanksError, StepMismatchError,
                                 agree_across_ranks, end_of_job_check)
from mpi_backend import MPIComm


def _still_works(comm):
    assert comm.all_reduce(torch.ones(2), "sum").tolist() == [comm.size] * 2


def _last(comm):
    return comm.rank == comm.size - 1


@pytest.mark.parametrize("timeout", [60.0, None])
def test_all_reduce_meeting_all_gather_raises_on_every_rank(comm, timeout):
    comm = MPIComm(comm.mpi_comm, timeout=timeout)  # blocking and non-blocking collectives alike
    x = torch.arange(3, dtype=torch.float32)
    with pytest.raises(CollectiveMismatchError) as e:
        comm.all_gather(x, 0) if _last(comm) else comm.all_reduce(x, "sum")
    msg = str(e.value)
    assert "ranks entered different collectives" in msg
    assert "rank 0: all_reduce(sum) #" in msg and f"rank {comm.size - 1}: all_gather #" in msg
    _still_works(comm)


@pytest.mark.parametrize("what", ["dtype", "shape", "op"])
def test_same_collective_with_different_dtype_shape_or_op_raises(comm, what):
    x = torch.ones(3)
    op = "sum"
    if _last(comm):
        x = x.double() if what == "dtype" else torch.ones(4) if what == "shape" else x
        op = "max" if what == "op" else op
    with pytest.raises(CollectiveMismatchError, match="with different dtypes/shapes/ops"):
        comm.all_reduce(x, op)
    _still_works(comm)


def test_all_gather_shape_mismatch_raises(comm):
    x = torch.ones(2, 3 if not _last(comm) else 4)
    with pytest.raises(CollectiveMismatchError, match=r"all_gather #\d+ float32 \[2, 3\].*\[2, 4\]"):
        comm.all_gather(x, 0)
    _still_works(comm)


def test_all_to_all_v_counts_that_do_not_pair_raise(comm):
    send = [1] * comm.size
    recv = [1] * comm.size
    if _last(comm):
        recv[0] = 2  # rank 0 sends one row, the last rank expects two
    with pytest.raises(CollectiveMismatchError, match="counts do not pair up"):
        comm.all_to_all_v(torch.ones(comm.size, 2), send, recv)
    _still_works(comm)


def test_bad_argument_on_one_rank_raises_everywhere(comm):
    op = "mean" if _last(comm) else "sum"
    if _last(comm):
        with pytest.raises(ValueError, match="all_reduce op must be one of"):
            comm.all_reduce(torch.ones(2), op)
    else:
        with pytest.raises(InconsistentRanksError, match=f"invalid arguments on rank.*{comm.size - 1}.*'mean'"):
            comm.all_reduce(torch.ones(2), op)
    _still_works(comm)


def test_agreement_kind_mismatch_is_a_step_mismatch(comm):
    c = MPIComm(comm.mpi_comm, timeout=60)
    with pytest.raises(StepMismatchError) as e:
        if _last(comm):
            end_of_job_check(c)
        else:
            agree_across_ranks(c, {"k": 2})
    assert f"rank {comm.size - 1} is in end-of-job check #1" in str(e.value)
    assert "rank 0 is in fmoe call #1" in str(e.value)
    _still_works(comm)


class RawMPI:
    """A user communicator straight over mpi4py, without fmoe's collective headers."""

    def __init__(self, mpi_comm):
        self.mpi_comm, self.rank, self.size = mpi_comm, mpi_comm.Get_rank(), mpi_comm.Get_size()

    def all_gather(self, x, axis=0):
        return torch.cat(self.mpi_comm.allgather(x), axis)


def test_agreement_counter_catches_a_rank_one_call_behind(comm):
    """Every rank's second call pairs with the last rank's first call on that communicator."""
    a, b = RawMPI(comm.mpi_comm), RawMPI(comm.mpi_comm)
    agree_across_ranks(b if _last(comm) else a, {"k": 2})
    with pytest.raises(StepMismatchError) as e:
        agree_across_ranks(a, {"k": 2})
    assert "rank 0 is in fmoe call #2; " in str(e.value)
    assert f"rank {comm.size - 1} is in fmoe call #1" in str(e.value)


def test_agreement_meeting_another_collective_is_reported(comm):
    """A user's own exchange of the same size paired with fmoe's agreement: fmoe's ranks refuse the data."""
    raw = RawMPI(comm.mpi_comm)
    if _last(comm):
        raw.all_gather(torch.zeros(1, 30, dtype=torch.int64))
    else:
        with pytest.raises(CollectiveMismatchError, match=rf"rank\(s\) \[{comm.size - 1}\] answered .* not an "
                                                          "agreement record"):
            agree_across_ranks(raw, {"k": 2})


def test_gloo_mismatch_raises_on_every_rank(comm):
    from fmoe.comm import TorchDistComm
    from _helpers import init_gloo
    init_gloo(comm)
    tdc = TorchDistComm()
    x = torch.ones(3)
    with pytest.raises(CollectiveMismatchError, match="ranks entered different collectives"):
        tdc.all_gather(x, 0) if _last(comm) else tdc.all_reduce(x, "sum")
    send = [1] * comm.size
    recv = [2 if (_last(comm) and u == 0) else 1 for u in range(comm.size)]
    with pytest.raises(CollectiveMismatchError, match="counts do not pair up"):
        tdc.all_to_all_v(torch.ones(comm.size, 2), send, recv)
    assert tdc.all_reduce(torch.ones(2), "sum").tolist() == [comm.size] * 2
