"""What the architecture adapters share: config access, activations, the block runner, and
the transformers-module -> pytree converters.

Each architecture block is a configuration of the one pipeline, :func:`fmoe.moe`: a router
(:mod:`fmoe.routers`), an expert type (:mod:`fmoe.experts`), optional shared experts and a
combine order; :func:`block_spec` builds that :class:`fmoe.MoESpec` and :func:`run_block`
runs it.

Combine orders (spec architectures.md §1.3, §11; :mod:`fmoe.ops.orders`):

* ``"eager"`` is the accumulation of transformers' eager expert loop: each (token, slot)
  product ``y * w`` is formed with torch type promotion (dt x dt -> dt for Qwen/GPT-OSS,
  dt x fp32 -> fp32 for DeepSeek/Mixtral), cast to dt, and added to the token's output in
  dt, experts in ascending id order.
* ``"grouped"`` is fmoe's :func:`fmoe.combine`: one fp32 reduction over the k slots and one
  final cast. This is the order of transformers' grouped_mm / batched_mm back-ends (the
  default for a ``PreTrainedModel``), Tutel's decode and upstream DeepSeek-V3.2; it agrees
  with them to rounding (1-2 dt ulp) and is the path that composes with ``torch.func``
  through fmoe's custom ops.

What equals transformers bit for bit. The router and the combine order are transformers'
arithmetic; the expert GEMMs are the engine's (:mod:`fmoe.engine`). With ``"eager"`` on the
CPU, when a gradient will be taken (engine phase 'train') or more than 16 rows per busy expert
('prefill'), every expert GEMM is one ``at::mm`` per busy expert on the intra-op threads, on
the same rows in the same order (by expert, then slot) as the ``F.linear`` of transformers'
eager loop: the block and a patched model's logits are equal bit for bit in every dtype, on any
host. In the decode phase (no gradient, at most 16 rows per busy expert) the experts may run
side by side, each ``at::mm`` single-threaded (or a kernel this host measured faster), and BLAS may
split the K reduction otherwise than the threaded call (MKL does on its AVX2 paths, i.e. on
AMD hosts): there, and against transformers' batched_mm / grouped_mm back-ends (other GEMM
calls) in either order, a block agrees within about 1e-6 of max|y| in fp32 and 2 ulp in bf16
(measured on the tests' tiny configs: fp32 0 to 4.8e-7, bf16 0). On CUDA the bf16 expert GEMMs
are ``torch._grouped_mm``, so the bound applies there too.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils import _pytree as pytree

from ..experts import ExpertSpec
from ..moe import MoESpec, moe
from ..routers import GateSpec
from ..routing import Routing


COMBINES = ("eager", "grouped")

# Only elementwise activations that real MoE checkpoints use; names as in HF configs.
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda z: F.gelu(z, approximate="tanh"),
    "relu": F.relu,
}

_MISSING = object()


def activation(name: str) -> Callable[[Tensor], Tensor]:
    """The elementwise activation called ``name`` in HF configs (``hidden_act``)."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported hidden_act {name!r}; supported: {sorted(ACTIVATIONS)}") from None


def cfg_get(cfg: Any, *names: str, default: Any = _MISSING) -> Any:
    """First of ``names`` present on a transformers config object or a plain dict (config.json)."""
    for n in names:
        if isinstance(cfg, dict):
            if n in cfg and cfg[n] is not None:
                return cfg[n]
        else:
            v = getattr(cfg, n, None)
            if v is not None:
                return v
    if default is _MISSING:
        raise KeyError(f"config has none of the keys {names}")
    return default


def text_config(cfg: Any) -> Any:
    """The text part of a (possibly multimodal) config, e.g. Kimi-K2.5's ``text_config``."""
    sub = cfg.get("text_config") if isinstance(cfg, dict) else getattr(cfg, "text_config", None)
    return sub if sub is not None else cfg


@dataclasses.dataclass(frozen=True, eq=False)
class BlockAux:
    """Auxiliary outputs of an adapter's ``moe_block`` (a pytree).

    Attributes:
        router_logits: [T, E] exactly as the architecture's router computes them (dt for
            Qwen/GPT-OSS/Mixtral, fp32 for the DeepSeek family); feed to the balance losses.
        routing: the dropless :class:`fmoe.Routing` (ids/weights [k, T], counts [E]).
        shared_gate: Qwen2-MoE's sigmoid shared-expert gate [T, 1] in dt, else None.
    """

    router_logits: Tensor
    routing: Routing
    shared_gate: Optional[Tensor] = None

    @property
    def counts(self) -> Tensor:
        return self.routing.counts

    def topk(self) -> tuple[Tensor, Tensor]:
        """(ids int64 [T, k], weights [T, k]) in transformers' layout."""
        return self.routing.expert_ids.t(), self.routing.weights.t()


def _aux_flatten(a: BlockAux):
    has_sg = a.shared_gate is not None
    return [a.router_logits, a.routing] + ([a.shared_gate] if has_sg else []), has_sg


def _aux_unflatten(leaves, has_sg) -> BlockAux:
    return BlockAux(leaves[0], leaves[1], leaves[2] if has_sg else None)


pytree.register_pytree_node(BlockAux, _aux_flatten, _aux_unflatten, serialized_type_name="fmoe.models.BlockAux")


def run_block(params: dict, x: Tensor, spec: MoESpec, *, comm=None, training: bool = False,
              generator: Optional[torch.Generator] = None, int8_activations: bool = False
              ) -> tuple[Tensor, "BlockAux"]:
    """One architecture block = :func:`fmoe.moe` with the block's spec; aux in the blocks' form.

    Args:
        params: the pipeline pytree ``{"gate": {"wg", ...}, "experts", "shared"?, "shared_gate"?}``.
        x: [..., H] in dt. spec: the block's :class:`fmoe.MoESpec`. comm: expert-parallel
            communicator (None = local). training, generator: Mixtral jitter.
        int8_activations: the spec's experts with ``int8_activations=True`` (packed FP4 experts
            at inference; :class:`fmoe.ExpertSpec`).
    Returns:
        y with x's shape and dtype; :class:`BlockAux`.
    """
    if int8_activations:
        spec = int8_spec(spec)
    y, aux = moe(params, x, spec, comm=comm, training=training, generator=generator)
    return y, BlockAux(aux.logits, aux.routing, aux.shared_gate)


@functools.lru_cache(maxsize=64)
def int8_spec(spec: MoESpec) -> MoESpec:
    """``spec`` with ``int8_activations=True`` experts (cached: one spec per block spec, not two
    dataclasses per call)."""
    return dataclasses.replace(spec, experts=dataclasses.replace(spec.experts, int8_activations=True))


def block_spec(hidden_size: int, num_experts: int, gate: GateSpec, experts: ExpertSpec, *, normalize: bool,
               combine: str, layout: str, shared: Optional[str] = None) -> MoESpec:
    """The MoESpec of an architecture block (post-scored, dropless unless the gate says otherwise;
    no balance loss: the models compute theirs from the router logits in :class:`BlockAux`)."""
    if combine not in COMBINES:
        raise ValueError(f"combine must be one of {COMBINES}, got {combine!r}")
    return MoESpec(model_dim=hidden_size, num_experts=num_experts, gate=gate, experts=experts,
                   normalize_gate=normalize, combine=combine, layout=layout, shared=shared, balance_loss=False)


def check_tokens(x: Tensor, hidden_size: int, where: str) -> None:
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise TypeError(f"{where}: x must be a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() < 2 or x.shape[-1] != hidden_size:
        raise ValueError(f"{where}: x must be [..., H] with H={hidden_size}, got shape {tuple(x.shape)}")


# --------------------------------------------------------------------------- transformers modules -> pytrees

def _fp8_scale(module, name: str):
    # transformers 5.24 names the fused FP8 scales `<name>_scale_inv`; an earlier revision used
    # `<name>_scales_inv` (formats.md §4.4): match the suffix, not one spelling.
    for suffix in ("_scale_inv", "_scales_inv"):
        s = getattr(module, name + suffix, None)
        if s is not None:
            return s
    return None


def _packed(w) -> bool:
    from ..quant import QuantizedTensor
    return isinstance(w, QuantizedTensor)


def _maybe_fp8(module, name: str):
    w = getattr(module, name)
    if not isinstance(w, torch.Tensor):   # already packed (a QuantizedTensor), e.g. MXFP4 experts kept packed
        return w
    if w.dtype in (torch.float8_e4m3fn, torch.uint8):
        scale = _fp8_scale(module, name)
        if scale is None:
            raise NotImplementedError(
                f"{type(module).__name__}.{name} is {w.dtype} without a *_scale_inv tensor; only "
                "DeepSeek-style FP8 blockwise experts are understood")
        from ..quant import from_deepseek_fp8
        bn = -(-w.shape[-2] // scale.shape[-2])
        bk = -(-w.shape[-1] // scale.shape[-1])
        return from_deepseek_fp8(w.data, scale.data, block=(bn, bk))
    return w


def experts_from_module(experts) -> dict:
    """Pytree of a transformers fused experts module (``*Experts``): parameters shared, not copied.

    Float experts give ``{"gate_up_proj", "down_proj"}`` (+ GPT-OSS biases); FP8 experts
    loaded without dequantisation (``gate_up_proj`` fp8 + ``gate_up_proj_scale_inv``) become
    QuantizedTensors. A module holding packed ``gate_proj`` and ``up_proj`` QuantizedTensors
    instead of a fused one (``fmoe.examples.generate``'s NVFP4 experts, each with its global scale)
    gives ``{"gate_proj", "up_proj", "down_proj"}``.
    """
    if getattr(experts, "gate_up_proj", None) is None:
        gate, up = getattr(experts, "gate_proj", None), getattr(experts, "up_proj", None)
        if _packed(gate) and _packed(up):   # packed gate and up kept apart (NVFP4: a global scale each)
            return {"gate_proj": gate, "up_proj": up, "down_proj": _maybe_fp8(experts, "down_proj")}
        raise NotImplementedError(
            f"{type(experts).__name__} has no fused gate_up_proj parameter (e.g. MXFP4 experts kept packed by "
            "transformers); load the block with fmoe.models.load_moe_block instead")
    p = {"gate_up_proj": _maybe_fp8(experts, "gate_up_proj"), "down_proj": _maybe_fp8(experts, "down_proj")}
    for b in ("gate_up_proj_bias", "down_proj_bias"):
        if getattr(experts, b, None) is not None:
            p[b] = getattr(experts, b)
    return p


def mlp_from_module(mlp) -> dict:
    """``{"gate_proj", "up_proj", "down_proj"}`` weights of a dense SwiGLU nn.Module (shared expert):
    its Linears' weights, or the packed QuantizedTensors a module holds under those names
    (``fmoe.examples.generate``'s packed shared experts)."""
    out = {}
    for n in ("gate_proj", "up_proj", "down_proj"):
        w = getattr(mlp, n)
        out[n] = w if _packed(w) else w.weight
    return out
