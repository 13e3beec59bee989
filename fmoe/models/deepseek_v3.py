"""DeepSeek-V3 family adapter (spec architectures.md §4-§6): DeepSeek-V3 / R1 / V3.1 / V3.2,
Kimi-K2 (``model_type "kimi_k2"`` is DeepSeek-V3), GLM-4.5/4.6/4.7, GLM-4.7-Flash and GLM-5.

Matches the transformers 5.24 formulation (fp32 router, -inf group fill, +1e-20 renorm, fp32
weights, shared SwiGLU added in dt after the routed sum) — not upstream V3's bf16 router nor
V3.2's fp32 accumulation of the shared expert (§4 table).

``params``: ``{"router": {"weight": [E, H] (fp32), "e_score_correction_bias": [E] fp32},
"experts": {...swiglu...}, "shared": {"gate_proj", "up_proj", "down_proj"}}`` ("shared" is
absent when ``n_shared_experts == 0``).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

from torch import Tensor

from ..experts import ExpertSpec
from ..routers import GateSpec
from .common import BlockAux, activation, block_spec, cfg_get, check_tokens, run_block, text_config

__all__ = ["DeepseekV3BlockConfig", "moe_block", "is_moe_layer", "params_from_module", "pipeline_params"]


@dataclasses.dataclass(frozen=True)
class DeepseekV3BlockConfig:
    """Static settings of one DeepSeek-family MoE block.

    Attributes:
        hidden_size: H. num_experts: E (``n_routed_experts``). top_k: k. moe_intermediate_size: I.
        n_group, topk_group: group-limited selection (1/1 = none: Kimi-K2, GLM).
        norm_topk_prob: renormalise (+1e-20). routed_scaling_factor: rsf (always applied; read
            it from the checkpoint — Glm4MoeConfig's class default 1.0 differs from GLM-4.5's 2.5).
        n_shared_experts: shared SwiGLU of size I * n_shared_experts (0 = none).
        hidden_act: activation.
    """

    hidden_size: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 1
    hidden_act: str = "silu"
    capacity_factor: float = 0.0
    layout: str = "auto"

    def __post_init__(self):
        for n in ("hidden_size", "num_experts", "top_k", "moe_intermediate_size", "n_group", "topk_group"):
            v = getattr(self, n)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"DeepseekV3BlockConfig.{n} must be a positive int, got {v!r}")
        if self.num_experts % self.n_group or self.num_experts // self.n_group < 2:
            raise ValueError(f"n_group={self.n_group} must split E={self.num_experts} into groups of >= 2")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group={self.topk_group} > n_group={self.n_group}")
        if self.top_k > self.num_experts // self.n_group * self.topk_group:
            raise ValueError(f"top_k={self.top_k} exceeds the experts of the kept groups")
        if self.n_shared_experts < 0:
            raise ValueError("n_shared_experts must be >= 0")

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "DeepseekV3BlockConfig":
        """From DeepseekV3/V32, Glm4Moe(Lite), GlmMoeDsa configs, Kimi-K2(.5) configs or config.json dicts.

        ``scoring_func``, ``topk_method``, ``seq_aux``, ``ep_size`` are ignored as in transformers;
        a non-sigmoid ``scoring_func`` is refused rather than silently mis-modelled.
        """
        c = text_config(cfg)
        scoring = cfg_get(c, "scoring_func", default="sigmoid")
        if scoring != "sigmoid":
            raise NotImplementedError(f"scoring_func={scoring!r}: only the sigmoid/noaux_tc router is implemented")
        return cls(hidden_size=int(cfg_get(c, "hidden_size")),
                   num_experts=int(cfg_get(c, "n_routed_experts", "num_local_experts")),
                   top_k=int(cfg_get(c, "num_experts_per_tok")),
                   moe_intermediate_size=int(cfg_get(c, "moe_intermediate_size")),
                   n_group=int(cfg_get(c, "n_group", default=1)),
                   topk_group=int(cfg_get(c, "topk_group", default=1)),
                   norm_topk_prob=bool(cfg_get(c, "norm_topk_prob", default=True)),
                   routed_scaling_factor=float(cfg_get(c, "routed_scaling_factor", default=1.0)),
                   n_shared_experts=int(cfg_get(c, "n_shared_experts", default=0)),
                   hidden_act=str(cfg_get(c, "hidden_act", default="silu")))


def is_moe_layer(cfg: Any, layer: int) -> bool:
    """``mlp_layer_types[layer] == "sparse"`` when the config has it (V3.2, GLM-5, GLM-4.7-Flash),
    else ``layer >= first_k_dense_replace``. Layers at or past num_hidden_layers (MTP) are not."""
    c = text_config(cfg)
    n = cfg_get(c, "num_hidden_layers", default=None)
    if n is not None and layer >= int(n):
        return False
    types = cfg_get(c, "mlp_layer_types", default=None)
    if types is not None:
        return types[layer] == "sparse"
    return layer >= int(cfg_get(c, "first_k_dense_replace", default=0))


@functools.lru_cache(maxsize=64)
def moe_spec(config: DeepseekV3BlockConfig, combine: str = "eager"):
    """The :class:`fmoe.MoESpec`: deepseek router, swiglu experts, shared SwiGLU (if any)."""
    gate = GateSpec(type="deepseek", k=config.top_k, capacity_factor=config.capacity_factor,
                    n_group=config.n_group, topk_group=config.topk_group,
                    routed_scaling_factor=config.routed_scaling_factor)
    return block_spec(config.hidden_size, config.num_experts, gate,
                      ExpertSpec(type="swiglu", hidden_size=config.moe_intermediate_size,
                                 activation=activation(config.hidden_act)),
                      normalize=config.norm_topk_prob, combine=combine, layout=config.layout,
                      shared="swiglu" if config.n_shared_experts > 0 else None)


def moe_block(params: dict, x: Tensor, config: DeepseekV3BlockConfig, *, comm=None, combine: str = "eager",
              int8_activations: bool = False) -> tuple[Tensor, BlockAux]:
    """DeepSeek-family block: y = experts(x, idx, w) + shared_experts(x).

    Args:
        params: see the module docstring. x: [..., H] in dt.
        config: static settings. comm: expert-parallel communicator. combine: "eager" | "grouped".
    Returns:
        y with x's shape and dtype (routed products are dt x fp32 -> fp32, rounded to dt);
        :class:`BlockAux` with fp32 router_logits [T, E].
    """
    check_tokens(x, config.hidden_size, "deepseek_v3.moe_block")
    return run_block(pipeline_params(params, config), x, moe_spec(config, combine), comm=comm,
                     int8_activations=int8_activations)


def pipeline_params(params: dict, config: DeepseekV3BlockConfig) -> dict:
    """The :func:`fmoe.moe` pytree of the block's ``params`` (the same tensors)."""
    r = params["router"]
    p = {"gate": {"wg": r["weight"], "correction_bias": r.get("e_score_correction_bias")},
         "experts": params["experts"]}
    if config.n_shared_experts > 0:
        p["shared"] = params["shared"]
    return p

def params_from_module(block) -> dict:
    """The fmoe pytree of a transformers ``DeepseekV3MoE`` / ``DeepseekV32MoE`` / ``Glm4MoeMoE`` /
    ``Glm4MoeLiteMoE`` / ``GlmMoeDsaMoE`` (tensors shared)."""
    from .common import experts_from_module, mlp_from_module
    p = {"router": {"weight": block.gate.weight, "e_score_correction_bias": block.gate.e_score_correction_bias},
         "experts": experts_from_module(block.experts)}
    if getattr(block, "shared_experts", None) is not None:
        p["shared"] = mlp_from_module(block.shared_experts)
    return p
