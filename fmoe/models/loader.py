"""Read one MoE block of an official checkpoint into an fmoe parameter pytree.

    params, cfg = load_moe_block("/ckpt/Qwen3-30B-A3B", "qwen3_moe", layer=0)
    y, aux = fmoe.models.qwen3_moe.moe_block(params, x, cfg)

Understood names (spec architectures.md §1.4, §2-§8; formats.md §4-§5), under the layer prefix
``model.layers.N.mlp.`` (also ``.block_sparse_moe.`` for Mixtral, and the Kimi-K2.5 /
multimodal ``language_model`` prefixes):

* router: ``gate.weight`` (+ ``gate.e_score_correction_bias``), GPT-OSS ``router.{weight,bias}``;
* per-expert float: ``experts.M.{gate,up,down}_proj.weight`` (Mixtral ``experts.M.w{1,3,2}.weight``)
  -> fused ``gate_up_proj`` [E, 2I, H] (gate rows first) and ``down_proj`` [E, H, I];
* per-expert DeepSeek FP8: ``.weight`` float8_e4m3fn + ``.weight_scale_inv`` -> QuantizedTensor
  "fp8_block" per projection (``gate_proj``/``up_proj`` kept apart: their 128-row blocks need
  not line up once concatenated);
* per-expert ModelOpt NVFP4: ``.weight`` uint8 + ``.weight_scale`` + ``.weight_scale_2`` (+
  ``.input_scale``, ignored by the weight-only path) -> "nvfp4" per projection (gate and up keep
  their own global scales, formats.md §5.2);
* fused transformers names: ``experts.gate_up_proj`` / ``experts.down_proj`` (+ FP8
  ``*_scale_inv`` / ``*_scales_inv``, + GPT-OSS ``*_bias``);
* GPT-OSS MXFP4: ``experts.{gate_up,down}_proj_{blocks,scales}`` -> "mxfp4" [E, 2I, H] / [E, H, I];
* shared experts: ``shared_expert.*`` + ``shared_expert_gate.weight`` (Qwen2-MoE),
  ``shared_experts.*`` (DeepSeek family), float or quantized like the experts.

Quantized weights stay quantized. Every tensor under the prefix must be understood (no
unexpected keys) and every needed one present (no missing keys). :func:`packed_linears` reads a
checkpoint's other quantized Linears (the FP8 and ModelOpt releases' attention projections) the same
way.
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping, Optional, Union

import torch
from torch import Tensor

from .registry import arch_module, canonical_arch, config_from_hf


_PROGRESS_BYTES = 256 << 20   # show a progress bar above this much to read

_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U16": 2, "U32": 4, "U64": 8}


def layer_prefixes(layer: int) -> list[str]:
    """Candidate key prefixes of layer N's MoE block, most common first."""
    return [f"model.layers.{layer}.mlp.", f"model.layers.{layer}.block_sparse_moe.",
            f"language_model.model.layers.{layer}.mlp.", f"model.language_model.layers.{layer}.mlp."]


# --------------------------------------------------------------------------- reading

def _safetensors():
    try:
        import safetensors  # noqa: F401
        from safetensors import safe_open
    except ImportError as e:
        raise ImportError("reading checkpoints needs the 'safetensors' package (pip install safetensors)") from e
    return safe_open


def _checkpoint_files(path: str) -> tuple[dict[str, str], Optional[str]]:
    """{key: file} restricted lazily later; returns (weight_map or {}, single_file or None)."""
    if os.path.isdir(path):
        idx = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(idx):
            path = idx
        elif os.path.exists(os.path.join(path, "model.safetensors")):
            return {}, os.path.join(path, "model.safetensors")
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if len(files) != 1:
                raise FileNotFoundError(f"{path}: expected model.safetensors.index.json, model.safetensors or one "
                                        f"*.safetensors file, found {files}")
            return {}, os.path.join(path, files[0])
    if path.endswith(".json"):
        with open(path) as f:
            index = json.load(f)
        if "weight_map" not in index:
            raise ValueError(f"{path} has no 'weight_map' (not a safetensors index)")
        base = os.path.dirname(os.path.abspath(path))
        return {k: _inside(base, v, path) for k, v in index["weight_map"].items()}, None
    if path.endswith(".safetensors"):
        return {}, path
    raise FileNotFoundError(f"{path}: not a directory, a .safetensors file or a safetensors index .json")


def _inside(base: str, name, index_path: str) -> str:
    """The shard file ``name`` of an index, refused unless it lies inside the checkpoint folder."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{index_path}: weight_map entry {name!r} is not a file name")
    real_base = os.path.realpath(base)
    full = os.path.realpath(os.path.join(base, name))
    if os.path.isabs(name) or os.path.commonpath([real_base, full]) != real_base:
        raise ValueError(f"{index_path}: shard {name!r} lies outside the checkpoint folder {base}; "
                         "refusing to follow it")
    return full


def read_tensors(path: str, want, *, progress: Optional[bool] = None) -> dict[str, Tensor]:
    """Read the tensors whose key satisfies ``want(key)`` from a checkpoint, opening only the
    shards that hold them (sharded checkpoints are resolved through the index).

    Args:
        path: checkpoint directory, ``*.safetensors`` file or ``model.safetensors.index.json``.
        want: predicate on keys.
        progress: tqdm bar; None = only when more than 256 MiB are read.
    """
    safe_open = _safetensors()
    weight_map, single = _checkpoint_files(str(path))
    by_file: dict[str, list[str]] = {}
    if single is not None:
        with safe_open(single, framework="pt") as f:
            by_file[single] = [k for k in f.keys() if want(k)]
    else:
        for k, fn in weight_map.items():
            if want(k):
                by_file.setdefault(fn, []).append(k)
    sizes: dict[tuple[str, str], int] = {}
    for fn, keys in by_file.items():
        if not os.path.exists(fn):
            raise FileNotFoundError(f"{path}: the index names shard {fn}, which does not exist "
                                    f"(it should hold {keys[:3]}{' ...' if len(keys) > 3 else ''})")
        with safe_open(fn, framework="pt") as f:
            present = set(f.keys())
            lacking = [k for k in keys if k not in present]
            if lacking:
                raise KeyError(f"{path}: shard {fn} lacks {len(lacking)} tensor(s) its index places there, "
                               f"e.g. {lacking[:3]}")
            for k in keys:
                sl = f.get_slice(k)
                n = _DTYPE_BYTES.get(sl.get_dtype(), 4)
                for d in sl.get_shape():
                    n *= d
                sizes[(fn, k)] = n
    total = sum(sizes.values())
    show = total > _PROGRESS_BYTES if progress is None else progress
    bar = None
    if show:
        from tqdm.auto import tqdm
        bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"reading {len(sizes)} tensors")
    out: dict[str, Tensor] = {}
    try:
        for fn, keys in by_file.items():
            with safe_open(fn, framework="pt") as f:
                for k in keys:
                    out[k] = f.get_tensor(k)
                    if bar is not None:
                        bar.update(sizes[(fn, k)])
    finally:
        if bar is not None:
            bar.close()
    return out


def _read_config(path: str) -> Optional[dict]:
    d = path if os.path.isdir(path) else os.path.dirname(path)
    fn = os.path.join(d, "config.json")
    if os.path.exists(fn):
        with open(fn) as f:
            return json.load(f)
    return None


# --------------------------------------------------------------------------- assembling

def _stack(ts: list[Tensor], what: str = "expert tensors") -> Tensor:
    # torch.stack would promote mixed dtypes (one fp16 expert among bf16 ones -> all fp32) and
    # fail with a bare size error on unequal shapes: refuse both, naming the experts.
    dtypes = sorted({str(t.dtype) for t in ts})
    if len(dtypes) > 1:
        odd = [m for m, t in enumerate(ts) if t.dtype != ts[0].dtype]
        raise ValueError(f"{what}: experts have different dtypes {dtypes} (expert 0 is {ts[0].dtype}, experts "
                         f"{odd[:8]} differ); every expert must be stored in one dtype")
    shapes = {tuple(t.shape) for t in ts}
    if len(shapes) > 1:
        odd = [m for m, t in enumerate(ts) if t.shape != ts[0].shape]
        raise ValueError(f"{what}: experts have different shapes (expert 0 is {list(ts[0].shape)}, expert "
                         f"{odd[0]} is {list(ts[odd[0]].shape)}); every expert must have the same shape")
    # torch.stack has no float8 kernels on CPU: stack the bytes.
    if ts[0].dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return torch.stack([t.view(torch.uint8) for t in ts]).view(ts[0].dtype)
    return torch.stack(ts)


class _Keys:
    """The block's tensors by local name; tracks which ones were consumed."""

    def __init__(self, tensors: Mapping[str, Tensor], where: str):
        self.t = dict(tensors)
        self.used: set[str] = set()
        self.where = where

    def has(self, k: str) -> bool:
        return k in self.t

    def get(self, k: str) -> Tensor:
        if k not in self.t:
            raise KeyError(f"{self.where}: missing tensor '{k}'")
        self.used.add(k)
        return self.t[k]

    def opt(self, k: str) -> Optional[Tensor]:
        return self.get(k) if k in self.t else None

    def unexpected(self) -> list[str]:
        return sorted(set(self.t) - self.used)


def _linear_weight(keys: _Keys, base: str):
    """One nn.Linear weight ``base.weight`` (float, FP8 blockwise or NVFP4) -> Tensor or QuantizedTensor."""
    w = keys.get(base + ".weight")
    if keys.has(base + ".weight_scale_inv"):
        from ..quant import from_deepseek_fp8
        s = keys.get(base + ".weight_scale_inv")
        return from_deepseek_fp8(w, s, block=_block_of(w, s))
    if keys.has(base + ".weight_scale"):
        from ..quant import from_modelopt_nvfp4
        ws, ws2 = keys.get(base + ".weight_scale"), keys.get(base + ".weight_scale_2")
        keys.opt(base + ".input_scale")   # activation scale: W4A4 kernels only
        return from_modelopt_nvfp4(w, ws, ws2)
    if not w.is_floating_point() or w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"{keys.where}: '{base}.weight' is {w.dtype} but no scale tensor sits next to it")
    return w


def packed_linears(tensors: Mapping[str, Tensor], *, where: str = "checkpoint") -> tuple[dict, set]:
    """The quantized ``nn.Linear`` weights among a checkpoint's tensors (attention projections, dense
    MLPs: what the official FP8 and ModelOpt releases quantize besides the experts), read as the
    experts' are: ``X.weight`` with DeepSeek's FP8 ``X.weight_scale_inv`` beside it, or ModelOpt
    NVFP4's ``X.weight_scale`` and ``X.weight_scale_2`` (``X.input_scale``, W4A4's, is read and
    dropped).

    Returns:
        ({module name X: QuantizedTensor [out, in]}, the names of every tensor read).
    """
    keys = _Keys(tensors, where)
    out = {}
    for k in sorted(tensors):
        for suffix in (".weight_scale_inv", ".weight_scale"):
            if k.endswith(suffix):
                base = k[: -len(suffix)]
                out[base] = _linear_weight(keys, base)
    return out, keys.used


def _block_of(w: Tensor, s: Tensor) -> tuple[int, int]:
    n, k = w.shape[-2:]
    sn, sk = s.shape[-2:]
    # The block is the smallest size giving this many scale rows/cols (128 in every release).
    bn = next((b for b in (128, 64, 32, 16, 256, n) if -(-n // b) == sn), None)
    bk = next((b for b in (128, 64, 32, 16, 256, k) if -(-k // b) == sk), None)
    if bn is None or bk is None:
        raise ValueError(f"FP8 scale shape {list(s.shape)} fits no block size for weight {list(w.shape)}: "
                         f"ceil(N/b) = {sn} and ceil(K/b) = {sk} need b in (16, 32, 64, 128, 256) or the whole dim")
    return bn, bk


def _stack_linear(ws: list):
    if isinstance(ws[0], Tensor):
        return _stack(ws)
    from ..quant import stack
    return stack(ws)


def _per_expert(keys: _Keys, E: int, names: tuple[str, str, str]) -> dict:
    g, u, d = names
    gate = [_linear_weight(keys, f"experts.{m}.{g}") for m in range(E)]
    up = [_linear_weight(keys, f"experts.{m}.{u}") for m in range(E)]
    down = [_linear_weight(keys, f"experts.{m}.{d}") for m in range(E)]
    kinds = {type(t).__name__ for t in gate + up + down}
    if len(kinds) > 1:
        raise ValueError(f"{keys.where}: experts mix float and quantized weights ({sorted(kinds)})")
    if isinstance(gate[0], Tensor):
        # Fused as transformers does: rows of gate_proj, then rows of up_proj.
        gs, us = _stack(gate, f"{keys.where}: {g}"), _stack(up, f"{keys.where}: {u}")
        if gs.dtype != us.dtype or gs.shape != us.shape:
            raise ValueError(f"{keys.where}: {g} is {gs.dtype} {list(gs.shape[1:])} but {u} is {us.dtype} "
                             f"{list(us.shape[1:])}; they must match to be fused")
        return {"gate_up_proj": torch.cat([gs, us], dim=1), "down_proj": _stack(down, f"{keys.where}: {d}")}
    return {"gate_proj": _stack_linear(gate), "up_proj": _stack_linear(up), "down_proj": _stack_linear(down)}


def _fused(keys: _Keys, name: str):
    w = keys.get(f"experts.{name}")
    for suffix in ("_scale_inv", "_scales_inv"):
        if keys.has(f"experts.{name}{suffix}"):
            from ..quant import from_deepseek_fp8
            s = keys.get(f"experts.{name}{suffix}")
            return from_deepseek_fp8(w, s, block=_block_of(w, s))
    return _float_weight(keys, f"experts.{name}", w)


def _float_weight(keys: _Keys, name: str, w: Tensor) -> Tensor:
    """An unquantized weight must be a (non-FP8) float tensor: integer bytes are not weights."""
    if not w.is_floating_point() or w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"{keys.where}: '{name}' is {w.dtype} but no scale tensor sits next to it; an "
                         "unquantized weight must be float16/bfloat16/float32/float64")
    return w


def _swiglu_experts(keys: _Keys, E: int, mixtral: bool) -> dict:
    if keys.has("experts.gate_up_proj"):
        return {"gate_up_proj": _fused(keys, "gate_up_proj"), "down_proj": _fused(keys, "down_proj")}
    names = ("w1", "w3", "w2") if mixtral and keys.has("experts.0.w1.weight") else ("gate_proj", "up_proj", "down_proj")
    return _per_expert(keys, E, names)


def _gpt_oss_experts(keys: _Keys) -> dict:
    p = {}
    for name in ("gate_up_proj", "down_proj"):
        if keys.has(f"experts.{name}_blocks"):
            from ..quant import from_gpt_oss
            p[name] = from_gpt_oss(keys.get(f"experts.{name}_blocks"), keys.get(f"experts.{name}_scales"))
        else:
            p[name] = _float_weight(keys, f"experts.{name}", keys.get(f"experts.{name}"))
        p[name + "_bias"] = keys.get(f"experts.{name}_bias")
    return p


def _mlp(keys: _Keys, base: str) -> dict:
    return {n: _linear_weight(keys, f"{base}.{n}") for n in ("gate_proj", "up_proj", "down_proj")}


def _cast(params, dtype: Optional[torch.dtype], keep_fp32: tuple = ()):
    if dtype is None:
        return params
    out = {}
    for k, v in params.items():
        if isinstance(v, dict):
            out[k] = _cast(v, dtype, keep_fp32)
        elif isinstance(v, Tensor) and v.is_floating_point() and k not in keep_fp32:
            out[k] = v.to(dtype)
        else:
            out[k] = v
    return out


def params_from_state_dict(tensors: Mapping[str, Tensor], arch: str, config, *, where: str = "block",
                           dtype: Optional[torch.dtype] = None, strict: bool = True) -> dict:
    """Build the fmoe pytree from a block's tensors keyed by local name (``gate.weight``, ...)."""
    a = canonical_arch(arch)
    keys = _Keys(tensors, where)
    E = config.num_experts
    if a == "gpt_oss":
        p = {"router": {"weight": keys.get("router.weight"), "bias": keys.get("router.bias")},
             "experts": _gpt_oss_experts(keys)}
    else:
        p = {"router": {"weight": keys.get("gate.weight")}, "experts": _swiglu_experts(keys, E, a == "mixtral")}
        if a == "deepseek_v3":
            # Router weight and correction bias are kept in fp32 (_keep_in_fp32_modules_strict).
            p["router"]["weight"] = p["router"]["weight"].float()
            b = keys.opt("gate.e_score_correction_bias")
            p["router"]["e_score_correction_bias"] = (torch.zeros(E) if b is None else b.float())
            if config.n_shared_experts > 0:
                p["shared"] = _mlp(keys, "shared_experts")
        if a == "qwen2_moe":
            p["shared"] = _mlp(keys, "shared_expert")
            p["shared_gate"] = {"weight": keys.get("shared_expert_gate.weight")}
    extra = keys.unexpected()
    if strict and extra:
        raise ValueError(f"{where}: unexpected tensors for arch {arch!r}: {extra[:8]}{' ...' if len(extra) > 8 else ''}")
    p = _cast(p, dtype)
    if a == "deepseek_v3":
        p["router"] = {k: v.float() for k, v in p["router"].items()}
    _check_shapes(p, a, config, where)
    return p


def _shape(t) -> tuple:
    return tuple(getattr(t, "logical_shape", None) or t.shape)


def _check_shapes(p: dict, arch: str, config, where: str) -> None:
    E, H = config.num_experts, config.hidden_size
    rw = _shape(p["router"]["weight"])
    if rw != (E, H):
        raise ValueError(f"{where}: router weight is {rw}, config says [E, H] = [{E}, {H}]")
    ex = p["experts"]
    if arch == "gpt_oss":
        I = config.intermediate_size
        gu = _shape(ex["gate_up_proj"])
        if gu not in ((E, H, 2 * I), (E, 2 * I, H)):
            raise ValueError(f"{where}: gate_up_proj is {gu}, expected [E, H, 2I] or MXFP4 [E, 2I, H] with "
                             f"E={E}, H={H}, I={I}")
        return
    I = config.moe_intermediate_size if hasattr(config, "moe_intermediate_size") else config.intermediate_size
    if "gate_up_proj" in ex and _shape(ex["gate_up_proj"]) != (E, 2 * I, H):
        raise ValueError(f"{where}: gate_up_proj is {_shape(ex['gate_up_proj'])}, expected [E, 2I, H] = "
                         f"[{E}, {2 * I}, {H}]")
    if _shape(ex["down_proj"]) != (E, H, I):
        raise ValueError(f"{where}: down_proj is {_shape(ex['down_proj'])}, expected [E, H, I] = [{E}, {H}, {I}]")


def load_moe_block(source: Union[str, os.PathLike, Mapping[str, Tensor]], arch: str, layer: int, *,
                   config: Any = None, dtype: Optional[torch.dtype] = None, prefix: Optional[str] = None,
                   strict: bool = True, progress: Optional[bool] = None) -> tuple[dict, Any]:
    """Load layer ``layer``'s MoE block into an fmoe pytree.

    Args:
        source: a checkpoint directory (``config.json`` + ``model.safetensors`` or a sharded
            ``model.safetensors.index.json``), a ``.safetensors`` file, an index ``.json``, or
            an in-memory state dict with the official names.
        arch: "qwen3_moe", "qwen2_moe", "deepseek_v3" (or deepseek_v32, kimi_k2, glm4_moe,
            glm4_moe_lite, glm_moe_dsa), "gpt_oss", "mixtral".
        layer: decoder layer index (must be a sparse layer).
        config: a block config (e.g. :class:`Qwen3MoeBlockConfig`), a transformers config or a
            config.json dict; default: the checkpoint's config.json.
        dtype: cast float tensors to this dtype (quantized ones stay quantized; the DeepSeek
            router stays fp32); None keeps the file's dtypes.
        prefix: the block's key prefix if not one of :func:`layer_prefixes`.
        strict: refuse tensors under the prefix that are not understood.
        progress: tqdm bar while reading (None = only for > 256 MiB).
    Returns:
        (params, block config).
    """
    mod = arch_module(arch)
    is_path = not isinstance(source, Mapping)
    if config is None and is_path:
        config = _read_config(str(source))
    if config is None:
        raise ValueError("load_moe_block needs config= (no config.json next to the checkpoint)")
    if not _is_block_config(config):
        if hasattr(mod, "is_moe_layer") and not mod.is_moe_layer(config, layer):
            raise ValueError(f"layer {layer} is a dense layer according to the config, not an MoE block")
        config = config_from_hf(config, arch)
    prefixes = [prefix] if prefix else layer_prefixes(layer)
    if is_path:
        tensors = read_tensors(str(source), lambda k: any(k.startswith(p) for p in prefixes), progress=progress)
    else:
        tensors = {k: v for k, v in source.items() if any(k.startswith(p) for p in prefixes)}
    used = next((p for p in prefixes if any(k.startswith(p) for k in tensors)), None)
    if used is None:
        raise KeyError(f"no tensors under {prefixes} in {source if is_path else 'the state dict'}")
    local = {k[len(used):]: v for k, v in tensors.items() if k.startswith(used)}
    params = params_from_state_dict(local, arch, config, where=used.rstrip("."), dtype=dtype, strict=strict)
    return params, config


def _is_block_config(c) -> bool:
    import dataclasses
    return dataclasses.is_dataclass(c) and type(c).__module__.startswith("fmoe.models")
