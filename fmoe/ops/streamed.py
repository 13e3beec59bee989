"""Streamed gated experts: gather, per-expert GEMMs and weighted scatter-add as one autograd node.

    y[t] = sum over kept pairs (t, e):  w_te * (act(x[t] G_e, x[t] U_e) D_e)

with act the SwiGLU ``silu(g) * u`` or GPT-OSS's clamped ``(clamp(u) + 1) * g σ(α g)``, g
clamped above (its in-projection interleaved, both projections with biases).

The staged pipeline (dispatch -> seam -> combine) materialises the dispatched rows [R, M],
the gate and up projections, the hidden state and the expert outputs [R, O], and autograd
keeps most of them until backward. Here each expert's rows are gathered from x straight into
its first GEMM and its output is added straight into y (ScatterMoE's gather-into-GEMM and
GEMM-into-scatter, with torch's own GEMMs): no [R, M] or [R, O] buffer ever exists, and no
padded row is ever multiplied. Backward walks the experts once more (in descending id),
regathers x's rows and needs each expert's gate/up projection z_e [n_e, 2H] back. Where it comes
from is ``save``:

* 'in_grad' (default): forward writes z into the storage of the in-projection weights' gradient
  (E·M·2H elements, z packed at its front in expert order). Backward walks the experts in
  descending id and reads z_e before it writes expert e's gradient slice; slices e' > e, written
  earlier, start at (e+1)·M·2H, so z_e is safe exactly when the experts up to e hold at most
  (e+1)·M rows. Loads that overshoot that by a few rows (balanced loads around M do) get room:
  the storage starts with P·2H elements in front of the gradient, P at most M/4 rows
  (:func:`in_grad_pad`), and the bound becomes P + (e+1)·M (:func:`in_grad_experts`). Those
  experts recompute nothing and need no memory beyond the gradients backward returns (and the P
  rows, which live as long as the gradient does); the others recompute z. When none qualifies,
  or the in-projection needs no gradient, it is 'recompute'; a second backward through the same
  graph (``retain_graph=True``) recomputes too.
* 'recompute': z is recomputed from the regathered rows (one more GEMM pair per expert).
* 'separate': z is saved in its own [N, 2H] buffer (N kept pairs).

The gate-weight gradient needs no saved expert output: with ``y_e = h_e D_e``,
``dL/dw = <dy, y_e> = <dy D_eᵀ, h_e>``, and ``dy D_eᵀ`` is the down GEMM's data gradient,
which backward computes anyway.

Two accumulation orders, both over experts in ascending id:

* 'fmoe' — contributions ``w * y_e`` formed and summed in the accumulation dtype (fp32 for
  bf16/fp16), one cast at the end: :func:`fmoe.combine`'s arithmetic with the k terms of a
  token added in expert order instead of slot order (equal within float rounding).
* 'eager' — transformers' eager expert loop bit for bit: ``(y_e * w)`` with torch promotion,
  cast to the compute dtype, ``index_add_`` into the output in that dtype.

Eager mode only: the row counts drive a Python loop (one host sync per call), so under
torch.func transforms and torch.compile the caller runs the staged pipeline instead
(:func:`applies`). Double backward (``create_graph=True``) runs a differentiable per-expert
re-computation of the same forward, so grad-of-grad stays available.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._C import _functorch
from torch.autograd import forward_ad as _fwd_ad

from .. import _slots
from ..layout import Layout, ragged_layout
from . import ragged as _ragged
from . import tuning
from .primitives import PLAIN_TENSORS
from .reference import compute_dtype

__all__ = ["ORDERS", "ACTIVATIONS", "SAVES", "IN_GRAD_PAD_DIV", "in_grad_pad", "in_grad_experts", "ExpertRows", "GluSpec", "expert_rows", "routing_rows", "streamed_glu", "applies", "small_path"]

ORDERS = ("fmoe", "eager")
ACTIVATIONS = ("silu", "gpt_oss")
SAVES = ("in_grad", "recompute", "separate")


@dataclasses.dataclass(frozen=True, eq=False)
class ExpertRows:
    """Kept (token, expert) pairs sorted by expert (the ragged layout's order), host bounds.

    Attributes:
        tokens: int64 [N]. Token of each kept pair.
        pairs: int64 [N]. Flat pair index ``j * T + t`` (gathers its gate weight).
        bounds: E + 1 host ints; expert e owns rows ``bounds[e] .. bounds[e + 1]``.
        dropped: int64 [] tensor, the routing's valid pairs lost to capacity, where known
            (:func:`routing_rows` counts them; a layout cannot tell them from masked pairs).
    """

    tokens: Tensor
    pairs: Tensor
    bounds: tuple
    dropped: Optional[Tensor] = None

    @property
    def num_experts(self) -> int:
        return len(self.bounds) - 1


def expert_rows(layout: Layout) -> ExpertRows:
    """The kept pairs of a ragged layout (:func:`fmoe.layout.ragged_layout`), sorted by expert.

    One host sync (the group sizes). Raises ValueError for a padded layout: its rows are
    not contiguous per expert."""
    if layout.kind != "ragged":
        raise ValueError("expert_rows needs the ragged layout (fmoe.make_layout(routing, 'ragged'))")
    sizes = layout.sizes.tolist()
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    pos = layout.positions.reshape(-1)
    kept = torch.nonzero(pos >= 0).squeeze(1)
    # Kept ragged positions are exactly 0 .. N-1, one pair each: a scatter inverts the map.
    pairs = torch.empty(bounds[-1], dtype=torch.int64, device=pos.device)
    pairs.index_copy_(0, pos.index_select(0, kept), kept)
    T = layout.positions.shape[1]
    return ExpertRows(pairs.remainder(T), pairs, tuple(bounds))


def routing_rows(routing) -> ExpertRows:
    """``expert_rows(ragged_layout(routing))`` without building the layout, and the number
    of pairs lost to capacity.

    On CPU one numba walk over the pairs (:func:`fmoe._slots.kept_rows_walk`) replaces the
    layout's and the inversion's two dozen small ops, about 0.15-0.3 ms of a decode call
    (T 16, E 32-64, 2026-12-02); elsewhere it is the layout. Raises ValueError for a routing
    whose counts disagree with its slots (a hand-made one; :func:`fmoe.make_routing`'s agree).
    """
    ids = routing.expert_ids
    if ids.device.type != "cpu":
        return _routing_rows_torch(routing)
    k, T = ids.shape
    E = routing.num_experts
    out, pairs = torch.empty(E + 2 + k * T, dtype=torch.int64), torch.empty(k * T, dtype=torch.int64)
    a = _slots.int64_array
    N = _slots.kept_rows_walk(a(ids), a(routing.slots), a(routing.counts), routing.capacity, out.numpy(), pairs.numpy())
    if N < 0:
        raise ValueError(f"routing_rows: the routing's counts disagree with its slots: {_slots.KEPT_ROWS_ERRORS[N]}")
    return ExpertRows(out[E + 2:E + 2 + N], pairs[:N], tuple(out[:E + 1].tolist()), out[E + 1])


def _routing_rows_torch(routing) -> ExpertRows:
    """:func:`routing_rows` in torch ops, through the ragged layout (off CPU; the reference)."""
    return dataclasses.replace(expert_rows(ragged_layout(routing)), dropped=routing.num_dropped())


@dataclasses.dataclass(frozen=True)
class GluSpec:
    """Static description of a gated expert: its weights' GEMM forms and its activation.

    Attributes:
        fused_in: the gate and up projections are one weight [.., 2H] (else two).
        in_transposed: in-projection weights are [E, N, M] (out x in, nn.Linear) rather
            than [E, M, N].
        out_transposed: the down projection is [E, O, H] rather than [E, H, O].
        interleaved: a fused in-projection holds gate/up in alternate columns (GPT-OSS)
            instead of gate half first.
        activation: 'silu' (``silu(g) * u``) or 'gpt_oss'
            (``(clamp(u, -limit, limit) + 1) * g' σ(alpha g')``, ``g' = min(g, limit)``).
        alpha, limit: the GPT-OSS constants.
    """

    fused_in: bool
    in_transposed: bool
    out_transposed: bool
    interleaved: bool = False
    activation: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"GluSpec.activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.interleaved and not self.fused_in:
            raise ValueError("GluSpec: interleaved gate/up columns need fused_in=True")


def applies(*ts: Optional[Tensor]) -> bool:
    """True where the streamed op can run: eager mode (no torch.func transform, no
    torch.compile, no forward-AD level), plain CPU or CUDA tensors without
    ``__torch_function__`` overrides."""
    if torch.compiler.is_compiling() or _functorch.maybe_current_level() is not None:
        return False
    if _fwd_ad._current_level >= 0:
        return False
    present = [t for t in ts if t is not None]
    if any(type(t) not in PLAIN_TENSORS for t in present):
        return False
    return not torch.overrides.has_torch_function(tuple(present))


def _op(w: Tensor, transposed: bool) -> Tensor:
    """op(w) [E, K, N] of a weight held [E, N, K] (transposed) or [E, K, N]."""
    return w.transpose(1, 2) if transposed else w


def small_path(pairs: int, order: str, dtype: torch.dtype) -> bool:
    """Inference with this many kept pairs runs :func:`_forward_small` (elementwise steps once
    over all rows, GEMMs as one call per projection where :func:`small_gemm` has one).
    transformers' eager order in bf16/fp16 keeps the per-expert loop: one bf16 index_add_ sums
    a call's duplicates in fp32, and a bf16 activation over all rows splits its threads
    elsewhere."""
    return pairs <= tuning.STREAMED_SMALL_PAIRS and (order == "fmoe" or dtype in (torch.float32, torch.float64))


def _mm(a: Tensor, w: Tensor, transposed: bool, out: Optional[Tensor] = None) -> Tensor:
    """a @ w (w [K, N]) or a @ wᵀ (w [N, K])."""
    return torch.mm(a, w.t() if transposed else w, out=out)


def _wgrad(a: Tensor, g: Tensor, transposed: bool, out: Tensor) -> None:
    """Gradient of ``a @ op(w)`` w.r.t. w, written into ``out``: aᵀ g ([K, N]) or gᵀ a ([N, K])."""
    if transposed:
        torch.mm(g.t(), a, out=out)
    else:
        torch.mm(a.t(), g, out=out)


def _split(z: Tensor, fmt: GluSpec, H: int) -> tuple[Tensor, Tensor]:
    """(gate, up) views of a fused projection z [n, 2H]."""
    if fmt.interleaved:
        return z[:, 0::2], z[:, 1::2]
    return z[:, :H], z[:, H:]


def _hidden(x_e: Tensor, w_in, b_in, e: int, fmt: GluSpec, H: int,
            out: Optional[tuple] = None) -> tuple[Tensor, Tensor]:
    """(gate, up) pre-activations [n, H] of the rows x_e [n, M] of expert e (bias added after
    the GEMM, as ``x @ A + a`` does)."""
    if fmt.fused_in:
        z = _mm(x_e, w_in[0][e], fmt.in_transposed, None if out is None else out[0])
        if b_in is not None:
            z.add_(b_in[e])
        return _split(z, fmt, H)
    return (_mm(x_e, w_in[0][e], fmt.in_transposed, None if out is None else out[0]),
            _mm(x_e, w_in[1][e], fmt.in_transposed, None if out is None else out[1]))


def _act(g: Tensor, u: Tensor, fmt: GluSpec, ws: Optional["_Scratch"] = None) -> Tensor:
    """The gated activation h [n, H] (differentiable without ``ws``), in the experts' own op
    order (transformers' GPT-OSS: ``(u' + 1) * (g' * sigmoid(g' * alpha))``); with ``ws``
    written into its "h" rows, GPT-OSS's clamped copies in its "gc" / "uc" rows (g and u may be
    saved projections), by in-place steps that round exactly as the out-of-place ones."""
    if ws is None:
        if fmt.activation == "silu":
            return F.silu(g).mul_(u)   # SiluBackward keeps g, not its output: in place is safe
        g, u = g.clamp(max=fmt.limit), u.clamp(min=-fmt.limit, max=fmt.limit)
        return (u + 1) * (g * torch.sigmoid(g * fmt.alpha))
    n, H = g.shape
    out = ws.take("h", n, H)
    if fmt.activation == "silu":
        return torch.ops.aten.silu.out(g, out=out).mul_(u)
    L = fmt.limit
    g = torch.clamp(g, max=L, out=ws.take("gc", n, H))
    u = torch.clamp(u, min=-L, max=L, out=ws.take("uc", n, H))
    return torch.mul(g, fmt.alpha, out=out).sigmoid_().mul_(g).mul_(u.add_(1))


def _act_parts(g: Tensor, u: Tensor, fmt: GluSpec, ws: "_Scratch") -> tuple[tuple, Tensor]:
    """(parts, h): h = act(g, u) [n, H] and what :func:`_act_backward` reuses, all in ``ws``:
    (silu(g),) for SwiGLU; (α·g', g' σ(α g'), u' + 1, u outside ±limit, g above the limit) for
    GPT-OSS (g' and u' clamped)."""
    n, H = g.shape
    if fmt.activation == "silu":
        sg = torch.ops.aten.silu.out(g, out=ws.take("sg", n, H))
        return (sg,), torch.mul(sg, u, out=ws.take("h", n, H))
    L = fmt.limit
    gc = torch.clamp(g, max=L, out=ws.take("gc", n, H))
    a = torch.mul(gc, fmt.alpha, out=ws.take("a", n, H))
    glu = torch.sigmoid(a, out=ws.take("glu", n, H)).mul_(gc)
    uc = torch.clamp(u, min=-L, max=L, out=ws.take("uc", n, H))
    outside = torch.ne(uc, u, out=ws.take("outside", n, H, torch.bool))   # NaN counts as outside
    above = torch.gt(g, L, out=ws.take("above", n, H, torch.bool))
    h = torch.mul(uc.add_(1), glu, out=ws.take("h", n, H))
    return (a, glu, uc, outside, above), h


class _Scratch:
    """Row buffers shared by every expert of one call: ``take(name, n, cols)`` is the [n, cols]
    front of one [max_rows, cols] buffer per name. The per-expert temporaries then cost one
    allocation per call, not one per expert: freed per-expert blocks under 1 MiB stayed in
    the allocator's heap, 17 MiB of them at the end of a dropless backward, which was the
    step's peak (2026-12-01). A name's buffer is valid until the next ``take`` of that name."""

    def __init__(self, max_rows: int, like: Tensor):
        self.max_rows, self.dtype, self.device = max_rows, like.dtype, like.device
        self.bufs: dict = {}

    def take(self, name: str, n: int, cols: int, dtype: Optional[torch.dtype] = None) -> Tensor:
        buf = self.bufs.get(name)
        if buf is None:
            buf = self.bufs[name] = torch.empty((self.max_rows, cols), dtype=dtype or self.dtype, device=self.device)
        elif buf.shape[1] != cols:
            raise RuntimeError(f"_Scratch: {name!r} holds {buf.shape[1]} columns, asked for {cols}")
        return buf[:n]


def _max_rows(bounds) -> int:
    return max((bounds[e + 1] - bounds[e] for e in range(len(bounds) - 1)), default=0)


def _widen(t: Tensor, dtype: torch.dtype, ws: Optional[_Scratch], name: str) -> Tensor:
    """t [n, c] in ``dtype``: t itself, or its exact copy in ``ws``'s buffer ``name`` (a fresh
    [n, c] per expert otherwise: the bf16/fp16 paths' widenings)."""
    if t.dtype == dtype:
        return t
    if ws is None:
        return t.to(dtype)
    return ws.take(name, *t.shape, dtype).copy_(t)


def _act_backward(g: Tensor, u: Tensor, gh: Tensor, fmt: GluSpec, out: tuple, parts: tuple, ws: "_Scratch") -> None:
    """dL/dg and dL/du written into ``out`` = (dg [n, H], du [n, H]) views, from gh = dL/dh
    (consumed) and the ``parts`` of :func:`_act_parts`. Both activations end in ATen's fused
    ``silu_backward`` (one vectorised pass): for GPT-OSS, ``d (g σ(α g)) / dg = silu'(α g)``."""
    dg, du = out
    if fmt.activation == "silu":
        (sg,) = parts
        torch.mul(gh, sg, out=du)                                      # d h / d u = silu(g)
        torch.ops.aten.silu_backward.grad_input(gh.mul_(u), g, grad_input=dg)
        return
    # GPT-OSS's g and u, dg and du are alternate columns: strided, so elementwise kernels run
    # unvectorised on them. Everything is computed in contiguous [n, H] buffers and only the
    # results are copied into the interleaved halves.
    a, glu, uc1, outside, above = parts
    t = torch.mul(gh, glu, out=ws.take("dact", *gh.shape)).masked_fill_(outside, 0)   # clamp passes
    du.copy_(t)                                                        # the gradient inside [-L, L]
    torch.ops.aten.silu_backward.grad_input(gh.mul_(uc1), a, grad_input=t)
    dg.copy_(t.masked_fill_(above, 0))


def _hidden_size(w_in: tuple, fmt: GluSpec) -> int:
    n = w_in[0].shape[1] if fmt.in_transposed else w_in[0].shape[2]
    return n // 2 if fmt.fused_in else n


def _out_dim(w_out: Tensor, fmt: GluSpec) -> int:
    return w_out.shape[1] if fmt.out_transposed else w_out.shape[2]


def _gate_column(w_rows: Tensor, y: Tensor, order: str) -> Tensor:
    """The gate weights [N, 1] as :func:`_accumulate` multiplies them (y's dtype for 'fmoe')."""
    w = w_rows.unsqueeze(1)
    return w.to(y.dtype) if order == "fmoe" else w


def _accumulate(y: Tensor, tok: Tensor, y_e: Tensor, w_e: Tensor, order: str,
                ws: Optional["_Scratch"] = None) -> None:
    """y[tok] += w_e * y_e in ``order``'s arithmetic (y is the accumulator, w_e [n, 1] from
    :func:`_gate_column`); y_e is overwritten. ``ws``: where a bf16/fp16 'fmoe' product is
    widened to y's dtype (one buffer per call instead of a fresh [n, O] per expert)."""
    if order == "fmoe":
        y.index_add_(0, tok, _widen(y_e, y.dtype, ws, "y_wide").mul_(w_e))
    else:  # transformers' eager: promotion, one cast, dt running sum
        # in place: the product is formed in the promoted dtype and rounded once to dt on
        # store, as ``(y_e * w_e).to(dt)`` rounds it, without a fresh [n, O] tensor per expert
        # (page faults: ~130 us per expert at prefill, T 2048, E 32, O 768, 2026-12-02)
        y.index_add_(0, tok, y_e.mul_(w_e))


def _forward(x, w_rows, rows: ExpertRows, w_out, b_in, b_out, w_in, fmt: GluSpec, order: str,
             saved: Optional[tuple], keep: Optional[list] = None):
    """y [T, O]; with ``saved``, expert e's projections are written into its rows of it where
    ``keep[e]``."""
    T = x.shape[0]
    H, O = _hidden_size(w_in, fmt), _out_dim(w_out, fmt)
    dt = x.dtype
    y = torch.zeros(T, O, dtype=compute_dtype(dt) if order == "fmoe" else dt, device=x.device)
    b = rows.bounds
    busy = [e for e in range(rows.num_experts) if b[e] < b[e + 1]]
    if saved is None and small_path(b[-1], order, dt):
        _forward_small(x, w_rows, rows, w_out, b_in, b_out, w_in, fmt, order, busy, H, O, y)
        return y.to(dt)
    win = [w.unbind(0) for w in w_in]
    wout_f = _op(w_out, fmt.out_transposed).unbind(0)   # op(D_e), made once
    w_col = _gate_column(w_rows, y, order)
    ws = _Scratch(_max_rows(b), x)
    for e in busy:
        r0, r1 = b[e], b[e + 1]
        n = r1 - r0
        tok = rows.tokens[r0:r1]
        x_e = torch.index_select(x, 0, tok, out=ws.take("x", n, x.shape[1]))
        if saved is not None and keep[e]:
            out = tuple(s[r0:r1] for s in saved)
        else:
            out = (ws.take("z", n, 2 * H),) if fmt.fused_in else (ws.take("g", n, H), ws.take("u", n, H))
        g, u = _hidden(x_e, win, b_in, e, fmt, H, out)
        y_e = torch.mm(_act(g, u, fmt, ws), wout_f[e], out=ws.take("y", n, O))
        if b_out is not None:
            y_e.add_(b_out[e])
        _accumulate(y, tok, y_e, w_col[r0:r1], order, ws)
    return y.to(dt)


_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _grouped_layout_ok(t: Tensor) -> bool:
    """t passes torch._grouped_mm's layout check (ATen's GroupedMMUtils.h): one of its last two
    strides is 1 and the other spans that dimension in a multiple of 16 bytes; off the CPU its
    data is 16-byte aligned too. (fp32 rows of 6 columns, 24 bytes, fail it.)"""
    s, n = t.stride(), t.shape
    align = 16 // t.element_size()
    if t.device.type != "cpu" and t.data_ptr() % 16:
        return False
    if s[-2] == 1 and s[-1] >= max(1, n[-2]):
        return s[-1] % align == 0
    if s[-1] == 1 and s[-2] >= max(1, n[-1]):
        return s[-2] % align == 0
    return False


def _grouped_ok(x_r: Tensor, H: int, *ws: Tensor) -> bool:
    """torch._grouped_mm (one call over every expert; equal to the per-expert mm, bit for bit
    on the shapes tests/test_streamed.py checks) takes the rows x_r [N, M], contiguous hidden
    rows [N, H] and the weights ``ws`` as passed to it (op(w) views)."""
    ts = (x_r, *ws)
    return (hasattr(torch, "_grouped_mm") and all(t.dtype in _GROUPED_DTYPES for t in ts)
            and all(_grouped_layout_ok(t) for t in ts) and H * x_r.element_size() % 16 == 0)


def _numba_small(x_r: Tensor) -> bool:
    """The small path multiplies and activates through the numba kernels."""
    return tuning.NUMBA_SMALL_GEMMS and x_r.device.type == "cpu" and x_r.dtype in (torch.float32, torch.float64)


def small_gemm(x_r: Tensor, H: int, fmt: GluSpec, bounds: list, w_out: Tensor, w_in: tuple):
    """How the small path multiplies all its rows by each projection at once: a function
    ``gemm(a, w, transposed)`` -> [N, cols] over the rows sorted by expert, or None (a
    ``torch.mm`` per expert). Where MKL's few-row GEMMs are slow (``tuning.NUMBA_SMALL_GEMMS``)
    the ragged kernels (:func:`fmoe.ops.ragged.grouped_rows`: few-row experts in one numba
    call); else one ``torch._grouped_mm`` per projection where its layout rule takes the
    operands (:func:`_grouped_ok`)."""
    if _numba_small(x_r):
        return lambda a, w, transposed: _ragged.grouped_rows(a, w, bounds, transposed)
    if _grouped_ok(x_r, H, _op(w_out, fmt.out_transposed), *(_op(w, fmt.in_transposed) for w in w_in)):
        offs = torch.tensor(bounds[1:], dtype=torch.int32, device=x_r.device)
        return lambda a, w, transposed: torch._grouped_mm(a, _op(w, transposed), offs=offs)
    return None


def _forward_small(x, w_rows, rows: ExpertRows, w_out, b_in, b_out, w_in, fmt: GluSpec, order: str, busy, H, O,
                   y) -> None:
    b, N = rows.bounds, rows.bounds[-1]
    x_r = x.index_select(0, rows.tokens)
    gemm = small_gemm(x_r, H, fmt, b, w_out, w_in)
    if gemm is not None:
        # One call per projection: no per-expert launches or parallel regions (decode: -7..14%
        # against the loop below on T 16/64, E 64, k 6, 2026-12-01).
        expert = None    # expert id per row, for the biases
        if b_in is not None or b_out is not None:
            sizes = torch.tensor([b[e + 1] - b[e] for e in range(len(b) - 1)], device=x.device)
            expert = torch.repeat_interleave(torch.arange(len(b) - 1, device=x.device), sizes, output_size=N)
        parts = tuple(gemm(x_r, w, fmt.in_transposed) for w in w_in)
        if b_in is not None:
            parts[0].add_(b_in.index_select(0, expert))
        g, u = _split(parts[0], fmt, H) if fmt.fused_in else parts
        if _numba_small(x_r):
            h = _ragged.glu_rows(g, u, None if fmt.activation == "silu" else (fmt.alpha, fmt.limit))
        else:
            h = _act(g, u, fmt)
        # contiguous [N, H] rows are what _grouped_ok checked (the activation's output already is)
        y_r = gemm(h.contiguous(), w_out, fmt.out_transposed)
        if b_out is not None:
            y_r.add_(b_out.index_select(0, expert))
    else:
        win, wout = [w.unbind(0) for w in w_in], w_out.unbind(0)
        parts = (x.new_empty((N, 2 * H)),) if fmt.fused_in else (x.new_empty((N, H)), x.new_empty((N, H)))
        y_r = x.new_empty((N, O))
        for e in busy:
            r0, r1 = b[e], b[e + 1]
            _hidden(x_r[r0:r1], win, b_in, e, fmt, H, tuple(p[r0:r1] for p in parts))
        g, u = _split(parts[0], fmt, H) if fmt.fused_in else parts
        h = _act(g, u, fmt)
        for e in busy:
            r0, r1 = b[e], b[e + 1]
            _mm(h[r0:r1], wout[e], fmt.out_transposed, y_r[r0:r1])
            if b_out is not None:
                y_r[r0:r1].add_(b_out[e])
    # rows are sorted by expert, and a float32/64 index_add_ adds duplicates in index order
    _accumulate(y, rows.tokens, y_r, _gate_column(w_rows, y, order), order)


_STATIC = 4  # rows, fmt, order, save: the non-tensor arguments between the tensors and w_in
_FIRST_IN = 5 + _STATIC


# The room in front of the in-projection gradients (below) is at most M // IN_GRAD_PAD_DIV rows:
# at most 1/(IN_GRAD_PAD_DIV·E) more memory than the gradients, held as long as they are. A
# random walk of E experts' loads around M, the usual 'in_grad' overflow, needs about
# sqrt(E·M) rows (coarse bench config, E 8, M 512: 23); heavier imbalance recomputes instead.
IN_GRAD_PAD_DIV = 4


def in_grad_pad(bounds, model_dim: int) -> int:
    """Rows of room in front of the in-projection gradients' storage that let the experts'
    projections wait there (see 'in_grad'): the largest ``bounds[e+1] - (e+1)·M`` over
    experts with rows, clipped to [0, M // IN_GRAD_PAD_DIV].

    Args:
        bounds: E + 1 row offsets. model_dim: M.
    """
    over = max((bounds[e + 1] - (e + 1) * model_dim for e in range(len(bounds) - 1)
                if bounds[e] < bounds[e + 1]), default=0)
    return min(max(over, 0), model_dim // IN_GRAD_PAD_DIV)


def in_grad_experts(bounds, model_dim: int, pad: int = 0) -> list:
    """Per expert, whether its projections can wait in the in-projection gradient's storage
    (see 'in_grad'): it has rows, and the experts up to it hold at most pad + (e+1)·M rows.

    Args:
        bounds: E + 1 row offsets. model_dim: M. pad: rows of room in front of the gradient
            (:func:`in_grad_pad`).
    """
    return [bounds[e] < bounds[e + 1] <= pad + (e + 1) * model_dim for e in range(len(bounds) - 1)]


def _in_grad_stores(w_in: tuple, pad_rows: int, cols: int, like: Tensor) -> tuple[tuple, tuple]:
    """(storages, gradients): per in-projection weight, one flat buffer of ``pad_rows·cols``
    elements of room followed by that weight's gradient, and the gradient as a view of it."""
    bases = tuple(torch.empty(pad_rows * cols + w.numel(), dtype=like.dtype, device=like.device) for w in w_in)
    grads = tuple(b[pad_rows * cols:].view(w.shape) for b, w in zip(bases, w_in))
    return bases, grads


def _projection_views(bases: tuple, N: int, fmt: GluSpec, H: int) -> tuple:
    """[N, 2H] (fused) or two [N, H] views packed at the front of each store (at most
    pad + E·M rows)."""
    cols = 2 * H if fmt.fused_in else H
    # Rows past the store belong only to experts that recompute (in_grad_experts): no view.
    n = min(N, bases[0].numel() // cols)
    return tuple(b[:n * cols].view(n, cols) for b in bases)


class _StreamedGlu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_rows, w_out, b_in, b_out, rows, fmt, order, save, *w_in):
        N, H = rows.bounds[-1], _hidden_size(w_in, fmt)
        keep = [True] * rows.num_experts    # experts whose projections backward reads back
        if save == "in_grad":
            pad = in_grad_pad(rows.bounds, x.shape[1])
            keep = in_grad_experts(rows.bounds, x.shape[1], pad)
            if not (all(ctx.needs_input_grad[_FIRST_IN:]) and any(keep)):
                save = "recompute"
        stores, grads = (), ()   # what holds the projections (the future gradients' storage, or a
        if save == "in_grad":    # separate buffer), and the gradients as views of it
            stores, grads = _in_grad_stores(w_in, pad, 2 * H if fmt.fused_in else H, x)
            saved = _projection_views(stores, N, fmt, H)
        elif save == "separate":
            shapes = [(N, 2 * H)] if fmt.fused_in else [(N, H), (N, H)]
            stores = saved = tuple(torch.empty(s, dtype=x.dtype, device=x.device) for s in shapes)
        else:
            saved = None
        y = _forward(x, w_rows, rows, w_out, b_in, b_out, w_in, fmt, order, saved, keep)
        ctx.rows, ctx.fmt, ctx.order, ctx.save, ctx.keep = rows, fmt, order, save, keep
        ctx.n_in = len(w_in)
        # Internal buffers, not inputs: kept on ctx (save_for_backward's version check would
        # refuse them once the first backward has written gradients into them).
        ctx.stores, ctx.grads = stores, grads
        ctx.save_for_backward(x, w_rows, w_out, b_in, b_out, *w_in)
        return y

    @staticmethod
    def backward(ctx, gy):
        x, w_rows, w_out, b_in, b_out, *w_in = ctx.saved_tensors
        w_in, stores = tuple(w_in), ctx.stores
        need = ctx.needs_input_grad
        if torch.is_grad_enabled():  # create_graph=True: differentiable re-computation
            return _double_backward(ctx, gy, x, w_rows, w_out, b_in, b_out, w_in)
        N, H = ctx.rows.bounds[-1], _hidden_size(w_in, ctx.fmt)
        saved, grad_bufs = None, None
        if ctx.save == "in_grad":
            # The first backward overwrites the projections with the gradients it returns; a
            # second one through a retained graph recomputes them into fresh buffers.
            saved, grad_bufs = _projection_views(stores, N, ctx.fmt, H), ctx.grads
            ctx.save, ctx.stores, ctx.grads = "recompute", (), ()
        elif ctx.save == "separate":
            saved = stores
        grads = _backward(gy, x, w_rows, w_out, b_in, b_out, w_in, saved, ctx.rows, ctx.fmt, ctx.order,
                          need=(need[0], need[1], need[2], need[3], need[4], any(need[_FIRST_IN:])),
                          grad_bufs=grad_bufs, keep=ctx.keep)
        gx, gw_rows, gw_out, gb_in, gb_out, gw_in = grads
        return (gx, gw_rows, gw_out, gb_in, gb_out, *(None,) * _STATIC,
                *(gw_in if gw_in is not None else (None,) * ctx.n_in))


def _weight_grad(w: Tensor, idle: list) -> Tensor:
    # Busy experts' slices are written whole by their GEMMs; only idle ones need zeros.
    g = torch.empty_like(w, memory_format=torch.contiguous_format)
    if idle:
        g[idle] = 0
    return g


def _backward(gy, x, w_rows, w_out, b_in, b_out, w_in, saved, rows: ExpertRows, fmt: GluSpec, order: str, *,
              need: tuple, grad_bufs: Optional[tuple] = None, keep: Optional[list] = None):
    """All input gradients, experts in descending id. ``grad_bufs``: the in-projection gradients'
    buffers that also hold ``saved`` ('in_grad'): expert e's slice is written only after its
    projections are read, and idle slices are zeroed in turn, never up front. ``keep[e]``:
    expert e's projections are in ``saved`` (else recomputed)."""
    need_x, need_w, need_out, need_b_in, need_b_out, need_in = need
    dt = x.dtype
    H = _hidden_size(w_in, fmt)
    gy = gy.to(dt)
    gx = torch.zeros(x.shape, dtype=compute_dtype(dt), device=x.device) if need_x else None
    gw_rows = torch.empty_like(w_rows) if need_w else None
    b = rows.bounds
    idle = [e for e in range(rows.num_experts) if b[e] == b[e + 1]]
    gw_out = _weight_grad(w_out, idle) if need_out else None
    if grad_bufs is not None:
        gw_in = grad_bufs
    else:
        gw_in = tuple(_weight_grad(w, idle) for w in w_in) if need_in else None
    gb_in = torch.zeros_like(b_in) if need_b_in else None
    gb_out = torch.zeros_like(b_out) if need_b_out else None
    # Per-expert views made once per call (a Python-level call per expert and use adds up at
    # E 32-64): op(w)ᵀ for the data gradients, and the gradients' expert slices.
    win = [w.unbind(0) for w in w_in]
    win_T = [(w if fmt.in_transposed else w.transpose(1, 2)).unbind(0) for w in w_in]
    wout_T = (w_out if fmt.out_transposed else w_out.transpose(1, 2)).unbind(0)
    gw_out_e = gw_out.unbind(0) if need_out else None
    gw_in_e = [g.unbind(0) for g in gw_in] if need_in else None
    # The product y_e * w is formed in p (transformers' promotion, or fmoe's fp32 accumulation).
    p = torch.promote_types(dt, w_rows.dtype)
    if order == "fmoe":
        p = torch.promote_types(p, compute_dtype(dt))
    w_dt_all = w_rows.unsqueeze(1).to(p).to(dt)        # [N, 1] gate weights as the products use them
    plain = p == dt == w_rows.dtype and b_out is None  # the gate-weight gradient needs no casts
    M, O = x.shape[1], gy.shape[1]
    ws = _Scratch(_max_rows(b), x)
    for e in reversed(range(rows.num_experts)):
        r0, r1 = b[e], b[e + 1]
        if r0 == r1:
            if grad_bufs is not None:
                for gw in gw_in:
                    gw[e] = 0
            continue
        n = r1 - r0
        tok = rows.tokens[r0:r1]
        x_e = torch.index_select(x, 0, tok, out=ws.take("x", n, M))
        if saved is None or not keep[e]:
            out = (ws.take("z", n, 2 * H),) if fmt.fused_in else (ws.take("g", n, H), ws.take("u", n, H))
            g, u = _hidden(x_e, win, b_in, e, fmt, H, out)
        else:
            g, u = _split(saved[0][r0:r1], fmt, H) if fmt.fused_in else (saved[0][r0:r1], saved[1][r0:r1])
        gy_e = torch.index_select(gy, 0, tok, out=ws.take("gy", n, O))   # [n, O]
        w_dt = w_dt_all[r0:r1]
        # Down projection first: gy_e and h are done with before the [n, 2H] gradient d is formed.
        parts, h = _act_parts(g, u, fmt, ws)                           # recomputed, elementwise
        gh = torch.mm(gy_e, wout_T[e], out=ws.take("gh", n, H))       # dy D_eᵀ, unscaled
        if need_w:   # <dy, y_e> = <dy D_eᵀ, h> (+ <dy, d_e>): no saved expert output
            if plain:
                torch.linalg.vecdot(gh, h, out=gw_rows[r0:r1])
            else:
                dw = torch.linalg.vecdot(_widen(gh, p, ws, "gh_wide"), _widen(h, p, ws, "h_wide"))
                if b_out is not None:
                    dw += gy_e.to(p) @ b_out[e].to(p)
                gw_rows[r0:r1] = dw.to(w_rows.dtype)
        if need_b_out:
            gb_out[e] = (gy_e.to(p) * w_dt.to(p)).sum(0).to(gb_out.dtype)
        if need_out:
            _wgrad(h.mul_(w_dt), gy_e, fmt.out_transposed, gw_out_e[e])  # h is not needed after this
        d = ws.take("d", n, 2 * H)                                     # [dL/dg, dL/du] (fused layout)
        dg, du = _split(d, fmt, H) if fmt.fused_in else (d[:, :H], d[:, H:])
        _act_backward(g, u, gh.mul_(w_dt), fmt, (dg, du), parts, ws)
        if need_b_in:
            gb_in[e] = d.sum(0).to(gb_in.dtype)
        if fmt.fused_in:
            if need_in:
                _wgrad(x_e, d, fmt.in_transposed, gw_in_e[0][e])
            if need_x:
                gx_e = torch.mm(d, win_T[0][e], out=ws.take("gx", n, M))
        else:
            if need_in:
                _wgrad(x_e, dg, fmt.in_transposed, gw_in_e[0][e])
                _wgrad(x_e, du, fmt.in_transposed, gw_in_e[1][e])
            if need_x:
                gx_e = torch.mm(dg, win_T[0][e], out=ws.take("gx", n, M)).addmm_(du, win_T[1][e])
        if need_x:
            gx.index_add_(0, tok, _widen(gx_e, gx.dtype, ws, "gx_wide"))
    return (None if gx is None else gx.to(dt)), gw_rows, gw_out, gb_in, gb_out, gw_in


def _reference(x, w_rows, rows: ExpertRows, w_out, b_in, b_out, w_in, fmt: GluSpec, order: str) -> Tensor:
    """The same forward from differentiable out-of-place ops (the double-backward graph)."""
    dt = x.dtype
    H, O = _hidden_size(w_in, fmt), _out_dim(w_out, fmt)
    acc_dt = compute_dtype(dt) if order == "fmoe" else dt
    y = x.new_zeros((x.shape[0], O), dtype=acc_dt)
    b = rows.bounds
    for e in range(rows.num_experts):
        r0, r1 = b[e], b[e + 1]
        if r0 == r1:
            continue
        tok = rows.tokens[r0:r1]
        x_e = x.index_select(0, tok)
        if fmt.fused_in:
            z = _mm(x_e, w_in[0][e], fmt.in_transposed)
            g, u = _split(z if b_in is None else z + b_in[e], fmt, H)
        else:
            g, u = _mm(x_e, w_in[0][e], fmt.in_transposed), _mm(x_e, w_in[1][e], fmt.in_transposed)
        y_e = _mm(_act(g, u, fmt), w_out[e], fmt.out_transposed)
        if b_out is not None:
            y_e = y_e + b_out[e]
        w_e = w_rows[r0:r1].unsqueeze(1)
        contrib = y_e.to(acc_dt) * w_e.to(acc_dt) if order == "fmoe" else (y_e * w_e).to(dt)
        y = y.index_add(0, tok, contrib)
    return y.to(dt)


def _double_backward(ctx, gy, x, w_rows, w_out, b_in, b_out, w_in):
    inputs = (x, w_rows, w_out, b_in, b_out, *w_in)
    with torch.enable_grad():
        y = _reference(x, w_rows, ctx.rows, w_out, b_in, b_out, w_in, ctx.fmt, ctx.order)
    need = ctx.needs_input_grad
    want = [i for i, t in enumerate(inputs)
            if t is not None and t.requires_grad and need[i if i < 5 else i + _STATIC]]
    grads = torch.autograd.grad(y, [inputs[i] for i in want], gy, create_graph=True, allow_unused=True)
    out = [None] * len(inputs)
    for i, g in zip(want, grads):
        out[i] = g
    return (*out[:5], *(None,) * _STATIC, *out[5:])


def streamed_glu(x: Tensor, w_rows: Tensor, rows: ExpertRows, w_in: tuple, w_out: Tensor, fmt: GluSpec, *,
                 b_in: Optional[Tensor] = None, b_out: Optional[Tensor] = None, order: str = "fmoe",
                 save: str = "in_grad") -> Tensor:
    """Gated experts over kept pairs, from tokens to tokens in one pass per expert.

    Args:
        x: float [T, M] tokens (the experts' compute dtype).
        w_rows: float [N] gate weight of each kept pair, in ``rows`` order (any float dtype;
            differentiable: its gradient is the gate-weight gradient).
        rows: :func:`expert_rows` of the routing's ragged layout.
        w_in: ``(W_gu,)`` fused ([E, 2H, M] if ``fmt.in_transposed`` else [E, M, 2H]; gate
            half first, or alternate columns if ``fmt.interleaved``) or ``(W_gate, W_up)``
            ([E, H, M] / [E, M, H] each).
        w_out: [E, O, H] if ``fmt.out_transposed`` else [E, H, O].
        fmt: :class:`GluSpec`.
        b_in: [E, 2H] bias of a fused in-projection (GPT-OSS), or None.
        b_out: [E, O] bias of the down projection, or None.
        order: 'fmoe' or 'eager' (see the module docstring).
        save: where backward gets the gate/up projections: 'in_grad' (inside the
            in-projection gradient's buffer; no extra memory, no recompute; falls back to
            'recompute' for experts whose loads do not fit), 'recompute' or 'separate' ([N, 2H] in x's
            dtype). See the module docstring.

    Returns:
        [T, O] in x's dtype; a token without kept pairs gets 0.
    """
    if order not in ORDERS:
        raise ValueError(f"streamed_glu: order must be one of {ORDERS}, got {order!r}")
    if save not in SAVES:
        raise ValueError(f"streamed_glu: save must be one of {SAVES}, got {save!r}")
    if x.dim() != 2:
        raise ValueError(f"streamed_glu: x must be [T, M], got shape {tuple(x.shape)}")
    if len(w_in) != (1 if fmt.fused_in else 2):
        raise ValueError(f"streamed_glu: fused_in={fmt.fused_in} takes {1 if fmt.fused_in else 2} in-projection "
                         f"weights, got {len(w_in)}")
    N = rows.bounds[-1]
    if w_rows.shape != (N,) or rows.tokens.shape != (N,):
        raise ValueError(f"streamed_glu: {N} kept pairs, but w_rows {tuple(w_rows.shape)} and tokens "
                         f"{tuple(rows.tokens.shape)}")
    E = rows.num_experts
    for w in (*w_in, w_out):
        if w.dim() != 3 or w.shape[0] != E:
            raise ValueError(f"streamed_glu: expert weights must be [E={E}, ., .], got {tuple(w.shape)}")
    H, O = _hidden_size(w_in, fmt), _out_dim(w_out, fmt)
    if b_in is not None and (not fmt.fused_in or tuple(b_in.shape) != (E, 2 * H)):
        raise ValueError(f"streamed_glu: b_in must be [E, 2H] = [{E}, {2 * H}] with a fused in-projection, got "
                         f"{tuple(b_in.shape)}")
    if b_out is not None and tuple(b_out.shape) != (E, O):
        raise ValueError(f"streamed_glu: b_out must be [E, O] = [{E}, {O}], got {tuple(b_out.shape)}")
    cast = lambda t: None if t is None else t.to(x.dtype)  # noqa: E731
    w_in = tuple(cast(w) for w in w_in)
    w_out, b_in, b_out = cast(w_out), cast(b_in), cast(b_out)
    tensors = (x, w_rows, w_out, b_in, b_out, *w_in)
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)):
        return _forward(x, w_rows, rows, w_out, b_in, b_out, w_in, fmt, order, None)   # inference: nothing saved
    return _StreamedGlu.apply(x, w_rows, w_out, b_in, b_out, rows, fmt, order, save, *w_in)
