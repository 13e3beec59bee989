"""Qwen3-MoE adapter (spec architectures.md §2): softmax router, optional renormalisation,
dt routing weights, fused SwiGLU experts, no shared expert.

    cfg = Qwen3MoeBlockConfig.from_hf_config(hf_config)
    y, aux = moe_block(params, x, cfg)

``params``: ``{"router": {"weight": [E, H]}, "experts": {"gate_up_proj": [E, 2I, H], "down_proj": [E, H, I]}}``
(see :mod:`fmoe.models.experts` for the split / quantized expert forms).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

from torch import Tensor

from ..experts import ExpertSpec
from ..routers import GateSpec
from .common import BlockAux, activation, block_spec, cfg_get, check_tokens, run_block, text_config

__all__ = ["Qwen3MoeBlockConfig", "moe_block", "is_moe_layer", "params_from_module", "pipeline_params"]


@dataclasses.dataclass(frozen=True)
class Qwen3MoeBlockConfig:
    """Static settings of one Qwen3-MoE sparse block.

    Attributes:
        hidden_size: H. num_experts: E. top_k: k (``num_experts_per_tok``).
        moe_intermediate_size: I. norm_topk_prob: renormalise the k weights (class default
            False; released checkpoints set True — always read it from the config).
        hidden_act: expert activation name (SiLU in every release).
    """

    hidden_size: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool = False
    hidden_act: str = "silu"
    capacity_factor: float = 0.0
    layout: str = "auto"

    def __post_init__(self):
        for n in ("hidden_size", "num_experts", "top_k", "moe_intermediate_size"):
            v = getattr(self, n)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{type(self).__name__}.{n} must be a positive int, got {v!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "Qwen3MoeBlockConfig":
        """From a transformers ``Qwen3MoeConfig`` or its config.json dict."""
        c = text_config(cfg)
        return cls(hidden_size=int(cfg_get(c, "hidden_size")),
                   num_experts=int(cfg_get(c, "num_experts", "num_local_experts")),
                   top_k=int(cfg_get(c, "num_experts_per_tok")),
                   moe_intermediate_size=int(cfg_get(c, "moe_intermediate_size")),
                   norm_topk_prob=bool(cfg_get(c, "norm_topk_prob", default=False)),
                   hidden_act=str(cfg_get(c, "hidden_act", default="silu")))


def is_moe_layer(cfg: Any, layer: int) -> bool:
    """Layer ℓ is sparse iff ℓ ∉ mlp_only_layers, E > 0 and (ℓ + 1) % decoder_sparse_step == 0."""
    c = text_config(cfg)
    step = int(cfg_get(c, "decoder_sparse_step", default=1))
    return (layer not in cfg_get(c, "mlp_only_layers", default=[])
            and int(cfg_get(c, "num_experts", "num_local_experts", default=0)) > 0
            and (layer + 1) % step == 0)


@functools.lru_cache(maxsize=64)
def moe_spec(config: Qwen3MoeBlockConfig, combine: str = "eager"):
    """The :class:`fmoe.MoESpec` of this block: qwen router, swiglu experts, no shared expert."""
    return block_spec(config.hidden_size, config.num_experts,
                      GateSpec(type="qwen", k=config.top_k, capacity_factor=config.capacity_factor),
                      ExpertSpec(type="swiglu", hidden_size=config.moe_intermediate_size,
                                 activation=activation(config.hidden_act)),
                      normalize=config.norm_topk_prob, combine=combine, layout=config.layout)


def moe_block(params: dict, x: Tensor, config: Qwen3MoeBlockConfig, *, comm=None, combine: str = "eager",
              int8_activations: bool = False) -> tuple[Tensor, BlockAux]:
    """Qwen3-MoE sparse block forward (no residual; input already normalised).

    Args:
        params: see the module docstring. x: [..., H] in dt.
        config: static settings. comm: expert-parallel communicator (None = local).
        combine: "eager" (transformers' eager loop's order) or "grouped" (one fp32 reduction
            over k: grouped_mm/batched_mm's); what equals transformers bit for bit and what
            agrees within a bound is said in :mod:`fmoe.models.common`.
        int8_activations: packed MXFP4 / NVFP4 experts at inference multiply int8-rounded rows
            (:class:`fmoe.ExpertSpec`'s ``int8_activations``; every architecture block takes it).
    Returns:
        y with x's shape and dtype; :class:`BlockAux` (router_logits [T, E] dt, routing).
    """
    check_tokens(x, config.hidden_size, "qwen3_moe.moe_block")
    return run_block(pipeline_params(params, config), x, moe_spec(config, combine), comm=comm,
                     int8_activations=int8_activations)


def pipeline_params(params: dict, config: Qwen3MoeBlockConfig) -> dict:
    """The :func:`fmoe.moe` pytree of the block's ``params`` (the same tensors)."""
    return {"gate": {"wg": params["router"]["weight"]}, "experts": params["experts"]}

def params_from_module(block) -> dict:
    """The fmoe pytree of a transformers ``Qwen3MoeSparseMoeBlock`` (tensors shared, not copied)."""
    from .common import experts_from_module
    return {"router": {"weight": block.gate.weight}, "experts": experts_from_module(block.experts)}
