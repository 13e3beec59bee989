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

Non-expert tensors: gather checks that every rank holds the same bytes
(replicated gate copies, heads, ...) and takes them from the last rank's file;
scatter copies them, and any other content, unchanged. Conversion moves bytes
only: it is exact.

Metadata and integrity: every state dict that scatter/gather (or
:func:`attach_metadata`) produce carries, in its ``_metadata`` attribute (the one
torch uses for per-module versions, so ``load_state_dict`` never sees it) under
``"fmoe.checkpoint"``: the world size, the rank, each layer's expert layout
(E and experts per rank, negative for s ranks sharing one expert) and a CRC-32
of every tensor's bytes. gather refuses rank files whose world size, rank or
layout disagree with ``--size`` and their position, whose checksums do not
match (flipped bytes), or that cannot be read (truncated); without metadata
(files saved by training code) it still refuses a set that has a file for rank
``size``. Files are written atomically (:mod:`fmoe._io`); a rank set is written
all or none.

Command line::

    python -m fmoe.checkpoint gather  --inputs 'ck/r{rank}-of-{size}.pt' --size 4 --output full.pt
    python -m fmoe.checkpoint scatter --input full.pt --outputs 'ck8/r{rank}-of-{size}.pt' --size 8
"""
from __future__ import annotations

import argparse
import collections
import copy
import os
import sys
import zlib
from typing import Optional

import torch
from torch import Tensor

from . import _io
from .experts import EXPERT_PARAMS

__all__ = ["gather", "scatter", "gather_files", "scatter_files", "state_dict_from_params",
           "params_from_state_dict", "attach_metadata", "read_metadata", "verify", "CheckpointError"]

MARKER = "_num_global_experts"
META = "fmoe.checkpoint"
META_FORMAT = 1
# From the one parameter-layout table (fmoe.experts.EXPERT_PARAMS): shard axis of each expert
# tensor in the per-rank [n, ...] layout, under fmoe's and Tutel's names (Tutel's gated W_fc*
# are stored flat and handled apart); padded leaves trimmed to their reference's last dim.
_SHARDABLE = [p for t in ("ffn", "gated_ffn") for p in EXPERT_PARAMS[t]]
_AXES = {p.name: p.shard_axis for p in _SHARDABLE}
_AXES.update({p.tutel_name: p.shard_axis for p in EXPERT_PARAMS["ffn"]})
_TUTEL = {p.name: p.tutel_name for p in _SHARDABLE}
_PADDED = {p.name: p.trim_like for p in _SHARDABLE if p.padded}
_PADDED.update({_TUTEL[p.name]: _TUTEL[p.trim_like] for p in _SHARDABLE if p.padded})


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


# --------------------------------------------------------------------------- metadata

class CheckpointError(ValueError):
    """A checkpoint file or rank set is corrupt, incomplete, or does not match what was asked."""


def _crc(t: Tensor) -> str:
    """CRC-32 of a tensor's dtype, shape and bytes (detects flipped bytes; not a cryptographic hash)."""
    flat = t.detach().reshape(-1).contiguous()
    raw = flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)
    head = f"{t.dtype}{tuple(t.shape)}".encode()
    return f"{zlib.crc32(raw.numpy(), zlib.crc32(head)):08x}"


def _layout(state: dict, world: int, num_experts: Optional[int] = None) -> dict:
    out = {}
    for prefix, E in _layers(state, num_experts).items():
        n, s = (E // world, 1) if E >= world and E % world == 0 else (1, world // E) if world % E == 0 else (0, 0)
        out[prefix] = {"num_experts": E, "experts_per_rank": n if s == 1 else -s}
    return out


def attach_metadata(state: dict, *, rank: int, world_size: int, num_experts: Optional[int] = None) -> dict:
    """``state`` as an OrderedDict (same keys and values) carrying fmoe's checkpoint metadata.

    Call it on each rank's state dict before saving a rank set from training code, so that
    gather can check the set. The metadata lives in ``state._metadata["fmoe.checkpoint"]``.
    """
    if not (isinstance(world_size, int) and world_size >= 1 and isinstance(rank, int) and 0 <= rank < world_size):
        raise ValueError(f"attach_metadata: need 0 <= rank < world_size, got rank={rank!r}, "
                         f"world_size={world_size!r}")
    out = collections.OrderedDict(state)
    out._metadata = collections.OrderedDict(getattr(state, "_metadata", None) or {})
    out._metadata[META] = {
        "format": META_FORMAT, "world_size": world_size, "rank": rank,
        "layers": _layout(state, world_size, num_experts),
        "checksums": {k: _crc(v) for k, v in state.items() if isinstance(v, Tensor)},
    }
    return out


def read_metadata(state) -> Optional[dict]:
    """fmoe's checkpoint metadata of a state dict, or None (e.g. a file saved by training code)."""
    meta = getattr(state, "_metadata", None)
    if meta is None or META not in meta:
        return None
    m = meta[META]
    if not isinstance(m, dict) or m.get("format") != META_FORMAT:
        raise CheckpointError(f"unknown fmoe checkpoint metadata {m!r} (format {META_FORMAT} expected)")
    return m


def verify(state, what: str = "state dict") -> Optional[dict]:
    """Check every tensor against the checksums in the metadata (if any); returns the metadata."""
    m = read_metadata(state)
    if m is None:
        return None
    sums = m["checksums"]
    keys = {k for k, v in state.items() if isinstance(v, Tensor)}
    if keys != set(sums):
        missing, extra = sorted(set(sums) - keys), sorted(keys - set(sums))
        raise CheckpointError(f"{what}: tensors do not match its metadata (missing {missing[:5]}, "
                              f"unlisted {extra[:5]})")
    bad = [k for k in sums if _crc(state[k]) != sums[k]]
    if bad:
        raise CheckpointError(f"{what} is corrupt: the bytes of {len(bad)} tensor(s) do not match their "
                              f"checksums, e.g. {bad[:3]}")
    return m


def _check_set(states: list, metas: list, names: list) -> None:
    """All files carry metadata or none; world size, rank and layouts agree with the set."""
    S = len(states)
    have = [m is not None for m in metas]
    if any(have) and not all(have):
        raise CheckpointError(f"gather: only some rank files carry fmoe metadata (without: "
                              f"{[names[r] for r, h in enumerate(have) if not h][:4]}); the set is mixed")
    if not any(have):
        return
    for r, m in enumerate(metas):
        if m["world_size"] != S:
            raise CheckpointError(f"gather: {names[r]} belongs to a set of {m['world_size']} rank files, but "
                                  f"--size/len(states) is {S}")
        if m["rank"] != r:
            raise CheckpointError(f"gather: {names[r]} is rank {m['rank']}'s file, found at position {r}")
        if m["layers"] != metas[0]["layers"]:
            raise CheckpointError(f"gather: {names[r]} has expert layout {m['layers']}, {names[0]} has "
                                  f"{metas[0]['layers']}")


def _same_bytes(a: Tensor, b: Tensor) -> bool:
    """Bitwise equality (NaN payloads included), which is what a replicated copy must satisfy."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.detach().reshape(-1).contiguous().view(torch.uint8),
                       b.detach().reshape(-1).contiguous().view(torch.uint8))


def _check_replicated(states: list, skip: set, names: list) -> None:
    last = states[-1]
    for key, v in last.items():
        if key in skip or not isinstance(v, Tensor) or key.endswith(MARKER):
            continue
        for r, st in enumerate(states[:-1]):
            other = st.get(key)
            same = isinstance(other, Tensor) and _same_bytes(other, v)
            if not same:
                raise CheckpointError(
                    f"gather: replicated tensor {key!r} differs between {names[r]} and {names[-1]} (every rank "
                    "must hold the same copy; pass check_replicated=False / --no-check-replicated to take the "
                    "last rank's)")


# --------------------------------------------------------------------------- gather / scatter

def gather(states: list, *, num_experts: Optional[int] = None, check_replicated: bool = True,
           names: Optional[list] = None) -> dict:
    """Merge S per-rank state dicts (rank order) into one with all E experts on one rank.

    Rank states with fmoe metadata are checked (checksums, world size S, rank order,
    layout); replicated (non-expert) tensors must be equal on every rank unless
    ``check_replicated=False``. The result carries metadata for world size 1.
    ``names`` label the states in error messages (e.g. file names).
    """
    S = len(states)
    if S == 0:
        raise ValueError("gather: no input state dicts")
    names = names or [f"rank {r}" for r in range(S)]
    metas = [verify(st, names[r]) for r, st in enumerate(states)]
    _check_set(states, metas, names)
    out = dict(states[-1])
    layers = _layers(states[-1], num_experts)
    if check_replicated and S > 1:
        _check_replicated(states, {k for p in layers for k in _expert_keys(states[-1], p)}, names)
    for prefix, E in layers.items():
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
    return attach_metadata(out, rank=0, world_size=1, num_experts=num_experts)


def scatter(state: dict, size: int) -> list[dict]:
    """Split a one-rank state dict (all E experts) into ``size`` per-rank state dicts."""
    S = int(size)
    if S < 1:
        raise ValueError(f"scatter: size must be >= 1, got {size}")
    layers = _layers(state, None)  # scatter refuses legacy files: E must be recorded
    m = verify(state, "scatter input")
    if m is not None and m["world_size"] != 1:
        raise CheckpointError(f"scatter: the input is rank {m['rank']} of a {m['world_size']}-rank set, not a "
                              "gathered checkpoint; gather the set first")
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
    return [attach_metadata(o, rank=r, world_size=S) for r, o in enumerate(outs)]


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


def _load(path: str):
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001 - a truncated/corrupt zip surfaces as RuntimeError, EOFError, ...
        raise CheckpointError(f"cannot read {path}: it is truncated or corrupt ({type(e).__name__}: "
                              f"{str(e)[:200]})") from None


def gather_files(inputs: str, size: int, output: str, *, namespace: Optional[str] = None,
                 num_experts: Optional[int] = None, progress: bool = True, check_replicated: bool = True) -> None:
    """Read ``size`` files named by ``inputs`` ({rank}, {size}) and write the gathered ``output`` atomically.

    Refuses a ``size`` that does not match the files' metadata, or (without metadata) a set that has
    a file for rank ``size`` too; an existing ``output`` is only replaced by a complete new file.
    """
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"gather: size must be >= 1, got {size!r}")
    names = [_name(inputs, r, size) for r in range(size)]
    beyond = _name(inputs, size, size)
    if "{size}" not in inputs and os.path.exists(beyond):
        raise CheckpointError(f"gather: --size is {size} but {beyond} exists: the rank set has more files; "
                              "pass the set's real size")
    raw = [_load(n) for n in _progress(names, "read", progress)]
    merged = gather([_descend(c, namespace) for c in raw], num_experts=num_experts,
                    check_replicated=check_replicated, names=names)
    _io.atomic_save(_put(raw[-1], namespace, merged), output)


def scatter_files(input: str, outputs: str, size: int, *, namespace: Optional[str] = None,
                  progress: bool = True) -> None:
    """Read one file and write ``size`` per-rank files named by ``outputs``: all of them or none."""
    raw = _load(input)
    parts = scatter(_descend(raw, namespace), size)
    items = []
    for r in range(size):
        path = _name(outputs, r, size)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        obj = _put(raw, namespace, parts[r])
        items.append((path, lambda f, obj=obj: torch.save(obj, f)))
    _io.replace_all(_progress(items, "write", progress))  # staged one by one, renamed when all are written


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
    g.add_argument("--no-check-replicated", action="store_true",
                   help="take non-expert tensors from the last rank without comparing the ranks' copies")
    for p in (g, s):
        p.add_argument("--namespace", default=None, help="dotted path to the state dict inside the file")
        p.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "gather":
            gather_files(a.inputs, a.size, a.output, namespace=a.namespace, num_experts=a.num_experts,
                         progress=not a.no_progress, check_replicated=not a.no_check_replicated)
        else:
            scatter_files(a.input, a.outputs, a.size, namespace=a.namespace, progress=not a.no_progress)
    except (ValueError, KeyError, OSError) as e:
        print(f"fmoe.checkpoint {a.cmd}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
