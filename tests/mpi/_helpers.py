"""Shared pieces of the MPI tests: reference runs and comparisons (single-process fmoe on full parameters)."""
from __future__ import annotations

import dataclasses
import socket

import torch
from torch.utils import _pytree as pytree

import fmoe
from fmoe.parallel import ParallelSpec, capacity_alignment, shard_experts

M, H = 8, 12


def make_spec(E, k, cf, *, expert_type="ffn", postscore=True, H_=H, fp32_gate=True):
    return fmoe.MoESpec(model_dim=M, num_experts=E, gate=fmoe.GateSpec(k=k, capacity_factor=cf, fp32_gate=fp32_gate),
                        experts=fmoe.ExpertSpec(type=expert_type, hidden_size=H_), is_postscore=postscore)


def full_params(spec, seed=0):
    p = fmoe.init_params(spec, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    # non-zero biases so "fc2 bias added once" is actually tested
    g = torch.Generator().manual_seed(seed + 1)
    for key in ("fc1_b", "fc2_b"):
        if key in p["experts"]:
            p["experts"][key] = torch.randn(p["experts"][key].shape, generator=g, dtype=torch.float64)
    return p


def local_params(spec, full, comm):
    return {"gate": full["gate"], "experts": shard_experts(spec.experts.type, full["experts"], spec.num_experts,
                                                           comm.rank, comm.size)}


def local_batch(rank, T=16, seed=100):
    return torch.randn(T, M, generator=torch.Generator().manual_seed(seed + rank), dtype=torch.float64)


def reference(spec, full, x, W, parallel=None, cot=None):
    """Single-process moe with the capacity alignment the distributed run uses; (y, grads)."""
    ref_spec = dataclasses.replace(spec, alignment=capacity_alignment(spec.num_experts, W, parallel or ParallelSpec()))
    p = pytree.tree_map(lambda t: t.detach().clone().requires_grad_(True), full)
    y, aux = fmoe.moe(p, x, ref_spec)
    if cot is None:
        return y.detach(), None
    (y * cot).sum().backward()
    return y.detach(), pytree.tree_map(lambda t: t.grad, p)


def distributed(spec, local, x, comm, parallel=None, cot=None):
    p = pytree.tree_map(lambda t: t.detach().clone().requires_grad_(True), local)
    y, aux = fmoe.moe(p, x, spec, comm=comm, parallel=parallel)
    if cot is None:
        return y.detach(), None
    (y * cot).sum().backward()
    return y.detach(), pytree.tree_map(lambda t: t.grad, p)


def allclose(a, b, what, atol=1e-10):
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    err = (a - b).abs().max().item() if a.numel() else 0.0
    assert err <= atol, f"{what}: max abs diff {err}"


def init_gloo(comm) -> None:
    """torch.distributed's default group over gloo on this MPI world, once per process (every rank
    calls it: rank 0 picks a free port and the ranks agree on it through ``comm``)."""
    import torch.distributed as dist
    if dist.is_initialized():
        return
    port = torch.tensor([0])
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port[0] = s.getsockname()[1]
    port = int(comm.all_reduce(port, "max").item())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size)


def ragged_send(comm, g: torch.Generator, T: int, k: int) -> tuple:
    """A ragged layout's positions over k*T pairs with one pair dropped, and the exchange it makes:
    (pos int64 [k, T] (-1: dropped), tokens int64 [N] (each row's token), N, send, recv) with N =
    k*T - 1 rows split about evenly over the ranks."""
    W = comm.size
    N = k * T - 1
    order = torch.randperm(k * T, generator=g)
    pos = torch.full((k * T,), -1, dtype=torch.int64)
    pos[order[:N]] = torch.arange(N)
    pos = pos.view(k, T)
    tokens = torch.empty(N, dtype=torch.int64)
    tokens[pos.reshape(-1)[order[:N]]] = order[:N] % T
    send = [N // W + (u < N % W) for u in range(W)]
    recv = comm.all_to_all(torch.tensor(send), 0, 0).tolist()
    return pos, tokens, N, send, recv
