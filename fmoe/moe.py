"""``moe()``: the one MoE pipeline, route -> layout -> dispatch -> (all-to-all) -> experts ->
(all-to-all) -> combine (+ shared experts), as one pure function.

    params = fmoe.init_params(spec, generator=g)
    y, aux = fmoe.moe(params, x, spec)

Every router (:mod:`fmoe.routers`), both layouts (:mod:`fmoe.layout`), every expert type
(:mod:`fmoe.experts`, through one grouped-GEMM seam) and every expert-parallel mode
(:mod:`fmoe.parallel`) meet here; the architecture blocks of :mod:`fmoe.models` are
configurations of this function. ``spec`` (a frozen, hashable :class:`MoESpec`) holds every
static setting; the parameter pytree holds every tensor; nothing else carries state. To change
a setting for one call, pass ``dataclasses.replace(spec, ...)`` — nothing sticks.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from .comm import resolve
from .engine import kinds as _kinds
from .experts import EXPERT_PARAMS, ExpertSpec, expert_dtype, init_experts, routed_experts, shared_experts, sharding
from .layout import LAYOUTS
from .losses import gshard_loss, load_importance_loss
from .ops.orders import COMBINES
from .routers import GateSpec, RouterOutput, init_router
from .routers import native_applies, route_native
from .routers import route as _router_route
from .routing import KeptRows, Routing, _capacity_factor, capacity_for

SHARED = ("swiglu", "gated_swiglu")
PLANS = ("auto", "layout")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoESpec:
    """Static description of one MoE layer (keyword-only).

    Attributes:
        model_dim: M, token feature size.
        num_experts: E, global experts.
        gate: :class:`~fmoe.routers.GateSpec` (selects the router).
        experts: :class:`~fmoe.experts.ExpertSpec`.
        is_postscore: gates scale expert outputs (True) or inputs (False).
        batch_prioritized: place important tokens first within each slot.
        normalize_gate: normalise the k gates (k > 1) before dropping, with the router's formula.
        is_gshard_loss: GShard loss (True) or Tutel's load/importance loss.
        balance_loss: compute that loss; False leaves ``MoEAux.l_aux`` a zero scalar (the
            architecture blocks: their models take their own losses from the router logits,
            and the loss's half-dozen small ops are ~0.1 ms of a decode call).
        alignment: capacity is rounded up to a multiple of this.
        layout: 'auto' (ragged for dropless routing, ``capacity_factor == 0``, padded
            otherwise), 'padded' (Tutel's [E, C, M], bit-exact) or 'ragged' (pairs sorted by
            expert, no padding rows; honours a finite capacity by dropping like padded).
        combine: the order of the final weighted sum: 'fmoe' (:func:`fmoe.combine`: fp32
            accumulation over the k slots, one cast), 'eager' (transformers' eager expert
            loop, bit for bit) or 'grouped' (transformers' grouped_mm/batched_mm order).
        shared: shared experts run on every token and added to the routed output: None,
            'swiglu' (DeepSeek: params["shared"]) or 'gated_swiglu' (Qwen2-MoE: sigmoid gate
            params["shared_gate"]["weight"] [1, M]).
        plan: which expert plan runs the experts. 'auto': on one process and with expert
            parallelism in eager mode a rows plan of the expert engine (:mod:`fmoe.engine`): the
            kept pairs sorted by expert, each projection one grouped-GEMM call whose kernel
            gathers x's rows itself, the outputs added straight into y; only kept pairs are
            multiplied (either layout). Every built-in kind with float weights, quantized-training
            recipes (quantize blocks per expert) or packed weights. Equal to the layout plan
            within float rounding (the k terms of a token are summed in expert order);
            combine='eager' stays transformers' order. Under torch.compile and torch.func's vmap
            and grad the same plan runs inside one custom op (:mod:`fmoe.engine.traced`). Under
            forward-mode AD or a second derivative, with custom experts on padded buffers,
            pre-scored gates or combine='grouped' (float weights), a layout plan runs instead.
            'layout': always the layout plan, the engine's layout kernel (dispatch -> one op per
            projection over the layout's buffers -> combine; with the padded layout Tutel's
            arithmetic bit for bit, every capacity row multiplied).
        save: on a rows plan, what backward keeps: 'projections' (the in-projection outputs,
            [N, H] or [N, 2H] for N kept pairs) or 'recompute' (nothing beyond the inputs: one
            more in-projection GEMM in backward).
    """

    model_dim: int
    num_experts: int
    experts: ExpertSpec
    gate: GateSpec = GateSpec()
    is_postscore: bool = True
    batch_prioritized: bool = False
    normalize_gate: bool = True
    is_gshard_loss: bool = True
    balance_loss: bool = True
    alignment: int = 1
    layout: str = "auto"
    combine: str = "fmoe"
    shared: Optional[str] = None
    plan: str = "auto"
    save: str = "projections"

    def __post_init__(self):
        for name in ("model_dim", "num_experts", "alignment"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"MoESpec.{name} must be a positive int, got {v!r}")
        if not self.is_gshard_loss and self.gate.gate_noise <= 0:
            raise ValueError("is_gshard_loss=False (load/importance loss) needs gate.gate_noise > 0")
        if self.layout not in ("auto",) + LAYOUTS:
            raise ValueError(f"MoESpec.layout must be 'auto', 'padded' or 'ragged', got {self.layout!r}")
        if self.layout == "ragged" and not self.experts.layout_aware:
            raise ValueError("MoESpec.layout='ragged' needs built-in experts; custom experts take padded buffers")
        if self.plan not in PLANS:
            raise ValueError(f"MoESpec.plan must be one of {PLANS}, got {self.plan!r}")
        if self.save not in _kinds.SAVES:
            raise ValueError(f"MoESpec.save must be one of {_kinds.SAVES}, got {self.save!r}")
        if self.combine not in COMBINES:
            raise ValueError(f"MoESpec.combine must be one of {COMBINES}, got {self.combine!r}")
        if self.shared is not None and self.shared not in SHARED:
            raise ValueError(f"MoESpec.shared must be None or one of {SHARED}, got {self.shared!r}")
        if self.combine != "fmoe" and not self.is_postscore:
            raise ValueError(f"MoESpec.combine={self.combine!r} applies the gates to the outputs; it needs "
                             "is_postscore=True")

    @property
    def output_dim(self) -> int:
        return self.experts.output_dim or self.model_dim

    def layout_kind(self, world: int = 1, overlap_degree: int = 1) -> str:
        """'padded' or 'ragged': the layout this spec routes into on ``world`` ranks.

        'auto' picks ragged for dropless token-choice routing with built-in experts, unless
        the expert-parallel setting needs the padded capacity axis (experts shared by several
        ranks, E < W, or an overlap degree > 1)."""
        if self.layout != "auto":
            return self.layout
        dropless = self.gate.capacity_factor == 0 and self.gate.type != "expert_choice"
        ragged_ep = world == 1 or (self.num_experts >= world and overlap_degree == 1)
        return "ragged" if dropless and self.experts.layout_aware and ragged_ep else "padded"


@dataclasses.dataclass(frozen=True, eq=False)
class MoEAux:
    """Auxiliary outputs of :func:`moe` (a pytree; ``capacity`` and which optional fields are None
    are static, so an aux leaves ``vmap`` with a batch axis on every tensor, its routing stacked).

    Attributes:
        l_aux: scalar balance loss (GShard or load/importance), unweighted.
        counts: int64 [E] pairs routed to each expert before dropping.
        dropped: int64 [] (token, expert) pairs lost to capacity.
        routing: the :class:`~fmoe.Routing` used (replayable).
        capacity: C (dropless: the largest load over the group, as Tutel reports it). The
            ragged layout never depends on it; under vmap / torch.compile dropless routing
            reports the capacity of the load bound T instead (no host sync): C = T (ragged, or
            padded dropless), min(T, k * int(-cf * ceil(T / E))) aligned (padded, capped).
        scores: [T, E] routing scores (the probabilities the balance losses use); None when a
            recorded routing was replayed.
        logits: [T, E] router logits as the router computes them (z-loss, HF load balancing);
            None when a routing was replayed.
        shared_gate: Qwen2-MoE's sigmoid shared-expert gate [T, 1], else None.
    """

    l_aux: Tensor
    counts: Tensor
    dropped: Tensor
    routing: Routing
    capacity: int
    scores: Optional[Tensor] = None
    logits: Optional[Tensor] = None
    shared_gate: Optional[Tensor] = None


    def __repr__(self) -> str:
        return (f"MoEAux(l_aux={_brief(self.l_aux)}, counts={_brief(self.counts)}, dropped={_brief(self.dropped)}, "
                f"routing={self.routing!r}, capacity={self.capacity}, scores={_brief(self.scores)}, "
                f"logits={_brief(self.logits)}, shared_gate={_brief(self.shared_gate)})")


def _brief(t) -> str:
    """A tensor as its shape and dtype (a scalar as its value): a repr of a few lines, not kilobytes."""
    if not isinstance(t, Tensor):
        return repr(t)
    if t.dim() == 0 and _plain(t):
        return f"{t.item():.6g}" if t.is_floating_point() else str(t.item())
    return f"{t.dtype}{list(t.shape)}".replace("torch.", "")


def _plain(t: Tensor) -> bool:
    return type(t) in (Tensor, torch.nn.Parameter) and not torch._C._functorch.is_functorch_wrapped_tensor(t)


_AUX_OPTIONAL = ("scores", "logits", "shared_gate")


def _aux_flatten(a: MoEAux):
    # Absent optional fields go in the context, not the leaves: a None leaf cannot leave a vmap.
    present = tuple(n for n in _AUX_OPTIONAL if getattr(a, n) is not None)
    return [a.l_aux, a.counts, a.dropped, a.routing, *(getattr(a, n) for n in present)], (a.capacity, present)


def _aux_unflatten(leaves, ctx) -> MoEAux:
    capacity, present = ctx
    return MoEAux(*leaves[:4], capacity=capacity, **dict(zip(present, leaves[4:])))


def _aux_flatten_with_keys(a: MoEAux):
    leaves, ctx = _aux_flatten(a)
    names = ("l_aux", "counts", "dropped", "routing") + ctx[1]
    return [(pytree.GetAttrKey(n), v) for n, v in zip(names, leaves)], ctx


pytree.register_pytree_node(
    MoEAux,
    _aux_flatten,
    _aux_unflatten,
    serialized_type_name="fmoe.moe.MoEAux",
    flatten_with_keys_fn=_aux_flatten_with_keys,
)


# --------------------------------------------------------------------------- params

def init_params(spec: MoESpec, *, generator: Optional[torch.Generator] = None,
                dtype: torch.dtype = torch.float32, num_local_experts: Optional[int] = None,
                comm=None) -> dict:
    """A fresh parameter pytree ``{"gate": {...}, "experts": {...}}`` (+ "shared", "shared_gate").

    Experts are drawn first, then the gate (Tutel's order), then shared experts. With
    ``fp32_gate`` the gate is float32 whatever ``dtype`` is.

    Args:
        spec: the layer.
        generator: RNG for reproducible initialisation.
        dtype: expert parameter dtype.
        num_local_experts: experts held by this process (default: all E).
        comm: expert-parallel communicator: all E experts are drawn (identically
            on every rank given the same generator) and this rank keeps its
            slice (:func:`fmoe.parallel.shard_experts`: E/W experts, or one
            shard of an expert shared by W/E ranks).
    """
    n = spec.num_experts if num_local_experts is None else num_local_experts
    if comm is not None and comm.size > 1 and num_local_experts is not None:
        raise ValueError("init_params: pass either comm (shards the E experts) or num_local_experts, not both")
    experts = init_experts(spec.experts, n, spec.model_dim, generator=generator, dtype=dtype)
    if comm is not None and comm.size > 1:
        from .parallel import shard_experts
        experts = shard_experts(spec.experts.type, experts, spec.num_experts, comm.rank, comm.size)
    gate_dtype = torch.float32 if spec.gate.fp32_gate else dtype
    gate = init_router(spec.gate, spec.num_experts, spec.model_dim, generator=generator, dtype=gate_dtype)
    params = {"gate": gate, "experts": experts}
    if spec.shared is not None:
        M, H = spec.model_dim, spec.experts.hidden_size

        def normal(shape):
            return (torch.randn(shape, generator=generator, dtype=torch.float32) * 0.02).to(dtype)

        params["shared"] = {"gate_proj": normal((H, M)), "up_proj": normal((H, M)), "down_proj": normal((M, H))}
        if spec.shared == "gated_swiglu":
            params["shared_gate"] = {"weight": normal((1, M))}
    return params


def _expect(cond: bool, msg) -> None:
    """Raise ValueError naming msg() unless cond (the message is built only on failure)."""
    if not cond:
        raise ValueError(f"parameter pytree does not match the MoESpec: {msg()}")


def _shape(t) -> tuple:
    return tuple(getattr(t, "logical_shape", None) or t.shape)


def _expert_shapes(et: str, ex: dict, n: int, M: int, H: int, O: int, s: int) -> dict:
    """key -> the shape ``spec`` gives that leaf of a rank's n experts (leaves named in
    :data:`fmoe.experts.EXPERT_PARAMS`; packed weights are out x in; s ranks sharing one expert
    hold H/s hidden units and ceil(O/s) fc2 bias entries)."""
    def packed(key):
        return not isinstance(ex.get(key), Tensor)
    h = H // s
    if et == "ffn":
        return {"fc1_w": (n, h, M), "fc1_b": (n, h), "fc2_w": (n, O, h) if packed("fc2_w") else (n, h, O),
                "fc2_b": (n, -(-O // s))}
    if et == "gated_ffn":
        w_in = (n, h, M) if packed("gate_w") else (n, M, h)
        return {"gate_w": w_in, "up_w": w_in, "down_w": (n, O, h) if packed("down_w") else (n, h, O)}
    if et == "swiglu":
        return {"gate_up_proj": (n, 2 * H, M), "gate_proj": (n, H, M), "up_proj": (n, H, M), "down_proj": (n, O, H)}
    return {"gate_up_proj": (n, 2 * H, M) if packed("gate_up_proj") else (n, M, 2 * H), "gate_up_proj_bias": (n, 2 * H),
            "down_proj": (n, O, H) if packed("down_proj") else (n, H, O), "down_proj_bias": (n, O)}


_BIAS_FLAGS = {"fc1_b": "has_fc1_bias", "fc2_b": "has_fc2_bias"}   # the ffn options a leaf can contradict
# type -> (every leaf name, the leaves that must be there), from the one table of layouts
_LEAF_NAMES = {t: (frozenset(p.name for p in ps), frozenset(p.name for p in ps if not p.optional))
               for t, ps in EXPERT_PARAMS.items()}


def check_params(params, spec: MoESpec, num_local_experts: Optional[int] = None, *, gate: bool = True,
                 world: int = 1, rank: int = 0) -> None:
    """Raise ValueError naming the first key, shape or option of ``params`` that does not fit ``spec``.

    Every built-in expert leaf (:data:`fmoe.experts.EXPERT_PARAMS`) is checked against the spec:
    its presence (a bias the spec turns off is an error, never silently used), no unknown keys, and
    every dimension (experts, hidden size, model and output dims; packed weights by their logical
    shape). Shared experts' model dims too. Only shapes are read: the check works alike inside
    torch.func transforms and torch.compile.

    Args:
        params: the pytree of :func:`init_params`.
        spec: the layer.
        num_local_experts: expert count of the leaves' leading dim (default: ``spec.num_experts``,
            or with ``world > 1`` this rank's part, :func:`fmoe.parallel.sharding`).
        gate: check the router's presence (a replayed routing never reads it). The router checks
            its own parameters' shapes when it runs (:func:`fmoe.routers.check_router_params`);
            with expert parallelism :func:`moe` checks them before the call's first collective.
        world, rank: expert parallelism: the leaves are rank ``rank``'s part of the experts on
            ``world`` ranks (an expert-parallel :func:`moe` call runs
            :func:`fmoe.parallel.check_expert_layout` first, which names the layout's fix).
    """
    need = ("gate", "experts") if gate else ("experts",)
    _expect(isinstance(params, dict) and all(k in params for k in need),
            lambda: f"expected a dict with keys {' and '.join(repr(k) for k in need)}, got "
            f"{sorted(params) if isinstance(params, dict) else type(params).__name__}")
    M, E = spec.model_dim, spec.num_experts
    ex, es = params["experts"], spec.experts
    if spec.shared is not None:
        _expect("shared" in params, lambda: f"shared={spec.shared!r} needs params['shared'], got keys {sorted(params)}")
        sh = params["shared"]
        _expect(isinstance(sh, dict) and {"gate_proj", "up_proj", "down_proj"} <= set(sh),
                lambda: "params['shared'] needs 'gate_proj' [I, M], 'up_proj' [I, M] and 'down_proj' [M, I], got "
                f"{sorted(sh) if isinstance(sh, dict) else type(sh).__name__}")
        g, u, d = _shape(sh["gate_proj"]), _shape(sh["up_proj"]), _shape(sh["down_proj"])
        _expect(len(g) == 2 and g[1] == M and u == g and d == (M, g[0]),
                lambda: f"shared experts need gate_proj/up_proj [I, M={M}] and down_proj [M={M}, I], got "
                f"{list(g)}, {list(u)}, {list(d)}")
        if spec.shared == "gated_swiglu":
            _expect("shared_gate" in params and _shape(params["shared_gate"]["weight"]) == (1, M),
                    lambda: f"shared='gated_swiglu' needs params['shared_gate']['weight'] [1, M={M}]")
    if es.type == "custom":
        return
    _expect(isinstance(ex, dict), lambda: f"experts must be a dict, got {type(ex).__name__}")
    n, s = sharding(E, world) if world > 1 else (E, 1)
    n = n if num_local_experts is None else num_local_experts
    names, required = _LEAF_NAMES[es.type]
    if not names.issuperset(ex):
        key = sorted(set(ex) - names)[0]
        _expect(False, lambda: f"experts[{key!r}] is not a {es.type} parameter; {es.type} experts take "
                f"{sorted(names)}")
    if not required.issubset(ex):
        _expect(False, lambda: f"{es.type} experts need {sorted(required - set(ex))[0]!r}, got keys {sorted(ex)}")
    if es.type == "ffn":
        for key, flag in _BIAS_FLAGS.items():
            on, held = getattr(es, flag), ex.get(key) is not None
            _expect(on == held, lambda: (
                f"{flag}=False but params hold experts[{key!r}]: drop the key or set {flag}=True" if held else
                f"{flag}=True but experts[{key!r}] is missing: add it or set {flag}=False"))
    elif es.type == "swiglu":
        fused, split = "gate_up_proj" in ex, "gate_proj" in ex or "up_proj" in ex
        _expect(fused != split and (fused or "up_proj" in ex and "gate_proj" in ex),
                lambda: f"swiglu experts take 'gate_up_proj' or both 'gate_proj' and 'up_proj' (one form, not "
                f"both), got keys {sorted(ex)}")
    want = _expert_shapes(es.type, ex, n, M, es.hidden_size, spec.output_dim, s)
    for key, leaf in ex.items():
        if leaf is None:
            continue
        got = leaf.shape if type(leaf) is Tensor or isinstance(leaf, Tensor) else _shape(leaf)
        if got != want[key]:
            _expect(False, lambda: (
                f"experts[{key!r}] has shape {list(_shape(leaf))}; this spec (num_experts={E}"
                + (f" on {world} ranks: {n} here" if world > 1 else "")
                + f", model_dim={M}, hidden_size={es.hidden_size}, output_dim={spec.output_dim}) needs "
                f"{list(want[key])} for a {es.type} expert"
                + (" (packed weights: out x in)" if not isinstance(leaf, Tensor) else "")))


# --------------------------------------------------------------------------- forward

def route(params: dict, x: Tensor, spec: MoESpec, *, comm=None, generator=None, noise: Optional[Tensor] = None,
          training: bool = False, alignment: Optional[int] = None) -> tuple[Routing, Tensor]:
    """Gate and route tokens x [T, M]; returns the Routing and the unweighted l_aux.

    ``alignment`` overrides ``spec.alignment`` (expert parallel needs C % (s*d) == 0)."""
    kind = spec.layout_kind(1 if comm is None else comm.size)
    routing, out, l_aux, _ = _route(params, x, spec, kind, comm=comm, generator=generator, noise=noise,
                                    training=training, alignment=alignment)
    return routing, l_aux


def _under_vmap(x: Tensor, gate_params) -> bool:
    """A vmap batches x or a gate parameter (only inside a functorch level: the leaves are not
    walked in plain eager calls). Peels functorch wrappers (grad levels) looking for a vmap
    BatchedTensor."""
    F = torch._C._functorch
    if F.maybe_current_level() is None:
        return False
    for t in (x, *pytree.tree_leaves(gate_params)):
        while isinstance(t, Tensor):
            if F.is_batchedtensor(t):
                return True
            if not F.is_functorch_wrapped_tensor(t):
                break
            t = F.get_unwrapped(t)
    return False


def _route(params, x, spec: MoESpec, kind: str, *, comm, generator, noise, training, alignment
           ) -> tuple[Routing, RouterOutput, Tensor, Optional[KeptRows]]:
    """(routing, router output, l_aux, the routing's kept rows where the native route made them)."""
    gs = spec.gate
    capacity = None
    if (gs.type != "expert_choice" and (torch.compiler.is_compiling() or _under_vmap(x, params["gate"]))
            and _capacity_factor(gs.static_capacity_factor) <= 0):
        # Dropless capacity is the max load, which cannot be read under vmap or compile. Dropless
        # ragged buffers hold k*T rows whatever the loads, so C = T (a token picks an expert at most
        # once) is reported. Padded buffers take the capacity the same formula gives with the load
        # bound T: C = T dropless, min(T, k * int(-cf * ceil(T / E))) capped; it drops exactly the
        # pairs the eager call drops (larger buffers, same output).
        T = x.shape[0]
        k = min(gs.k, spec.num_experts)
        if kind == "ragged" and gs.static_capacity_factor == 0:
            capacity = T
        elif comm is None or comm.size == 1:   # expert parallel ranks agree on the max load
            capacity = capacity_for(gs.static_capacity_factor, num_tokens=T, num_experts=spec.num_experts, k=k,
                                    max_load=T, alignment=spec.alignment if alignment is None else alignment)
    align = spec.alignment if alignment is None else alignment
    native = None
    if (capacity is None and noise is None and not spec.batch_prioritized and (comm is None or comm.size == 1)
            and native_applies(params["gate"], x, gs, training)):
        # a small eager call: top-k, gates, slots and the plan's rows in one native call, the same values
        native = route_native(params["gate"], x, gs, num_experts=spec.num_experts, normalize=spec.normalize_gate,
                              alignment=align, fraction=spec.balance_loss and spec.is_gshard_loss)
    loss = rows = None
    if native is not None:
        routing, out, loss, rows = native   # loss: the GShard loss route_native made, or None
    else:
        routing, out = _router_route(params["gate"], x, gs, num_experts=spec.num_experts,
                                     normalize=spec.normalize_gate, batch_prioritized=spec.batch_prioritized,
                                     training=training, generator=generator, noise=noise, alignment=align,
                                     comm=comm, capacity=capacity)
    return routing, out, balance_loss(spec, routing, out, loss), rows


def balance_loss(spec: MoESpec, routing: Routing, out: RouterOutput, loss: Optional[Tensor] = None) -> Tensor:
    """The unweighted l_aux of a routed call: 0 without ``spec.balance_loss`` (or for expert choice,
    balanced by construction), GShard's (``loss`` where the native route made it) or Tutel's
    load/importance loss."""
    gs = spec.gate
    if gs.type == "expert_choice" or not spec.balance_loss:
        return out.scores.new_zeros(())
    if spec.is_gshard_loss:
        return gshard_loss(out.scores, routing.expert_ids[0]) if loss is None else loss
    return load_importance_loss(out.logits, out.noisy_logits, gs.k, gs.gate_noise)


def _check_input(x, spec: MoESpec) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"moe: x must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"moe: x must be floating point, got dtype {x.dtype}")
    if x.dim() < 2:
        raise ValueError(f"moe: x must have at least 2 dims [..., M], got shape {tuple(x.shape)}")
    if x.shape[-1] != spec.model_dim:
        raise ValueError(f"moe: x's last dim must be model_dim={spec.model_dim}, got shape {tuple(x.shape)}")


def _check_replay(routing, num_tokens: int, spec: MoESpec, alignment: int, world: int = 1) -> None:
    """Raise ValueError unless the injected ``routing`` is one this spec could have made for
    ``num_tokens`` tokens: its T and E, its k (the gate's k clipped to E) and a capacity that drops
    exactly the pairs the spec's capacity factor drops (padded: C itself; dropless: nothing;
    capped: C up to the max load). With expert parallelism (``world > 1``) the group's token count
    and load are not known here, so only a capacity below this rank's own value is refused."""
    from .routing import _plain_tensor
    if not isinstance(routing, Routing):
        raise TypeError(f"moe: routing must be a fmoe.Routing, got {type(routing).__name__}")
    gs, E = spec.gate, spec.num_experts
    if routing.num_tokens != num_tokens or routing.num_experts != E:
        raise ValueError(f"moe: injected routing is for T={routing.num_tokens}, E={routing.num_experts}; "
                         f"this call has T={num_tokens}, E={E}")
    k = E if gs.type == "expert_choice" else min(gs.k, E)
    if routing.k != k:
        raise ValueError(f"moe: injected routing has k={routing.k} pairs per token; this spec's gate has k={k} "
                         f"(GateSpec.k={gs.k}, E={E}): replay it under the spec it was recorded with")
    if gs.type == "expert_choice":
        return
    cf, C = gs.capacity_factor, routing.capacity
    fix = ("replay it under the spec (capacity_factor, alignment) it was recorded with, or route again "
           "(routing=None)")
    if cf > 0:
        want = capacity_for(cf, num_tokens=num_tokens, num_experts=E, k=k, alignment=alignment)
        if C != want and not (world > 1 and C > want):
            raise ValueError(f"moe: injected routing has capacity {C}; this spec (capacity_factor={cf}, T="
                             f"{num_tokens}, E={E}, k={k}, alignment={alignment}) gives {want}: {fix}")
        return
    if not _plain_tensor(routing.counts) or not routing.counts.numel():
        return   # traced or vmapped counts: the load cannot be read here
    load = int(routing.counts.max())
    want = capacity_for(cf, num_tokens=num_tokens, num_experts=E, k=k, max_load=load, alignment=alignment)
    ok = C >= min(want, load) if world > 1 else min(C, load) == min(want, load)
    if not ok:
        mode = "dropless" if cf == 0 else f"capped dropless (capacity_factor={cf})"
        raise ValueError(f"moe: injected routing has capacity {C}, which drops pairs of its largest expert load "
                         f"{load}; this spec's {mode} capacity is {want}: {fix}")


def moe(params: dict, x: Tensor, spec: MoESpec, *, comm=None, generator: Optional[torch.Generator] = None,
        noise: Optional[Tensor] = None, training: bool = False, routing: Optional[Routing] = None,
        parallel=None) -> tuple[Tensor, MoEAux]:
    """One MoE layer forward.

    Args:
        params: ``{"gate": ..., "experts": ...}`` (+ "shared", "shared_gate") from :func:`init_params`.
        x: float [..., M]; all leading dims are tokens.
        spec: static settings.
        comm: communicator (None = one process).
        generator, noise: router randomness (Tutel gate noise, Mixtral jitter; training only)
            and the quantized-training recipe's stochastic rounding.
        training: enables gate noise / jitter.
        routing: a recorded :class:`Routing` to replay instead of routing (then ``l_aux`` is 0
            and no gradient reaches the gate).
        parallel: :class:`fmoe.parallel.ParallelSpec` for this call only (mode
            'data'/'model'/'adaptive:r', overlap degree, 2DH local size, wire precision);
            used when ``comm.size > 1``. Padded capacity is aligned to s*d.

    Returns:
        y with x's leading dims, last dim O, x's dtype; and :class:`MoEAux`.

    A layer called over and over at inference (decode) can be prepared once:
    ``fmoe.prepare(params, spec)(x)`` is this call's result bit for bit (:mod:`fmoe.prepared`).
    """
    comm = resolve(comm)
    alignment = spec.alignment
    if comm.size == 1:
        _check_input(x, spec)
        check_params(params, spec, gate=routing is None)
        if routing is not None:
            _check_replay(routing, x.numel() // spec.model_dim, spec, alignment)
    else:
        if spec.experts.int8_activations:   # the same spec on every rank: each raises, before any collective
            from .engine.kinds import int8_refusal
            raise ValueError(int8_refusal(f"this call is expert parallel over {comm.size} ranks"))
        from . import parallel as _par  # distributed path lives in its own module
        parallel = parallel or _par.ParallelSpec()

        def local_check():
            _check_input(x, spec)
            check_params(params, spec, gate=routing is None, world=comm.size, rank=comm.rank)
            if routing is not None:
                _check_replay(routing, x.numel() // spec.model_dim, spec,
                              _par.capacity_alignment(spec.num_experts, comm.size, parallel, spec.alignment),
                              comm.size)
        # Before any other collective: bad input or ranks that disagree raise everywhere, never hang.
        _par.check_moe_call(comm, spec, parallel, x, params, routing, local_check)
        alignment = _par.capacity_alignment(spec.num_experts, comm.size, parallel, spec.alignment)
    kind = spec.layout_kind(comm.size, parallel.overlap_degree if comm.size > 1 else 1)
    # (x itself where it is [T, M] already: a reshape to its own shape is still a dispatched op)
    tokens = x if x.dim() == 2 else x.reshape(-1, spec.model_dim)
    out = rows = None
    if routing is None:
        routing, out, l_aux, rows = _route(params, tokens, spec, kind, comm=comm, generator=generator,
                                           noise=noise, training=training, alignment=alignment)
    else:   # the injected routing was checked above (_check_replay), before any collective
        l_aux = x.new_zeros(())
    seen = tokens if out is None or out.tokens is None else out.tokens  # Mixtral jitter: experts see it too
    shared = None if spec.shared is None else shared_experts(spec.shared, params, seen.to(x.dtype),
                                                             activation=spec.experts.act())
    dt = expert_dtype(params["experts"], x.dtype)
    compute = seen if seen.dtype == dt else seen.to(dt)   # a self-cast is still a dispatched op
    if comm.size == 1:
        y, dropped = routed_experts(spec.experts, params["experts"], compute, routing, layout_kind=kind,
                                    order=spec.combine, prescore=not spec.is_postscore, plan=spec.plan,
                                    save=spec.save, generator=generator, rows=rows)
    elif spec.experts.takes_plan:
        raise ValueError("custom experts with takes_plan=True run on one process; use takes_plan=False (padded "
                         "[E, C, M] buffers) with expert parallelism")
    else:
        y = _par.expert_stage(spec.experts, params["experts"], compute, routing, comm,
                              dataclasses.replace(parallel, check=False), layout_kind=kind,
                              num_experts=spec.num_experts, output_dim=spec.output_dim,
                              prescore=not spec.is_postscore, order=spec.combine, save=spec.save,
                              generator=generator)
        dropped = routing.num_dropped()
    return finish(x, y, shared, l_aux, routing, dropped, out)


def finish(x: Tensor, y: Tensor, shared, l_aux: Tensor, routing: Routing, dropped: Tensor,
           out: Optional[RouterOutput]) -> tuple[Tensor, MoEAux]:
    """:func:`moe`'s result from the routed experts' y [T, O]: y in x's leading dims and dtype, the
    shared experts' (output, gate) added, and the :class:`MoEAux`."""
    if x.dim() != 2 or torch.compiler.is_compiling():
        # (eager [T, M]: no reshape, a dispatched op. Traced it costs nothing, and dynamo cannot set an
        # attribute on the traced expert op's own output, which fmoe.nn does: y.l_aux)
        y = y.reshape(*x.shape[:-1], y.shape[-1])
    y = y if y.dtype == x.dtype else y.to(x.dtype)
    if shared is not None:
        y = y + shared[0].reshape(y.shape)
    aux = MoEAux(l_aux, routing.counts, dropped, routing, routing.capacity, None if out is None else out.scores,
                 None if out is None else out.logits, None if shared is None else shared[1])
    return y, aux
