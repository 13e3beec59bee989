"""Routing statistics as pure functions of a :class:`~fmoe.Routing` (and scores).

    y, aux = fmoe.moe(params, x, spec)
    st = fmoe.stats.summarize(aux)            # RoutingStats, a pytree of tensors
    print(fmoe.stats.format_table(st))        # one row per expert + totals

Every function is plain torch (comparisons with ``arange``, sums), so it works
under ``torch.func.vmap``: a sweep over settings gets one stats row per setting
for free. Nothing here synchronises with the host.

Definitions (E experts, k slots, T tokens; "pairs" are (token, slot) choices):

* ``routed[e]``: pairs sent to e before capacity (= ``routing.counts``).
* ``load[e]``: pairs that landed in e's buffer (after capacity).
* ``dropped_fraction``: pairs lost to capacity / valid pairs (masked ids
  excluded); 0 when there are no valid pairs.
* ``load_cv``: coefficient of variation std/mean of ``routed`` over the active
  experts, with the *population* std (divisor E): the load vector is the whole
  population of experts, not a sample. 0 means perfectly balanced. (Tutel's
  load/importance *loss* uses the unbiased variance; this is a statistic.)
* ``load_entropy``: entropy (nats) of ``routed / sum(routed)``; ln E when balanced.
* ``score_entropy``: mean over tokens of the entropy (nats) of the routing
  score row; needs the scores, so it is NaN when they are not given.
* ``importance[e]``: mean score of expert e over tokens (NaN without scores).

An ``active`` bool [E] mask restricts the balance statistics to a subset of
experts (used by :mod:`fmoe.ablate` when it sweeps the number of experts by
masking).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from .routing import Routing

__all__ = [
    "RoutingStats",
    "expert_load",
    "dropped_fraction",
    "load_cv",
    "load_entropy",
    "score_entropy",
    "importance",
    "routing_stats",
    "summarize",
    "format_table",
]


@dataclasses.dataclass(frozen=True, eq=False)
class RoutingStats:
    """Statistics of one routing (a pytree; every field a tensor).

    Attributes:
        routed: float64 [E] pairs per expert before capacity.
        load: float64 [E] pairs per expert after capacity (kept).
        dropped: float64 [] pairs lost to capacity.
        dropped_fraction: float64 [] dropped / valid pairs.
        load_cv: float64 [] std/mean of ``routed`` over active experts.
        load_entropy: float64 [] entropy (nats) of the routed distribution.
        score_entropy: float64 [] mean per-token score entropy (NaN without scores).
        importance: float64 [E] mean score per expert (NaN without scores).
    """

    routed: Tensor
    load: Tensor
    dropped: Tensor
    dropped_fraction: Tensor
    load_cv: Tensor
    load_entropy: Tensor
    score_entropy: Tensor
    importance: Tensor

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


_FIELDS = [f.name for f in dataclasses.fields(RoutingStats)]
pytree.register_pytree_node(
    RoutingStats,
    lambda s: ([getattr(s, n) for n in _FIELDS], None),
    lambda leaves, _: RoutingStats(*leaves),
    serialized_type_name="fmoe.stats.RoutingStats",
)

# float64 throughout: counts up to 2**53 stay exact and the statistics of a
# sweep are compared across settings, where float32 rounding would be noise.
_F = torch.float64


def _per_expert(ids: Tensor, keep: Tensor, num_experts: int) -> Tensor:
    experts = torch.arange(num_experts, device=ids.device)
    hit = (ids.reshape(-1, 1) == experts) & keep.reshape(-1, 1)
    return hit.to(_F).sum(0)


def expert_load(routing: Routing, *, after_capacity: bool = True) -> Tensor:
    """float64 [E]: pairs per expert, after capacity (kept) or before (routed)."""
    keep = routing.kept() if after_capacity else routing.expert_ids >= 0
    return _per_expert(routing.expert_ids, keep, routing.num_experts)


def dropped_fraction(routing: Routing) -> Tensor:
    """float64 []: pairs lost to capacity over valid pairs (0 if none are valid)."""
    valid = (routing.expert_ids >= 0).to(_F).sum()
    dropped = routing.dropped_mask().to(_F).sum()
    return dropped / valid.clamp(min=1)


def _masked(v: Tensor, active: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    if active is None:
        return v, v.new_tensor(float(v.shape[-1]))
    active = active.to(torch.bool)
    return torch.where(active, v, torch.zeros_like(v)), active.to(_F).sum()


def load_cv(load: Tensor, active: Optional[Tensor] = None) -> Tensor:
    """float64 []: population std / mean of ``load`` [E] over ``active`` experts.

    0 when the load is empty (nothing routed) rather than NaN, so that a sweep
    table stays finite.
    """
    v, n = _masked(load.to(_F), active)
    mean = v.sum() / n
    dev = v - mean
    if active is not None:
        dev = torch.where(active.to(torch.bool), dev, torch.zeros_like(dev))
    std = (dev.square().sum() / n).sqrt()
    return torch.where(mean > 0, std / torch.where(mean > 0, mean, torch.ones_like(mean)),
                       torch.zeros_like(mean))


def _entropy(p: Tensor, dim: int = -1) -> Tensor:
    # 0 * log 0 = 0; the inner where keeps log's gradient finite too.
    safe = torch.where(p > 0, p, torch.ones_like(p))
    return -(torch.where(p > 0, p * safe.log(), torch.zeros_like(p))).sum(dim)


def load_entropy(load: Tensor, active: Optional[Tensor] = None) -> Tensor:
    """float64 []: entropy (nats) of ``load / load.sum()``; ln(#active) when balanced."""
    v, _ = _masked(load.to(_F), active)
    total = v.sum()
    return _entropy(v / torch.where(total > 0, total, torch.ones_like(total)))


def score_entropy(scores: Tensor) -> Tensor:
    """float64 []: mean over tokens of the entropy (nats) of each score row [T, E].

    Rows are renormalised first, so sigmoid scores are treated as a distribution
    over experts too.
    """
    p = scores.to(_F)
    p = p / p.sum(-1, keepdim=True).clamp(min=torch.finfo(_F).tiny)
    return _entropy(p).mean()


def importance(scores: Tensor) -> Tensor:
    """float64 [E]: mean score of each expert over tokens."""
    return scores.to(_F).mean(0)


def routing_stats(routing: Routing, scores: Optional[Tensor] = None, *,
                  active: Optional[Tensor] = None) -> RoutingStats:
    """All statistics of one routing.

    Args:
        routing: the routing (e.g. ``aux.routing``).
        scores: optional float [T, E] routing scores (for the entropy and
            importance); NaN fields without them.
        active: optional bool [E]: experts that count for the balance stats.
    """
    routed = expert_load(routing, after_capacity=False)
    load = expert_load(routing, after_capacity=True)
    dropped = routing.dropped_mask().to(_F).sum()
    E = routing.num_experts
    if scores is None:
        nan = torch.tensor(math.nan, dtype=_F, device=routed.device)
        ent, imp = nan, torch.full((E,), math.nan, dtype=_F, device=routed.device)
    else:
        if scores.dim() != 2 or scores.shape[1] != E:
            raise ValueError(f"routing_stats: scores must be [T, E] with E={E}, got {tuple(scores.shape)}")
        ent, imp = score_entropy(scores), importance(scores)
    return RoutingStats(routed, load, dropped, dropped_fraction(routing), load_cv(routed, active),
                        load_entropy(routed, active), ent, imp)


def summarize(aux, scores: Optional[Tensor] = None) -> RoutingStats:
    """Statistics of an :class:`~fmoe.MoEAux` (or a bare :class:`~fmoe.Routing`).

    Uses ``aux.scores`` when the aux carries them and ``scores`` is not given.
    """
    routing = aux if isinstance(aux, Routing) else aux.routing
    if scores is None:
        scores = getattr(aux, "scores", None)
    return routing_stats(routing, scores)


def _fmt(v: float) -> str:
    if math.isnan(v):
        return "-"
    if float(v).is_integer() and abs(v) < 1e9:
        return str(int(v))
    return f"{v:.4g}"


def format_table(stats, *, title: Optional[str] = None) -> str:
    """A plain-text table: one row per expert, then the scalar statistics.

    Args:
        stats: a :class:`RoutingStats` (unbatched), or a dict of named
            RoutingStats (e.g. one per layer), shown as one block each.
    """
    if isinstance(stats, dict):
        return "\n\n".join(format_table(s, title=str(name)) for name, s in stats.items())
    if stats.routed.dim() != 1:
        raise ValueError("format_table: expects one routing's stats; index a batched RoutingStats first")
    E = stats.routed.shape[0]
    total = float(stats.routed.sum())
    head = f"{'expert':>6} {'routed':>8} {'kept':>8} {'share':>7} {'importance':>10}"
    lines = ([title] if title else []) + [head, "-" * len(head)]
    for e in range(E):
        r, kept = float(stats.routed[e]), float(stats.load[e])
        share = f"{r / total:.3f}" if total > 0 else "-"
        lines.append(f"{e:>6} {_fmt(r):>8} {_fmt(kept):>8} {share:>7} {_fmt(float(stats.importance[e])):>10}")
    lines.append("-" * len(head))
    lines.append(f"dropped {_fmt(float(stats.dropped))} ({float(stats.dropped_fraction):.2%})  "
                 f"load_cv {float(stats.load_cv):.4f}  load_entropy {float(stats.load_entropy):.4f} "
                 f"(max {math.log(E):.4f})  score_entropy {_fmt(float(stats.score_entropy))}")
    return "\n".join(lines)
