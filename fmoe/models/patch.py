"""Swap the MoE blocks of a loaded transformers model for fmoe-backed modules.

    model = AutoModelForCausalLM.from_pretrained(...)
    fmoe.models.patch(model)          # same outputs, MoE blocks now run through fmoe

The replacement :class:`FmoeMoEBlock` adopts the original block's children (router, experts,
shared experts) as its own, so parameter names, ``state_dict()``, ``save_pretrained``,
``.to()`` and gradients are unchanged; only ``forward`` differs: it reads those parameters
into an fmoe pytree and calls ``fmoe.models.<arch>.moe_block``.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from .common import text_config
from .registry import arch_module, canonical_arch, config_from_hf

__all__ = ["FmoeMoEBlock", "patch", "BLOCK_CLASSES"]

# transformers 5.24 MoE block class name -> adapter (spec architectures.md §0).
BLOCK_CLASSES = {
    "Qwen3MoeSparseMoeBlock": "qwen3_moe",
    "Qwen2MoeSparseMoeBlock": "qwen2_moe",
    "DeepseekV3MoE": "deepseek_v3",
    "DeepseekV32MoE": "deepseek_v3",
    "Glm4MoeMoE": "deepseek_v3",
    "Glm4MoeLiteMoE": "deepseek_v3",
    "GlmMoeDsaMoE": "deepseek_v3",
    "GptOssMLP": "gpt_oss",
    "MixtralSparseMoeBlock": "mixtral",
}

_ROUTER_ATTR = {"gpt_oss": "router"}


def combine_for(hf_config: Any) -> str:
    """The combine order that reproduces the model's experts back-end: "eager" for
    ``_experts_implementation == "eager"`` (or unset), "grouped" otherwise (grouped_mm,
    batched_mm and kernel back-ends all reduce over the k slots once)."""
    impl = getattr(hf_config, "_experts_implementation", None)
    return "eager" if impl in (None, "eager") else "grouped"


class FmoeMoEBlock(nn.Module):
    """A transformers MoE block whose forward runs through fmoe.

    Args:
        original: the transformers block (its children are adopted, not copied).
        arch: adapter name ("qwen3_moe", "deepseek_v3", ...).
        config: the block config (e.g. :class:`fmoe.models.DeepseekV3BlockConfig`).
        combine: "eager" or "grouped".

    Attributes:
        generator: optional ``torch.Generator`` for Mixtral's training jitter.
    """

    def __init__(self, original: nn.Module, arch: str, config: Any, *, combine: str = "eager"):
        super().__init__()
        self.arch = canonical_arch(arch)
        self.block_config = config
        self.combine = combine
        self.generator: Optional[torch.Generator] = None
        self.original_class = type(original).__name__
        for name, child in original.named_children():
            self.add_module(name, child)
        # Validate now (e.g. packed MXFP4 experts) rather than at the first forward.
        self._mod.params_from_module(self)

    @property
    def _mod(self):
        # Looked up, not stored: a module object attribute would break copy.deepcopy(model).
        return arch_module(self.arch)

    def extra_repr(self) -> str:
        return f"fmoe {self.arch} (was {self.original_class}), combine={self.combine!r}"

    def forward(self, hidden_states: torch.Tensor):
        params = self._mod.params_from_module(self)
        kwargs = {}
        if self.arch == "mixtral":
            kwargs = {"training": self.training, "generator": self.generator}
        y, aux = self._mod.moe_block(params, hidden_states, self.block_config, combine=self.combine, **kwargs)
        self._emit_router_output(hidden_states, aux)
        if self.arch == "gpt_oss":
            return y, aux.topk()[1]          # GptOssMLP also returns the [T, k] routing weights
        return y

    def _emit_router_output(self, hidden_states, aux) -> None:
        # transformers records router logits (output_router_logits / aux loss) with forward
        # hooks on the router module; fmoe computed the router output itself, so hand the
        # same (logits, weights, ids) triple to those hooks.
        router = getattr(self, _ROUTER_ATTR.get(self.arch, "gate"), None)
        hooks = getattr(router, "_forward_hooks", None)
        if not hooks:
            return
        ids, w = aux.topk()
        out = (aux.router_logits, w, ids)
        for hook in list(hooks.values()):
            hook(router, (hidden_states.reshape(-1, hidden_states.shape[-1]),), out)


def patch(model: nn.Module, *, combine: Optional[str] = None, hf_config: Any = None) -> nn.Module:
    """Replace every supported MoE block of ``model`` in place with an :class:`FmoeMoEBlock`.

    Args:
        model: a loaded transformers model (``*ForCausalLM``, ``*Model`` or a bare block
            container) with float or FP8-blockwise experts.
        combine: "eager" / "grouped"; default follows ``config._experts_implementation``
            (:func:`combine_for`), so the patched model reproduces the back-end it had.
        hf_config: the transformers config; default ``model.config``.
    Returns:
        the same ``model`` object.
    Raises:
        ValueError if no supported MoE block is found.
    """
    cfg = hf_config if hf_config is not None else getattr(model, "config", None)
    if cfg is None:
        raise ValueError("patch: model has no .config; pass hf_config=")
    tc = text_config(cfg)
    mode = combine if combine is not None else combine_for(cfg)
    targets = [(name, m) for name, m in model.named_modules() if type(m).__name__ in BLOCK_CLASSES]
    if not targets:
        raise ValueError(f"patch: no supported MoE block in {type(model).__name__}; supported classes: "
                         f"{sorted(BLOCK_CLASSES)}")
    block_cfgs: dict[str, Any] = {}
    for name, m in targets:
        if not name:
            raise ValueError("patch: the model itself is an MoE block; patch the module that contains it")
        arch = BLOCK_CLASSES[type(m).__name__]
        if arch not in block_cfgs:
            block_cfgs[arch] = config_from_hf(getattr(m, "config", None) or tc, arch)
        new = FmoeMoEBlock(m, arch, block_cfgs[arch], combine=mode)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new)
    return model
