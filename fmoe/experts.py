"""Expert functions, batched over the local experts.

Every expert function has the signature ``fn(params, x) -> y`` with
x [E, C, M] (E local experts, C rows each) and y [E, C, O].

Parameter pytrees (float layouts follow Tutel so checkpoints map one to one):
    ffn:       ``{"fc1_w": [E, H, M], "fc1_b": [E, H]?, "fc2_w": [E, H, O], "fc2_b": [E, O]?}``
               (fc1 is hidden x in like nn.Linear; fc2 is hidden x out, spec §11.1)
    gated_ffn: ``{"gate_w": [E, M, H], "up_w": [E, M, H], "down_w": [E, H, M]}`` applied as x @ W
               (Tutel's llama_ffn, SwiGLU).

A weight may also be a quantized tensor from :mod:`fmoe.quant`; quantized
weights always use the out x in layout [E, N, K] (blocks run along the
reduction axis K, as checkpoints store them) and are multiplied by the fused
low-precision kernel.

Custom experts: pass any ``fn(params, x[E, C, M]) -> [E, C, O]`` as
``ExpertSpec(type="custom", fn=..., init=...)``; ``init(num_experts,
model_dim, spec, generator, dtype)`` returns its parameter pytree.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .ops.grouped import expert_mm

__all__ = ["ExpertSpec", "ffn", "gated_ffn", "apply_experts", "init_experts", "expert_matmul"]

EXPERT_TYPES = ("ffn", "gated_ffn", "custom")


@dataclasses.dataclass(frozen=True)
class ExpertSpec:
    """Static description of the experts (hashable, never traced).

    Attributes:
        type: 'ffn' (fc1, activation, fc2), 'gated_ffn' (SwiGLU) or 'custom'.
        hidden_size: H, hidden units per expert.
        activation: elementwise callable; default ReLU for ffn, SiLU for gated_ffn.
        has_fc1_bias, has_fc2_bias: ffn biases (Tutel defaults: both on).
        output_dim: O (default: model_dim).
        fn, init: the custom expert function and its initialiser.
        exact_rows: :func:`fmoe.moe` multiplies exactly the filled rows of each expert
            buffer (ffn/gated_ffn with float weights): at decode one GEMV per routed row
            and no weight reads for idle experts, about 1.7x faster at 8 tokens x 128
            experts. Outputs then equal the default (padded-GEMM order, bit for bit equal
            to the unpadded forward, e.g. :mod:`fmoe.ablate`) only within float rounding.
    """

    type: str = "ffn"
    hidden_size: int = 0
    activation: Optional[Callable[[Tensor], Tensor]] = None
    has_fc1_bias: bool = True
    has_fc2_bias: bool = True
    output_dim: Optional[int] = None
    fn: Optional[Callable] = None
    init: Optional[Callable] = None
    exact_rows: bool = False

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

    def act(self) -> Callable[[Tensor], Tensor]:
        if self.activation is not None:
            return self.activation
        return F.silu if self.type == "gated_ffn" else F.relu


def _is_quantized(w) -> bool:
    # Anything but a plain tensor in a weight slot must be a fmoe.quant packed tensor;
    # fmoe.quant.expert_matmul validates it.
    return not isinstance(w, Tensor)


def expert_matmul(x: Tensor, w, *, transposed: bool, rows: Optional[Tensor] = None,
                  exact_rows: bool = False) -> Tensor:
    """Per-expert x[e] @ W[e] for float or quantized weights.

    Args:
        x: [E, C, K].
        w: float [E, N, K] if ``transposed`` (out x in) else [E, K, N];
            or a quantized tensor of logical shape [E, N, K].
        rows: optional int64 [E]: multiply only rows [0, min(rows[e], C)) of
            expert e (float weights; other output rows are 0). See
            :mod:`fmoe.ops.grouped`.
        exact_rows: multiply exactly those rows (faster at decode); they then equal
            the padded GEMM within float rounding, not bit for bit
            (:func:`fmoe.ops.grouped.grouped_mm`).
    Returns:
        [E, C, N] in x's dtype.
    """
    if _is_quantized(w):
        from . import quant  # local: the quantized path is optional
        return quant.expert_matmul(x, w)
    w = w.to(x.dtype)
    return expert_mm(x, w, transposed=transposed, rows=rows, exact=exact_rows)


def ffn(params: dict, x: Tensor, *, activation: Callable[[Tensor], Tensor] = F.relu,
        rows: Optional[Tensor] = None, exact_rows: bool = False) -> Tensor:
    """h = act(x W1^T + b1); y = h W2 + b2 for each expert (Tutel 'ffn').

    Args:
        params: ``{"fc1_w": [E, H, M], "fc1_b": [E, H] (optional), "fc2_w": [E, H, O],
            "fc2_b": [E, O] (optional)}``.
        x: [E, C, M].
        rows: optional int64 [E] filled rows per expert (``min(counts, C)``):
            the GEMMs skip the empty rows; the output on rows [0, rows[e]) is
            unchanged, later rows are not meaningful (0 + bias).
        exact_rows: see :func:`expert_matmul`.
    Returns:
        [E, C, O].
    """
    h = expert_matmul(x, params["fc1_w"], transposed=True, rows=rows, exact_rows=exact_rows)
    if params.get("fc1_b") is not None:
        h = h + params["fc1_b"].to(h.dtype).unsqueeze(1)
    h = activation(h)
    w2 = params["fc2_w"]
    # Quantized fc2 is stored out x in ([E, O, H]); float fc2 keeps Tutel's hidden x out.
    y = expert_matmul(h, w2, transposed=_is_quantized(w2), rows=rows, exact_rows=exact_rows)
    if params.get("fc2_b") is not None:
        y = y + params["fc2_b"].to(y.dtype).unsqueeze(1)
    return y


def gated_ffn(params: dict, x: Tensor, *, activation: Callable[[Tensor], Tensor] = F.silu,
              rows: Optional[Tensor] = None, exact_rows: bool = False) -> Tensor:
    """SwiGLU: y = (act(x A) * (x B)) Cm per expert (Tutel 'llama_ffn').

    Args:
        params: ``{"gate_w": [E, M, H], "up_w": [E, M, H], "down_w": [E, H, M]}``
            (quantized weights: [E, H, M], [E, H, M], [E, M, H], out x in).
        x: [E, C, M].
        rows: optional int64 [E] filled rows per expert; see :func:`ffn`.
        exact_rows: see :func:`expert_matmul`.
    Returns:
        [E, C, M_out].
    """
    def mm(inp, w):
        return expert_matmul(inp, w, transposed=_is_quantized(w), rows=rows, exact_rows=exact_rows)

    h = activation(mm(x, params["gate_w"])) * mm(x, params["up_w"])
    return mm(h, params["down_w"])


def apply_experts(spec: ExpertSpec, params, x: Tensor, *, rows: Optional[Tensor] = None,
                  exact_rows: bool = False) -> Tensor:
    """Run the experts described by ``spec`` on buffers x [E, C, M] -> [E, C, O].

    ``rows`` (int64 [E], filled rows per expert) lets ffn/gated_ffn skip empty
    rows; custom experts ignore it. ``exact_rows``: see :func:`expert_matmul`.
    """
    if spec.type == "ffn":
        return ffn(params, x, activation=spec.act(), rows=rows, exact_rows=exact_rows)
    if spec.type == "gated_ffn":
        return gated_ffn(params, x, activation=spec.act(), rows=rows, exact_rows=exact_rows)
    return spec.fn(params, x)


def _uniform(shape, bound: float, generator) -> Tensor:
    return (torch.rand(shape, generator=generator, dtype=torch.float32) * 2 - 1).mul_(bound)


def init_experts(spec: ExpertSpec, num_experts: int, model_dim: int, *, generator=None,
                 dtype=torch.float32) -> dict:
    """Initial parameters for ``num_experts`` experts.

    ffn follows Tutel: W1 ~ U(+-1/sqrt(M)), W2 ~ U(+-1/sqrt(H)), drawn in float32
    expert by expert and then cast; biases zero. gated_ffn: N(0, 0.01).
    """
    E, M, H = num_experts, model_dim, spec.hidden_size
    O = spec.output_dim or model_dim
    if spec.type == "custom":
        return spec.init(num_experts, model_dim, spec, generator, dtype)
    if spec.type == "ffn":
        w1 = torch.stack([_uniform((H, M), 1 / math.sqrt(M), generator) for _ in range(E)])
        w2 = torch.stack([_uniform((H, O), 1 / math.sqrt(H), generator) for _ in range(E)])
        p = {"fc1_w": w1.to(dtype), "fc2_w": w2.to(dtype)}
        if spec.has_fc1_bias:
            p["fc1_b"] = torch.zeros(E, H, dtype=dtype)
        if spec.has_fc2_bias:
            p["fc2_b"] = torch.zeros(E, O, dtype=dtype)
        return p

    def normal(shape):
        return (torch.randn(shape, generator=generator, dtype=torch.float32) * 0.01).to(dtype)

    return {"gate_w": normal((E, M, H)), "up_w": normal((E, M, H)), "down_w": normal((E, H, O))}
