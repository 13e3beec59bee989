"""fmoe.models.load_moe_block: tiny checkpoints written under the official names (spec
architectures.md §1.4, §2-§8; formats.md §4-§5) load into fmoe pytrees and give the same block.

Needs safetensors (CI: pip install safetensors); the save_pretrained round trip also needs transformers.
"""
import json
import math
import os

import pytest
import torch

safetensors_torch = pytest.importorskip("safetensors.torch")

from fmoe.models import deepseek_v3, gpt_oss, load_moe_block, mixtral, qwen2_moe, qwen3_moe  # noqa: E402
from fmoe.quant import (QuantizedTensor, quantize_fp8_block, quantize_mxfp4, quantize_nvfp4,  # noqa: E402
                        to_deepseek_fp8, to_gpt_oss, to_modelopt_nvfp4)

H, I, E = 128, 128, 4


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _w(*shape, g, dtype=torch.bfloat16):
    return (torch.randn(*shape, generator=g) / math.sqrt(shape[-1])).to(dtype)


def _save(d, tensors, config=None, name="model.safetensors"):
    os.makedirs(d, exist_ok=True)
    safetensors_torch.save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(d, name))
    if config is not None:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(config, f)


def _per_expert(prefix, g, names=("gate_proj", "up_proj", "down_proj")):
    sd, gate, up, down = {}, [], [], []
    for m in range(E):
        gate.append(_w(I, H, g=g))
        up.append(_w(I, H, g=g))
        down.append(_w(H, I, g=g))
        sd[f"{prefix}experts.{m}.{names[0]}.weight"] = gate[-1]
        sd[f"{prefix}experts.{m}.{names[1]}.weight"] = up[-1]
        sd[f"{prefix}experts.{m}.{names[2]}.weight"] = down[-1]
    fused = {"gate_up_proj": torch.cat([torch.stack(gate), torch.stack(up)], 1), "down_proj": torch.stack(down)}
    return sd, fused


QWEN3_CFG = {"model_type": "qwen3_moe", "hidden_size": H, "num_experts": E, "num_experts_per_tok": 2,
             "moe_intermediate_size": I, "norm_topk_prob": True, "num_hidden_layers": 2, "decoder_sparse_step": 1,
             "mlp_only_layers": [], "hidden_act": "silu"}


def test_qwen3_official_names_round_trip(tmp_path):
    g = _g(0)
    sd, fused = _per_expert("model.layers.1.mlp.", g)
    sd["model.layers.1.mlp.gate.weight"] = _w(E, H, g=g)
    sd["model.layers.0.mlp.gate.weight"] = _w(E, H, g=g)        # another layer: not read
    _save(tmp_path, sd, QWEN3_CFG)
    params, cfg = load_moe_block(str(tmp_path), "qwen3_moe", 1)
    assert cfg == qwen3_moe.Qwen3MoeBlockConfig(hidden_size=H, num_experts=E, top_k=2, moe_intermediate_size=I,
                                                norm_topk_prob=True)
    assert torch.equal(params["experts"]["gate_up_proj"], fused["gate_up_proj"])   # gate rows first
    assert torch.equal(params["experts"]["down_proj"], fused["down_proj"])
    assert torch.equal(params["router"]["weight"], sd["model.layers.1.mlp.gate.weight"])
    # The same from an in-memory state dict, and a float32 cast on request.
    p2, _ = load_moe_block(sd, "qwen3_moe", 1, config=QWEN3_CFG, dtype=torch.float32)
    assert p2["experts"]["down_proj"].dtype == torch.float32
    x = torch.randn(10, H, generator=g).to(torch.bfloat16)
    y, _ = qwen3_moe.moe_block(params, x, cfg)
    y2, _ = qwen3_moe.moe_block({"router": {"weight": sd["model.layers.1.mlp.gate.weight"]}, "experts": fused},
                                x, cfg)
    assert torch.equal(y, y2)


def test_errors_name_the_problem(tmp_path):
    g = _g(1)
    sd, _ = _per_expert("model.layers.0.mlp.", g)
    sd["model.layers.0.mlp.gate.weight"] = _w(E, H, g=g)
    extra = dict(sd, **{"model.layers.0.mlp.experts.0.gate_proj.lora_A": torch.zeros(2)})
    with pytest.raises(ValueError, match="unexpected tensors.*lora_A"):
        load_moe_block(extra, "qwen3_moe", 0, config=QWEN3_CFG)
    missing = {k: v for k, v in sd.items() if "experts.3.up_proj" not in k}
    with pytest.raises(KeyError, match="experts.3.up_proj.weight"):
        load_moe_block(missing, "qwen3_moe", 0, config=QWEN3_CFG)
    with pytest.raises(ValueError, match="dense layer"):
        load_moe_block(sd, "qwen3_moe", 0, config=dict(QWEN3_CFG, mlp_only_layers=[0]))
    with pytest.raises(ValueError, match="needs config"):
        load_moe_block(sd, "qwen3_moe", 0)
    with pytest.raises(ValueError, match="unknown MoE architecture"):
        load_moe_block(sd, "llama", 0, config=QWEN3_CFG)


def test_mixtral_and_qwen2_names(tmp_path):
    g = _g(2)
    sd, fused = _per_expert("model.layers.0.block_sparse_moe.", g, names=("w1", "w3", "w2"))
    sd["model.layers.0.block_sparse_moe.gate.weight"] = _w(E, H, g=g)
    cfg = {"model_type": "mixtral", "hidden_size": H, "num_local_experts": E, "num_experts_per_tok": 2,
           "intermediate_size": I}
    p, c = load_moe_block(sd, "mixtral", 0, config=cfg)
    assert isinstance(c, mixtral.MixtralBlockConfig)
    assert torch.equal(p["experts"]["gate_up_proj"], fused["gate_up_proj"])        # w1 rows, then w3
    sd2, _ = _per_expert("model.layers.0.mlp.", g)
    sd2.update({"model.layers.0.mlp.gate.weight": _w(E, H, g=g),
                "model.layers.0.mlp.shared_expert.gate_proj.weight": _w(96, H, g=g),
                "model.layers.0.mlp.shared_expert.up_proj.weight": _w(96, H, g=g),
                "model.layers.0.mlp.shared_expert.down_proj.weight": _w(H, 96, g=g),
                "model.layers.0.mlp.shared_expert_gate.weight": _w(1, H, g=g)})
    cfg2 = dict(QWEN3_CFG, model_type="qwen2_moe", shared_expert_intermediate_size=96, norm_topk_prob=False)
    p2, c2 = load_moe_block(sd2, "qwen2_moe", 0, config=cfg2)
    assert c2.shared_expert_intermediate_size == 96 and not c2.norm_topk_prob
    assert torch.equal(p2["shared_gate"]["weight"], sd2["model.layers.0.mlp.shared_expert_gate.weight"])
    y, aux = qwen2_moe.moe_block(p2, torch.randn(5, H, generator=g).to(torch.bfloat16), c2)
    assert aux.shared_gate.shape == (5, 1)


DS_CFG = {"model_type": "deepseek_v3", "hidden_size": H, "n_routed_experts": E, "num_experts_per_tok": 2,
          "moe_intermediate_size": I, "n_group": 2, "topk_group": 1, "norm_topk_prob": True,
          "routed_scaling_factor": 2.5, "n_shared_experts": 1, "first_k_dense_replace": 1, "num_hidden_layers": 3,
          "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                  "activation_scheme": "dynamic"}}


def _fp8_linear(sd, name, w):
    q, s = to_deepseek_fp8(quantize_fp8_block(w.float()))
    sd[name + ".weight"], sd[name + ".weight_scale_inv"] = q, s
    return quantize_fp8_block(w.float()).dequantize(torch.bfloat16)


def test_deepseek_fp8_sharded_reads_only_its_shard(tmp_path):
    g = _g(3)
    pre = "model.layers.1.mlp."
    sd, deq = {}, {"gate": [], "up": [], "down": []}
    for m in range(E):
        deq["gate"].append(_fp8_linear(sd, f"{pre}experts.{m}.gate_proj", _w(I, H, g=g, dtype=torch.float32)))
        deq["up"].append(_fp8_linear(sd, f"{pre}experts.{m}.up_proj", _w(I, H, g=g, dtype=torch.float32)))
        deq["down"].append(_fp8_linear(sd, f"{pre}experts.{m}.down_proj", _w(H, I, g=g, dtype=torch.float32)))
    shared = {n: _fp8_linear(sd, f"{pre}shared_experts.{n}", _w(*(I, H) if n != "down_proj" else (H, I), g=g,
                                                                 dtype=torch.float32))
              for n in ("gate_proj", "up_proj", "down_proj")}
    sd[pre + "gate.weight"] = _w(E, H, g=g)                         # bf16 in the release
    sd[pre + "gate.e_score_correction_bias"] = torch.randn(E, generator=g) * 0.1
    _save(tmp_path, sd, DS_CFG, name="model-00001-of-00002.safetensors")
    # Layer 2 lives in a shard that is not a safetensors file at all: reading it would fail.
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"not a checkpoint")
    index = {"metadata": {}, "weight_map": {k: "model-00001-of-00002.safetensors" for k in sd}}
    index["weight_map"]["model.layers.2.mlp.gate.weight"] = "model-00002-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))

    params, cfg = load_moe_block(str(tmp_path), "deepseek_v3", 1, progress=True)
    assert isinstance(cfg, deepseek_v3.DeepseekV3BlockConfig) and cfg.routed_scaling_factor == 2.5
    ex = params["experts"]
    assert set(ex) == {"gate_proj", "up_proj", "down_proj"}
    assert all(isinstance(v, QuantizedTensor) and v.fmt == "fp8_block" for v in ex.values())
    assert ex["gate_proj"].logical_shape == (E, I, H)
    assert torch.equal(ex["down_proj"].data.view(torch.uint8),
                       torch.stack([sd[f"{pre}experts.{m}.down_proj.weight"].view(torch.uint8) for m in range(E)]))
    assert params["router"]["weight"].dtype == torch.float32          # kept fp32 (§4 dtype policy)
    assert isinstance(params["shared"]["up_proj"], QuantizedTensor)
    # Same block as the dequantized float weights, to bf16 rounding.
    x = torch.randn(16, H, generator=g).to(torch.bfloat16)
    y, aux = deepseek_v3.moe_block(params, x, cfg)
    fparams = {"router": params["router"],
               "experts": {"gate_up_proj": torch.cat([torch.stack(deq["gate"]), torch.stack(deq["up"])], 1),
                           "down_proj": torch.stack(deq["down"])},
               "shared": shared}
    yf, auxf = deepseek_v3.moe_block(fparams, x, cfg)
    assert torch.equal(aux.routing.expert_ids, auxf.routing.expert_ids)
    assert (y.float() - yf.float()).abs().max() <= 2e-2 * yf.float().abs().max()
    with pytest.raises(Exception):
        load_moe_block(str(tmp_path), "deepseek_v3", 2)


def test_gpt_oss_mxfp4_blocks_scales(tmp_path):
    g = _g(4)
    pre = "model.layers.0.mlp."
    gu = torch.randn(E, 2 * I, H, generator=g) / math.sqrt(H)        # [E, 2I, H] out x in, interleaved rows
    dn = torch.randn(E, H, I, generator=g) / math.sqrt(I)
    qgu, qdn = quantize_mxfp4(gu), quantize_mxfp4(dn)
    sd = {}
    sd[pre + "experts.gate_up_proj_blocks"], sd[pre + "experts.gate_up_proj_scales"] = to_gpt_oss(qgu)
    sd[pre + "experts.down_proj_blocks"], sd[pre + "experts.down_proj_scales"] = to_gpt_oss(qdn)
    sd[pre + "experts.gate_up_proj_bias"] = _w(E, 2 * I, g=g)
    sd[pre + "experts.down_proj_bias"] = _w(E, H, g=g)
    sd[pre + "router.weight"] = _w(E, H, g=g)
    sd[pre + "router.bias"] = _w(E, 1, g=g).reshape(E)
    cfg = {"model_type": "gpt_oss", "hidden_size": H, "num_local_experts": E, "num_experts_per_tok": 2,
           "intermediate_size": I, "quantization_config": {"quant_method": "mxfp4"}}
    _save(tmp_path, sd, cfg)
    params, c = load_moe_block(str(tmp_path / "model.safetensors"), "gpt_oss", 0, config=cfg)
    ex = params["experts"]
    assert ex["gate_up_proj"].fmt == "mxfp4" and ex["gate_up_proj"].logical_shape == (E, 2 * I, H)
    assert torch.equal(ex["gate_up_proj"].dequantize(), qgu.dequantize())
    x = torch.randn(12, H, generator=g).to(torch.bfloat16)
    y, _ = gpt_oss.moe_block(params, x, c)
    # Float reference in transformers' [E, H, 2I] layout (dequantized, then transposed).
    fl = dict(ex, gate_up_proj=qgu.dequantize(torch.bfloat16).transpose(1, 2),
              down_proj=qdn.dequantize(torch.bfloat16).transpose(1, 2))
    yf, _ = gpt_oss.moe_block(dict(params, experts=fl), x, c)
    assert (y.float() - yf.float()).abs().max() <= 2e-2 * yf.float().abs().max()


def test_modelopt_nvfp4_per_expert(tmp_path):
    g = _g(5)
    pre = "model.layers.0.mlp."
    sd, deq = {}, {}
    for m in range(E):
        for n, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            w = torch.randn(*shape, generator=g) * (0.5 if n == "up_proj" else 1.0)   # gate/up amax differ
            q = quantize_nvfp4(w)
            base = f"{pre}experts.{m}.{n}"
            sd[base + ".weight"], sd[base + ".weight_scale"], sd[base + ".weight_scale_2"] = to_modelopt_nvfp4(q)
            sd[base + ".input_scale"] = torch.tensor(0.01)
            deq.setdefault(n, []).append(q.dequantize())
    sd[pre + "gate.weight"] = _w(E, H, g=g)
    params, c = load_moe_block(sd, "qwen3_moe", 0, config=QWEN3_CFG)
    ex = params["experts"]
    assert ex["gate_proj"].fmt == "nvfp4" and ex["up_proj"].global_scale.shape == (E,)
    assert not torch.equal(ex["gate_proj"].global_scale, ex["up_proj"].global_scale)   # two alphas kept
    for n in ("gate_proj", "up_proj", "down_proj"):
        assert torch.equal(ex[n].dequantize(), torch.stack(deq[n]))


@pytest.mark.parametrize("name,arch,layer", [("qwen3_moe", "qwen3_moe", 1), ("qwen2_moe", "qwen2_moe", 0),
                                             ("deepseek_v3", "deepseek_v3", 1), ("mixtral", "mixtral", 1),
                                             ("gpt_oss", "gpt_oss", 0)])
def test_save_pretrained_round_trip(tmp_path, name, arch, layer):
    pytest.importorskip("transformers")
    from tests.test_models_hf import _randomise, _tiny
    from fmoe.models import arch_module
    model = _tiny(name).eval()
    _randomise(model, 7)
    model.config._experts_implementation = "eager"
    model = model.to(torch.bfloat16)
    block = model.model.layers[layer].mlp
    if arch == "deepseek_v3":
        block.gate.float()
    model.save_pretrained(tmp_path)
    params, cfg = load_moe_block(str(tmp_path), arch, layer)          # strict: no unexpected keys
    mod = arch_module(arch)
    ref_params = mod.params_from_module(block)
    import torch.utils._pytree as pytree
    got = {pytree.keystr(k): v for k, v in pytree.tree_flatten_with_path(params)[0]}
    ref = {pytree.keystr(k): v for k, v in pytree.tree_flatten_with_path(ref_params)[0]}
    assert got.keys() == ref.keys()
    assert all(torch.equal(got[k], ref[k].detach()) for k in ref), [k for k in ref if not torch.equal(got[k], ref[k])]
    x = torch.randn(1, 16, 64, generator=_g(8)).to(torch.bfloat16)
    with torch.no_grad():
        want = block(x)
        want = want[0] if isinstance(want, tuple) else want
        y, _ = mod.moe_block(params, x, cfg)
    assert torch.equal(y, want)
