"""fmoe: functional Mixture-of-Experts for PyTorch.

Stateless primitives over explicit parameter pytrees, composed at the user's edge:

    spec = fmoe.MoESpec(model_dim=512, num_experts=8,
                        gate=fmoe.GateSpec(k=2), experts=fmoe.ExpertSpec(hidden_size=1024))
    params = fmoe.init_params(spec, generator=torch.Generator().manual_seed(0))
    y, aux = fmoe.moe(params, x, spec)

Data flows one way: routers -> routing -> layout -> ops -> experts -> moe (and a layer's
prepared inference call, ``fmoe.prepare``) -> the edge (nn, compat, models). Research helpers
(``fmoe.ablate``, ``fmoe.stats``) are imported by name.
"""
from . import comm, experts, losses, ops, routers
from .experts import ExpertSpec
from .layout import Layout, make_layout
from .moe import MoEAux, MoESpec, check_params, init_params, moe, route
from .ops import combine, dispatch, gate_grad
from .prepared import PreparedMoE, prepare
from .routers import GateSpec
from .routing import Routing, assign_slots, capacity_for, make_routing, top_k, top_k_routing

__version__ = "0.1.0"

__all__ = [
    "Routing", "top_k", "assign_slots", "capacity_for", "make_routing", "top_k_routing",
    "Layout", "make_layout", "dispatch", "combine", "gate_grad",
    "ExpertSpec", "GateSpec", "MoESpec", "MoEAux", "init_params", "moe", "route", "check_params",
    "PreparedMoE", "prepare",
    "comm", "experts", "losses", "ops", "routers",
]
