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

from ..experts import ExpertSpec
from ..routers import GateSpec
from .common import BlockAux, activation, block_spec, cfg_get, check_tokens, run_block, text_config
from .qwen3_moe import Qwen3MoeBlockConfig, is_moe_layer

__all__ = ["Qwen2MoeBlockConfig", "moe_block", "is_moe_layer", "params_from_module", "pipeline_params"]


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


@functools.lru_cache(maxsize=64)
def moe_spec(config: Qwen2MoeBlockConfig, combine: str = "eager"):
    """The :class:`fmoe.MoESpec`: qwen router, swiglu experts, sigmoid-gated shared SwiGLU."""
    return block_spec(config.hidden_size, config.num_experts,
                      GateSpec(type="qwen", k=config.top_k, capacity_factor=config.capacity_factor),
                      ExpertSpec(type="swiglu", hidden_size=config.moe_intermediate_size,
                                 activation=activation(config.hidden_act)),
                      normalize=config.norm_topk_prob, combine=combine, layout=config.layout, shared="gated_swiglu")


def moe_block(params: dict, x: Tensor, config: Qwen2MoeBlockConfig, *, comm=None, combine: str = "eager",
              int8_activations: bool = False) -> tuple[Tensor, BlockAux]:
    """Qwen2-MoE block: y = routed(x) + σ(x · w_sgᵀ) · shared(x), every term and the sum in dt.

    Args and returns as :func:`fmoe.models.qwen3_moe.moe_block`; ``aux.shared_gate`` is [T, 1].
    """
    check_tokens(x, config.hidden_size, "qwen2_moe.moe_block")
    return run_block(pipeline_params(params, config), x, moe_spec(config, combine), comm=comm,
                     int8_activations=int8_activations)


def pipeline_params(params: dict, config: Qwen2MoeBlockConfig) -> dict:
    """The :func:`fmoe.moe` pytree of the block's ``params`` (the same tensors)."""
    return {"gate": {"wg": params["router"]["weight"]}, "experts": params["experts"], "shared": params["shared"],
            "shared_gate": params["shared_gate"]}

def params_from_module(block) -> dict:
    """The fmoe pytree of a transformers ``Qwen2MoeSparseMoeBlock`` (tensors shared)."""
    from .common import experts_from_module, mlp_from_module
    return {"router": {"weight": block.gate.weight}, "experts": experts_from_module(block.experts),
            "shared": mlp_from_module(block.shared_expert),
            "shared_gate": {"weight": block.shared_expert_gate.weight}}
