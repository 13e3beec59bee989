"""fmoe.examples.generate: a transformers model patched with fmoe, its experts kept packed, generates
the same greedy tokens as the unpatched model over the dequantized weights.

The checkpoints are written here in the official layouts (gpt-oss MXFP4 blocks/scales, DeepSeek
FP8 weight + weight_scale_inv) from random weights; transformers dequantizes them on a CPU, fmoe
keeps them packed. Both run in float32; the patched experts' sums run in another order (the
packed kernel), which the sharpened random model's logits absorb: every token must be equal.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")   # transformers' MXFP4 / FP8 loaders need it

from fmoe.examples import generate as G  # noqa: E402
from fmoe.quant import QuantizedTensor  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("arch,tokens", [("gpt_oss", 64), ("deepseek_v3", 32)])
def test_patched_packed_model_generates_the_unpatched_tokens(tmp_path, arch, tokens):
    path = G.write_checkpoint(str(tmp_path / arch), arch, "tiny")
    model, nbytes = G.load_patched(path, arch)
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts.gate_up_proj, QuantizedTensor) and isinstance(experts.down_proj, QuantizedTensor)
    assert experts.gate_up_proj.fmt == ("mxfp4" if arch == "gpt_oss" else "fp8_block")
    assert nbytes > 0
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
