"""Checkpoints on ``torch.distributed.checkpoint`` (DCP): resharded between meshes, atomic, verified.

    fmoe.distributed.dcp.save(model, mesh, "ck", step=100)     # collective
    fmoe.distributed.dcp.load(model, other_mesh, "ck")         # any (pp, dp, ep) with E % ep == 0

What is stored (mesh-independent): every dense parameter whole (the replicas write one copy)
and every expert parameter as its logical ``[E, ...]`` tensor, a DTensor ``Shard(0)`` over the
expert dimension, so dim 0 is the global expert index. DCP saves each rank's rows with their
offsets, and a load on another mesh reads exactly the rows of the experts the rank holds there:
ep=2 saved loads on ep=4 and back, bit for bit (bytes are copied, never recomputed). FSDP2 and
DDP models, and pipeline stages (they keep the model's parameter names), save and load alike;
under FSDP each rank first all-gathers its n experts over dp (small; the expert shards of one
dp group) and keeps only its own shard on load.

Layout of ``path`` (a directory)::

    path/LATEST                 name of the current version (written atomically)
    path/v-<token>/             DCP's files (.metadata, __<rank>_0.distcp) + manifest.json
    path/.tmp-<token>/          a save in progress (or killed): never read

Atomicity: a save writes into ``.tmp-<token>``, then renames it to ``v-<token>`` and only then
replaces ``LATEST`` (:mod:`fmoe._io`: temporary file, fsync, rename). A save killed at any
point leaves ``LATEST`` naming the previous complete version, which stays loadable; the next
save removes the leftovers. Verification: ``manifest.json`` holds every file's size and
SHA-256 and every tensor's logical shape and dtype; :func:`load` refuses (``CheckpointError``,
on every rank) a missing or truncated file, a checksum mismatch, and a model whose parameter
names, shapes or expert counts differ from the checkpoint's. Rank 0 reads every file once to
check it (the cost of a second read of the checkpoint per load).

Parameters only: optimizer state and buffers are not saved (the one buffer of MoELayer,
``_num_global_experts``, is implied by the experts' ``[E, ...]`` shapes and checked on load).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from typing import Optional

import torch
from torch import nn

from .. import _io
from ..checkpoint import CheckpointError
from ._params import local_full, named_parameters_by_kind, unwrap

__all__ = ["save", "load", "verify", "CheckpointError", "FORMAT"]

FORMAT = "fmoe.dcp/1"
MANIFEST = "manifest.json"
LATEST = "LATEST"


# --------------------------------------------------------------------------- the logical state

def _expert_dtensor(local, mesh):
    """This ep rank's experts ``[n, ...]`` as the ``[E, ...]`` DTensor sharded over the ep dimension."""
    from torch.distributed.tensor import DTensor, Shard
    n = local.shape[0]
    shape = torch.Size((n * mesh.ep,) + tuple(local.shape[1:]))
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local.contiguous(), mesh.device_mesh["ep"], [Shard(0)], run_check=False,
                              shape=shape, stride=stride)


def _state(model: nn.Module, mesh, *, empty: bool) -> dict:
    """{name: tensor}: dense whole (plain), experts as ``[E, ...]`` DTensors; ``empty``: load targets."""
    out = {}
    for name, p, is_expert in named_parameters_by_kind(model):
        if empty:
            t = torch.empty(tuple(p.shape), dtype=p.dtype)  # a DTensor's shape is its unsharded one
        else:
            t = local_full(p.detach()).clone()
        out[name] = _expert_dtensor(t, mesh) if is_expert else t
    return out


def _shapes(state: dict) -> dict:
    """{name: {"shape": logical shape, "dtype": ..., "kind": "expert" | "dense"}}."""
    from torch.distributed.tensor import DTensor
    return {k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch."),
                "kind": "expert" if isinstance(v, DTensor) else "dense"} for k, v in state.items()}


# --------------------------------------------------------------------------- files

def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(folder: str) -> dict:
    return {f: {"bytes": os.path.getsize(os.path.join(folder, f)), "sha256": _sha256(os.path.join(folder, f))}
            for f in sorted(os.listdir(folder)) if f != MANIFEST}


def _current(path: str) -> Optional[str]:
    try:
        with open(os.path.join(path, LATEST)) as f:
            name = f.read().strip()
    except FileNotFoundError:
        return None
    return os.path.join(path, name)


def verify(folder: str) -> dict:
    """The manifest of one version folder, after checking every file's size and SHA-256."""
    try:
        with open(os.path.join(folder, MANIFEST)) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{folder}: no {MANIFEST} (not an fmoe DCP checkpoint, or an unfinished save)") \
            from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{folder}/{MANIFEST} is not valid JSON ({e}): truncated or corrupted") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{folder}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    for name, want in manifest["files"].items():
        fp = os.path.join(folder, name)
        if not os.path.exists(fp):
            raise CheckpointError(f"{folder}: file {name} is missing")
        size = os.path.getsize(fp)
        if size != want["bytes"]:
            raise CheckpointError(f"{folder}/{name}: {size} bytes, the manifest says {want['bytes']} (truncated?)")
        if _sha256(fp) != want["sha256"]:
            raise CheckpointError(f"{folder}/{name}: SHA-256 mismatch (the file changed after the save)")
    return manifest


def _agree(verdict, src: int = 0):
    """Rank ``src``'s Python object on every rank (the default group)."""
    import torch.distributed as dist
    box = [verdict]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def _raise_everywhere(fn):
    """Run ``fn`` on rank 0; its result, or its CheckpointError, on every rank."""
    import torch.distributed as dist
    out = None
    if dist.get_rank() == 0:
        try:
            out = ("ok", fn())
        except CheckpointError as e:
            out = ("error", str(e))
    out = _agree(out)
    if out[0] == "error":
        raise CheckpointError(out[1])
    return out[1]


# --------------------------------------------------------------------------- save / load

def save(model: nn.Module, mesh, path: str, *, step: Optional[int] = None, extra: Optional[dict] = None) -> str:
    """Save ``model``'s parameters under ``path`` (collective over every rank); returns the version folder.

    Args:
        model: the (FSDP2-sharded, DDP-wrapped or plain) model or pipeline stage, MoE layers
            over ``mesh.ep_comm``.
        mesh: its :class:`fmoe.comm.MoEMesh` (from :func:`fmoe.comm.mesh`).
        path: checkpoint directory (created); the previous version is replaced atomically.
        step, extra: recorded in the manifest (``extra`` must be JSON-serialisable).
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    if mesh.device_mesh is None:
        raise ValueError("dcp.save needs a torch DeviceMesh: build the mesh with fmoe.comm.mesh(...)")
    model = unwrap(model)
    state = _state(model, mesh, empty=False)
    rank = dist.get_rank()
    token = _agree(uuid.uuid4().hex[:12] if rank == 0 else None)
    tmp = os.path.join(path, f".tmp-{token}")
    final = os.path.join(path, f"v-{token}")
    if rank == 0:
        os.makedirs(tmp)
    dist.barrier()
    dcp.save(state, checkpoint_id=tmp)
    # Every rank's shapes (pipeline stages hold different names) for the manifest.
    shapes = [None] * dist.get_world_size()
    dist.all_gather_object(shapes, _shapes(state))
    error = None
    if rank == 0:
        try:
            tensors = {k: v for s in shapes for k, v in s.items()}
            manifest = {"format": FORMAT, "step": step, "extra": extra or {},
                        "mesh": {"pp": mesh.pp, "dp": mesh.dp, "ep": mesh.ep},
                        "num_experts": {k: v["shape"][0] for k, v in tensors.items() if v["kind"] == "expert"},
                        "tensors": tensors, "files": _files(tmp)}
            _io.atomic_write_text(os.path.join(tmp, MANIFEST), json.dumps(manifest, indent=1, sort_keys=True))
            _publish(path, tmp, final)
        except Exception as e:  # tell the other ranks before raising
            error = f"{type(e).__name__}: {e}"
    error = _agree(error)
    if error is not None:
        raise CheckpointError(f"dcp.save to {path} failed on rank 0: {error}; the previous version is intact")
    return final


def _publish(path: str, tmp: str, final: str) -> None:
    """Rename the finished save into place, point LATEST at it, then drop the older versions."""
    _io._fsync_dir(tmp)
    os.rename(tmp, final)
    _io._fsync_dir(path)
    _io.atomic_write_text(os.path.join(path, LATEST), os.path.basename(final) + "\n")
    keep = os.path.basename(final)
    for name in os.listdir(path):
        if name != keep and (name.startswith("v-") or name.startswith(".tmp-")):
            shutil.rmtree(os.path.join(path, name), ignore_errors=True)


def load(model: nn.Module, mesh, path: str) -> dict:
    """Load the current version under ``path`` into ``model`` (collective); returns its manifest.

    The model may be on another mesh than the save's (any pp/dp/ep with E % ep == 0; pipeline
    stages load their own names). Raises :class:`CheckpointError` on every rank if the files fail
    verification or the model's names / shapes differ from the checkpoint's.
    """
    import torch.distributed.checkpoint as dcp
    from ._params import _assign
    if mesh.device_mesh is None:
        raise ValueError("dcp.load needs a torch DeviceMesh: build the mesh with fmoe.comm.mesh(...)")
    model = unwrap(model)

    def check():
        folder = _current(path)
        if folder is None:
            raise CheckpointError(f"{path}: no {LATEST} file (no completed save in this directory)")
        return folder, verify(folder)
    folder, manifest = _raise_everywhere(check)
    state = _state(model, mesh, empty=True)
    mine = _shapes(state)
    bad = []
    for k, v in mine.items():
        have = manifest["tensors"].get(k)
        if have is None:
            bad.append(f"{k}: not in the checkpoint")
        elif have != v:
            what = "different expert count" if v["kind"] == "expert" and have["shape"][0] != v["shape"][0] else \
                "different shape or dtype"
            bad.append(f"{k}: checkpoint {have['kind']} {have['shape']} {have['dtype']}, model {v['kind']} "
                       f"{v['shape']} {v['dtype']} ({what})")
    # Every rank checks its own names; all raise if any rank found a problem.
    import torch.distributed as dist
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, bad)
    problems = [p for ps in problems for p in ps]
    if problems:
        raise CheckpointError(f"{folder} does not fit this model ({len(problems)} problems): "
                              + "; ".join(sorted(set(problems))[:8]))
    dcp.load(state, checkpoint_id=folder)
    for name, p, is_expert in named_parameters_by_kind(model):
        t = state[name]
        _assign(p, t.to_local() if is_expert else t)
    return manifest
