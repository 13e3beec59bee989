"""Compressed all-to-all (fmoe.comm.compress) across ranks: equal to encode -> plain uint8
all-to-all -> decode done by hand, forward and backward, over MPIComm, 2DH and gloo."""
from __future__ import annotations

import pytest
import torch

from fmoe.comm import Hierarchical2DComm
from fmoe.comm import compress as CC

M = 96  # a multiple of 32 (mxfp8), not of 128 (fp8_block's ragged last block)
WIRES = ("bf16", "fp8", "fp8_block", "mxfp8")


def _x(comm, rows_per_rank=3, seed=0):
    g = torch.Generator().manual_seed(seed + comm.rank)
    return torch.randn(comm.size * rows_per_rank, 5, M, generator=g) * (comm.rank + 1)


def _by_hand_a2a(x, comm, concat, split, wire):
    payload = CC.encode_wire(x, wire).contiguous()
    return CC.decode_wire(comm.all_to_all(payload, concat, split), wire, x.shape[-1], x.dtype)


@pytest.mark.parametrize("wire", WIRES)
def test_compressed_a2a_equals_compress_exchange_decompress(comm, wire):
    x = _x(comm).requires_grad_()
    y = CC.all_to_all(x, comm, 1, 0, wire=wire, grad_wire="fp8")
    assert torch.equal(y, _by_hand_a2a(x.detach(), comm, 1, 0, wire))
    assert y.shape == (3, 5 * comm.size, M)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(50 + comm.rank))
    (gx,) = torch.autograd.grad(y, x, g)
    # the backward is the swapped exchange, compressed in grad_wire
    assert torch.equal(gx, _by_hand_a2a(g, comm, 0, 1, "fp8"))


def test_compressed_a2a_is_close_to_the_plain_exchange(comm):
    x = _x(comm, seed=3)
    plain = comm.all_to_all(x, 1, 0)
    for wire, tol in (("bf16", 2 ** -8), ("fp8", 2 ** -3), ("mxfp8", 2 ** -3)):
        got = CC.all_to_all(x, comm, 1, 0, wire=wire)
        rel = ((got - plain).abs() / plain.abs().amax(-1, keepdim=True)).max().item()
        assert rel <= tol, (wire, rel)


@pytest.mark.parametrize("wire", ("fp8", "mxfp8"))
def test_compressed_a2a_v_equals_by_hand(comm, wire):
    W, r = comm.size, comm.rank
    send = [(r + u) % 3 + 1 for u in range(W)]
    recv = [(u + r) % 3 + 1 for u in range(W)]  # what rank u sends to me
    x = torch.randn(sum(send), M, generator=torch.Generator().manual_seed(r)).requires_grad_()
    y = CC.all_to_all_v(x, comm, send, recv, wire=wire, grad_wire="bf16")
    payload = CC.encode_wire(x.detach(), wire)
    want = CC.decode_wire(comm.all_to_all_v(payload, send, recv), wire, M)
    assert torch.equal(y, want)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(9 + r))
    (gx,) = torch.autograd.grad(y, x, g)
    back = CC.decode_wire(comm.all_to_all_v(CC.encode_wire(g, "bf16"), recv, send), "bf16", M)
    assert torch.equal(gx, back)


def test_compressed_a2a_over_2dh_equals_flat(comm):
    x = _x(comm, seed=5)
    flat = CC.all_to_all(x, comm, 1, 0, wire="fp8")
    for L in [q for q in range(1, comm.size + 1) if comm.size % q == 0]:
        h = Hierarchical2DComm(comm, L)
        assert torch.equal(CC.all_to_all(x, h, 1, 0, wire="fp8"), flat), L


def test_compressed_a2a_over_gloo_equals_mpi(comm):
    from fmoe.comm import TorchDistComm
    from _helpers import init_gloo
    init_gloo(comm)
    tdc = TorchDistComm()
    x = _x(comm, seed=7)
    for wire in WIRES:
        assert torch.equal(CC.all_to_all(x, tdc, 1, 0, wire=wire), CC.all_to_all(x, comm, 1, 0, wire=wire))
    send = [2] * comm.size
    rows = torch.randn(2 * comm.size, M, generator=torch.Generator().manual_seed(comm.rank))
    assert torch.equal(CC.all_to_all_v(rows, tdc, send, send, wire="mxfp8"),
                       CC.all_to_all_v(rows, comm, send, send, wire="mxfp8"))


def test_wire_bytes_per_call(comm):
    x = _x(comm)
    assert CC.wire_bytes(x.shape, "fp32") / CC.wire_bytes(x.shape, "fp8") >= 3.5
    assert CC.wire_bytes(x.shape, "fp8") == CC.encode_wire(x, "fp8").numel()


# --- quantized expert training and compressed exchanges inside expert-parallel moe() ---------

def _ep_spec(precision, E):
    import fmoe
    return fmoe.MoESpec(model_dim=32, num_experts=E, gate=fmoe.GateSpec(k=2, capacity_factor=1.5),
                        experts=fmoe.ExpertSpec(type="ffn", hidden_size=64, precision=precision))


@pytest.mark.parametrize("fmt", ("fp8_row", "fp8_block", "mxfp8", "mxfp4", "nvfp4"))
def test_weight_quantized_training_under_expert_parallel_equals_one_process(comm, fmt):
    # Weight-only recipes are layout independent (each expert's weight is quantized on its own),
    # so expert parallel == one process: outputs per rank, expert grads summed over ranks.
    from fmoe.parallel import shard_experts
    from fmoe.quant.training import TrainPrecision
    from _helpers import distributed, full_params, local_params, reference
    W = comm.size
    spec = _ep_spec(TrainPrecision(weights=fmt), 2 * W)
    full = full_params(spec)
    full = {k: {n: t.float() for n, t in v.items()} for k, v in full.items()}
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(100 + comm.rank))
    cot = torch.randn(16, 32, generator=torch.Generator().manual_seed(7 + comm.rank))
    yd, gd = distributed(spec, local_params(spec, full, comm), x, comm, None, cot)
    yr, gr = reference(spec, full, x, W, None, cot)
    torch.testing.assert_close(yd, yr, rtol=1e-5, atol=1e-5)
    y_float, _ = distributed(_ep_spec(None, 2 * W), local_params(spec, full, comm), x, comm, None, None)
    assert (yd - y_float).norm() > 1e-3 * y_float.norm()  # the quantization really ran
    summed = {k: comm.all_reduce(v, "sum") for k, v in gr["experts"].items()}
    mine = shard_experts("ffn", summed, spec.num_experts, comm.rank, W)
    for k in mine:
        torch.testing.assert_close(gd["experts"][k], mine[k], rtol=1e-4, atol=1e-5)


def test_moe_with_a_compressed_wire_is_close_to_uncompressed(comm):
    import fmoe
    from fmoe.parallel import ParallelSpec
    from _helpers import full_params, local_params
    spec = _ep_spec(None, 2 * comm.size)
    p = local_params(spec, {k: {n: t.float() for n, t in v.items()} for k, v in full_params(spec).items()}, comm)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(3 + comm.rank))
    plain = fmoe.moe(p, x, spec, comm=comm)[0]
    for wire, tol in (("bf16", 2e-2), ("fp8", 1e-1), ("mxfp8", 1e-1)):
        y = fmoe.moe(p, x, spec, comm=comm, parallel=ParallelSpec(wire=wire))[0]
        rel = ((y - plain).norm() / plain.norm()).item()
        assert 0 < rel < tol, (wire, rel)
    # overlap chunks and the 2DH exchange move the same rows: the same compressed result
    fp8 = fmoe.moe(p, x, spec, comm=comm, parallel=ParallelSpec(wire="fp8"))[0]
    variants = [ParallelSpec(wire="fp8", overlap_degree=2)]
    if comm.size % 2 == 0:
        variants.append(ParallelSpec(wire="fp8", local_size=2))
    for par in variants:
        y = fmoe.moe(p, x, spec, comm=comm, parallel=par)[0]
        torch.testing.assert_close(y, fp8, rtol=1e-5, atol=1e-6, msg=str(par))
