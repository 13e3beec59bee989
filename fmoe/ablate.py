"""Gate ablations in one call: many gate settings, one vmapped forward/backward.

    points = [fmoe.ablate.Point(k=k, capacity_factor=cf) for k in (1, 2) for cf in (1.0, 1.5)]
    res = fmoe.ablate.sweep_moe(params, x, spec, points, target=y)
    res.table["loss"]          # [S] one value per setting
    res.grads["experts"]       # pytree of [S, ...] gradients

A *setting* (:class:`Point`) changes the gate: k, capacity factor, number of
experts, softmax temperature, gate-noise scale, loss coefficients, and (with a
stacked ``gates`` pytree) the gate weights themselves (ensembles).

How settings that change shapes stay one vmapped call ("masked" mode). Every
setting runs inside static maxima (:class:`Limits`: k_max, C_max, E_max) and
is masked down to its own values, exactly as a separate run would see them:

* k: route with k_max, then give slots j >= min(k, E) expert id -1 (negative
  ids are skipped by dispatch/combine and get no slot). Gates are normalised
  over the first k slots only, and not at all when k = 1 (spec §8).
* capacity: buffers hold C_max rows; a pair at slot c >= C_s is pushed to
  c + (C_max - C_s) >= C_max, so it is dropped *and counted as dropped*,
  while slots below C_s are unchanged. Dropless (cf = 0) uses C = T, an upper
  bound of any expert's load (the k experts of a token are distinct), so it
  needs no host sync; capped dropless (cf < 0) uses its cap.
* E: logits of experts >= E_s are set to -inf, so their softmax score is
  exactly 0, they are never selected among the first min(k, E_s) slots, and
  their parameters get zero gradient. Gate noise is scaled by 1/E_s and the
  GShard loss by E_s, as a run with E_s experts would.

Exactness (tested against ``mode="loop"``, i.e. separate runs with real
shapes through the library's ``top_k_routing``): routing decisions (ids,
kept slots, counts, drops) are identical, and routing statistics and the gate
losses are equal bit for bit. The exceptions are reductions over the expert axis
when a setting masks experts: softmax denominators and the GShard sum add E_max
(zero-padded) instead of E_s terms and may differ in the last bit. The task loss
and the gradients pass through expert GEMMs that vmap batches into other shapes
and agree to float rounding (rtol 1e-5; bit for bit on Intel's MKL paths, not on
those MKL takes on other CPUs).

Masking costs compute (every setting pays for E_max x C_max buffer rows). When
the shape settings vary a lot, ``mode="grouped"`` runs one vmapped call per
distinct (k, C, E) with real shapes instead; ``mode="loop"`` runs the settings
one by one (the baseline). All three give the same table.

Record/replay: :func:`record_routings`, :func:`save_routings` and
:func:`load_routings` keep the :class:`~fmoe.Routing` of every layer, and
``fmoe.moe(..., routing=r)`` replays one bit for bit (same params and input ->
same output bits; gate and l_aux are skipped).

Per-example gradients: :func:`per_example_grads` is ``vmap(grad(f))`` over the
batch axis; each example then routes its own tokens with its own capacity.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from . import routers as _gates
from . import stats as _stats
from ._io import atomic_save
from .losses import gshard_loss, z_loss
from .experts import routed_experts
from .moe import MoESpec, check_params
from .routing import Routing, _trusted_routing, assign_slots, capacity_for, top_k_routing

__all__ = [
    "Point",
    "Limits",
    "Settings",
    "SweepAux",
    "SweepResult",
    "resolve",
    "stack_points",
    "grid",
    "masked_route",
    "masked_moe",
    "static_moe",
    "sweep",
    "sweep_moe",
    "per_example_grads",
    "record_routings",
    "save_routings",
    "load_routings",
    "record_layers",
    "replay_layers",
]

# --------------------------------------------------------------------------- settings


@dataclasses.dataclass(frozen=True)
class Point:
    """One gate setting; ``None`` means "the MoESpec's value".

    Attributes:
        k: experts per token (clipped to the setting's E).
        capacity_factor: > 0 padded, 0 dropless, < 0 capped dropless (spec §7.1).
        num_experts: use only the first E_s <= spec.num_experts experts.
        temperature: scores = score_fn(noisy_logits / temperature); > 0.
        gate_noise: Tutel noise scale (std gate_noise / E_s); needs ``noise``.
        aux_coef: weight of the balance loss (GShard) in the total loss.
        z_coef: weight of the router z-loss (on clean logits / temperature).
    """

    k: Optional[int] = None
    capacity_factor: Optional[float] = None
    num_experts: Optional[int] = None
    temperature: float = 1.0
    gate_noise: float = 0.0
    aux_coef: float = 0.0
    z_coef: float = 0.0

    def label(self) -> str:
        parts = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                 if getattr(self, f.name) != f.default]
        return ",".join(parts) or "default"


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A :class:`Point` with the spec filled in and the capacity computed (static ints)."""

    k: int
    capacity: int
    num_experts: int
    temperature: float
    noise_scale: float  # gate_noise / E_s, computed in double as add_gate_noise does
    aux_coef: float
    z_coef: float


@dataclasses.dataclass(frozen=True)
class Limits:
    """Static maxima every masked setting runs inside (hashable, never traced)."""

    k: int
    capacity: int
    num_experts: int


@dataclasses.dataclass(frozen=True, eq=False)
class Settings:
    """Per-setting tensors (a pytree): leaves are [S] outside vmap, [] inside.

    Attributes:
        k, capacity, num_experts: int64.
        temperature, noise_scale, aux_coef, z_coef: float64 (cast to the
            logits' dtype where used, as a Python float would be).
    """

    k: Tensor
    capacity: Tensor
    num_experts: Tensor
    temperature: Tensor
    noise_scale: Tensor
    aux_coef: Tensor
    z_coef: Tensor

    def __len__(self) -> int:
        return self.k.shape[0]

    def __getitem__(self, i) -> "Settings":
        return pytree.tree_map(lambda t: t[i], self)


_SFIELDS = [f.name for f in dataclasses.fields(Settings)]
pytree.register_pytree_node(
    Settings,
    lambda s: ([getattr(s, n) for n in _SFIELDS], None),
    lambda leaves, _: Settings(*leaves),
    serialized_type_name="fmoe.ablate.Settings",
)


def resolve(point: Point, spec: MoESpec, num_tokens: int) -> Resolved:
    """Fill ``point`` from ``spec`` and compute its capacity for ``num_tokens`` tokens.

    Dropless (cf = 0) gets C = T rounded up to the alignment: no expert can
    receive more than T pairs, so nothing is dropped and no host sync is needed.
    """
    E = spec.num_experts if point.num_experts is None else point.num_experts
    if isinstance(E, bool) or not isinstance(E, int) or not 1 <= E <= spec.num_experts:
        raise ValueError(f"Point.num_experts must be an int in [1, {spec.num_experts}] (the spec's E), got {E!r}")
    k = spec.gate.k if point.k is None else point.k
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"Point.k must be an int >= 1, got {k!r}")
    k = min(k, E)
    cf = spec.gate.capacity_factor if point.capacity_factor is None else float(point.capacity_factor)
    cap = capacity_for(cf, num_tokens=num_tokens, num_experts=E, k=k, max_load=num_tokens,
                       alignment=spec.alignment)
    if not point.temperature > 0:
        raise ValueError(f"Point.temperature must be > 0, got {point.temperature}")
    if point.gate_noise < 0:
        raise ValueError(f"Point.gate_noise must be >= 0, got {point.gate_noise}")
    return Resolved(k, cap, E, float(point.temperature), point.gate_noise / E, float(point.aux_coef),
                    float(point.z_coef))


def stack_points(points: Sequence[Point], spec: MoESpec, num_tokens: int
                 ) -> tuple[Settings, Limits, list[Resolved]]:
    """Resolve ``points`` and stack them into :class:`Settings` [S] plus their :class:`Limits`."""
    if len(points) == 0:
        raise ValueError("stack_points: need at least one Point")
    rs = [resolve(p, spec, num_tokens) for p in points]

    def col(name, dtype):
        return torch.tensor([getattr(r, name) for r in rs], dtype=dtype)

    settings = Settings(col("k", torch.int64), col("capacity", torch.int64), col("num_experts", torch.int64),
                        col("temperature", torch.float64), col("noise_scale", torch.float64),
                        col("aux_coef", torch.float64), col("z_coef", torch.float64))
    limits = Limits(max(r.k for r in rs), max(r.capacity for r in rs), spec.num_experts)
    return settings, limits, rs


def grid(**axes: Sequence) -> list[Point]:
    """Cartesian product of Point fields: ``grid(k=[1, 2], temperature=[0.5, 1.0])`` -> 4 Points."""
    names = list(axes)
    unknown = set(names) - {f.name for f in dataclasses.fields(Point)}
    if unknown:
        raise ValueError(f"grid: unknown Point fields {sorted(unknown)}")
    out: list[dict] = [{}]
    for n in names:
        out = [dict(d, **{n: v}) for d in out for v in axes[n]]
    return [Point(**d) for d in out]


# --------------------------------------------------------------------------- masked forward


@dataclasses.dataclass(frozen=True, eq=False)
class SweepAux:
    """Auxiliary outputs of :func:`masked_moe` / :func:`static_moe` (a pytree).

    Attributes:
        l_aux: scalar GShard loss over the setting's experts (unweighted).
        z_loss: scalar router z-loss (unweighted).
        routing: the Routing used (masked: E_max experts, C_max capacity).
        scores: float [T, E] routing scores.
        active: bool [E] experts that belong to the setting.
    """

    l_aux: Tensor
    z_loss: Tensor
    routing: Routing
    scores: Tensor
    active: Tensor


pytree.register_pytree_node(
    SweepAux,
    lambda a: ([a.l_aux, a.z_loss, a.routing, a.scores, a.active], None),
    lambda leaves, _: SweepAux(*leaves),
    serialized_type_name="fmoe.ablate.SweepAux",
)


def _check_spec(spec: MoESpec) -> None:
    if not spec.is_gshard_loss:
        raise NotImplementedError("fmoe.ablate sweeps the GShard balance loss only (spec.is_gshard_loss=True)")


def masked_route(gate_params: dict, x: Tensor, spec: MoESpec, setting: Settings, limits: Limits, *,
                 noise: Optional[Tensor] = None) -> tuple[Routing, Tensor, Tensor, Tensor]:
    """Route tokens for one setting inside the static ``limits`` (vmap over ``setting``).

    Args:
        gate_params: the gate pytree (E_max experts).
        x: float [T, M] tokens.
        setting: one setting (0-dim leaves; use ``torch.func.vmap`` for many).
        limits: static maxima; ``limits.capacity`` >= every setting's capacity.
        noise: optional eps [T, E_max] (standard normal), scaled per setting.

    Returns:
        (routing, scores [T, E_max], clean tempered logits [T, E_max], active bool [E_max]).
    """
    gs = spec.gate
    E = limits.num_experts
    logits = _gates.gate_logits(gs.type, gate_params, x, fp32=gs.fp32_gate)
    dt = logits.dtype
    noisy = logits if noise is None else logits + noise.to(dt) * setting.noise_scale.to(dt)
    temp = setting.temperature.to(dt)
    active = torch.arange(E, device=x.device) < setting.num_experts
    neg_inf = torch.full_like(logits, -math.inf)
    clean_t = torch.where(active, logits / temp, neg_inf)
    scores = _gates.scores_from_logits(torch.where(active, noisy / temp, neg_inf), gs.score_fn)
    # Top-k at the static k_max; slots past the setting's k (clipped to its E) are masked.
    vals, ids = torch.topk(scores, limits.k, dim=1, sorted=True)
    k_eff = torch.minimum(setting.k, setting.num_experts)
    on = torch.arange(limits.k, device=x.device) < k_eff
    vals = torch.where(on, vals, torch.zeros_like(vals))
    if spec.normalize_gate:
        eps = torch.finfo(vals.dtype).eps
        normed = vals / vals.sum(dim=1, keepdim=True).clamp(min=eps)
        vals = torch.where(k_eff > 1, normed, vals)
    ids = torch.where(on, ids, torch.full_like(ids, -1)).t().contiguous()
    vals = vals.t().contiguous()
    order = torch.argsort(-scores.amax(dim=1), stable=True) if spec.batch_prioritized else None
    slots, counts = assign_slots(ids, E, order=order)
    cap = setting.capacity
    slots = torch.where(slots < cap, slots, slots + (limits.capacity - cap))
    return Routing(ids, slots, vals, counts, limits.capacity, E), scores, clean_t, active


def masked_moe(params: dict, x: Tensor, spec: MoESpec, setting: Settings, limits: Limits, *,
               noise: Optional[Tensor] = None) -> tuple[Tensor, SweepAux]:
    """One MoE forward for one setting inside static maxima; vmap it over settings.

    Args:
        params: ``{"gate": ..., "experts": ...}`` for E_max experts (leaves may be
            vmapped, e.g. a stacked gate for ensembles).
        x: float [..., M].
        setting, limits, noise: see :func:`masked_route`.

    Returns:
        y [..., O] in x's dtype and :class:`SweepAux`. Equal to :func:`static_moe`
        with the setting's real k, C and E (routing decisions identical).
    """
    _check_spec(spec)
    tokens = x.reshape(-1, spec.model_dim)
    routing, scores, clean_t, active = masked_route(params["gate"], tokens, spec, setting, limits, noise=noise)
    top1 = routing.expert_ids[0]
    E_s = setting.num_experts.to(scores.dtype)
    l_aux = E_s * (scores.mean(0) * _top1_fraction(top1, limits.num_experts, scores.dtype)).sum()
    y = _experts_and_combine(params["experts"], tokens, spec, routing)
    return y.reshape(*x.shape[:-1], y.shape[-1]).to(x.dtype), SweepAux(l_aux, z_loss(clean_t), routing, scores,
                                                                       active)


def _top1_fraction(top1: Tensor, E: int, dtype) -> Tensor:
    hits = (top1.reshape(-1, 1) == torch.arange(E, device=top1.device)).to(dtype)
    return hits.sum(0) / top1.numel()


def _experts_and_combine(expert_params, tokens: Tensor, spec: MoESpec, routing: Routing) -> Tensor:
    """The experts on the masked routing through :func:`fmoe.moe`'s own expert stage
    (:func:`fmoe.experts.routed_experts`: the engine's door, the kept pairs only, one folded call
    under vmap). A setting's capacity lives in the
    slots (a pair past it sits past the static capacity), so the counts the plan reads are the
    kept pairs per expert, not the routed ones."""
    dtype = next((t.dtype for t in pytree.tree_leaves(expert_params)
                  if isinstance(t, Tensor) and t.is_floating_point()), tokens.dtype)
    ids, C = routing.expert_ids, routing.capacity
    kept = ((ids >= 0) & (routing.slots < C)).to(routing.counts.dtype)
    counts = torch.zeros_like(routing.counts).scatter_add(0, ids.clamp(min=0).reshape(-1), kept.reshape(-1))
    r = _trusted_routing(ids, routing.slots, routing.weights, counts, C, routing.num_experts)
    y, _ = routed_experts(spec.experts, expert_params, tokens.to(dtype), r, layout_kind=spec.layout_kind(),
                          order=spec.combine, prescore=not spec.is_postscore, plan=spec.plan, save=spec.save)
    return y


# --------------------------------------------------------------------------- static forward


def _slice_params(params: dict, spec: MoESpec, E: int) -> dict:
    """The parameters of the first E experts (gate columns and expert rows)."""
    if E == spec.num_experts:
        return params
    g = dict(params["gate"])
    if spec.gate.type == "top":
        g["wg"] = g["wg"][:E]
    else:
        g["sim_matrix"] = g["sim_matrix"][:, :E]
    experts = pytree.tree_map(lambda t: t[:E] if isinstance(t, Tensor) else t, params["experts"])
    return {**params, "gate": g, "experts": experts}


def static_moe(params: dict, x: Tensor, spec: MoESpec, r: Resolved, *, noise: Optional[Tensor] = None,
               temperature=None, noise_scale=None) -> tuple[Tensor, SweepAux]:
    """One setting with its real shapes (k, C, E) through the library's own routing.

    This is the "separate run" that masked sweeps are checked against, and the
    body of ``mode="grouped"`` (vmapped over ``temperature``/``noise_scale``
    tensors, which override ``r``'s floats).

    Args:
        params: full parameters (E_max experts); the first ``r.num_experts`` are used.
        x: float [..., M].
        r: resolved setting.
        noise: optional eps [T, E_max]; its first E_s columns are used.
    """
    _check_spec(spec)
    E = r.num_experts
    p = _slice_params(params, spec, E)
    tokens = x.reshape(-1, spec.model_dim)
    gs = spec.gate
    logits = _gates.gate_logits(gs.type, p["gate"], tokens, fp32=gs.fp32_gate)
    dt = logits.dtype
    temp = torch.as_tensor(r.temperature if temperature is None else temperature, dtype=torch.float64).to(dt)
    ns = torch.as_tensor(r.noise_scale if noise_scale is None else noise_scale, dtype=torch.float64).to(dt)
    noisy = logits if noise is None else logits + noise[:, :E].to(dt) * ns
    scores = _gates.scores_from_logits(noisy / temp, gs.score_fn)
    routing = top_k_routing(scores, r.k, normalize=spec.normalize_gate, batch_prioritized=spec.batch_prioritized,
                            capacity=r.capacity)
    l_aux = gshard_loss(scores, routing.expert_ids[0])
    y = _experts_and_combine(p["experts"], tokens, spec, routing)
    active = torch.ones(E, dtype=torch.bool, device=x.device)
    return y.reshape(*x.shape[:-1], y.shape[-1]).to(x.dtype), SweepAux(l_aux, z_loss(logits / temp), routing,
                                                                       scores, active)


# --------------------------------------------------------------------------- drivers


def sweep(loss_fn: Callable, params, batch, settings, *, param_dims: Any = None, grad: bool = True):
    """Generic vmapped sweep: ``loss_fn(params, batch, setting) -> (loss [], metrics dict)``.

    Args:
        loss_fn: a pure function of one setting (0-dim leaves of ``settings``).
        params: parameter pytree; ``param_dims`` says which leaves carry a
            leading setting axis (a pytree prefix of in_dims, e.g.
            ``{"gate": 0, "experts": None}`` or ``0`` to train S models at once).
        batch: shared inputs (not vmapped).
        settings: a pytree whose leaves have a leading axis S (e.g. :class:`Settings`).
        grad: also return the per-setting gradients wrt ``params``.

    Returns:
        (table, grads): table is ``{"loss": [S], **metrics with leading S}``;
        grads is the stacked gradient pytree ([S, ...] leaves) or None.
    """
    if grad:
        fn = torch.func.grad_and_value(loss_fn, has_aux=True)
        grads, (loss, metrics) = torch.func.vmap(fn, in_dims=(param_dims, None, 0))(params, batch, settings)
    else:
        loss, metrics = torch.func.vmap(loss_fn, in_dims=(param_dims, None, 0))(params, batch, settings)
        grads = None
    return {"loss": loss, **metrics}, grads


@dataclasses.dataclass(frozen=True, eq=False)
class SweepResult:
    """What :func:`sweep_moe` returns.

    Attributes:
        table: dict of tensors with a leading setting axis S: ``loss``,
            ``task_loss``, ``l_aux``, ``z_loss`` (float), ``dropped_fraction``,
            ``load_cv``, ``load_entropy``, ``score_entropy`` (float64 []),
            ``load`` (float64 [S, E_max] kept pairs per expert), ``capacity``.
        grads: per-setting gradient pytree ([S, ...] leaves) or None.
        points: the settings, in table order.
        resolved: the static values of each setting (k clipped, capacity).
        limits: the static maxima (masked mode).
    """

    table: dict
    grads: Any
    points: list
    resolved: list
    limits: Limits


def _mse(y: Tensor, target: Tensor) -> Tensor:
    return (y - target).square().mean()


def _metrics(y, aux: SweepAux, setting_coefs, task_loss, target, E_max: int):
    aux_coef, z_coef = setting_coefs
    task = task_loss(y, target)
    loss = task + aux_coef.to(task.dtype) * aux.l_aux.to(task.dtype) + z_coef.to(task.dtype) * aux.z_loss.to(task.dtype)
    st = _stats.routing_stats(aux.routing, aux.scores, active=aux.active)
    load = st.load
    if load.shape[-1] < E_max:  # static runs with fewer experts: pad the heatmap row
        load = torch.cat([load, load.new_zeros(E_max - load.shape[-1])])
    metrics = {"task_loss": task, "l_aux": aux.l_aux, "z_loss": aux.z_loss,
               "dropped_fraction": st.dropped_fraction, "load_cv": st.load_cv, "load_entropy": st.load_entropy,
               "score_entropy": st.score_entropy, "load": load}
    return loss, metrics


def sweep_moe(params: dict, x: Tensor, spec: MoESpec, points: Sequence[Point], *, target: Optional[Tensor] = None,
              task_loss: Optional[Callable[[Tensor, Tensor], Tensor]] = None, gates: Optional[dict] = None,
              noise: Optional[Tensor] = None, mode: str = "masked", grad: bool = True) -> SweepResult:
    """One MoE layer forward (and backward) for every setting in ``points``.

    Args:
        params: ``{"gate": ..., "experts": ...}`` (E_max = spec.num_experts experts).
        x: float [..., M].
        spec: the layer (its gate values are the defaults of each Point).
        points: S settings.
        target: what ``task_loss(y, target)`` compares y with (default: zeros).
        task_loss: scalar loss of the output; default mean squared error.
        gates: optional stacked gate pytree (leaves [S, ...]) replacing
            ``params["gate"]`` per setting (ensembles of gate weights).
        noise: optional eps [T, E_max], shared by all settings and scaled by
            each setting's ``gate_noise / E_s`` (so settings differ only by scale).
        mode: "masked" (one vmapped call), "grouped" (one vmapped call per
            distinct (k, C, E)) or "loop" (one call per setting).
        grad: also compute gradients wrt ``params`` (and ``gates``).

    Returns:
        :class:`SweepResult`; the gradient pytree has ``gates`` stacked when given.
    """
    check_params(params, spec)
    T = x.numel() // spec.model_dim
    if noise is not None and tuple(noise.shape) != (T, spec.num_experts):
        raise ValueError(f"sweep_moe: noise must be [T, E] = [{T}, {spec.num_experts}], got {tuple(noise.shape)}")
    if any(p.gate_noise > 0 for p in points) and noise is None:
        raise ValueError("sweep_moe: a Point has gate_noise > 0 but no noise tensor was given; pass "
                         "noise=torch.randn(T, E, generator=...) (explicit randomness keeps runs comparable)")
    settings, limits, rs = stack_points(points, spec, T)
    S = len(rs)
    task_loss = task_loss or _mse
    target = torch.zeros((), dtype=x.dtype) if target is None else target
    if gates is not None:
        lead = {t.shape[0] for t in pytree.tree_leaves(gates)}
        if lead != {S}:
            raise ValueError(f"sweep_moe: every leaf of gates needs a leading axis of {S} settings, got {lead}")
        params = {**params, "gate": gates}
    param_dims = {"gate": 0 if gates is not None else None, "experts": None}
    batch = (x, target, noise)
    E_max = spec.num_experts

    if mode == "masked":
        def loss_fn(p, b, s):
            y, aux = masked_moe(p, b[0], spec, s, limits, noise=b[2])
            return _metrics(y, aux, (s.aux_coef, s.z_coef), task_loss, b[1], E_max)

        table, grads = sweep(loss_fn, params, batch, settings, param_dims=param_dims, grad=grad)
    elif mode in ("grouped", "loop"):
        table, grads = _grouped(params, batch, spec, rs, settings, param_dims, task_loss, grad, E_max,
                                per_setting=(mode == "loop"))
    else:
        raise ValueError(f"sweep_moe: mode must be 'masked', 'grouped' or 'loop', got {mode!r}")
    table["capacity"] = settings.capacity
    return SweepResult(table, grads, list(points), rs, limits)


def _grouped(params, batch, spec, rs, settings, param_dims, task_loss, grad, E_max, per_setting):
    """Run settings with equal (k, C, E) as one vmapped static call each (or one by one)."""
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(rs):
        key = (i,) if per_setting else (r.k, r.capacity, r.num_experts)
        groups.setdefault(key, []).append(i)
    pieces = []  # (indices, table, grads)
    stacked_gate = param_dims["gate"] == 0
    for idx in groups.values():
        r0 = rs[idx[0]]
        sub = settings[torch.tensor(idx)]
        sub_params = params
        if stacked_gate:
            sub_params = {**params, "gate": pytree.tree_map(lambda t: t[idx], params["gate"])}

        def loss_fn(p, b, s, r0=r0):
            y, aux = static_moe(p, b[0], spec, r0, noise=b[2], temperature=s.temperature,
                                noise_scale=s.noise_scale)
            return _metrics(y, aux, (s.aux_coef, s.z_coef), task_loss, b[1], E_max)

        if per_setting or len(idx) == 1:  # vmap over a batch of one only adds overhead
            one = sub[0]
            p1 = sub_params
            if stacked_gate:
                p1 = {**params, "gate": pytree.tree_map(lambda t: t[idx[0]], params["gate"])}
            if grad:
                g, (loss, m) = torch.func.grad_and_value(loss_fn, has_aux=True)(p1, batch, one)
            else:
                (loss, m), g = loss_fn(p1, batch, one), None
            add = lambda t: t.unsqueeze(0)  # noqa: E731
            pieces.append((idx, pytree.tree_map(add, {"loss": loss, **m}),
                           None if g is None else pytree.tree_map(add, g)))
        else:
            t, g = sweep(loss_fn, sub_params, batch, sub, param_dims=param_dims, grad=grad)
            pieces.append((idx, t, g))
    order = torch.argsort(torch.tensor([i for idx, _, _ in pieces for i in idx]))

    def cat(*leaves):
        return torch.cat(leaves)[order]

    table = pytree.tree_map(cat, *[t for _, t, _ in pieces])
    grads = None
    if grad:
        gs = [_pad_grads(g, params, spec) for _, _, g in pieces]
        grads = pytree.tree_map(cat, *gs)
    return table, grads


def _pad_grads(g, params, spec):
    """Zero-pad gradients of sliced (fewer-expert) runs back to the full parameter shapes.

    A group's gradient leaf is [S_g, *sliced]; the parameter is [*full] or, for a
    stacked gate, [S, *full]. The missing experts had no part in the run, so
    their gradient is exactly zero, as the masked mode produces.
    """
    def pad(gl, full):
        tail = tuple(full.shape[full.dim() - (gl.dim() - 1):])
        if tuple(gl.shape[1:]) == tail:
            return gl
        out = gl.new_zeros((gl.shape[0],) + tail)
        out[tuple(slice(0, n) for n in gl.shape)] = gl
        return out
    return pytree.tree_map(pad, g, params)


# --------------------------------------------------------------------------- per-example grads


def per_example_grads(loss_fn: Callable, params, *batch, batch_dim: int = 0):
    """Gradient of ``loss_fn(params, *example)`` for every example of ``batch``.

    ``vmap(grad(loss_fn))`` over the batch axis: inside, each example is its own
    MoE call, so it routes only its own tokens and its capacity is computed
    from its own token count (``k * int(cf * ceil(T_example / E))``), not the
    batch's. Dropless routing (cf <= 0) needs the max load, a host sync vmap cannot do: the
    ragged layout's size is static, and the padded layout takes the load bound T instead (the
    same pairs dropped, larger buffers).

    Returns:
        the gradient pytree with a leading batch axis on every leaf.
    """
    return torch.func.vmap(torch.func.grad(loss_fn), in_dims=(None,) + (batch_dim,) * len(batch))(params, *batch)


# --------------------------------------------------------------------------- record / replay


def record_routings(auxes) -> dict:
    """Routings of many layers: ``{name: aux.routing}`` from ``{name: MoEAux}``.

    Accepts a dict (or list) of MoEAux / SweepAux / Routing; lists are keyed
    by position. Replay one with ``fmoe.moe(params, x, spec, routing=r)``.
    """
    items = auxes.items() if isinstance(auxes, dict) else enumerate(auxes)
    out = {}
    for name, a in items:
        r = a if isinstance(a, Routing) else getattr(a, "routing", None)
        if not isinstance(r, Routing):
            raise TypeError(f"record_routings: entry {name!r} is a {type(a).__name__}, not an aux with a routing")
        out[str(name)] = r
    return out


def save_routings(path, routings: dict) -> None:
    """Save ``{name: Routing}`` in one file (plain tensors and ints; loads with weights_only)."""
    data = {}
    for name, r in routings.items():
        if not isinstance(r, Routing):
            raise TypeError(f"save_routings: {name!r} is a {type(r).__name__}, not a Routing")
        data[str(name)] = {f.name: getattr(r, f.name) for f in dataclasses.fields(Routing)}
    atomic_save({"fmoe_routings": 1, "layers": data}, path)   # temp file + fsync + rename


def load_routings(path, map_location=None) -> dict:
    """Read what :func:`save_routings` wrote: ``{name: Routing}``."""
    blob = torch.load(path, map_location=map_location, weights_only=True)
    if not isinstance(blob, dict) or blob.get("fmoe_routings") != 1:
        raise ValueError(f"load_routings: {path!r} was not written by fmoe.ablate.save_routings")
    return {name: Routing(**d) for name, d in blob["layers"].items()}


def _moe_layers(model) -> dict:
    from .nn import MoELayer  # local: nn sits above this module in the data flow
    layers = {name: m for name, m in model.named_modules() if isinstance(m, MoELayer)}
    if not layers:
        raise ValueError(f"no fmoe.nn.MoELayer inside {type(model).__name__}")
    return layers


@contextlib.contextmanager
def record_layers(model):
    """Record the routing of every :class:`fmoe.nn.MoELayer` in ``model``.

    Yields a dict ``{module name: Routing}`` that fills in as the model runs
    (a layer called twice keeps its last call). The layers behave as usual;
    for the duration only, module hooks (removed on exit) collect the routings.

        with fmoe.ablate.record_layers(model) as routings:
            out = model(x)
        fmoe.ablate.save_routings("r.pt", routings)
    """
    recorded: dict = {}
    layers = _moe_layers(model)
    wanted: dict = {}   # id(layer) -> whether its caller asked for (y, aux) itself

    def ask_for_aux(layer, args, kwargs):
        wanted[id(layer)] = kwargs.get("return_aux", False)
        return args, {**kwargs, "return_aux": True}

    def keep_routing(name):
        def hook(layer, args, kwargs, output):
            y, aux = output
            recorded[name] = aux.routing
            if wanted.pop(id(layer)):
                return y, aux
            if layer.result_func is not None:
                return layer.result_func(y)
            y.l_aux = aux.l_aux
            return y
        return hook

    # Module hooks (PyTorch's own mechanism), removed on exit: the layers' forward is untouched.
    handles = []
    try:
        for name, layer in layers.items():
            handles.append(layer.register_forward_pre_hook(ask_for_aux, with_kwargs=True))
            handles.append(layer.register_forward_hook(keep_routing(name), with_kwargs=True))
        yield recorded
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def replay_layers(model, routings: dict):
    """Run every :class:`fmoe.nn.MoELayer` of ``model`` with a recorded routing.

    ``routings`` is what :func:`record_layers` (or :func:`load_routings`)
    gave: ``{module name: Routing}``. Same parameters and inputs reproduce the
    recorded outputs bit for bit; the gates are skipped (l_aux = 0, no gate
    gradient). Layers missing from ``routings`` raise, so a renamed model
    cannot silently fall back to live routing.
    """
    layers = _moe_layers(model)
    missing = sorted(set(layers) - set(routings))
    if missing:
        raise KeyError(f"replay_layers: no recorded routing for layers {missing}")

    def with_routing(r):
        def hook(layer, args, kwargs):
            return args, {**kwargs, "routing": r}
        return hook

    handles = []
    try:
        for name, layer in layers.items():
            handles.append(layer.register_forward_pre_hook(with_routing(routings[name]), with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()
