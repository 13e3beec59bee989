"""Checkpoints you can trust, and loaders that refuse bad files: every case here was accepted before.

* gather with the wrong --size, flipped bytes, truncated files, differing replicated copies;
* atomic writes: a write that fails (file-size limit, the real EFBIG a full disk gives) leaves the
  old output intact and no partial rank set or temporary file behind;
* the safetensors loader stays inside the checkpoint folder and names missing/unequal/mixed tensors;
* hand-built QuantizedTensors must match their format.
"""
from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys

import pytest
import torch

import fmoe
from fmoe import checkpoint as ck
from fmoe.models import loader
from fmoe.quant import QuantizedTensor, quantize_fp8_block, quantize_mxfp4, quantize_nvfp4

safetensors_torch = pytest.importorskip("safetensors.torch")


def _full(E=2):
    spec = fmoe.MoESpec(model_dim=4, num_experts=E, gate=fmoe.GateSpec(k=1),
                        experts=fmoe.ExpertSpec(type="ffn", hidden_size=8))
    p = fmoe.init_params(spec, generator=torch.Generator().manual_seed(0))
    return ck.state_dict_from_params(p, E, prefix="moe") | {"head": torch.arange(3.0)}


def _cli(*args, fsize=None):
    def limit():  # a file-size limit makes writes fail with EFBIG, as a full disk would
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    return subprocess.run([sys.executable, "-m", "fmoe.checkpoint", *args, "--no-progress"], capture_output=True,
                          text=True, timeout=120, preexec_fn=limit if fsize else None)


def _scatter8(tmp_path, pattern="r{rank}-of-{size}.pt"):
    torch.save(_full(), tmp_path / "full.pt")
    ck.scatter_files(str(tmp_path / "full.pt"), str(tmp_path / pattern), 8, progress=False)
    return str(tmp_path / pattern)


def test_gather_refuses_a_size_that_does_not_match_the_rank_files(tmp_path):
    pattern = _scatter8(tmp_path, "r{rank}.pt")  # no {size} in the names: --size 4 finds files 0..3
    r = _cli("gather", "--inputs", pattern, "--size", "4", "--output", str(tmp_path / "out.pt"))
    assert r.returncode == 2 and "--size is 4 but" in r.stderr and "r4.pt exists" in r.stderr, r.stderr
    os.remove(tmp_path / "r4.pt")  # now only the metadata can tell
    with pytest.raises(ck.CheckpointError, match="belongs to a set of 8 rank files, but --size/len"):
        ck.gather_files(pattern, 4, str(tmp_path / "out.pt"), progress=False)
    assert not (tmp_path / "out.pt").exists()


def test_gather_refuses_rank_files_out_of_place():
    parts = ck.scatter(_full(), 4)
    with pytest.raises(ck.CheckpointError, match="rank 2's file, found at position 1"):
        ck.gather([parts[0], parts[2], parts[1], parts[3]])
    back = ck.gather(parts)
    assert torch.equal(back["moe.experts.fc1_w"], _full()["moe.experts.fc1_w"])
    assert ck.read_metadata(back)["world_size"] == 1


def test_flipped_bytes_and_truncation_are_detected(tmp_path):
    pattern = _scatter8(tmp_path)
    victim = tmp_path / "r3-of-8.pt"
    blob = bytearray(victim.read_bytes())
    t = torch.load(victim, weights_only=False)["moe.experts.fc1_w"]
    at = bytes(blob).find(t.numpy().tobytes())
    assert at > 0
    blob[at + 5] ^= 0x10  # one flipped bit inside an expert tensor's data
    victim.write_bytes(bytes(blob))
    with pytest.raises(ck.CheckpointError, match=r"r3-of-8.pt is corrupt: the bytes of 1 tensor\(s\) do not match"):
        ck.gather_files(pattern, 8, str(tmp_path / "out.pt"), progress=False)
    victim.write_bytes(bytes(blob[: len(blob) // 2]))
    with pytest.raises(ck.CheckpointError, match="cannot read .*r3-of-8.pt: it is truncated or corrupt"):
        ck.gather_files(pattern, 8, str(tmp_path / "out.pt"), progress=False)
    assert not (tmp_path / "out.pt").exists()


def test_replicated_tensors_are_compared():
    parts = ck.scatter(_full(), 2)
    parts[0]["moe.gate.wg"] = parts[0]["moe.gate.wg"] + 1  # a stale gate copy on rank 0
    parts[0] = ck.attach_metadata(parts[0], rank=0, world_size=2)  # metadata re-made: the bytes are "valid"
    with pytest.raises(ck.CheckpointError, match="replicated tensor 'moe.gate.wg' differs between rank 0 and rank 1"):
        ck.gather(parts)
    assert torch.equal(ck.gather(parts, check_replicated=False)["moe.gate.wg"], parts[1]["moe.gate.wg"])


def test_gather_of_legacy_rank_files_without_metadata_still_works():
    parts = [dict(p) for p in ck.scatter(_full(), 2)]  # plain dicts: what training code saves
    assert ck.read_metadata(parts[0]) is None
    assert torch.equal(ck.gather(parts)["moe.experts.fc2_w"], _full()["moe.experts.fc2_w"])


def test_scatter_refuses_a_rank_file_as_input():
    part = ck.scatter(_full(), 2)[1]
    with pytest.raises(ck.CheckpointError, match="rank 1 of a 2-rank set"):
        ck.scatter(part, 2)


def test_failed_gather_leaves_the_old_output_intact(tmp_path):
    pattern = _scatter8(tmp_path)
    out = tmp_path / "out.pt"
    out.write_bytes(b"the good old checkpoint")
    r = _cli("gather", "--inputs", pattern, "--size", "8", "--output", str(out), fsize=600)
    assert r.returncode == 2 and "error" in r.stderr, r.stderr
    assert out.read_bytes() == b"the good old checkpoint"
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_failed_scatter_writes_no_partial_rank_set(tmp_path):
    torch.save(_full(), tmp_path / "full.pt")
    args = ("scatter", "--input", str(tmp_path / "full.pt"), "--outputs", str(tmp_path / "s/r{rank}.pt"), "--size", "4")
    os.makedirs(tmp_path / "s")
    for q in range(4):  # an existing set is replaced whole or not at all
        (tmp_path / "s" / f"r{q}.pt").write_bytes(b"old")
    r = _cli(*args, fsize=1000)
    assert r.returncode == 2 and "error" in r.stderr, r.stderr
    assert sorted(os.listdir(tmp_path / "s")) == [f"r{q}.pt" for q in range(4)]  # no partial file, no temporary
    assert all((tmp_path / "s" / f"r{q}.pt").read_bytes() == b"old" for q in range(4))
    ck.scatter_files(str(tmp_path / "full.pt"), str(tmp_path / "s/r{rank}.pt"), 4, progress=False)
    assert ck.read_metadata(torch.load(tmp_path / "s" / "r3.pt", weights_only=False))["rank"] == 3


def test_atomic_write_keeps_the_old_file_when_serialising_raises(tmp_path):
    from fmoe import _io
    path = tmp_path / "x.pt"
    _io.atomic_save({"a": torch.ones(2)}, path)

    def broken(f):
        f.write(b"partial")
        raise OSError(28, "No space left on device")
    with pytest.raises(OSError, match="No space left"):
        _io.atomic_write(path, broken)
    assert torch.equal(torch.load(path)["a"], torch.ones(2))
    assert os.listdir(tmp_path) == ["x.pt"]


# ------------------------------------------------------------------ safetensors loader

def _index(d, weight_map):
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": weight_map}, f)


def test_index_cannot_point_outside_the_checkpoint(tmp_path):
    ck_dir = tmp_path / "ckpt"
    ck_dir.mkdir()
    safetensors_torch.save_file({"a": torch.ones(2)}, str(tmp_path / "outside.safetensors"))
    _index(ck_dir, {"a": "../outside.safetensors"})
    with pytest.raises(ValueError, match=r"shard '../outside.safetensors' lies outside the checkpoint folder"):
        loader.read_tensors(str(ck_dir), lambda k: True)
    _index(ck_dir, {"a": str(tmp_path / "outside.safetensors")})
    with pytest.raises(ValueError, match="lies outside the checkpoint folder"):
        loader.read_tensors(str(ck_dir), lambda k: True)


def test_shard_lacking_a_tensor_its_index_names(tmp_path):
    safetensors_torch.save_file({"a": torch.ones(2)}, str(tmp_path / "s1.safetensors"))
    _index(tmp_path, {"a": "s1.safetensors", "b": "s1.safetensors"})
    with pytest.raises(KeyError, match=r"shard .*s1.safetensors lacks 1 tensor\(s\) its index places there, e.g. \['b'\]"):
        loader.read_tensors(str(tmp_path), lambda k: True)
    _index(tmp_path, {"a": "s1.safetensors", "c": "s2.safetensors"})
    with pytest.raises(FileNotFoundError, match="names shard .*s2.safetensors, which does not exist"):
        loader.read_tensors(str(tmp_path), lambda k: True)


def _qwen3(E=2, H=16, I=16):
    from fmoe.models import qwen3_moe
    cfg = {"model_type": "qwen3_moe", "hidden_size": H, "num_experts": E, "num_experts_per_tok": 1,
           "moe_intermediate_size": I, "norm_topk_prob": True, "num_hidden_layers": 1, "decoder_sparse_step": 1,
           "mlp_only_layers": [], "hidden_act": "silu"}
    sd = {"gate.weight": torch.randn(E, H, dtype=torch.bfloat16)}
    for m in range(E):
        sd[f"experts.{m}.gate_proj.weight"] = torch.randn(I, H, dtype=torch.bfloat16)
        sd[f"experts.{m}.up_proj.weight"] = torch.randn(I, H, dtype=torch.bfloat16)
        sd[f"experts.{m}.down_proj.weight"] = torch.randn(H, I, dtype=torch.bfloat16)
    return sd, fmoe.models.registry.config_from_hf(cfg, "qwen3_moe")


def test_unequal_or_mixed_dtype_experts_are_refused():
    sd, cfg = _qwen3()
    bad = dict(sd, **{"experts.1.up_proj.weight": torch.randn(8, 16, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match=r"up_proj: experts have different shapes \(expert 0 is \[16, 16\], expert 1 is \[8, 16\]\)"):
        loader.params_from_state_dict(bad, "qwen3_moe", cfg)
    mixed = dict(sd, **{"experts.1.down_proj.weight": sd["experts.1.down_proj.weight"].half()})
    with pytest.raises(ValueError, match=r"down_proj: experts have different dtypes \['torch.bfloat16', 'torch.float16'\]"):
        loader.params_from_state_dict(mixed, "qwen3_moe", cfg)
    p = loader.params_from_state_dict(sd, "qwen3_moe", cfg)
    assert p["experts"]["down_proj"].dtype == torch.bfloat16


def test_integer_weights_on_the_fused_path_are_refused():
    sd, cfg = _qwen3()
    fused = {"gate.weight": sd["gate.weight"], "experts.gate_up_proj": torch.zeros(2, 32, 16, dtype=torch.int8),
             "experts.down_proj": torch.zeros(2, 16, 16, dtype=torch.bfloat16)}
    with pytest.raises(ValueError, match="'experts.gate_up_proj' is torch.int8 but no scale tensor"):
        loader.params_from_state_dict(fused, "qwen3_moe", cfg)


def test_fp8_scale_shape_that_fits_no_block():
    w = torch.zeros(256, 256).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"FP8 scale shape \[3, 2\] fits no block size for weight \[256, 256\]"):
        loader._block_of(w, torch.ones(3, 2))


# ------------------------------------------------------------------ QuantizedTensor

@pytest.mark.parametrize("fmt,make", [
    ("mxfp4", lambda: quantize_mxfp4(torch.randn(4, 64))),
    ("nvfp4", lambda: quantize_nvfp4(torch.randn(4, 64))),
    ("fp8_block", lambda: quantize_fp8_block(torch.randn(4, 64), block=(2, 32))),
])
def test_truncated_scales_are_refused(fmt, make):
    q = make()
    with pytest.raises(ValueError, match=rf"QuantizedTensor\({fmt}.*scales must be .* got"):
        QuantizedTensor(q.data, q.scales[..., :1], q.global_scale, q.fmt, q.shape, q.block)
    with pytest.raises(ValueError, match=r"data must be"):
        QuantizedTensor(q.data[..., :-1], q.scales, q.global_scale, q.fmt, q.shape, q.block)


def test_quantized_tensor_global_scale_and_dtype_rules():
    q = quantize_nvfp4(torch.randn(2, 4, 32))
    with pytest.raises(ValueError, match=r"nvfp4 needs a floating global_scale of shape \[2\]"):
        QuantizedTensor(q.data, q.scales, None, "nvfp4", q.shape, q.block)
    m = quantize_mxfp4(torch.randn(4, 64))
    with pytest.raises(ValueError, match="only nvfp4 has a global_scale"):
        QuantizedTensor(m.data, m.scales, torch.ones(()), "mxfp4", m.shape, m.block)
    with pytest.raises(ValueError, match=r"scales must be torch.uint8"):
        QuantizedTensor(m.data, m.scales.float(), None, "mxfp4", m.shape, m.block)
    # indexing, vmap and pytree round trips still build valid tensors
    assert torch.equal(q[1].dequantize(), q.dequantize()[1])
    assert torch.func.vmap(lambda qq: qq.dequantize())(q).shape == (2, 4, 32)
