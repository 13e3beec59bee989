"""GPT-OSS adapter (gpt-oss-20b / -120b; spec architectures.md §7): biased router, top-k on
logits with softmax over the k in dt, clamped SwiGLU experts with interleaved gate/up and
biases (the routing weight also scales the down bias), no shared expert.

``params``: ``{"router": {"weight": [E, H], "bias": [E]}, "experts": {"gate_up_proj",
"gate_up_proj_bias", "down_proj", "down_proj_bias"}}`` (float [E, H, 2I] / [E, I, H], or
MXFP4 QuantizedTensors [E, 2I, H] / [E, H, I]).

The block is the transformers ``GptOssMLP`` (no norm, no residual); upstream gpt-oss's
``MLPBlock`` also holds the RMSNorm and residual.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

from torch import Tensor

from ..experts import ExpertSpec
from ..routers import GateSpec
from .common import BlockAux, block_spec, cfg_get, check_tokens, run_block, text_config

__all__ = ["GptOssBlockConfig", "moe_block", "params_from_module", "pipeline_params"]


@dataclasses.dataclass(frozen=True)
class GptOssBlockConfig:
    """Attributes: hidden_size H, num_experts E, top_k k, intermediate_size I,
    swiglu_alpha α (1.702), swiglu_limit L (7.0)."""

    hidden_size: int
    num_experts: int
    top_k: int
    intermediate_size: int
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    capacity_factor: float = 0.0
    layout: str = "auto"

    def __post_init__(self):
        for n in ("hidden_size", "num_experts", "top_k", "intermediate_size"):
            v = getattr(self, n)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"GptOssBlockConfig.{n} must be a positive int, got {v!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "GptOssBlockConfig":
        c = text_config(cfg)
        return cls(hidden_size=int(cfg_get(c, "hidden_size")),
                   num_experts=int(cfg_get(c, "num_local_experts", "num_experts")),
                   top_k=int(cfg_get(c, "num_experts_per_tok", "experts_per_token")),
                   intermediate_size=int(cfg_get(c, "intermediate_size")),
                   swiglu_alpha=float(cfg_get(c, "swiglu_alpha", default=1.702)),
                   swiglu_limit=float(cfg_get(c, "swiglu_limit", default=7.0)))


@functools.lru_cache(maxsize=64)
def moe_spec(config: GptOssBlockConfig, combine: str = "eager"):
    """The :class:`fmoe.MoESpec`: gpt_oss router, clamped-SwiGLU experts with biases."""
    return block_spec(config.hidden_size, config.num_experts,
                      GateSpec(type="gpt_oss", k=config.top_k, capacity_factor=config.capacity_factor),
                      ExpertSpec(type="gpt_oss", hidden_size=config.intermediate_size, alpha=config.swiglu_alpha,
                                 limit=config.swiglu_limit),
                      normalize=True, combine=combine, layout=config.layout)


def moe_block(params: dict, x: Tensor, config: GptOssBlockConfig, *, comm=None, combine: str = "eager",
              int8_activations: bool = False) -> tuple[Tensor, BlockAux]:
    """GPT-OSS MoE block. Args/returns as :func:`fmoe.models.qwen3_moe.moe_block`; the routing
    weights are dt. transformers' ``GptOssMLP`` also returns the [T, k] weights: they are
    ``aux.topk()[1]``."""
    check_tokens(x, config.hidden_size, "gpt_oss.moe_block")
    return run_block(pipeline_params(params, config), x, moe_spec(config, combine), comm=comm,
                     int8_activations=int8_activations)


def pipeline_params(params: dict, config: GptOssBlockConfig) -> dict:
    """The :func:`fmoe.moe` pytree of the block's ``params`` (the same tensors)."""
    r = params["router"]
    return {"gate": {"wg": r["weight"], "bias": r.get("bias")}, "experts": params["experts"]}

def params_from_module(block) -> dict:
    """The fmoe pytree of a transformers ``GptOssMLP`` with float experts (tensors shared)."""
    from .common import experts_from_module
    return {"router": {"weight": block.router.weight, "bias": block.router.bias},
            "experts": experts_from_module(block.experts)}
