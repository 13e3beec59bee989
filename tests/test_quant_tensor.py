"""QuantizedTensor as a pytree: torch.func transforms, torch.save/load, indexing."""
import io

import pytest
import torch
import torch.utils._pytree as pytree

import fmoe.quant as Q

FMTS = ["mxfp4", "nvfp4", "mxfp8", "fp8_block", "fp8_row"]


@pytest.mark.parametrize("fmt", FMTS)
def test_pytree_flatten_and_vmap(fmt):
    w = torch.randn(3, 8, 64)
    q = Q.quantize(w, fmt)
    leaves, spec = pytree.tree_flatten(q)
    assert len(leaves) == (3 if fmt == "nvfp4" else 2)
    assert pytree.tree_unflatten(leaves, spec) == q
    d = Q.dequantize(q)
    dv = torch.func.vmap(lambda qq: qq.dequantize())(q)
    assert torch.equal(d, dv)
    # vmap over experts with x batched alongside the weights.
    x = torch.randn(3, 5, 64)
    y = torch.func.vmap(lambda xx, qq: xx @ Q.dequantize(qq).T)(x, q)
    assert torch.allclose(y, torch.bmm(x, d.transpose(1, 2)), atol=1e-5)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_grad_over_function_taking_quantized_tensor(fmt):
    q = Q.quantize(torch.randn(2, 8, 32), fmt)
    x = torch.randn(2, 4, 32)

    def f(x, qq):
        return (x @ Q.dequantize(qq).transpose(-1, -2)).pow(2).sum()

    g = torch.func.grad(f)(x, q)
    xr = x.clone().requires_grad_()
    f(xr, q).backward()
    assert torch.allclose(g, xr.grad)


@pytest.mark.parametrize("weights_only", [True, False])
def test_save_load_round_trip(weights_only):
    q = Q.quantize_nvfp4(torch.randn(2, 16, 32))
    buf = io.BytesIO()
    torch.save({"w": q, "m": Q.quantize_mxfp4(torch.randn(4, 32))}, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=weights_only)
    assert isinstance(back["w"], Q.QuantizedTensor) and back["w"].fmt == "nvfp4"
    assert torch.equal(Q.dequantize(back["w"]), Q.dequantize(q))


def test_indexing_and_errors():
    q = Q.quantize_mxfp4(torch.randn(4, 8, 64))
    assert q[1].logical_shape == (8, 64)
    assert torch.equal(Q.dequantize(q[1:3]), Q.dequantize(q)[1:3])
    assert Q.is_quantized(q) and not Q.is_quantized(torch.zeros(1))
    with pytest.raises(IndexError):
        q[0][0]
    with pytest.raises(ValueError, match="unknown quantized format"):
        Q.QuantizedTensor(q.data, q.scales, None, "int3", (4, 8, 64), (1, 32))
