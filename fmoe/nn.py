"""``MoELayer``: the nn.Module at the user's edge, a drop-in for Tutel's ``moe_layer``.

The module only *holds* parameters (under Tutel's state-dict names and shapes,
so a Tutel checkpoint loads directly) and calls :func:`fmoe.moe`. Per-call
overrides (``top_k``, ``capacity_factor``, ...) build a new static spec for
that call only; nothing in the module changes during forward.

Tutel compatibility notes:
    * ``forward`` returns the output tensor with ``l_aux`` set on it, as Tutel
      does (``y.l_aux``). Pass ``return_aux=True`` to get ``(y, MoEAux)``
      instead; the functional core never attaches anything to tensors.
    * The layer does not store ``l_aux``/``dispatch_count`` on itself (that is
      hidden state); read them from ``aux``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .comm.launch import launched_world
from .experts import EXPERT_PARAMS, ExpertSpec
from .moe import GateSpec, MoEAux, MoESpec, init_params, moe

__all__ = ["MoELayer", "moe_layer"]

_GATE_KEYS = {"type", "k", "capacity_factor", "gate_noise", "fp32_gate", "proj_dim", "init_t", "score_fn"}
_EXPERT_KEYS = {"type", "num_experts_per_device", "count_per_node", "hidden_size_per_expert", "activation_fn",
                "has_fc1_bias", "has_fc2_bias", "output_dim"}
_PARALLEL_TYPES = ("data", "model")


def _gate_spec(cfg: dict) -> GateSpec:
    if not isinstance(cfg, dict) or "type" not in cfg:
        raise ValueError(f"gate_type must be a dict with a 'type' key (or a list of such dicts), got {cfg!r}")
    unknown = set(cfg) - _GATE_KEYS
    if unknown:
        raise ValueError(f"unknown gate_type keys {sorted(unknown)}; accepted: {sorted(_GATE_KEYS)}")
    kw = {k: v for k, v in cfg.items() if k in _GATE_KEYS}
    if "k" in kw and not isinstance(kw["k"], bool) and isinstance(kw["k"], float) and kw["k"].is_integer():
        kw["k"] = int(kw["k"])
    return GateSpec(**kw)


def _expert_spec(cfg: dict) -> tuple[ExpertSpec, int]:
    if not isinstance(cfg, dict) or "type" not in cfg:
        raise ValueError(f"experts must be a dict with a 'type' key, got {cfg!r}")
    unknown = set(cfg) - _EXPERT_KEYS
    if unknown:
        raise ValueError(f"unknown experts keys {sorted(unknown)}; accepted: {sorted(_EXPERT_KEYS)}")
    n = cfg.get("num_experts_per_device", cfg.get("count_per_node", 1))
    if isinstance(n, bool) or not isinstance(n, int) or n == 0:
        raise ValueError(f"num_experts_per_device must be a non-zero int (negative = ranks sharing one "
                         f"expert), got {n!r}")
    etype = cfg["type"]
    if etype == "custom":
        raise ValueError("use MoELayer(custom_expert=ExpertSpec(type='custom', fn=..., init=...)) for custom experts")
    spec = ExpertSpec(
        type=etype,
        hidden_size=cfg.get("hidden_size_per_expert", 0),
        activation=cfg.get("activation_fn"),
        has_fc1_bias=cfg.get("has_fc1_bias", True),
        has_fc2_bias=cfg.get("has_fc2_bias", True),
        output_dim=cfg.get("output_dim"),
    )
    return spec, n


def _parse_parallel_type(parallel_type: str) -> str:
    if parallel_type in _PARALLEL_TYPES:
        return parallel_type
    if parallel_type == "auto":   # Tutel's 'auto' heuristic is unreachable there too: it runs as 'data'
        return "data"
    if isinstance(parallel_type, str) and parallel_type.startswith("adaptive:"):
        try:
            int(parallel_type.split(":", 1)[1])
        except ValueError:
            pass
        else:
            return parallel_type
    raise ValueError(f"parallel_type must be 'data', 'model', 'auto' or 'adaptive:<int>', got {parallel_type!r}")


class _LinearGate(nn.Module):
    def __init__(self, p: dict):
        super().__init__()
        self.wg = nn.Module()
        self.wg.weight = nn.Parameter(p["wg"])

    def params(self) -> dict:
        return {"wg": self.wg.weight}


class _CosineGate(nn.Module):
    def __init__(self, p: dict):
        super().__init__()
        self.cosine_projector = nn.Module()
        self.cosine_projector.weight = nn.Parameter(p["proj_w"])
        self.cosine_projector.bias = nn.Parameter(p["proj_b"])
        self.sim_matrix = nn.Parameter(p["sim_matrix"])
        self.temperature = nn.Parameter(p["temperature"])

    def params(self) -> dict:
        return {"proj_w": self.cosine_projector.weight, "proj_b": self.cosine_projector.bias,
                "sim_matrix": self.sim_matrix, "temperature": self.temperature}


class _Experts(nn.Module):
    """Expert parameters under Tutel's names.

    ffn: batched_fc1_w [n, H, M], batched_fc2_w [n, H, O], batched_fc1_bias [n, H],
    batched_fc2_bias [n, O]. gated_ffn (Tutel llama_ffn): W_fc1/W_fc2 [n, H, M] and W_fc3
    [n, O, H], out x in (nn.Linear's order); :meth:`params` gives them as Tutel's x @ W views
    [n, M, H] / [n, M, H] / [n, H, O]. The state dict holds Tutel's flat tensors ([n*M*H], the
    elements of those x @ W views in row-major order; copies, not the Parameters), and loading
    takes them back. The out x in storage is for decode: MKL multiplies a few rows by an
    nn.Linear-order weight straight from memory, where an x @ W operand is first repacked
    (T 16 / 64, E 64, k 6: 0.80x / 0.73x the step time, training steps 0.98-1.01x; suite
    gemm_calls, BENCHMARKS.md "Session 6").
    Custom experts: the pytree's leaves under their own (dotted) names.
    """

    # pytree key -> Tutel's state-dict name, from the one parameter-layout table
    _FFN = {p.name: p.tutel_name for p in EXPERT_PARAMS["ffn"]}
    _GATED = {p.name: p.tutel_name for p in EXPERT_PARAMS["gated_ffn"]}

    def __init__(self, spec: ExpertSpec, p: dict):
        super().__init__()
        self.kind = spec.type
        self._shapes = {}
        if spec.type == "ffn":
            for key, name in self._FFN.items():
                if key in p:
                    self.register_parameter(name, nn.Parameter(p[key]))
        elif spec.type == "gated_ffn":
            for key, name in self._GATED.items():
                self._shapes[name] = tuple(p[key].shape)
                self.register_parameter(name, nn.Parameter(p[key].transpose(1, 2).contiguous()))
            self.register_state_dict_post_hook(_Experts._tutel_order)
        else:
            flat, self._treespec = torch.utils._pytree.tree_flatten(p)
            for i, leaf in enumerate(flat):
                self.register_parameter(f"p{i}", nn.Parameter(leaf))

    def params(self):
        if self.kind == "ffn":
            return {key: getattr(self, name) for key, name in self._FFN.items() if hasattr(self, name)}
        if self.kind == "gated_ffn":
            return {key: getattr(self, name).transpose(1, 2) for key, name in self._GATED.items()}
        leaves = [getattr(self, f"p{i}") for i in range(self._treespec.num_leaves)]
        return torch.utils._pytree.tree_unflatten(leaves, self._treespec)

    @staticmethod
    def _tutel_order(module, state_dict, prefix, local_metadata) -> None:
        """State-dict post-hook: the gated weights as Tutel stores them, flat in x @ W order."""
        for name in module._GATED.values():
            key = prefix + name
            if key in state_dict:
                state_dict[key] = state_dict[key].detach().transpose(1, 2).reshape(-1)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        for name, param in self._parameters.items():
            key = prefix + name
            # What a checkpoint holds: the parameter, or for gated weights Tutel's x @ W order.
            shape = self._shapes.get(name, tuple(param.shape))
            if key not in state_dict:
                # Tutel zero-fills missing experts with a warning; a silent zero expert is worse
                # than a failed load (spec §16.14), so this is an error even with strict=False.
                error_msgs.append(f"missing expert parameter {key!r} (expected shape {shape})")
                continue
            stored = state_dict[key]
            expected, got = shape, tuple(stored.shape)
            if got == expected or (stored.numel() == param.numel() and stored.dim() != len(expected)):
                # Converted (resharded) checkpoints and Tutel's flat llama_ffn / [n, 1, H] bias
                # layouts store the same row-major elements with a different number of dims.
                stored = stored.reshape(expected)
                state_dict[key] = stored.transpose(1, 2) if name in self._shapes else stored
                continue
            # Same rank but another shape is a transposed (or mis-sharded) tensor: reshaping it
            # would scramble the weights, and a [1, H] / [E, 1] bias would broadcast silently.
            what = "transposed or permuted" if sorted(got) == sorted(expected) else "wrong shape"
            error_msgs.append(f"expert parameter {key!r}: checkpoint tensor has shape {got}, this layer "
                              f"expects {expected} ({what}; fmoe never reshapes or broadcasts a same-rank "
                              f"tensor on load)")
            # Keep PyTorch's own size-mismatch message out of the way: ours names the problem.
            state_dict[key] = param.detach()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)


def _distributed_world() -> tuple[str, int]:
    """(launcher, ranks) of an initialised multi-process job, or ("", 1).

    Looks only at state the job itself set up (an initialised torch.distributed
    default group, or MPI initialised by mpi4py); importing neither here, so a
    one-process run never initialises MPI as a side effect.
    """
    import sys
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        size = dist.get_world_size()
        if size > 1:
            return "torch.distributed", size
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        size = mpi.COMM_WORLD.Get_size()
        if size > 1:
            return "MPI", size
    return "", 1


def check_not_silently_local(comm, what: str = "MoELayer") -> None:
    """Raise if a multi-rank job would run this layer on one process because ``comm`` is None.

    Without a communicator every rank holds and runs every expert: no expert
    parallelism, negative ``num_experts_per_device`` sharding is lost, and a
    script's gradient all-reduce then averages experts that should differ.
    """
    if comm is not None:
        return
    launcher, size = _distributed_world()
    if size > 1:
        fix = ("comm=fmoe.comm.TorchDistComm() (or TorchDistComm(group) for a sub-group)"
               if launcher == "torch.distributed" else "comm=mpi_backend.MPIComm()")
        raise RuntimeError(
            f"{what}: {launcher} is initialised with {size} ranks but no comm= was given, so every rank would "
            f"run every expert locally (no expert parallelism). Pass {fix}, or fmoe.comm.from_env(); pass "
            f"comm=fmoe.comm.LocalComm() to run this layer on each rank independently on purpose.")
    launcher, size = launched_world()   # started as a job whose communicator was never set up
    if size > 1:
        raise RuntimeError(
            f"{what}: this process is one of {size} ranks started by {launcher}, but no comm= was given and no "
            f"communicator is set up, so every rank would run every expert locally as its own model (no expert "
            f"parallelism). Pass comm=fmoe.comm.from_env() (the job's world), or comm=fmoe.comm.LocalComm() to "
            f"run this layer on each rank independently on purpose.")


class MoELayer(nn.Module):
    """Tutel-compatible MoE layer over :func:`fmoe.moe`.

    Args:
        gate_type: dict (or list of dicts) with ``type`` 'top' | 'cosine_top',
            ``k``, ``capacity_factor``, ``gate_noise``, ``fp32_gate`` (and
            ``proj_dim``/``init_t`` for the cosine gate).
        model_dim: M.
        experts: dict with ``type`` 'ffn' | 'gated_ffn' (alias 'llama_ffn'),
            ``num_experts_per_device``, ``hidden_size_per_expert``,
            ``activation_fn``, ``has_fc1_bias``, ``has_fc2_bias``, ``output_dim``.
        custom_expert: an ``ExpertSpec(type='custom', ...)`` instead of ``experts``
            (then pass ``num_experts``).
        result_func: if given, ``forward`` returns ``result_func(y)`` (``y.l_aux`` is already set).
        comm: communicator (None = one process); W = comm.size. None under an initialised
            torch.distributed / MPI job of more than one rank raises (never silently local):
            pass the job's communicator, or ``LocalComm()`` to run locally on purpose.
        seeds: Tutel's (gate seed, expert seed, after seed) triple; with it,
            experts are drawn from a generator seeded with seeds[1] and gate i
            from seeds[0] + i (fmoe does not touch the global RNG).
        generator: alternatively one explicit generator for everything.
        a2a_ffn_overlap_degree, parallel_type, use_2dh: distributed settings (parallel_type
            'data', 'model', 'adaptive:<r>', or Tutel's 'auto', which runs as 'data')
            (defaults for every call; ``forward`` can override the first two
            for one call). ``use_2dh`` needs ``local_size`` (ranks per node):
            fmoe never reads it from the environment.
        local_size: ranks per node for the 2DH all-to-all.
        is_postscore, batch_prioritized_routing, normalize_gate, is_gshard_loss:
            as in :class:`fmoe.MoESpec`.
        dtype: parameter dtype of the experts (gates stay float32 with fp32_gate).
        pad_samples: accepted for Tutel scripts and ignored (deprecated in Tutel; fmoe never pads).
        plan, save: as in :class:`fmoe.MoESpec` (``plan='layout'``: the layout kernel on
            the layout's buffers, Tutel's arithmetic bit for bit; ``save``: what the expert
            engine keeps for backward, 'projections' | 'recompute').
    """

    def __init__(self, gate_type: Union[dict, Sequence[dict]], model_dim: int, experts: Optional[dict] = None,
                 *, custom_expert: Optional[ExpertSpec] = None, num_experts: Optional[int] = None,
                 result_func: Optional[Callable] = None, comm=None, seeds: Optional[Sequence[int]] = None,
                 generator: Optional[torch.Generator] = None, a2a_ffn_overlap_degree: int = 1,
                 is_postscore: bool = True, batch_prioritized_routing: bool = False, normalize_gate: bool = True,
                 is_gshard_loss: bool = True, parallel_type: str = "adaptive:1", use_2dh: bool = False,
                 dtype: torch.dtype = torch.float32, scan_expert_func=None, group=None,
                 local_size: Optional[int] = None, plan: str = "auto", save: str = "projections",
                 pad_samples: bool = False):
        super().__init__()
        if group is not None:
            raise ValueError("MoELayer takes an explicit communicator: pass comm=fmoe.comm.TorchDistComm(group) "
                             "instead of group=")
        if scan_expert_func is not None:
            raise ValueError("scan_expert_func is not supported: filter expert parameters by name "
                             "('experts.' prefix) instead")
        if (experts is None) == (custom_expert is None):
            raise ValueError("pass exactly one of experts= (a Tutel experts dict) or custom_expert=")
        if not isinstance(a2a_ffn_overlap_degree, int) or not 1 <= a2a_ffn_overlap_degree <= 32:
            raise ValueError(f"a2a_ffn_overlap_degree must be an int in [1, 32], got {a2a_ffn_overlap_degree!r}")
        check_not_silently_local(comm)
        self.comm = comm
        world = 1 if comm is None else comm.size
        if experts is not None:
            espec, n = _expert_spec(experts)
            if n < 0 and world % -n:   # else one process would silently build one whole expert
                raise ValueError(f"num_experts_per_device={n}: {-n} ranks cannot share an expert evenly in a group "
                                 f"of {world} rank{'s' if world != 1 else ''} (comm.size must be a multiple of {-n})")
            num_global = n * world if n > 0 else world // -n
        else:
            if num_experts is None:
                raise ValueError("custom_expert needs num_experts=")
            espec, num_global, n = custom_expert, num_experts, num_experts
        self.num_local_experts = n
        gate_cfgs = [gate_type] if isinstance(gate_type, dict) else list(gate_type)
        if not gate_cfgs:
            raise ValueError("gate_type list is empty")
        base = dict(model_dim=model_dim, num_experts=num_global, experts=espec, is_postscore=is_postscore,
                    batch_prioritized=batch_prioritized_routing, normalize_gate=normalize_gate,
                    is_gshard_loss=is_gshard_loss, plan=plan, save=save)
        self.specs = tuple(MoESpec(gate=_gate_spec(c), **base) for c in gate_cfgs)
        self.parallel_type = _parse_parallel_type(parallel_type)
        self.a2a_ffn_overlap_degree = a2a_ffn_overlap_degree
        self.use_2dh = bool(use_2dh)
        if self.use_2dh and world > 1 and local_size is None:
            raise ValueError("use_2dh=True needs local_size= (ranks per node); fmoe does not read LOCAL_SIZE")
        self.local_size = local_size
        self.result_func = result_func
        self.register_buffer("_num_global_experts", torch.tensor(num_global, dtype=torch.int64))

        def gen(seed_index: int, offset: int = 0):
            if seeds is not None:
                return torch.Generator().manual_seed(int(seeds[seed_index]) + offset)
            return generator

        if n > 0:
            expert_params = init_params(self.specs[0], generator=gen(1), dtype=dtype,
                                        num_local_experts=n)["experts"]
        else:  # one expert shared by -n ranks: draw it whole, keep this rank's shard (spec §12.1)
            from .parallel import shard_experts
            whole = init_params(self.specs[0], generator=gen(1), dtype=dtype,
                                num_local_experts=num_global)["experts"]
            expert_params = shard_experts(espec.type, whole, num_global, 0 if comm is None else comm.rank, world)
        self.experts = _Experts(espec, expert_params)
        gates = []
        for i, spec in enumerate(self.specs):
            gp = init_params(dataclasses.replace(spec, experts=_NO_EXPERTS), generator=gen(0, i), dtype=dtype,
                             num_local_experts=0)["gate"]
            gates.append(_LinearGate(gp) if spec.gate.type == "top" else _CosineGate(gp))
        self.gates = nn.ModuleList(gates)

    @property
    def num_global_experts(self) -> int:
        return int(self._num_global_experts)

    def params(self, gate_index: int = 0) -> dict:
        """The parameter pytree ``{"gate": ..., "experts": ...}`` (views of this module's Parameters)."""
        return {"gate": self.gates[gate_index].params(), "experts": self.experts.params()}

    def spec(self, gate_index: int = 0, *, top_k: Optional[int] = None,
             capacity_factor: Optional[float] = None) -> MoESpec:
        """The static spec of one call, with per-call overrides applied (nothing is stored)."""
        if not 0 <= gate_index < len(self.specs):
            raise IndexError(f"gate_index {gate_index} out of range for {len(self.specs)} gate(s)")
        spec = self.specs[gate_index]
        changes = {}
        if top_k:  # Tutel: 0 or None means "use the gate's k"
            changes["k"] = top_k
        if capacity_factor is not None:
            changes["capacity_factor"] = capacity_factor
        if changes:
            spec = dataclasses.replace(spec, gate=dataclasses.replace(spec.gate, **changes))
        return spec

    def parallel_spec(self, a2a_ffn_overlap_degree: Optional[int] = None, adaptive_r: Optional[int] = None):
        """The :class:`fmoe.parallel.ParallelSpec` of one call (None for one process); nothing is stored."""
        if self.comm is None or self.comm.size == 1:
            return None
        from .parallel import ParallelSpec
        mode = self.parallel_type if adaptive_r is None else f"adaptive:{int(adaptive_r)}"
        d = self.a2a_ffn_overlap_degree if a2a_ffn_overlap_degree is None else a2a_ffn_overlap_degree
        return ParallelSpec(mode=mode, overlap_degree=d, local_size=self.local_size if self.use_2dh else None)

    def forward(self, input: Tensor, gate_index: int = 0, capacity_factor: Optional[float] = None,
                top_k: Optional[int] = None, reserve_dims: int = 1, *, generator: Optional[torch.Generator] = None,
                return_aux: bool = False, routing=None, a2a_ffn_overlap_degree: Optional[int] = None,
                adaptive_r: Optional[int] = None):
        """Args:
            input: [..., M] (or [..., *feature] with ``reserve_dims`` > 1 trailing feature dims).
            gate_index, capacity_factor, top_k: per-call overrides (this call only).
            generator: RNG for gate noise (training mode).
            return_aux: return ``(y, aux)`` instead of ``y`` with ``y.l_aux``.
            routing: a recorded Routing to replay.
            a2a_ffn_overlap_degree, adaptive_r: distributed settings for this call only.
        """
        check_not_silently_local(self.comm)  # the job may have been initialised after construction
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
            raise ValueError(f"top_k must be an int >= 0 (0 = the gate's k), got {top_k!r}")
        spec = self.spec(gate_index, top_k=top_k, capacity_factor=capacity_factor)
        if not isinstance(reserve_dims, int) or reserve_dims < 1 or reserve_dims >= input.dim():
            raise ValueError(f"reserve_dims must be in [1, input.dim()), got {reserve_dims} for shape "
                             f"{tuple(input.shape)}")
        feature = input.shape[input.dim() - reserve_dims:]
        x = input.reshape(*input.shape[:input.dim() - reserve_dims], math.prod(feature))
        y, aux = moe(self.params(gate_index), x, spec, comm=self.comm, generator=generator,
                     training=self.training, routing=routing,
                     parallel=self.parallel_spec(a2a_ffn_overlap_degree, adaptive_r))
        if reserve_dims > 1 and y.shape[-1] == x.shape[-1]:
            y = y.reshape(input.shape)
        if return_aux:
            return y, aux
        y.l_aux = aux.l_aux  # before result_func: Tutel's result_func reads y.l_aux
        if self.result_func is not None:
            return self.result_func(y)
        return y

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        stored = state_dict.get(prefix + "_num_global_experts")
        if stored is not None and int(stored) != self.num_global_experts:
            error_msgs.append(f"checkpoint has {int(stored)} global experts ({prefix}_num_global_experts), "
                              f"this layer has {self.num_global_experts}; convert it with fmoe.checkpoint")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def extra_repr(self) -> str:
        s = self.specs[0]
        return (f"model_dim={s.model_dim}, num_global_experts={s.num_experts}, k={s.gate.k}, "
                f"capacity_factor={s.gate.capacity_factor}, experts={s.experts.type}")


# Gate-only initialisation placeholder: init_params draws the experts first, and a
# gate-only call must not consume expert randomness.
def _no_init(num_experts, model_dim, spec, generator, dtype):
    return {}


_NO_EXPERTS = ExpertSpec(type="custom", fn=lambda p, x: x, init=_no_init)

moe_layer = MoELayer  # Tutel's lowercase alias
