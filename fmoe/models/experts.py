"""Expert MLP variants of real checkpoints, as fmoe custom experts ``fn(params, x[E, C, H]) -> [E, C, H]``.

All are batched over experts with ``torch.bmm`` and accept :class:`fmoe.quant.QuantizedTensor`
weights (logical out x in [E, N, K]) wherever a checkpoint ships them quantized. Static
settings (activation, alpha, limit) are keyword arguments; bind them with
``functools.partial`` to get a two-argument custom expert function.

Parameter layouts (transformers' fused layouts, spec architectures.md §1.2):

* :func:`swiglu_experts` — ``{"gate_up_proj": [E, 2I, H], "down_proj": [E, H, I]}``, gate rows
  first (Qwen, DeepSeek family, Mixtral); or gate and up kept apart as ``"gate_proj"`` and
  ``"up_proj"`` [E, I, H] (quantized checkpoints whose gate and up blocks/alphas differ).
* :func:`gpt_oss_experts` — float ``{"gate_up_proj": [E, H, 2I], "down_proj": [E, I, H]}``
  (in x out), or quantized [E, 2I, H] / [E, H, I] (out x in); gate/up **interleaved**
  (even = gate, odd = up); biases ``"gate_up_proj_bias"`` [E, 2I], ``"down_proj_bias"`` [E, H].

Shared experts act on tokens [T, H] (they are not routed):

* :func:`swiglu_mlp` — ``{"gate_proj": [Is, H], "up_proj": [Is, H], "down_proj": [H, Is]}``.
* :func:`gated_shared_mlp` — Qwen2-MoE: σ(x · w_sgᵀ) · swiglu_mlp(x), ``w_sg`` [1, H].
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .common import activation, expert_mm, is_quantized, linear

__all__ = ["swiglu_experts", "gpt_oss_experts", "swiglu_mlp", "gated_shared_mlp"]


def swiglu_experts(params: dict, x: Tensor, *, act: str = "silu", rows: Optional[Tensor] = None) -> Tensor:
    """y_e = D_e (act(G_e x) * (U_e x)), no biases, in x's dtype dt.

    Args:
        params: ``{"gate_up_proj": [E, 2I, H], "down_proj": [E, H, I]}`` or
            ``{"gate_proj": [E, I, H], "up_proj": [E, I, H], "down_proj": [E, H, I]}``.
        x: [E, C, H] in dt.
        rows: optional int64 [E] filled rows per expert; rows past them are not meaningful.
    Returns:
        [E, C, H] in dt.
    """
    f = activation(act)
    if "gate_up_proj" in params:
        gate, up = expert_mm(x, params["gate_up_proj"], layout="out_in", rows=rows).chunk(2, dim=-1)
    else:
        gate = expert_mm(x, params["gate_proj"], layout="out_in", rows=rows)
        up = expert_mm(x, params["up_proj"], layout="out_in", rows=rows)
    return expert_mm(f(gate) * up, params["down_proj"], layout="out_in", rows=rows)


def gpt_oss_experts(params: dict, x: Tensor, *, alpha: float = 1.702, limit: float = 7.0,
                    rows: Optional[Tensor] = None) -> Tensor:
    """GPT-OSS clamped SwiGLU (§7), including the down bias (the combine weight scales it).

        z = x A_e + a_e;  gate = z[..., 0::2], up = z[..., 1::2]
        gate = min(gate, limit); up = clamp(up, -limit, limit)
        y = ((up + 1) * gate * σ(alpha * gate)) D_e + d_e

    Args:
        params: see the module docstring. x: [E, C, H] in dt.
        rows: optional int64 [E] filled rows per expert; rows past them are not meaningful.
    Returns:
        [E, C, H] in dt. Empty buffer rows give d_e, not 0; they are never combined.
    """
    z = expert_mm(x, params["gate_up_proj"], layout="in_out", rows=rows)
    z = z + params["gate_up_proj_bias"].to(z.dtype).unsqueeze(1)
    gate, up = z[..., 0::2], z[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    h = (up + 1) * (gate * torch.sigmoid(gate * alpha))
    y = expert_mm(h, params["down_proj"], layout="in_out", rows=rows)
    return y + params["down_proj_bias"].to(y.dtype).unsqueeze(1)


def swiglu_mlp(params: dict, x: Tensor, *, act: str = "silu") -> Tensor:
    """Dense SwiGLU on tokens (DeepSeek ``shared_experts``, Qwen2 ``shared_expert``).

    Args:
        params: ``{"gate_proj": [Is, H], "up_proj": [Is, H], "down_proj": [H, Is]}`` (float or quantized).
        x: [T, H] in dt.
    Returns:
        [T, H] in dt.
    """
    f = activation(act)
    return linear(f(linear(x, params["gate_proj"])) * linear(x, params["up_proj"]), params["down_proj"])


def gated_shared_mlp(params: dict, gate_weight: Tensor, x: Tensor, *, act: str = "silu") -> tuple[Tensor, Tensor]:
    """Qwen2-MoE / Qwen3-Next shared expert: σ(x · w_sgᵀ) * swiglu_mlp(x), all in dt.

    Args:
        params: shared SwiGLU weights. gate_weight: w_sg [1, H]. x: [T, H] in dt.
    Returns:
        (output [T, H] dt, gate [T, 1] dt).
    """
    if is_quantized(gate_weight):
        raise TypeError("shared_expert_gate weight must be a float tensor")
    g = torch.sigmoid(linear(x, gate_weight))
    return g * swiglu_mlp(params, x, act=act), g
