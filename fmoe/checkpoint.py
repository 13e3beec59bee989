"""Convert MoE checkpoints between world sizes (spec §13).

A checkpoint is a (possibly nested) dict of tensors. A MoE layer at prefix P
is marked by the key ``P._num_global_experts`` (E); its expert tensors are the
keys starting with ``P.experts.``. Per-rank files are named by a pattern with
``{rank}`` and ``{size}``.

* gather: S rank files -> one file holding all E experts (n = E).
  E % S == 0: pieces are concatenated along dim 0.
  S % E == 0 (s = S/E ranks per expert): each expert's s shards are joined
  along their shard axis (fmoe/Tutel ffn names: the hidden axis; fc2 bias:
  the output axis, padding trimmed); unknown expert tensors use Tutel's rule
  (concatenate, reshape to [E, -1, *piece.shape[2:]]).
* scatter: one file -> S rank files, the exact inverse (run with E/S experts
  per rank, or one shard of an expert shared by S/E ranks, i.e. Tutel's
  ``num_experts_per_device = -S/E``). Unknown expert tensors are cut into S
  contiguous pieces of their flat storage (Tutel's rule).

Non-expert tensors: gather takes them from the last rank's file (they are
assumed identical); scatter copies them, and any other content, unchanged.
Conversion moves bytes only: it is exact.

Command line::

    python -m fmoe.checkpoint gather  --inputs 'ck/r{rank}-of-{size}.pt' --size 4 --output full.pt
    python -m fmoe.checkpoint scatter --input full.pt --outputs 'ck8/r{rank}-of-{size}.pt' --size 8
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
from typing import Optional

import torch
from torch import Tensor

__all__ = ["gather", "scatter", "gather_files", "scatter_files", "state_dict_from_params",
           "params_from_state_dict", "main"]

MARKER = "_num_global_experts"
# shard axis of each expert tensor in the per-rank [n, ...] layout; see fmoe.parallel.SHARD_AXES
_AXES = {"fc1_w": 1, "fc1_b": 1, "fc2_w": 1, "fc2_b": 1, "gate_w": 2, "up_w": 2, "down_w": 1,
         "batched_fc1_w": 1, "batched_fc1_bias": 1, "batched_fc2_w": 1, "batched_fc2_bias": 1}
# padded along O; trimmed to the matching fc2 weight's last dim
_PADDED = {"fc2_b": "fc2_w", "batched_fc2_bias": "batched_fc2_w"}


# --------------------------------------------------------------------------- functional params

def state_dict_from_params(params: dict, num_experts: int, prefix: str = "moe") -> dict:
    """Flat checkpoint dict of one layer's pytree ``{"gate": ..., "experts": ...}`` with the E marker."""
    out = {f"{prefix}.{MARKER}": torch.tensor(num_experts, dtype=torch.int64)}
    for group in ("gate", "experts"):
        for k, v in params[group].items():
            if v is not None:
                out[f"{prefix}.{group}.{k}"] = v
    return out


def params_from_state_dict(state: dict, prefix: str = "moe") -> dict:
    """Inverse of :func:`state_dict_from_params` (expert tensors keep their stored per-rank shapes)."""
    out = {"gate": {}, "experts": {}}
    for key, v in state.items():
        for group in out:
            head = f"{prefix}.{group}."
            if key.startswith(head):
                out[group][key[len(head):]] = v
    if not out["experts"]:
        raise KeyError(f"no '{prefix}.experts.*' tensors in the state dict")
    return out


# --------------------------------------------------------------------------- layers

def _descend(obj: dict, namespace: Optional[str]) -> dict:
    if not namespace:
        return obj
    for part in namespace.split("."):
        if not isinstance(obj, dict) or part not in obj:
            raise KeyError(f"namespace {namespace!r}: no key {part!r} in the checkpoint")
        obj = obj[part]
    return obj


def _layers(state: dict, num_experts: Optional[int]) -> dict[str, int]:
    """prefix (with trailing dot, '' for top level) -> E."""
    found = {}
    for key, v in state.items():
        if key == MARKER or key.endswith("." + MARKER):
            found[key[:-len(MARKER)]] = int(v)
    if found:
        return found
    if num_experts is None:
        raise ValueError(f"no '*.{MARKER}' key marks a MoE layer in this checkpoint; for a legacy file pass "
                         "the expert count explicitly (num_experts= / --num-experts, gather only)")
    prefixes = {key[:key.index("experts.")] for key in state if "experts." in key
                and (key.startswith("experts.") or ".experts." in key)}
    return {p: num_experts for p in prefixes}


def _expert_keys(state: dict, prefix: str) -> list[str]:
    head = prefix + "experts."
    return [k for k in state if k.startswith(head) and isinstance(state[k], Tensor)]


def _leaf(key: str) -> str:
    return key.rsplit(".", 1)[-1]


# --------------------------------------------------------------------------- gather / scatter

def gather(states: list, *, num_experts: Optional[int] = None) -> dict:
    """Merge S per-rank state dicts (rank order) into one with all E experts on one rank."""
    S = len(states)
    if S == 0:
        raise ValueError("gather: no input state dicts")
    out = dict(states[-1])
    for prefix, E in _layers(states[-1], num_experts).items():
        keys = _expert_keys(states[-1], prefix)
        for key in keys:
            missing = [r for r, st in enumerate(states) if key not in st]
            if missing:
                raise KeyError(f"gather: expert tensor {key!r} is missing from rank file(s) {missing}")
        for key in keys:
            pieces = [st[key] for st in states]
            name = _leaf(key)
            if E % S == 0:
                full = torch.cat(pieces, 0)
                if full.shape[0] != E:
                    raise ValueError(f"gather: {key} has {full.shape[0]} rows after concatenating {S} files, "
                                     f"expected E={E}")
            elif S % E == 0:
                s = S // E
                if name in _AXES:
                    full = torch.cat([torch.cat(pieces[e * s:(e + 1) * s], _AXES[name]) for e in range(E)], 0)
                    if name in _PADDED:
                        o = states[-1].get(key[:-len(name)] + _PADDED[name])
                        if o is not None:
                            full = full[..., :o.shape[-1]]
                elif name.startswith("W_fc"):
                    # MoELayer stores a gated expert's hidden-axis shard flattened, not Tutel's flat
                    # storage split; joining the pieces as flat storage would silently scramble them.
                    raise ValueError(f"gather: {key} is a sharded gated (llama_ffn) expert; converting sharded "
                                     "gated experts is not supported")
                else:
                    full = torch.cat(pieces, 0).reshape(E, -1, *pieces[0].shape[2:])
            else:
                raise ValueError(f"gather: {E} experts and {S} files: need E % S == 0 or S % E == 0")
            out[key] = full.clone()
    return out


def scatter(state: dict, size: int) -> list[dict]:
    """Split a one-rank state dict (all E experts) into ``size`` per-rank state dicts."""
    S = int(size)
    if S < 1:
        raise ValueError(f"scatter: size must be >= 1, got {size}")
    layers = _layers(state, None)  # scatter refuses legacy files: E must be recorded
    outs = [dict(state) for _ in range(S)]
    for prefix, E in layers.items():
        for key in _expert_keys(state, prefix):
            t, name = state[key], _leaf(key)
            if t.shape[0] != E:
                raise ValueError(f"scatter: {key} has {t.shape[0]} experts, the layer has E={E}; "
                                 "gather it to one rank first")
            if E % S == 0:
                n = E // S
                for r in range(S):
                    outs[r][key] = t[r * n:(r + 1) * n].clone()
            elif S % E == 0:
                s = S // E
                for r in range(S):
                    e, j = divmod(r, s)
                    outs[r][key] = _piece(t[e:e + 1], name, key, s, j)
            else:
                raise ValueError(f"scatter: {E} experts over {S} ranks: need E % S == 0 or S % E == 0")
    return outs


def _piece(t: Tensor, name: str, key: str, s: int, j: int) -> Tensor:
    if name in _AXES:
        a = _AXES[name]
        size = t.shape[a]
        if name in _PADDED:
            step = -(-size // s)
            if step * s != size:
                t = torch.nn.functional.pad(t, [0, step * s - size])
        elif size % s:
            raise ValueError(f"scatter: {key} dim {a} (size {size}) is not divisible by {s} ranks per expert")
        else:
            step = size // s
        return t.narrow(a, j * step, step).clone()
    flat = t.reshape(-1)
    if flat.numel() % s:
        raise ValueError(f"scatter: {key} has {flat.numel()} elements per expert, not divisible by {s}")
    step = flat.numel() // s
    return flat[j * step:(j + 1) * step].reshape(1, -1).clone()


# --------------------------------------------------------------------------- files

def _name(pattern: str, rank: int, size: int) -> str:
    if "{rank}" not in pattern:
        raise ValueError(f"file pattern {pattern!r} must contain '{{rank}}' (and may contain '{{size}}')")
    return pattern.format(rank=rank, size=size)


def _progress(items, desc: str, show: bool):
    if not show:
        return items
    from tqdm import tqdm
    return tqdm(items, desc=desc, unit="file", file=sys.stderr)


def _put(container, namespace: Optional[str], state: dict):
    if not namespace:
        return state
    container = copy.copy(container)
    node = container
    parts = namespace.split(".")
    for part in parts[:-1]:
        node[part] = copy.copy(node[part])
        node = node[part]
    node[parts[-1]] = state
    return container


def gather_files(inputs: str, size: int, output: str, *, namespace: Optional[str] = None,
                 num_experts: Optional[int] = None, progress: bool = True) -> None:
    """Read ``size`` files named by ``inputs`` ({rank}, {size}) and write the gathered ``output``."""
    raw = [torch.load(_name(inputs, r, size), map_location="cpu", weights_only=False)
           for r in _progress(range(size), "read", progress)]
    merged = gather([_descend(c, namespace) for c in raw], num_experts=num_experts)
    torch.save(_put(raw[-1], namespace, merged), output)


def scatter_files(input: str, outputs: str, size: int, *, namespace: Optional[str] = None,
                  progress: bool = True) -> None:
    """Read one file and write ``size`` per-rank files named by ``outputs``."""
    raw = torch.load(input, map_location="cpu", weights_only=False)
    parts = scatter(_descend(raw, namespace), size)
    for r in _progress(range(size), "write", progress):
        path = _name(outputs, r, size)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        torch.save(_put(raw, namespace, parts[r]), path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fmoe.checkpoint", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gather", help="S rank files -> one file")
    g.add_argument("--inputs", required=True, help="pattern with {rank} and optionally {size}")
    g.add_argument("--size", type=int, required=True, help="number of rank files S")
    g.add_argument("--output", required=True)
    g.add_argument("--num-experts", type=int, default=None, help="E, for legacy files without the marker")
    s = sub.add_parser("scatter", help="one file -> S rank files")
    s.add_argument("--input", required=True)
    s.add_argument("--outputs", required=True, help="pattern with {rank} and optionally {size}")
    s.add_argument("--size", type=int, required=True, help="number of ranks S")
    for p in (g, s):
        p.add_argument("--namespace", default=None, help="dotted path to the state dict inside the file")
        p.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "gather":
            gather_files(a.inputs, a.size, a.output, namespace=a.namespace, num_experts=a.num_experts,
                         progress=not a.no_progress)
        else:
            scatter_files(a.input, a.outputs, a.size, namespace=a.namespace, progress=not a.no_progress)
    except (ValueError, KeyError, FileNotFoundError) as e:
        print(f"fmoe.checkpoint {a.cmd}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
