"""Swap the MoE blocks of a loaded transformers model for fmoe-backed modules.

    model = AutoModelForCausalLM.from_pretrained(...)
    fmoe.models.patch(model)          # same outputs, MoE blocks now run through fmoe

The replacement :class:`FmoeMoEBlock` adopts the original block's children (router, experts,
shared experts) as its own, so parameter names, ``state_dict()``, ``save_pretrained``,
``.to()`` and gradients are unchanged; only ``forward`` differs: it reads those parameters
into an fmoe pytree and calls ``fmoe.models.<arch>.moe_block``. The block's other public
attributes (Mixtral's ``top_k``, ``jitter_noise``; DeepSeek-V3's ``config``) stay readable.

By default the combine order follows transformers' experts back-end at every call, like the
replaced block: ``model.set_experts_implementation("batched_mm")`` after ``patch`` switches the
patched blocks to the order of that back-end (:func:`combine_for`). What stays fmoe's is the
rest of the block: its router, its expert GEMMs (the engine's kernels, not transformers' back-end
functions) and its shared experts.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..prepared import PreparedMoE, prepare
from .common import COMBINES, BlockAux, check_tokens, int8_spec, text_config
from .registry import arch_module, canonical_arch, config_from_hf


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


# transformers' experts back-ends (ALL_EXPERTS_FUNCTIONS, ALL_FP8_EXPERTS_FUNCTIONS) -> the combine
# order that reproduces each: the eager loop adds expert by expert in dt; batched_mm and
# grouped_mm weight each (token, slot) row with torch promotion, then sum the k slots of a token
# at once (``.view(T, k, H).sum(1)``), which is "grouped" exactly. The CUDA kernel back-ends
# (deepgemm, sonicmoe) also sum the k slots at once but round the routing weights to dt first:
# "grouped" is their order, to that rounding.
BACKEND_COMBINES = {
    None: "eager",                       # unset: transformers' experts run their eager forward
    "eager": "eager",
    "batched_mm": "grouped",
    "grouped_mm": "grouped",
    "deepgemm": "grouped",
    "deepgemm_megamoe": "grouped",
    "sonicmoe": "grouped",
}


def combine_for(hf_config: Any) -> str:
    """The combine order that reproduces the experts back-end ``hf_config._experts_implementation``
    names (:data:`BACKEND_COMBINES`): "eager" for "eager" or unset, "grouped" for transformers'
    batched_mm, grouped_mm and kernel back-ends.

    Raises:
        ValueError for a back-end whose accumulation order fmoe does not know (e.g. one a user
        registered in transformers' ``ALL_EXPERTS_FUNCTIONS``).
    """
    impl = getattr(hf_config, "_experts_implementation", None)
    try:
        return BACKEND_COMBINES[impl]
    except (KeyError, TypeError):
        raise ValueError(
            f"experts_implementation={impl!r}: fmoe does not know the accumulation order of this back-end "
            f"(known: {sorted(k for k in BACKEND_COMBINES if k)}); pass combine='eager' or 'grouped' to "
            "fmoe.models.patch to pin one") from None


class FmoeMoEBlock(nn.Module):
    """A transformers MoE block whose forward runs through fmoe.

    Args:
        original: the transformers block (its children are adopted, not copied; its other
            public attributes, e.g. Mixtral's ``top_k`` / ``jitter_noise`` or DeepSeek-V3's
            ``config``, are kept with the same values).
        arch: adapter name ("qwen3_moe", "deepseek_v3", ...).
        config: the block config (e.g. :class:`fmoe.models.DeepseekV3BlockConfig`).
        combine: "eager" or "grouped" pins the combine order; None (the default) follows the
            experts back-end at every call, as the replaced block does: the order
            :func:`combine_for` gives for ``experts.config._experts_implementation`` (the
            attribute transformers' ``set_experts_implementation`` sets), or for ``hf_config``'s
            where the experts module has no config.
        hf_config: the transformers config whose back-end a block without ``experts.config``
            follows.
        int8_activations: packed MXFP4 / NVFP4 experts multiply int8-rounded rows
            (:class:`fmoe.ExpertSpec`'s ``int8_activations``: inference only, an AVX-512 VNNI CPU).

    Attributes:
        generator: optional ``torch.Generator`` for Mixtral's training jitter.
    """

    def __init__(self, original: nn.Module, arch: str, config: Any, *, combine: Optional[str] = None,
                 hf_config: Any = None, int8_activations: bool = False):
        super().__init__()
        if not isinstance(int8_activations, bool):
            raise TypeError(f"int8_activations must be a bool, got {int8_activations!r}")
        if combine is not None and combine not in COMBINES:
            raise ValueError(f"combine must be one of {COMBINES} or None (follow the experts back-end), "
                             f"got {combine!r}")
        self.arch = canonical_arch(arch)
        self.block_config = config
        self.combine = combine
        self.int8_activations = int8_activations
        self.generator: Optional[torch.Generator] = None
        self.original_class = type(original).__name__
        self._hf_config = hf_config
        own = set(vars(self))
        for name, value in vars(original).items():
            # nn.Module's own state (training, hooks, _parameters, ...) is set up by __init__ above;
            # children go through add_module below.
            if name.startswith("_") or name == "training":
                continue
            if name in own:
                raise ValueError(f"patch: {self.original_class}.{name} would shadow FmoeMoEBlock.{name}; "
                                 "this transformers block is not supported by fmoe.models.patch")
            setattr(self, name, value)
        self.training = original.training
        for name, child in original.named_children():
            self.add_module(name, child)
        # Validate now (e.g. packed MXFP4 experts) rather than at the first forward.
        self._mod.params_from_module(self)

    @property
    def _mod(self):
        # Looked up, not stored: a module object attribute would break copy.deepcopy(model).
        return arch_module(self.arch)

    def current_combine(self) -> str:
        """The combine order the next forward runs: the pinned one, or the one that reproduces
        the experts back-end the model's config names now (:func:`combine_for`)."""
        if self.combine is not None:
            return self.combine
        # transformers' experts modules hold their config as an instance attribute; read from the
        # instance dict (getattr on a module without one, fmoe's packed experts, raises inside nn.Module)
        experts = self._modules.get("experts")
        cfg = None if experts is None else vars(experts).get("config")
        return combine_for(cfg if cfg is not None else self._hf_config)

    def extra_repr(self) -> str:
        how = repr(self.combine) if self.combine is not None else "follows experts_implementation"
        return (f"fmoe {self.arch} (was {self.original_class}), combine={how}"
                + (", int8_activations=True" if self.int8_activations else ""))

    def forward(self, hidden_states: torch.Tensor):
        if self.arch == "mixtral" and self.training:   # the router's jitter: a training call of fmoe.moe
            kwargs = {"int8_activations": True} if self.int8_activations else {}
            y, aux = self._mod.moe_block(self._mod.params_from_module(self), hidden_states, self.block_config,
                                         combine=self.current_combine(), training=True, generator=self.generator,
                                         **kwargs)
        else:   # moe_block's call, through the prepared call of these parameters (the same bits)
            check_tokens(hidden_states, self.block_config.hidden_size, f"{self.arch}.moe_block")
            y, maux = self._prepared()(hidden_states)
            aux = BlockAux(maux.logits, maux.routing, maux.shared_gate)
        self._emit_router_output(hidden_states, aux)
        if self.arch == "gpt_oss":
            return y, aux.routing.weights.t()   # GptOssMLP also returns the [T, k] routing weights
        return y

    def _prepared(self) -> PreparedMoE:
        """The prepared call (:func:`fmoe.prepare`) of this block's spec and current parameters: the
        one kept from the last call where it holds the same spec and parameter objects (or FP8
        weights over the same storage), else a new one. Parameters replaced, converted
        (``.to(dtype)``) or another combine order since: prepared again."""
        spec = self._mod.moe_spec(self.block_config, self.current_combine())
        if self.int8_activations:
            spec = int8_spec(spec)
        params = self._mod.pipeline_params(self._mod.params_from_module(self), self.block_config)
        kept = self.__dict__.get("_fmoe_prepared")
        if kept is None or kept.spec is not spec or not kept.holds(params):
            kept = prepare(params, spec)
            self.__dict__["_fmoe_prepared"] = kept
        return kept

    def __getstate__(self):
        # the prepared call is a cache of the parameters, not state: copies and pickles prepare their own
        state = super().__getstate__()
        state.pop("_fmoe_prepared", None)
        return state

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


def patch(model: nn.Module, *, combine: Optional[str] = None, hf_config: Any = None,
          int8_activations: bool = False) -> nn.Module:
    """Replace every supported MoE block of ``model`` in place with an :class:`FmoeMoEBlock`.

    Args:
        model: a loaded transformers model (``*ForCausalLM``, ``*Model`` or a bare block
            container) with float or FP8-blockwise experts.
        combine: "eager" / "grouped" pins that combine order; None (default) follows the
            experts back-end at every call (:meth:`FmoeMoEBlock.current_combine`), so the
            patched model reproduces the back-end it has, also after
            ``model.set_experts_implementation(...)``.
        hf_config: the transformers config; default ``model.config``.
        int8_activations: every patched block's packed MXFP4 / NVFP4 experts multiply int8-rounded
            rows (:class:`FmoeMoEBlock`; inference only).
    Returns:
        the same ``model`` object.
    Raises:
        ValueError if no supported MoE block is found, for a combine order not in ("eager",
        "grouped"), or when following a back-end whose order fmoe does not know
        (:func:`combine_for`); the model is then left unchanged.
    """
    cfg = hf_config if hf_config is not None else getattr(model, "config", None)
    if cfg is None:
        raise ValueError("patch: model has no .config; pass hf_config=")
    tc = text_config(cfg)
    if combine is None:
        combine_for(tc)   # an unknown back-end is refused now, not at the first forward
    elif combine not in COMBINES:
        raise ValueError(f"patch: combine must be one of {COMBINES} or None (follow the experts back-end), "
                         f"got {combine!r}")
    targets = [(name, m) for name, m in model.named_modules() if type(m).__name__ in BLOCK_CLASSES]
    if not targets:
        raise ValueError(f"patch: no supported MoE block in {type(model).__name__}; supported classes: "
                         f"{sorted(BLOCK_CLASSES)}")
    block_cfgs: dict[str, Any] = {}
    swaps = []
    for name, m in targets:
        if not name:
            raise ValueError("patch: the model itself is an MoE block; patch the module that contains it")
        arch = BLOCK_CLASSES[type(m).__name__]
        if arch not in block_cfgs:
            block_cfgs[arch] = config_from_hf(getattr(m, "config", None) or tc, arch)
        swaps.append((name, FmoeMoEBlock(m, arch, block_cfgs[arch], combine=combine, hf_config=tc,
                                         int8_activations=int8_activations)))
    for name, new in swaps:   # every block built (and checked) before the first swap
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new)
    return model
