"""fmoe.models.patch as a drop-in for transformers' MoE blocks (issue 33 §3): the experts back-end
switch is followed, the replaced block's attributes stay readable, and the eager order's
bit-exactness holds where the expert GEMMs are the same calls as transformers'.

Optional dependency: skipped without transformers.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from fmoe.models import patch  # noqa: E402
from fmoe.models.patch import BACKEND_COMBINES, FmoeMoEBlock, combine_for  # noqa: E402
from tests.test_models_hf import _randomise  # noqa: E402

H = 64
ARCHS = ["qwen3_moe", "qwen2_moe", "deepseek_v3", "mixtral", "gpt_oss"]
BACKENDS = ["eager", "batched_mm", "grouped_mm", "eager"]   # back to eager: the switch goes both ways


def _tiny(name, dtype):
    """A two-layer model with k = 4 of 8 experts (at k = 2 the eager and grouped orders round
    alike in bf16 for dt routing weights, and a switch could not be seen), random weights."""
    tf = transformers
    common = dict(vocab_size=97, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  hidden_size=H, max_position_embeddings=64, num_experts_per_tok=4)
    if name == "qwen3_moe":
        m = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**common, head_dim=16, intermediate_size=64,
                                                     moe_intermediate_size=32, num_experts=8, norm_topk_prob=True))
    elif name == "qwen2_moe":
        m = tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(**common, intermediate_size=64, moe_intermediate_size=32,
                                                     num_experts=8, shared_expert_intermediate_size=48))
    elif name == "deepseek_v3":
        m = tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
            **common, intermediate_size=64, moe_intermediate_size=32, n_routed_experts=8, n_group=2, topk_group=2,
            first_k_dense_replace=0, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=32,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16))
    elif name == "gpt_oss":
        m = tf.GptOssForCausalLM(tf.GptOssConfig(**common, head_dim=16, intermediate_size=32, num_local_experts=8,
                                                 layer_types=["sliding_attention", "full_attention"],
                                                 sliding_window=8))
    else:
        m = tf.MixtralForCausalLM(tf.MixtralConfig(**common, intermediate_size=32, num_local_experts=8))
    _randomise(m, 3)
    m = m.eval().to(dtype)
    if name == "deepseek_v3":   # transformers keeps the DeepSeek router in fp32 (spec §4)
        for layer in m.model.layers:
            layer.mlp.gate.float()
    return m


def _ids():
    return torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(4))


def _ulp_bound(ref, ulps):
    """``ulps`` units in the last place of the largest |ref| in ref's dtype."""
    mant = {torch.bfloat16: 7, torch.float32: 23}[ref.dtype]
    return ulps * 2.0 ** (torch.floor(torch.log2(ref.float().abs().max())).item() - mant)


# What holds between a patched model and transformers under the same back-end, in logits:
# the router and the combine order are the same arithmetic, but the expert GEMMs are not the
# same calls (fmoe's engine vs transformers' back-end, or the engine's decode regime: experts side
# by side, each at::mm single-threaded, where transformers' eager loop runs each F.linear on the
# intra-op threads: BLAS may split K differently). Their rounding differences go through the
# remaining layers to the logits: fp32 within 16 ulp of the largest logit (measured: 0 to 2 ulp,
# up to 9e-8 at |logits| ~ 0.5), bf16 within 2 ulp (measured: 0). A wrong expert moves the
# logits by more (test_bounds_catch_a_wrong_expert).
LOGIT_ULPS = {torch.float32: 16, torch.bfloat16: 2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ARCHS)
def test_patched_model_follows_the_backend_switch(name, dtype):
    model = _tiny(name, dtype)
    ids = _ids()
    refs = {}
    with torch.no_grad():
        for b in BACKENDS[:3]:
            model.set_experts_implementation(b)
            refs[b] = model(ids).logits
        patch(model)
        blocks = [m for m in model.modules() if isinstance(m, FmoeMoEBlock)]
        assert len(blocks) == 2
        seen = []
        hooks = [blk.register_forward_hook(lambda m, args, out: seen.append((m, args[0], out))) for blk in blocks]
        orders_differ = False
        for b in BACKENDS:
            model.set_experts_implementation(b)
            want = BACKEND_COMBINES[b]
            assert [blk.current_combine() for blk in blocks] == [want, want]
            seen.clear()
            got = model(ids).logits
            # The order that ran is the back-end's: each block's output is moe_block in that order
            # (the same call on the same input, so bit for bit) ...
            assert len(seen) == 2
            other = "grouped" if want == "eager" else "eager"
            for blk, x, y in seen:
                y = y[0] if isinstance(y, tuple) else y
                params = blk._mod.params_from_module(blk)
                same, _ = blk._mod.moe_block(params, x, blk.block_config, combine=want)
                assert torch.equal(y, same)
                alt, _ = blk._mod.moe_block(params, x, blk.block_config, combine=other)
                orders_differ |= not torch.equal(y, alt)
            # ... and the model agrees with transformers under that back-end (bound above).
            bound = _ulp_bound(refs[b], LOGIT_ULPS[dtype])
            assert (got - refs[b]).abs().max().item() <= bound, (b, (got - refs[b]).abs().max().item(), bound)
        for h in hooks:
            h.remove()
    # the two orders round differently on these inputs, so a block that kept one order would
    # have failed the equality above
    assert orders_differ


def test_bounds_catch_a_wrong_expert():
    # The logit bounds above are tight enough to see one block using another expert's weights.
    for dtype in (torch.float32, torch.bfloat16):
        model = _tiny("qwen3_moe", dtype)
        ids = _ids()
        with torch.no_grad():
            ref = model(ids).logits
            patch(model)
            ex = model.model.layers[1].mlp.experts
            ex.gate_up_proj[[0, 1]] = ex.gate_up_proj[[1, 0]].clone()
            got = model(ids).logits
        # measured: 0.021 against a bf16 bound of 0.0078, 2e4 x the fp32 bound
        assert (got - ref).abs().max().item() > 2 * _ulp_bound(ref, LOGIT_ULPS[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ARCHS)
def test_eager_order_is_bit_exact_where_the_gemms_are_the_same_calls(name, dtype):
    # With a gradient to take (phase 'train'), the engine runs every expert GEMM as one at::mm
    # per busy expert on the intra-op threads, on the rows in transformers' order (by expert,
    # then slot, then token): the call transformers' eager loop makes, so the logits are equal
    # bit for bit on any host. (In the decode phase the bound of the test above applies.)
    model = _tiny(name, dtype)
    model.set_experts_implementation("eager")
    ids = _ids()
    ref = model(ids).logits
    patch(model)
    assert all(m.current_combine() == "eager" for m in model.modules() if isinstance(m, FmoeMoEBlock))
    got = model(ids).logits
    assert torch.equal(got, ref), (got - ref).abs().max().item()


def test_plan_rows_are_in_transformers_eager_order():
    # The premise of the bit-exact test above: each expert's GEMM sees the rows transformers'
    # eager loop gives F.linear, in the same order (torch.where over the [k, T] mask of the
    # expert: slot-major, then token). BLAS may round a row differently at another position.
    from fmoe.engine import make_plan
    from fmoe.models import config_from_hf, qwen3_moe
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    cfg = transformers.Qwen3MoeConfig(hidden_size=H, num_experts=8, num_experts_per_tok=4, moe_intermediate_size=32)
    block = Qwen3MoeSparseMoeBlock(cfg)
    g = _randomise(block, 7)
    x = torch.randn(40, H, generator=g)
    with torch.no_grad():
        _, aux = qwen3_moe.moe_block(qwen3_moe.params_from_module(block), x, config_from_hf(cfg))
        _, _, ids = block.gate(x)                       # transformers' [T, k] expert ids
    plan = make_plan(aux.routing, needs_grad=False, dtype=x.dtype)
    mask = torch.nn.functional.one_hot(ids, num_classes=8).permute(2, 1, 0)   # as the eager loop builds it
    b = plan.bounds
    unsorted = 0
    for e in range(8):
        _, token_idx = torch.where(mask[e])
        assert torch.equal(plan.tokens[b[e]:b[e + 1]], token_idx), e
        unsorted += not torch.equal(token_idx, token_idx.sort().values)
    assert unsorted > 0   # the order differs from token order, so the check can tell them apart


def test_pinned_combine_and_unknown_backends():
    model = _tiny("qwen3_moe", torch.float32)
    patch(model, combine="grouped")
    model.set_experts_implementation("eager")
    blk = model.model.layers[0].mlp
    assert blk.current_combine() == "grouped" and "combine='grouped'" in repr(blk)

    model = _tiny("qwen3_moe", torch.float32)
    patch(model)
    assert "follows experts_implementation" in repr(model.model.layers[0].mlp)
    # a back-end fmoe cannot reproduce (a user-registered one) is refused at the call, naming the fix
    model.config._experts_implementation_internal = "my_kernel"
    with pytest.raises(ValueError, match=r"experts_implementation='my_kernel'.*pass combine='eager' or 'grouped'"):
        model(_ids())
    # ... and at patch time, before any block is swapped
    model = _tiny("qwen3_moe", torch.float32)
    model.config._experts_implementation_internal = "my_kernel"
    with pytest.raises(ValueError, match="my_kernel"):
        patch(model)
    assert not any(isinstance(m, FmoeMoEBlock) for m in model.modules())
    with pytest.raises(ValueError, match=r"combine must be one of \('eager', 'grouped'\).*got 'fmoe'"):
        patch(model, combine="fmoe")
    assert combine_for(None) == "eager"


def _block_instances():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32MoE
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE
    from transformers.models.glm4_moe_lite.modeling_glm4_moe_lite import Glm4MoeLiteMoE
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaMoE
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    tf = transformers
    ds = dict(hidden_size=H, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    return [
        Qwen3MoeSparseMoeBlock(tf.Qwen3MoeConfig(hidden_size=H, num_experts=8, moe_intermediate_size=32)),
        Qwen2MoeSparseMoeBlock(tf.Qwen2MoeConfig(hidden_size=H, num_experts=8, moe_intermediate_size=32,
                                                 shared_expert_intermediate_size=48)),
        DeepseekV3MoE(tf.DeepseekV3Config(**ds, n_group=2, topk_group=1)),
        DeepseekV32MoE(tf.DeepseekV32Config(**ds, n_group=2, topk_group=1)),
        Glm4MoeMoE(tf.Glm4MoeConfig(**ds)),
        Glm4MoeLiteMoE(tf.Glm4MoeLiteConfig(**ds)),
        GlmMoeDsaMoE(tf.GlmMoeDsaConfig(**ds)),
        GptOssMLP(tf.GptOssConfig(hidden_size=H, num_local_experts=8, intermediate_size=32)),
        MixtralSparseMoeBlock(tf.MixtralConfig(hidden_size=H, num_local_experts=8, intermediate_size=32,
                                               router_jitter_noise=0.25)),
    ]


def _public_attributes(module):
    return {k: v for k, v in vars(module).items() if not k.startswith("_")}


@pytest.mark.parametrize("block", _block_instances(), ids=lambda b: type(b).__name__)
def test_patched_block_keeps_the_attributes_of_the_block_it_replaces(block):
    block.eval()
    attrs = _public_attributes(block)
    children = dict(block.named_children())
    holder = torch.nn.Sequential(block)
    patch(holder, hf_config=block.experts.config)
    new = holder[0]
    assert isinstance(new, FmoeMoEBlock)
    for k, v in attrs.items():          # config, top_k, jitter_noise, training, ...
        assert getattr(new, k) is v or getattr(new, k) == v, k
    assert dict(new.named_children()).keys() == children.keys()
    assert all(getattr(new, k) is c for k, c in children.items())
    if type(block).__name__ == "MixtralSparseMoeBlock":
        assert (new.top_k, new.jitter_noise) == (2, 0.25)
    if type(block).__name__ == "DeepseekV3MoE":
        assert new.config is block.config
