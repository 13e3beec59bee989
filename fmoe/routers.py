"""Every router as a pure function: token features -> one :class:`~fmoe.Routing`.

    spec = GateSpec(type="deepseek", k=8, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                    capacity_factor=0)
    params = init_router(spec, E, M, generator=g)
    routing, out = route(params, x, spec, num_experts=E)

Router types (``ROUTER_TYPES``), their parameters and their math:

=============  ==========================  ===================================================
type           params                      selection / weights
=============  ==========================  ===================================================
top            wg [E, M]                   Tutel: score_fn(noisy logits), top-k, eps-clamped
                                           renormalisation (spec routing.md §3.1, §4, §5, §8)
cosine_top     proj_w, proj_b, sim_matrix, Tutel/SwinV2 cosine logits (§3.2), then as 'top'
               temperature
qwen           wg [E, M]                   logits in dt, fp32 softmax, top-k, renorm without
                                           eps, weights cast to dt (architectures.md §2)
deepseek       wg [E, M], correction_bias  fp32 sigmoid; bias for selection only; group-limited
               [E]                         top-k; renorm +1e-20; x rsf; fp32 weights (§4)
gpt_oss        wg [E, M], bias [E]         dt logits + bias, top-k on logits, softmax over the
                                           k in dt (§7)
mixtral        wg [E, M]                   as qwen but fp32 weights; training jitter (§8)
expert_choice  wg [E, M]                   each expert picks its top-C tokens by score
                                           (Zhou et al. 2022); weights = scores
sinkhorn       wg [E, M]                   top-k on a Sinkhorn-balanced assignment matrix;
                                           weights = the unbalanced scores (S-BASE style)
=============  ==========================  ===================================================

Expert choice (Zhou et al. 2022, "Mixture-of-Experts with Expert Choice Routing"):
scores = score_fn(noisy logits) [T, E]; expert e takes the C tokens with the largest
scores[:, e] (C = :func:`expert_choice_capacity`, ranked best first); its weight for token t
is scores[t, e] (not renormalised). A token may be taken by several experts or by none
(then its routed output is 0). Balanced by construction; the batch decides who gets what.

Sinkhorn (S-BASE style, Clark et al. 2022): P = :func:`sinkhorn_balance` (noisy logits)
(``sinkhorn_iters`` Sinkhorn-Knopp iterations in fp32, log domain, rows -> 1, columns ->
T/E; no gradient flows through P); ids = top-k of each row of P (slot 0 = largest P);
weights = scores[t, ids] with scores = score_fn(noisy logits) *unbalanced*, renormalised
like Tutel's for k > 1. The balancing runs in eval mode too (a pure function of the batch);
for batch-independent inference route the same ``wg`` with type 'top'.

Token-choice routers produce ``expert_ids``/``weights`` [k, T] and go through
:func:`fmoe.routing.make_routing`, so Tutel's three capacity-factor modes, alignment and
batch-prioritized placement apply to all of them (``capacity_factor=0`` is dropless).
Expert choice builds its Routing directly (see :func:`route`).

Everything is pure torch (topk, gather, scatter, comparisons), composes with ``torch.func``
(grad through the gate weights, vmap over stacked gate parameters) and never mutates an input.
A small eager no-grad CPU call (decode) may run :func:`route_native` instead: the same torch ops
up to the scores, then top-k, gates, slots, capacity and the plan's rows in one native call, equal
bit for bit to :func:`route` (used by :func:`fmoe.moe`).
Randomness (Tutel gate noise, Mixtral jitter) takes an explicit generator or noise tensor.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils import _pytree as pytree

from . import _slots
from .routing import Routing, _capacity_factor, _group_max, _routing_of, _top_k, _trusted_routing, capacity_bound
from .routing import KeptRows, capacity_for, check_finite, raise_route_error
from .losses import gshard_loss

__all__ = [
    "ROUTER_TYPES", "GateSpec", "RouterOutput", "init_router", "router_forward", "route", "expert_choice_capacity",
    "sinkhorn_balance",
    # Tutel gates
    "linear_gate", "cosine_gate",
    # architecture routers
    "qwen_topk", "deepseek_topk", "gpt_oss_topk", "mixtral_topk", "mixtral_jitter",
]

ROUTER_TYPES = ("top", "cosine_top", "qwen", "deepseek", "gpt_oss", "mixtral", "expert_choice", "sinkhorn")
GATE_TYPES = ROUTER_TYPES
SCORE_FNS = ("softmax", "sigmoid")
# Routers whose logits come from Tutel's gate functions and whose score_fn / gate_noise /
# fp32_gate settings apply; the architecture routers have their own fixed dtype rules.
_TUTEL_LOGITS = ("top", "cosine_top", "expert_choice", "sinkhorn")
_MAX_LOG_INV_TEMPERATURE = math.log(100.0)


# --------------------------------------------------------------------------- spec

@dataclasses.dataclass(frozen=True)
class GateSpec:
    """Static router settings (Tutel's gate dict, extended to every router family).

    Attributes:
        type: one of ``ROUTER_TYPES``.
        k: experts per token (>= 1). Tutel routers clip it to E; the architecture routers
            require k <= E; for 'expert_choice' it is the *average* experts per token that
            sizes each expert's choice C.
        capacity_factor: > 0 padded, 0 dropless, < 0 capped dropless (token choice);
            > 0 for 'expert_choice' (C = :func:`expert_choice_capacity`).
        gate_noise: Tutel noise scale (training only); std is gate_noise / E
            ('top', 'cosine_top', 'expert_choice', 'sinkhorn').
        fp32_gate: Tutel-style routers compute logits in float32 (ignored by the
            architecture routers, whose dtype rules are fixed by the architecture).
        score_fn: 'softmax' (Tutel) or 'sigmoid' (Tutel-style routers only).
        proj_dim, init_t: cosine gate projection size and initial temperature.
        n_group, topk_group: DeepSeek group-limited selection (E % n_group == 0, >= 2
            experts per group, keep topk_group groups; 1/1 = none).
        routed_scaling_factor: DeepSeek rsf, multiplies the weights (always applied).
        jitter_eps: Mixtral training jitter eps: x * U(1 - eps, 1 + eps), in [0, 1).
        sinkhorn_iters: Sinkhorn-Knopp iterations (>= 1; each = one row + one column
            normalisation). The default 16 leaves max |row sum - 1| <= 7e-6 in fp32 on
            T=1024, E in {16, 64}, logits N(0, sigma in {1, 3}) plus a 4-logit skew (measured).
        sinkhorn_tol: 0 runs exactly ``sinkhorn_iters`` iterations (no host sync; vmap and
            compile friendly); > 0 stops earlier once every row sum is within tol of 1.
    """

    type: str = "top"
    k: int = 1
    capacity_factor: float = 1.0
    gate_noise: float = 0.0
    fp32_gate: bool = True
    score_fn: str = "softmax"
    proj_dim: int = 256
    init_t: float = 0.5
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    jitter_eps: float = 0.0
    sinkhorn_iters: int = 16
    sinkhorn_tol: float = 0.0

    def __post_init__(self):
        if self.type not in ROUTER_TYPES:
            raise ValueError(f"unknown gate type {self.type!r}; expected one of {ROUTER_TYPES}")
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"gate k must be an int >= 1, got {self.k!r} (a negative k does not shard "
                             "experts; use a negative num_experts_per_device)")
        if self.score_fn not in SCORE_FNS:
            raise ValueError(f"unknown score_fn {self.score_fn!r}; expected one of {SCORE_FNS}")
        if self.gate_noise < 0:
            raise ValueError(f"gate_noise must be >= 0, got {self.gate_noise}")
        t = self.type
        if t not in _TUTEL_LOGITS:
            if self.gate_noise > 0:
                raise ValueError(f"GateSpec.gate_noise={self.gate_noise} applies to {_TUTEL_LOGITS} only, not "
                                 f"type={t!r}" + (" (use jitter_eps)" if t == "mixtral" else ""))
            if self.score_fn != "softmax":
                raise ValueError(f"GateSpec.score_fn={self.score_fn!r} applies to {_TUTEL_LOGITS} only; "
                                 f"type={t!r} has its own score function")
        for name in ("n_group", "topk_group", "sinkhorn_iters"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"GateSpec.{name} must be an int >= 1, got {v!r}")
        if t != "deepseek":
            for name, default in (("n_group", 1), ("topk_group", 1), ("routed_scaling_factor", 1.0)):
                if getattr(self, name) != default:
                    raise ValueError(f"GateSpec.{name}={getattr(self, name)!r} applies to type='deepseek' only, "
                                     f"not {t!r}")
        if self.topk_group > self.n_group:
            raise ValueError(f"GateSpec.topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
        if not math.isfinite(self.routed_scaling_factor) or self.routed_scaling_factor <= 0:
            raise ValueError(f"GateSpec.routed_scaling_factor must be finite and > 0, got "
                             f"{self.routed_scaling_factor!r}")
        if not 0.0 <= self.jitter_eps < 1.0:
            raise ValueError(f"GateSpec.jitter_eps must be in [0, 1), got {self.jitter_eps!r}")
        if self.jitter_eps != 0.0 and t != "mixtral":
            raise ValueError(f"GateSpec.jitter_eps={self.jitter_eps!r} applies to type='mixtral' only, not {t!r}")
        if not self.sinkhorn_tol >= 0:
            raise ValueError(f"GateSpec.sinkhorn_tol must be >= 0, got {self.sinkhorn_tol!r}")
        if t != "sinkhorn" and (self.sinkhorn_iters != 16 or self.sinkhorn_tol != 0.0):
            raise ValueError(f"GateSpec.sinkhorn_iters/sinkhorn_tol apply to type='sinkhorn' only, not {t!r}")
        if t == "expert_choice" and not self.capacity_factor > 0:
            raise ValueError(f"GateSpec.capacity_factor must be > 0 for type='expert_choice' (it sizes each "
                             f"expert's choice C), got {self.capacity_factor!r}")
        # The capacity factor sizes the buffers. A recompiling torch.compile makes a float that
        # changed between calls symbolic (automatic dynamic), and a symbolic capacity cannot size a
        # buffer; a string is a constant to it (guarded by value), so capacity reads the factor's text.
        cf = self.capacity_factor
        real = isinstance(cf, numbers.Real) and not isinstance(cf, bool)
        object.__setattr__(self, "_capacity_factor_text", repr(float(cf)) if real else None)

    @property
    def static_capacity_factor(self):
        """``capacity_factor`` as a constant under torch.compile (never symbolic: a sweep that
        recompiles for another factor specializes on it); what sizes capacity."""
        text = self._capacity_factor_text
        return self.capacity_factor if text is None else float(text)


# --------------------------------------------------------------------------- output

@dataclasses.dataclass(frozen=True, eq=False)
class RouterOutput:
    """What a router computed, before capacity (a pytree; ``capacity`` and ``type`` are static).

    Attributes:
        expert_ids: int64 [k, T], slot 0 best; negative = masked pair. Expert choice:
            [E, T] with ``expert_ids[e, t] = e`` if expert e chose token t, else -1.
        weights: [k, T] gate values in the router's own dtype (Tutel: logits dtype; qwen,
            gpt_oss: x's dtype; deepseek, mixtral: fp32; expert choice: 0 where not chosen).
        logits: [T, E] clean logits as the architecture computes them (z-loss, HF loss).
        scores: [T, E] the probabilities the balance losses use (Tutel: score_fn of the noisy
            logits; qwen/gpt_oss/mixtral: fp32 softmax of the logits; deepseek: fp32 sigmoid;
            sinkhorn: the unbalanced scores).
        noisy_logits: [T, E] logits after gate noise (Tutel-style routers; equal to
            ``logits`` without noise) or None.
        importance: [T] max score per token (batch-prioritized placement) or None.
        slots: expert choice only: int64 [E, T] rank of token t in expert e's choice
            (0 = highest score), -1 if not chosen; None otherwise.
        tokens: None, or the tensor [T, M] the experts must see (Mixtral jitter).
        capacity: static: expert choice's C (tokens each expert picks), else None.
        type: static router type.
    """

    expert_ids: Tensor
    weights: Tensor
    logits: Tensor
    scores: Tensor
    noisy_logits: Optional[Tensor] = None
    importance: Optional[Tensor] = None
    slots: Optional[Tensor] = None
    tokens: Optional[Tensor] = None
    capacity: Optional[int] = None
    type: str = "top"


_OUT_LEAVES = ("expert_ids", "weights", "logits", "scores", "noisy_logits", "importance", "slots", "tokens")


pytree.register_pytree_node(
    RouterOutput,
    lambda o: ([getattr(o, n) for n in _OUT_LEAVES], (o.capacity, o.type)),
    lambda leaves, ctx: RouterOutput(*leaves, capacity=ctx[0], type=ctx[1]),
    serialized_type_name="fmoe.routers.RouterOutput",
    flatten_with_keys_fn=lambda o: ([(pytree.GetAttrKey(n), getattr(o, n)) for n in _OUT_LEAVES],
                                    (o.capacity, o.type)),
)


# --------------------------------------------------------------------------- Tutel gates

def linear_gate(params: dict, x: Tensor, *, fp32: bool = False) -> Tensor:
    """logits[t, e] = sum_m x[t, m] * wg[e, m]  (Tutel 'top'; no bias).

    Args:
        params: ``{"wg": [E, M]}``.
        x: [T, M].
        fp32: compute in float32 (the logits are float32).
    Returns:
        [T, E] logits.
    """
    wg = params["wg"]
    dt = torch.float32 if fp32 else x.dtype
    # a cast to the dtype a tensor has returns it, but is still a dispatched op: only cast what differs
    if x.dtype != dt:
        x = x.to(dt)
    return x @ (wg if wg.dtype == dt else wg.to(dt)).t()


def cosine_gate(params: dict, x: Tensor, *, fp32: bool = False) -> Tensor:
    """SwinV2-MoE cosine router (Tutel 'cosine_top', spec §3.2).

    logits = normalize_rows(x Wp^T + bp) . normalize_cols(sim) * exp(min(temperature, ln 100))

    Args:
        params: ``{"proj_w": [Pd, M], "proj_b": [Pd], "sim_matrix": [Pd, E], "temperature": [1]}``.
        x: [T, M].
    Returns:
        [T, E] logits.
    """
    dt = torch.float32 if fp32 else x.dtype
    u = F.normalize(F.linear(x.to(dt), params["proj_w"].to(dt), params["proj_b"].to(dt)), dim=1)
    v = F.normalize(params["sim_matrix"].to(dt), dim=0)
    scale = torch.exp(params["temperature"].to(dt).clamp(max=_MAX_LOG_INV_TEMPERATURE))
    return (u @ v) * scale


_GATES = {"top": linear_gate, "cosine_top": cosine_gate}


def gate_logits(gate_type: str, params: dict, x: Tensor, *, fp32: bool = False) -> Tensor:
    """Dispatch on the gate type name ('top' or 'cosine_top')."""
    try:
        fn = _GATES[gate_type]
    except KeyError:
        raise ValueError(f"unknown gate type {gate_type!r}; expected one of {sorted(_GATES)}") from None
    return fn(params, x, fp32=fp32)


def add_gate_noise(logits: Tensor, gate_noise: float, *, generator: Optional[torch.Generator] = None,
                   noise: Optional[Tensor] = None) -> Tensor:
    """Tutel gate noise (spec §4): logits + gate_noise * eps / E with eps ~ N(0, 1).

    Args:
        logits: [T, E].
        gate_noise: noise scale; 0 returns ``logits`` unchanged.
        generator: explicit RNG for eps (reproducible runs).
        noise: an explicit eps tensor [T, E] instead of sampling.
    """
    if gate_noise == 0:
        return logits
    if noise is None:
        noise = torch.randn(logits.shape, dtype=logits.dtype, device=logits.device, generator=generator)
    elif noise.shape != logits.shape:
        raise ValueError(f"noise must have the logits' shape {tuple(logits.shape)}, got {tuple(noise.shape)}")
    return logits + noise.to(logits.dtype) * (gate_noise / logits.shape[-1])


def scores_from_logits(logits: Tensor, score_fn: str = "softmax") -> Tensor:
    """Routing scores [T, E]: softmax over experts, or elementwise sigmoid."""
    if score_fn == "softmax":
        return torch.softmax(logits, dim=-1)
    if score_fn == "sigmoid":
        return torch.sigmoid(logits)
    raise ValueError(f"unknown score function {score_fn!r}; expected one of {SCORE_FNS}")


def _uniform(shape, bound: float, generator, dtype) -> Tensor:
    return (torch.rand(shape, generator=generator, dtype=torch.float32) * 2 - 1).mul_(bound).to(dtype)


def init_linear_gate(num_experts: int, model_dim: int, *, generator=None, dtype=torch.float32) -> dict:
    """wg ~ U(+-1/sqrt(M)), the nn.Linear default Tutel uses."""
    return {"wg": _uniform((num_experts, model_dim), 1 / math.sqrt(model_dim), generator, dtype)}


def init_cosine_gate(num_experts: int, model_dim: int, *, proj_dim: int = 256, init_t: float = 0.5,
                     generator=None, dtype=torch.float32) -> dict:
    """Projector as nn.Linear defaults, sim_matrix ~ N(0, 0.01), temperature = ln(1/init_t)."""
    bound = 1 / math.sqrt(model_dim)
    return {
        "proj_w": _uniform((proj_dim, model_dim), bound, generator, dtype),
        "proj_b": _uniform((proj_dim,), bound, generator, dtype),
        "sim_matrix": (torch.randn((proj_dim, num_experts), generator=generator) * 0.01).to(dtype),
        "temperature": torch.full((1,), math.log(1.0 / init_t), dtype=dtype),
    }


# --------------------------------------------------------------------------- architecture routers
#
# Each ``*_topk`` returns transformers' router triple ``(router_logits [T, E], weights [T, k],
# ids int64 [T, k])`` with the dtypes and order of operations of spec/architectures.md:
#
# =========  ==================  ======================  ===============
# router     logits              selection               weights
# =========  ==================  ======================  ===============
# Qwen       dt GEMM             softmax fp32, top-k     cast to dt
# DeepSeek   fp32 GEMM           sigmoid + bias, groups  fp32 (x rsf)
# GPT-OSS    dt GEMM + bias      top-k on logits         softmax(k) in dt
# Mixtral    dt GEMM             softmax fp32, top-k     fp32, renormed
# =========  ==================  ======================  ===============

def _check(x: Tensor, weight: Tensor, k: int) -> None:
    if x.dim() != 2:
        raise ValueError(f"router input must be tokens [T, H], got shape {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"router weight must be [E, H] with H={x.shape[1]}, got {tuple(weight.shape)}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= weight.shape[0]:
        raise ValueError(f"k must be an int in [1, E={weight.shape[0]}], got {k!r}")


def _qwen(x: Tensor, weight: Tensor, k: int, norm: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _check(x, weight, k)
    logits = F.linear(x, weight.to(x.dtype))
    # The logits are rounded to dt *before* the fp32 softmax; computing them in fp32 would
    # flip a few bf16 routing decisions (§13).
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    w, ids = torch.topk(probs, k, dim=-1)
    if norm:
        w = w / w.sum(dim=-1, keepdim=True)
    return logits, probs, w, ids


def qwen_topk(x: Tensor, weight: Tensor, k: int, *, norm_topk_prob: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Qwen3-MoE / Qwen2-MoE / Qwen3-Next router (§2).

    Args:
        x: [T, H] in dt. weight: W_r [E, H] (used in dt).
        k: experts per token. norm_topk_prob: renormalise the k probabilities (no epsilon).
    Returns:
        logits [T, E] dt; weights [T, k] dt (slot 0 largest); ids int64 [T, k].
    """
    logits, _, w, ids = _qwen(x, weight, k, norm_topk_prob)
    return logits, w.to(logits.dtype), ids


def _router_dtype(dtype: torch.dtype) -> torch.dtype:
    # fp32 for bf16/fp16/fp32 (transformers); float64 stays float64 so that finite-difference
    # checks can run in double precision (transformers would round it to fp32).
    return torch.promote_types(dtype, torch.float32)


def _deepseek(x, weight, bias, k, n_group, topk_group, norm, rsf):
    _check(x, weight, k)
    T, E = x.shape[0], weight.shape[0]
    if n_group < 1 or E % n_group != 0 or E // n_group < 2:
        raise ValueError(f"n_group={n_group} must divide E={E} into groups of >= 2 experts")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group={topk_group} must be in [1, n_group={n_group}]")
    if k > E // n_group * topk_group:
        raise ValueError(f"k={k} exceeds the {E // n_group * topk_group} experts of topk_group={topk_group} "
                         f"groups of {E // n_group}")
    dt = _router_dtype(x.dtype)
    logits = F.linear(x.to(dt), weight.to(dt))
    scores = logits.sigmoid()
    choice = scores if bias is None else scores + bias.to(dt)
    # Group score = sum of the two best biased scores in each contiguous group.
    group_scores = choice.view(T, n_group, E // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, group_idx, True)
    keep = keep.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)
    choice = choice.masked_fill(~keep, float("-inf"))
    ids = torch.topk(choice, k=k, dim=-1, sorted=False)[1]
    w = scores.gather(1, ids)
    if norm:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return logits, scores, w * rsf, ids


def deepseek_topk(x: Tensor, weight: Tensor, bias: Optional[Tensor], k: int, *, n_group: int = 1,
                  topk_group: int = 1, norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """DeepSeek-V3/R1/V3.1/V3.2, Kimi-K2, GLM-4.5+/GLM-5 "noaux_tc" router as in transformers (§4).

    Args:
        x: [T, H] any float dtype (promoted to fp32; float64 stays float64). weight: W_r [E, H]
            (used in fp32; the release stores it in bf16 and transformers keeps an fp32 copy).
        bias: e_score_correction_bias [E] fp32, used for *selection only*; None = zeros.
        k: experts per token. n_group, topk_group: group-limited selection (E % n_group == 0,
            >= 2 experts per group). norm_topk_prob: renormalise with +1e-20.
        routed_scaling_factor: rsf, always applied.
    Returns:
        logits [T, E] fp32; weights [T, k] fp32 (unbiased sigmoid scores); ids int64 [T, k]
        in torch.topk(sorted=False) order — compare ids as sets (§12.5).
    """
    logits, _, w, ids = _deepseek(x, weight, bias, k, n_group, topk_group, norm_topk_prob, routed_scaling_factor)
    return logits, w, ids


def gpt_oss_topk(x: Tensor, weight: Tensor, bias: Optional[Tensor], k: int) -> tuple[Tensor, Tensor, Tensor]:
    """GPT-OSS router (§7): linear with bias in dt, top-k on the raw logits, softmax over the k in dt.

    Returns:
        logits [T, E] dt; weights [T, k] dt; ids int64 [T, k] (descending logits).
    """
    _check(x, weight, k)
    logits = F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
    top, ids = torch.topk(logits, k, dim=-1)
    return logits, torch.softmax(top, dim=-1, dtype=top.dtype), ids


def _mixtral(x: Tensor, weight: Tensor, k: int, norm: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _check(x, weight, k)
    logits = F.linear(x, weight.to(x.dtype))
    probs = torch.softmax(logits.float(), dim=-1)
    w, ids = torch.topk(probs, k, dim=-1)
    return logits, probs, (w / w.sum(dim=-1, keepdim=True) if norm else w), ids


def mixtral_topk(x: Tensor, weight: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Mixtral router (§8): dt logits, fp32 softmax over all E, top-k, always renormalised, fp32 weights.

    Returns:
        logits [T, E] dt; weights [T, k] fp32; ids int64 [T, k].
    """
    logits, _, w, ids = _mixtral(x, weight, k, True)
    return logits, w, ids


def mixtral_jitter(x: Tensor, eps: float, *, generator: Optional[torch.Generator] = None) -> Tensor:
    """Mixtral training jitter: x * U(1 - eps, 1 + eps), elementwise, **not** in place.

    Draws the same numbers as transformers' ``empty_like(x).uniform_(...)`` for the same RNG
    state, so seeding ``generator`` like the global RNG reproduces it. Both the router and
    the experts must see the returned tensor (§8).
    """
    if eps <= 0:
        return x
    noise = torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps, generator=generator)
    return x * noise


# --------------------------------------------------------------------------- Sinkhorn

def sinkhorn_balance(logits: Tensor, *, iters: int = 16, tol: float = 0.0) -> Tensor:
    """Balanced assignment matrix by Sinkhorn-Knopp on K = exp(logits), in the log domain.

    Finds P = diag(u) K diag(v) with every row summing to 1 (each token spends one unit) and
    every column to T/E (each expert receives an equal share). Each iteration normalises the
    rows, then the columns, so after it the column sums are exact up to rounding and the
    row sums converge (linearly) to 1. Computed in fp32 (float64 stays float64) with
    logsumexp, so no exp overflows and no epsilon is needed.

    Args:
        logits: [T, E] float.
        iters: maximum iterations (>= 1).
        tol: 0 runs exactly ``iters`` iterations (no host sync, vmap-safe); > 0 stops after
            the first iteration whose max |row sum - 1| <= tol (one host sync per iteration).
    Returns:
        P [T, E] in the compute dtype (rows ~ 1, columns = T/E).
    """
    if logits.dim() != 2:
        raise ValueError(f"sinkhorn_balance: logits must be [T, E], got shape {tuple(logits.shape)}")
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"sinkhorn_balance: iters must be an int >= 1, got {iters!r}")
    L = logits.to(_router_dtype(logits.dtype))
    T, E = L.shape
    if T == 0:
        return L.clone()
    log_col = math.log(T / E)
    log_v = torch.zeros_like(L[0])
    for _ in range(iters):
        log_u = -torch.logsumexp(L + log_v, dim=1)                        # rows -> 1
        log_v = log_col - torch.logsumexp(L + log_u[:, None], dim=0)     # columns -> T/E
        if tol > 0:
            rows = torch.exp(L + log_u[:, None] + log_v).sum(1)
            if float((rows - 1).abs().max()) <= tol:
                break
    return torch.exp(L + log_u[:, None] + log_v)


# --------------------------------------------------------------------------- params

def init_router(spec: GateSpec, num_experts: int, model_dim: int, *, generator: Optional[torch.Generator] = None,
                dtype: torch.dtype = torch.float32) -> dict:
    """Fresh router parameters.

    'top'/'cosine_top' draw exactly as Tutel's gates (so ``fmoe.init_params`` is unchanged);
    every other router draws ``wg`` [E, M] ~ U(+-1/sqrt(M)) (nn.Linear default) in ``dtype``;
    gpt_oss adds ``bias`` [E] ~ U(+-1/sqrt(M)) in ``dtype``; deepseek adds ``correction_bias``
    [E] = 0 in fp32 (transformers keeps it fp32).
    """
    _check_spec(spec)
    if spec.type == "cosine_top":
        return init_cosine_gate(num_experts, model_dim, proj_dim=spec.proj_dim, init_t=spec.init_t,
                                generator=generator, dtype=dtype)
    p = init_linear_gate(num_experts, model_dim, generator=generator, dtype=dtype)
    if spec.type == "gpt_oss":
        p["bias"] = _uniform((num_experts,), 1 / math.sqrt(model_dim), generator, dtype)
    elif spec.type == "deepseek":
        p["correction_bias"] = torch.zeros(num_experts, dtype=torch.float32)
    return p


def _check_spec(spec) -> None:
    if not isinstance(spec, GateSpec):
        raise TypeError(f"expected a fmoe.routers.GateSpec, got {type(spec).__name__}")


def _fail(cond: bool, msg) -> None:
    """Raise ValueError(msg()) unless cond (the message is built only on failure)."""
    if not cond:
        raise ValueError(msg())


def _shape(t) -> tuple:
    return tuple(t.shape) if isinstance(t, Tensor) else f"a {type(t).__name__}"


def check_router_params(params, spec: GateSpec, num_experts: int, model_dim: int) -> None:
    """Raise ValueError naming the first key or shape of ``params`` that does not fit ``spec``."""
    _check_spec(spec)
    E, M = num_experts, model_dim
    _fail(isinstance(params, dict), lambda: f"router params must be a dict, got {type(params).__name__}")
    g = params
    if spec.type == "cosine_top":
        need = {"proj_w", "proj_b", "sim_matrix", "temperature"}
        _fail(need <= set(g), lambda: f"cosine gate needs {sorted(need)}, got keys {sorted(g)}")
        pw, sm = _shape(g["proj_w"]), _shape(g["sim_matrix"])
        _fail(len(pw) == 2 and pw[1] == M, lambda: f"gate.proj_w must be [Pd, {M}], got {pw}")
        _fail(len(sm) == 2 and sm[1] == E and sm[0] == pw[0],
              lambda: f"gate.sim_matrix must be [Pd, {E}] with Pd={pw[0]}, got {sm}")
        _fail(_shape(g["proj_b"]) == (pw[0],),
              lambda: f"gate.proj_b must be [Pd] = [{pw[0]}], got {_shape(g['proj_b'])}")
        _fail(_shape(g["temperature"]) == (1,), lambda: f"gate.temperature must be [1], got {_shape(g['temperature'])}")
        return
    name = "linear gate" if spec.type == "top" else f"{spec.type} router"
    _fail("wg" in g, lambda: f"{name} needs 'wg', got keys {sorted(g)}")
    _fail(_shape(g["wg"]) == (E, M), lambda: f"gate.wg must be [E, M] = [{E}, {M}], got {_shape(g['wg'])}")
    if spec.type == "gpt_oss":
        _fail("bias" in g, lambda: f"gpt_oss router needs 'bias' [E], got keys {sorted(g)}")
    if spec.type in ("gpt_oss", "deepseek"):
        key = "bias" if spec.type == "gpt_oss" else "correction_bias"
        if g.get(key) is not None:
            _fail(_shape(g[key]) == (E,), lambda: f"gate.{key} must be [E] = [{E}], got {_shape(g[key])}")


# --------------------------------------------------------------------------- forward

def expert_choice_capacity(capacity_factor: float, k: int, num_tokens: int, num_experts: int) -> int:
    """Tokens each expert picks in expert-choice routing:

        C = min(T, int(capacity_factor * ceil(k * T / E)))

    so that on average every token is processed by ~k * capacity_factor experts (Zhou et al.
    2022 use C = T * c / E with c the capacity factor; here c = k * capacity_factor so that
    ``k`` keeps its meaning of "experts per token"). Raises if C would be 0.
    """
    cf = float(capacity_factor)
    if not cf > 0:
        raise ValueError(f"expert_choice needs capacity_factor > 0, got {capacity_factor!r}")
    C = int(cf * -(-(k * num_tokens) // num_experts))
    if C < 1 and num_tokens > 0:
        raise ValueError(f"expert-choice capacity is 0: int(capacity_factor * ceil(k * T / E)) = int({cf} * "
                         f"ceil({k} * {num_tokens} / {num_experts})) = 0; use a larger capacity_factor or k")
    return min(C, num_tokens)


# Non-finite x (or router weights) give non-finite logits; top-k would then pick experts for a NaN
# row (an error for some k / normalize settings, a NaN output row for the others).
_LOGITS = ("router logits [T, E]", "the router's input x or its parameters hold NaN/Inf. Find where it comes from "
           "upstream, or clean x (torch.nan_to_num) before the layer")


def _check_logits(logits: Tensor) -> None:
    check_finite(logits, *_LOGITS)


def _tutel_logits(spec, params, x, training, generator, noise):
    fn = cosine_gate if spec.type == "cosine_top" else linear_gate
    logits = fn(params, x, fp32=spec.fp32_gate)
    _check_logits(logits)
    noisy = logits
    if training and spec.gate_noise > 0:
        noisy = add_gate_noise(logits, spec.gate_noise, generator=generator, noise=noise)
    return logits, noisy, scores_from_logits(noisy, spec.score_fn)


def _normalize_tutel(vals: Tensor) -> Tensor:
    # Tutel's formula (routing.md §8): divide by the sum clamped at the dtype's eps; [k, T].
    if vals.shape[0] < 2:
        return vals
    eps = torch.finfo(vals.dtype).eps
    return vals / vals.sum(dim=0, keepdim=True).clamp(min=eps)


def _check_x(x) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"router input must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"router input must be tokens [T, M], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"router input must be floating point, got dtype {x.dtype}")


def router_forward(params: dict, x: Tensor, spec: GateSpec, *, num_experts: int, normalize: bool = True,
                   training: bool = False, generator: Optional[torch.Generator] = None,
                   noise: Optional[Tensor] = None) -> RouterOutput:
    """Run one router on tokens x [T, M]; no capacity yet.

    Args:
        params: router parameters (:func:`init_router`).
        x: float [T, M].
        spec: static settings (``spec.type`` selects the router).
        num_experts: E.
        normalize: renormalise the k gates with the router's own formula: Tutel-style
            routers (top, cosine_top, sinkhorn) divide by max(sum, eps) for k > 1; qwen and
            mixtral divide by the sum; deepseek by sum + 1e-20 (then always x rsf). gpt_oss
            weights are a softmax over the k selected logits (always normalised: False is an
            error). Expert-choice weights are the raw scores (not normalised, as in Zhou et al.).
        training: enables gate noise / Mixtral jitter.
        generator: RNG for gate noise or jitter.
        noise: explicit randomness instead of sampling: Tutel-style routers take eps [T, E]
            ~ N(0, 1); mixtral takes the multiplier [T, M] (values in [1 - eps, 1 + eps]).
    Returns:
        :class:`RouterOutput`.
    """
    return _router_forward(params, x, spec, num_experts, normalize, training, generator, noise, importance=True)


def _router_forward(params: dict, x: Tensor, spec: GateSpec, num_experts: int, normalize: bool, training: bool,
                    generator, noise, *, importance: bool) -> RouterOutput:
    """:func:`router_forward`; ``importance=False`` leaves ``RouterOutput.importance`` None (one
    [T, E] reduction less where nothing places tokens by it)."""
    _check_spec(spec)
    _check_x(x)
    check_router_params(params, spec, num_experts, x.shape[1])
    t = spec.type

    def amax(s: Tensor) -> Optional[Tensor]:
        return s.amax(dim=1) if importance else None

    k = spec.k
    if t in ("top", "cosine_top"):
        logits, noisy, scores = _tutel_logits(spec, params, x, training, generator, noise)
        # without noise the scores are a softmax / sigmoid of logits check_finite passed: in [0, 1]
        ids, w = _top_k(scores, k, normalize, checked=noisy is logits)
        return RouterOutput(ids, w, logits, scores, noisy, amax(scores), type=t)
    if t == "sinkhorn":
        logits, noisy, scores = _tutel_logits(spec, params, x, training, generator, noise)
        kk = min(k, num_experts)
        balanced = sinkhorn_balance(noisy.detach(), iters=spec.sinkhorn_iters, tol=spec.sinkhorn_tol)
        ids = torch.topk(balanced, kk, dim=1, sorted=True)[1].t().contiguous()
        w = scores.t().gather(0, ids)
        if normalize:
            w = _normalize_tutel(w)
        return RouterOutput(ids, w, logits, scores, noisy, amax(scores), type=t)
    if t == "expert_choice":
        logits, noisy, scores = _tutel_logits(spec, params, x, training, generator, noise)
        T, E = scores.shape
        C = expert_choice_capacity(spec.static_capacity_factor, k, T, E)
        st = scores.t()                                                     # [E, T]
        vals, tok = torch.topk(st, C, dim=1, sorted=True)                  # [E, C]
        experts = torch.arange(E, device=x.device)[:, None]
        ids = torch.full((E, T), -1, dtype=torch.int64, device=x.device).scatter(1, tok, experts.expand(E, C))
        rank = torch.arange(C, device=x.device).expand(E, C)
        slots = torch.full((E, T), -1, dtype=torch.int64, device=x.device).scatter(1, tok, rank)
        w = torch.where(ids >= 0, st, torch.zeros_like(st))
        return RouterOutput(ids, w, logits, scores, noisy, None, slots, capacity=C, type=t)
    if noise is not None and t != "mixtral":
        raise ValueError(f"noise= is for the Tutel-style routers and mixtral jitter, not type={t!r}")
    out = _arch_router(params, x, spec, k, normalize, training, generator, noise, amax)
    _check_logits(out.logits)
    return out


def _arch_router(params, x, spec: GateSpec, k: int, normalize: bool, training: bool, generator, noise,
                 amax: Callable) -> RouterOutput:
    """The architecture routers (qwen, deepseek, gpt_oss, mixtral) of :func:`router_forward`
    (``amax``: the importance of the scores, or None)."""
    t = spec.type
    if t == "qwen":
        logits, probs, w, ids = _qwen(x, params["wg"], k, normalize)
        return RouterOutput(ids.t().contiguous(), w.to(logits.dtype).t().contiguous(), logits, probs,
                            importance=amax(probs), type=t)
    if t == "deepseek":
        logits, scores, w, ids = _deepseek(x, params["wg"], params.get("correction_bias"), k, spec.n_group,
                                           spec.topk_group, normalize, spec.routed_scaling_factor)
        return RouterOutput(ids.t().contiguous(), w.t().contiguous(), logits, scores,
                            importance=amax(scores), type=t)
    if t == "gpt_oss":
        if not normalize:
            raise ValueError("gpt_oss weights are a softmax over the k selected logits and always sum to 1; "
                             "normalize=False is not defined for type='gpt_oss'")
        logits, w, ids = gpt_oss_topk(x, params["wg"], params["bias"], k)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        return RouterOutput(ids.t().contiguous(), w.t().contiguous(), logits, probs,
                            importance=amax(probs), type=t)
    # mixtral
    tokens = None
    if training and spec.jitter_eps > 0:
        if noise is None:
            tokens = mixtral_jitter(x, spec.jitter_eps, generator=generator)
        elif noise.shape != x.shape:
            raise ValueError(f"mixtral jitter noise must have x's shape {tuple(x.shape)}, got {tuple(noise.shape)}")
        else:
            tokens = x * noise.to(x.dtype)
    logits, probs, w, ids = _mixtral(x if tokens is None else tokens, params["wg"], k, normalize)
    return RouterOutput(ids.t().contiguous(), w.t().contiguous(), logits, probs, importance=amax(probs),
                        tokens=tokens, type=t)


def _expert_choice_routing(out: RouterOutput, num_experts: int, *, alignment: int, comm, capacity) -> Routing:
    C = out.capacity
    if capacity is None:
        cap = _group_max(C, comm, out.expert_ids.device)   # ranks' all-to-all buffers must agree
        if alignment > 256:
            alignment = -(-alignment // 128) * 128
        cap = -(-cap // alignment) * alignment
    else:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < C:
            raise ValueError(f"capacity={capacity!r} is below the expert-choice C={C} (tokens each expert picks)")
        cap = capacity
    counts = (out.expert_ids >= 0).sum(dim=1)
    return Routing(out.expert_ids, out.slots, out.weights, counts, int(cap), int(num_experts))


# --------------------------------------------------------------------------- one native call

# Routers whose selection, gates and rows one native call makes (route_native); calls up to this
# many tokens (decode and small batches: their host work is the call's; prefill keeps the torch ops).
_NATIVE_TYPES = ("top", "cosine_top", "qwen", "mixtral", "gpt_oss", "deepseek")
NATIVE_MAX_TOKENS = 64
_NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def native_applies(params: dict, x: Tensor, spec: GateSpec, training: bool) -> bool:
    """Whether :func:`route_native` may run this call: eager (no torch.compile, no torch.func
    transform), nothing that needs a gradient from the router, CPU tokens [T, M] with 0 < T <=
    NATIVE_MAX_TOKENS, a router of ``_NATIVE_TYPES`` and no training noise or jitter."""
    if spec.type not in _NATIVE_TYPES or (training and (spec.gate_noise > 0 or spec.jitter_eps > 0)):
        return False
    if type(x) is not Tensor or not x.is_cpu:
        return False
    shape = x.shape   # (one call into torch for the rank and T: a cold decode call pays microseconds for each)
    if len(shape) != 2 or not 0 < shape[0] <= NATIVE_MAX_TOKENS:
        return False
    if torch.compiler.is_compiling() or torch._C._functorch.maybe_current_level() is not None:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or any(isinstance(v, Tensor) and v.requires_grad
                                                           for v in params.values())):
        return False
    return True


def route_native(params: dict, x: Tensor, spec: GateSpec, *, num_experts: int, normalize: bool, alignment: int,
                 fraction: bool):
    """:func:`route` of one small eager CPU call (:func:`native_applies`, one process, no batch
    priority, computed capacity) with its top-k, gates, slots, capacity and kept rows made by one
    native call (fmoe/ops/csrc/walks.cpp ``route_rows``), or None where it does not apply (the
    extension not built, k past the gate sums it adds in torch's order, half-precision Tutel
    scores to normalise): then :func:`route` runs.

    The logits and scores are the torch ops of :func:`route` (the router GEMM, the softmax); the
    selection is torch.topk's algorithm with its tie order, the normalisation torch.sum's order of
    additions and one IEEE division, so ids, gates, slots and counts equal :func:`route`'s bit for
    bit (tests/test_native_route.py). gpt_oss's softmax over the k selected logits stays a torch op;
    deepseek's sigmoid and bias add are torch ops, its group-limited selection, normalisation and
    scaling native (torch's float ops with its Python scalars rounded to float). A 'top' gate whose
    weight has x's dtype runs its GEMM and softmax (or sigmoid) inside the native call (walks.cpp
    ``route_gate``: the same aten ops, dispatched from C++), which also builds the result's objects.
    Per-call statics (k, capacity formulas, the loss's width) are cached per spec, E, x's shape and
    dtype, normalize, alignment and fraction; the parameters are checked on every call. Nothing
    returned carries a gradient: the caller runs it only where none is needed (:func:`native_applies`).

    Returns:
        (routing, router output, l_aux, rows): l_aux is the GShard loss
        (:func:`fmoe.losses.gshard_loss` of the scores and the slot-0 experts, a 0-dim float32
        tensor) where ``fraction`` and the scores are float32, else None; the native call makes it
        in torch's orders of additions where :func:`fmoe._slots.loss_width` vouches for them, else
        the torch ops do from its counts. rows: the routing's :class:`~fmoe.routing.KeptRows` for
        the plan of the same call.
    """
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1 or not _slots.TOPK_AS_TORCH:
        return None   # route raises its own error (or, another torch's top-k, runs the torch ops)
    # the spec by identity (hashing a GateSpec hashes its 14 fields): the entry holds it, so its id is not reused
    entry = _NATIVE_STATICS.get(id(spec))
    shape = x.shape
    key = (num_experts, shape, x.dtype, normalize, alignment, fraction)
    st = entry[1].get(key) if entry is not None and entry[0] is spec else None
    if st is None:
        st = _native_statics(params, x, spec, num_experts, normalize, alignment, fraction)
        if st is None:
            return None
        if entry is None or entry[0] is not spec:
            if len(_NATIVE_STATICS) >= _NATIVE_STATICS_MAX:
                _NATIVE_STATICS.clear()
            entry = _NATIVE_STATICS[id(spec)] = (spec, {})
        entry[1][key] = st
    k, norm, order, cap_fixed, cap_limit, align, bound, frac, width, gate_dt = st
    t, E = spec.type, num_experts
    if not _router_params_fit(params, t, E, shape[1]):
        check_router_params(params, spec, E, shape[1])   # raises, naming the key or shape
    gate = gate_dt is not None and params["wg"].dtype == gate_dt
    if not gate:   # the torch ops of route() make the logits and scores, before the native call
        logits, scores, sel, noisy, choice, out_dtype, by_token = _native_scores(params, x, spec)
    if gate:
        # a linear gate of x's dtype: its logits (linear_gate's mm), scores, routing and this function's result
        # in one native call that dispatches the same aten ops
        res = _slots.route_gate(x, params["wg"], spec.score_fn == "sigmoid", k, norm, order, cap_fixed, cap_limit,
                                align, frac, width, bound, _RESULT_TYPES)
        if type(res[0]) is not int:
            if frac and not width:   # the torch ops from the native counts
                return res[0], res[1], gshard_loss(res[1].scores, None, fraction=res[2]), res[3]
            return res
        status, max_load, logits, past = res[0], res[1], res[2], res[0] == _ROUTE_PAST_BOUND
    else:
        res = _slots.route_rows(sel, logits, k, norm, out_dtype, by_token, cap_fixed, cap_limit, align, frac, choice,
                                spec.n_group, spec.topk_group, spec.routed_scaling_factor, scores if width else None,
                                width, order)
        status, ids, gates, slots, counts, tokens, pairs, offsets, dropped, row_gates, bounds, C, share = res
        past = C > bound
    if status or past:   # the torch path's error
        if not gate:
            max_load = int(counts.max()) if status == 0 else 1
        raise_route_error(status == _slots.ROUTE_NON_FINITE, logits, _LOGITS, spec.static_capacity_factor, k, shape[0],
                          E, alignment, max_load)
        if gate or status:
            raise AssertionError(f"native route status {status} raised no error")
    if t == "gpt_oss":
        gates = torch.softmax(gates, dim=-1, dtype=gates.dtype).t().contiguous()   # [T, k] -> [k, T]
    if frac and not width:   # the torch ops from the native counts
        share = gshard_loss(scores, None, fraction=share)
    routing = _trusted_routing(ids, slots, gates, counts, C, E, shapes=False)
    rows = object.__new__(KeptRows)   # (frozen dataclasses' __init__ costs microseconds; the fields are right)
    rows.__dict__.update(tokens=tokens, pairs=pairs, bounds=bounds, dropped=dropped, offsets=offsets,
                         row_gates=row_gates)
    out = object.__new__(RouterOutput)
    out.__dict__.update(expert_ids=ids, weights=gates, logits=logits, scores=scores, noisy_logits=noisy,
                        importance=None, slots=None, tokens=None, capacity=None, type=t)
    return routing, out, share, rows


def _native_scores(params: dict, x: Tensor, spec: GateSpec) -> tuple:
    """(logits, scores, the scores top-k reads, noisy logits, deepseek's choice scores, the gates' dtype, whether
    gpt_oss's softmax over the k follows) of :func:`route_native`: the torch ops of :func:`route`. (Matmul,
    softmax and sigmoid outputs are contiguous, as route_rows checks.)"""
    t = spec.type
    by_token, noisy, choice = False, None, None
    if t in ("top", "cosine_top"):
        logits = (cosine_gate if t == "cosine_top" else linear_gate)(params, x, fp32=spec.fp32_gate)
        scores = sel = scores_from_logits(logits, spec.score_fn)
        noisy, out_dtype = logits, scores.dtype
    elif t == "gpt_oss":
        wg, bias = params["wg"], params["bias"]
        w = wg if wg.dtype == x.dtype else wg.to(x.dtype)
        logits = sel = F.linear(x, w, None if bias is None else (bias if bias.dtype == x.dtype else bias.to(x.dtype)))
        out_dtype, by_token = logits.dtype, True
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    elif t == "deepseek":   # fp32 logits and sigmoid scores; the bias for selection only
        wg, bias = params["wg"], params.get("correction_bias")
        f32 = torch.float32
        logits = F.linear(x if x.dtype == f32 else x.to(f32), wg if wg.dtype == f32 else wg.to(f32))
        scores = sel = logits.sigmoid()
        choice = scores if bias is None else scores + (bias if bias.dtype == f32 else bias.to(f32))
        out_dtype = f32
    else:   # qwen, mixtral: dt logits, an fp32 softmax, fp32 gates (qwen's cast to dt)
        wg = params["wg"]
        logits = F.linear(x, wg if wg.dtype == x.dtype else wg.to(x.dtype))
        if t == "qwen":
            scores = sel = torch.softmax(logits, dim=-1, dtype=torch.float32)
        else:
            scores = sel = torch.softmax(logits.float(), dim=-1)
        out_dtype = logits.dtype if t == "qwen" else torch.float32
    return logits, scores, sel, noisy, choice, out_dtype, by_token


# route_native's statics for a (spec, E, x's shape and dtype, normalize, alignment, fraction): what its
# checks and capacity formulas give, which no tensor value changes. {id(spec): (spec, {(E, x.shape,
# x.dtype, normalize, alignment, fraction): statics})}: a process routes a few specs and shapes (decode:
# T = 1..NATIVE_MAX_TOKENS per layer spec); cleared past _NATIVE_STATICS_MAX specs.
_NATIVE_STATICS: dict = {}
_NATIVE_STATICS_MAX = 256
# the classes walks.cpp route_gate builds route_native's result from, and its status for a capacity past the bound
_RESULT_TYPES = (Routing, KeptRows, RouterOutput)
_ROUTE_PAST_BOUND = 3


def _native_statics(params, x, spec: GateSpec, E: int, normalize, alignment: int, fraction):
    """(k, norm, order, cap_fixed, cap_limit, align, capacity bound, frac, loss width, the gate weight's
    dtype for :func:`fmoe._slots.route_gate` or None) of :func:`route_native`, or None
    where it does not apply; raises the torch path's errors for a bad x, spec or parameters."""
    t, T = spec.type, x.shape[0]
    k = min(spec.k, E) if t in ("top", "cosine_top") else spec.k
    if k > E or k > 64 or (t == "gpt_oss" and not normalize):
        return None   # route raises its own error (or, k > 64, runs the torch ops)
    if t in ("top", "cosine_top"):
        dt = torch.float32 if spec.fp32_gate else x.dtype
        norm = _slots.ROUTE_TUTEL if normalize and k > 1 else _slots.ROUTE_RAW
        if dt not in _NATIVE_DTYPES or (norm != _slots.ROUTE_RAW and dt != torch.float32):
            return None
        loss32 = dt == torch.float32   # the scores are dt
    elif x.dtype not in _NATIVE_DTYPES:
        return None
    elif t == "deepseek":
        G = spec.n_group
        if E % G or E // G < 2 or k > E // G * spec.topk_group:
            return None
        norm = _slots.ROUTE_DEEPSEEK if normalize else _slots.ROUTE_SCALE
        loss32 = True
    else:
        norm = _slots.ROUTE_SUM if normalize and t != "gpt_oss" else _slots.ROUTE_RAW
        loss32 = True   # fp32 softmax or sigmoid scores
    if not _slots.route_rows_ready(k, norm):
        return None
    _check_x(x)
    check_router_params(params, spec, E, x.shape[1])
    cf = _capacity_factor(spec.static_capacity_factor)
    try:
        cap_fixed = capacity_for(cf, num_tokens=T, num_experts=E, k=k, alignment=alignment) if cf > 0 else -1
    except ValueError:
        return None   # route raises it, after its own checks of the logits
    cap_limit = k * int(-cf * -(-T // E)) if cf < 0 else -1
    align = 1 if cf > 0 else (alignment if alignment <= 256 else -(-alignment // 128) * 128)
    frac = bool(fraction) and loss32   # the scores the loss reads are float32
    width = _slots.loss_width(T, E) if frac else 0
    # linear_gate computes in x's dtype unless fp32_gate casts it: route_gate takes the gate where nothing is cast
    gate_dt = x.dtype if t == "top" and (x.dtype == torch.float32 or not spec.fp32_gate) else None
    return (k, norm, _slots.sum_order(k, norm), cap_fixed, cap_limit, align, capacity_bound(k, T), frac, width,
            gate_dt)


def _router_params_fit(params, t: str, E: int, M: int) -> bool:
    """Whether :func:`check_router_params` passes params (cosine_top: not checked here, False)."""
    if type(params) is not dict or t == "cosine_top":
        return False
    wg = params.get("wg")
    if not isinstance(wg, Tensor) or wg.shape != (E, M):
        return False
    if t == "gpt_oss":
        if "bias" not in params:
            return False
        b = params["bias"]
    elif t == "deepseek":
        b = params.get("correction_bias")
    else:
        return True
    return b is None or (isinstance(b, Tensor) and b.shape == (E,))


def route(params: dict, x: Tensor, spec: GateSpec, *, num_experts: int, normalize: bool = True,
          batch_prioritized: bool = False, training: bool = False, generator: Optional[torch.Generator] = None,
          noise: Optional[Tensor] = None, alignment: int = 1, comm=None, capacity: Optional[int] = None
          ) -> tuple[Routing, RouterOutput]:
    """:func:`router_forward`, then capacity and slots: the Routing dispatch/combine consume.

    Token-choice routers go through :func:`fmoe.routing.make_routing` with
    ``spec.capacity_factor`` (> 0 padded, 0 dropless, < 0 capped dropless), ``alignment``,
    ``comm`` (ranks agree on capacity) and, with ``batch_prioritized``, the importance
    ``max_e scores[t, e]`` (stable: ties by token index).

    Expert choice (k = E "slots"): ``expert_ids[e, t] = e`` if expert e chose token t, else
    -1; ``slots[e, t]`` = rank of t in e's choice; ``weights[e, t]`` = scores[t, e] where
    chosen (0 elsewhere); ``counts[e] = C`` (:func:`expert_choice_capacity`); the buffer
    capacity is the max of C over ``comm``'s ranks rounded up to ``alignment`` (or
    ``capacity`` if given, which must be >= C). Nothing is dropped; a token no expert chose
    gets zero output. ``batch_prioritized`` is an error (experts pick the tokens).

    Returns:
        (routing, router output); the output's ``importance`` is None unless ``batch_prioritized``
        (nothing else reads it: :func:`router_forward` gives it always).
    """
    out = _router_forward(params, x, spec, num_experts, normalize, training, generator, noise,
                          importance=batch_prioritized)
    if spec.type == "expert_choice":
        if batch_prioritized:
            raise ValueError("batch_prioritized has no meaning for type='expert_choice' (experts pick their "
                             "tokens; nothing is dropped)")
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1:
            raise ValueError(f"alignment must be an int >= 1, got {alignment!r}")
        return _expert_choice_routing(out, num_experts, alignment=alignment, comm=comm, capacity=capacity), out
    # the router's own ids and gates: [k, T] int64 and float by construction (make_routing's checks)
    routing = _routing_of(out.expert_ids, out.weights, num_experts, spec.static_capacity_factor,
                          importance=out.importance, alignment=alignment, comm=comm, capacity=capacity,
                          trusted=True)
    return routing, out

