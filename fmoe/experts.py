"""Expert functions over the one grouped-GEMM seam, and the table of their parameter layouts.

Every built-in expert function has the signature ``fn(params, x, gemm) -> y`` where ``gemm``
is a :class:`fmoe.engine.GroupedGemm` (the kernel table's entry bound to the call's plan) and
x is the plan's rows: a layout's buffer, padded [E, C, M] or ragged [R, M]; y has the same
leading shape and O features. ``gemm=None`` means plain per-expert matmuls over padded buffers [E, C, M] (every
row multiplied), which is what a hand-written call on ``fmoe.dispatch`` output wants.

Expert types (``ExpertSpec.type``) and their parameter pytrees (float layouts; a weight may
also be a :class:`fmoe.quant.QuantizedTensor`, always out x in [E, N, K]):

=============  =======================================================================  ==========
type           parameters                                                               origin
=============  =======================================================================  ==========
``ffn``        fc1_w [E, H, M], fc1_b [E, H]?, fc2_w [E, H, O], fc2_b [E, O]?           Tutel ffn
``gated_ffn``  gate_w [E, M, H], up_w [E, M, H], down_w [E, H, O]  (x @ W)              Tutel llama_ffn
``swiglu``     gate_up_proj [E, 2I, M] (gate rows first) or gate_proj/up_proj [E, I, M];  transformers
               down_proj [E, M, I]  (out x in, like nn.Linear)                          Qwen/DeepSeek/Mixtral
``gpt_oss``    gate_up_proj [E, M, 2I] (in x out, gate/up interleaved), gate_up_proj_bias  GPT-OSS
               [E, 2I], down_proj [E, I, M], down_proj_bias [E, M]; clamped SwiGLU
``custom``     anything: ``fn(params, x[E, C, M]) -> [E, C, O]`` on padded buffers       user
=============  =======================================================================  ==========

:data:`EXPERT_PARAMS` is the one description of these layouts (names, Tutel state-dict
names, the axis cut when several ranks share an expert, zero-padded leaves); expert
parallelism, checkpoints and :mod:`fmoe.nn` read it.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils import _pytree as pytree

from .ops.grouped import padded_mm
from .engine import ExpertForm, GroupedGemm
from .engine import kinds as _kinds
from .engine import plan as _plan
from .engine import traced as _traced
from .layout import make_layout

__all__ = ["ExpertSpec", "EXPERT_PARAMS", "EXPERT_TYPES", "ffn", "gated_ffn", "swiglu", "gpt_oss", "apply_experts",
           "routed_experts", "expert_form", "expert_dtype", "init_experts", "expert_matmul", "shared_experts", "linear"]

EXPERT_TYPES = ("ffn", "gated_ffn", "swiglu", "gpt_oss", "custom")


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """One expert parameter of a built-in expert type.

    Attributes:
        name: key in the expert pytree.
        tutel_name: Tutel's state-dict name (None where Tutel has no such expert).
        shard_axis: axis of the local [n, ...] tensor cut when s ranks share one expert (None:
            this type cannot be sharded).
        padded: cut with zero padding to a multiple of s (fc2 bias along O).
        optional: may be absent (biases).
        trim_like: for a padded leaf, the parameter whose last dim is its true length (O).
    """

    name: str
    tutel_name: Optional[str] = None
    shard_axis: Optional[int] = None
    padded: bool = False
    optional: bool = False
    trim_like: Optional[str] = None


EXPERT_PARAMS: dict[str, tuple[ParamLayout, ...]] = {
    "ffn": (ParamLayout("fc1_w", "batched_fc1_w", 1), ParamLayout("fc1_b", "batched_fc1_bias", 1, optional=True),
            ParamLayout("fc2_w", "batched_fc2_w", 1),
            ParamLayout("fc2_b", "batched_fc2_bias", 1, padded=True, optional=True, trim_like="fc2_w")),
    "gated_ffn": (ParamLayout("gate_w", "W_fc1", 2), ParamLayout("up_w", "W_fc2", 2), ParamLayout("down_w", "W_fc3", 1)),
    # Fused gate/up halves and interleaved columns cannot be cut along the hidden axis by one
    # narrow: these types run with E >= W (whole experts per rank) only.
    "swiglu": (ParamLayout("gate_up_proj", optional=True), ParamLayout("gate_proj", optional=True),
               ParamLayout("up_proj", optional=True), ParamLayout("down_proj")),
    "gpt_oss": (ParamLayout("gate_up_proj"), ParamLayout("gate_up_proj_bias"), ParamLayout("down_proj"),
                ParamLayout("down_proj_bias")),
}


def sharding(num_experts: int, world: int) -> tuple[int, int]:
    """(n local experts, s ranks per expert) for E experts on W ranks."""
    E, W = num_experts, world
    if E >= W:
        if E % W:
            raise ValueError(f"{E} experts cannot be spread evenly over {W} ranks (need E % W == 0 or W % E == 0): "
                             + _layout_fix(E, W))
        return E // W, 1
    if W % E:
        raise ValueError(f"{E} experts cannot be shared evenly by {W} ranks (need W % E == 0): " + _layout_fix(E, W))
    return 1, W // E


def _layout_fix(E: int, W: int) -> str:
    """The nearest expert counts and world sizes that do fit, for an error message."""
    sizes = [w for w in range(1, 2 * max(W, E) + 1) if E % w == 0 or w % E == 0]
    counts = [e for e in range(1, 2 * max(E, W) + 1) if e % W == 0 or W % e == 0]
    near_w = sorted(sizes, key=lambda w: (abs(w - W), w))[:3]
    near_e = sorted(counts, key=lambda e: (abs(e - E), e))[:3]
    return (f"use MoESpec.num_experts in {sorted(near_e)} for {W} ranks, or a world size in {sorted(near_w)} "
            f"for {E} experts")


def shard_axes(expert_type: str) -> Optional[dict[str, ParamLayout]]:
    """name -> ParamLayout for a type whose experts can be shared by several ranks, else None."""
    table = EXPERT_PARAMS.get(expert_type)
    if table is None or any(p.shard_axis is None for p in table):
        return None
    return {p.name: p for p in table}


@dataclasses.dataclass(frozen=True)
class ExpertSpec:
    """Static description of the experts (hashable, never traced).

    Attributes:
        type: one of :data:`EXPERT_TYPES` ('llama_ffn' is accepted as Tutel's name of gated_ffn).
        hidden_size: H (I for swiglu / gpt_oss), hidden units per expert.
        activation: elementwise callable; default ReLU for ffn, SiLU for gated_ffn / swiglu.
        has_fc1_bias, has_fc2_bias: ffn biases (Tutel defaults: both on).
        output_dim: O (default: model_dim).
        alpha, limit: GPT-OSS clamped SwiGLU constants.
        fn, init: the custom expert function ``fn(params, x[E, C, M]) -> [E, C, O]`` and its
            initialiser ``init(num_experts, model_dim, spec, generator, dtype)``.
        takes_plan: custom experts only: ``fn(params, x[T, M], plan) -> [N, O]`` instead, on the
            expert engine's :class:`~fmoe.engine.ExpertPlan` (the kept pairs sorted by expert;
            one process, eager mode): the rows of expert e are ``plan.bounds[e]:plan.bounds[e+1]``,
            and :func:`fmoe.engine.grouped_mm` multiplies all experts at once through the
            kernel table (differentiable). fmoe weights the rows by their gates and sums them
            back to tokens.
        precision: None, a name such as 'fp8_block' / 'mxfp4' / 'nvfp4', or a
            :class:`fmoe.quant.training.TrainPrecision`: run the expert GEMMs of float master
            weights quantized in forward and backward (quantized training).
        int8_activations: packed MXFP4 / NVFP4 experts at inference multiply the rows rounded to
            int8 per 32-element block (scale amax / 127) with integer dot products (AVX-512 VNNI),
            as llama.cpp's Q8 activations: |error| <= |W| @ (d / 2) per row over the blocks'
            scales d, about 1 % of the layer output (BENCHMARKS.md). Only on the fused packed
            stage (an eager no-grad CPU call on one process, every expert weight packed FP4 with
            input widths that are multiples of 128, a VNNI CPU); any other call raises.
    """

    type: str = "ffn"
    hidden_size: int = 0
    activation: Optional[Callable[[Tensor], Tensor]] = None
    has_fc1_bias: bool = True
    has_fc2_bias: bool = True
    output_dim: Optional[int] = None
    alpha: float = 1.702
    limit: float = 7.0
    fn: Optional[Callable] = None
    init: Optional[Callable] = None
    precision: Any = None
    takes_plan: bool = False
    int8_activations: bool = False

    def __post_init__(self):
        if self.type == "llama_ffn":  # Tutel's name for the same SwiGLU expert
            object.__setattr__(self, "type", "gated_ffn")
        if self.type not in EXPERT_TYPES:
            raise ValueError(f"unknown expert type {self.type!r}; expected one of {EXPERT_TYPES}")
        if self.type == "custom":
            if self.fn is None or self.init is None:
                raise ValueError("custom experts need both fn(params, x) and init(num_experts, model_dim, spec, "
                                 "generator, dtype)")
        elif not isinstance(self.hidden_size, int) or self.hidden_size < 1:
            raise ValueError(f"hidden_size must be a positive int, got {self.hidden_size!r}")
        if self.takes_plan and self.type != "custom":
            raise ValueError(f"takes_plan is for custom experts; {self.type!r} experts run on the engine already")
        if not isinstance(self.int8_activations, bool):
            raise TypeError(f"int8_activations must be a bool, got {self.int8_activations!r}")
        if self.int8_activations and (self.type == "custom" or self.precision is not None):
            raise ValueError("int8_activations is for built-in experts with packed weights at inference; it does not "
                             f"combine with type={self.type!r} / precision={self.precision!r}")
        if isinstance(self.precision, str):
            from .quant import training as _qt  # validates the name; keeps the spec hashable
            object.__setattr__(self, "precision", _qt.recipe_from_name(self.precision))

    def act(self) -> Callable[[Tensor], Tensor]:
        if self.activation is not None:
            return self.activation
        return F.relu if self.type == "ffn" else F.silu

    @property
    def layout_aware(self) -> bool:
        """Built-in types take any layout through the seam; custom experts see padded buffers."""
        return self.type != "custom"


def _is_quantized(w) -> bool:
    # Anything but a plain tensor in a weight slot must be a fmoe.quant packed tensor;
    # fmoe.quant.expert_matmul validates it.
    return not isinstance(w, Tensor)


def expert_matmul(x: Tensor, w, gemm: Optional[GroupedGemm] = None, *, transposed: bool,
                  bias: Optional[Tensor] = None) -> Tensor:
    """Per-expert ``x_e @ op(w[e]) (+ bias[e])`` through the seam (``gemm``) or, with ``gemm=None``,
    over padded buffers x [E, C, K] with every row multiplied.

    Args:
        x: the layout's buffer ([E, C, K] or [R, K]).
        w: float [E, N, K] if ``transposed`` (out x in) else [E, K, N]; or a quantized tensor
            of logical shape [E, N, K].
        bias: [E, N] or None.
    Returns:
        [E, C, N] / [R, N] in x's dtype.
    """
    if gemm is not None:
        return gemm.mm(x, w, transposed=transposed, bias=bias)
    y = padded_mm(x, w, transposed=transposed)
    return y if bias is None else y + bias.to(y.dtype).unsqueeze(1)


_COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def expert_dtype(params, fallback: torch.dtype) -> torch.dtype:
    """The experts' compute dtype: that of the first float leaf of ``params`` (packed,
    quantized weights are not compute dtypes), else ``fallback``."""
    # a flat dict (every built-in kind) in its own order, as tree_leaves would walk it (a tenth of its cost)
    flat = type(params) is dict and not any(isinstance(v, (dict, list, tuple)) for v in params.values())
    leaves = params.values() if flat else pytree.tree_leaves(
        params, is_leaf=lambda t: not isinstance(t, (dict, list, tuple)))
    for leaf in leaves:
        if isinstance(leaf, Tensor) and leaf.dtype in _COMPUTE_DTYPES:
            return leaf.dtype
    return fallback


def expert_form(spec: "ExpertSpec", params) -> dict:
    """Every built-in kind as one description: ``{"form": ExpertForm, "w_in": tuple, "w_out",
    "b_in", "b_out"}`` over the weights as given (float, or quantized: always out x in).

    The expert functions (:func:`apply_experts`) and the engine (:func:`fmoe.engine.run`) both
    take it, so a kind is defined once."""
    b_in = b_out = None
    if spec.type == "ffn":   # fc1 out x in; float fc2 keeps Tutel's hidden x out, quantized fc2 is out x in
        w_in, w_out, b_in, b_out = (params["fc1_w"],), params["fc2_w"], params.get("fc1_b"), params.get("fc2_b")
        form = _form_of(spec, True, _is_quantized(params["fc2_w"]))
    elif spec.type == "gpt_oss":   # float x @ W, quantized out x in
        w_in, w_out = (params["gate_up_proj"],), params["down_proj"]
        b_in, b_out = params["gate_up_proj_bias"], params["down_proj_bias"]
        form = _form_of(spec, _is_quantized(w_in[0]), _is_quantized(w_out))
    elif spec.type == "gated_ffn":   # float x @ W, quantized out x in
        w_in, w_out = (params["gate_w"], params["up_w"]), params["down_w"]
        form = _form_of(spec, _is_quantized(w_in[0]), _is_quantized(w_out))
    elif spec.type == "swiglu":   # out x in (nn.Linear), gate rows first when fused
        w_in = (params["gate_up_proj"],) if "gate_up_proj" in params else (params["gate_proj"], params["up_proj"])
        w_out = params["down_proj"]
        form = _form_of(spec, True, True)
    else:
        raise ValueError(f"custom experts have no built-in form (type {spec.type!r})")
    return {"form": form, "w_in": w_in, "w_out": w_out, "b_in": b_in, "b_out": b_out}


def _form(spec: "ExpertSpec", in_transposed: bool, out_transposed: bool) -> ExpertForm:
    """The :class:`~fmoe.engine.ExpertForm` of a built-in kind: a pure function of the frozen spec
    and the two flags."""
    if spec.type == "gpt_oss":
        return ExpertForm("gpt_oss", in_transposed, out_transposed, alpha=spec.alpha, limit=spec.limit,
                          int8=spec.int8_activations)
    return ExpertForm("ffn" if spec.type == "ffn" else "glu", in_transposed, out_transposed, activation=spec.act(),
                      int8=spec.int8_activations)


_cached_form = functools.lru_cache(maxsize=256)(_form)


def _form_of(spec: "ExpertSpec", in_transposed: bool, out_transposed: bool) -> ExpertForm:
    # one form per layer's spec, not one dataclass per call; a spec holding an unhashable
    # callable (an activation object without __hash__) builds its form each time, and so does a
    # traced call (dynamo warns at a cache wrapper; the form is a constant of the graph anyway)
    if torch.compiler.is_compiling():
        return _form(spec, in_transposed, out_transposed)
    try:
        return _cached_form(spec, in_transposed, out_transposed)
    except TypeError:
        return _form(spec, in_transposed, out_transposed)


def apply_form(form: ExpertForm, x: Tensor, w_in: tuple, w_out, b_in: Optional[Tensor] = None,
               b_out: Optional[Tensor] = None, gemm: Optional[GroupedGemm] = None) -> Tensor:
    """``y = hidden(x W_in + b_in) W_out + b_out`` per expert over the seam (a layout plan's
    expert stage for every built-in kind).

    Args:
        form: the kind (:class:`fmoe.engine.ExpertForm`).
        x: the layout's buffer, [E, C, M] or [R, M].
        w_in, w_out, b_in, b_out: as :func:`expert_form` returns them.
        gemm: the seam (None: every row of padded buffers).
    Returns:
        [E, C, O] or [R, O]. Rows holding no pair are not meaningful (0, or the biases' output).
    """
    return _kinds.project(functools.partial(expert_matmul, gemm=gemm), form, x, w_in, b_in, w_out, b_out)


def ffn(params: dict, x: Tensor, gemm: Optional[GroupedGemm] = None, *,
        activation: Callable[[Tensor], Tensor] = F.relu) -> Tensor:
    """h = act(x W1^T + b1); y = h W2 + b2 for each expert (Tutel 'ffn').

    Args:
        params: ``{"fc1_w": [E, H, M], "fc1_b": [E, H] (optional), "fc2_w": [E, H, O],
            "fc2_b": [E, O] (optional)}``.
        x: the layout's buffer, [E, C, M] or [R, M]. gemm: the seam (None: every row of padded buffers).
    Returns:
        [E, C, O] or [R, O]. Rows holding no pair are not meaningful (0 + bias).
    """
    return apply_form(**expert_form(ExpertSpec("ffn", 1, activation=activation), params), x=x, gemm=gemm)


def gated_ffn(params: dict, x: Tensor, gemm: Optional[GroupedGemm] = None, *,
              activation: Callable[[Tensor], Tensor] = F.silu) -> Tensor:
    """SwiGLU: y = (act(x A) * (x B)) Cm per expert (Tutel 'llama_ffn').

    Args:
        params: ``{"gate_w": [E, M, H], "up_w": [E, M, H], "down_w": [E, H, M]}``
            (quantized weights: [E, H, M], [E, H, M], [E, M, H], out x in).
        x: the layout's buffer. gemm: the seam.
    Returns:
        [E, C, M_out] or [R, M_out].
    """
    return apply_form(**expert_form(ExpertSpec("gated_ffn", 1, activation=activation), params), x=x, gemm=gemm)


def swiglu(params: dict, x: Tensor, gemm: Optional[GroupedGemm] = None, *,
           activation: Callable[[Tensor], Tensor] = F.silu) -> Tensor:
    """y_e = D_e (act(G_e x) * (U_e x)), no biases, in x's dtype (transformers' fused experts).

    Args:
        params: ``{"gate_up_proj": [E, 2I, M], "down_proj": [E, M, I]}`` (gate rows first) or
            ``{"gate_proj": [E, I, M], "up_proj": [E, I, M], "down_proj": [E, M, I]}``; out x in.
        x: the layout's buffer. gemm: the seam.
    Returns:
        [E, C, M] or [R, M]. Rows holding no pair are 0.
    """
    return apply_form(**expert_form(ExpertSpec("swiglu", 1, activation=activation), params), x=x, gemm=gemm)


def gpt_oss(params: dict, x: Tensor, gemm: Optional[GroupedGemm] = None, *, alpha: float = 1.702,
            limit: float = 7.0) -> Tensor:
    """GPT-OSS clamped SwiGLU (architectures.md §7), including the down bias.

        z = x A_e + a_e;  gate = z[..., 0::2], up = z[..., 1::2]
        gate = min(gate, limit); up = clamp(up, -limit, limit)
        y = ((up + 1) * gate * σ(alpha * gate)) D_e + d_e

    Args:
        params: float ``{"gate_up_proj": [E, M, 2I], "down_proj": [E, I, M]}`` (in x out) or
            quantized [E, 2I, M] / [E, M, I] (out x in); biases [E, 2I], [E, M].
        x: the layout's buffer. gemm: the seam.
    Returns:
        [E, C, M] or [R, M]. Rows holding no pair give d_e, not 0; they are never combined.
    """
    return apply_form(**expert_form(ExpertSpec("gpt_oss", 1, alpha=alpha, limit=limit), params), x=x, gemm=gemm)


def apply_experts(spec: ExpertSpec, params, x: Tensor, gemm: Optional[GroupedGemm] = None) -> Tensor:
    """Run the experts described by ``spec`` on the layout's buffer x through the seam ``gemm``.

    Custom experts are called as ``spec.fn(params, x)`` on padded buffers [E, C, M].
    """
    if spec.type != "custom":
        return apply_form(**expert_form(spec, params), x=x, gemm=gemm)
    if gemm is not None and gemm.layout.kind != "padded":
        raise ValueError("custom experts take padded buffers [E, C, M]; route them with layout='padded'")
    return spec.fn(params, x)


def routed_experts(spec: ExpertSpec, params, x: Tensor, routing, *, layout_kind: str = "padded",
                   order: str = "fmoe", prescore: bool = False, plan: str = "auto", save: str = "projections",
                   generator: Optional[torch.Generator] = None, rows=None) -> tuple[Tensor, Tensor]:
    """The routed experts of one process on tokens x [T, M]: the engine over a rows plan where
    it applies (``plan`` 'auto'; custom experts with ``takes_plan`` always), else over a layout
    plan of ``layout_kind`` (dispatch, the layout kernel, combine).

    Args:
        spec: the experts. params: their pytree ([E, ...] leaves, float or packed weights).
        x: [T, M] in the experts' compute dtype. routing: a :class:`fmoe.Routing` over the T tokens.
        order: the combine order (:data:`fmoe.ops.orders.COMBINES`). prescore: gates scale the
            experts' inputs. plan: :attr:`fmoe.MoESpec.plan`. save: :attr:`fmoe.MoESpec.save`.
        generator: the quantized-training recipe's stochastic rounding.
        rows: the routing's :class:`~fmoe.routing.KeptRows` where the native route made them with
            it (a rows plan then takes them instead of walking the routing), else None.
    Returns:
        (y [T, O] in x's dtype, pairs dropped int64 []).
    """
    kw = None if spec.type == "custom" else expert_form(spec, params)
    ts = (x, routing.weights) if kw is None else (
        x, routing.weights, *kw["w_in"], kw["w_out"], kw["b_in"], kw["b_out"])
    how = dict(order=order, prescore=prescore)
    # custom experts take padded buffers (a layout plan) unless written for the plan's rows
    door = "layout" if kw is None else _traced.door(kw["form"], ts, precision=spec.precision, plan=plan, **how)
    if spec.takes_plan:   # custom experts written for the plan: its rows or nothing
        if _traced.door(None, ts, **how) != "rows":
            raise ValueError("custom experts with takes_plan=True run on one process in eager mode (no torch.func "
                             "transform, no torch.compile) with is_postscore=True and combine 'fmoe' or 'eager'; "
                             "use takes_plan=False (padded [E, C, M] buffers) there")
        door = "rows"
    if door == "traced":
        if spec.int8_activations:
            raise ValueError(_kinds.int8_refusal("this call is traced (torch.compile or a torch.func transform)"))
        y = _traced.run(kw["form"], x, routing, kw["w_in"], kw["w_out"], b_in=kw["b_in"], b_out=kw["b_out"],
                        order=order, save=save)
        return y, routing.num_dropped()
    ts = tuple(t for t in ts if t is None or isinstance(t, Tensor))   # packed weights: their own type
    # a custom expert's parameters are not in ts: any call with grad on may be a training call
    needs_grad = torch.is_grad_enabled() and (kw is None or any(t is not None and t.requires_grad for t in ts))
    rows_plan = _plan.make_plan(routing, needs_grad=needs_grad, dtype=x.dtype,
                                precision=None if kw is None else spec.precision,
                                layout=None if door == "rows" else make_layout(routing, layout_kind), rows=rows,
                                device_rows=False if kw is None else None)   # a custom fn may loop on host bounds
    # (a rows plan made from the native route's rows: its gates too, KeptRows.gates)
    w_rows = rows.gates(routing.weights) if door == "rows" and rows is not None else rows_plan.row_weights(routing.weights)
    if kw is None:
        y = _kinds.run_custom(spec.fn, params, x, w_rows, rows_plan, order=order, prescore=prescore)
    else:
        y = _kinds.run(kw["form"], x, w_rows, rows_plan, kw["w_in"], kw["w_out"], b_in=kw["b_in"],
                       b_out=kw["b_out"], order=order, save=save, prescore=prescore, generator=generator)
    return y, rows_plan.dropped


def _uniform(shape, bound: float, generator) -> Tensor:
    # Tutel's expression (rand * 2b - b), so the same seed draws Tutel's weights bit for bit
    return torch.rand(shape, generator=generator, dtype=torch.float32) * (bound + bound) - bound


def init_experts(spec: ExpertSpec, num_experts: int, model_dim: int, *, generator=None,
                 dtype=torch.float32) -> dict:
    """Initial parameters for ``num_experts`` experts.

    ffn follows Tutel: W1 ~ U(+-1/sqrt(M)), W2 ~ U(+-1/sqrt(H)), drawn in float32 expert by
    expert (fc1 then fc2 of each, Tutel's order and formula: the same seed gives Tutel's
    weights) and then cast; biases zero. gated_ffn: N(0, 0.01). swiglu / gpt_oss
    (architectures whose weights come from checkpoints): N(0, 0.02) weights, zero biases.
    """
    E, M, H = num_experts, model_dim, spec.hidden_size
    O = spec.output_dim or model_dim
    if spec.type == "custom":
        return spec.init(num_experts, model_dim, spec, generator, dtype)
    if spec.type == "ffn":
        pairs = [(_uniform((H, M), 1 / math.sqrt(M), generator), _uniform((H, O), 1 / math.sqrt(H), generator))
                 for _ in range(E)]
        w1 = torch.stack([a for a, _ in pairs])
        w2 = torch.stack([b for _, b in pairs])
        p = {"fc1_w": w1.to(dtype), "fc2_w": w2.to(dtype)}
        if spec.has_fc1_bias:
            p["fc1_b"] = torch.zeros(E, H, dtype=dtype)
        if spec.has_fc2_bias:
            p["fc2_b"] = torch.zeros(E, O, dtype=dtype)
        return p

    def normal(shape, std):
        return (torch.randn(shape, generator=generator, dtype=torch.float32) * std).to(dtype)

    if spec.type == "gated_ffn":
        return {"gate_w": normal((E, M, H), 0.01), "up_w": normal((E, M, H), 0.01), "down_w": normal((E, H, O), 0.01)}
    if spec.type == "swiglu":
        return {"gate_up_proj": normal((E, 2 * H, M), 0.02), "down_proj": normal((E, O, H), 0.02)}
    return {"gate_up_proj": normal((E, M, 2 * H), 0.02), "gate_up_proj_bias": torch.zeros(E, 2 * H, dtype=dtype),
            "down_proj": normal((E, H, O), 0.02), "down_proj_bias": torch.zeros(E, O, dtype=dtype)}


# --------------------------------------------------------------------------- shared experts

def _packed_rows(x: Tensor, *ws) -> bool:
    """Whether packed [N, K] weights ``ws`` multiply packed on tokens x: an eager CPU call on fp32
    or bf16 rows [T, K] (elsewhere, CUDA, torch.compile, torch.func, they are dequantized)."""
    return (x.device.type == "cpu" and x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16)
            and all(_is_quantized(w) and w.device.type == "cpu" and w.ndim == 2 for w in ws) and _traced._eager(x))


def _one_expert(w):
    """A packed [N, K] weight as one expert's [1, N, K] (views of its tensors)."""
    from .quant import QuantizedTensor   # optional: low-precision weights
    gs = None if w.global_scale is None else w.global_scale.reshape(1)
    return QuantizedTensor(w.data.unsqueeze(0), w.scales.unsqueeze(0), gs, w.fmt, (1, *w.shape), w.block)


def linear(x: Tensor, w, bias: Optional[Tensor] = None) -> Tensor:
    """nn.Linear on tokens x [T, K] with W [N, K] float or quantized; result in x's dtype.

    A packed W multiplies packed where :func:`_packed_rows` says so
    (:func:`fmoe.quant.packed.grouped_matmul`, one expert: its bytes read once, float32 products, as
    the routed experts'); elsewhere it is dequantized to x's dtype and multiplied by ``F.linear``."""
    if _is_quantized(w):
        if _packed_rows(x, w):
            from .quant import packed   # optional: low-precision weights
            y = packed.grouped_matmul(x, _one_expert(w), torch.tensor([0, x.shape[0]]))
            return y if bias is None else y + bias.to(x.dtype)
        w = w.dequantize(x.dtype)
    return F.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype))


def shared_stage(params: dict, activation: Callable[[Tensor], Tensor] = F.silu):
    """The fused stage's weights (:func:`fmoe.quant.packed.stage_weights`, one expert) of a shared
    SwiGLU whose three weights are packed [N, K] CPU tensors, with SiLU and the packed extension
    built; else None. :func:`swiglu_mlp` makes them per call; a prepared call
    (:class:`fmoe.PreparedMoE`) once."""
    ws = (params["gate_proj"], params["up_proj"], params["down_proj"])
    if activation is not F.silu or not all(_is_quantized(w) and w.device.type == "cpu" and w.ndim == 2 for w in ws):
        return None
    from .quant import packed   # optional: low-precision weights
    if not packed.AVAILABLE:
        return None
    gate, up, down = (_one_expert(w) for w in ws)
    return packed.stage_weights((gate, up), down, act="glu")


def run_shared_stage(weights, x: Tensor) -> Tensor:
    """:func:`swiglu_mlp` of the packed weights :func:`shared_stage` made, on rows x [T, M] (fp32 or
    bf16, CPU, an eager call that wants no gradient): one native call (forward only: one expert,
    every token's gate 1), the bits of :func:`swiglu_mlp`'s composition over the same packed GEMMs."""
    from .quant import packed   # optional: low-precision weights
    T = x.shape[0]
    return packed.run_stage(weights, x if x.stride(1) == 1 else x.contiguous(), torch.arange(T), torch.tensor([0, T]),
                            torch.ones(T))


def swiglu_mlp(params: dict, x: Tensor, *, activation: Callable[[Tensor], Tensor] = F.silu) -> Tensor:
    """Dense SwiGLU on tokens (DeepSeek ``shared_experts``, Qwen2 ``shared_expert``).

    Args:
        params: ``{"gate_proj": [Is, M], "up_proj": [Is, M], "down_proj": [M, Is]}`` (float or quantized).
        x: [T, M] in dt.
    Returns:
        [T, M] in dt.

    Three packed weights and SiLU (:func:`shared_stage`) on rows :func:`_packed_rows` takes, where
    no gradient is wanted: one native call (:func:`run_shared_stage`), the composition's bits.
    """
    if _packed_rows(x) and not (x.requires_grad and torch.is_grad_enabled()):
        weights = shared_stage(params, activation)
        if weights is not None:
            return run_shared_stage(weights, x)
    return linear(activation(linear(x, params["gate_proj"])) * linear(x, params["up_proj"]), params["down_proj"])


def shared_experts(kind: str, params: dict, x: Tensor, *, activation: Callable[[Tensor], Tensor] = F.silu
                   ) -> tuple[Tensor, Optional[Tensor]]:
    """The shared (always-on) experts of a block, on tokens x [T, M] in dt.

    Args:
        kind: 'swiglu' (DeepSeek family: ``params["shared"]``) or 'gated_swiglu' (Qwen2-MoE /
            Qwen3-Next: σ(x · w_sgᵀ) * swiglu, ``params["shared_gate"]["weight"]`` [1, M]).
        params: the layer's pytree.
    Returns:
        (output [T, M] dt, gate [T, 1] dt or None).
    """
    y = swiglu_mlp(params["shared"], x, activation=activation)
    if kind == "swiglu":
        return y, None
    w = params["shared_gate"]["weight"]
    if _is_quantized(w):
        raise TypeError("shared_expert_gate weight must be a float tensor")
    g = torch.sigmoid(linear(x, w))
    return g * y, g
