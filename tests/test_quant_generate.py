"""fmoe.examples.generate: a transformers model patched with fmoe, its experts kept packed, generates
the same greedy tokens as the unpatched model over the dequantized weights.

The checkpoints are written here in the official layouts (gpt-oss MXFP4 blocks/scales, DeepSeek
and Qwen3 FP8 weight + weight_scale_inv, ModelOpt NVFP4 weight + weight_scale + weight_scale_2)
from random weights; transformers dequantizes the first two on a CPU (fmoe dequantizes NVFP4 for
it: transformers has no CPU path for ModelOpt's), fmoe keeps them packed. Both run in float32; the
patched experts' sums run in another order (the packed kernel), which the sharpened random model's
logits absorb: every token must be equal.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")   # transformers' MXFP4 / FP8 loaders need it

from fmoe.examples import generate as G  # noqa: E402
from fmoe.quant import QuantizedTensor  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("arch,fmt,tokens", [("gpt_oss", "mxfp4", 64), ("deepseek_v3", "fp8_block", 64),
                                             ("qwen3_moe", "fp8_block", 64), ("qwen3_moe", "nvfp4", 64)])
def test_patched_packed_model_generates_the_unpatched_tokens(tmp_path, arch, fmt, tokens):
    path = G.write_checkpoint(str(tmp_path / arch), arch, "tiny", fmt=fmt)
    model, nbytes = G.load_patched(path, arch)
    experts = model.model.layers[0].mlp.experts
    # NVFP4 keeps gate and up apart (a global scale each); FP8's fuse exactly
    names = ("gate_proj", "up_proj", "down_proj") if fmt == "nvfp4" else ("gate_up_proj", "down_proj")
    packed = {n: getattr(experts, n) for n in names}
    assert all(isinstance(w, QuantizedTensor) and w.fmt == fmt for w in packed.values())
    if arch == "deepseek_v3":   # the FP8 shared experts stay packed too
        shared = model.model.layers[0].mlp.shared_experts
        assert all(isinstance(getattr(shared, n), QuantizedTensor) for n in ("gate_proj", "up_proj", "down_proj"))
    # the attention projections as the official FP8 / ModelOpt releases store them: packed too (gpt-oss's are bf16)
    attn = dict(model.model.layers[0].self_attn.named_children())
    linears = {n: type(m).__name__ for n, m in attn.items() if "norm" not in n}
    want = "Linear" if arch == "gpt_oss" else "PackedLinear"
    assert linears and set(linears.values()) == {want}, linears
    assert all(m.weight.fmt == fmt for m in attn.values() if isinstance(m, G.PackedLinear))
    assert nbytes == sum(w.nbytes for m in model.modules() for w in vars(m).values()
                         if isinstance(w, QuantizedTensor)) > 0
    prompt = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29]])
    ids = G.greedy(model, prompt, tokens)
    ref = G.greedy(G.load_reference(path), prompt, tokens)
    assert ids.shape == (1, tokens)
    assert torch.equal(ids, ref), f"first difference at token {int((ids != ref).int().argmax())}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_load_patched_equals_from_pretrained_outside_the_experts(tmp_path, dtype):
    # load_patched builds the gpt-oss model with its experts on the meta device and fills them with
    # the packed ones: every other tensor must equal what transformers' from_pretrained loads (cast
    # alike), the computed rotary buffers too, and nothing may stay on the meta device
    import fmoe.models
    from transformers import AutoModelForCausalLM
    path = G.write_checkpoint(str(tmp_path / "gpt_oss"), "gpt_oss", "tiny")
    model, _ = G.load_patched(path, "gpt_oss", dtype=dtype)
    ref = fmoe.models.patch(AutoModelForCausalLM.from_pretrained(path, dtype=dtype))
    assert not model.training and model.model.layers[0].mlp.current_combine() == "grouped"
    got = {k: v for k, v in model.state_dict().items() if ".experts." not in k}
    want = {k: v for k, v in ref.state_dict().items() if ".experts." not in k}
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    bufs = dict(model.named_buffers())
    for k, v in ref.named_buffers():
        if ".experts." not in k:
            assert torch.equal(bufs[k], v), k
    assert not [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not [n for n, t in model.state_dict().items() if ".experts." in n and t.is_floating_point()
                and t.dim() == 3], "a dequantized expert weight is resident"


@pytest.mark.slow
def test_experts_on_huge_pages_give_the_memory_mapped_logits(tmp_path):
    """load_patched's default copies the packed experts onto huge pages: the same values, so the same
    kernels give the same logits, bit for bit; the experts' data sits in memory advised for them."""
    from fmoe.quant import hugepages
    if not hugepages.available():
        pytest.skip("no transparent huge pages by advice here")
    from tests.test_hugepages import _vm_flags
    path = G.write_checkpoint(str(tmp_path / "small"), "gpt_oss", "small")
    x = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29]])
    logits = {}
    for huge in (True, False):
        model, _ = G.load_patched(path, "gpt_oss", huge_pages=huge)
        data = model.model.layers[0].mlp.experts.gate_up_proj.data
        assert (data.data_ptr() % hugepages.HUGE == 0 and "hg" in _vm_flags(data.data_ptr())) == huge
        with torch.no_grad():
            logits[huge] = model(x).logits
    assert torch.equal(logits[True], logits[False])


def test_inference_suite_counts_the_weights_and_times_the_moe_blocks(tmp_path):
    """benchmarks.bench_inference's whole-model bounds: the weights a patched model holds are its
    parameters and buffers plus the packed experts' bytes (the loader's count), and the MoE blocks'
    time is spent inside them: positive, below the whole call's, and zero where no block runs."""
    import time
    from benchmarks import bench_inference as B
    path = G.write_checkpoint(str(tmp_path / "gpt_oss"), "gpt_oss", "tiny")
    model, packed_bytes = G.load_patched(path, "gpt_oss")
    dense = {t.data_ptr(): t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers())}
    assert packed_bytes > 0 and B._weight_bytes(model) == sum(dense.values()) + packed_bytes
    prompt = torch.tensor([[1, 2, 3]])
    t0 = time.perf_counter()
    inside = B._moe_block_seconds(model, lambda: G.greedy(model, prompt, 4))
    assert 0 < inside < time.perf_counter() - t0
    assert B._moe_block_seconds(model, lambda: None) == 0
    assert all(not layer.mlp._forward_hooks and not layer.mlp._forward_pre_hooks for layer in model.model.layers)


def test_prepared_benchmark_alternates_both_blocks_and_restores_the_forward(tmp_path):
    """benchmarks.bench_prepared: every decode call of every block is timed on one of the two paths
    (ABBA: as many on each), both give the same tokens, and the patched forward is restored after."""
    from benchmarks import bench_prepared as BP
    from fmoe.models.patch import FmoeMoEBlock
    forward = FmoeMoEBlock.forward
    path = G.write_checkpoint(str(tmp_path / "gpt_oss"), "gpt_oss", "tiny")
    res = BP.measure(path, tokens=5, repeats=2, log=lambda _: None)
    layers = len(G.load_patched(path, "gpt_oss")[0].model.layers)
    assert res["same_tokens"] and res["calls"] == 2 * 4 * layers // 2   # 4 decode calls a prompt, after its prefill
    assert res["prepared"] > 0 and res["unprepared"] > 0 and res["ratio"] > 0
    assert FmoeMoEBlock.forward is forward


def test_qwen3_nvfp4_checkpoint_has_modelopt_names_and_each_projection_its_global_scale(tmp_path):
    """The NVFP4 checkpoint in ModelOpt's per-expert names and dtypes (uint8 weight [out, in/2],
    float8_e4m3fn weight_scale [out, in/16], float32 scalar weight_scale_2 and input_scale), its config
    "modelopt"; the patched model reads each projection with its own global scale, and its blocks run
    fmoe's prepared call over both in-projections apart."""
    import json
    from safetensors import safe_open
    from fmoe.quant import packed
    path = G.write_checkpoint(str(tmp_path / "q"), "qwen3_moe", "tiny", fmt="nvfp4")
    s = G.SIZES["tiny"]
    with open(tmp_path / "q" / "config.json") as f:
        qc = json.load(f)["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "NVFP4"
    with safe_open(str(tmp_path / "q" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        base = "model.layers.0.mlp.experts.1.up_proj"
        w, sc, s2, si = (f.get_tensor(f"{base}.{n}") for n in ("weight", "weight_scale", "weight_scale_2", "input_scale"))
        gate_s2 = f.get_tensor("model.layers.0.mlp.experts.1.gate_proj.weight_scale_2")
    assert not any("gate_up_proj" in k or k.endswith("weight_scale_inv") for k in keys)
    assert w.dtype == torch.uint8 and tuple(w.shape) == (s["inter"], s["hidden"] // 2)
    assert sc.dtype == torch.float8_e4m3fn and tuple(sc.shape) == (s["inter"], s["hidden"] // 16)
    assert s2.dtype == torch.float32 and s2.dim() == 0 and si.dim() == 0
    model, _ = G.load_patched(path, "qwen3_moe")
    ex = model.model.layers[0].mlp.experts
    assert float(ex.up_proj.global_scale[1]) == float(s2) and float(ex.gate_proj.global_scale[1]) == float(gate_s2)
    assert float(s2) != float(gate_s2)   # why gate and up stay apart
    if packed.AVAILABLE:
        assert model.model.layers[0].mlp._prepared().fast


def test_write_checkpoint_names_the_formats_of_each_architecture(tmp_path):
    with pytest.raises(ValueError, match=r"gpt_oss checkpoints are written in \('mxfp4',\), got fmt='nvfp4'"):
        G.write_checkpoint(str(tmp_path / "x"), "gpt_oss", "tiny", fmt="nvfp4")
    with pytest.raises(ValueError, match="arch must be one of"):
        G.write_checkpoint(str(tmp_path / "x"), "mixtral", "tiny")
    with pytest.raises(ValueError, match="size must be one of"):
        G.write_checkpoint(str(tmp_path / "x"), "qwen3_moe", "huge")
    with pytest.raises(ValueError, match="dense_layers is deepseek_v3's first_k_dense_replace; qwen3_moe has none"):
        G.write_checkpoint(str(tmp_path / "x"), "qwen3_moe", "tiny", dense_layers=1)
    with pytest.raises(ValueError, match=r"dense_layers must be an int in \[0, 2\) \(size 'tiny' has 2 layers\), got 2"):
        G.write_checkpoint(str(tmp_path / "x"), "deepseek_v3", "tiny", dense_layers=2)


def test_deepseek_dense_first_layer_stays_packed_and_generates_the_unpatched_tokens(tmp_path):
    """DeepSeek-V3's first layers are dense MLPs, FP8 in the release like its attention: the loader keeps
    them packed (PackedLinear), patches only the MoE layers, and the model generates transformers' tokens
    (float32); the inference suite counts and times the MoE layers only."""
    from benchmarks import bench_inference as B
    path = G.write_checkpoint(str(tmp_path / "ds"), "deepseek_v3", "tiny", dense_layers=1)
    model, _ = G.load_patched(path, "deepseek_v3")
    dense, moe = model.model.layers[0].mlp, model.model.layers[1].mlp
    assert type(dense).__name__ == "DeepseekV3MLP" and type(moe).__name__ == "FmoeMoEBlock"
    assert all(isinstance(getattr(dense, n), G.PackedLinear) and getattr(dense, n).weight.fmt == "fp8_block"
               for n in ("gate_proj", "up_proj", "down_proj"))
    prompt = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29]])
    ids = G.greedy(model, prompt, 32)
    assert torch.equal(ids, G.greedy(G.load_reference(path), prompt, 32))
    assert B._moe_layers(model) == [model.model.layers[1]]
    k = G.SIZES["tiny"]["k"]
    routed = sum(w.nbytes for n, w in vars(moe.experts).items() if isinstance(w, QuantizedTensor)) * k // G.SIZES["tiny"]["experts"]
    shared = sum(w.nbytes for w in vars(moe.shared_experts).values() if isinstance(w, QuantizedTensor))
    router = sum(t.numel() * t.element_size() for n, t in [*moe.named_parameters(), *moe.named_buffers()]
                 if not n.startswith("experts."))
    assert B._moe_step_bytes(model, k, True) == routed + shared + router
    assert B._moe_block_seconds(model, lambda: G.greedy(model, prompt, 2)) > 0


def test_inference_suite_counts_a_decode_step_of_split_nvfp4_experts(tmp_path):
    """bench_inference's decode bound reads k experts of every packed projection, the NVFP4 gate and up
    kept apart included, and every other weight but the embedding table, the packed attention
    projections included."""
    from benchmarks import bench_inference as B
    path = G.write_checkpoint(str(tmp_path / "q"), "qwen3_moe", "tiny", fmt="nvfp4")
    model, _ = G.load_patched(path, "qwen3_moe")
    k, E = G.SIZES["tiny"]["k"], G.SIZES["tiny"]["experts"]
    emb = model.get_input_embeddings().weight
    dense = sum(t.numel() * t.element_size() for n, t in list(model.named_parameters()) + list(model.named_buffers())
                if t is not emb and ".experts." not in n and "rotary" not in n)
    attention = sum(m.weight.nbytes for layer in model.model.layers for m in layer.self_attn.children()
                    if isinstance(m, G.PackedLinear))
    assert attention > 0
    experts = sum(w.nbytes for layer in model.model.layers for n, w in vars(layer.mlp.experts).items()
                  if n in ("gate_proj", "up_proj", "down_proj"))
    assert B._decode_step_bytes(model, k, True) == dense + attention + experts * k // E
    # the MoE blocks' share of it: each layer's router and its k experts, no attention, norm or head weight
    routers = sum(layer.mlp.gate.weight.numel() * layer.mlp.gate.weight.element_size() for layer in model.model.layers)
    assert B._moe_step_bytes(model, k, True) == routers + experts * k // E


def test_packed_linear_multiplies_its_packed_weight_as_a_linear_of_the_dequantized_one(monkeypatch):
    """generate.PackedLinear (a checkpoint's packed attention projection): x [..., in] -> [..., out] in
    x's dtype, within the packed GEMM's rounding of F.linear over the dequantized weight, the bias added,
    multiplied packed on an eager CPU call (dequantize is not called)."""
    from fmoe.quant import packed, quantize_fp8_block, quantize_nvfp4
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(48, 256, generator=g), torch.randn(48, generator=g)
    x = torch.randn(2, 3, 256, generator=g)
    for q in (quantize_fp8_block(w), quantize_nvfp4(w)):
        ref = torch.nn.functional.linear(x.double(), q.dequantize(torch.float64), b.double())
        bound = (256 + 2) * torch.finfo(torch.float32).eps * (x.abs().double() @ q.dequantize(torch.float64).abs().T)
        m = G.PackedLinear(q, b)
        assert (m.in_features, m.out_features) == (256, 48) and q.fmt in repr(m)
        if packed.AVAILABLE:
            monkeypatch.setattr(QuantizedTensor, "dequantize", lambda *a, **k: pytest.fail("dequantized"))
        y = m(x)
        monkeypatch.undo()
        assert y.shape == (2, 3, 48) and y.dtype == torch.float32
        assert ((y.double() - ref).abs() <= bound + 1e-6).all()
        assert m(x.bfloat16()).dtype == torch.bfloat16
    assert G.PackedLinear(quantize_fp8_block(w)).bias is None


def test_without_experts_refuses_a_packed_weight_that_does_not_fit_its_module(tmp_path):
    # a stored packed attention weight of another shape is named, not loaded into the wrong module
    import json
    from safetensors.torch import load_file, save_file
    from fmoe.quant import quantize_fp8_block
    path = G.write_checkpoint(str(tmp_path / "q"), "qwen3_moe", "tiny")
    f = str(tmp_path / "q" / "model.safetensors")
    sd = load_file(f)
    name = "model.layers.0.self_attn.o_proj"
    q = quantize_fp8_block(torch.randn(8, 16))
    sd[name + ".weight"], sd[name + ".weight_scale_inv"] = q.data, q.scales
    save_file(sd, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"'{name}' is stored as a packed \\[8, 16\\] weight but the model holds Linear"):
        G.load_patched(path, "qwen3_moe")
    with pytest.raises(ValueError, match="linears must be 'packed' or 'dequantized'"):
        G._without_experts(path, torch.float32, linears="float")
    assert json.load(open(tmp_path / "q" / "config.json"))["quantization_config"]["modules_to_not_convert"] == [
        "model.layers.*.mlp.gate", "lm_head"]
