"""Checkpoint round trip 1 -> 2 -> 4 -> 1 ranks: same outputs at every world size, bytes unchanged."""
from __future__ import annotations

import torch

import fmoe
from fmoe import checkpoint as ck
from _helpers import allclose, full_params, local_batch, make_spec


def test_round_trip_between_world_sizes(comm):
    spec = make_spec(2, 2, 1.0)  # W=4: one expert per 2 ranks (sharded layout)
    full = ck.state_dict_from_params(full_params(spec), 2, prefix="moe")
    x = local_batch(comm.rank)
    y1, _ = fmoe.moe(ck.params_from_state_dict(full), x, spec)
    state = full
    for size in [s for s in (2, 4) if s <= comm.size]:
        parts = ck.scatter(state, size)
        sub = comm.split(comm.rank // size)  # groups of `size` ranks each run the converted model
        mine = ck.params_from_state_dict(parts[sub.rank])
        y, _ = fmoe.moe(mine, x, spec, comm=sub)
        allclose(y, y1, f"outputs with {size} ranks vs 1")
        state = ck.gather(parts)
    for k, v in full.items():
        assert torch.equal(state[k], v), k
