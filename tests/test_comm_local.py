"""Single-process checks of fmoe.comm and fmoe.parallel (the multi-rank ones live in tests/mpi)."""
from __future__ import annotations

import pytest
import torch

from fmoe.comm import LocalComm, all_gather, all_to_all, all_to_all_v, from_env, handle_of, reduce_scatter
from fmoe.comm.layout import a2a_out_shape, chunks_to_front, front_to_concat
from fmoe.comm.agreement import _fingerprint
from fmoe.parallel import ParallelSpec, capacity_alignment, sharding


def test_layout_is_the_jax_all_to_all():
    x = torch.arange(4 * 6 * 2).reshape(4, 6, 2)
    W = 2
    front = chunks_to_front(x, 1, W)
    assert front.shape == (2, 4, 3, 2) and torch.equal(front[1], x[:, 3:])
    assert torch.equal(front_to_concat(front, 0), torch.cat([x[:, :3], x[:, 3:]], 0))
    assert a2a_out_shape((4, 6, 2), 0, 1, 2) == [8, 3, 2]
    with pytest.raises(ValueError, match="not divisible"):
        chunks_to_front(x, 2, 4)


def test_local_comm_collectives_are_identities_and_differentiable():
    c = LocalComm()
    x = torch.randn(4, 3, requires_grad=True)
    for y in (all_to_all(x, c, 1, 0), all_gather(x, c, 0), reduce_scatter(x, c, 0), all_to_all_v(x, c, [4], [4])):
        assert torch.equal(y, x)
    assert handle_of(c) == handle_of(c)
    assert isinstance(from_env("local"), LocalComm)
    with pytest.raises(ValueError, match="kind"):
        from_env("nccl-magic")


def test_parallel_spec_validation_and_sharding():
    assert ParallelSpec(mode="data").degree(4) == 1
    assert ParallelSpec(mode="model").degree(4) == 4
    assert ParallelSpec(mode="adaptive:9").degree(4) == 4  # clamped to s
    assert ParallelSpec(mode="adaptive:0").degree(1) == 0
    with pytest.raises(ValueError, match="divisor"):
        ParallelSpec(mode="adaptive:3").degree(4)
    for bad in ("auto", "adaptive:x", 3):
        with pytest.raises(ValueError):
            ParallelSpec(mode=bad)
    with pytest.raises(ValueError):
        ParallelSpec(overlap_degree=33)
    assert sharding(8, 4) == (2, 1) and sharding(2, 8) == (1, 4)
    with pytest.raises(ValueError):
        sharding(3, 2)
    assert capacity_alignment(2, 8, ParallelSpec(overlap_degree=3)) == 12


def test_fingerprint_is_process_independent():
    import torch.nn.functional as F
    from fmoe import ExpertSpec
    a = _fingerprint({"s": ExpertSpec(hidden_size=4, activation=F.gelu), "k": 2})
    assert a == _fingerprint({"s": ExpertSpec(hidden_size=4, activation=F.gelu), "k": 2})
    assert a != _fingerprint({"s": ExpertSpec(hidden_size=4, activation=F.relu), "k": 2})


@pytest.mark.parametrize("rows_kind", ["none", "runs", "scattered"])
@pytest.mark.parametrize("place_kind", ["none", "runs", "scattered"])
def test_move_rows_equals_index_ops(rows_kind, place_kind):
    """fmoe.comm.layout.move_rows (the communicators' row copies: block copies per run where there are
    few runs, one gather / placement where there are many) equals out[place] = x[rows]."""
    from fmoe.comm.layout import MAX_RUNS, move_rows
    g = torch.Generator().manual_seed(5)
    n = 3 * MAX_RUNS   # rows moved: "runs" has n/40 runs (few), "scattered" about n (many)

    def index(kind, size):   # n entries in [0, size): None, shuffled blocks of 40, or scattered
        if kind == "none":
            return None
        if kind == "scattered":
            return torch.randperm(size, generator=g)[:n].contiguous()
        starts = torch.arange(0, size, 40)[torch.randperm(-(-size // 40), generator=g)]
        return torch.cat([torch.arange(b, min(b + 40, size)) for b in starts.tolist()])[:n].contiguous()

    x = torch.randn(2 * n, 5, generator=g)
    rows, place = index(rows_kind, 2 * n), index(place_kind, n)
    src = x[:n] if rows is None else x
    picked = src if rows is None else src.index_select(0, rows)
    want = picked.clone() if place is None else torch.empty(n, 5).index_copy_(0, place, picked)
    got = torch.full((n, 5), float("nan"))
    move_rows(src, rows, place, got)
    assert torch.equal(got, want)
