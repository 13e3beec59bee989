"""Expert parallel == single process on each rank's local batch, for every mode.

Outputs on each rank equal single-process fmoe on that rank's tokens with the
same global parameters; expert-parameter gradients equal the sum over ranks of
the single-process gradients (cut to this rank's shard); gate gradients are
per rank (the layer does not reduce them).
"""
from __future__ import annotations

import pytest
import torch

from fmoe.parallel import ParallelSpec, shard_experts, sharding
from _helpers import M, allclose, distributed, full_params, local_batch, local_params, make_spec, reference


def _expert_counts(W):
    return sorted({2 * W, W, max(W // 2, 1), 1}, reverse=True)


def _modes(s):
    return [0] + [q for q in range(1, s + 1) if s % q == 0]


def _check(comm, spec, parallel, expert_type="ffn", atol=1e-10):
    W = comm.size
    full = full_params(spec)
    x = local_batch(comm.rank)
    cot = torch.randn(x.shape[0], spec.output_dim, generator=torch.Generator().manual_seed(7 + comm.rank),
                      dtype=torch.float64)
    yd, gd = distributed(spec, local_params(spec, full, comm), x, comm, parallel, cot)
    yr, gr = reference(spec, full, x, W, parallel, cot)
    tag = f"E={spec.num_experts} k={spec.gate.k} cf={spec.gate.capacity_factor} {parallel}"
    allclose(yd, yr, f"output {tag}", atol)
    summed = {k: comm.all_reduce(v, "sum") for k, v in gr["experts"].items()}
    mine = shard_experts(expert_type, summed, spec.num_experts, comm.rank, W)
    for k in mine:
        allclose(gd["experts"][k], mine[k], f"grad experts.{k} {tag}", atol)
    for k in gr["gate"]:
        allclose(gd["gate"][k], gr["gate"][k], f"grad gate.{k} {tag}", atol)


@pytest.mark.parametrize("cf", [1.0, 0.0, -0.5])
@pytest.mark.parametrize("k", [1, 2])
def test_every_mode_matches_single_process(comm, k, cf):
    for E in _expert_counts(comm.size):
        _, s = sharding(E, comm.size)
        for r in _modes(s):
            _check(comm, make_spec(E, k, cf), ParallelSpec(mode=f"adaptive:{r}"))


@pytest.mark.parametrize("mode", ["data", "model"])
def test_named_modes_and_gated_experts(comm, mode):
    for E in _expert_counts(comm.size):
        _check(comm, make_spec(E, 2, 1.0, expert_type="gated_ffn"), ParallelSpec(mode=mode), "gated_ffn")
        _check(comm, make_spec(E, 2, 1.0, postscore=False), ParallelSpec(mode=mode))


def test_overlap_and_2dh_equal_flat_bit_for_bit(comm):
    W = comm.size
    for E in _expert_counts(W):
        spec = make_spec(E, 2, 1.0)
        full = full_params(spec)
        local = local_params(spec, full, comm)
        x = local_batch(comm.rank)
        _, s = sharding(E, W)
        for r in _modes(s):
            base = ParallelSpec(mode=f"adaptive:{r}", overlap_degree=2)
            y_flat, _ = distributed(spec, local, x, comm, base)
            y_2dh, _ = distributed(spec, local, x, comm, ParallelSpec(mode=base.mode, overlap_degree=2,
                                                                      local_size=2))
            assert torch.equal(y_flat, y_2dh), f"2DH differs from flat: E={E} r={r}"
        # d=2 vs d=1: same numbers up to GEMM-shape rounding
        y1, _ = distributed(spec, local, x, comm, ParallelSpec(overlap_degree=1))
        y2, _ = distributed(spec, local, x, comm, ParallelSpec(overlap_degree=2))
        yr, _ = reference(spec, full, x, W, ParallelSpec(overlap_degree=2))
        allclose(y2, yr, f"overlap d=2 vs reference E={E}")
        # different alignment (s vs 2s) may change C but never the kept tokens when cf > 0 is large enough
        allclose(y1, y2, f"overlap d=1 vs d=2 E={E}")


def test_mode_switch_needs_no_resharding(comm):
    """One parameter pytree, every r, per call: identical outputs (nothing sticky)."""
    E = max(comm.size // 2, 1)
    spec = make_spec(E, 2, 0.0)
    local = local_params(spec, full_params(spec), comm)
    x = local_batch(comm.rank)
    _, s = sharding(E, comm.size)
    ys = [distributed(spec, local, x, comm, ParallelSpec(mode=f"adaptive:{r}"))[0] for r in _modes(s) * 2]
    for y in ys[1:]:
        allclose(y, ys[0], "mode switch")


@pytest.mark.parametrize("checks", ["step", "off"])
def test_every_checks_setting_matches_single_process(comm, checks):
    """'step' and 'off' move the same data as the default 'full' (sharded, ragged and overlapped paths too)."""
    from mpi_backend import MPIComm
    c = MPIComm(comm.mpi_comm, timeout=60, checks=checks)
    for E in _expert_counts(comm.size):
        _, s = sharding(E, comm.size)
        _check(c, make_spec(E, 2, 1.0), ParallelSpec(mode="model"))
        if E >= comm.size:
            _check(c, make_spec(E, 2, 0.0), ParallelSpec())
    _check(c, make_spec(2 * comm.size, 1, 1.0), ParallelSpec(overlap_degree=2))
