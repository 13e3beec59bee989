"""Architecture adapters: run the MoE block of real checkpoints through fmoe with the same numbers.

    from fmoe.models import deepseek_v3, load_moe_block, patch
    params, cfg = load_moe_block("/ckpt/DeepSeek-V3", "deepseek_v3", layer=3)
    y, aux = deepseek_v3.moe_block(params, x, cfg)

Architectures (``ARCHS``): qwen3_moe, qwen2_moe, deepseek_v3 (also deepseek_v32, kimi_k2,
glm4_moe, glm4_moe_lite, glm_moe_dsa), gpt_oss, mixtral. The math is spec/architectures.md;
combine orders are explained in :mod:`fmoe.models.common`.
"""
from . import common, deepseek_v3, gpt_oss, mixtral, qwen2_moe, qwen3_moe
from .common import BlockAux
from .deepseek_v3 import DeepseekV3BlockConfig
from .gpt_oss import GptOssBlockConfig
from .mixtral import MixtralBlockConfig
from .qwen2_moe import Qwen2MoeBlockConfig
from .qwen3_moe import Qwen3MoeBlockConfig
from .registry import ARCHS, ALIASES, arch_module, canonical_arch, config_from_hf, moe_block
from .loader import load_moe_block
from .patch import FmoeMoEBlock, patch

__all__ = [
    "ARCHS", "arch_module", "config_from_hf", "moe_block",
    "load_moe_block", "patch", "FmoeMoEBlock", "BlockAux",
    "Qwen3MoeBlockConfig", "Qwen2MoeBlockConfig", "DeepseekV3BlockConfig", "GptOssBlockConfig",
    "MixtralBlockConfig",
    "qwen3_moe", "qwen2_moe", "deepseek_v3", "gpt_oss", "mixtral",
]
