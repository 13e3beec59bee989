"""Architecture routers as pure functions (spec architectures.md §2-§8).

Each ``*_topk`` function returns the router triple in transformers' layout,
``(router_logits [T, E], weights [T, k], ids int64 [T, k])``, with the dtypes and order of
operations of the spec; each ``*_router`` wraps it into a dropless :class:`fmoe.Routing`
(capacity = max per-expert load, nothing dropped) and returns ``(routing, router_logits)``.

Dtype summary (dt = x's dtype):

=========  ==================  ======================  ===============
router     logits              selection               weights
=========  ==================  ======================  ===============
Qwen       dt GEMM             softmax fp32, top-k     cast to dt
DeepSeek   fp32 GEMM           sigmoid + bias, groups  fp32 (x rsf)
GPT-OSS    dt GEMM + bias      top-k on logits         softmax(k) in dt
Mixtral    dt GEMM             softmax fp32, top-k     fp32, renormed
=========  ==================  ======================  ===============
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..routing import Routing
from .common import to_routing

__all__ = [
    "qwen_topk", "deepseek_topk", "gpt_oss_topk", "mixtral_topk", "mixtral_jitter",
    "qwen_router", "deepseek_router", "gpt_oss_router", "mixtral_router",
]


def _check(x: Tensor, weight: Tensor, k: int) -> None:
    if x.dim() != 2:
        raise ValueError(f"router input must be tokens [T, H], got shape {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"router weight must be [E, H] with H={x.shape[1]}, got {tuple(weight.shape)}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= weight.shape[0]:
        raise ValueError(f"k must be an int in [1, E={weight.shape[0]}], got {k!r}")


def qwen_topk(x: Tensor, weight: Tensor, k: int, *, norm_topk_prob: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Qwen3-MoE / Qwen2-MoE / Qwen3-Next router (§2).

    Args:
        x: [T, H] in dt. weight: W_r [E, H] (used in dt).
        k: experts per token. norm_topk_prob: renormalise the k probabilities (no epsilon).
    Returns:
        logits [T, E] dt; weights [T, k] dt (slot 0 largest); ids int64 [T, k].
    """
    _check(x, weight, k)
    logits = F.linear(x, weight.to(x.dtype))
    # The logits are rounded to dt *before* the fp32 softmax; computing them in fp32 would
    # flip a few bf16 routing decisions (§13).
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    w, ids = torch.topk(probs, k, dim=-1)
    if norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    return logits, w.to(logits.dtype), ids


def deepseek_topk(x: Tensor, weight: Tensor, bias: Optional[Tensor], k: int, *, n_group: int = 1,
                  topk_group: int = 1, norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """DeepSeek-V3/R1/V3.1/V3.2, Kimi-K2, GLM-4.5+/GLM-5 "noaux_tc" router as in transformers (§4).

    Args:
        x: [T, H] any float dtype (promoted to fp32). weight: W_r [E, H] (used in fp32; the
            release stores it in bf16 and transformers keeps an fp32 copy).
        bias: e_score_correction_bias [E] fp32, used for *selection only*; None = zeros.
        k: experts per token. n_group, topk_group: group-limited selection (E % n_group == 0,
            >= 2 experts per group). norm_topk_prob: renormalise with +1e-20.
        routed_scaling_factor: rsf, always applied.
    Returns:
        logits [T, E] fp32; weights [T, k] fp32 (unbiased sigmoid scores); ids int64 [T, k]
        in torch.topk(sorted=False) order — compare ids as sets (§12.5).
    """
    _check(x, weight, k)
    T, E = x.shape[0], weight.shape[0]
    if n_group < 1 or E % n_group != 0 or E // n_group < 2:
        raise ValueError(f"n_group={n_group} must divide E={E} into groups of >= 2 experts")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group={topk_group} must be in [1, n_group={n_group}]")
    logits = F.linear(x.float(), weight.float())
    scores = logits.sigmoid()
    choice = scores if bias is None else scores + bias.float()
    # Group score = sum of the two best biased scores in each contiguous group.
    group_scores = choice.view(T, n_group, E // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, group_idx, True)
    keep = keep.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)
    choice = choice.masked_fill(~keep, float("-inf"))
    ids = torch.topk(choice, k=k, dim=-1, sorted=False)[1]
    w = scores.gather(1, ids)
    if norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return logits, w * routed_scaling_factor, ids


def gpt_oss_topk(x: Tensor, weight: Tensor, bias: Optional[Tensor], k: int) -> tuple[Tensor, Tensor, Tensor]:
    """GPT-OSS router (§7): linear with bias in dt, top-k on the raw logits, softmax over the k in dt.

    Returns:
        logits [T, E] dt; weights [T, k] dt; ids int64 [T, k] (descending logits).
    """
    _check(x, weight, k)
    logits = F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
    top, ids = torch.topk(logits, k, dim=-1)
    return logits, torch.softmax(top, dim=-1, dtype=top.dtype), ids


def mixtral_topk(x: Tensor, weight: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Mixtral router (§8): dt logits, fp32 softmax over all E, top-k, always renormalised, fp32 weights.

    Returns:
        logits [T, E] dt; weights [T, k] fp32; ids int64 [T, k].
    """
    _check(x, weight, k)
    logits = F.linear(x, weight.to(x.dtype))
    probs = torch.softmax(logits.float(), dim=-1)
    w, ids = torch.topk(probs, k, dim=-1)
    return logits, w / w.sum(dim=-1, keepdim=True), ids


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


def qwen_router(x: Tensor, weight: Tensor, k: int, *, norm_topk_prob: bool, comm=None) -> tuple[Routing, Tensor]:
    """:func:`qwen_topk` as a dropless Routing; returns (routing, logits [T, E])."""
    logits, w, ids = qwen_topk(x, weight, k, norm_topk_prob=norm_topk_prob)
    return to_routing(ids, w, weight.shape[0], comm=comm), logits


def deepseek_router(x: Tensor, weight: Tensor, bias: Optional[Tensor], k: int, *, n_group: int = 1,
                    topk_group: int = 1, norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0,
                    comm=None) -> tuple[Routing, Tensor]:
    """:func:`deepseek_topk` as a dropless Routing; returns (routing, logits [T, E] fp32)."""
    logits, w, ids = deepseek_topk(x, weight, bias, k, n_group=n_group, topk_group=topk_group,
                                   norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor)
    return to_routing(ids, w, weight.shape[0], comm=comm), logits


def gpt_oss_router(x: Tensor, weight: Tensor, bias: Optional[Tensor], k: int, *, comm=None) -> tuple[Routing, Tensor]:
    """:func:`gpt_oss_topk` as a dropless Routing; returns (routing, logits [T, E])."""
    logits, w, ids = gpt_oss_topk(x, weight, bias, k)
    return to_routing(ids, w, weight.shape[0], comm=comm), logits


def mixtral_router(x: Tensor, weight: Tensor, k: int, *, comm=None) -> tuple[Routing, Tensor]:
    """:func:`mixtral_topk` as a dropless Routing; returns (routing, logits [T, E])."""
    logits, w, ids = mixtral_topk(x, weight, k)
    return to_routing(ids, w, weight.shape[0], comm=comm), logits
