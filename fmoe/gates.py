"""Gate functions: token features -> routing logits, plus noise and score functions.

Pure functions over parameter dicts. ``fp32=True`` computes in float32 by
casting copies of the inputs; parameters are never mutated (spec §16.12).

Parameter pytrees:
    linear: ``{"wg": [E, M]}``
    cosine: ``{"proj_w": [Pd, M], "proj_b": [Pd], "sim_matrix": [Pd, E], "temperature": [1]}``
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "linear_gate",
    "cosine_gate",
    "gate_logits",
    "add_gate_noise",
    "scores_from_logits",
    "init_linear_gate",
    "init_cosine_gate",
    "SCORE_FNS",
]

SCORE_FNS = ("softmax", "sigmoid")
_MAX_LOG_INV_TEMPERATURE = math.log(100.0)


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
    if fp32:
        return x.float() @ wg.float().t()
    return x @ wg.to(x.dtype).t()


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
