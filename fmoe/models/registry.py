"""Architecture names -> adapter modules and block configs."""
from __future__ import annotations

from types import ModuleType
from typing import Any

from . import deepseek_v3, gpt_oss, mixtral, qwen2_moe, qwen3_moe
from .common import cfg_get, text_config


ARCHS: dict[str, ModuleType] = {
    "qwen3_moe": qwen3_moe,
    "qwen2_moe": qwen2_moe,
    "deepseek_v3": deepseek_v3,
    "gpt_oss": gpt_oss,
    "mixtral": mixtral,
}

# model_type values whose MoE block is one of the above (spec §0): the DeepSeek-family classes
# are bit-identical; kimi_k2 is not a registered transformers type but its checkpoints say so.
ALIASES: dict[str, str] = {
    "deepseek_v32": "deepseek_v3",
    "kimi_k2": "deepseek_v3",
    "kimi_k25": "deepseek_v3",
    "glm4_moe": "deepseek_v3",
    "glm4_moe_lite": "deepseek_v3",
    "glm_moe_dsa": "deepseek_v3",
}

_CONFIGS = {
    "qwen3_moe": qwen3_moe.Qwen3MoeBlockConfig,
    "qwen2_moe": qwen2_moe.Qwen2MoeBlockConfig,
    "deepseek_v3": deepseek_v3.DeepseekV3BlockConfig,
    "gpt_oss": gpt_oss.GptOssBlockConfig,
    "mixtral": mixtral.MixtralBlockConfig,
}


def canonical_arch(arch: str) -> str:
    """'glm4_moe' -> 'deepseek_v3', 'qwen3_moe' -> 'qwen3_moe'; ValueError for unknown names."""
    a = ALIASES.get(arch, arch)
    if a not in ARCHS:
        raise ValueError(f"unknown MoE architecture {arch!r}; known: {sorted(ARCHS) + sorted(ALIASES)}")
    return a


def arch_module(arch: str) -> ModuleType:
    """The adapter module (with ``moe_block``, ``*BlockConfig``) for ``arch`` or one of its aliases."""
    return ARCHS[canonical_arch(arch)]


def config_from_hf(cfg: Any, arch: str | None = None):
    """Block config from a transformers config or a config.json dict; arch defaults to its model_type."""
    if arch is None:
        arch = cfg_get(text_config(cfg), "model_type")
    return _CONFIGS[canonical_arch(arch)].from_hf_config(cfg)


def moe_block(arch: str, params: dict, x, config, **kwargs):
    """Dispatch to ``fmoe.models.<arch>.moe_block(params, x, config, **kwargs)``."""
    return arch_module(arch).moe_block(params, x, config, **kwargs)
