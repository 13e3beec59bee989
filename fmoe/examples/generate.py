"""Whole-model generation with packed experts: ``python -m fmoe.examples.generate``.

Writes a small checkpoint in a real packed layout (random weights, no download), builds the
transformers model, patches the MoE blocks with :func:`fmoe.models.patch`, hands every patched
block its experts PACKED as the checkpoint stores them (read by :func:`fmoe.models.load_moe_block`;
the experts, routed and shared, are never dequantized: the model is built with them on the meta
device), and generates with ``model.generate``, streaming the tokens and printing tokens/s.

    python -m fmoe.examples.generate                       # gpt-oss layout, MXFP4 experts
    python -m fmoe.examples.generate --arch deepseek_v3    # DeepSeek layout, FP8 128x128 blocks
    python -m fmoe.examples.generate --arch deepseek_v3 --dense-layers 1   # its first layer a dense MLP
    python -m fmoe.examples.generate --arch qwen3_moe      # Qwen3-MoE, FP8 128x128 blocks
    python -m fmoe.examples.generate --arch qwen3_moe --format nvfp4   # Qwen3-MoE, ModelOpt NVFP4
    python -m fmoe.examples.generate --compare             # also the unpatched model: same tokens?

Layouts written (the names and shapes the official checkpoints use):
  gpt_oss      ``model.layers.N.mlp.experts.{gate_up,down}_proj_{blocks,scales}`` (uint8 [E, out,
               in/32, 16] and [E, out, in/32]) + ``*_bias``; config ``quantization_config``
               ``{"quant_method": "mxfp4"}``. transformers dequantizes these on a CPU.
  deepseek_v3  ``model.layers.N.mlp.experts.M.{gate,up,down}_proj.weight`` float8_e4m3fn +
               ``.weight_scale_inv`` float32 [out/128, in/128] (ceil), the shared experts and every
               attention projection (``self_attn.*.weight``) too; config ``quantization_config``
               ``{"quant_method": "fp8", "weight_block_size": [128, 128]}``, the router and the
               head left unquantized (``modules_to_not_convert``).
  qwen3_moe    fp8_block: the DeepSeek names and config (Qwen3's own FP8 releases use them).
               nvfp4: ModelOpt's, ``model.layers.N.mlp.experts.M.{gate,up,down}_proj.weight`` uint8
               [out, in/2] + ``.weight_scale`` float8_e4m3fn [out, in/16] + ``.weight_scale_2``
               float32 [] + ``.input_scale`` float32 [], the attention projections too; config
               ``quantization_config`` ``{"quant_method": "modelopt", "quant_algo": "NVFP4", ...}``
               (``ignore``: the head and the routers). transformers has no CPU path for these: the
               unpatched model (:func:`load_reference`) runs transformers' modules over fmoe's
               dequantization of them.

The loader keeps every packed weight packed: the experts in the patched MoE blocks, the attention
projections (and DeepSeek's dense MLPs, ``--dense-layers``) as :class:`PackedLinear` modules.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import sys
import tempfile
import time
from typing import Optional

import torch
from torch import nn

from fmoe.quant import quantize_fp8_block, quantize_mxfp4, quantize_nvfp4, to_gpt_oss, to_modelopt_nvfp4

# Small enough to write and load in seconds, large enough that the experts dominate the bytes.
SIZES = {
    "tiny": dict(hidden=64, inter=128, layers=2, experts=4, k=2, heads=4, kv=2, head_dim=16, vocab=256),
    "small": dict(hidden=1024, inter=512, layers=4, experts=32, k=4, heads=8, kv=2, head_dim=64, vocab=4096),
    "medium": dict(hidden=2048, inter=768, layers=8, experts=64, k=6, heads=16, kv=4, head_dim=64, vocab=8192),
}


def _gpt_oss_config(s: dict):
    from transformers import GptOssConfig
    n = s["layers"]
    return GptOssConfig(hidden_size=s["hidden"], intermediate_size=s["inter"], num_hidden_layers=n,
                        num_local_experts=s["experts"], num_experts_per_tok=s["k"], num_attention_heads=s["heads"],
                        num_key_value_heads=s["kv"], head_dim=s["head_dim"], vocab_size=s["vocab"],
                        max_position_embeddings=4096, sliding_window=128,
                        rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
                        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)])


def _deepseek_config(s: dict, dense_layers: int = 0):
    from transformers import DeepseekV3Config
    return DeepseekV3Config(hidden_size=s["hidden"], intermediate_size=2 * s["inter"],
                            moe_intermediate_size=s["inter"], num_hidden_layers=s["layers"],
                            first_k_dense_replace=dense_layers,
                            n_routed_experts=s["experts"], num_experts_per_tok=s["k"], n_shared_experts=1,
                            n_group=1, topk_group=1, num_attention_heads=s["heads"],
                            num_key_value_heads=s["heads"], q_lora_rank=None, kv_lora_rank=64,
                            qk_nope_head_dim=s["head_dim"], qk_rope_head_dim=32, v_head_dim=s["head_dim"],
                            vocab_size=s["vocab"], max_position_embeddings=4096, rope_scaling=None)


def _qwen3_moe_config(s: dict):
    from transformers import Qwen3MoeConfig
    return Qwen3MoeConfig(hidden_size=s["hidden"], intermediate_size=2 * s["inter"], moe_intermediate_size=s["inter"],
                          num_hidden_layers=s["layers"], num_experts=s["experts"], num_experts_per_tok=s["k"],
                          num_attention_heads=s["heads"], num_key_value_heads=s["kv"], head_dim=s["head_dim"],
                          vocab_size=s["vocab"], max_position_embeddings=4096, decoder_sparse_step=1,
                          mlp_only_layers=[], norm_topk_prob=True)


_CONFIGS = {"gpt_oss": _gpt_oss_config, "deepseek_v3": _deepseek_config, "qwen3_moe": _qwen3_moe_config}
# The packed formats each architecture's checkpoint is written in (the first is the default).
FORMATS = {"gpt_oss": ("mxfp4",), "deepseek_v3": ("fp8_block",), "qwen3_moe": ("fp8_block", "nvfp4")}


def _sharpen(model: nn.Module) -> None:
    # Random weights give near-flat logits, where greedy decoding is decided by rounding noise;
    # a larger embedding/head scale gives confident tokens, so equal generations mean equal math.
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(20.0)
        model.get_output_embeddings().weight.mul_(20.0)


def write_checkpoint(path: str, arch: str = "gpt_oss", size: str = "tiny", seed: int = 0,
                     fmt: Optional[str] = None, dense_layers: int = 0) -> str:
    """A random model of `arch` at `size` (see SIZES) saved to `path` with its routed experts packed
    in `fmt` (one of ``FORMATS[arch]``; default the first), in the official layout of that format
    (module docstring). ``dense_layers``: deepseek_v3 only, its first layers dense MLPs instead of MoE
    blocks (``first_k_dense_replace``: three in the DeepSeek-V3 release), stored packed like its
    attention. Returns path."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    if arch not in FORMATS:
        raise ValueError(f"write_checkpoint: arch must be one of {tuple(FORMATS)}, got {arch!r}")
    fmt = FORMATS[arch][0] if fmt is None else fmt
    if fmt not in FORMATS[arch]:
        raise ValueError(f"write_checkpoint: {arch} checkpoints are written in {FORMATS[arch]}, got fmt={fmt!r}")
    if size not in SIZES:
        raise ValueError(f"write_checkpoint: size must be one of {tuple(SIZES)}, got {size!r}")
    s = SIZES[size]
    if isinstance(dense_layers, bool) or not isinstance(dense_layers, int) or not 0 <= dense_layers < s["layers"]:
        raise ValueError(f"write_checkpoint: dense_layers must be an int in [0, {s['layers']}) (size {size!r} has "
                         f"{s['layers']} layers), got {dense_layers!r}")
    if dense_layers and arch != "deepseek_v3":
        raise ValueError(f"write_checkpoint: dense_layers is deepseek_v3's first_k_dense_replace; {arch} has none")
    torch.manual_seed(seed)
    cfg = _deepseek_config(s, dense_layers) if arch == "deepseek_v3" else _CONFIGS[arch](s)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _sharpen(model)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    if arch == "gpt_oss":
        for k in [k for k in sd if k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj")]:
            w = sd.pop(k) * 0.5                    # [E, in, out] (x @ W) in transformers
            blocks, scales = to_gpt_oss(quantize_mxfp4(w.transpose(1, 2).contiguous()))   # rows = out
            sd[k + "_blocks"], sd[k + "_scales"] = blocks, scales
        qcfg = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                     "model.embed_tokens", "lm_head"]}
    else:
        for k in [k for k in sd if ".mlp.experts." in k or ".mlp.shared_experts." in k]:
            if k.endswith("proj") and sd[k].dim() == 3:   # transformers' fused [E, out, in] -> per expert
                w = sd.pop(k)
                base, name = k.rsplit(".", 1)
                parts = ([("gate_proj", w[:, : w.shape[1] // 2]), ("up_proj", w[:, w.shape[1] // 2:])]
                         if name == "gate_up_proj" else [("down_proj", w)])
                for pname, pw in parts:
                    for e in range(pw.shape[0]):
                        sd.update(_packed_linear(f"{base}.{e}.{pname}", pw[e].contiguous(), fmt))
            elif k.endswith(".weight") and ".shared_experts." in k:
                q = quantize_fp8_block(sd[k])
                sd[k], sd[k[:-len("weight")] + "weight_scale_inv"] = q.data, q.scales
        # the attention projections and dense MLPs too, as the official FP8 and ModelOpt releases store them
        # (not the norms, the routers or the head)
        for k in [k for k in sd if k.endswith(".weight") and sd[k].dim() == 2 and (
                ".self_attn." in k or re.search(r"\.mlp\.(gate|up|down)_proj\.weight$", k))]:
            sd.update(_packed_linear(k[:-len(".weight")], sd.pop(k), fmt))
        if fmt == "nvfp4":
            group = {"num_bits": 4, "type": "float", "group_size": 16, "dynamic": False}
            qcfg = {"quant_method": "modelopt", "quant_algo": "NVFP4", "producer": {"name": "modelopt"},
                    "config_groups": {"group_0": {"weights": group, "input_activations": group, "targets": ["Linear"]}},
                    "ignore": ["lm_head", "model.layers.*.mlp.gate"]}
        else:
            qcfg = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128], "modules_to_not_convert": ["model.layers.*.mlp.gate", "lm_head"]}
    os.makedirs(path, exist_ok=True)
    save_file(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    c = cfg.to_dict()
    c["quantization_config"] = qcfg
    c["architectures"] = [type(model).__name__]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f, indent=1)
    return path


def _packed_linear(name: str, w: torch.Tensor, fmt: str) -> dict:
    """One Linear weight w [out, in] (an expert projection, an attention projection, a dense MLP's) as the
    official checkpoints store it in `fmt`."""
    if fmt == "nvfp4":   # ModelOpt: an input scale beside the weight (W4A4's; the weight-only path ignores it)
        data, scale, scale_2 = to_modelopt_nvfp4(quantize_nvfp4(w))
        return {f"{name}.weight": data, f"{name}.weight_scale": scale, f"{name}.weight_scale_2": scale_2,
                f"{name}.input_scale": torch.tensor(1.0 / (6 * 448))}
    q = quantize_fp8_block(w)
    return {f"{name}.weight": q.data, f"{name}.weight_scale_inv": q.scales}


def _quant_method(path: str) -> Optional[str]:
    with open(os.path.join(path, "config.json")) as f:
        return (json.load(f).get("quantization_config") or {}).get("quant_method")


class PackedExperts(nn.Module):
    """A patched block's experts (routed, or DeepSeek's shared ones) as the checkpoint stores them:
    QuantizedTensors (held as plain attributes: they are not nn.Parameters) + float biases, read by
    fmoe's block adapters."""

    def __init__(self, experts: dict):
        super().__init__()
        for name, value in experts.items():
            if isinstance(value, torch.Tensor):
                self.register_buffer(name, value)
            else:
                setattr(self, name, value)


class PackedLinear(nn.Module):
    """An ``nn.Linear`` whose weight the checkpoint stores packed (the attention projections of the
    FP8 and ModelOpt releases): the QuantizedTensor [out, in] held as a plain attribute (not an
    nn.Parameter), multiplied by :func:`fmoe.experts.linear` (packed on eager CPU fp32 or bf16 rows,
    dequantized elsewhere). x [..., in] -> [..., out] in x's dtype."""

    def __init__(self, weight, bias: Optional[torch.Tensor] = None):
        super().__init__()
        self.weight = weight
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from fmoe.experts import linear
        y = linear(x.reshape(-1, self.in_features), self.weight, self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.weight.fmt}, "
                f"bias={self.bias is not None}")


def _cat_rows(gate, up):
    """[E, I, H] + [E, I, H] fp8_block -> [E, 2I, H], gate rows first (exact: I is a whole number of
    row blocks, so no scale block straddles the seam)."""
    from fmoe.quant import QuantizedTensor
    E, n, k = gate.logical_shape
    if n % gate.block[0]:
        raise ValueError(f"the experts' intermediate size {n} is not a multiple of the FP8 row block "
                         f"{gate.block[0]}: gate and up cannot be fused exactly")
    data = torch.cat([gate.data.view(torch.uint8), up.data.view(torch.uint8)], 1).view(torch.float8_e4m3fn)
    return QuantizedTensor(data, torch.cat([gate.scales, up.scales], 1), None, "fp8_block", (E, 2 * n, k), gate.block)


_EXPERTS = (".mlp.experts.", ".mlp.shared_experts.")


def _without_experts(path: str, dtype: torch.dtype, *, linears: str = "packed"):
    """transformers' model of the checkpoint at `path` with every weight but the experts' (routed
    and shared) read from it (floats cast to dtype, as from_pretrained does) and the experts left
    unallocated (on the meta device) for the packed ones: no dequantized copy of the experts is
    ever made, so neither the load's peak nor the heap it leaves behind holds one
    (from_pretrained's CPU path dequantizes MXFP4 experts to dtype first: 384 MiB at size 'small',
    most of which glibc keeps resident after they are freed). The checkpoint's other quantized
    Linears (:func:`fmoe.models.loader.packed_linears`: the FP8 and ModelOpt attention projections)
    become :class:`PackedLinear` modules with ``linears="packed"``, or nn.Linears of their
    dequantized weights in dtype with ``linears="dequantized"``."""
    from fmoe.models.loader import packed_linears, read_tensors
    from transformers import AutoConfig, AutoModelForCausalLM

    if linears not in ("packed", "dequantized"):
        raise ValueError(f"linears must be 'packed' or 'dequantized', got {linears!r}")
    cfg = AutoConfig.from_pretrained(path)
    cfg.quantization_config = None   # the experts are fmoe's; the rest is read here
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    def expert(k: str) -> bool:
        return any(e in k for e in _EXPERTS)
    sd = read_tensors(path, lambda k: not expert(k))
    quantized, read = packed_linears(sd, where=path)
    for name, w in quantized.items():
        parent, _, child = name.rpartition(".")
        old = model.get_submodule(name)
        if not isinstance(old, nn.Linear) or tuple(w.shape) != (old.out_features, old.in_features):
            raise ValueError(f"{path}: '{name}' is stored as a packed [{w.shape[0]}, {w.shape[1]}] weight but the model "
                             f"holds {old} there")
        if linears == "packed":   # (a bias stays a float tensor of the state dict, loaded below)
            new = PackedLinear(w, torch.empty(w.shape[0], dtype=dtype, device="meta") if old.bias is not None else None)
        else:
            new = nn.Linear(old.in_features, old.out_features, bias=old.bias is not None, dtype=dtype, device="meta")
            sd[name + ".weight"] = w.dequantize(torch.float32)   # (the key read as packed: replaced)
            read.discard(name + ".weight")
        setattr(model.get_submodule(parent), child, new)
    sd = {k: t.to(dtype) if t.is_floating_point() else t for k, t in sd.items() if k not in read}
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    if unexpected or any(not expert(k) for k in missing):
        raise ValueError(f"{path}: the checkpoint does not fit {type(model).__name__}: unexpected "
                         f"{unexpected[:4]}, missing {[k for k in missing if not expert(k)][:4]}")
    model.tie_weights()
    for name, m in model.named_modules():
        if any(b.is_meta for b in m.buffers(recurse=False)):
            if not name.endswith("rotary_emb"):
                raise ValueError(f"{name}: a computed buffer left on the meta device")
            model.get_submodule(name.rpartition(".")[0]).rotary_emb = type(m)(config=model.config)
    return model.eval()


def load_patched(path: str, arch: str, dtype: torch.dtype = torch.float32, *, int8_activations: bool = False,
                 huge_pages: bool = True):
    """(model, packed_bytes): transformers' model from `path`, patched with fmoe, every MoE block's
    experts the checkpoint's packed ones (``int8_activations``: :func:`fmoe.models.patch`'s), and its
    other packed Linears :class:`PackedLinear` modules; packed_bytes counts them all.
    ``huge_pages``: the packed tensors are copied onto transparent huge pages
    (:func:`fmoe.quant.huge_pages`: fewer TLB misses as decode streams them; resident from the
    load on) instead of staying memory-mapped from the checkpoint. No packed weight (experts routed
    and shared, attention projections) is ever dequantized (:func:`_without_experts`)."""
    import fmoe.models
    from fmoe.models import load_moe_block
    from fmoe.quant import huge_pages as to_huge_pages

    model = _without_experts(path, dtype)
    fmoe.models.patch(model, int8_activations=int8_activations)
    packed_bytes = 0
    for m in model.modules():   # the checkpoint's packed attention projections (FP8, ModelOpt releases)
        if isinstance(m, PackedLinear):
            m.weight = to_huge_pages(m.weight) if huge_pages else m.weight
            packed_bytes += m.weight.nbytes
    for i, layer in enumerate(model.model.layers):
        block = layer.mlp
        if not isinstance(block, fmoe.models.FmoeMoEBlock):   # a dense layer (DeepSeek's first ones)
            continue
        params, _ = load_moe_block(path, arch, layer=i)
        ex = params["experts"]
        if "gate_proj" in ex and ex["gate_proj"].fmt == "fp8_block":
            # per-projection FP8 fused into one gate_up_proj (exact); NVFP4's stay apart (a global scale each)
            ex = {"gate_up_proj": _cat_rows(ex.pop("gate_proj"), ex.pop("up_proj")), **ex}
        for name, held in (("experts", ex), ("shared_experts", params.get("shared"))):
            if held is None:
                continue
            held = {k: (v.to(dtype) if isinstance(v, torch.Tensor) else v) for k, v in held.items()}
            setattr(block, name, PackedExperts(to_huge_pages(held) if huge_pages else held))
            packed_bytes += sum(v.nbytes for v in held.values() if not isinstance(v, torch.Tensor))
    return model, packed_bytes


def load_reference(path: str, dtype: torch.dtype = torch.float32):
    """The same checkpoint through transformers alone, its packed weights dequantized: by its own
    CPU path (MXFP4, FP8), or for ModelOpt NVFP4, which it does not load on a CPU, by
    :func:`fmoe.quant.dequantize` into its unpatched experts and attention modules."""
    from transformers import AutoModelForCausalLM
    if _quant_method(path) != "modelopt":
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    from fmoe.models import load_moe_block
    from fmoe.quant import dequantize
    model = _without_experts(path, dtype, linears="dequantized")
    arch = model.config.model_type
    for i, layer in enumerate(model.model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:   # a dense layer: its Linears dequantized by _without_experts
            continue
        ex = load_moe_block(path, arch, layer=i)[0]["experts"]
        experts.gate_up_proj = nn.Parameter(torch.cat([dequantize(ex["gate_proj"]), dequantize(ex["up_proj"])], 1)
                                            .to(dtype), requires_grad=False)
        experts.down_proj = nn.Parameter(dequantize(ex["down_proj"]).to(dtype), requires_grad=False)
    return model


def greedy(model, prompt: torch.Tensor, new_tokens: int, streamer=None) -> torch.Tensor:
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             streamer=streamer, pad_token_id=0)
    return out[:, prompt.shape[1]:]


class _PrintStreamer:
    """Prints token ids as generate() produces them (the random model has no tokenizer)."""

    def __init__(self):
        self.first = True
        self.t0 = time.perf_counter()
        self.times = []

    def put(self, value):
        if self.first:   # generate() hands over the prompt first
            self.first = False
            return
        self.times.append(time.perf_counter())
        print(" ".join(str(int(v)) for v in value.reshape(-1)), end=" ", flush=True)

    def end(self):
        print(flush=True)


def rss_mib() -> float:
    """Peak resident memory of this process so far, MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", choices=list(FORMATS), default="gpt_oss")
    p.add_argument("--format", default=None, help="the experts' packed format (gpt_oss: mxfp4; deepseek_v3: "
                   "fp8_block; qwen3_moe: fp8_block (default) or nvfp4)")
    p.add_argument("--size", choices=list(SIZES), default="small")
    p.add_argument("--dense-layers", type=int, default=0,
                   help="deepseek_v3: the first N layers dense MLPs (first_k_dense_replace; the release has 3), "
                        "stored FP8 like its attention")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--checkpoint", default=None, help="directory to write (default: a temporary one)")
    p.add_argument("--compare", action="store_true", help="also generate with the unpatched model")
    p.add_argument("--int8-activations", action="store_true",
                   help="the packed FP4 experts multiply int8-rounded rows (ExpertSpec.int8_activations; an "
                        "AVX-512 VNNI CPU; MXFP4 and NVFP4 experts only, not FP8)")
    p.add_argument("--no-huge-pages", action="store_true",
                   help="keep the packed experts memory-mapped from the checkpoint on 4 KiB pages instead of copying "
                        "them onto transparent huge pages (fmoe.quant.huge_pages)")
    args = p.parse_args(argv)
    tmp = None
    path = args.checkpoint
    if path is None:
        tmp = tempfile.TemporaryDirectory(prefix="fmoe-generate-")
        path = tmp.name
    t0 = time.perf_counter()
    fmt = FORMATS[args.arch][0] if args.format is None else args.format
    if fmt not in FORMATS[args.arch]:
        p.error(f"--format: {args.arch} checkpoints are written in {FORMATS[args.arch]}, got {fmt!r}")
    if args.dense_layers and args.arch != "deepseek_v3":
        p.error(f"--dense-layers: {args.arch} has no dense layers (deepseek_v3's first_k_dense_replace)")
    write_checkpoint(path, args.arch, args.size, fmt=fmt, dense_layers=args.dense_layers)
    print(f"wrote a random {args.arch} checkpoint ({args.size}, {fmt} experts) to {path} in {time.perf_counter() - t0:.1f} s; "
          f"{os.path.getsize(os.path.join(path, 'model.safetensors')) / 2**20:.0f} MiB")
    model, nbytes = load_patched(path, args.arch, int8_activations=args.int8_activations,
                                 huge_pages=not args.no_huge_pages)
    from fmoe.quant import hugepages
    pages = "huge pages" if hugepages.available() and not args.no_huge_pages else "4 KiB pages"
    print(f"patched with fmoe; packed weights kept packed: {nbytes / 2**20:.1f} MiB on {pages}"
          + ("; int8 activations" if args.int8_activations else ""))
    from fmoe.quant import packed
    print(packed.status())
    prompt = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29]])
    streamer = _PrintStreamer()
    ids = greedy(model, prompt, args.tokens, streamer)
    ts = streamer.times
    if len(ts) > 1:
        print(f"fmoe: {len(ts) - 1} tokens in {ts[-1] - ts[0]:.2f} s after the first = "
              f"{(len(ts) - 1) / (ts[-1] - ts[0]):.1f} tokens/s; peak RSS {rss_mib():.0f} MiB")
    if args.compare:
        del model
        ref = load_reference(path)
        ref_ids = greedy(ref, prompt, args.tokens)
        same = int((ids == ref_ids).cumprod(-1).sum())
        print(f"unpatched transformers model: first {same} of {args.tokens} tokens equal")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
