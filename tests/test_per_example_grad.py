"""Per-example gradients through the MoE: vmap(grad) equals a loop over examples."""
import pytest
import torch
import torch.utils._pytree as pytree

import fmoe
from fmoe import ablate


def _setup(cf=1.0):
    spec = fmoe.MoESpec(model_dim=16, num_experts=4, gate=fmoe.GateSpec(k=2, capacity_factor=cf),
                        experts=fmoe.ExpertSpec(hidden_size=32))
    params = fmoe.init_params(spec, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    return spec, params, torch.randn(5, 12, 16, generator=g), torch.randn(5, 12, 16, generator=g)


def test_per_example_grads_equal_loop():
    spec, params, x, y = _setup(cf=0.5)  # tight capacity: drops depend on the example's own tokens

    def loss(p, xb, yb):
        out, aux = fmoe.moe(p, xb, spec)
        return (out - yb).square().mean() + 0.01 * aux.l_aux

    grads = ablate.per_example_grads(loss, params, x, y)
    for i in range(x.shape[0]):
        gi = torch.func.grad(loss)(params, x[i], y[i])
        for (path, a), b in zip(pytree.tree_leaves_with_path(grads), pytree.tree_leaves(gi)):
            torch.testing.assert_close(a[i], b, rtol=1e-5, atol=1e-7, msg=pytree.keystr(path))
    # Each example routes alone: capacity from its own 12 tokens, not the batch's 60.
    caps = torch.func.vmap(lambda xb: fmoe.moe(params, xb, spec)[1].dropped)(x)
    assert torch.equal(caps, torch.stack([fmoe.moe(params, xi, spec)[1].dropped for xi in x]))
    _, batch_aux = fmoe.moe(params, x, spec)
    assert batch_aux.capacity == 2 * int(0.5 * 15) and fmoe.moe(params, x[0], spec)[1].capacity == 2 * int(0.5 * 3)


def test_dropless_runs_under_vmap_ragged_and_padded():
    # The ragged layout (dropless default) has a static size k*T: per-example gradients work
    # and equal the loop. The padded dropless layout sizes C by the max load, a host sync vmap
    # cannot do: under vmap it takes the load bound C = T, which drops nothing either (issue 36).
    import dataclasses
    spec, params, x, y = _setup(cf=0.0)
    assert spec.layout_kind() == "ragged"

    def loss(p, xb, yb, s=spec):
        return (fmoe.moe(p, xb, s)[0] - yb).square().mean()

    grads = ablate.per_example_grads(loss, params, x, y)
    for i in range(x.shape[0]):
        gi = torch.func.grad(loss)(params, x[i], y[i])
        for (path, a), b in zip(pytree.tree_leaves_with_path(grads), pytree.tree_leaves(gi)):
            torch.testing.assert_close(a[i], b, rtol=1e-5, atol=1e-7, msg=pytree.keystr(path))
    for cf in (0.0, -1.0):   # dropless and capped dropless
        padded = dataclasses.replace(spec, layout="padded", gate=dataclasses.replace(spec.gate, capacity_factor=cf))
        grads = ablate.per_example_grads(lambda p, xb, yb: loss(p, xb, yb, padded), params, x, y)
        for i in range(x.shape[0]):
            gi = torch.func.grad(loss)(params, x[i], y[i], padded)
            for (path, a), b in zip(pytree.tree_leaves_with_path(grads), pytree.tree_leaves(gi)):
                torch.testing.assert_close(a[i], b, rtol=1e-5, atol=1e-7, msg=f"cf={cf} {pytree.keystr(path)}")
