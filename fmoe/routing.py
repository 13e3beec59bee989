"""Top-k routing with capacity: the `Routing` pytree and the functions that build it.

Semantics follow ../shared/spec/routing.md (§5–§8): slot-major location order,
three capacity-factor modes, alignment, gate normalisation for k > 1 *before*
dropping, negative expert ids as masked tokens, and per-expert counts taken
before capacity clipping.

Everything here is pure torch (topk, cumsum, comparisons with ``arange``) so it
composes with ``torch.func`` transforms. The only host synchronisation is the
dropless capacity (``capacity_factor <= 0``), which needs ``max(counts)`` as a
Python int because it sets a buffer shape.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import os
from typing import Optional

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from . import _io, _slots, _slots_vmap

__all__ = [
    "Routing",
    "top_k",
    "assign_slots",
    "capacity_for",
    "make_routing",
    "top_k_routing",
    "validate_routing",
]


@dataclasses.dataclass(frozen=True, eq=False)
class Routing:
    """Where every (slot, token) pair goes. A pytree: tensors are leaves.

    Attributes:
        expert_ids: int64 [k, T]. Expert of slot j of token t; slot 0 is the
            best expert. Negative ids mark masked pairs (skipped everywhere).
        slots: int64 [k, T]. Location of the pair inside its expert's buffer,
            counted before capacity clipping; ``slots >= capacity`` means the
            pair is dropped. -1 where ``expert_ids`` is negative.
        weights: float [k, T]. Gate values (normalised for k > 1 if asked).
        counts: int64 [E]. Pairs routed to each expert before dropping
            (Tutel's ``dispatch_count``).
        capacity: static int C, rows per expert buffer.
        num_experts: static int E.
    """

    expert_ids: Tensor
    slots: Tensor
    weights: Tensor
    counts: Tensor
    capacity: int
    num_experts: int

    def __post_init__(self):
        # Runs for Routing(...), dataclasses.replace and pytree unflatten alike.
        validate_routing(self)

    def __repr__(self) -> str:
        # shapes, not every element (a T=128 routing printed ~9 kB)
        def brief(t):
            return f"{t.dtype}{list(t.shape)}".replace("torch.", "") if isinstance(t, Tensor) else repr(t)
        batch = f"batch={list(self.expert_ids.shape[:-2])}, " if self.expert_ids.dim() > 2 else ""
        return (f"Routing({batch}k={self.expert_ids.shape[-2]}, T={self.expert_ids.shape[-1]}, "
                f"num_experts={self.num_experts}, "
                f"capacity={self.capacity}, expert_ids={brief(self.expert_ids)}, slots={brief(self.slots)}, "
                f"weights={brief(self.weights)}, counts={brief(self.counts)})")

    @property
    def k(self) -> int:
        return self.expert_ids.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.expert_ids.shape[1]

    def kept(self) -> Tensor:
        """bool [k, T]: pairs that land in a buffer (valid and within capacity)."""
        return (self.expert_ids >= 0) & (self.slots < self.capacity)

    def dropped_mask(self) -> Tensor:
        """bool [k, T]: valid pairs lost to capacity."""
        return (self.expert_ids >= 0) & (self.slots >= self.capacity)

    def num_dropped(self) -> Tensor:
        """int64 []: number of (token, expert) pairs lost to capacity."""
        return self.dropped_mask().sum()

    def positions(self) -> Tensor:
        """int64 [k, T]: flat row ``e * C + slot`` in the [E*C, M] buffer, -1 if not kept."""
        pos = self.expert_ids * self.capacity + self.slots
        return torch.where(self.kept(), pos, -1)

    def reversed_ids(self, what: str = "sample_id") -> Tensor:
        """int64 [E, C]: which token ('sample_id') or slot j ('top_id') fills each
        buffer row, -1 where empty (Tutel's ``get_reversed_sample_ids``)."""
        if what not in ("sample_id", "top_id"):
            raise ValueError(f"reversed_ids: what must be 'sample_id' or 'top_id', got {what!r}")
        k, T = self.expert_ids.shape
        rows = self.num_experts * self.capacity
        pos = self.positions().reshape(-1)
        if what == "sample_id":
            src = torch.arange(T, device=pos.device).expand(k, T).reshape(-1)
        else:
            src = torch.arange(k, device=pos.device)[:, None].expand(k, T).reshape(-1)
        out = torch.full((rows + 1,), -1, dtype=torch.int64, device=pos.device)
        out = out.index_copy(0, torch.where(pos >= 0, pos, rows), src)
        out[rows] = -1
        return out[:rows].reshape(self.num_experts, self.capacity)

    def save(self, path) -> None:
        """Write this routing to ``path`` (torch.save of plain tensors and ints), atomically."""
        _io.atomic_save(_routing_to_dict(self), path)

    @staticmethod
    def load(path, map_location=None) -> "Routing":
        """Read a routing written by :meth:`save`; the result is validated like any Routing."""
        d = torch.load(path, map_location=map_location, weights_only=True)
        try:
            return _routing_from_dict(d)
        except (TypeError, ValueError) as e:
            raise type(e)(f"Routing.load({os.fspath(path)!r}): {e}") from None


@dataclasses.dataclass(frozen=True, eq=False)
class KeptRows:
    """A CPU routing's kept pairs sorted by expert, made with it in one native call
    (:func:`fmoe.routers.route_native`), for the rows plan of the same call
    (:func:`fmoe.engine.plan.make_plan`'s ``rows``); not part of the Routing's value.

    Attributes:
        tokens: int64 [N] token of each row. pairs: int64 [N] flat pair index ``j * T + t``.
        bounds: the E + 1 row offsets as host ints. dropped: int64 [] pairs over capacity.
        offsets: int64 [E + 1] the same offsets. row_gates: [N] each row's gate weight in the
            routing's weight dtype, or None where the gates are made after the call (gpt_oss).
    """

    tokens: Tensor
    pairs: Tensor
    bounds: tuple
    dropped: Tensor
    offsets: Tensor
    row_gates: Optional[Tensor]

    def gates(self, weights: Tensor) -> Tensor:
        """[N] each row's gate weight from the routing's [k, T] ``weights``: the native route's
        ``row_gates`` (the same values, gathered with the rows) where it made them and ``weights``
        needs no gradient, else gathered from ``weights`` (differentiable)."""
        if self.row_gates is not None and not weights.requires_grad:
            return self.row_gates
        return weights.reshape(-1).index_select(0, self.pairs)


def _routing_to_dict(r: Routing) -> dict:
    return {f.name: getattr(r, f.name) for f in dataclasses.fields(r)}


def _routing_from_dict(d: dict) -> Routing:
    names = [f.name for f in dataclasses.fields(Routing)]
    if not isinstance(d, dict) or sorted(d) != sorted(names):
        got = sorted(d) if isinstance(d, dict) else type(d).__name__
        raise ValueError(f"not a saved Routing: expected the keys {names}, got {got}")
    return Routing(**{n: d[n] for n in names})


# A pair fills at most one buffer row, so capacity beyond k*T rows only adds padding. Padded mode
# legitimately exceeds it (capacity_factor > 1 with few experts, alignment), so the bound is generous:
# C <= MAX_CAPACITY_PER_PAIR * max(k*T, 1) + slack. Above it the buffers would be almost all padding
# (capacity_factor=1e6 asked for gigabytes); that is refused with a clear error. capacity_for knows the
# group's T* and uses slack 1024; a Routing only knows its own T (a rank's ragged last batch may be
# much smaller than T*), so it allows slack 65536 rows on top.
MAX_CAPACITY_PER_PAIR = 64
_ALIGN_SLACK = 1024
_RAGGED_SLACK = 65536


def capacity_bound(k: int, num_tokens: int, slack: int = _ALIGN_SLACK) -> int:
    """The largest capacity fmoe computes for k slots and T tokens: ``64 * max(k*T, 1) + 1024``.

    A :class:`Routing` accepts up to ``64 * max(k*T, 1) + 65536`` (its T is local; capacity may come
    from the group's larger T*)."""
    return MAX_CAPACITY_PER_PAIR * max(int(k) * int(num_tokens), 1) + slack


def _plain_tensor(t: Tensor) -> bool:
    """True for an ordinary eager tensor whose values may be read (not traced, vmapped, fake or meta)."""
    if torch.compiler.is_compiling() or t.device.type == "meta":
        return False
    if torch._C._functorch.is_functorch_wrapped_tensor(t):
        return False
    return type(t) is torch.Tensor or type(t) is torch.nn.Parameter


def check_finite(t: Tensor, name: str, why: str) -> None:
    """Raise ValueError naming ``name`` if t holds NaN or Inf (one sum, one host read).

    Inside torch.func transforms the values are read from the tensor under the wrappers (a
    vmapped tensor: every example at once). Under torch.compile the check is skipped: a
    data-dependent raise would break the graph (run the step eagerly once to check it).

    Args:
        t: float [..., N]; rows are its last-dim slices (tokens for x or logits).
        name: what t is, for the message ("x", "router logits").
        why: the likely cause and the fix, appended to the message.
    """
    if torch.compiler.is_compiling():
        return
    F = torch._C._functorch
    while F.is_functorch_wrapped_tensor(t):
        t = F.get_unwrapped(t)
    if t.device.type == "meta" or not t.numel():
        return
    # A NaN/Inf makes the sum non-finite; one read of t, no [T, N] mask (2-3x cheaper than
    # isfinite().all()), and the test runs on the host's copy of the sum (one op, not two). A sum
    # that overflowed on finite values is told apart below. (A detached sum records no graph, as
    # under no_grad, without entering and leaving that context on every call.)
    if math.isfinite((t.detach() if t.requires_grad else t).sum().item()):
        return
    with torch.no_grad():
        bad = ~torch.isfinite(t.reshape(-1, t.shape[-1])).all(dim=1)
        if not bool(bad.any()):
            return
        rows, first, nan = int(bad.sum()), int(bad.nonzero()[0, 0]), bool(torch.isnan(t).any())
    raise ValueError(f"{name} holds non-finite values ({'NaN' if nan else 'Inf'}) in {rows} of {bad.numel()} rows "
                     f"[..., {t.shape[-1]}] (first: row {first}); {why}")


def _int_like(v) -> bool:
    return isinstance(v, (int, torch.SymInt)) and not isinstance(v, bool)


def _trusted_routing(expert_ids, slots, weights, counts, capacity: int, num_experts: int, *,
                     shapes: bool = True) -> "Routing":
    """A Routing built by :func:`make_routing`, whose values are right by construction: only the cheap
    shape/dtype checks run (the value-range pass costs ~0.1-0.3 ms at T=4096 and is for routings made
    by hand, replaced or loaded). ``shapes=False`` skips those too, for fields that hold them by
    construction: a router's ids and gates (one top-k), the slot walk's slots and counts and a
    capacity from :func:`capacity_for` (which keeps it within a Routing's bound)."""
    r = object.__new__(Routing)
    r.__dict__.update(expert_ids=expert_ids, slots=slots, weights=weights, counts=counts, capacity=capacity,
                      num_experts=num_experts)
    if shapes:
        validate_routing(r, values=False)
    return r


def validate_routing(r: "Routing", *, values: bool = True) -> None:
    """Check a Routing's fields against each other; raise ValueError/TypeError naming the problem.

    Always (cheap, safe under vmap and torch.compile): every leaf is a tensor;
    ``expert_ids``, ``slots``, ``weights`` all [k, T]; ``counts`` [E]; integer
    ids/slots/counts and floating weights; int ``capacity`` in
    ``[0, 64 * max(k*T, 1) + 65536]`` and int ``num_experts >= 1``.

    On plain eager tensors only (one host sync; skipped while tracing, under
    vmap/grad transforms and for fake/meta tensors): ids in ``[-1, E)``, where
    ``-1`` (any negative) marks a masked pair; slots of valid pairs in
    ``[0, k*T)``; counts non-negative with ``sum(counts) <= k*T``.

    Leaves that are ints or None (pytree plumbing, e.g. vmap in_dims trees)
    skip the tensor checks. ``values=False`` skips the value pass.
    """
    leaves = {n: getattr(r, n) for n in _LEAVES}
    if any(v is None or _int_like(v) for v in leaves.values()):
        return
    for n, v in leaves.items():
        if not isinstance(v, Tensor):
            raise TypeError(f"Routing.{n} must be a torch.Tensor, got {type(v).__name__}")
    ids, slots, w, counts = (leaves[n] for n in _LEAVES)
    if not _int_like(r.num_experts) or r.num_experts < 1:
        raise ValueError(f"Routing.num_experts must be an int >= 1, got {r.num_experts!r}")
    if not _int_like(r.capacity) or r.capacity < 0:
        raise ValueError(f"Routing.capacity must be an int >= 0, got {r.capacity!r}")
    if ids.dim() != 2:
        raise ValueError(f"Routing.expert_ids must be [k, T], got shape {list(ids.shape)}")
    k, T = ids.shape
    for n, v in (("slots", slots), ("weights", w)):
        if v.shape != ids.shape:
            raise ValueError(f"Routing.{n} has shape {list(v.shape)} but expert_ids is [k, T] = {[k, T]}; "
                             "all three must match")
    if counts.dim() != 1 or counts.shape[0] != r.num_experts:
        raise ValueError(f"Routing.counts must be [E] = [{r.num_experts}], got shape {list(counts.shape)}")
    for n, v in (("expert_ids", ids), ("slots", slots), ("counts", counts)):
        if v.dtype.is_floating_point or v.dtype.is_complex or v.dtype == torch.bool:
            raise TypeError(f"Routing.{n} must be an integer tensor, got {v.dtype}")
    if not w.dtype.is_floating_point:
        raise TypeError(f"Routing.weights must be floating point, got {w.dtype}")
    bound = capacity_bound(k, T, _RAGGED_SLACK)
    if r.capacity > bound:
        raise ValueError(f"Routing.capacity={r.capacity} exceeds the bound 64*max(k*T, 1) + 65536 = {bound} for "
                         f"k={k}, T={T} (a pair fills at most one row; such buffers would be almost all padding)")
    if not values or ids.numel() == 0 or not all(_plain_tensor(v) for v in (ids, slots, counts)):
        return
    # slot + 1 where the pair is masked: a valid pair's slot must be >= 0, a masked one's >= -1
    shifted = slots + (ids < 0).to(slots.dtype)
    stats = torch.stack([ids.max(), slots.max(), shifted.min(),
                         counts.min() if counts.numel() else ids.new_zeros(()), counts.sum()]).tolist()
    id_max, slot_max, shifted_min, count_min, count_sum = stats
    if id_max >= r.num_experts:
        raise ValueError(f"Routing.expert_ids has id {id_max}, outside [-1, E) = [-1, {r.num_experts})")
    if shifted_min < 0 or slot_max >= k * T:
        if slot_max >= k * T:
            bad, which = slot_max, "a"
        else:
            low = int(torch.where(ids >= 0, slots, 0).min())
            bad, which = (low, "a valid") if low < 0 else (int(slots.min()), "a masked")
        raise ValueError(f"Routing.slots has {bad} for {which} pair; slots of valid pairs lie in [0, k*T) = "
                         f"[0, {k * T}), masked pairs (negative expert_ids) have -1")
    if count_min < 0 or count_sum > k * T:
        raise ValueError(f"Routing.counts must be >= 0 with sum <= k*T = {k * T}; got min {count_min}, "
                         f"sum {count_sum}")


_LEAVES = ("expert_ids", "slots", "weights", "counts")


def _flatten(r: Routing):
    return [getattr(r, n) for n in _LEAVES], (r.capacity, r.num_experts)


def _unflatten(leaves, ctx) -> Routing:
    ids, slots, weights, counts = leaves
    if (isinstance(ids, Tensor) and ids.dim() > 2 and isinstance(counts, Tensor)
            and counts.dim() == ids.dim() - 1 and ids.shape[:-2] == counts.shape[:-1]):
        # Leaving a vmap (or any map that stacks): the leaves carry leading batch dims. The result
        # is a stack of routings for inspection (index a leaf for one); moe() takes unbatched ones.
        r = object.__new__(Routing)
        for name, v in zip(_LEAVES + ("capacity", "num_experts"), (*leaves, *ctx)):
            object.__setattr__(r, name, v)
        return r
    return Routing(*leaves, capacity=ctx[0], num_experts=ctx[1])


def _flatten_with_keys(r: Routing):
    return [(pytree.GetAttrKey(n), getattr(r, n)) for n in _LEAVES], (r.capacity, r.num_experts)


pytree.register_pytree_node(
    Routing,
    _flatten,
    _unflatten,
    serialized_type_name="fmoe.routing.Routing",
    flatten_with_keys_fn=_flatten_with_keys,
)


# --------------------------------------------------------------------------- top-k

def top_k(scores: Tensor, k: int, *, normalize: bool = True) -> tuple[Tensor, Tensor]:
    """Select the k best experts per token.

    Args:
        scores: float [T, E], non-negative routing scores (e.g. softmax output).
        k: experts per token; clipped to E (as Tutel does). Must be >= 1.
        normalize: for k > 1 divide the k gates by their sum (§8); k = 1 is
            never normalised.

    Returns:
        expert_ids int64 [k, T] (slot 0 best) and gates [k, T] in scores' dtype.
    """
    return _top_k(scores, k, normalize, checked=False)


def _top_k(scores: Tensor, k: int, normalize: bool, checked: bool) -> tuple[Tensor, Tensor]:
    """:func:`top_k`; ``checked``: the scores are known finite and >= 0 (a router's softmax or
    sigmoid of logits that passed :func:`check_finite`), so normalising skips the host read that
    refuses negative or NaN gates."""
    _check_scores(scores)
    k = _check_k(k, scores.shape[1])
    vals, ids = torch.topk(scores, k, dim=1, sorted=True)
    if normalize and k > 1 and not checked and vals.numel() and _plain_tensor(vals):
        low = vals.min().item()
        if not low >= 0:  # also NaN
            raise ValueError(
                f"top_k: normalize=True divides the k gates by their sum, which needs non-negative scores; got "
                f"a selected score of {low} (pass softmax probabilities, or normalize=False for raw logits)")
    if normalize and k > 1:
        eps = torch.finfo(vals.dtype).eps
        vals = vals / vals.sum(dim=1, keepdim=True).clamp(min=eps)
    return ids.t().contiguous(), vals.t().contiguous()


def _check_scores(scores: Tensor) -> None:
    if not isinstance(scores, Tensor):
        raise TypeError(f"scores must be a torch.Tensor, got {type(scores).__name__}")
    if scores.dim() != 2:
        raise ValueError(f"scores must have shape [T, E], got shape {tuple(scores.shape)}")
    if not scores.is_floating_point():
        raise TypeError(f"scores must be floating point, got dtype {scores.dtype}")
    if scores.shape[1] < 1:
        raise ValueError("scores must have at least one expert column (E >= 1)")


def _check_k(k, num_experts: int) -> int:
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k must be an int >= 1, got {k!r}")
    if k < 1:
        raise ValueError(
            f"k must be >= 1, got k={k} (to shard an expert over ranks use a negative "
            "num_experts_per_device, not a negative k)")
    return min(k, num_experts)


# --------------------------------------------------------------------------- slots

def assign_slots(expert_ids: Tensor, num_experts: int, *, order: Optional[Tensor] = None
                 ) -> tuple[Tensor, Tensor]:
    """Slot-major location assignment (§6); same contract as :func:`assign_slots_torch`.

    On CPU this runs the O(k*T) counter walk (:mod:`fmoe._slots`: C++, numba where not built), under
    one vmap level without ``order`` one walk over the batch (:mod:`fmoe._slots_vmap`); while
    compiling, off CPU and otherwise under vmap it is the pure-torch version.
    """
    fast = _slots.assign_slots_fast(expert_ids, num_experts, order)
    if fast is None and order is None:
        fast = _slots_vmap.assign_slots_batched(expert_ids, num_experts)
    if fast is not None:
        return fast
    return assign_slots_torch(expert_ids, num_experts, order=order)


def assign_slots_torch(expert_ids: Tensor, num_experts: int, *, order: Optional[Tensor] = None
                       ) -> tuple[Tensor, Tensor]:
    """Slot-major location assignment (§6), pure torch (the reference).

    Walk (j, t) with j outer and t inner (t in ``order`` if given) and hand out a
    per-expert counter. Negative ids get no slot (-1) and are not counted.

    Args:
        expert_ids: int64 [k, T].
        num_experts: E.
        order: optional int64 [T] permutation of tokens (batch-prioritized
            routing visits the most important tokens first in every slot).

    Returns:
        slots int64 [k, T] and counts int64 [E].
    """
    k, T = expert_ids.shape
    ids = expert_ids if order is None else expert_ids[:, order]
    experts = torch.arange(num_experts, device=ids.device)
    # [k*T, E] membership; a cumulative sum down the walk order numbers each
    # expert's pairs. Comparisons with arange instead of one_hot keep vmap(grad) happy.
    member = (ids.reshape(k * T, 1) == experts).to(torch.int64)
    running = member.cumsum(0)
    counts = member.sum(0)
    slot = running.gather(1, ids.reshape(k * T, 1).clamp(min=0)).reshape(k, T) - 1
    slot = torch.where(ids >= 0, slot, torch.full_like(slot, -1))
    if order is not None:
        slot = slot[:, torch.argsort(order)]
    return slot, counts


# --------------------------------------------------------------------------- capacity

def _capacity_factor(capacity_factor) -> float:
    """``capacity_factor`` as a float, refusing strings, bools, inf and NaN with a clear error."""
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, numbers.Real):
        raise TypeError(f"capacity_factor must be a real number (> 0 padded, 0 dropless, < 0 capped dropless), "
                        f"got {type(capacity_factor).__name__} {capacity_factor!r}")
    cf = float(capacity_factor)
    if not math.isfinite(cf):
        raise ValueError(f"capacity_factor must be finite, got {cf} (use 0 for dropless routing)")
    return cf


def raise_route_error(non_finite: bool, logits: Tensor, what: tuple, capacity_factor, k: int, num_tokens: int,
                      num_experts: int, alignment: int, max_load: int) -> None:
    """Raise the error the torch route raises where a native route stopped: non-finite logits
    (:func:`check_finite` with ``what``, naming the rows) or a capacity the spec cannot give
    (:func:`capacity_for`'s message, with the walk's ``max_load``)."""
    if non_finite:
        check_finite(logits, *what)
    capacity_for(_capacity_factor(capacity_factor), num_tokens=num_tokens, num_experts=num_experts, k=k,
                 max_load=max_load, alignment=alignment)


def capacity_for(capacity_factor: float, *, num_tokens: int, num_experts: int, k: int,
                 max_load: Optional[int] = None, alignment: int = 1) -> int:
    """Capacity C from the three capacity-factor modes and alignment (§7).

    Args:
        capacity_factor: > 0 padded, 0 dropless (C = max_load), < 0 capped dropless.
        num_tokens: T* (group-agreed token count: the max over ranks).
        num_experts: E.
        k: experts per token after clipping.
        max_load: group-agreed max per-expert count (needed when cf <= 0).
        alignment: round C up to a multiple of this (s * d for sharded experts
            and overlap chunks); values above 256 are rounded up to 128s.
    """
    if not isinstance(alignment, int) or alignment < 1:
        raise ValueError(f"alignment must be an int >= 1, got {alignment!r}")
    cf = _capacity_factor(capacity_factor)
    for name, v in (("num_tokens", num_tokens), ("num_experts", num_experts), ("k", k)):
        if not _int_like(v) or v < (1 if name != "num_tokens" else 0):
            raise ValueError(f"capacity_for: {name} must be an int >= {1 if name != 'num_tokens' else 0}, got {v!r}")
    spe = -(-num_tokens // num_experts)  # ceil(T / E)
    if cf > 0:
        per_slot = int(cf * spe)
        if per_slot == 0:
            raise ValueError(
                f"capacity is 0: int(capacity_factor * ceil(T / E)) = int({cf} * ceil({num_tokens} / "
                f"{num_experts})) = 0 with capacity_factor={cf}, T={num_tokens}, E={num_experts}; "
                "use a larger capacity_factor, more tokens, or capacity_factor=0 (dropless)")
        cap = k * per_slot
    else:
        if max_load is None:
            raise ValueError("capacity_factor <= 0 (dropless) needs max_load")
        cap = int(max_load)
        if cf < 0:
            per_slot = int(-cf * spe)
            if per_slot == 0 and cap > 0:   # a cap of 0 would drop every pair (as +cf does, refused)
                raise ValueError(
                    f"capacity is 0: int(-capacity_factor * ceil(T / E)) = int({-cf} * ceil({num_tokens} / "
                    f"{num_experts})) = 0 with capacity_factor={cf} (capped dropless), T={num_tokens}, "
                    f"E={num_experts}: every pair would be dropped; use capacity_factor <= "
                    f"{-1 / spe if spe else -1:.4g}, more tokens, or capacity_factor=0 (dropless)")
            cap = min(cap, k * per_slot)
    if alignment > 256:
        alignment = -(-alignment // 128) * 128
    cap = -(-cap // alignment) * alignment
    bound = capacity_bound(k, num_tokens)
    if cap > bound:
        raise ValueError(
            f"capacity {cap} (capacity_factor={capacity_factor}, T={num_tokens}, E={num_experts}, k={k}, "
            f"alignment={alignment}) exceeds the bound 64*max(k*T, 1) + 1024 = {bound}: a pair fills at most one "
            "row, so the buffers would be almost all padding; use a smaller capacity_factor")
    return cap


def _group_max(value: int, comm, device) -> int:
    if comm is None or comm.size == 1:
        return int(value)
    t = torch.tensor([int(value)], dtype=torch.int64, device=device)
    return int(comm.all_reduce(t, op="max").item())


# --------------------------------------------------------------------------- routing

def make_routing(expert_ids: Tensor, weights: Tensor, num_experts: int, capacity_factor: float = 0.0,
                 *, importance: Optional[Tensor] = None, alignment: int = 1, comm=None,
                 capacity: Optional[int] = None) -> Routing:
    """Build a :class:`Routing` from experts already chosen (e.g. by an architecture router).

    Args:
        expert_ids: int [k, T]; negative ids are masked pairs.
        weights: float [k, T] gate values used by dispatch/combine.
        num_experts: E.
        capacity_factor: capacity mode (§7.1); the default 0 is dropless.
        importance: optional float [T]; if given, tokens are visited in
            decreasing importance within each slot (stable: ties by index).
        alignment: capacity alignment (§7.2).
        comm: communicator; capacity inputs are agreed across its ranks.
        capacity: a static capacity that overrides the computed one (no host
            sync; required under ``torch.compile`` or ``vmap`` in dropless mode).
    """
    if expert_ids.dim() != 2 or weights.shape != expert_ids.shape:
        raise ValueError(
            f"expert_ids and weights must both be [k, T]; got {tuple(expert_ids.shape)} and "
            f"{tuple(weights.shape)}")
    if expert_ids.dtype.is_floating_point or expert_ids.dtype == torch.bool:
        raise TypeError(f"expert_ids must be an integer tensor, got {expert_ids.dtype}")
    if expert_ids.dtype != torch.int64:
        expert_ids = expert_ids.to(torch.int64)
    return _routing_of(expert_ids, weights, num_experts, capacity_factor, importance=importance,
                       alignment=alignment, comm=comm, capacity=capacity, trusted=False)


def _routing_of(expert_ids: Tensor, weights: Tensor, num_experts: int, capacity_factor, *,
                importance: Optional[Tensor], alignment: int, comm, capacity: Optional[int],
                trusted: bool) -> Routing:
    """:func:`make_routing` after its argument checks: ``expert_ids`` int64 [k, T] and ``weights``
    float [k, T]. ``trusted``: both are a router's own top-k (fmoe.routers), so on one process with
    a computed capacity (:func:`capacity_for` checks E, k and the bound) the Routing's shape checks
    hold by construction and are skipped; an id >= E still raises in the slot walk."""
    k, T = expert_ids.shape
    order = None
    if importance is not None:
        order = torch.argsort(-importance, stable=True)
    slots, counts = assign_slots(expert_ids, num_experts, order=order)
    given = capacity is not None
    if not given:
        cf = _capacity_factor(capacity_factor)
        t_star = _group_max(T, comm, expert_ids.device) if cf > 0 else T
        max_load = None
        if cf <= 0:
            try:
                local = int(counts.max().item()) if num_experts > 0 else 0
            except RuntimeError as e:  # e.g. under vmap: the buffer size cannot depend on batched data
                raise RuntimeError(
                    "dropless routing (capacity_factor <= 0) needs max(counts) as a Python int to size the "
                    "expert buffers, which is impossible under vmap/tracing; pass a static capacity= "
                    "(e.g. T * k covers every case)") from e
            max_load = _group_max(local, comm, expert_ids.device)
        capacity = capacity_for(cf, num_tokens=t_star, num_experts=num_experts, k=k,
                                max_load=max_load, alignment=alignment)
    elif capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    # (with expert parallelism the capacity comes from the group's T, which a Routing's bound on its
    # own T may not cover: checked)
    one = comm is None or comm.size == 1
    return _trusted_routing(expert_ids, slots, weights, counts, int(capacity), int(num_experts),
                            shapes=given or not trusted or not one)


def top_k_routing(scores: Tensor, k: int, capacity_factor: float = 1.0, *, normalize: bool = True,
                  batch_prioritized: bool = False, alignment: int = 1, comm=None,
                  capacity: Optional[int] = None) -> Routing:
    """Tutel-compatible top-k routing (``extract_critical``).

    Args:
        scores: float [T, E] routing scores, e.g. ``softmax(logits)``.
        k: experts per token (>= 1; clipped to E).
        capacity_factor: > 0 padded capacity ``k * int(cf * ceil(T/E))``; 0 dropless
            (C = max load over the group); < 0 capped dropless.
        normalize: normalise the k gates to sum to 1 (k > 1 only), before dropping.
        batch_prioritized: within each slot, place tokens in decreasing
            ``max_e scores[t, e]`` (stable sort: ties by token index).
        alignment: round capacity up to a multiple of this.
        comm: communicator whose ranks must agree on capacity (None = one process).
        capacity: optional static capacity overriding the capacity factor.

    Returns:
        :class:`Routing` with ids/slots/weights [k, T] and counts [E].
    """
    _check_scores(scores)
    ids, gates = top_k(scores, k, normalize=normalize)
    importance = scores.amax(dim=1) if batch_prioritized else None
    return make_routing(ids, gates, scores.shape[1], capacity_factor, importance=importance,
                        alignment=alignment, comm=comm, capacity=capacity)
