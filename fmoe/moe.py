"""``moe()``: gate -> route -> dispatch -> experts -> combine, as one pure function.

    params = fmoe.init_params(spec, generator=g)
    y, aux = fmoe.moe(params, x, spec)

``spec`` (a frozen, hashable :class:`MoESpec`) holds every static setting; the
parameter pytree holds every tensor; nothing else carries state. To change a
setting for one call, pass ``dataclasses.replace(spec, ...)`` — nothing sticks.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from . import gates as _gates
from .comm import resolve
from .experts import ExpertSpec, apply_experts, init_experts
from .losses import gshard_loss, load_importance_loss
from .ops import combine, dispatch
from .ops.grouped import filled_rows
from .routing import Routing, top_k_routing

__all__ = ["GateSpec", "MoESpec", "MoEAux", "init_params", "moe", "check_params", "route"]

GATE_TYPES = ("top", "cosine_top")


@dataclasses.dataclass(frozen=True)
class GateSpec:
    """Static gate settings (Tutel's gate dict).

    Attributes:
        type: 'top' (linear) or 'cosine_top'.
        k: experts per token (>= 1; clipped to E).
        capacity_factor: > 0 padded, 0 dropless, < 0 capped dropless.
        gate_noise: Tutel noise scale (training only); std is gate_noise / E.
        fp32_gate: keep gate parameters and logits in float32.
        score_fn: 'softmax' (Tutel) or 'sigmoid'.
        proj_dim, init_t: cosine gate projection size and initial temperature.
    """

    type: str = "top"
    k: int = 1
    capacity_factor: float = 1.0
    gate_noise: float = 0.0
    fp32_gate: bool = True
    score_fn: str = "softmax"
    proj_dim: int = 256
    init_t: float = 0.5

    def __post_init__(self):
        if self.type not in GATE_TYPES:
            raise ValueError(f"unknown gate type {self.type!r}; expected one of {GATE_TYPES}")
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"gate k must be an int >= 1, got {self.k!r} (a negative k does not shard "
                             "experts; use a negative num_experts_per_device)")
        if self.score_fn not in _gates.SCORE_FNS:
            raise ValueError(f"unknown score_fn {self.score_fn!r}; expected one of {_gates.SCORE_FNS}")
        if self.gate_noise < 0:
            raise ValueError(f"gate_noise must be >= 0, got {self.gate_noise}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoESpec:
    """Static description of one MoE layer (keyword-only).

    Attributes:
        model_dim: M, token feature size.
        num_experts: E, global experts.
        gate: :class:`GateSpec`.
        experts: :class:`~fmoe.experts.ExpertSpec`.
        is_postscore: gates scale expert outputs (True) or inputs (False).
        batch_prioritized: place important tokens first within each slot.
        normalize_gate: normalise the k gates (k > 1) before dropping.
        is_gshard_loss: GShard loss (True) or Tutel's load/importance loss.
        alignment: capacity is rounded up to a multiple of this.
    """

    model_dim: int
    num_experts: int
    experts: ExpertSpec
    gate: GateSpec = GateSpec()
    is_postscore: bool = True
    batch_prioritized: bool = False
    normalize_gate: bool = True
    is_gshard_loss: bool = True
    alignment: int = 1

    def __post_init__(self):
        for name in ("model_dim", "num_experts", "alignment"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"MoESpec.{name} must be a positive int, got {v!r}")
        if not self.is_gshard_loss and self.gate.gate_noise <= 0:
            raise ValueError("is_gshard_loss=False (load/importance loss) needs gate.gate_noise > 0")

    @property
    def output_dim(self) -> int:
        return self.experts.output_dim or self.model_dim


@dataclasses.dataclass(frozen=True, eq=False)
class MoEAux:
    """Auxiliary outputs of :func:`moe` (a pytree; ``capacity`` is static).

    Attributes:
        l_aux: scalar balance loss (GShard or load/importance), unweighted.
        counts: int64 [E] pairs routed to each expert before dropping.
        dropped: int64 [] (token, expert) pairs lost to capacity.
        routing: the :class:`~fmoe.Routing` used (replayable).
        capacity: C.
        scores: [T, E] routing scores (softmax/sigmoid of the noisy logits);
            None when a recorded routing was replayed.
    """

    l_aux: Tensor
    counts: Tensor
    dropped: Tensor
    routing: Routing
    capacity: int
    scores: Optional[Tensor] = None


pytree.register_pytree_node(
    MoEAux,
    lambda a: ([a.l_aux, a.counts, a.dropped, a.routing, a.scores], a.capacity),
    lambda leaves, cap: MoEAux(*leaves[:4], capacity=cap, scores=leaves[4]),
    serialized_type_name="fmoe.moe.MoEAux",
)


# --------------------------------------------------------------------------- params

def init_params(spec: MoESpec, *, generator: Optional[torch.Generator] = None,
                dtype: torch.dtype = torch.float32, num_local_experts: Optional[int] = None,
                comm=None) -> dict:
    """A fresh parameter pytree ``{"gate": {...}, "experts": {...}}``.

    Experts are drawn first, then the gate (Tutel's order). With ``fp32_gate``
    the gate is float32 whatever ``dtype`` is.

    Args:
        spec: the layer.
        generator: RNG for reproducible initialisation.
        dtype: expert parameter dtype.
        num_local_experts: experts held by this process (default: all E).
        comm: expert-parallel communicator: all E experts are drawn (identically
            on every rank given the same generator) and this rank keeps its
            slice (:func:`fmoe.parallel.shard_experts`: E/W experts, or one
            shard of an expert shared by W/E ranks).
    """
    n = spec.num_experts if num_local_experts is None else num_local_experts
    if comm is not None and comm.size > 1 and num_local_experts is not None:
        raise ValueError("init_params: pass either comm (shards the E experts) or num_local_experts, not both")
    experts = init_experts(spec.experts, n, spec.model_dim, generator=generator, dtype=dtype)
    if comm is not None and comm.size > 1:
        from .parallel import shard_experts
        experts = shard_experts(spec.experts.type, experts, spec.num_experts, comm.rank, comm.size)
    gate_dtype = torch.float32 if spec.gate.fp32_gate else dtype
    if spec.gate.type == "top":
        gate = _gates.init_linear_gate(spec.num_experts, spec.model_dim, generator=generator, dtype=gate_dtype)
    else:
        gate = _gates.init_cosine_gate(spec.num_experts, spec.model_dim, proj_dim=spec.gate.proj_dim,
                                       init_t=spec.gate.init_t, generator=generator, dtype=gate_dtype)
    return {"gate": gate, "experts": experts}


def _expect(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(f"parameter pytree does not match the MoESpec: {msg}")


def _shape(t) -> tuple:
    return tuple(getattr(t, "logical_shape", None) or t.shape)


def check_params(params, spec: MoESpec, num_local_experts: Optional[int] = None) -> None:
    """Raise ValueError naming the first key or shape that does not fit ``spec``."""
    _expect(isinstance(params, dict) and "gate" in params and "experts" in params,
            f"expected a dict with keys 'gate' and 'experts', got "
            f"{sorted(params) if isinstance(params, dict) else type(params).__name__}")
    E, M, O = spec.num_experts, spec.model_dim, spec.output_dim
    g = params["gate"]
    if spec.gate.type == "top":
        _expect("wg" in g, f"linear gate needs 'wg', got keys {sorted(g)}")
        _expect(tuple(g["wg"].shape) == (E, M), f"gate.wg must be [E, M] = [{E}, {M}], got {tuple(g['wg'].shape)}")
    else:
        need = {"proj_w", "proj_b", "sim_matrix", "temperature"}
        _expect(need <= set(g), f"cosine gate needs {sorted(need)}, got keys {sorted(g)}")
        _expect(g["proj_w"].shape[1] == M, f"gate.proj_w must be [Pd, {M}], got {tuple(g['proj_w'].shape)}")
        _expect(g["sim_matrix"].shape[1] == E,
                f"gate.sim_matrix must be [Pd, {E}], got {tuple(g['sim_matrix'].shape)}")
    ex, es = params["experts"], spec.experts
    if es.type == "custom":
        return
    n = num_local_experts
    if es.type == "ffn":
        for key in ("fc1_w", "fc2_w"):
            _expect(key in ex, f"ffn experts need '{key}', got keys {sorted(ex)}")
        H = es.hidden_size
        w1, w2 = _shape(ex["fc1_w"]), _shape(ex["fc2_w"])
        n = n or w1[0]
        _expect(len(w1) == 3 and w1[0] == n and w1[2] == M,
                f"experts.fc1_w must be [n, H, M] with n={n}, M={M}, got {w1}")
        _expect(len(w2) == 3 and w2[0] == n, f"experts.fc2_w must be [n, H, O] with n={n}, got {w2}")
        if es.has_fc1_bias:
            _expect(ex.get("fc1_b") is not None, "ffn has_fc1_bias=True but 'fc1_b' is missing")
        if es.has_fc2_bias:
            _expect(ex.get("fc2_b") is not None, "ffn has_fc2_bias=True but 'fc2_b' is missing")
        del H
    else:
        for key in ("gate_w", "up_w", "down_w"):
            _expect(key in ex, f"gated_ffn experts need '{key}', got keys {sorted(ex)}")


# --------------------------------------------------------------------------- forward

def route(params: dict, x: Tensor, spec: MoESpec, *, comm=None, generator=None, noise: Optional[Tensor] = None,
          training: bool = False, alignment: Optional[int] = None) -> tuple[Routing, Tensor]:
    """Gate and route tokens x [T, M]; returns the Routing and the unweighted l_aux.

    ``alignment`` overrides ``spec.alignment`` (expert parallel needs C % (s*d) == 0)."""
    routing, l_aux, _ = _route(params, x, spec, comm=comm, generator=generator, noise=noise, training=training,
                               alignment=alignment)
    return routing, l_aux


def _route(params, x, spec, *, comm, generator, noise, training, alignment):
    gs = spec.gate
    logits = _gates.gate_logits(gs.type, params["gate"], x, fp32=gs.fp32_gate)
    noisy = logits
    if training and gs.gate_noise > 0:
        noisy = _gates.add_gate_noise(logits, gs.gate_noise, generator=generator, noise=noise)
    scores = _gates.scores_from_logits(noisy, gs.score_fn)
    routing = top_k_routing(scores, gs.k, gs.capacity_factor, normalize=spec.normalize_gate,
                            batch_prioritized=spec.batch_prioritized,
                            alignment=spec.alignment if alignment is None else alignment, comm=comm)
    if spec.is_gshard_loss:
        l_aux = gshard_loss(scores, routing.expert_ids[0])
    else:
        l_aux = load_importance_loss(logits, noisy, gs.k, gs.gate_noise)
    return routing, l_aux, scores


def _check_input(x, spec: MoESpec) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"moe: x must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"moe: x must be floating point, got dtype {x.dtype}")
    if x.dim() < 2:
        raise ValueError(f"moe: x must have at least 2 dims [..., M], got shape {tuple(x.shape)}")
    if x.shape[-1] != spec.model_dim:
        raise ValueError(f"moe: x's last dim must be model_dim={spec.model_dim}, got shape {tuple(x.shape)}")


def _expert_dtype(experts, fallback: torch.dtype) -> torch.dtype:
    for leaf in pytree.tree_leaves(experts):
        if isinstance(leaf, Tensor) and leaf.is_floating_point():
            return leaf.dtype
    return fallback


def moe(params: dict, x: Tensor, spec: MoESpec, *, comm=None, generator: Optional[torch.Generator] = None,
        noise: Optional[Tensor] = None, training: bool = False, routing: Optional[Routing] = None,
        parallel=None) -> tuple[Tensor, MoEAux]:
    """One MoE layer forward.

    Args:
        params: ``{"gate": ..., "experts": ...}`` from :func:`init_params`.
        x: float [..., M]; all leading dims are tokens.
        spec: static settings.
        comm: communicator (None = one process).
        generator, noise: gate-noise randomness (training only).
        training: enables gate noise.
        routing: a recorded :class:`Routing` to replay instead of gating
            (then ``l_aux`` is 0 and no gradient reaches the gate).
        parallel: :class:`fmoe.parallel.ParallelSpec` for this call only (mode
            'data'/'model'/'adaptive:r', overlap degree, 2DH local size);
            used when ``comm.size > 1``. Capacity is aligned to s*d.

    Returns:
        y with x's leading dims, last dim O, x's dtype; and :class:`MoEAux`.
    """
    comm = resolve(comm)
    alignment = spec.alignment
    if comm.size == 1:
        _check_input(x, spec)
        check_params(params, spec)
    else:
        from . import parallel as _par  # distributed path lives in its own module
        parallel = parallel or _par.ParallelSpec()
        # Before any other collective: bad input or ranks that disagree raise everywhere, never hang.
        _par.check_moe_call(comm, spec, parallel, x, params, routing,
                            lambda: (_check_input(x, spec), check_params(params, spec)))
        alignment = _par.capacity_alignment(spec.num_experts, comm.size, parallel, spec.alignment)
    tokens = x.reshape(-1, spec.model_dim)
    if routing is None:
        routing, l_aux, scores = _route(params, tokens, spec, comm=comm, generator=generator, noise=noise,
                                        training=training, alignment=alignment)
    else:
        if routing.num_tokens != tokens.shape[0] or routing.num_experts != spec.num_experts:
            raise ValueError(f"moe: injected routing is for T={routing.num_tokens}, E={routing.num_experts}; "
                             f"this call has T={tokens.shape[0]}, E={spec.num_experts}")
        l_aux, scores = x.new_zeros(()), None
    compute = tokens.to(_expert_dtype(params["experts"], x.dtype))
    pos = routing.positions()  # computed once for dispatch and combine
    buffers = dispatch(compute, routing, weighted=not spec.is_postscore, positions=pos)
    if comm.size == 1:
        # Only the first min(count, C) rows of each buffer hold tokens; skip the rest
        # (bit-identical to the padded GEMMs unless spec.experts.exact_rows asks for speed).
        out_buffers = apply_experts(spec.experts, params["experts"], buffers,
                                    rows=filled_rows(routing.counts, routing.capacity),
                                    exact_rows=spec.experts.exact_rows)
    else:
        out_buffers = _par.expert_parallel(spec, params["experts"], buffers, comm,
                                           dataclasses.replace(parallel, check=False))
    y = combine(out_buffers, routing, weighted=spec.is_postscore, positions=pos)
    y = y.reshape(*x.shape[:-1], y.shape[-1]).to(x.dtype)
    aux = MoEAux(l_aux, routing.counts, routing.num_dropped(), routing, routing.capacity, scores)
    return y, aux
