"""fmoe.models against transformers 5.24 blocks and tiny full models (spec architectures.md §14).

Optional dependency: skipped without transformers. CI: pip install "transformers==5.24.0".
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from fmoe import losses  # noqa: E402
from fmoe.models import (config_from_hf, deepseek_v3, gpt_oss, mixtral, patch, qwen2_moe,  # noqa: E402
                         qwen3_moe)
from fmoe.models.patch import FmoeMoEBlock  # noqa: E402

H = 64
T = 64


def _blocks():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    tf = transformers
    return {
        # name: (config, block class, adapter, router attribute)
        "qwen3_moe": (tf.Qwen3MoeConfig(hidden_size=H, num_experts=16, num_experts_per_tok=4,
                                        moe_intermediate_size=32, norm_topk_prob=True),
                      Qwen3MoeSparseMoeBlock, qwen3_moe, "gate"),
        "qwen2_moe": (tf.Qwen2MoeConfig(hidden_size=H, num_experts=15, num_experts_per_tok=4,
                                        moe_intermediate_size=32, shared_expert_intermediate_size=48),
                      Qwen2MoeSparseMoeBlock, qwen2_moe, "gate"),
        "deepseek_v3": (tf.DeepseekV3Config(hidden_size=H, n_routed_experts=16, num_experts_per_tok=4,
                                            moe_intermediate_size=32, n_group=4, topk_group=2,
                                            routed_scaling_factor=2.5),
                        DeepseekV3MoE, deepseek_v3, "gate"),
        "kimi_k2": (tf.DeepseekV3Config(hidden_size=H, n_routed_experts=24, num_experts_per_tok=4,
                                        moe_intermediate_size=32, n_group=1, topk_group=1,
                                        routed_scaling_factor=2.827),
                    DeepseekV3MoE, deepseek_v3, "gate"),
        "glm4_moe": (tf.Glm4MoeConfig(hidden_size=H, n_routed_experts=16, num_experts_per_tok=4,
                                      moe_intermediate_size=32, routed_scaling_factor=2.5),
                     Glm4MoeMoE, deepseek_v3, "gate"),
        "gpt_oss": (tf.GptOssConfig(hidden_size=H, num_local_experts=16, num_experts_per_tok=4,
                                    intermediate_size=32),
                    GptOssMLP, gpt_oss, "router"),
        "mixtral": (tf.MixtralConfig(hidden_size=H, num_local_experts=8, num_experts_per_tok=2,
                                     intermediate_size=32),
                    MixtralSparseMoeBlock, mixtral, "gate"),
    }


BLOCKS = ["qwen3_moe", "qwen2_moe", "deepseek_v3", "kimi_k2", "glm4_moe", "gpt_oss", "mixtral"]


def _randomise(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            scale = 0.5 if name.endswith("bias") else p.shape[-1] ** -0.5
            p.copy_(torch.randn(p.shape, generator=g) * scale)
        for _, b in module.named_buffers():
            if b.is_floating_point():
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return g


def _make_block(name, dtype, impl):
    cfg, cls, mod, router_attr = _blocks()[name]
    cfg._experts_implementation = impl
    block = cls(cfg)
    g = _randomise(block, 0)
    block = block.to(dtype)
    if mod is deepseek_v3:
        # Faithful bf16: the release stores the router in bf16, transformers keeps it fp32 (§4).
        gate = block.gate
        gate.weight.data = gate.weight.data.to(dtype).float()
        gate.e_score_correction_bias.data = gate.e_score_correction_bias.data.float()
    x = torch.randn(1, T, H, generator=g).to(dtype)
    return cfg, block, mod, router_attr, x


def _sorted_by_expert(ids, w):
    o = ids.argsort(dim=1)
    return ids.gather(1, o), w.gather(1, o)


def _bf16_ulps(ref, n):
    return n * 2.0 ** (torch.floor(torch.log2(ref.float().abs().max())) - 7)


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", BLOCKS)
def test_block_matches_transformers(name, dtype, impl):
    cfg, block, mod, router_attr, x = _make_block(name, dtype, impl)
    c = config_from_hf(cfg)
    combine = "eager" if impl == "eager" else "grouped"
    with torch.no_grad():
        ref = block(x)
        ref = ref[0] if isinstance(ref, tuple) else ref
        ref_logits, ref_w, ref_ids = getattr(block, router_attr)(x.reshape(-1, H))
        # no gradient and 16 rows per expert: the engine's decode phase
        y, aux = mod.moe_block(mod.params_from_module(block), x, c, combine=combine)
    ids, w = aux.topk()
    # (3) equal top-k sets; (4) weights sorted by expert id equal to fp32 ulp; logits equal.
    i1, w1 = _sorted_by_expert(ids, w)
    i2, w2 = _sorted_by_expert(ref_ids, ref_w)
    assert torch.equal(i1, i2)
    assert w1.dtype == w2.dtype
    torch.testing.assert_close(w1, w2, rtol=2e-7, atol=0)
    assert torch.equal(aux.router_logits, ref_logits)
    assert int(aux.routing.num_dropped()) == 0
    # (5) outputs. The combine order is transformers', but the expert GEMMs are other calls:
    # the decode phase runs experts side by side with single-threaded at::mm (transformers' eager
    # loop: F.linear on the intra-op threads), grouped_mm is torch's grouped kernel; BLAS may
    # split K differently (it does on MKL's AVX2 paths): fp32 within ~1e-6 relative, bf16 within
    # 2 ulp of the largest output (both measured 0 on the AVX-512 Xeon; a wrong expert moves
    # outputs by O(|y|)).
    assert y.dtype == ref.dtype and y.shape == ref.shape
    if dtype == torch.bfloat16:
        assert (y.float() - ref.float()).abs().max() <= _bf16_ulps(ref, 2)
    else:
        torch.testing.assert_close(y, ref, rtol=0, atol=2e-6 * max(1.0, ref.abs().max().item()))
    if impl == "eager":
        # With a gradient to take (phase 'train') every expert GEMM is one at::mm per busy expert
        # on the intra-op threads, on transformers' rows in transformers' order: the calls of its
        # eager loop, so the block is equal bit for bit in either dtype, on any host.
        y_train, _ = mod.moe_block(mod.params_from_module(block), x, c, combine="eager")
        assert torch.equal(y_train, ref), (y_train - ref).abs().max()


def test_other_order_is_within_backend_spread():
    # fmoe's grouped order vs transformers eager in bf16: 1-2 ulp of the largest outputs (§11).
    cfg, block, mod, _, x = _make_block("deepseek_v3", torch.bfloat16, "eager")
    with torch.no_grad():
        ref = block(x)
        y, _ = mod.moe_block(mod.params_from_module(block), x, config_from_hf(cfg), combine="grouped")
    assert (y.float() - ref.float()).abs().max() <= _bf16_ulps(ref, 2)


def test_mixtral_training_jitter_matches():
    tf = transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    cfg = tf.MixtralConfig(hidden_size=H, num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
                           router_jitter_noise=0.1)
    cfg._experts_implementation = "eager"
    block = MixtralSparseMoeBlock(cfg)
    g = _randomise(block, 1)
    block.train()
    x = torch.randn(1, 16, H, generator=g)
    x0 = x.clone()
    torch.manual_seed(123)
    with torch.no_grad():
        ref = block(x.clone())                      # transformers jitters its input in place
        y, _ = mixtral.moe_block(mixtral.params_from_module(block), x, config_from_hf(cfg), training=True,
                                 generator=torch.Generator().manual_seed(123))
    assert torch.equal(x, x0)
    torch.testing.assert_close(y, ref, rtol=0, atol=2e-6)


def test_load_balancing_loss_matches_transformers():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
    g = torch.Generator().manual_seed(2)
    layers = tuple(torch.randn(2 * 6, 8, generator=g) for _ in range(3))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0
    for m in (None, mask):
        ref = load_balancing_loss_func(layers, 8, 2, m)
        got = losses.load_balancing_loss(layers, 2, attention_mask=m)
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- patch on tiny full models

def _tiny(name):
    tf = transformers
    common = dict(vocab_size=97, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  hidden_size=H, max_position_embeddings=64)
    if name == "qwen3_moe":
        return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**common, head_dim=16, intermediate_size=64,
                                                        moe_intermediate_size=32, num_experts=8,
                                                        num_experts_per_tok=2, norm_topk_prob=True))
    if name == "qwen2_moe":
        return tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(**common, intermediate_size=64, moe_intermediate_size=32,
                                                        num_experts=6, num_experts_per_tok=2,
                                                        shared_expert_intermediate_size=48))
    if name == "deepseek_v3":
        return tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
            **common, intermediate_size=64, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
            n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5, kv_lora_rank=16,
            q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16))
    if name == "gpt_oss":
        return tf.GptOssForCausalLM(tf.GptOssConfig(**common, head_dim=16, intermediate_size=32,
                                                    num_local_experts=8, num_experts_per_tok=2,
                                                    layer_types=["sliding_attention", "full_attention"],
                                                    sliding_window=8))
    if name == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(**common, intermediate_size=32, num_local_experts=4,
                                                      num_experts_per_tok=2))
    raise KeyError(name)


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "deepseek_v3", "gpt_oss", "mixtral"])
@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
def test_patch_full_model_same_outputs(name, impl):
    torch.manual_seed(0)
    model = _tiny(name).eval()
    _randomise(model, 3)                          # MoE weights of real size, not init zeros
    model.config._experts_implementation = impl
    for m in model.modules():
        if hasattr(m, "config") and hasattr(m.config, "_experts_implementation"):
            m.config._experts_implementation = impl
    dtype = torch.bfloat16 if impl == "eager" else torch.float32
    model = model.to(dtype)
    if name == "deepseek_v3":
        for layer in model.model.layers[1:]:
            layer.mlp.gate.float()
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(4))
    keys = list(model.state_dict())
    # eager: with a gradient to take, the engine's expert GEMMs are the calls of transformers'
    # eager loop (tests/test_models_dropin.py), so bf16 logits are equal by construction
    with torch.set_grad_enabled(impl == "eager"):
        ref = model(ids, output_router_logits=name != "deepseek_v3")
        patch(model)
        got = model(ids, output_router_logits=name != "deepseek_v3")
    assert list(model.state_dict()) == keys                      # names unchanged
    n = sum(isinstance(m, FmoeMoEBlock) for m in model.modules())
    assert n == (1 if name == "deepseek_v3" else 2)
    if dtype == torch.bfloat16:
        assert torch.equal(got.logits, ref.logits)
    else:
        torch.testing.assert_close(got.logits, ref.logits, rtol=0, atol=1e-5)
    if name != "deepseek_v3":
        assert got.aux_loss is not None
        torch.testing.assert_close(got.aux_loss, ref.aux_loss, rtol=1e-6, atol=0)


def test_patch_trains():
    model = _tiny("qwen3_moe")
    _randomise(model, 5)
    patch(model, combine="grouped")
    ids = torch.randint(0, 97, (1, 8), generator=torch.Generator().manual_seed(6))
    out = model(ids, labels=ids)
    out.loss.backward()
    blk = model.model.layers[0].mlp
    assert isinstance(blk, FmoeMoEBlock)
    assert blk.experts.gate_up_proj.grad.abs().sum() > 0 and blk.gate.weight.grad.abs().sum() > 0
    import copy
    twin = copy.deepcopy(model).eval()
    with torch.no_grad():
        assert torch.equal(twin(ids).logits, model.eval()(ids).logits)


def test_patch_refuses_models_without_moe():
    with pytest.raises(ValueError, match="no supported MoE block"):
        patch(torch.nn.Linear(2, 2), hf_config={"model_type": "qwen3_moe"})
