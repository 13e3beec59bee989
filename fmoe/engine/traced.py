"""The rows plan under torch.compile and torch.func: the engine's expert op as one
``torch.library`` custom op; and :func:`door`, the one place that decides which door of the
engine a call takes.

    y = traced.run(form, x, routing, w_in, w_out, b_in=b_in, b_out=b_out, order="fmoe", save="projections")

A compiled graph cannot hold the rows plan's host row counts, so the plan is built inside the op
(one numba walk over the routing's tensors, as in eager mode; off the CPU the device rows plan,
no host sync, :func:`fmoe.engine.plan.device_plan`) and the op runs the same kernels
as :func:`fmoe.engine.kinds.run`: eager and compiled calls make the same GEMM calls on the same
rows. The op's shapes are static: y [T, O], and the saved in-projection outputs padded to the
bound of k*T rows (:func:`torch.library.register_fake`), so ``torch.compile(fullgraph=True)``
captures it with no graph break and no host sync in the graph. Its backward is a second custom op
over the same kernels (:func:`fmoe.engine.kinds` ``_backward``), registered with
:func:`torch.library.register_autograd`. Under ``vmap`` the batch folds into one call
(:func:`torch.library.register_vmap`): batched tokens and batched experts become more tokens and
more experts, and each (token, expert) pair that any batch element keeps is multiplied once, so
a sweep of gate settings over one x shares the pairs its settings agree on. A training call under
vmap (per-example gradients) folds into more tokens over the same shared experts, no weight
copied, and its backward takes each element's weight gradients over its own rows of each expert.

What it takes: built-in kinds with float weights whose activation is a known pure function
(:data:`ACTIVATIONS`, or GPT-OSS), no quantized-training recipe, combine 'fmoe' or 'eager', gates
on the outputs; compiled outside any torch.func transform, or in eager mode under vmap and grad
levels (forward-mode AD keeps the layout plan's staged kernel, whose ops carry jvp rules);
:func:`applies` says which.
"""
from __future__ import annotations

import contextlib
import ctypes
import sys
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._C import _functorch
from torch._functorch import pyfunctorch as _pyfunctorch
from torch.autograd import forward_ad as _fwd_ad

from ..ops.primitives import PLAIN_TENSORS
from ..routing import Routing
from . import kinds
from .kinds import ExpertForm
from .plan import device_plan, device_rows_by_default, kept_rows, plan_from_bounds
from .table import Kernel, select


ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
               "softplus": F.softplus, "elu": F.elu, "leaky_relu": F.leaky_relu, "mish": F.mish, "selu": F.selu,
               "hardswish": F.hardswish}
_NAMES = {**{fn: name for name, fn in ACTIVATIONS.items()}, torch.relu: "relu", F.sigmoid: "sigmoid",
          F.tanh: "tanh"}


def _activation_name(form: ExpertForm) -> Optional[str]:
    return "" if form.form == "gpt_oss" else _NAMES.get(form.activation)


def _functorch_reaches() -> bool:
    """The custom op carries this call's torch.func transforms: vmap levels and at most one grad
    level (vjp, jacrev, grad); not forward-mode AD (jvp, jacfwd), functionalize, or a second
    derivative (its backward is first order; the layout plan's ops are closed under
    differentiation)."""
    if _fwd_ad._current_level >= 0:
        return False
    TT = torch._C._functorch.TransformType
    keys = [i.key() for i in _pyfunctorch.retrieve_all_functorch_interpreters()]
    return all(k in (TT.Vmap, TT.Grad) for k in keys) and keys.count(TT.Grad) <= 1


def data_shapes() -> bool:
    """Shapes may follow the data here (a host sync is allowed): not compiling, and no vmap level
    (grad and jvp levels run eagerly)."""
    if torch.compiler.is_compiling():
        return False
    TT = torch._C._functorch.TransformType
    return all(i.key() != TT.Vmap for i in _pyfunctorch.retrieve_all_functorch_interpreters())


def applies(form: ExpertForm, w: tuple, precision, order: str) -> bool:
    """True where the call runs the experts through the custom op: under torch.compile outside
    any torch.func transform, or in eager mode under vmap / grad levels only; float weights, no
    recipe, a known activation, order 'fmoe'/'eager'."""
    # _are_functorch_transforms_active: the functorch check dynamo folds to a constant
    if torch.compiler.is_compiling():
        if torch._C._are_functorch_transforms_active():
            return False
    elif not (torch._C._are_functorch_transforms_active() and _functorch_reaches()) or \
            torch.overrides.has_torch_function(tuple(t for t in w if isinstance(t, Tensor))):
        return False
    return (precision is None and order in kinds.ORDERS and _activation_name(form) is not None
            and all(t is None or isinstance(t, Tensor) for t in w))


def _form(form: str, in_t: bool, out_t: bool, act: str, alpha: float, limit: float) -> ExpertForm:
    return ExpertForm(form, in_t, out_t, activation=ACTIVATIONS.get(act, F.silu), alpha=alpha, limit=limit)


def _plan(expert_ids: Tensor, slots: Tensor, counts: Tensor, capacity: int, T: int, train: bool, dtype,
          host: bool = False):
    """The op's rows plan: off the CPU, where the table's grouped kernel runs the call, a device
    plan (no host sync inside the op); else host bounds (the CPU's numba walk). ``host``: host
    bounds everywhere (per-element weight gradients split rows at host bounds)."""
    if not host and device_rows_by_default(expert_ids.device, dtype, None):
        return device_plan(expert_ids, slots, counts.shape[0], capacity, needs_grad=train, dtype=dtype)
    tokens, pairs, bounds, dropped = kept_rows(expert_ids, slots, counts, capacity)
    # k known here: the fused stage's bf16 'eager' combine need not find it from the pairs (a host sync)
    return plan_from_bounds(tokens, pairs, bounds, T, needs_grad=train, dtype=dtype, dropped=dropped,
                            num_slots=expert_ids.shape[0])


@contextlib.contextmanager
def _local_autograd():
    """Autograd back on inside a custom op's kernel (which runs below the autograd keys), for a
    local graph on plain tensors that never leaves the op."""
    DK = torch._C.DispatchKey
    include, exclude = torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set()
    with torch._C._ForceDispatchKeyGuard(include.remove(DK.ADInplaceOrView), exclude.remove(DK.AutogradFunctionality)):
        yield


def _stored(f: ExpertForm, w_in: list, w_out: Tensor) -> tuple:
    """kinds.as_stored, and which weights it flipped (their gradients flip back)."""
    g, w_in2, w_out2 = kinds.as_stored(f, tuple(w_in), w_out)
    return g, w_in2, w_out2, g.in_transposed != f.in_transposed, g.out_transposed != f.out_transposed


@torch.library.custom_op("fmoe::expert_rows", mutates_args=())
def _expert_rows(x: Tensor, gates: Tensor, expert_ids: Tensor, slots: Tensor, counts: Tensor, capacity: int,
                 w_in: list[Tensor], w_out: Tensor, b_in: Optional[Tensor], b_out: Optional[Tensor], form: str,
                 in_t: bool, out_t: bool, act: str, alpha: float, limit: float, order: str, train: bool,
                 keep: bool) -> list[Tensor]:
    """[y [T, O], *z] where z are the in-projection outputs padded to k*T rows (when ``keep``)."""
    f, w_in, w_out, _, _ = _stored(_form(form, in_t, out_t, act, alpha, limit), w_in, w_out)
    plan = _plan(expert_ids, slots, counts, capacity, x.shape[0], train, x.dtype)
    kern = select(plan, kinds._matrix_bytes(w_out))
    w_rows = plan.row_weights(gates)
    y, z, _ = kinds.forward(kern, f, x, w_rows, plan, w_in, b_in, w_out, b_out, order)
    if not keep:
        return [y]
    rows = expert_ids.numel()   # dropless keeps every pair: z is already k*T rows, no copy
    return [y, *(t if t.shape[0] == rows else torch.cat([t, t.new_zeros(rows - t.shape[0], t.shape[1])]) for t in z)]


@_expert_rows.register_fake
def _(x, gates, expert_ids, slots, counts, capacity, w_in, w_out, b_in, b_out, form, in_t, out_t, act, alpha, limit,
      order, train, keep):
    y = x.new_empty((x.shape[0], w_out.shape[1] if out_t else w_out.shape[2]))
    if not keep:
        return [y]
    return [y, *(x.new_empty((expert_ids.numel(), w.shape[1] if in_t else w.shape[2])) for w in w_in)]


@torch.library.custom_op("fmoe::expert_rows_backward", mutates_args=())
def _expert_rows_backward(gy: Tensor, x: Tensor, gates: Tensor, expert_ids: Tensor, slots: Tensor, counts: Tensor,
                          capacity: int, w_in: list[Tensor], w_out: Tensor, b_in: Optional[Tensor],
                          b_out: Optional[Tensor], z: list[Tensor], form: str, in_t: bool, out_t: bool, act: str,
                          alpha: float, limit: float, order: str, need: list[bool], groups: int = 1) -> list[Tensor]:
    """[gx, g_gates, g_bin, g_out, g_bout, *g_in]; an input whose gradient is not needed gets an
    empty tensor. ``groups`` > 1: x's tokens are that many elements' (T / groups each) whose rows
    come element by element within each expert (:class:`_Merge`), and the weight and bias
    gradients are per (expert, element): [E * groups, ...], expert-major."""
    f, w_in, w_out, flip_in, flip_out = _stored(_form(form, in_t, out_t, act, alpha, limit), w_in, w_out)
    plan = _plan(expert_ids, slots, counts, capacity, x.shape[0], True, x.dtype, host=groups > 1)
    kern = select(plan, kinds._matrix_bytes(w_out))
    w_rows = plan.row_weights(gates)
    N = plan.num_rows
    zz = tuple(t[:N] for t in z) if z else kinds._projections(kern, f, x, plan, w_in, b_in)
    if groups > 1:
        kern, plan, b_in, b_out = _per_element(kern, plan, groups, b_in, b_out)
    with _local_autograd():   # the activation's derivative: a local graph over z's rows
        gx, g_rows, g_bin, g_out, g_bout, *g_in = kinds._backward(kern, f, plan, gy, tuple(need), x, w_rows, b_in,
                                                                 w_out, b_out, w_in, zz)
    g_gates = None
    if g_rows is not None:
        g_gates = gates.new_zeros(gates.numel()).index_copy_(0, plan.pairs, g_rows).view_as(gates)
    if g_out is not None and flip_out:
        g_out = g_out.transpose(1, 2)
    g_in = [g.transpose(1, 2) if g is not None and flip_in else g for g in g_in]
    return [x.new_empty(0) if g is None else g for g in (gx, g_gates, g_bin, g_out, g_bout, *g_in)]


@_expert_rows_backward.register_fake
def _(gy, x, gates, expert_ids, slots, counts, capacity, w_in, w_out, b_in, b_out, z, form, in_t, out_t, act, alpha,
      limit, order, need, groups=1):
    # the real op's weight gradients come out in the stored orientation and flip back as views
    # (the strides the compiled graph is checked against)
    _, _, _, flip_in, flip_out = _stored(_form(form, in_t, out_t, act, alpha, limit), w_in, w_out)
    like = (x, gates, b_in, w_out, b_out, *w_in)
    flips = (False, False, False, flip_out, False, *(flip_in for _ in w_in))

    def grad_like(t: Tensor, flip: bool) -> Tensor:
        shape = (t.shape[0] * groups, *t.shape[1:])
        return t.new_empty((shape[0], shape[2], shape[1])).transpose(1, 2) if flip else t.new_empty(shape)

    return [x.new_empty(0) if not n or t is None else torch.empty_like(t) if i < 2 else grad_like(t, flip)
            for i, (t, n, flip) in enumerate(zip(like, need, flips))]


def _per_element(kern: Kernel, plan, groups: int, b_in: Optional[Tensor], b_out: Optional[Tensor]) -> tuple:
    """(kernel, plan, b_in, b_out) for a backward whose weight gradients are per (expert,
    element): the plan's rows split at element bounds within each expert (group e * groups + b;
    rows already come element by element there), a kernel whose GEMMs and scatters run over the
    experts' rows (shared weights, read once) and whose wgrads run over the groups, and the
    biases repeated per group (their gradients are the groups'; the gate gradient reads row r's
    own expert's bias through its group)."""
    T_elem = plan.num_tokens // groups
    group = plan.experts * groups + torch.div(plan.tokens, T_elem, rounding_mode="floor")
    if group.numel() > 1 and bool((group[1:] < group[:-1]).any()):
        raise ValueError("expert_rows_backward with groups > 1 takes rows that come element by element within "
                         "each expert (traced._Merge's routing)")
    counts = torch.bincount(group, minlength=plan.num_experts * groups)
    fine = plan_from_bounds(plan.tokens, plan.pairs, [0, *counts.cumsum(0).tolist()], plan.num_tokens,
                            needs_grad=True, dtype=plan.dtype)
    base = kern
    kern = Kernel(base.name, base.why,
                  lambda a, w, _, **kw: base.mm(a, w, plan, **kw),
                  lambda a, b, _, **kw: base.wgrad(a, b, fine, **kw),
                  lambda a, w, _, **kw: base.scatter(a, w, plan, **kw))
    rep = [None if b is None else b.repeat_interleave(groups, dim=0) for b in (b_in, b_out)]
    return kern, fine, *rep


def _save(ctx, need: list, x, gates, ids, slots, counts, capacity, w_in, w_out, b_in, b_out, statics, z) -> None:
    ctx.statics = (capacity, *statics)
    ctx.n_in = len(w_in)
    ctx.need = need
    ctx.save_for_backward(x, gates, ids, slots, counts, w_out, b_in, b_out, *w_in, *z)


def _grads(ctx, gy: Tensor) -> tuple:
    """(gx, g_gates, g_bin, g_out, g_bout, g_in list), None where not needed."""
    capacity, form, in_t, out_t, act, alpha, limit, order = ctx.statics
    saved = ctx.saved_tensors
    x, gates, ids, slots, counts, w_out, b_in, b_out = saved[:8]
    w_in, z = list(saved[8:8 + ctx.n_in]), list(saved[8 + ctx.n_in:])
    g = torch.ops.fmoe.expert_rows_backward(gy.contiguous(), x, gates, ids, slots, counts, capacity, w_in, w_out,
                                            b_in, b_out, z, form, in_t, out_t, act, alpha, limit, order, ctx.need)
    gx, g_gates, g_bin, g_out, g_bout, *g_in = (t if n else None for t, n in zip(g, ctx.need))
    return gx, g_gates, g_bin, g_out, g_bout, g_in


def _setup(ctx, inputs, output):
    (x, gates, ids, slots, counts, capacity, w_in, w_out, b_in, b_out, form, in_t, out_t, act, alpha, limit, order,
     train, keep) = inputs
    need = [x.requires_grad, gates.requires_grad, b_in is not None and b_in.requires_grad, w_out.requires_grad,
            b_out is not None and b_out.requires_grad, *(w.requires_grad for w in w_in)]
    _save(ctx, need, x, gates, ids, slots, counts, capacity, w_in, w_out, b_in, b_out,
          (form, in_t, out_t, act, alpha, limit, order), output[1:])


def _backward(ctx, grads):
    gx, g_gates, g_bin, g_out, g_bout, g_in = _grads(ctx, grads[0])
    return (gx, g_gates, None, None, None, None, g_in, g_out, g_bin, g_bout) + (None,) * 9


torch.library.register_autograd("fmoe::expert_rows", _backward, setup_context=_setup)


class _ExpertRows(torch.autograd.Function):
    """The op behind an ``autograd.Function`` front for torch.func: in torch 2.13 ``grad``,
    ``vjp`` and ``jacrev`` refuse a custom op's registered autograd (its generated Function has
    no ``setup_context``). The in-projection weights come last and one by one (a Function
    differentiates tensor arguments only, not a list); vmap runs the op's own rule."""
    generate_vmap_rule = True

    @staticmethod
    def forward(x, gates, ids, slots, counts, capacity, w_out, b_in, b_out, statics, train, keep, *w_in):
        return tuple(torch.ops.fmoe.expert_rows(x, gates, ids, slots, counts, capacity, list(w_in), w_out, b_in,
                                                b_out, *statics, train, keep))

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, gates, ids, slots, counts, capacity, w_out, b_in, b_out, statics, train, keep, *w_in = inputs
        _save(ctx, [], x, gates, ids, slots, counts, capacity, w_in, w_out, b_in, b_out, statics, output[1:])
        ctx.mark_non_differentiable(*output[1:])
        # z (non-differentiable) takes no gradient: autograd would otherwise fill a zero [k*T, H] for
        # each; backward runs only when y has one, so gy is never None
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, gy, *_):
        n = ctx.needs_input_grad
        ctx.need = [n[0], n[1], n[7], n[6], n[8], *n[12:]]
        # first order only (the door sends nested grad levels to the layout plan): functorch
        # runs every backward with create_graph, and the backward op has no autograd of its own
        with torch.no_grad():
            gx, g_gates, g_bin, g_out, g_bout, g_in = _grads(ctx, gy)
        return (gx, g_gates, None, None, None, None, g_out, g_bin, g_bout, None, None, None, *g_in)


# --------------------------------------------------------------------------- vmap

def _take(a, d, b: int):
    """Batch element b of one op argument (a list argument has a dim per element)."""
    if isinstance(a, (list, tuple)):
        return [_take(t, dt, b) for t, dt in zip(a, d)]
    return a if d is None or a is None else a.select(d, b)


def _loop(op, info, in_dims, args) -> tuple:
    """The op once per batch element, outputs stacked on dim 0 (the rule where rows cannot be
    shared: saved in-projection outputs in each element's own row order, and the backward)."""
    outs = [op(*(_take(a, d, b) for a, d in zip(args, in_dims))) for b in range(info.batch_size)]
    return [torch.stack(ts) for ts in zip(*outs)], [0] * len(outs[0])


def _batched(t: Tensor, d: Optional[int], B: int) -> Tensor:
    return t.movedim(d, 0) if d is not None else t.unsqueeze(0).expand(B, *t.shape)


def _fold_experts(t: Optional[Tensor], d: Optional[int], B: int) -> Optional[Tensor]:
    """An expert weight or bias [E, ...] (batched at d, or shared) as B*E experts [B*E, ...]:
    element b's expert e is b*E + e (a shared one is copied B times)."""
    if t is None:
        return None
    bt = _batched(t, d, B)
    return bt.reshape(bt.shape[0] * bt.shape[1], *bt.shape[2:])


def _expert_rows_vmap(info, in_dims, x, gates, expert_ids, slots, counts, capacity, w_in, w_out, b_in, b_out, form,
                      in_t, out_t, act, alpha, limit, order, train, keep):
    """vmap's rule: the batch folded into one call. Tokens of a batched x and experts of batched
    weights become B*T tokens and B*E experts; every (token, expert) pair kept by any element
    is multiplied once (a sweep of gate settings over the same x and weights shares the pairs
    its settings agree on), then each element sums its own pairs with its own gates, k terms in
    ascending expert order (:func:`_shared_pairs`). With saved projections (``keep``: a gradient
    will be taken) the batch folds into B*T tokens without sharing pairs (:func:`_fold`: shared
    weights stay E experts whose rows come element by element, batched ones become B*E
    experts), and the backward folds alike. bf16/fp16 (whose
    per-row roundings the shared rows' combine does not reproduce) run once per element."""
    args = (x, gates, expert_ids, slots, counts, capacity, w_in, w_out, b_in, b_out, form, in_t, out_t, act, alpha,
            limit, order, train, keep)
    if x.dtype not in (torch.float32, torch.float64):
        return _loop(torch.ops.fmoe.expert_rows, info, in_dims, args)
    B = info.batch_size
    if keep:   # training: one call over B*T tokens, whose backward folds the same way
        f = _fold(B, in_dims[:10], x, gates, expert_ids, slots, counts, capacity, w_in, w_out, b_in, b_out)
        y, *z = torch.ops.fmoe.expert_rows(f.x, f.gates, f.ids, f.slots, f.counts, f.capacity, f.w_in, f.w_out,
                                           f.b_in, f.b_out, form, in_t, out_t, act, alpha, limit, order, train, keep)
        # each element's saved rows are a slice of the folded plan's, read back only by the
        # backward's fold (never by a per-element call)
        return [y.view(B, -1, y.shape[-1]), *(t.view(B, -1, t.shape[-1]) for t in z)], [0] * (1 + len(z))
    y, dim = _shared_pairs(B, in_dims[:10], x, gates, expert_ids, slots, capacity, w_in, w_out, b_in, b_out,
                           (form, in_t, out_t, act, alpha, limit, order))
    return [y], [dim]


# Bytes of the largest transient buffer of one block of the vmapped sweep's fold (its rows'
# products [rows, O], their projections [rows, H], its bags' sums [bags, O]): below glibc's
# largest mmap threshold (a threshold that rises to a freed buffer's size, up to 32 MiB on
# 64-bit; a margin for blocks' uneven rows), so each block reuses the heap pages the one before
# it freed, where one [U, O] buffer of a large sweep is fresh pages every call (their first
# touch cost the fold about 0.1x of the N calls' time). Blocks are token ranges, each running
# every busy expert's GEMMs over its rows: the fewest blocks that fit (short per-expert GEMMs
# re-read the weights, and each GEMM is a parallel region whose threads meet, which costs most
# on an oversubscribed host).
_BLOCK_BYTES = 24 << 20


def _shared_pairs(B: int, dims: tuple, x, gates, expert_ids, slots, capacity: int, w_in, w_out, b_in, b_out,
                  statics: tuple) -> tuple[Tensor, int]:
    """(y, its batch dim): the vmapped forward over the pairs any element keeps, each multiplied
    once; y [T, B, O] (batch dim 1) where each key token is B elements' token, else [B, T, O].

    Each kept pair of element b is the key (expert e', token t') of the folded call (e' = b*E + e
    where the weights are batched, t' = b*T + t where x is and the weights are shared); one bool
    mask over the keys marks those any element keeps: the U rows to multiply. The key tokens are
    cut into blocks of about :data:`_BLOCK_BYTES` of transient buffers; within a block, the mask's
    set positions in order are its rows sorted by expert then token (no sort). The experts run
    over a block's rows into y_b [U_b, O] (no gate: each row is its own token's), and each bag (a
    key token's element) sums its kept rows of y_b with its gates, in ascending expert order, in
    one embedding bag: a bag's pairs all lie in its token's block, so each block writes its
    bags' final rows of y. Where an enclosing grad level differentiates the call (grad of a
    vmapped sweep), the rows run through the op, whose autograd that level records; otherwise
    straight through the kernel table (the rows gathered by the kernel, no [U, M] copy, no zeroed
    [U, O] buffer to scatter into)."""
    dx, dg, di, ds, _, _, dwi, dwo, dbi, dbo = dims
    form, in_t, out_t, act, alpha, limit, order = statics
    # [B, T, k]: a token's pairs side by side
    ids, sl, g = (_batched(t, d, B).transpose(1, 2) for t, d in ((expert_ids, di), (slots, ds), (gates, dg)))
    T, dev = ids.shape[1], ids.device
    xs = x.movedim(dx, 0).reshape(B * T, x.shape[-1]) if dx is not None else x
    weights, w_dims = (*w_in, w_out, b_in, b_out), (*dwi, dwo, dbi, dbo)
    E = w_out.shape[1 if dwo == 0 else 0]   # w_out [E, ., .], its batch dim at dwo
    per_weights = any(d is not None for t, d in zip(weights, w_dims) if t is not None)
    if per_weights:   # per-element experts: B*E of them
        weights = tuple(_fold_experts(t, d, B) for t, d in zip(weights, w_dims))
    *w_in, w_out, b_in, b_out = weights
    E_all = B * E if per_weights else E
    # each token's k pairs in ascending expert order, as the op adds them (masked ids, -1, first)
    ids, by_expert = ids.sort(dim=2)
    g = g.gather(2, by_expert)
    kept = (sl.gather(2, by_expert) < capacity) & (ids >= 0)
    elem = torch.arange(B, device=dev).view(B, 1, 1)
    tok = torch.arange(T, device=dev).view(1, T, 1)
    # keys e' * T_key + t': with batched weights, t' is the token within its element (e' names the
    # element), so the mask is [B*E, T] rather than [B*E, B*T]
    T_key = B * T if (dx is not None and not per_weights) else T
    key = (ids + E * elem if per_weights else ids) * T_key + (tok + T * elem if T_key != T else tok)
    n_keys = E_all * T_key
    key = torch.where(kept, key, n_keys)   # dropped and masked pairs: one spare key past the end
    mask = torch.zeros(n_keys + 1, dtype=torch.bool, device=dev)
    mask[key.reshape(-1)] = True
    # blocks of Tb key tokens: the mask [E', T_key] as [blocks, E', Tb], whose set positions come
    # by block, then expert, then token
    O = w_out.shape[1 if out_t else 2]
    per_key = B if T_key == T else 1   # bags (elements) per key token
    U = int(mask[:n_keys].sum())
    # the largest of the rows' products, their projections and the bags' sums, over all blocks
    need = xs.element_size() * max(U * O, U * sum(w.shape[1 if in_t else 2] for w in w_in), T_key * per_key * O)
    Tb = -(-T_key // max(1, min(T_key, -(-need // _BLOCK_BYTES))))
    n_blocks = -(-T_key // Tb)
    blocked = mask.new_zeros(E_all, n_blocks * Tb)
    blocked[:, :T_key] = mask[:n_keys].view(E_all, T_key)
    blk, expert_u, tb = blocked.view(E_all, n_blocks, Tb).transpose(0, 1).nonzero().unbind(1)
    tok_u = blk * Tb + tb
    row_of = torch.empty(n_keys + 1, dtype=torch.int64, device=dev)
    row_of[expert_u * T_key + tok_u] = torch.arange(U, device=dev)
    tokens = tok_u + (expert_u // E) * T if (dx is not None and per_weights) else tok_u   # rows of xs
    bounds = [0, *torch.bincount(blk * E_all + expert_u, minlength=n_blocks * E_all).cumsum(0).tolist()]
    # bags: [T_key, B] (a key token's elements side by side) where the key tokens are the
    # elements' shared tokens, else [B * T] = [T_key, 1]; a block's bags are one slice of y
    if per_key > 1:
        kept, key, g = (t.transpose(0, 1) for t in (kept, key, g))
    sel = kept.reshape(-1).nonzero().squeeze(1)
    per_bag = kept.sum(-1).reshape(-1)
    first = torch.zeros(per_bag.numel() + 1, dtype=torch.int64, device=dev)   # each bag's first pair
    torch.cumsum(per_bag, 0, out=first[1:])
    bag_cut = [min(b * Tb, T_key) * per_key for b in range(n_blocks + 1)]
    pair_cut = first[bag_cut].tolist()
    rows = row_of.index_select(0, key.reshape(-1).index_select(0, sel))
    w_pair = g.reshape(-1).index_select(0, sel)
    differentiable = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (xs, g, *weights))
    if not differentiable:
        fs, w_in_s, w_out_s = kinds.as_stored(_form(form, in_t, out_t, act, alpha, limit), tuple(w_in), w_out)
        y = _huge_pages(xs.new_empty((T_key * per_key, O)))
        scratch = _BlockScratch(xs, [w.shape[1 if fs.in_transposed else 2] for w in w_in_s], O,
                                max(bounds[(b + 1) * E_all] - bounds[b * E_all] for b in range(n_blocks)))
    parts = []
    for b in range(n_blocks):
        r0, r1 = bounds[b * E_all], bounds[(b + 1) * E_all]
        p0, p1 = pair_cut[b], pair_cut[b + 1]
        eb = [r - r0 for r in bounds[b * E_all:(b + 1) * E_all + 1]]
        if r1 == r0:   # no kept pair in this block: its bags are empty
            if differentiable:
                parts.append(xs.new_zeros((bag_cut[b + 1] - bag_cut[b], O)))
            else:
                y[bag_cut[b]:bag_cut[b + 1]].zero_()
            continue
        if differentiable:
            # the op's own autograd, one token per row: its output rows are the rows' outputs
            e_b = expert_u[r0:r1] - b * E_all
            y_b = torch.ops.fmoe.expert_rows(
                xs.index_select(0, tokens[r0:r1]), g.new_ones(1, r1 - r0), e_b.view(1, -1),
                (torch.arange(r1 - r0, device=dev) - e_b.new_tensor(eb[:-1])[e_b]).view(1, -1),
                torch.tensor(eb, device=dev).diff(), r1 - r0, w_in, w_out, b_in, b_out,
                form, in_t, out_t, act, alpha, limit, order, False, False)[0]
        else:
            plan = plan_from_bounds(tokens[r0:r1], torch.arange(r0, r1, device=dev), eb, xs.shape[0],
                                    needs_grad=False, dtype=xs.dtype)
            y_b = scratch.rows_out(select(plan, kinds._matrix_bytes(w_out_s)), fs, xs, plan, w_in_s, b_in, w_out_s,
                                   b_out)
        # y[bag] = the sum over its kept pairs, in ascending expert order, of gate * row output
        # (no [bags, O] term per pair); a key token's bags read the same rows one after another.
        # One call a block: at two threads on a busy host every parallel region can wait a time
        # slice for its second thread (1 MiB chunks, 13 a block, took 10x longer in such a phase)
        part = F.embedding_bag(rows[p0:p1] - r0, y_b, first[bag_cut[b]:bag_cut[b + 1]] - p0, mode="sum",
                               per_sample_weights=w_pair[p0:p1].to(y_b.dtype))
        if differentiable:
            parts.append(part)
        else:
            y[bag_cut[b]:bag_cut[b + 1]] = part
        del y_b, part
    if differentiable:
        y = torch.cat(parts)
    return (y.view(T, B, -1), 1) if per_key > 1 else (y.view(B, T, -1), 0)


class _BlockScratch:
    """One buffer for every block of a sweep's fold: each block's projections and row outputs
    are written into the same memory (the kernels' ``out=``), so only the first block touches
    fresh pages, and those in huge pages (:func:`_huge_pages`). Why: per-block fresh buffers came
    back from the allocator as fresh pages each call (glibc trims the heap once more than twice
    its mmap threshold is free), about 7k minor faults per call at N = 8, T = 2048.

    Args: x (dtype, device), the in-projections' widths, the output width O, and the most rows
    of any block."""

    def __init__(self, x: Tensor, widths: list, O: int, rows: int):
        align = max(1, 64 // x.element_size())   # each part starts on a 64-byte boundary, as a fresh tensor
        self.at, n = [], 0
        for width in (*widths, O):
            self.at.append(n)
            n += -(-rows * width // align) * align
        self.widths, self.O = widths, O
        buf = _huge_pages(x.new_empty(n + align))
        self.buf = buf[(-buf.data_ptr() % 64) // x.element_size():]

    def _part(self, i: int, n: int, width: int) -> Tensor:
        return self.buf.narrow(0, self.at[i], n * width).view(n, width)

    def rows_out(self, kern: Kernel, f: ExpertForm, x: Tensor, plan, w_in: tuple, b_in, w_out, b_out) -> Tensor:
        """The block's row outputs [N, O]: :func:`fmoe.engine.kinds._projections`, the activation
        and the out-projection, each GEMM into this buffer where the kernel writes into one
        (:attr:`Kernel.writes_out`), with the bits of fresh outputs of the same regime."""
        N = plan.num_rows
        # experts side by side, one thread each: a block's experts hold hundreds of rows each, and
        # one parallel region a projection rather than one a GEMM (16 a projection at E = 16)
        regime = "parallel" if torch.get_num_threads() > 1 else None

        def out(i, width):
            return {"out": self._part(i, N, width), "regime": regime} if kern.writes_out else {}
        z = kinds._projections(kern, f, x, plan, w_in, b_in, tuple(out(i, w) for i, w in enumerate(self.widths)))
        return kern.mm(f.hidden_(*z), w_out, plan, transposed=f.out_transposed, bias=b_out,
                       **out(len(self.widths), self.O))


_MADV_HUGEPAGE = 14   # linux/mman.h
_HUGE_PAGE = 2 << 20
_LIBC = []


def _huge_pages(t: Tensor) -> Tensor:
    """t, the whole 2 MiB pages of its fresh (not yet touched) storage advised for transparent
    huge pages (Linux's madvise MADV_HUGEPAGE) before their first write. Why: the sweep's output
    (50 MB at N=8, T=2048, O=768) is past glibc's mmap threshold (32 MiB at most), fresh pages
    every call, whose first touch 4 KiB at a time took 12k minor faults (a fresh 100 MB buffer
    filled: 56-83 ms in 4 KiB pages, 30-37 ms in huge pages on this host). Pages already
    resident (a buffer glibc reused) are left as they are (mincore). A no-op off Linux, below 4
    MiB, or where THP is off."""
    n = t.numel() * t.element_size()
    if t.device.type != "cpu" or n < 2 * _HUGE_PAGE or not sys.platform.startswith("linux"):
        return t
    if not _LIBC:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            _LIBC.append(libc)
        except (OSError, AttributeError):
            _LIBC.append(None)
    libc = _LIBC[0]
    lo = -(-t.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
    hi = (t.data_ptr() + n) // _HUGE_PAGE * _HUGE_PAGE
    if libc is None or hi <= lo:
        return t
    resident = (ctypes.c_ubyte * 1)()
    if libc.mincore(lo, 1, resident) == 0 and not resident[0] & 1:
        libc.madvise(lo, hi - lo, _MADV_HUGEPAGE)   # advice: a failure changes nothing
    return t


torch.library.register_vmap("fmoe::expert_rows", _expert_rows_vmap)


def _expert_rows_backward_vmap(info, in_dims, gy, x, gates, expert_ids, slots, counts, capacity, w_in, w_out, b_in,
                               b_out, z, form, in_t, out_t, act, alpha, limit, order, need):
    """The backward of a folded forward folds the same way (:func:`_fold`: each element's weight
    gradients are its own, per (expert, element) group of shared weights or per expert of B*E);
    saved rows from per-element calls (bf16, or a forward outside this vmap, as jacrev's vmap over
    cotangents) run once per element."""
    args = (gy, x, gates, expert_ids, slots, counts, capacity, w_in, w_out, b_in, b_out, z, form, in_t, out_t, act,
            alpha, limit, order, need)
    dz = in_dims[11]
    if x.dtype not in (torch.float32, torch.float64) or any(d is None for d in dz):
        return _loop(torch.ops.fmoe.expert_rows_backward, info, in_dims, args)
    B = info.batch_size
    f = _fold(B, in_dims[1:11], x, gates, expert_ids, slots, counts, capacity, w_in, w_out, b_in, b_out)
    gy = _batched(gy, in_dims[0], B)
    zs = [t.movedim(d, 0).reshape(-1, t.shape[-1]) for t, d in zip(z, dz)]
    g = torch.ops.fmoe.expert_rows_backward(gy.reshape(-1, gy.shape[-1]), f.x, f.gates, f.ids, f.slots, f.counts,
                                            f.capacity, f.w_in, f.w_out, f.b_in, f.b_out, zs, form, in_t, out_t, act,
                                            alpha, limit, order, need, f.groups)
    gx, g_gates, g_bin, g_out, g_bout, *g_in = g
    k = f.gates.shape[0]
    # weight gradients: [E*B, ...] expert-major from shared weights' groups, [B*E, ...] from B*E experts
    wd = 1 if f.groups > 1 else 0
    out = [gx.view(B, -1, gx.shape[-1]) if need[0] else gx,
           g_gates.view(k, B, -1) if need[1] else g_gates,
           *((t.view(-1, B, *t.shape[1:]) if wd else t.view(B, -1, *t.shape[1:])) if n else t
             for t, n in zip((g_bin, g_out, g_bout, *g_in), need[2:]))]
    dims = [0 if need[0] else None, 1 if need[1] else None, *(wd if n else None for n in need[2:])]
    return out, dims


def _fold(B, dims, x, gates, expert_ids, slots, counts, capacity, w_in, w_out, b_in, b_out):
    """A vmapped training call as one call over B*T tokens: :class:`_Merge` where every expert
    weight and bias is shared (no weight copied), else :class:`_Fold` (B*E experts)."""
    if all(d is None for d in (*dims[6], *dims[7:10])):
        return _Merge(B, dims, x, gates, expert_ids, slots, counts, capacity, w_in, w_out, b_in, b_out)
    return _Fold(B, dims, x, gates, expert_ids, slots, counts, capacity, w_in, w_out, b_in, b_out)


class _Merge:
    """A vmapped call's arguments, its expert weights shared, as one call over B*T tokens and
    the same E experts (element b's token t is b*T + t). Within an expert the rows come element by
    element: element b's kept slot s of expert e becomes slot (e's kept rows in elements before b)
    + s, its dropped pairs are masked (-1) and the capacity lies past every row, so the call keeps
    exactly the elements' kept pairs. The backward (``groups`` = B) takes the weight gradients
    per (expert, element) group of rows: [E*B, ...], expert-major.

    Attributes: x [B*T, M], gates/ids/slots [k, B*T], counts [E], capacity, groups = B, and the
    weights as given."""

    def __init__(self, B, dims, x, gates, expert_ids, slots, counts, capacity, w_in, w_out, b_in, b_out):
        dx, dg, di, ds, dc = dims[:5]
        ids, sl = _batched(expert_ids, di, B), _batched(slots, ds, B)   # [B, k, T]
        k, T = ids.shape[1:]
        kept = (ids >= 0) & (sl < capacity)
        n = _batched(counts, dc, B).clamp(max=max(capacity, 0))         # [B, E] kept rows
        before = n.cumsum(0) - n
        e = ids.clamp(min=0).reshape(B, -1)
        sl = torch.where(kept, before.gather(1, e).view_as(ids) + sl, 0)

        def kt(t):   # [B, k, T] -> [k, B*T]
            return t.transpose(0, 1).reshape(k, B * T)

        self.x = _batched(x, dx, B).reshape(B * T, x.shape[-1])
        self.ids, self.slots, self.gates = kt(torch.where(kept, ids, -1)), kt(sl), kt(_batched(gates, dg, B))
        self.counts, self.capacity, self.groups = n.sum(0), max(1, k * B * T), B
        self.w_in, self.w_out, self.b_in, self.b_out = list(w_in), w_out, b_in, b_out


class _Fold:
    """A vmapped call's arguments as one call over B*T tokens and B*E experts (element b's
    token t is b*T + t, its expert e is b*E + e); unbatched tensors are expanded (copies).

    Attributes: x [B*T, M], gates/ids/slots [k, B*T], counts [B*E], capacity, groups = 1,
    w_in list, w_out, b_in, b_out with B*E experts."""

    def __init__(self, B, dims, x, gates, expert_ids, slots, counts, capacity, w_in, w_out, b_in, b_out):
        dx, dg, di, ds, dc, _, dwi, dwo, dbi, dbo = dims
        ids = _batched(expert_ids, di, B)                               # [B, k, T]
        k, T = ids.shape[1:]
        E = _batched(w_out, dwo, B).shape[1]
        ids = torch.where(ids >= 0, ids + E * torch.arange(B, device=ids.device).view(B, 1, 1), ids)

        def kt(t, d):   # [B, k, T] -> [k, B*T]
            return _batched(t, d, B).transpose(0, 1).reshape(k, B * T)

        self.x = _batched(x, dx, B).reshape(B * T, x.shape[-1])
        self.ids, self.slots, self.gates = ids.transpose(0, 1).reshape(k, B * T), kt(slots, ds), kt(gates, dg)
        self.counts, self.capacity, self.groups = _batched(counts, dc, B).reshape(B * E), capacity, 1
        self.w_in = [_fold_experts(w, d, B) for w, d in zip(w_in, dwi)]
        self.w_out, self.b_in, self.b_out = (_fold_experts(t, d, B) for t, d in ((w_out, dwo), (b_in, dbi), (b_out, dbo)))


torch.library.register_vmap("fmoe::expert_rows_backward", _expert_rows_backward_vmap)


def run(form: ExpertForm, x: Tensor, routing: Routing, w_in: tuple, w_out: Tensor, *,
        b_in: Optional[Tensor] = None, b_out: Optional[Tensor] = None, order: str = "fmoe",
        save: str = "projections") -> Tensor:
    """The experts of ``form`` on the routing's kept pairs, summed back to tokens: y [T, O] in
    x's dtype (:func:`fmoe.engine.kinds.run` on a rows plan, as one custom op).

    Args:
        form: the expert kind (its activation one of :data:`ACTIVATIONS`, or GPT-OSS).
        x: float [T, M]. routing: its :class:`~fmoe.Routing` (gates: ``routing.weights`` [k, T]).
        w_in, w_out, b_in, b_out: as :func:`fmoe.experts.expert_form` returns them, in x's dtype.
        order: 'fmoe' or 'eager'. save: 'projections' (the in-projection outputs kept for
            backward, [k*T, H] each, padded) or 'recompute'.
    """
    act = _activation_name(form)
    if act is None:
        raise ValueError(f"the traced expert op takes the activations {sorted(ACTIVATIONS)}; got {form.activation!r} "
                         "(other callables run on the layout plan)")
    ts = (x, routing.weights, b_in, w_out, b_out, *w_in)
    train = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)
    statics = (form.form, form.in_transposed, form.out_transposed, act, float(form.alpha), float(form.limit), order)
    args = (x, routing.weights, routing.expert_ids, routing.slots, routing.counts, routing.capacity)
    keep = train and save == "projections"
    if torch.compiler.is_compiling():   # the op itself, whose registered autograd dynamo captures
        return torch.ops.fmoe.expert_rows(*args, list(w_in), w_out, b_in, b_out, *statics, train, keep)[0]
    return _ExpertRows.apply(*args, w_out, b_in, b_out, statics, train, keep, *w_in)[0]


def _eager(*ts: Optional[Tensor]) -> bool:
    """True where :func:`fmoe.engine.kinds.run` runs a rows plan: eager mode (no torch.func transform, no torch.compile, no
    forward-AD level) on plain tensors without ``__torch_function__`` overrides. Elsewhere the
    caller runs the staged pipeline (its ops carry vmap, jvp and compile rules)."""
    if torch.compiler.is_compiling() or _functorch.maybe_current_level() is not None:
        return False
    if _fwd_ad._current_level >= 0:
        return False
    present = [t for t in ts if t is not None]
    if any(type(t) not in PLAIN_TENSORS for t in present):
        return False
    return not torch.overrides.has_torch_function(tuple(present))


DOORS = ("rows", "traced", "layout")


def door(form: Optional[ExpertForm], tensors: tuple, *, precision=None, order: str = "fmoe", prescore: bool = False,
         plan: str = "auto") -> str:
    """The door of one call: 'rows' (a rows plan in eager mode, :func:`fmoe.engine.kinds.run`),
    'traced' (the same plan and kernels inside this module's custom op: under torch.compile, and
    under vmap / grad transforms in eager mode) or 'layout' (a layout plan, the staged kernel:
    forward-mode AD, a torch.func transform inside a compiled call, pre-scored gates, combine
    'grouped', ``MoESpec(plan='layout')``, what the custom op does not take). :func:`fmoe.moe`
    and each rank's :func:`fmoe.parallel.expert_stage` ask here.

    Args:
        form: the kind (None: custom experts, which have no traced door).
        tensors: the call's x, gates and weights (packed weights, None biases allowed).
        precision: the quantized-training recipe or None. order: the combine order.
        prescore: gates scale the experts' inputs. plan: :attr:`fmoe.MoESpec.plan`.
    Returns:
        one of :data:`DOORS`.
    """
    # packed weights also sum in transformers' 'grouped' order on a rows plan (kinds.rows_orders)
    packed = any(t is not None and not isinstance(t, Tensor) for t in tensors)
    if plan != "auto" or prescore or order not in (kinds.LAYOUT_ORDERS if packed else kinds.ORDERS):
        return "layout"
    if _eager(*(t for t in tensors if t is None or isinstance(t, Tensor))):
        return "rows"
    if form is not None and applies(form, tensors, precision, order):
        return "traced"
    return "layout"
