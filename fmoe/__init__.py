from .routing import Routing, top_k_routing
from .ops import dispatch, combine, gate_grad
