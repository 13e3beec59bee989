"""Routing's slot assignment (spec §6) on CPU: fmoe.routing.assign_slots_torch (pure torch:
a [k*T, E] membership cumsum) against fmoe._slots.assign_slots_fast (what fmoe.routing.assign_slots runs on CPU; an O(k*T)
numba counter walk), at the core configs' shapes. Medians over repeats, one process."""
from __future__ import annotations

from typing import Callable

import torch

from fmoe import _slots
from fmoe.routing import assign_slots_torch as assign_slots

from .bench_core import CONFIGS, median_time


def run(quick: bool, only, log: Callable[[str], None] = print) -> dict:
    repeats = 3 if quick else 7
    out = {}
    for c in CONFIGS:
        if only and only not in (c.name, "routing"):
            continue
        tokens = c.quick_tokens if quick and c.quick_tokens else c.tokens
        g = torch.Generator().manual_seed(0)
        scores = torch.rand(tokens, c.experts, generator=g)
        ids = torch.topk(scores, c.k, dim=1).indices.t().contiguous()
        assert all(torch.equal(a, b) for a, b in zip(assign_slots(ids, c.experts),
                                                      _slots.assign_slots_fast(ids, c.experts, None)))
        t_torch = median_time(lambda: assign_slots(ids, c.experts), repeats)
        t_numba = median_time(lambda: _slots.assign_slots_fast(ids, c.experts, None), repeats)
        out[c.name] = {"tokens": tokens, "torch_seconds": t_torch, "numba_seconds": t_numba,
                       "speedup": t_torch / t_numba}
        log(f"  routing {c.name}: torch {t_torch * 1e3:.2f} ms, numba {t_numba * 1e3:.3f} ms "
            f"({t_torch / t_numba:.0f}x)")
    return out
