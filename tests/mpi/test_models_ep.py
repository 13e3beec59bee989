"""Architecture adapters with experts split over ranks equal the single-process block (issue 5)."""
from __future__ import annotations

import math

import pytest
import torch

from fmoe.models import deepseek_v3, gpt_oss, mixtral, qwen3_moe
from _helpers import allclose

H, I = 8, 6


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _swiglu_params(E, seed):
    g = _gen(seed)
    return {"router": {"weight": torch.randn(E, H, generator=g, dtype=torch.float64)},
            "experts": {"gate_up_proj": torch.randn(E, 2 * I, H, generator=g, dtype=torch.float64) / math.sqrt(H),
                        "down_proj": torch.randn(E, H, I, generator=g, dtype=torch.float64) / math.sqrt(I)}}


def _case(arch, E):
    if arch == "qwen3_moe":
        cfg = qwen3_moe.Qwen3MoeBlockConfig(hidden_size=H, num_experts=E, top_k=2, moe_intermediate_size=I,
                                            norm_topk_prob=True)
        return qwen3_moe.moe_block, cfg, _swiglu_params(E, 1)
    if arch == "deepseek_v3":
        cfg = deepseek_v3.DeepseekV3BlockConfig(hidden_size=H, num_experts=E, top_k=2, moe_intermediate_size=I,
                                                n_group=2, topk_group=1, routed_scaling_factor=2.5)
        p = _swiglu_params(E, 2)
        g = _gen(3)
        p["router"]["e_score_correction_bias"] = torch.randn(E, generator=g, dtype=torch.float64) * 0.1
        p["shared"] = {"gate_proj": torch.randn(I, H, generator=g, dtype=torch.float64),
                       "up_proj": torch.randn(I, H, generator=g, dtype=torch.float64),
                       "down_proj": torch.randn(H, I, generator=g, dtype=torch.float64) / 4}
        return deepseek_v3.moe_block, cfg, p
    if arch == "mixtral":
        cfg = mixtral.MixtralBlockConfig(hidden_size=H, num_experts=E, top_k=2, intermediate_size=I)
        return mixtral.moe_block, cfg, _swiglu_params(E, 4)
    cfg = gpt_oss.GptOssBlockConfig(hidden_size=H, num_experts=E, top_k=2, intermediate_size=I)
    g = _gen(5)
    p = {"router": {"weight": torch.randn(E, H, generator=g, dtype=torch.float64),
                    "bias": torch.randn(E, generator=g, dtype=torch.float64)},
         "experts": {"gate_up_proj": torch.randn(E, H, 2 * I, generator=g, dtype=torch.float64) / math.sqrt(H),
                     "gate_up_proj_bias": torch.randn(E, 2 * I, generator=g, dtype=torch.float64) * 0.1,
                     "down_proj": torch.randn(E, I, H, generator=g, dtype=torch.float64) / math.sqrt(I),
                     "down_proj_bias": torch.randn(E, H, generator=g, dtype=torch.float64) * 0.1}}
    return gpt_oss.moe_block, cfg, p


def _local(params, comm, E):
    n = E // comm.size
    mine = slice(comm.rank * n, (comm.rank + 1) * n)
    out = dict(params)
    out["experts"] = {k: v[mine].clone() for k, v in params["experts"].items()}
    return out


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "gpt_oss", "mixtral"])
def test_block_expert_parallel_equals_single_process(comm, arch):
    E = 2 * comm.size
    block, cfg, params = _case(arch, E)
    x = torch.randn(3, 5, H, generator=_gen(100 + comm.rank), dtype=torch.float64)
    y_ref, aux_ref = block(params, x, cfg)
    y, aux = block(_local(params, comm, E), x, cfg, comm=comm)
    allclose(y, y_ref, f"{arch} rank {comm.rank}", atol=1e-12)
    assert int(aux.routing.num_dropped()) == 0
    assert torch.equal(aux.routing.expert_ids, aux_ref.routing.expert_ids)
