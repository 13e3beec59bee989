"""Machinery shared by the architecture adapters: config access, matmuls over float or
quantized expert weights, the dropless routed path, and the two combine orders.

Combine orders (spec architectures.md §1.3, §11):

* ``"eager"`` reproduces transformers' eager expert loop bit for bit: each (token, slot)
  product ``y * w`` is formed with torch type promotion (dt x dt -> dt for Qwen/GPT-OSS,
  dt x fp32 -> fp32 for DeepSeek/Mixtral), cast to dt, and added to the token's output in
  dt, experts in ascending id order.
* ``"grouped"`` is fmoe's :func:`fmoe.combine`: one fp32 reduction over the k slots and one
  final cast. This is the order of transformers' grouped_mm / batched_mm back-ends (the
  default for a ``PreTrainedModel``), Tutel's decode and upstream DeepSeek-V3.2; it agrees
  with them to rounding (1-2 dt ulp) and is the path that composes with ``torch.func``
  through fmoe's custom ops.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils import _pytree as pytree

from ..comm import resolve
from ..ops import combine as _fmoe_combine
from ..ops import dispatch as _fmoe_dispatch
from ..ops.reference import compute_dtype as _compute_dtype
from ..ops.grouped import expert_mm as _grouped_expert_mm
from ..ops.grouped import filled_rows
from ..routing import Routing, make_routing

__all__ = ["BlockAux", "COMBINES", "ACTIVATIONS", "activation", "cfg_get", "is_quantized", "expert_mm",
           "linear", "to_routing", "routed_experts", "eager_combine", "grouped_combine"]

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


def is_quantized(w: Any) -> bool:
    """True for a :class:`fmoe.quant.QuantizedTensor` (anything that is not a plain tensor)."""
    return w is not None and not isinstance(w, Tensor)


def _dequantized(w, dtype: torch.dtype) -> Tensor:
    # Exact decode (formats.md §7): MXFP4/NVFP4 are bf16-representable; FP8 blocks are formed
    # in fp32 and rounded once, as transformers' dequantize=True loaders do.
    return w.dequantize(dtype)


def expert_mm(x: Tensor, w, *, layout: str, rows: Optional[Tensor] = None) -> Tensor:
    """Per-expert matmul ``x[e] @ W[e]`` with ``torch.bmm``.

    Args:
        x: [E, C, K] in the compute dtype dt.
        w: float [E, N, K] when ``layout == "out_in"`` (nn.Linear / transformers fused layout),
            float [E, K, N] when ``layout == "in_out"`` (GPT-OSS float layout), or a
            QuantizedTensor of logical shape [E, N, K] whatever ``layout`` says (quantized
            checkpoints always store out x in).
        rows: optional int64 [E] filled rows per expert (dropless: the counts); float weights
            then multiply exactly those rows, like transformers' per-expert loop
            (``grouped_mm(exact=True)``: equal to the padded GEMM within float rounding,
            not bit for bit); later rows are 0.
    Returns:
        [E, C, N] in x's dtype.
    """
    if is_quantized(w):
        from .. import quant
        mm = getattr(quant, "expert_matmul", None)
        if mm is not None:
            return mm(x, w).to(x.dtype)
        return torch.bmm(x, _dequantized(w, x.dtype).transpose(1, 2))
    w = w.to(x.dtype)
    # Decode buffers are mostly empty experts; the grouped GEMM skips them (and runs one
    # torch.mm per filled expert, like transformers' per-expert loop).
    return _grouped_expert_mm(x, w, transposed=layout == "out_in", rows=rows, exact=True)


def linear(x: Tensor, w, bias: Optional[Tensor] = None) -> Tensor:
    """nn.Linear on tokens x [T, K] with W [N, K] float or quantized; result in x's dtype."""
    if is_quantized(w):
        w = _dequantized(w, x.dtype)
    return F.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype))


def to_routing(ids: Tensor, weights: Tensor, num_experts: int, *, comm=None) -> Routing:
    """Dropless :class:`fmoe.Routing` from router output in transformers' layout.

    Args:
        ids: int64 [T, k] expert of each (token, slot).
        weights: float [T, k] routing weights exactly as fed to the experts (dtype kept).
        num_experts: E.
        comm: ranks agree on the dropless capacity (MAX of the per-expert loads, spec §12.9).
    Returns:
        Routing with [k, T] leaves and capacity = max per-expert load (no drops).
    """
    return make_routing(ids.t().contiguous(), weights.t().contiguous(), num_experts, 0.0, comm=comm)


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


def eager_combine(y: Tensor, routing: Routing, out_dtype: torch.dtype, *, positions: Optional[Tensor] = None
                  ) -> Tensor:
    """transformers' eager accumulation order, vectorised.

    The eager loop visits experts in ascending id and index_adds ``(y * w).to(dt)``; a token
    never meets the same expert twice, so its output is the dt running sum of its k
    contributions sorted by expert id. Masked pairs (negative ids) contribute nothing.

    Args:
        y: [E, C, H] expert outputs (dt). routing: the routing that filled the buffers.
        out_dtype: dt.
    Returns:
        [T, H] in out_dtype.
    """
    E, C, H = y.shape
    pos = routing.positions() if positions is None else positions  # [k, T], -1 when masked
    rows = y.reshape(E * C, H)[pos.clamp(min=0)]     # [k, T, H]
    # Promotion as in transformers: dt*dt stays dt, dt*fp32 becomes fp32, then one cast.
    contrib = (rows * routing.weights.unsqueeze(-1)).to(out_dtype)
    contrib = torch.where((pos >= 0).unsqueeze(-1), contrib, torch.zeros((), dtype=out_dtype, device=y.device))
    key = torch.where(routing.expert_ids >= 0, routing.expert_ids, torch.full_like(routing.expert_ids, -1))
    order = torch.argsort(key, dim=0, stable=True)   # [k, T]
    contrib = contrib.gather(0, order.unsqueeze(-1).expand_as(contrib))
    out = contrib[0]
    for j in range(1, contrib.shape[0]):
        out = out + contrib[j]   # one dt rounding per expert, like index_add_
    return out


def grouped_combine(y: Tensor, routing: Routing, out_dtype: torch.dtype, *, positions: Optional[Tensor] = None
                    ) -> Tensor:
    """transformers' grouped_mm / batched_mm order through :func:`fmoe.combine`.

    Each buffer row holds exactly one (token, slot) pair, so the routing weight is applied
    per row with torch promotion first (a bf16 x bf16 product is rounded to bf16, as those
    back-ends do), then fmoe's combine sums the k slots in fp32 and the result is cast once.

    Args:
        y: [E, C, H] expert outputs (dt). routing: dropless routing. out_dtype: dt.
    Returns:
        [T, H] in out_dtype.
    """
    E, C, H = y.shape
    w = routing.weights
    if (w.dtype in (torch.float32, torch.float64) and out_dtype == y.dtype
            and torch.promote_types(y.dtype, w.dtype) == w.dtype == _compute_dtype(y.dtype)):
        # The per-row product y * w is formed in w's dtype, which is also combine's compute
        # dtype: combine's weighted sum forms the same products and sums them in the same
        # order, then casts once to dt (fp32 experts; fp32 weights on bf16 experts): the same
        # result without the [E, C, H] weighted copy.
        return _fmoe_combine(y, routing, weighted=True, positions=positions)
    pos = (routing.positions() if positions is None else positions).reshape(-1)
    w = w.reshape(-1)
    # Row E*C is a bin for masked pairs; kept positions are unique so index_copy is a scatter.
    w_rows = torch.zeros(E * C + 1, dtype=w.dtype, device=w.device).index_copy(
        0, torch.where(pos >= 0, pos, torch.full_like(pos, E * C)), w)[: E * C]
    weighted = y * w_rows.reshape(E, C, 1)
    return _fmoe_combine(weighted, routing, weighted=False, positions=positions).to(out_dtype)


def _no_init(*args, **kwargs):
    raise RuntimeError("adapter experts are loaded from checkpoints, not initialised")


def routed_experts(expert_params: dict, tokens: Tensor, routing: Routing, expert_fn: Callable,
                   *, combine: str = "eager", comm=None) -> Tensor:
    """dispatch -> experts -> combine over a dropless routing.

    Args:
        expert_params: the experts' pytree (float or quantized leaves).
        tokens: [T, H] in dt.
        routing: dropless routing over the T tokens (weights as fed to the experts).
        expert_fn: ``fn(params, x[E, C, H], *, rows=None) -> [E, C, H]``; locally it is given
            ``rows`` (filled rows per expert) so empty buffer rows are skipped.
        combine: "eager" or "grouped" (module docstring).
        comm: None / a size-1 communicator runs locally; a larger one goes through
            ``fmoe.parallel.expert_parallel`` (no silent single-process fallback).
    Returns:
        [T, H] routed output in dt.
    """
    if combine not in COMBINES:
        raise ValueError(f"combine must be one of {COMBINES}, got {combine!r}")
    pos = routing.positions()  # once for dispatch and combine
    buffers = _fmoe_dispatch(tokens, routing, positions=pos)
    c = resolve(comm)
    if c.size == 1:
        out = expert_fn(expert_params, buffers, rows=filled_rows(routing.counts, routing.capacity))
    else:
        try:
            from ..parallel import expert_parallel
        except ImportError as e:
            raise NotImplementedError(
                f"moe_block with a communicator of size {c.size} needs fmoe.parallel.expert_parallel("
                "spec, expert_params, buffers, comm), which is not available in this build "
                f"({e}); refusing to fall back to a single process") from e
        from ..experts import ExpertSpec
        from ..moe import MoESpec
        spec = MoESpec(model_dim=tokens.shape[1], num_experts=routing.num_experts,
                       experts=ExpertSpec(type="custom", fn=expert_fn, init=_no_init))
        out = expert_parallel(spec, expert_params, buffers, c)
    if combine == "grouped":
        return grouped_combine(out, routing, tokens.dtype, positions=pos)
    return eager_combine(out, routing, tokens.dtype, positions=pos)


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


def _maybe_fp8(module, name: str):
    w = getattr(module, name)
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
    QuantizedTensors.
    """
    if getattr(experts, "gate_up_proj", None) is None:
        raise NotImplementedError(
            f"{type(experts).__name__} has no fused gate_up_proj parameter (e.g. MXFP4 experts kept packed by "
            "transformers); load the block with fmoe.models.load_moe_block instead")
    p = {"gate_up_proj": _maybe_fp8(experts, "gate_up_proj"), "down_proj": _maybe_fp8(experts, "down_proj")}
    for b in ("gate_up_proj_bias", "down_proj_bias"):
        if getattr(experts, b, None) is not None:
            p[b] = getattr(experts, b)
    return p


def mlp_from_module(mlp) -> dict:
    """``{"gate_proj", "up_proj", "down_proj"}`` weights of a dense SwiGLU nn.Module (shared expert)."""
    return {n: getattr(mlp, n).weight for n in ("gate_proj", "up_proj", "down_proj")}
