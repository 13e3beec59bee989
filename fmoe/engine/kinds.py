"""The expert kinds on the engine: one autograd Function over the plan, one reference.

Every built-in expert is an in-projection, an elementwise step and an out-projection:

    z   = x[tokens] @ op(W_in[e]) (+ b_in[e])          one weight, or gate and up weights
    h   = hidden(z)                                    relu/gelu/any callable; act(g) * u; GPT-OSS
    y_r = h @ op(W_out[e]) (+ b_out[e])
    y[t] += w_r * y_r   for every kept pair r = (t, e), in ascending expert order

:class:`ExpertForm` says which (static, hashable). :func:`run` is the fast path: the GEMMs are the
kernel table's (:mod:`.table`, rows gathered by the kernel), the rest is a handful of whole-row
torch ops, and no Python runs per expert. The biases are added inside the GEMM calls (each
expert's block while it is in cache). Backward saves only the in-projection's output z (x and
the weights are the caller's) and recomputes h from it; x's and dy's rows are gathered inside
the kernels (no [N, M] or [N, O] copy), and the gate-weight gradient comes from the
out-projection's data gradient, ``<dy, h D + d> = <dy D^T, h> + <dy, d>``, so no [N, O] output
is kept. A user's activation
callable (:attr:`ExpertForm.pure` is False: it may hold dropout, as Tutel's examples do) runs
once, in forward, under autograd, and its graph is kept for backward instead. Double backward
re-runs the reference under autograd (an impure activation is then called again).

:func:`reference` is the oracle: one ``torch.mm`` per expert and plain autograd. The fast path
equals it bit for bit in forward where the kernel's GEMMs equal ``torch.mm`` (the tests pin
which), and within float rounding in backward (the gate-weight gradient's other order).

Orders of the final sum (``order``): 'fmoe' widens bf16/fp16 products to fp32, sums there and
rounds once (:func:`fmoe.combine`'s arithmetic, k terms in expert order); 'eager' is
transformers' eager loop bit for bit (``(y_e * w).to(dt)`` added in dt, one expert at a time);
'grouped' (transformers' grouped_mm order: each row times its gate with torch promotion, the k
slots of a token summed in fp32 in slot order, one cast) on a layout plan and on a rows plan
with packed weights (:func:`packed_rows`), as the layout plan's combine sums it.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from ..ops.memory_order import stored_transposed
from ..ops.orders import COMBINES, combine_in_order
from ..ops.primitives import dispatch_raw
from ..ops.reference import compute_dtype
from .grouped import GroupedGemm
from .plan import ExpertPlan, LayoutPlan
from .table import Kernel, select


FORMS = ("ffn", "glu", "gpt_oss")
PURE_ACTIVATIONS = frozenset({F.relu, F.gelu, F.silu, F.sigmoid, F.tanh, F.softplus, F.elu, F.leaky_relu, F.mish,
                              F.selu, F.hardswish, torch.relu, torch.sigmoid, torch.tanh})
_INPLACE = {F.relu: torch.relu_, torch.relu: torch.relu_, F.silu: lambda t: F.silu(t, inplace=True)}
ORDERS = ("fmoe", "eager")   # a float rows plan's; a layout plan and packed weights also 'grouped' (LAYOUT_ORDERS)
LAYOUT_ORDERS = COMBINES
SAVES = ("projections", "recompute")


@dataclasses.dataclass(frozen=True)
class ExpertForm:
    """How one expert kind multiplies (static).

    Attributes:
        form: 'ffn' (``h = act(z)``), 'glu' (``h = act(g) * u``: gate_w/up_w, or one fused
            in-projection with the gate half first) or 'gpt_oss' (one fused in-projection,
            gate/up in alternate columns, ``h = (clamp(u) + 1) * g' σ(alpha g')``, ``g' = min(g, limit)``).
        in_transposed: in-projection weights are [E, H, M] (out x in) rather than [E, M, H].
        out_transposed: the out-projection is [E, O, H] rather than [E, H, O].
        activation: the elementwise callable of 'ffn' and 'glu'.
        alpha, limit: GPT-OSS's constants.
        int8: packed FP4 weights multiply int8-rounded rows (``ExpertSpec.int8_activations``;
            the fused packed stage only, :func:`fused_stage`).
    """

    form: str
    in_transposed: bool
    out_transposed: bool
    activation: Callable[[Tensor], Tensor] = F.silu
    alpha: float = 1.702
    limit: float = 7.0
    int8: bool = False

    def __post_init__(self):
        if self.form not in FORMS:
            raise ValueError(f"ExpertForm.form must be one of {FORMS}, got {self.form!r}")

    @property
    def pure(self) -> bool:
        """The elementwise step is a known deterministic function, so backward may recompute it
        from z. A user's callable may draw random numbers (Tutel's examples put dropout in the
        activation) or hold state: its autograd graph is kept from forward instead."""
        return self.form == "gpt_oss" or self.activation in PURE_ACTIVATIONS

    def hidden(self, *z: Tensor) -> Tensor:
        """h [N, H] from the in-projection output(s) z ([N, H]; [N, 2H] fused; or gate and up [N, H])."""
        if self.form == "ffn":
            return self.activation(z[0])
        if self.form == "glu":
            g, u = z if len(z) == 2 else z[0].chunk(2, dim=-1)
            return self.activation(g) * u
        # gate and up in alternate columns (unbind, not a strided slice: fake CUDA tensors take it)
        g, u = z[0].unflatten(-1, (-1, 2)).unbind(-1)
        g, u = g.clamp(max=self.limit), u.clamp(min=-self.limit, max=self.limit)
        return (u + 1) * (g * torch.sigmoid(g * self.alpha))

    def hidden_(self, *z: Tensor) -> Tensor:
        """:meth:`hidden` with the same bits, writing over z where the activation has an in-place
        twin (relu, silu): for callers whose z is dead afterwards and outside autograd. A fresh
        [N, H] of a large call is new pages, whose first touch costs about what the activation does."""
        inplace = _INPLACE.get(self.activation)
        if inplace is None or self.form == "gpt_oss":
            return self.hidden(*z)
        if self.form == "ffn":
            return inplace(z[0])
        g, u = z if len(z) == 2 else z[0].chunk(2, dim=-1)
        return inplace(g) * u


def packed_rows(plan: Union[ExpertPlan, LayoutPlan], w_in: tuple, w_out) -> bool:
    """A rows plan with a packed weight (:class:`fmoe.quant.QuantizedTensor`): its experts run
    :func:`reference`'s composition over the packed GEMMs, which also sums in transformers'
    'grouped' order (the autograd Function's float route does not)."""
    return not isinstance(plan, LayoutPlan) and not all(isinstance(w, Tensor) for w in (*w_in, w_out))


_STAGE_ACTS = {F.relu: "relu", torch.relu: "relu", F.silu: "silu"}   # ffn's activations the fused stage runs


def fused_stage(form: ExpertForm, x: Tensor, w_rows: Optional[Tensor], plan: ExpertPlan, w_in: tuple, w_out,
                b_in: Optional[Tensor], b_out: Optional[Tensor]) -> Optional[str]:
    """Whether a packed rows call (:func:`packed_rows`) runs as ONE native call
    (:func:`fmoe.quant.packed.expert_stage`: gather, both GEMMs, the activation and the combine):
    its activation key if so, else None (the composition of :func:`reference` over the packed
    GEMMs). The one place that decides, in two halves: :func:`fused_act` (what the layer's kind
    and weights fix) and :func:`fused_operands_ok` (what each call's tensors make), which a
    prepared inference call (:class:`fmoe.PreparedMoE`) asks once and per call. It takes an
    eager CPU call with every weight packed, a host plan of gathered rows (not expert parallel's
    in-order rows or gate-free rows), no quantized-training recipe, nothing that needs a gradient,
    fp32 or bf16 rows (fp32 gates, or bf16 beside bf16 rows; biases in the rows' dtype), a kind
    whose elementwise step it computes (gpt_oss; glu with SiLU; ffn with ReLU or SiLU), and every
    combine order. Its output equals that composition's bit for bit (tests/test_packed_fused.py)."""
    if plan.bounds is None or plan.in_order or plan.precision is not None or not plan.tokens.is_contiguous():
        return None
    if not fused_operands_ok(x, w_rows, b_in, b_out):
        return None
    return fused_act(form, w_in, w_out)


def fused_act(form: ExpertForm, w_in: tuple, w_out) -> Optional[str]:
    """The half of :func:`fused_stage`'s decision that a layer's kind and weights fix: the
    activation key where the stage computes the kind's elementwise step (gpt_oss with one fused
    in-projection; glu with SiLU; ffn with ReLU or SiLU) and every weight is packed on the CPU with
    the extension built, else None."""
    if form.form == "gpt_oss":
        act = "gpt_oss" if len(w_in) == 1 else None
    elif form.form == "glu":
        act = "glu" if form.activation is F.silu else None
    else:
        act = _STAGE_ACTS.get(form.activation)
    if act is None or any(isinstance(w, Tensor) or w.device.type != "cpu" for w in (*w_in, w_out)):
        return None
    from ..quant import packed   # optional: low-precision weights
    return act if packed.AVAILABLE else None


def fused_operands_ok(x: Tensor, w_rows: Optional[Tensor], b_in: Optional[Tensor], b_out: Optional[Tensor]) -> bool:
    """The half of :func:`fused_stage`'s decision that each call's tensors make: fp32 or bf16 rows
    x [., M] with unit column stride on the CPU, gates w_rows [N] contiguous in fp32 or x's dtype,
    biases None or contiguous in x's dtype, nothing that needs a gradient, no torch.compile."""
    dt = x.dtype
    if ((dt is not torch.float32 and dt is not torch.bfloat16) or x.device.type != "cpu" or x.stride(1) != 1
            or w_rows is None or (w_rows.dtype is not torch.float32 and w_rows.dtype is not dt)
            or not w_rows.is_contiguous()):
        return False
    if any(b is not None and (b.dtype is not dt or not b.is_contiguous()) for b in (b_in, b_out)):
        return False
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, w_rows, b_in, b_out)):
        return False
    return not torch.compiler.is_compiling()


def int8_refusal(why: str) -> str:
    """The error of an ``int8_activations`` call that the fused packed stage does not take."""
    return ("ExpertSpec(int8_activations=True) runs on the fused packed inference stage only: an eager no-grad CPU "
            "call on one process whose expert weights are all packed (MXFP4 / NVFP4), with gates and a built-in "
            f"activation (fmoe.engine.kinds.fused_stage); {why}. Use int8_activations=False for this call")


def run_fused(act: str, form: ExpertForm, x: Tensor, w_rows: Tensor, plan: ExpertPlan, w_in: tuple, w_out,
              b_in: Optional[Tensor], b_out: Optional[Tensor], order: str, *, isa: str = "auto",
              buffers: tuple = ()) -> Tensor:
    """y [T, O] in x's dtype: the packed expert stage in one native call (``act`` from
    :func:`fused_stage`; ``isa`` and ``buffers`` as :func:`fmoe.quant.packed.expert_stage` takes them)."""
    from ..quant import packed   # optional: low-precision weights
    # (the stage reads the pairs and k where the order's combine needs them)
    return packed.expert_stage(x, plan.tokens, plan.offsets, w_rows, w_in, w_out, act=act,
                               activations="int8" if form.int8 else "float", b_in=b_in, b_out=b_out,
                               order=order, pairs=plan.pairs, num_slots=_num_slots(plan), alpha=form.alpha,
                               limit=form.limit, isa=isa, buffers=buffers)


def rows_orders(plan: Union[ExpertPlan, LayoutPlan], w_in: tuple, w_out) -> tuple:
    """The combine orders ``run`` takes for this plan and these weights: every order of
    :data:`LAYOUT_ORDERS` on a layout plan and with packed weights (:func:`packed_rows`),
    :data:`ORDERS` on a rows plan with float weights."""
    return LAYOUT_ORDERS if isinstance(plan, LayoutPlan) or packed_rows(plan, w_in, w_out) else ORDERS


def _check(x: Tensor, w_rows: Optional[Tensor], plan: ExpertPlan, w_in: tuple, w_out: Tensor, order: str) -> None:
    layout = isinstance(plan, LayoutPlan)
    orders = rows_orders(plan, w_in, w_out)
    if order not in orders:
        raise ValueError(f"order must be one of {orders} on a {'layout' if layout else 'rows'} plan"
                         + ("" if layout or orders is LAYOUT_ORDERS else " with float weights")
                         + f", got {order!r}")
    if x.dim() != 2 or x.shape[0] != plan.num_tokens:
        raise ValueError(f"x must be [T, M] with T={plan.num_tokens} (the plan's tokens), got {tuple(x.shape)}")
    if layout:   # the layout kernel casts weights to x's dtype (gates: _gated_routing)
        if w_rows is None:
            raise ValueError("a layout plan combines with the routing's [k, T] gates: w_rows=None is for rows plans")
        return
    if w_rows is None:
        if plan.bounds is None:   # a device plan's dead rows need their gate 0
            raise ValueError("gate weights w_rows=None (every gate 1) need a host plan; a device plan's dead rows "
                             "take gate 0: pass plan.row_weights(routing.weights)")
    elif w_rows.shape != (plan.num_rows,):
        raise ValueError(f"the gate weights must be [N] = [{plan.num_rows}] (one per plan row), got "
                         f"{tuple(w_rows.shape)}")
    for w in (*w_in, w_out):
        shape = tuple(w.shape) if isinstance(w, Tensor) else tuple(w.logical_shape)   # packed: its logical shape
        if len(shape) != 3 or shape[0] != plan.num_experts:
            raise ValueError(f"expert weights must be [E, ., .] with E={plan.num_experts}, got {shape}")
        if isinstance(w, Tensor) and w.dtype != x.dtype:
            raise TypeError(f"expert weights must be in x's dtype {x.dtype}, got {w.dtype}")


def _cast(t: Tensor, dtype: torch.dtype) -> Tensor:
    # t itself where it has the dtype: a cast to its own dtype returns it but is still a
    # dispatched op (tens of microseconds each on a cold decode call)
    return t if t.dtype == dtype else t.to(dtype)


def _weighted(y_r: Tensor, w_rows: Optional[Tensor], dtype: Optional[torch.dtype] = None) -> Tensor:
    # w_r * y_r (None: every gate 1, whose product is y_r itself), in dtype where given
    if dtype is not None:
        y_r, w_rows = _cast(y_r, dtype), (None if w_rows is None else _cast(w_rows, dtype))
    return y_r if w_rows is None else y_r * w_rows.unsqueeze(1)


def _num_slots(plan: ExpertPlan) -> int:
    """k, the slots a token's rows take: the plan's, else read from its pairs (one host sync)."""
    return plan.num_slots or (int(plan.pairs.max()) // plan.num_tokens + 1 if plan.pairs.shape[0] else 1)


def _accumulate(y_r: Tensor, w_rows: Optional[Tensor], plan: ExpertPlan, order: str, dt: torch.dtype) -> Tensor:
    """y [T, O] in dt: ``y[t] += w_r * y_r`` over the rows in plan (ascending expert) order
    (``w_rows`` None: every gate 1)."""
    T, O = plan.num_tokens, y_r.shape[1]
    tokens = plan.tokens
    if order == "grouped":
        # transformers' grouped_mm order (fmoe.ops.orders.grouped_combine): each row times its
        # gate with torch promotion (bf16 x bf16 rounds to bf16), then a token's k terms summed
        # in fp32 in slot order, one cast. Rows sorted by pair index j * T + t run slot by slot,
        # and an fp32 index_add_ adds duplicates in index order.
        acc = compute_dtype(dt)
        by_slot = torch.argsort(plan.pairs)
        y = y_r.new_zeros((T, O), dtype=acc)
        y.index_add_(0, tokens.index_select(0, by_slot),
                     _weighted(y_r, w_rows).index_select(0, by_slot).to(acc))
        return y.to(dt)
    if order == "fmoe":
        acc = compute_dtype(dt)
        y = y_r.new_zeros((T, O), dtype=acc)
        # rows are sorted by expert, and an fp32/fp64 index_add_ adds duplicates in index order
        y.index_add_(0, tokens, _weighted(y_r, w_rows, acc))
        return _cast(y, dt)
    contrib = _weighted(y_r, w_rows).to(dt)
    if dt in (torch.float32, torch.float64):
        return y_r.new_zeros((T, O)).index_add_(0, tokens, contrib)
    # transformers adds expert by expert in dt (a bf16/fp16 index_add_ would sum one call's
    # duplicates in fp32). A token meets each expert once, so its output is the dt running sum of
    # its terms in ascending expert order: each row goes to its rank among its token's rows (the
    # rows are sorted by expert) in a [k, T, O] buffer, and the k slices are added in order. No
    # Python per expert, no host sync where the plan knows k.
    N = tokens.shape[0]
    k = _num_slots(plan)
    by_token = torch.argsort(tokens, stable=True)
    run = tokens.index_select(0, by_token)
    rank = torch.empty_like(tokens).index_copy_(
        0, by_token, torch.arange(N, device=tokens.device) - torch.searchsorted(run, run))
    # (a device plan's dead rows rank after its token's kept rows and add an exact 0)
    buf = y_r.new_zeros((k, T, O), dtype=dt).index_put_((rank, tokens), contrib)
    y, *rest = buf.unbind(0)
    for b in rest:
        y = y + b
    return y


def combine_rows(y_r: Tensor, w_rows: Tensor, plan: ExpertPlan, order: str = "fmoe") -> Tensor:
    """y [T, O] in y_r's dtype: every plan row weighted by its gate and summed into its token, in
    ascending expert order (differentiable; what custom experts on the plan return into)."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    return _accumulate(y_r, w_rows, plan, order, y_r.dtype)


def scatters_output(order: str, dtype: torch.dtype) -> bool:
    """The output projection (and its bias) goes straight into y (the kernel's scatter) rather
    than through an [N, O] buffer: in every order whose roundings the scatter reproduces
    (transformers' bf16/fp16 eager order rounds each term to dt first)."""
    return order == "fmoe" or dtype in (torch.float32, torch.float64)


def _bias_rows(b: Optional[Tensor], expert: Optional[Tensor]) -> Optional[Tensor]:
    return None if b is None else b.index_select(0, expert)


def forward(kern: Kernel, form: ExpertForm, x: Tensor, w_rows: Optional[Tensor], plan: ExpertPlan, w_in: tuple,
            b_in: Optional[Tensor], w_out: Tensor, b_out: Optional[Tensor], order: str, keep_graph: bool = False
            ) -> tuple[Tensor, tuple, Optional[tuple]]:
    """(y [T, O] in x's dtype, z, graph) through the kernel ``kern``; with ``keep_graph`` the
    elementwise step runs under autograd on z and graph is (z, h)."""
    z = _projections(kern, form, x, plan, w_in, b_in)
    graph = None
    if keep_graph:
        with torch.enable_grad():
            h = form.hidden(*(t.requires_grad_() for t in z))
        graph, h = (z, h), h.detach()
    else:
        h = form.hidden(*z)
    dt = x.dtype
    if plan.in_order and w_rows is None and scatters_output(order, dt):
        # each row is its own token, with gate 1: the products are y's rows. The scatter below would
        # add each product to a zero once (0 + v is v, only -0.0 turns +0.0), so no fill and no scatter
        y = kern.mm(h, w_out, plan, transposed=form.out_transposed, bias=b_out)
        return y, z, graph
    if scatters_output(order, dt):
        # straight into y: the same products, roundings and order as _accumulate, no [N, O] buffer
        y = x.new_zeros((plan.num_tokens, w_out.shape[1] if form.out_transposed else w_out.shape[2]),
                        dtype=compute_dtype(dt) if order == "fmoe" else dt)
        kern.scatter(h, w_out, plan, index=plan.tokens, out=y, scale=w_rows, transposed=form.out_transposed,
                     bias=b_out)
        return _cast(y, dt), z, graph
    y_r = kern.mm(h, w_out, plan, transposed=form.out_transposed, bias=b_out)
    return _accumulate(y_r, w_rows, plan, order, dt), z, graph


def reference(form: ExpertForm, x: Tensor, w_rows: Optional[Tensor], plan: ExpertPlan, w_in: tuple,
              b_in: Optional[Tensor], w_out: Tensor, b_out: Optional[Tensor], order: str = "fmoe", *,
              mm: Optional[Callable] = None) -> Tensor:
    """The oracle: per-expert ``torch.mm`` and plain autograd (differentiable to any order).

    Args:
        form: the expert kind.
        x: float [T, M]. w_rows: [N] gate weight of each plan row (None: every gate 1).
        plan: the :class:`~fmoe.engine.ExpertPlan`.
        w_in: one or two in-projection weights, [E, M, H] ([E, H, M] with ``form.in_transposed``).
        b_in: [E, H] or None. w_out: [E, H, O] ([E, O, H] transposed). b_out: [E, O] or None.
        mm: ``mm(rows [N, k], w, transposed) -> [N, n]``, a differentiable per-expert GEMM over the
            plan's rows (default: one ``torch.mm`` per busy expert).
    Returns:
        y [T, O] in x's dtype.
    """
    if mm is None:   # the per-expert loop reads host bounds
        plan, w_rows = _on_host(plan, w_rows)
        mm = _per_expert_mm(plan)
    expert = plan.experts if (b_in is not None or b_out is not None) else None
    x_r = x.index_select(0, plan.tokens)
    z = [mm(x_r, w, form.in_transposed) for w in w_in]
    if b_in is not None:
        z[0] = z[0] + _bias_rows(b_in, expert)
    y_r = mm(form.hidden(*z), w_out, form.out_transposed)
    if b_out is not None:
        y_r = y_r + _bias_rows(b_out, expert)
    return _accumulate(y_r, w_rows, plan, order, x.dtype)


def _takes_device_plan(plan: ExpertPlan, kern: Optional[Kernel], w_in: tuple, w_out) -> bool:
    """Whether the call's GEMMs run a device rows plan as it is (no host sync): no recipe, and
    the float kernel's :attr:`~fmoe.engine.Kernel.static_rows`, or with every weight packed the
    packed kernel's."""
    if plan.precision is not None:
        return False
    if kern is not None:
        return kern.static_rows
    return not any(isinstance(w, Tensor) for w in (*w_in, w_out)) and select(plan, packed=True).static_rows


def _on_host(plan: ExpertPlan, w_rows: Optional[Tensor]) -> tuple[ExpertPlan, Optional[Tensor]]:
    """(plan, w_rows) with host bounds: a device plan's kept rows (its first rows, one host
    sync) and their gate weights, for the consumers that loop over experts in Python."""
    if plan.bounds is not None:
        return plan, w_rows
    plan = plan.on_host()
    return plan, None if w_rows is None else w_rows.narrow(0, 0, plan.num_rows)


def _per_expert_mm(plan: ExpertPlan) -> Callable:
    """One differentiable ``torch.mm`` per busy expert over the plan's rows."""
    b = plan.bounds
    busy = [e for e in range(plan.num_experts) if b[e + 1] > b[e]]

    def mm(a_rows: Tensor, w: Tensor, transposed: bool) -> Tensor:
        parts = [a_rows[b[e]:b[e + 1]] @ (w[e].t() if transposed else w[e]) for e in busy]
        n = w.shape[1] if transposed else w.shape[2]
        return torch.cat(parts) if parts else a_rows.new_zeros((0, n))
    return mm


def _rows_mm(kern: Optional[Kernel], plan: ExpertPlan, generator: Optional[torch.Generator]) -> Callable:
    """:func:`reference`'s ``mm`` for weights the autograd Function does not take: packed
    (:class:`fmoe.quant.QuantizedTensor`, out x in) weights, the table's packed kernel
    (``select(plan, packed=True)``); float weights under the
    plan's quantized-training recipe, :func:`fmoe.quant.training.quantized_mm` over the plan's
    rows (quantize blocks per expert) around the kernel's float GEMMs; other float weights
    (beside packed ones), one ``torch.mm`` per busy expert."""
    def mm(a_rows: Tensor, w, transposed: bool) -> Tensor:
        if not isinstance(w, Tensor):
            return select(plan, packed=True).mm(a_rows, w, plan, transposed=transposed)
        if plan.precision is None:
            return _per_expert_mm(plan)(a_rows, w.to(a_rows.dtype), transposed)
        from ..quant import training as _qt   # optional: quantized training recipes
        return _qt.quantized_mm(a_rows, w, plan.precision, transposed=transposed, generator=generator,
                                offsets=plan.offsets, mm=lambda a, w_, t: kern.mm(a, w_, plan, transposed=t),
                                wgrad=lambda a, b_: kern.wgrad(a, b_, plan))
    return mm


def _rows_of(plan: ExpertPlan, a: Tensor) -> Optional[Tensor]:
    """The kernels' gather index of a's rows: ``plan.tokens``, or None (no copy of the rows) on an
    in-order plan whose a lies as the kernel's gathered copy would: contiguous, each row starting
    on a 64-byte boundary. The GEMMs then take operands of the same shape, strides and alignment,
    hence the same bits."""
    if plan.in_order and a.is_contiguous() and a.data_ptr() % 64 == 0 and a.stride(0) * a.element_size() % 64 == 0:
        return None
    return plan.tokens


def _projections(kern: Kernel, form: ExpertForm, x: Tensor, plan: ExpertPlan, w_in: tuple, b_in,
                 mm_kw: tuple = ()) -> tuple:
    """The in-projections' row products; ``mm_kw``: per projection, more keywords for ``kern.mm``
    (``out=`` / ``regime=`` of a :attr:`Kernel.writes_out` kernel)."""
    rows = _rows_of(plan, x)
    return tuple(kern.mm(x, w, plan, rows=rows, transposed=form.in_transposed, bias=b_in if i == 0 else None,
                         **(mm_kw[i] if mm_kw else {}))
                 for i, w in enumerate(w_in))


_STATIC = 5   # kern, form, plan, order, save: the arguments before the tensors


class _ExpertOp(torch.autograd.Function):
    """:func:`forward` as one autograd node (inputs: x, w_rows, b_in, w_out, b_out, *w_in)."""

    @staticmethod
    def forward(ctx, kern, form, plan, order, save, x, w_rows, b_in, w_out, b_out, *w_in):
        y, z, graph = forward(kern, form, x, w_rows, plan, w_in, b_in, w_out, b_out, order, keep_graph=not form.pure)
        ctx.kern, ctx.form, ctx.plan, ctx.order = kern, form, plan, order
        ctx.graph = graph   # an impure activation's graph, kept whatever ``save`` says
        keep = save == "projections" and graph is None
        ctx.save_for_backward(x, w_rows, b_in, w_out, b_out, *w_in, *(z if keep else ()))
        ctx.n_in = len(w_in)
        return y

    @staticmethod
    def backward(ctx, gy):
        kern, form, plan = ctx.kern, ctx.form, ctx.plan
        saved = ctx.saved_tensors
        x, w_rows, b_in, w_out, b_out = saved[:5]
        w_in, z = saved[5:5 + ctx.n_in], saved[5 + ctx.n_in:]
        need = ctx.needs_input_grad[_STATIC:]
        if torch.is_grad_enabled():   # create_graph: the reference under autograd, differentiable again
            return (None,) * _STATIC + _reference_grads(ctx, gy, need, x, w_rows, b_in, w_out, b_out, w_in)
        graph = ctx.graph
        if graph is None and not z:   # save='recompute': one more in-projection GEMM, no [N, H] kept
            z = _projections(kern, form, x, plan, w_in, b_in)
        return (None,) * _STATIC + _backward(kern, form, plan, gy, need, x, w_rows, b_in, w_out, b_out, w_in, z,
                                             graph)


def _backward(kern: Kernel, form: ExpertForm, plan: ExpertPlan, gy: Tensor, need, x, w_rows, b_in, w_out, b_out,
              w_in, z, graph=None) -> tuple:
    dt, tokens = x.dtype, plan.tokens
    gy = gy.to(dt).contiguous()
    # w_rows None: every gate 1 (expert parallel's received rows), so no product by the gates
    w_col = None if w_rows is None else w_rows.unsqueeze(1)
    expert = plan.experts if b_in is not None or b_out is not None else None
    if graph is None:   # a pure activation: recomputed from z
        zz = tuple(t.detach().requires_grad_() for t in z)
        with torch.enable_grad():
            h = form.hidden(*zz)
    else:
        zz, h = graph
    hd = h.detach()
    # dL/dh without the gate weight: dy[t] D^T (dy's rows gathered by the kernel); it also gives
    # the gate-weight gradient <dy, h D + d> = <dy D^T, h> + <dy, d>
    gy_rows, x_rows = _rows_of(plan, gy), _rows_of(plan, x)
    gh_u = kern.mm(gy, w_out, plan, rows=gy_rows, transposed=not form.out_transposed)
    g_rows = None
    if need[1]:
        acc = compute_dtype(dt)
        g_rows = torch.linalg.vecdot(gh_u.to(acc), hd.to(acc))
        if b_out is not None:   # <dy_t, d_e>: one [T, E] product, read at each row's (token, expert)
            E = b_out.shape[0]
            g_rows = g_rows + (gy.to(acc) @ b_out.to(acc).t()).reshape(-1).index_select(0, tokens * E + expert)
        if plan.dead is not None:   # a device plan's dead rows weigh nothing: no gradient for a dropped pair
            g_rows = g_rows.masked_fill_(plan.dead, 0)
        g_rows = g_rows.to(w_rows.dtype)
    g_out = g_bout = None
    if need[3]:   # the gate weight folded into h: sum over e's rows of (w h)^T dy[t]
        wh = (hd if w_col is None else hd * w_col).to(dt)
        g_out = kern.wgrad(gy, wh, plan, rows=gy_rows) if form.out_transposed else kern.wgrad(wh, gy, plan,
                                                                                               rows_b=gy_rows)
        del wh
    if b_out is not None and need[4]:   # sum over e's rows of w dy[t]: the same kernel, a one-column operand
        col = gy.new_ones((plan.num_rows, 1)) if w_col is None else w_col.to(dt)
        g_bout = kern.wgrad(col, gy, plan, rows_b=gy_rows).squeeze(1).to(b_out.dtype)
    gh = gh_u if w_col is None else gh_u.mul_(w_col)
    need_z = need[0] or need[2] or any(need[5:])
    # a kept graph stays usable for a second backward through a retained outer graph
    gz = torch.autograd.grad(h, zz, gh, retain_graph=graph is not None) if need_z else (None,) * len(zz)
    del h, hd, gh, gh_u, zz   # the [N, H] rows are done with: the peak below is gz and dx
    g_bin = None
    if b_in is not None and need[2]:
        g_bin = torch.zeros_like(b_in).index_add_(0, expert, gz[0].to(b_in.dtype))
    g_in = []
    for i, w in enumerate(w_in):
        if not need[5 + i]:
            g_in.append(None)
        elif form.in_transposed:
            g_in.append(kern.wgrad(gz[i], x, plan, rows_b=x_rows))
        else:
            g_in.append(kern.wgrad(x, gz[i], plan, rows=x_rows))
    gx = None
    if need[0]:
        first = 0
        if plan.in_order:   # each row is its own token: the first product is dx's rows (no fill, no scatter)
            gx, first = kern.mm(gz[0].contiguous(), w_in[0], plan, transposed=not form.in_transposed), 1
        else:
            gx = torch.zeros_like(x)
        for i in range(first, len(w_in)):   # the k terms of a token added in expert order, straight into dx
            kern.scatter(gz[i].contiguous(), w_in[i], plan, index=tokens, out=gx, transposed=not form.in_transposed)
    return (gx, g_rows, g_bin, g_out, g_bout, *g_in)


def _reference_grads(ctx, gy, need, x, w_rows, b_in, w_out, b_out, w_in) -> tuple:
    # Aliases of the saved inputs (not detached copies): the gradients stay connected to them for
    # the next derivative, and each is a partial derivative. With the inputs themselves, a gate
    # weight computed from x would add its path to x's gradient, and autograd adds it again.
    inputs = tuple(None if t is None else t.view_as(t) for t in (x, w_rows, b_in, w_out, b_out, *w_in))
    wanted = [t for t, n in zip(inputs, need) if t is not None and n]
    with torch.enable_grad():
        x, w_rows, b_in, w_out, b_out, *w_in = inputs
        y = reference(ctx.form, x, w_rows, ctx.plan, tuple(w_in), b_in, w_out, b_out, ctx.order)
        grads = iter(torch.autograd.grad(y, wanted, gy, create_graph=True, allow_unused=True))
    return tuple(next(grads) if (t is not None and n) else None for t, n in zip(inputs, need))


def as_stored(form: ExpertForm, w_in: tuple, w_out) -> tuple:
    """(form, w_in, w_out) with every float weight that is a transposed view of contiguous
    storage (``fmoe.nn.MoELayer`` holds gated_ffn weights out x in and hands out x @ W views)
    replaced by that storage and its flag flipped: the kernels multiply the memory as it lies,
    and the weight gradients come out in that order (no copy into the parameters' strides).
    The in-projections flip together or not at all (one flag)."""
    def view(w) -> bool:
        return isinstance(w, Tensor) and w.dim() == 3 and stored_transposed(w)

    in_t, out_t = form.in_transposed, form.out_transposed
    if all(view(w) for w in w_in):
        w_in, in_t = tuple(w.transpose(1, 2) for w in w_in), not in_t
    if view(w_out):
        w_out, out_t = w_out.transpose(1, 2), not out_t
    if (in_t, out_t) != (form.in_transposed, form.out_transposed):
        form = dataclasses.replace(form, in_transposed=in_t, out_transposed=out_t)
    return form, w_in, w_out


def _gated_routing(plan: LayoutPlan, gates: Tensor):
    """A layout plan's routing carrying ``gates`` [k, T] (the caller's, which may differ from the
    routing's own), for the layout plan's dispatch and combine."""
    if tuple(gates.shape) != tuple(plan.routing.weights.shape):
        raise ValueError(f"a layout plan's gate weights are the routing's [k, T] = "
                         f"{list(plan.routing.weights.shape)}, got {tuple(gates.shape)}")
    return plan.routing if gates is plan.routing.weights else dataclasses.replace(plan.routing, weights=gates)


def _through_layout(stage: Callable[[Tensor], Tensor], x: Tensor, gates: Tensor, plan: LayoutPlan, order: str,
                    prescore: bool) -> Tensor:
    """A layout plan's experts: dispatch x [T, M] into the layout's buffers, ``stage(buffers)``,
    combine in ``order``; plain autograd through ops that carry torch.func and compile rules.
    gates: [k, T]."""
    r, lay = _gated_routing(plan, gates), plan.layout
    # the plan's layout was made from this routing (make_plan): fmoe.dispatch's checks hold already
    buf = dispatch_raw(x, lay.positions, gates if prescore else None, lay.num_rows)
    y = stage(buf.reshape(lay.buffer_shape(x.shape[1])))
    return combine_in_order(y, r, lay, order, weighted=not prescore)


def project(mm: Callable, form: ExpertForm, buf: Tensor, w_in: tuple, b_in, w_out, b_out) -> Tensor:
    """``hidden(buf W_in + b_in) W_out + b_out`` per expert over a layout's buffer ([E, C, M] or
    [R, M]) through ``mm(buf, w, transposed=, bias=)`` (a :class:`~fmoe.engine.GroupedGemm`'s):
    a layout plan's expert stage, and :func:`fmoe.experts.apply_form`'s."""
    z = [mm(buf, w, transposed=form.in_transposed, bias=b_in if i == 0 else None) for i, w in enumerate(w_in)]
    return mm(form.hidden(*z), w_out, transposed=form.out_transposed, bias=b_out)


def _matrix_bytes(w) -> int:
    """Bytes of one expert's matrix of ``w`` [E, a, b] (packed weights: as stored): the size by
    which the kernel table's measured choices (:mod:`fmoe.engine.wisdom`) are classed."""
    if isinstance(w, Tensor):
        return w.shape[1] * w.shape[2] * w.element_size()
    return sum(t.numel() * t.element_size() for t in (w.data, w.scales) if isinstance(t, Tensor)) // max(1, w.logical_shape[0])


def run(form: ExpertForm, x: Tensor, w_rows: Optional[Tensor], plan: Union[ExpertPlan, LayoutPlan], w_in: tuple,
        w_out: Tensor, *, b_in: Optional[Tensor] = None, b_out: Optional[Tensor] = None, order: str = "fmoe",
        save: str = "projections", prescore: bool = False, kernel: Optional[Kernel] = None,
        generator: Optional[torch.Generator] = None) -> Tensor:
    """The experts of ``form`` on the plan, summed back to tokens.

    Args:
        form: the expert kind.
        x: float [T, M] tokens. w_rows: ``plan.row_weights(routing.weights)``: [N] gate weight of
            each row of a rows plan, the routing's [k, T] for a layout plan (differentiable); None
            on a host rows plan: every gate 1 (expert parallel's received rows, whose gates act at
            the source rank's combine), with no product by the gates forward or backward.
        plan: :func:`~fmoe.engine.make_plan` of the routing.
        w_in: in-projection weights in x's dtype, one ([E, M, H] or [E, M, 2H] fused) or two
            (gate, up), transposed ([E, H, M]) with ``form.in_transposed``.
        w_out: [E, H, O] ([E, O, H] with ``form.out_transposed``). b_in [E, H|2H], b_out [E, O]: optional.
        order: 'fmoe' or 'eager' (see the module docstring); a layout plan and packed weights
            (:func:`packed_rows`) also 'grouped' (transformers' grouped_mm order,
            :func:`fmoe.ops.orders.grouped_combine`).
        save: what backward keeps of a rows plan's forward: 'projections' (the in-projection
            output z [N, H] / [N, 2H]) or 'recompute' (nothing: one more in-projection GEMM in backward).
        prescore: the gates scale the experts' inputs instead of their outputs (layout plans).
        kernel: the table entry (default :func:`~fmoe.engine.select` of the plan).
        generator: the quantized-training recipe's randomness (``plan.precision``'s stochastic
            rounding and Hadamard signs).
    Returns:
        y [T, O] in x's dtype; tokens with no kept pair are 0.

    A rows plan runs eager mode only (:func:`fmoe.engine.traced.door`): float weights through
    one autograd Function over the table's kernels (a weight given as a transposed view of contiguous
    storage is read as that storage). Packed weights (:class:`fmoe.quant.QuantizedTensor`, any
    projection) run the same composition with the table's packed kernel, one call per
    projection for every busy expert (``select(plan, packed=True)``). With a quantized-training
    recipe (``plan.precision``) every float projection is :func:`fmoe.quant.training.quantized_mm` over the plan's rows
    (quantize blocks per expert, ``offsets=plan.offsets``) around the kernel's float GEMMs,
    composed like :func:`reference` under autograd (``save`` does not apply: each quantized GEMM
    keeps what its recipe saves). A layout plan dispatches, runs its layout's kernel
    (:func:`fmoe.engine.select`) on the buffers and combines. A device rows plan
    (``plan.bounds`` None) runs as it is where the kernel takes it (:attr:`Kernel.static_rows
    <fmoe.engine.table.Kernel>`: the CUDA float and packed entries, no host sync); a recipe,
    packed beside float weights or another kernel take its
    :meth:`~fmoe.engine.ExpertPlan.on_host` (one host sync).
    """
    w_in = tuple(w_in)
    _check(x, w_rows, plan, w_in, w_out, order)
    if save not in SAVES:
        raise ValueError(f"save must be one of {SAVES}, got {save!r}")
    packed = packed_rows(plan, w_in, w_out)
    if form.int8 and (isinstance(plan, LayoutPlan) or not packed):
        raise ValueError(int8_refusal("this call runs on a layout plan (a traced or vmapped call with packed "
                                      "weights, plan='layout' or pre-scored gates)" if isinstance(plan, LayoutPlan) else
                                      "this call's expert weights are float tensors"))
    # packed weights without a recipe take the table's packed kernel per projection (_rows_mm)
    float_gemms = isinstance(plan, LayoutPlan) or plan.precision is not None or not packed
    kern = kernel if kernel is not None or not float_gemms else select(plan, _matrix_bytes(w_out), generator=generator)
    if isinstance(plan, LayoutPlan):
        # each projection one op over every buffer row (padded: Tutel's arithmetic bit for bit)
        mm = GroupedGemm(plan, kern).mm
        return _through_layout(lambda buf: project(mm, form, buf, w_in, b_in, w_out, b_out), x, w_rows, plan, order,
                               prescore)
    if prescore:
        raise ValueError("pre-scored gates (prescore=True) run on a layout plan (make_plan(..., layout=))")
    if plan.bounds is None and not _takes_device_plan(plan, kern, w_in, w_out):
        # recipes, packed beside float weights and the per-expert kernels loop over experts in Python
        plan, w_rows = _on_host(plan, w_rows)
    form, w_in, w_out = as_stored(form, w_in, w_out)
    ts = (x, w_rows, b_in, w_out, b_out, *w_in)
    if plan.precision is None and not packed:
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts):
            return _ExpertOp.apply(kern, form, plan, order, save, *ts)
        return forward(kern, form, x, w_rows, plan, w_in, b_in, w_out, b_out, order)[0]
    act = fused_stage(form, x, w_rows, plan, w_in, w_out, b_in, b_out) if packed else None
    if act is not None:   # the whole packed stage in one native call, the same bits
        return run_fused(act, form, x, w_rows, plan, w_in, w_out, b_in, b_out, order)
    if form.int8:
        raise ValueError(int8_refusal("this call needs a gradient, has expert parallel's rows, float weights beside "
                                      "packed ones or a custom activation"))
    return reference(form, x, w_rows, plan, w_in, b_in, w_out, b_out, order, mm=_rows_mm(kern, plan, generator))


def run_custom(fn: Callable, params, x: Tensor, w_rows: Tensor, plan: Union[ExpertPlan, LayoutPlan], *, order: str = "fmoe",
               prescore: bool = False) -> Tensor:
    """A custom expert on the plan, summed back to tokens: y [T, O] in x's dtype.

    On a rows plan ``fn(params, x [T, M], plan) -> [N, O]`` (one row per plan row; it may
    multiply through :func:`fmoe.engine.grouped_mm`), gate-weighted and summed here in ``order``.
    On a layout plan ``fn(params, buffers) -> buffers`` over the layout's padded [E, C, M]
    buffers (Tutel's custom-expert contract), dispatched and combined in ``order``. A rows plan
    must have host bounds (``fn`` may loop over experts in Python): a device rows plan raises
    ValueError naming ``make_plan(..., device_rows=False)``, which :func:`fmoe.routed_experts` asks for."""
    if isinstance(plan, ExpertPlan):
        if prescore:
            raise ValueError("pre-scored gates (prescore=True) run on a layout plan (make_plan(..., layout=))")
        if plan.bounds is None:
            raise ValueError("run_custom: a custom expert takes a rows plan with host bounds; make it with "
                             "make_plan(..., device_rows=False) or take plan.on_host() (one host sync)")
        y_rows = fn(params, x, plan)
        if not isinstance(y_rows, Tensor) or y_rows.dim() != 2 or y_rows.shape[0] != plan.num_rows:
            raise ValueError(f"a custom expert with takes_plan=True must return [N, O] with N={plan.num_rows} (one "
                             f"row per plan row), got {getattr(y_rows, 'shape', type(y_rows).__name__)}")
        return combine_rows(y_rows, w_rows, plan, order).to(x.dtype)
    if plan.layout.kind != "padded":
        raise ValueError("custom experts take padded buffers [E, C, M]; route them with layout='padded'")
    return _through_layout(lambda buf: fn(params, buf), x, w_rows, plan, order, prescore)
