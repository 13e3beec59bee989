"""Qwen2-MoE adapter (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B; spec architectures.md §3): the Qwen3
router and experts plus an always-on shared SwiGLU expert scaled by σ(x · w_sgᵀ).

``params``: the Qwen3 pytree plus ``"shared": {"gate_proj": [Is, H], "up_proj": [Is, H],
"down_proj": [H, Is]}`` and ``"shared_gate": {"weight": [1, H]}``.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

from torch import Tensor

from .common import BlockAux, cfg_get, check_tokens, routed_experts, text_config, to_routing
from .experts import gated_shared_mlp, swiglu_experts
from .qwen3_moe import Qwen3MoeBlockConfig, is_moe_layer
from ..routers import qwen_topk

__all__ = ["Qwen2MoeBlockConfig", "moe_block", "is_moe_layer", "params_from_module"]


@dataclasses.dataclass(frozen=True)
class Qwen2MoeBlockConfig(Qwen3MoeBlockConfig):
    """Qwen3 settings plus ``shared_expert_intermediate_size`` (Is). Released checkpoints use
    ``norm_topk_prob = False`` (weights are raw softmax probabilities)."""

    shared_expert_intermediate_size: int = 0

    def __post_init__(self):
        super().__post_init__()
        if self.shared_expert_intermediate_size < 1:
            raise ValueError("Qwen2MoeBlockConfig.shared_expert_intermediate_size must be >= 1")

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "Qwen2MoeBlockConfig":
        base = Qwen3MoeBlockConfig.from_hf_config(cfg)
        c = text_config(cfg)
        return cls(**dataclasses.asdict(base),
                   shared_expert_intermediate_size=int(cfg_get(c, "shared_expert_intermediate_size")))


def moe_block(params: dict, x: Tensor, config: Qwen2MoeBlockConfig, *, comm=None, combine: str = "eager"
              ) -> tuple[Tensor, BlockAux]:
    """Qwen2-MoE block: y = routed(x) + σ(x · w_sgᵀ) · shared(x), every term and the sum in dt.

    Args and returns as :func:`fmoe.models.qwen3_moe.moe_block`; ``aux.shared_gate`` is [T, 1].
    """
    check_tokens(x, config.hidden_size, "qwen2_moe.moe_block")
    t = x.reshape(-1, config.hidden_size)
    logits, w, ids = qwen_topk(t, params["router"]["weight"], config.top_k, norm_topk_prob=config.norm_topk_prob)
    routing = to_routing(ids, w, config.num_experts, comm=comm)
    fn = functools.partial(swiglu_experts, act=config.hidden_act)
    routed = routed_experts(params["experts"], t, routing, fn, combine=combine, comm=comm)
    shared, gate = gated_shared_mlp(params["shared"], params["shared_gate"]["weight"], t, act=config.hidden_act)
    return (routed + shared).reshape(x.shape), BlockAux(logits, routing, gate)


def params_from_module(block) -> dict:
    """The fmoe pytree of a transformers ``Qwen2MoeSparseMoeBlock`` (tensors shared)."""
    from .common import experts_from_module, mlp_from_module
    return {"router": {"weight": block.gate.weight}, "experts": experts_from_module(block.experts),
            "shared": mlp_from_module(block.shared_expert),
            "shared_gate": {"weight": block.shared_expert_gate.weight}}
