"""Tutel's ``tutel.moe``: the layer and the from-scratch routing primitives.

    from fmoe.compat.tutel import moe
    layer = moe.moe_layer(gate_type={'type': 'top', 'k': 2}, model_dim=M, experts={...})
    crit, l_aux = moe.top_k_routing(scores, top_k=2, capacity_factor=0)
    y = moe.fast_decode(expert(moe.fast_encode(x, crit)), crit)
"""
from ._critical import (extract_critical, fast_cumsum_sub_one, fast_decode, fast_encode, get_dispatch_count, get_reversed_sample_ids,
                        get_topk_selection)
from ._layer import MOELayer, moe_layer

top_k_routing = extract_critical

__all__ = ["moe_layer", "MOELayer", "top_k_routing", "fast_cumsum_sub_one", "extract_critical", "fast_encode", "fast_decode",
           "get_reversed_sample_ids", "get_topk_selection", "get_dispatch_count"]
