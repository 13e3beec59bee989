"""Tutel's ``moe_layer`` over :func:`fmoe.moe`.

The layer holds parameters under Tutel's names and shapes, draws them from
the global RNG in Tutel's order (so the same ``seeds`` give Tutel's initial
weights bit for bit), and calls fmoe's functional core for routing, dispatch,
the expert stage (one process, or expert parallel over the group) and combine.

Tutel conventions kept here, and nowhere else in fmoe:
    * global RNG: ``seeds=(a, b, c)`` reseeds it with b before the experts,
      a + i before gate i and c afterwards; gate noise is ``torch.randn_like``;
    * parameters take ``torch.get_default_dtype()`` (fp32_gate gates: float32);
    * after a forward the layer holds ``l_aux``, ``dispatch_count``,
      ``protected_shape``; per-call ``a2a_ffn_overlap_degree`` / ``adaptive_r``
      overwrite ``a2a_ffn_overlap_degree`` / ``adaptive_degree`` (sticky);
    * ``group=None`` is the job's world group; custom experts get the layer
      itself as ``ctx`` (``ctx.sharded_count``, ``ctx.group``, ...).
"""
from __future__ import annotations

import logging
import math
import re

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...experts import ExpertSpec
from ...moe import GateSpec, MoESpec, moe
from ...nn import _Experts
from ...ops import combine, dispatch
from ...comm import all_to_all
from ...routing import top_k_routing
from ... import losses as _losses
from ._groups import comm_of, session_local_size


_BUILTIN_GATE_KEYS = {"top": {"k", "fp32_gate", "capacity_factor", "gate_noise"},
                      "cosine_top": {"k", "fp32_gate", "capacity_factor", "gate_noise", "proj_dim", "init_t"}}
_FFN_KEYS = {"hidden_size_per_expert", "activation_fn", "activation_fn_with_self", "output_dim", "has_fc1_bias",
             "has_fc2_bias"}
_LLAMA_KEYS = {"hidden_size_per_expert", "activation_fn"}


def _int_experts(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n == 0:
        raise ValueError(f"num_experts_per_device must be a non-zero int (negative -s: s ranks share one "
                         f"expert), got {n!r}")
    return n


class _TopGate(nn.Module):
    """Tutel's 'top' gate: ``wg`` is an ``nn.Linear(M, E, bias=False)`` (state key ``wg.weight``)."""

    def __init__(self, model_dim, num_global_experts, k=1, fp32_gate=False, capacity_factor=1.0, gate_noise=0.0):
        super().__init__()
        self.wg = nn.Linear(model_dim, num_global_experts, bias=False,
                            dtype=torch.float32 if fp32_gate else None)
        self.top_k = min(num_global_experts, int(k))
        self.fp32_gate, self.capacity_factor, self.gate_noise = fp32_gate, capacity_factor, gate_noise

    def params(self) -> dict:
        return {"wg": self.wg.weight}

    def forward(self, x: Tensor) -> Tensor:
        w = self.wg.weight.float() if self.fp32_gate else self.wg.weight
        return F.linear(x.to(w.dtype), w)


class _CosineGate(nn.Module):
    """Tutel's 'cosine_top' gate (projector with bias, temperature capped at ln 100)."""

    def __init__(self, model_dim, num_global_experts, k=1, fp32_gate=False, proj_dim=256, init_t=0.5,
                 capacity_factor=1.0, gate_noise=0.0):
        super().__init__()
        self.top_k = min(num_global_experts, int(k))
        self.fp32_gate, self.capacity_factor, self.gate_noise = fp32_gate, capacity_factor, gate_noise
        self.proj_dim, self.init_t = proj_dim, init_t
        # Registration (and so RNG) order as Tutel: temperature (no draw), projector, similarity matrix.
        self.temperature = nn.Parameter(torch.log(torch.full([1], 1.0 / init_t)))
        self.cosine_projector = nn.Linear(model_dim, proj_dim)
        self.sim_matrix = nn.Parameter(torch.randn(proj_dim, num_global_experts))
        with torch.no_grad():
            self.sim_matrix.normal_(0, 0.01)

    def params(self) -> dict:
        return {"proj_w": self.cosine_projector.weight, "proj_b": self.cosine_projector.bias,
                "sim_matrix": self.sim_matrix, "temperature": self.temperature}

    def forward(self, x: Tensor) -> Tensor:
        dt = torch.float32 if self.fp32_gate else self.sim_matrix.dtype
        proj = F.linear(x.to(dt), self.cosine_projector.weight.to(dt), self.cosine_projector.bias.to(dt))
        logits = F.normalize(proj, dim=1) @ F.normalize(self.sim_matrix.to(dt), dim=0)
        return logits * torch.clamp(self.temperature.to(dt), max=math.log(100.0)).exp()


def _ffn_params(n: int, M: int, H_shard: int, O: int, s: int, has_b1: bool, has_b2: bool, dtype) -> dict:
    """Tutel's ffn initialisation, expert by expert (fc1 then fc2 of each), from the global RNG.

    W1 ~ U(-1/sqrt(M), 1/sqrt(M)) [H/s, M], W2 ~ U(+-1/sqrt(H/s)) [H/s, O], drawn in float32
    as ``rand * (b + b) - b`` and cast; biases zero (fc2 bias: ceil(O/s) per shard)."""
    b1, b2 = 1.0 / math.sqrt(M), 1.0 / math.sqrt(H_shard)
    w1 = torch.empty(n, H_shard, M, dtype=dtype)
    w2 = torch.empty(n, H_shard, O, dtype=dtype)
    for i in range(n):
        w1[i] = (torch.rand([H_shard, M], dtype=torch.float32) * (b1 + b1) - b1).to(dtype)
        w2[i] = (torch.rand([H_shard, O], dtype=torch.float32) * (b2 + b2) - b2).to(dtype)
    p = {"fc1_w": w1, "fc2_w": w2}
    if has_b1:
        p["fc1_b"] = torch.zeros(n, H_shard, dtype=dtype)
    if has_b2:
        p["fc2_b"] = torch.zeros(n, -(-O // s), dtype=dtype)
    return p


def _llama_params(n: int, M: int, H: int, dtype) -> dict:
    """Tutel's llama_ffn initialisation: three flat N(0, 0.01) tensors in W_fc1, W_fc2, W_fc3 order."""
    flat = [torch.empty(n * M * H, dtype=dtype).normal_(0, 0.01) for _ in range(3)]
    return {"gate_w": flat[0].view(n, M, H), "up_w": flat[1].view(n, M, H), "down_w": flat[2].view(n, H, M)}


class _FlatLlamaShards(nn.Module):
    """A llama_ffn expert shared by s ranks, stored as Tutel does: each rank holds a flat chunk of
    ceil(M*H/s) elements of every flattened weight (W_fc1, W_fc2 [1, M, H]; W_fc3 [1, H, M]), drawn
    on that rank from the global RNG.

    :meth:`params` gathers the chunks over this rank's group of s consecutive ranks (differentiable:
    the backward reduce-scatters) and returns this rank's hidden slice in fmoe's sharded layout
    (gate_w/up_w [1, M, H/s], down_w [1, H/s, M]), so fmoe's expert parallel runs every parallel
    degree r correctly (Tutel's llama ignores r and multiplies its output by r for r > 1).
    """

    def __init__(self, M: int, H: int, s: int, dtype):
        super().__init__()
        self.M, self.H, self.s = M, H, s
        chunk = -(-M * H // s)
        for name in ("W_fc1", "W_fc2", "W_fc3"):  # Tutel's registration and draw order
            self.register_parameter(name, nn.Parameter(torch.empty(chunk, dtype=dtype).normal_(0, 0.01)))

    def params(self) -> dict:
        from . import net
        group = net.create_groups_from_world(group_count=-self.s).model_group
        j, h = net.get_world_rank(group), self.H // self.s

        def full(w, shape):
            return net.zero_gather(w, group=group).reshape(-1)[:self.M * self.H].view(shape)

        gate, up = full(self.W_fc1, (1, self.M, self.H)), full(self.W_fc2, (1, self.M, self.H))
        down = full(self.W_fc3, (1, self.H, self.M))
        return {"gate_w": gate[:, :, j * h:(j + 1) * h], "up_w": up[:, :, j * h:(j + 1) * h],
                "down_w": down[:, j * h:(j + 1) * h]}

    def extra_repr(self) -> str:
        return f"llama_ffn shard 1/{self.s} of [1, {self.M}, {self.H}]"


def _no_init(num_experts, model_dim, spec, generator, dtype):
    return {}


class MOELayer(nn.Module):
    """Tutel's ``moe_layer`` (see the module docstring for the conventions kept).

    Args (Tutel's):
        gate_type: dict or list of dicts: ``{'type': 'top' | 'cosine_top', 'k', 'capacity_factor',
            'gate_noise', 'fp32_gate', 'proj_dim', 'init_t'}`` or ``{'type': 'custom', 'module': cls,
            ...}`` (``cls(model_dim=, num_global_experts=, **rest)`` returns logits [T, E] from
            ``forward(x)`` and has ``top_k``).
        model_dim: M.
        experts: ``{'type': 'ffn' | 'llama_ffn' | 'custom', 'num_experts_per_device' (or
            'count_per_node'; negative -s: s ranks share one expert), 'hidden_size_per_expert',
            'activation_fn' | 'activation_fn_with_self', 'has_fc1_bias', 'has_fc2_bias',
            'output_dim', 'module'}``; a custom module is built as ``cls(model_dim=,
            num_experts_per_device=, sharded_count=, **rest)`` (or with ``local_experts=``, Tutel's
            old name) and called as ``forward(x [n, C, M], ctx)`` with this layer as ctx.
        scan_expert_func: ``fn(name, param)`` called on every expert parameter.
        result_func: ``forward`` returns ``result_func(y)``; ``y.l_aux`` is set before.
        group: torch process group or fmoe communicator (None: the job's world).
        seeds: (gate seed, expert seed, after seed) for the global RNG; None entries skip.
        a2a_ffn_overlap_degree: capacity chunks; capacity is a multiple of s * degree.
        is_postscore, batch_prioritized_routing, normalize_gate, is_gshard_loss: routing options.
        parallel_type: 'adaptive:r', 'data', 'model' or 'auto' (Tutel's 'auto' is 'data').
        use_2dh: two-level all-to-all with the session's ``local_size``.
        pad_samples: accepted and ignored (Tutel deprecated it; fmoe never pads samples).
        megablocks_size, inequivalent_tokens: accepted; no-ops (see README).
    """

    @staticmethod
    def global_expert_count(num_local_experts, group=None) -> int:
        """E for n experts per rank over the group (n < 0: -n ranks share each expert)."""
        n = _int_experts(num_local_experts)
        W = comm_of(group).size
        if n > 0:
            return n * W
        if W % -n:
            raise ValueError(f"{-n} ranks cannot share an expert evenly in a group of {W} ranks")
        return W // -n

    def __init__(self, gate_type, model_dim: int, experts=None, scan_expert_func=None, result_func=None,
                 group=None, seeds=None, a2a_ffn_overlap_degree: int = 1, is_postscore: bool = True,
                 batch_prioritized_routing: bool = False, normalize_gate: bool = True, is_gshard_loss: bool = True,
                 parallel_type: str = "adaptive:1", use_2dh: bool = False, **kwargs):
        super().__init__()
        if "pad_samples" in kwargs:
            logging.warning("`pad_samples` is deprecated in Tutel and ignored: fmoe never pads samples.")
            kwargs.pop("pad_samples")
        self.megablocks_size = int(kwargs.pop("megablocks_size", 0))
        self.inequivalent_tokens = bool(kwargs.pop("inequivalent_tokens", False))
        if kwargs:
            raise TypeError(f"moe_layer: unrecognized argument(s) {sorted(kwargs)}")
        if not isinstance(experts, dict) or "type" not in experts:
            raise ValueError(f"experts must be a dict with a 'type' key, got {experts!r}")
        if not isinstance(a2a_ffn_overlap_degree, int) or not 1 <= a2a_ffn_overlap_degree <= 32:
            raise ValueError(f"a2a_ffn_overlap_degree must be an int in [1, 32], got {a2a_ffn_overlap_degree!r}")
        experts = dict(experts)  # Tutel pops keys from the caller's dict; fmoe never mutates it
        self.group = group
        self.comm = comm_of(group)
        self.result_func = result_func
        self.model_dim = model_dim

        n = experts.pop("count_per_node") if "count_per_node" in experts else experts.pop("num_experts_per_device", 1)
        n = 1 if n == -1 else _int_experts(n)
        E = self.global_expert_count(n, self.comm)
        self.register_buffer("_num_global_experts", torch.tensor(E))
        W = self.world_size = self.comm.size
        self.sharded_count = W // E if E < W else 1
        self.num_local_experts = 1 if E < W else n
        s = self.sharded_count

        self.auto_parallel, self.use_model_parallel = False, True
        self.valid_rs = [0] + [i for i in range(1, s + 1) if s % i == 0]
        self.adaptive_degree = s
        if isinstance(parallel_type, str) and parallel_type.startswith("adaptive:"):
            try:
                r = int(parallel_type.split(":", 1)[1])
            except ValueError:
                raise ValueError(f"parallel_type {parallel_type!r}: 'adaptive:' needs an integer") from None
            self.adaptive_degree = min(max(r, 0), s)
            if self.adaptive_degree not in self.valid_rs:
                raise ValueError(f"parallel_type {parallel_type!r} gives r={self.adaptive_degree}, expected one of "
                                 f"{self.valid_rs}")
        elif parallel_type in ("data", "auto"):  # Tutel's 'auto' heuristic is unreachable: it runs as 'data'
            self.adaptive_degree = 1
        elif parallel_type == "model":
            self.adaptive_degree = s
        else:
            raise ValueError(f"parallel_type must be 'adaptive:<r>', 'data', 'model' or 'auto', got {parallel_type!r}")
        self.parallel_type = parallel_type
        self.is_postscore, self.batch_prioritized_routing = is_postscore, batch_prioritized_routing
        self.normalize_gate, self.is_gshard_loss = normalize_gate, is_gshard_loss
        self.a2a_ffn_overlap_degree = a2a_ffn_overlap_degree
        self.use_2dh = use_2dh

        dtype = torch.get_default_dtype()
        if seeds is not None and seeds[1] is not None:
            torch.manual_seed(seeds[1])
        self._espec = self._build_experts(experts, E, s, dtype)
        if scan_expert_func is not None:
            for name, p in self.experts.named_parameters():
                scan_expert_func(name, p)
        for _, p in self.experts.named_parameters():
            p._tutel_expert = True

        if isinstance(gate_type, str):  # Tutel's deprecated spelling, e.g. 'Top2Gate'
            m = re.fullmatch(r"Top([0-9]+)Gate", gate_type)
            if m is None:
                raise ValueError(f"gate_type string must look like 'Top2Gate', got {gate_type!r}")
            logging.warning("gate_type %r is deprecated in Tutel; use {'type': 'top', 'k': %s}", gate_type, m[1])
            gate_type = {"type": "top", "k": int(m[1])}
        if isinstance(gate_type, dict):
            gate_type = [gate_type]
        if not isinstance(gate_type, (list, tuple)) or not gate_type:
            raise ValueError(f"gate_type must be a dict or a non-empty list of dicts, got {gate_type!r}")
        gates = []
        for gi, cfg in enumerate(gate_type):
            if seeds is not None and seeds[0] is not None:
                torch.manual_seed(seeds[0] + gi)
            gates.append(self._build_gate(cfg, E))
        self.gates = nn.ModuleList(gates)
        if not is_gshard_loss:
            quiet = [i for i, g in enumerate(gates) if isinstance(g, (_TopGate, _CosineGate)) and g.gate_noise <= 0]
            if quiet:
                raise ValueError(f"is_gshard_loss=False (Tutel's load/importance loss) needs gate_noise > 0; gate(s) "
                                 f"{quiet} have none")
        if seeds is not None and len(seeds) > 2 and seeds[2] is not None:
            torch.manual_seed(seeds[2])

    # ----------------------------------------------------------------------- construction

    def _build_experts(self, cfg: dict, E: int, s: int, dtype) -> ExpertSpec:
        etype = cfg.pop("type")
        n, M = self.num_local_experts, self.model_dim
        if etype == "custom":
            if "module" not in cfg:
                raise ValueError("experts type 'custom' needs 'module': an nn.Module class")
            cls = cfg.pop("module")
            cfg.update(model_dim=M, num_experts_per_device=n, sharded_count=s)
            try:
                self.experts = cls(**cfg)
            except TypeError:  # Tutel's fallback for modules written with the old name
                logging.warning("ExpertModule.__init__(.., local_experts, ..) is deprecated in Tutel; rename "
                                "`local_experts` to `num_experts_per_device`.")
                cfg["local_experts"] = cfg.pop("num_experts_per_device")
                self.experts = cls(**cfg)
            layer = self

            def custom_fn(params, x):
                feature = layer._feature_shape
                y = layer.experts(x.view(x.size(0), x.size(1), *feature), layer)
                layer.protected_shape = y.shape
                return y.reshape(y.size(0), y.size(1), -1)
            return ExpertSpec(type="custom", fn=custom_fn, init=_no_init)
        if etype == "ffn":
            unknown = set(cfg) - _FFN_KEYS
            if unknown:
                raise ValueError(f"unknown keys {sorted(unknown)} for experts type 'ffn'; accepted: "
                                 f"{sorted(_FFN_KEYS | {'type', 'num_experts_per_device', 'count_per_node'})}")
            H = cfg.get("hidden_size_per_expert")
            if not isinstance(H, int) or H < 1 or H % s:
                raise ValueError(f"hidden_size_per_expert must be a positive int divisible by the sharding "
                                 f"count {s}, got {H!r}")
            O = cfg.get("output_dim") or M
            act, act_self = cfg.get("activation_fn"), cfg.get("activation_fn_with_self")
            if act is not None and act_self is not None:
                raise ValueError("pass exactly one of activation_fn and activation_fn_with_self")
            if act_self is not None:
                act = lambda x: act_self(x, self.experts)  # noqa: E731 - Tutel passes the expert module
            b1, b2 = cfg.get("has_fc1_bias", True), cfg.get("has_fc2_bias", True)
            spec = ExpertSpec(type="ffn", hidden_size=H, activation=act or F.relu, has_fc1_bias=b1,
                              has_fc2_bias=b2, output_dim=cfg.get("output_dim"))
            self.experts = _Experts(spec, _ffn_params(n, M, H // s, O, s, b1, b2, dtype))
            return spec
        if etype in ("llama_ffn", "gated_ffn"):
            unknown = set(cfg) - _LLAMA_KEYS
            if unknown:
                raise ValueError(f"unknown keys {sorted(unknown)} for experts type {etype!r}; accepted: "
                                 f"{sorted(_LLAMA_KEYS | {'type', 'num_experts_per_device', 'count_per_node'})}")
            H = cfg.get("hidden_size_per_expert")
            if not isinstance(H, int) or H < 1 or H % s:
                raise ValueError(f"hidden_size_per_expert must be a positive int divisible by the sharding "
                                 f"count {s}, got {H!r}")
            spec = ExpertSpec(type="gated_ffn", hidden_size=H, activation=cfg.get("activation_fn") or F.silu)
            if s == 1:
                self.experts = _Experts(spec, _llama_params(n, M, H, dtype))
            else:
                if self.comm.size != comm_of(None).size:
                    raise ValueError("llama_ffn experts shared by several ranks need the world group (Tutel "
                                     "gathers their flat shards over groups of the world)")
                self.experts = _FlatLlamaShards(M, H, s, dtype)
            return spec
        raise ValueError(f"unknown experts type {etype!r}; expected 'ffn', 'llama_ffn' or 'custom'")

    def _build_gate(self, cfg: dict, E: int) -> nn.Module:
        if not isinstance(cfg, dict) or "type" not in cfg:
            raise ValueError(f"each gate_type must be a dict with a 'type' key, got {cfg!r}")
        cfg = dict(cfg)
        gtype = cfg.pop("type")
        if gtype == "custom":
            if "module" not in cfg:
                raise ValueError("gate type 'custom' needs 'module': an nn.Module class returning logits [T, E]")
            cls = cfg.pop("module")
            gate = cls(model_dim=self.model_dim, num_global_experts=E, **cfg)
            if not hasattr(gate, "top_k"):
                raise ValueError(f"custom gate {cls.__name__} must set self.top_k")
            if not hasattr(gate, "gate_noise"):
                gate.gate_noise = cfg.get("gate_noise", 0.0)
            if not hasattr(gate, "capacity_factor"):
                gate.capacity_factor = cfg.get("capacity_factor", 1.0)
            return gate
        if gtype not in _BUILTIN_GATE_KEYS:
            raise ValueError(f"unknown gate type {gtype!r}; expected 'top', 'cosine_top' or 'custom'")
        unknown = set(cfg) - _BUILTIN_GATE_KEYS[gtype]
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)} for gate type {gtype!r}; accepted: "
                             f"{sorted(_BUILTIN_GATE_KEYS[gtype] | {'type'})}")
        k = cfg.get("k", 1)
        if isinstance(k, bool) or int(k) != k or int(k) < 1:
            raise ValueError(f"gate k must be an int >= 1 (shard experts with a negative "
                             f"num_experts_per_device instead), got {k!r}")
        cfg["k"] = int(k)
        return (_TopGate if gtype == "top" else _CosineGate)(self.model_dim, E, **cfg)

    # ----------------------------------------------------------------------- Tutel API

    @property
    def num_global_experts(self) -> int:
        return int(self._num_global_experts)

    def get_parameter_iterator(self, param_type: str):
        """``named_parameters()`` of the gates ('gate') or of this rank's experts ('local_experts')."""
        if param_type == "gate":
            return self.gates.named_parameters()
        if param_type == "local_experts":
            return self.experts.named_parameters()
        raise ValueError(f"param_type must be 'gate' or 'local_experts', got {param_type!r}")

    def extra_repr(self) -> str:
        ks = [f"k={g.top_k}, noise={g.gate_noise}" for g in self.gates]
        return f"Top-K(s) = {ks}, Total-Experts = {self.num_global_experts} [managed by {self.world_size} device(s)],"

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "_num_global_experts"
        if key not in state_dict:
            logging.warning("loading a legacy Tutel checkpoint without %s; assuming %d global experts",
                            key, self.num_global_experts)
            state_dict[key] = self._num_global_experts
        elif int(state_dict[key]) != self.num_global_experts:
            error_msgs.append(f"checkpoint has {int(state_dict[key])} global experts ({key}), this layer has "
                              f"{self.num_global_experts}; convert it with fmoe.checkpoint")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    # ----------------------------------------------------------------------- forward

    def _expert_params(self):
        if isinstance(self.experts, (_Experts, _FlatLlamaShards)):
            return self.experts.params()
        return dict(self.experts.named_parameters())

    def _spec(self, gate, k: int, cf: float, alignment: int) -> MoESpec:
        builtin = isinstance(gate, (_TopGate, _CosineGate))
        gspec = GateSpec(type="cosine_top" if isinstance(gate, _CosineGate) else "top", k=k, capacity_factor=cf,
                         gate_noise=float(gate.gate_noise), fp32_gate=bool(getattr(gate, "fp32_gate", False)),
                         **({"proj_dim": gate.proj_dim, "init_t": gate.init_t} if isinstance(gate, _CosineGate)
                            else {}))
        return MoESpec(model_dim=self._flat_dim, num_experts=self.num_global_experts, experts=self._espec,
                       gate=gspec, is_postscore=self.is_postscore, batch_prioritized=self.batch_prioritized_routing,
                       normalize_gate=self.normalize_gate, is_gshard_loss=self.is_gshard_loss or not builtin,
                       alignment=alignment)

    def _parallel(self, d: int):
        if self.world_size == 1:
            return None
        from ...parallel import ParallelSpec
        local = None
        if self.use_2dh:
            # Ranks per node come from the session (torchrun's LOCAL_WORLD_SIZE); 1 or W is the flat path.
            local = session_local_size()
            local = local if 1 < local < self.world_size else None
        return ParallelSpec(mode=f"adaptive:{self.adaptive_degree}", overlap_degree=d, local_size=local)

    def _custom_route(self, gate, x: Tensor, k: int, cf: float, alignment: int):
        """Routing and l_aux of a custom gate module (its ``forward(x)`` gives logits [T, E])."""
        logits = gate(x)
        noisy = logits
        if self.training and gate.gate_noise > 0:
            noisy = logits + torch.randn_like(logits) * (gate.gate_noise / logits.shape[-1])
        scores = torch.softmax(noisy, dim=1)
        comm = self.comm if self.world_size > 1 else None
        routing = top_k_routing(scores, k, cf, normalize=self.normalize_gate,
                                batch_prioritized=self.batch_prioritized_routing, alignment=alignment, comm=comm)
        if self.is_gshard_loss:
            l_aux = _losses.gshard_loss(scores, routing.expert_ids[0])
        else:
            l_aux = _losses.load_importance_loss(logits, noisy, k, float(gate.gate_noise))
        return routing, l_aux

    def _sharded_custom_experts(self, x: Tensor, routing) -> Tensor:
        """Tutel's data flow for custom experts shared by s = W/E ranks (the module gathers its own shards)."""
        buffers = dispatch(x, routing, weighted=not self.is_postscore)       # [E, C, M]
        E, W, r = self.num_global_experts, self.world_size, self.adaptive_degree
        if r == 0:
            y = self._espec.fn(None, buffers)
        else:
            y = buffers.repeat(1, r, 1) if r > 1 else buffers
            y = all_to_all(y.reshape(W, -1, y.size(2)), self.comm, 1, 0)
            y = self._espec.fn(None, y)
            y = all_to_all(y, self.comm, 0, 1)
            y = y.reshape(E, r, -1, y.size(2)).sum(1)
        return combine(y, routing, weighted=self.is_postscore)

    def forward(self, input: Tensor, gate_index: int = 0, capacity_factor=None, top_k=None,
                a2a_ffn_overlap_degree=None, reserve_dims: int = 1, inequivalent_tokens: bool = False,
                adaptive_r=None, megablocks_size: int = 0):
        """input [..., *feature] (``reserve_dims`` trailing feature dims) -> [..., *out] with ``.l_aux``."""
        del inequivalent_tokens  # capacity inputs are always group-agreed
        original_shape, original_dtype = input.shape, input.dtype
        if input.dim() < 2 or not 1 <= reserve_dims < input.dim():
            raise ValueError(f"input must be [..., *feature] with 1 <= reserve_dims < input.dim(); got shape "
                             f"{tuple(original_shape)}, reserve_dims={reserve_dims}")
        if not input.is_floating_point():   # cast back at the end, an int input would truncate y silently
            raise TypeError(f"moe_layer: input must be floating point, got dtype {input.dtype}: pass "
                            f"input.float() (or the model's dtype)")
        self._feature_shape = tuple(original_shape[-reserve_dims:])
        self._flat_dim = math.prod(self._feature_shape)
        if self._flat_dim != self.model_dim:
            raise ValueError(f"moe_layer: input's feature size is {self._flat_dim} (shape {tuple(original_shape)}, "
                             f"reserve_dims={reserve_dims} trailing feature dims), but the layer was built with "
                             f"model_dim={self.model_dim}")
        x = input.reshape(-1, self._flat_dim)
        for p in self.experts.parameters():
            x = x.to(p.dtype)
            break
        if not 0 <= gate_index < len(self.gates):
            raise IndexError(f"gate_index {gate_index} out of range for {len(self.gates)} gate(s)")
        gate = self.gates[gate_index]
        if a2a_ffn_overlap_degree is not None:  # sticky, as in Tutel (scripts read it back)
            self.a2a_ffn_overlap_degree = a2a_ffn_overlap_degree
        d = self.a2a_ffn_overlap_degree
        if adaptive_r is not None:  # sticky, as in Tutel
            if adaptive_r not in self.valid_rs:
                raise ValueError(f"adaptive_r={adaptive_r} is not one of {self.valid_rs}")
            self.adaptive_degree = adaptive_r
        self.megablocks_size = megablocks_size  # accepted; the CPU path has no sparse-block GEMM
        k = top_k or gate.top_k
        cf = gate.capacity_factor if capacity_factor is None else capacity_factor
        W = self.world_size
        # Tutel rounds capacity to a multiple of s * d; on one process that is d.
        alignment = d if W == 1 else 1
        if W > 1:
            from ...parallel import capacity_alignment
            route_alignment = capacity_alignment(self.num_global_experts, W, self._parallel(d))
        else:
            route_alignment = d
        spec = self._spec(gate, k, cf, alignment)
        builtin = isinstance(gate, (_TopGate, _CosineGate))
        custom_sharded = self._espec.type == "custom" and self.sharded_count > 1
        self.protected_shape = None
        if builtin and not custom_sharded:
            noise = None
            if self.training and gate.gate_noise > 0:
                dt = torch.float32 if gate.fp32_gate else next(gate.parameters()).dtype
                noise = torch.randn(x.shape[0], self.num_global_experts, dtype=dt)  # Tutel: randn_like(logits)
            params = {"gate": gate.params(), "experts": self._expert_params()}
            y, aux = moe(params, x, spec, comm=self.comm if W > 1 else None, noise=noise, training=self.training,
                         parallel=self._parallel(d))
            l_aux, counts = aux.l_aux, aux.counts
        else:
            if builtin:
                logits = gate(x)
                gate = _LogitsGate(logits, gate)
            routing, l_aux = self._custom_route(gate, x, k, cf, route_alignment)
            counts = routing.counts
            if custom_sharded:
                y = self._sharded_custom_experts(x, routing)
            else:
                # The gate is outside fmoe's spec: pass a zero-stride placeholder so the parameter
                # check passes; the replayed routing carries the gate's gradient.
                params = {"gate": {"wg": x.new_zeros(()).expand(self.num_global_experts, self._flat_dim)},
                          "experts": self._expert_params()}
                y, _ = moe(params, x, spec, comm=self.comm if W > 1 else None, routing=routing,
                           training=self.training, parallel=self._parallel(d))
        self.dispatch_count = counts
        lead = list(original_shape[:-reserve_dims])
        if self.protected_shape is not None:
            y = y.view(lead + list(self.protected_shape[-reserve_dims:]))
        elif reserve_dims > 1 and y.shape[-1] == self._flat_dim:
            y = y.view(original_shape)
        else:
            y = y.view(lead + [y.shape[-1]])
        y = y.to(original_dtype)
        self.l_aux = y.l_aux = l_aux
        return self.result_func(y) if self.result_func is not None else y


class _LogitsGate:
    """A built-in gate whose logits were already computed (custom-sharded expert path)."""

    def __init__(self, logits, gate):
        self._logits, self.gate_noise = logits, gate.gate_noise

    def __call__(self, x):
        return self._logits


moe_layer = MOELayer
