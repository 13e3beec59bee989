"""Mixtral adapter (8x7B, 8x22B; spec architectures.md §8): softmax router, always renormalised,
fp32 routing weights, SwiGLU experts (w1 = gate, w3 = up, w2 = down), optional training jitter.

``params``: ``{"router": {"weight": [E, H]}, "experts": {"gate_up_proj": [E, 2I, H], "down_proj": [E, H, I]}}``.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import torch
from torch import Tensor

from ..experts import ExpertSpec
from ..routers import GateSpec
from .common import BlockAux, activation, block_spec, cfg_get, check_tokens, run_block, text_config

__all__ = ["MixtralBlockConfig", "moe_block", "params_from_module", "pipeline_params"]


@dataclasses.dataclass(frozen=True)
class MixtralBlockConfig:
    """Attributes: hidden_size H, num_experts E (``num_local_experts``), top_k k, intermediate_size I
    (per expert), router_jitter_noise ε (training only), hidden_act."""

    hidden_size: int
    num_experts: int
    top_k: int
    intermediate_size: int
    router_jitter_noise: float = 0.0
    hidden_act: str = "silu"
    capacity_factor: float = 0.0
    layout: str = "auto"

    def __post_init__(self):
        for n in ("hidden_size", "num_experts", "top_k", "intermediate_size"):
            v = getattr(self, n)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"MixtralBlockConfig.{n} must be a positive int, got {v!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if not 0.0 <= self.router_jitter_noise < 1.0:
            raise ValueError(f"router_jitter_noise must be in [0, 1), got {self.router_jitter_noise}")

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "MixtralBlockConfig":
        c = text_config(cfg)
        return cls(hidden_size=int(cfg_get(c, "hidden_size")),
                   num_experts=int(cfg_get(c, "num_local_experts", "num_experts")),
                   top_k=int(cfg_get(c, "num_experts_per_tok")),
                   intermediate_size=int(cfg_get(c, "intermediate_size")),
                   router_jitter_noise=float(cfg_get(c, "router_jitter_noise", default=0.0)),
                   hidden_act=str(cfg_get(c, "hidden_act", default="silu")))


@functools.lru_cache(maxsize=64)
def moe_spec(config: MixtralBlockConfig, combine: str = "eager"):
    """The :class:`fmoe.MoESpec`: mixtral router (with jitter), swiglu experts."""
    gate = GateSpec(type="mixtral", k=config.top_k, capacity_factor=config.capacity_factor,
                    jitter_eps=config.router_jitter_noise)
    return block_spec(config.hidden_size, config.num_experts, gate,
                      ExpertSpec(type="swiglu", hidden_size=config.intermediate_size,
                                 activation=activation(config.hidden_act)),
                      normalize=True, combine=combine, layout=config.layout)


def moe_block(params: dict, x: Tensor, config: MixtralBlockConfig, *, comm=None, combine: str = "eager",
              training: bool = False, generator: Optional[torch.Generator] = None,
              int8_activations: bool = False) -> tuple[Tensor, BlockAux]:
    """Mixtral sparse block.

    Args:
        params, x, config, comm, combine: as :func:`fmoe.models.qwen3_moe.moe_block`.
        training: apply the router jitter (when ``router_jitter_noise > 0``) to the hidden
            state seen by both the router and the experts; x itself is never modified.
        generator: RNG for the jitter (None = torch's global RNG, as transformers).
    Returns:
        y with x's shape and dtype; :class:`BlockAux` (router_logits [T, E] dt).
    """
    check_tokens(x, config.hidden_size, "mixtral.moe_block")
    return run_block(pipeline_params(params, config), x, moe_spec(config, combine), comm=comm, training=training,
                     generator=generator, int8_activations=int8_activations)


def pipeline_params(params: dict, config: MixtralBlockConfig) -> dict:
    """The :func:`fmoe.moe` pytree of the block's ``params`` (the same tensors)."""
    return {"gate": {"wg": params["router"]["weight"]}, "experts": params["experts"]}

def params_from_module(block) -> dict:
    """The fmoe pytree of a transformers ``MixtralSparseMoeBlock`` (tensors shared)."""
    from .common import experts_from_module
    return {"router": {"weight": block.gate.weight}, "experts": experts_from_module(block.experts)}
