"""Auxiliary load-balancing losses and balancing updates, as pure functions.

Weighting a loss and adding it to the training loss is the caller's job; nothing here
keeps state. Every loss works for every router through :func:`router_loss`, which reads
what it needs from a :class:`fmoe.routers.RouterOutput` and its :class:`fmoe.Routing`.

* Tutel (spec routing.md §10): :func:`gshard_loss` (= :func:`switch_loss`),
  :func:`load_importance_loss`; ST-MoE :func:`z_loss`.
* transformers (architectures.md §1.5): :func:`load_balancing_loss` over pooled layers.
* DeepSeek-V3: :func:`sequence_aux_loss` (sequence-wise), :func:`aux_free_bias_update`
  (auxiliary-loss-free balancing) with :func:`expert_load`.
* Global-batch balance: :func:`global_aux_loss` (expert fractions from counts summed over
  ranks and/or micro-batches).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import numpy as np
import torch
from torch import Tensor

__all__ = ["gshard_loss", "load_importance_loss", "switch_loss", "z_loss", "load_balancing_loss",
           "expert_load", "aux_free_bias_update", "sequence_aux_loss", "global_aux_loss", "router_loss",
           "LOSS_KINDS"]


def _fraction_routed(top1_ids: Tensor, num_experts: int, dtype: torch.dtype) -> Tensor:
    """[E] fraction of tokens whose slot-0 expert is e (masked ids < 0 count nowhere)."""
    if dtype in (torch.float32, torch.float64) and 0 < top1_ids.numel() < 1 << 24 and _host_ints(top1_ids):
        # The same counts as the one-hot's column sums (integers below 2^24, exact in either dtype) from one
        # bincount on the host, and the same division: a decode call's loss in 4 torch ops, not 10.
        ids = top1_ids.numpy().reshape(-1)
        try:
            hits = np.bincount(ids, minlength=num_experts)
        except ValueError:   # a masked id (< 0)
            hits = None
        if hits is None or hits.shape[0] != num_experts:   # ids < 0 to bin 0, ids >= E to bin E + 1, both cut off
            hits = np.bincount(np.minimum(np.maximum(ids, -1), num_experts) + 1, minlength=num_experts + 2)
            hits = hits[1:num_experts + 1]
        # numpy's division of the float counts by T is IEEE division in the dtype, as torch's is: the same
        # fractions bit for bit, without a torch op
        real = np.float32 if dtype == torch.float32 else np.float64
        return torch.from_numpy(hits.astype(real) / real(top1_ids.numel()))
    experts = torch.arange(num_experts, device=top1_ids.device)
    hits = (top1_ids.reshape(-1, 1) == experts).to(dtype)
    return hits.sum(0) / top1_ids.numel()


def _host_ints(t: Tensor) -> bool:
    """A plain eager CPU int32/int64 tensor whose values numpy may read (not traced, outside every torch.func
    transform)."""
    return (type(t) is Tensor and t.dtype in (torch.int64, torch.int32) and t.device.type == "cpu"
            and not torch.compiler.is_compiling() and torch._C._functorch.maybe_current_level() is None)


def gshard_loss(scores: Tensor, top1_ids: Optional[Tensor], *, fraction: Optional[Tensor] = None) -> Tensor:
    """GShard balance loss with top-1 ids only (Tutel quirk §15.4):

        l = E * sum_e mean_t(scores[t, e]) * frac1_e

    Args:
        scores: [T, E] (noisy) softmax scores.
        top1_ids: int [T], the slot-0 expert of every token.
        fraction: frac1 [E] in scores' dtype, where already counted (the same counts over T, one
            division), instead of ``top1_ids``: fmoe.routers.route_native's counts where no vector width
            of fmoe._slots.loss_width repeats these ops' orders of additions (elsewhere its native call
            makes the loss itself, equal to these ops bit for bit).
    Returns:
        scalar; 1.0 for uniform scores with a balanced top-1 assignment.
    """
    E = scores.shape[1]
    if fraction is None:
        fraction = _fraction_routed(top1_ids, E, scores.dtype)
    return E * (scores.mean(0) * fraction).sum()


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
    """Router z-loss (ST-MoE): mean_t logsumexp(logits[t])^2.

    Args:
        logits: [T, E]. Returns: scalar in logits' dtype.
    """
    return torch.logsumexp(logits, dim=1).square().mean()


# --------------------------------------------------------------------------- transformers / DeepSeek

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


def sequence_aux_loss(scores: Tensor, ids: Tensor, *, alpha: float = 1.0, k: Optional[int] = None) -> Tensor:
    """DeepSeek-V3 sequence-wise balance loss, averaged over sequences.

    Per sequence of length S with E routed experts and k selections per token:
        s'_{t,e} = s_{t,e} / Σ_e' s_{t,e'}      (normalised affinity; s = sigmoid scores)
        f_e = E / (k·S) · Σ_t 1[e ∈ topk(t)]
        P_e = (1/S) Σ_t s'_{t,e}
        L = alpha · Σ_e f_e · P_e

    Args:
        scores: [B, S, E] (or [S, E]) non-negative affinities, e.g. sigmoid(router_logits).
        ids: int [B, S, k'] (or [S, k']) selected experts; negative ids select nothing
            (e.g. expert choice's [T, E] layout with -1 where not chosen).
        alpha: balance factor α.
        k: selections per token in f's normaliser (default k' = ids.shape[-1]).
    Returns:
        scalar in scores' dtype (fp32 for fp32 scores); 1·alpha for a perfectly uniform router.
    """
    if scores.dim() == 2:
        scores, ids = scores.unsqueeze(0), ids.unsqueeze(0)
    if scores.dim() != 3 or ids.dim() != 3 or scores.shape[:2] != ids.shape[:2]:
        raise ValueError(f"scores [B, S, E] and ids [B, S, k] must agree, got {tuple(scores.shape)} and "
                         f"{tuple(ids.shape)}")
    B, S, E = scores.shape
    k = ids.shape[-1] if k is None else k
    sel = (ids.unsqueeze(-1) == torch.arange(E, device=ids.device)).any(dim=2).to(scores.dtype)  # [B, S, E]
    f = sel.sum(1) * (E / (k * S))
    P = (scores / scores.sum(-1, keepdim=True)).mean(1)
    return alpha * (f * P).sum(-1).mean()


def global_aux_loss(scores: Tensor, counts: Tensor, *, k: int, num_tokens: Optional[int] = None,
                    comm=None) -> Tensor:
    """Global-batch balance loss: expert fractions from counts over the whole global batch.

        f_e = N_e / (k · N)          N_e: selections of expert e, N: tokens they cover,
                                     both summed over ``comm``'s ranks (no gradient)
        P_e = mean_t scores[t, e]    over this call's (local micro-batch) tokens
        L   = E · Σ_e f_e · P_e

    With one rank, one micro-batch and k = 1 this is the Switch loss; it is 1 for uniform
    scores with balanced counts. Balancing the *global* fractions instead of each
    micro-batch's lets a micro-batch specialise (Qiu et al. 2025, "Demons in the detail").
    Accumulate over micro-batches by passing the summed counts and their token total.

    Args:
        scores: [T, E] routing probabilities of the local tokens (carries the gradient).
        counts: int or float [E] selections per expert (e.g. ``routing.counts``, or their
            sum over accumulated micro-batches).
        k: selections per token (after clipping to E).
        num_tokens: N covered by ``counts`` before the all-reduce (default T).
        comm: communicator whose ranks' counts and N are summed (None = this process only).
    Returns:
        scalar in scores' dtype.
    """
    if scores.dim() != 2 or counts.shape != (scores.shape[1],):
        raise ValueError(f"global_aux_loss: scores must be [T, E] and counts [E]; got {tuple(scores.shape)} and "
                         f"{tuple(counts.shape)}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"global_aux_loss: k must be an int >= 1, got {k!r}")
    E = scores.shape[1]
    n = scores.shape[0] if num_tokens is None else num_tokens
    total = torch.cat([counts.detach().to(torch.float64).reshape(-1),
                       torch.tensor([float(n)], dtype=torch.float64, device=counts.device)])
    if comm is not None and comm.size > 1:
        total = comm.all_reduce(total, op="sum")
    if not float(total[E]) > 0:
        raise ValueError("global_aux_loss: the counts cover no tokens (N = 0)")
    f = (total[:E] / (k * total[E])).to(scores.dtype)
    return E * (f * scores.mean(0)).sum()


# --------------------------------------------------------------------------- every loss for every router

LOSS_KINDS = ("gshard", "switch", "load_importance", "z", "load_balancing", "sequence_aux", "global_aux")


def router_loss(kind: str, out, routing, *, k: int, gate_noise: float = 0.0, comm=None,
                seq_len: Optional[int] = None, alpha: float = 1.0) -> Tensor:
    """Any balance loss for any router's output (unweighted scalar).

    Args:
        kind: one of ``LOSS_KINDS``:
            'gshard'/'switch': :func:`gshard_loss` on ``out.scores`` and the top-1 ids (slot 0
                of ``routing``; for expert choice the token's best-scoring expert).
            'load_importance': :func:`load_importance_loss` on ``out.logits`` (clean) and
                ``out.noisy_logits`` (the clean logits when None); needs gate_noise > 0.
            'z': :func:`z_loss` on ``out.logits`` (computed in at least fp32).
            'load_balancing': transformers' :func:`load_balancing_loss` on ``out.logits``.
            'sequence_aux': :func:`sequence_aux_loss` on ``out.scores`` with the routing's
                ids, sequences of ``seq_len`` tokens (default: all T are one sequence).
            'global_aux': :func:`global_aux_loss` with ``routing.counts`` summed over ``comm``.
        out: the :class:`fmoe.routers.RouterOutput`.
        routing: the :class:`fmoe.Routing` built from it.
        k: the router's k (``spec.k``; clipped to E here).
        gate_noise: Tutel gate-noise scale (load/importance only).
        comm: communicator (global_aux only).
        seq_len: tokens per sequence (sequence_aux only); must divide T.
        alpha: sequence_aux's α.
    Returns:
        scalar tensor.
    """
    if kind not in LOSS_KINDS:
        raise ValueError(f"unknown loss kind {kind!r}; expected one of {LOSS_KINDS}")
    T, E = out.scores.shape
    kk = min(int(k), E)
    expert_choice = out.type == "expert_choice"
    if kind in ("gshard", "switch"):
        top1 = out.scores.argmax(dim=1) if expert_choice else routing.expert_ids[0]
        return gshard_loss(out.scores, top1)
    if kind == "load_importance":
        noisy = out.logits if out.noisy_logits is None else out.noisy_logits
        return load_importance_loss(out.logits, noisy, kk, gate_noise)
    if kind == "z":
        return z_loss(out.logits.to(torch.promote_types(out.logits.dtype, torch.float32)))
    if kind == "load_balancing":
        return load_balancing_loss(out.logits, kk)
    if kind == "sequence_aux":
        S = T if seq_len is None else seq_len
        if isinstance(S, bool) or not isinstance(S, int) or S < 1 or T % S:
            raise ValueError(f"sequence_aux: seq_len={seq_len!r} must be an int >= 1 dividing T={T}")
        ids = routing.expert_ids.t()
        return sequence_aux_loss(out.scores.reshape(T // S, S, E), ids.reshape(T // S, S, ids.shape[1]),
                                 alpha=alpha, k=kk)
    return global_aux_loss(out.scores, routing.counts, k=kk, comm=comm)
