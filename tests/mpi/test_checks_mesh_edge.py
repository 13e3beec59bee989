"""Parameters that do not fit the spec and the communicator (or a mesh's expert group) are refused up front,
on every rank, with a message naming the counts and the fix. Runs under mpiexec -n 2 and -n 4."""
from __future__ import annotations

import pytest
import torch

import fmoe
from fmoe.comm.agreement import InconsistentRanksError
from fmoe.parallel import shard_experts
from mpi_backend import MPIComm

from _helpers import H, full_params, local_batch, local_params, make_spec

FIX = r"pass fmoe\.parallel\.shard_experts\('ffn', full_experts, \d+, comm\.rank, comm\.size\) or fmoe\.init_params\(spec, comm=comm\)"


def _last(comm):
    return comm.rank == comm.size - 1


def _still_works(comm):
    assert comm.all_reduce(torch.ones(2), "sum").tolist() == [comm.size] * 2


@pytest.mark.parametrize("checks", ["full", "step"])
def test_all_experts_on_every_rank_are_refused(comm, checks):
    """The issue's case: a pytree of all E experts where E/W are expected (was torch's bmm size error)."""
    c = MPIComm(comm.mpi_comm, timeout=60, checks=checks)
    W = c.size
    E = 2 * W
    spec = make_spec(E, 2, 1.0)
    params = full_params(spec)
    with pytest.raises(ValueError, match=rf"experts\['fc1_w'\] \[{E}, {H}, 8\] holds all {E} experts on rank "
                                         rf"{c.rank} of {W} \(the layout of 1 rank\); MoESpec.num_experts={E} on "
                                         rf"{W} ranks needs 2 per rank: {FIX}"):
        fmoe.moe(params, local_batch(c.rank), spec, comm=c)
    _still_works(c)


def test_one_rank_with_the_wrong_pytree_makes_every_rank_raise(comm):
    W = comm.size
    spec = make_spec(2 * W, 2, 1.0)
    full = full_params(spec)
    params = full if _last(comm) else local_params(spec, full, comm)
    want = rf"holds all {2 * W} experts on rank {W - 1} of {W}.*needs 2 per rank"
    if _last(comm):
        with pytest.raises(ValueError, match=want):
            fmoe.moe(params, local_batch(comm.rank), spec, comm=comm)
    else:
        with pytest.raises(InconsistentRanksError, match=rf"invalid input on rank\(s\) {W - 1}: ValueError: .*{want}"):
            fmoe.moe(params, local_batch(comm.rank), spec, comm=comm)
    _still_works(comm)


def test_a_leading_dim_that_fits_no_layout(comm):
    W = comm.size
    E = 2 * W
    spec = make_spec(E, 2, 1.0)
    experts = {k: v[:3] for k, v in full_params(spec)["experts"].items()}  # 3 does not divide 2W (W = 2, 4)
    params = {"gate": full_params(spec)["gate"], "experts": experts}
    with pytest.raises(ValueError, match=rf"holds 3 experts on rank {comm.rank} of {W} \(which fits no layout of {E} "
                                         rf"experts.*needs 2 per rank: {FIX}"):
        fmoe.moe(params, local_batch(comm.rank), spec, comm=comm)
    _still_works(comm)


def test_a_world_size_that_does_not_fit_the_expert_count(comm):
    W = comm.size
    E = W + 1  # neither divides the other for W = 2, 4
    spec = make_spec(E, 1, 1.0)
    params = full_params(spec)
    with pytest.raises(ValueError, match=rf"{E} experts cannot be spread evenly over {W} ranks \(need E % W == 0 or "
                                         rf"W % E == 0\): use MoESpec.num_experts in \[.*\] for {W} ranks, or a "
                                         rf"world size in \[.*\] for {E} experts"):
        fmoe.moe(params, local_batch(comm.rank), spec, comm=comm)
    _still_works(comm)


def test_the_whole_of_a_shared_expert_is_refused(comm):
    """E < W: each of s = W/E ranks holds 1/s of one expert's hidden units; the whole expert is not that."""
    W = comm.size
    E, s = W // 2, 2
    spec = make_spec(E, 1, 1.0)
    full = full_params(spec)
    mine = local_params(spec, full, comm)
    whole = {k: v[comm.rank // s:comm.rank // s + 1] for k, v in full["experts"].items()}
    with pytest.raises(ValueError, match=rf"experts\['fc1_w'\] \[1, {H}, 8\] holds the whole expert \(hidden units "
                                         rf"along dim 1\) on rank {comm.rank} of {W}; {E} experts? on {W} ranks (are "
                                         rf"each|is) shared by {s} ranks, so each rank holds shard {comm.rank % s} of "
                                         rf"expert {comm.rank // s}: {H // s} of {H} hidden units: {FIX}"):
        fmoe.moe({"gate": full["gate"], "experts": whole}, local_batch(comm.rank), spec, comm=comm)
    y, _ = fmoe.moe(mine, local_batch(comm.rank), spec, comm=comm)  # the right shard runs
    assert y.shape == (16, 8)


def test_a_shard_where_whole_experts_are_expected(comm):
    W = comm.size
    spec = make_spec(W, 1, 1.0)
    full = full_params(spec)
    halves = shard_experts("ffn", full["experts"], W, comm.rank, 2 * W)  # the E < W layout of twice the ranks
    with pytest.raises(ValueError, match=rf"experts\['fc1_w'\] \[1, {H // 2}, 8\] has {H // 2} hidden units along "
                                         rf"dim 1 on rank {comm.rank} of {W}; whole experts \({W} experts on {W} "
                                         rf"ranks\) need all {H}"):
        fmoe.moe({"gate": full["gate"], "experts": halves}, local_batch(comm.rank), spec, comm=comm)
    _still_works(comm)


def test_mesh_expert_group_sizes_are_checked(comm):
    """Through a (dp, ep) mesh made by splits: the expert group, not the world, sets the per-rank count."""
    from fmoe.comm.mesh import mesh_from_comm
    W = comm.size
    ep = 2
    m = mesh_from_comm(comm, ep=ep, dp=W // ep)
    E = 4
    spec = make_spec(E, 2, 1.0)
    full = full_params(spec)
    with pytest.raises(ValueError, match=rf"holds all {E} experts on rank {m.ep_rank} of {ep} .*MoESpec.num_experts="
                                         rf"{E} on {ep} ranks needs 2 per rank"):
        fmoe.moe(full, local_batch(comm.rank), spec, comm=m.ep_comm)
    y, _ = fmoe.moe(local_params(spec, full, m.ep_comm), local_batch(comm.rank), spec, comm=m.ep_comm)
    assert y.shape == (16, 8)
    spec3 = make_spec(3, 1, 1.0)
    with pytest.raises(ValueError, match=r"3 experts cannot be spread evenly over 2 ranks"):
        fmoe.moe(full_params(spec3), local_batch(comm.rank), spec3, comm=m.ep_comm)
    _still_works(m.ep_comm)
