"""The exchanges' receive buffers are reused across calls (fmoe.comm.buffers), never while a tensor
still uses them: a held result keeps its values through later exchanges, on MPIComm and on gloo,
and expert-parallel training steps on reused buffers equal the same steps on fresh ones bit for bit."""
from __future__ import annotations

import torch

import fmoe
from fmoe.comm import buffers
from fmoe.comm.registry import cache_of
from fmoe.parallel import ParallelSpec
from _helpers import init_gloo, local_params

MB = 1 << 20


def _gloo(comm):
    from fmoe.comm import TorchDistComm
    init_gloo(comm)
    return TorchDistComm()


def _ptr(t):
    return t.untyped_storage().data_ptr()


def _check_held_results_survive(c, W, rank):
    rows = MB // (4 * 64) + 7                      # > 1 MB received: pooled
    send = [rows] * W
    base = torch.arange(W * rows * 64, dtype=torch.float32).reshape(W * rows, 64)
    x = base + 1e6 * rank                               # rows [w*rows, (w+1)*rows) go to rank w
    want = torch.cat([base[rank * rows:(rank + 1) * rows] + 1e6 * u for u in range(W)])
    a = c.all_to_all_v(x, send, send)
    assert torch.equal(a, want)
    b = c.all_to_all_v(x + 1, send, send)              # a is held: b lands elsewhere
    assert _ptr(b) != _ptr(a) and torch.equal(a, want) and torch.equal(b, want + 1)
    front = x.reshape(W, rows, 64)
    e = c.all_to_all(front, 0, 0)                     # the equal-split exchange takes the pool too
    assert torch.equal(a, want) and torch.equal(e.reshape(-1, 64), want)
    g = c.all_gather(x, 0)                              # so does the all-gather
    g2 = c.all_gather(x + 2, 0)
    assert torch.equal(g, torch.cat([base + 1e6 * u for u in range(W)])) and torch.equal(g2, g + 2)
    assert torch.equal(a, want) and torch.equal(b, want + 1)
    p = _ptr(a)
    del a
    again = c.all_to_all_v(x, send, send)              # a's buffer is free again: reused, right values
    assert _ptr(again) == p and torch.equal(again, want)


def test_held_exchange_results_are_never_overwritten(comm):
    _check_held_results_survive(comm, comm.size, comm.rank)
    _check_held_results_survive(_gloo(comm), comm.size, comm.rank)


def test_ep_training_steps_on_reused_buffers_equal_fresh_buffers(comm):
    # rows large enough for the pool: about T * k = 4096 rows of 256 floats (4 MB) per exchange
    spec = fmoe.MoESpec(model_dim=256, num_experts=2 * comm.size, gate=fmoe.GateSpec(k=2, capacity_factor=0.0),
                        experts=fmoe.ExpertSpec(type="ffn", hidden_size=64))
    full = fmoe.init_params(spec, generator=torch.Generator().manual_seed(3))
    p = {"gate": full["gate"], "experts": local_params(spec, full, comm)["experts"]}
    x = torch.randn(2048, 256, generator=torch.Generator().manual_seed(10 + comm.rank))

    def step():
        q = {g: {k: v.detach().requires_grad_(True) for k, v in d.items() if v is not None} for g, d in p.items()}
        xs = x.clone().requires_grad_(True)
        y, _ = fmoe.moe(q, xs, spec, comm=comm, parallel=ParallelSpec())
        y.square().sum().backward()
        return [y.detach(), xs.grad] + [v.grad for d in q.values() for v in d.values()]

    cache = cache_of(comm)
    pooled = cache.pop(buffers._KEY, None)
    cache[buffers._KEY] = buffers.BufferPool(max_buffers=0)     # every receive buffer fresh
    try:
        fresh = step()
    finally:
        cache.pop(buffers._KEY)
        if pooled is not None:
            cache[buffers._KEY] = pooled
    for _ in range(3):   # the first step fills the pool, the later ones reuse it
        got = step()
        assert len(got) == len(fresh) and all(torch.equal(a, b) for a, b in zip(got, fresh))


def test_own_rows_and_empty_senders(comm):
    """all_to_all_v copies a rank's own rows outside MPI; a rank that sends no rows at all (x [0, M])
    still receives its peers' rows; counts that differ per pair land at the right offsets."""
    W, r = comm.size, comm.rank
    for c in (comm, _gloo(comm)):
        send = [0 if r == 0 else (r + u) % 3 + 1 for u in range(W)]   # rank 0 sends nothing
        recv = [0 if u == 0 else (u + r) % 3 + 1 for u in range(W)]
        x = torch.cat([torch.full((n, 5), 100.0 * r + u) for u, n in enumerate(send)]) if sum(send) else \
            torch.empty(0, 5)
        got = c.all_to_all_v(x, send, recv)
        want = torch.cat([torch.full((n, 5), 100.0 * u + r) for u, n in enumerate(recv)])
        assert torch.equal(got, want), f"rank {r}: {got[:, 0].tolist()} != {want[:, 0].tolist()}"
