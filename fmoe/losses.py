"""Auxiliary load-balancing losses as pure functions (spec §10).

Weighting them and adding them to the training loss is the caller's job.
All take scores/logits [T, E] and return a scalar tensor in the scores' dtype.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["gshard_loss", "load_importance_loss", "switch_loss", "z_loss"]


def _fraction_routed(top1_ids: Tensor, num_experts: int, dtype: torch.dtype) -> Tensor:
    """[E] fraction of tokens whose slot-0 expert is e (masked ids < 0 count nowhere)."""
    experts = torch.arange(num_experts, device=top1_ids.device)
    hits = (top1_ids.reshape(-1, 1) == experts).to(dtype)
    return hits.sum(0) / top1_ids.numel()


def gshard_loss(scores: Tensor, top1_ids: Tensor) -> Tensor:
    """GShard balance loss with top-1 ids only (Tutel quirk §15.4):

        l = E * sum_e mean_t(scores[t, e]) * frac1_e

    Args:
        scores: [T, E] (noisy) softmax scores.
        top1_ids: int [T], the slot-0 expert of every token.
    Returns:
        scalar; 1.0 for uniform scores with a balanced top-1 assignment.
    """
    E = scores.shape[1]
    return E * (scores.mean(0) * _fraction_routed(top1_ids, E, scores.dtype)).sum()


def switch_loss(scores: Tensor, top1_ids: Tensor) -> Tensor:
    """Switch Transformer loss E * sum_e f_e * P_e (f: top-1 fraction, P: mean score).

    Numerically the same formula as GShard's; kept under its own name because
    users look for it under this one.
    """
    return gshard_loss(scores, top1_ids)


def _cv_squared(v: Tensor) -> Tensor:
    # Unbiased variance over experts, as Tutel (torch.var default).
    return v.var() / (v.mean() ** 2 + 1e-10)


def load_importance_loss(clean_logits: Tensor, noisy_logits: Tensor, k: int, gate_noise: float) -> Tensor:
    """Tutel's load/importance loss (spec §10.2; Tutel-specific, not Shazeer's).

    l = (CV^2(Imp) + CV^2(Load)) / 2 with Imp_e = sum_t softmax(clean)[t, e] and
    Load_e = sum_t Phi((softmax(clean)[t, e] - theta_t) / sigma), where theta_t is
    the k-th largest *noisy logit* of token t and sigma = gate_noise / E. The
    probability-vs-logit comparison is Tutel's quirk, kept on purpose.

    Args:
        clean_logits, noisy_logits: [T, E].
        k: experts per token (clipped to E).
        gate_noise: > 0 (the load term divides by it).
    """
    if not gate_noise > 0:
        raise ValueError(f"load_importance_loss needs gate_noise > 0, got {gate_noise}")
    E = clean_logits.shape[1]
    k = min(int(k), E)
    p = torch.softmax(clean_logits, dim=1)
    l_imp = _cv_squared(p.sum(0))
    threshold = torch.topk(noisy_logits, k, dim=1).values[:, k - 1:k]
    sigma = gate_noise / E
    normal_cdf = 0.5 * (1 + torch.erf((p - threshold) / (sigma * math.sqrt(2.0))))
    l_load = _cv_squared(normal_cdf.sum(0))
    return (l_imp + l_load) / 2


def z_loss(logits: Tensor) -> Tensor:
    """Router z-loss (ST-MoE): mean_t logsumexp(logits[t])^2."""
    return torch.logsumexp(logits, dim=1).square().mean()
