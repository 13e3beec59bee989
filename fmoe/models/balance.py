"""Load-balancing objectives for the adapted architectures, as pure functions.

* :func:`load_balancing_loss` — the Switch/GShard-style auxiliary loss transformers adds for
  Qwen3-MoE, Qwen2-MoE, GPT-OSS and Mixtral (spec architectures.md §1.5), over the router
  logits of all layers pooled together, with optional padding mask.
* :func:`aux_free_bias_update` — DeepSeek-V3's auxiliary-loss-free balancing: after each step
  move ``e_score_correction_bias`` by ±γ against each expert's load (the bias only affects
  selection, never the weights; transformers never updates it in the forward pass).
* :func:`sequence_aux_loss` — DeepSeek-V3's complementary sequence-wise balance loss.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import Tensor

__all__ = ["load_balancing_loss", "expert_load", "aux_free_bias_update", "sequence_aux_loss"]


def _pool(router_logits: Union[Tensor, Sequence[Tensor]]) -> Tensor:
    if isinstance(router_logits, Tensor):
        return router_logits.reshape(-1, router_logits.shape[-1])
    if len(router_logits) == 0:
        raise ValueError("router_logits is empty")
    return torch.cat([r.reshape(-1, r.shape[-1]) for r in router_logits], dim=0)


def load_balancing_loss(router_logits: Union[Tensor, Sequence[Tensor]], top_k: int, *,
                        attention_mask: Optional[Tensor] = None) -> Tensor:
    """loss = E · Σ_e f_e · P_e over all layers' rows pooled (unweighted; multiply by
    ``router_aux_loss_coef`` yourself).

    p = softmax(logits) in fp32; f_e = (number of (row, slot) top-k selections of e) / rows;
    P_e = mean over rows of p[:, e]. With ``attention_mask`` [B, S] (1 = real token) every
    layer's [B*S, E] rows are weighted by the mask, so padding counts in neither f nor P.

    Args:
        router_logits: one [T, E] tensor or a sequence of per-layer [T, E] (T = B*S when masked).
        top_k: k. attention_mask: optional [B, S].
    Returns:
        fp32 scalar.
    """
    logits = _pool(router_logits)
    E = logits.shape[-1]
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k must be in [1, {E}], got {top_k}")
    p = torch.softmax(logits.float(), dim=-1)
    ids = torch.topk(p, top_k, dim=-1).indices                                  # [N, k]
    hits = (ids.unsqueeze(-1) == torch.arange(E, device=ids.device)).float()     # [N, k, E]
    if attention_mask is None:
        f = hits.mean(0)                                                         # [k, E]
        P = p.mean(0)
    else:
        m = attention_mask.reshape(-1).float()
        if logits.shape[0] % m.numel():
            raise ValueError(f"attention_mask has {m.numel()} tokens but the pooled logits have "
                             f"{logits.shape[0]} rows (not a whole number of layers)")
        m = m.repeat(logits.shape[0] // m.numel())
        f = (hits * m[:, None, None]).sum(0) / m.sum()
        P = (p * m[:, None]).sum(0) / m.sum()
    return (f * P.unsqueeze(0)).sum() * E


def expert_load(ids: Tensor, num_experts: int) -> Tensor:
    """int64 [E]: (token, slot) selections per expert from ids [T, k] or [k, T] (negatives ignored)."""
    flat = ids.reshape(-1)
    return (flat.unsqueeze(-1) == torch.arange(num_experts, device=ids.device)).sum(0)


def aux_free_bias_update(bias: Tensor, load: Tensor, rate: float) -> Tensor:
    """DeepSeek-V3 auxiliary-loss-free balancing step (returns a new bias; nothing in place).

        b_e ← b_e − γ · sign(load_e − mean(load))

    Overloaded experts become less likely to be selected, underloaded ones more; an expert at
    exactly the mean load is left alone. Sum ``load`` over data-parallel ranks (and over the
    accumulated micro-batches) before calling.

    Args:
        bias: e_score_correction_bias [E] (fp32). load: [E] selections per expert (e.g.
            ``aux.counts`` or :func:`expert_load`). rate: γ (DeepSeek-V3 used 0.001).
    Returns:
        [E] in bias' dtype.
    """
    if bias.shape != load.shape:
        raise ValueError(f"bias {tuple(bias.shape)} and load {tuple(load.shape)} must both be [E]")
    l = load.to(torch.float64)
    step = torch.sign(l - l.mean()).to(bias.dtype)
    return bias - rate * step


def sequence_aux_loss(scores: Tensor, ids: Tensor, *, alpha: float = 1.0) -> Tensor:
    """DeepSeek-V3 sequence-wise balance loss, averaged over sequences.

    Per sequence of length S with E routed experts and k selections per token:
        s'_{t,e} = s_{t,e} / Σ_e' s_{t,e'}      (normalised affinity; s = sigmoid scores)
        f_e = E / (k·S) · Σ_t 1[e ∈ topk(t)]
        P_e = (1/S) Σ_t s'_{t,e}
        L = alpha · Σ_e f_e · P_e

    Args:
        scores: [B, S, E] (or [S, E]) non-negative affinities, e.g. sigmoid(router_logits).
        ids: int [B, S, k] (or [S, k]) selected experts.
        alpha: balance factor α.
    Returns:
        scalar in scores' dtype (fp32 for fp32 scores); 1·alpha for a perfectly uniform router.
    """
    if scores.dim() == 2:
        scores, ids = scores.unsqueeze(0), ids.unsqueeze(0)
    if scores.dim() != 3 or ids.dim() != 3 or scores.shape[:2] != ids.shape[:2]:
        raise ValueError(f"scores [B, S, E] and ids [B, S, k] must agree, got {tuple(scores.shape)} and "
                         f"{tuple(ids.shape)}")
    B, S, E = scores.shape
    k = ids.shape[-1]
    sel = (ids.unsqueeze(-1) == torch.arange(E, device=ids.device)).any(dim=2).to(scores.dtype)  # [B, S, E]
    f = sel.sum(1) * (E / (k * S))
    P = (scores / scores.sum(-1, keepdim=True)).mean(1)
    return alpha * (f * P).sum(-1).mean()
