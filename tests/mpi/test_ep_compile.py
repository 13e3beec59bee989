"""Expert parallelism and torch.compile: the graph breaks at the host-side agreement check and at the
exchanges, and fullgraph=True gets fmoe's error naming the ways out (run under mpiexec -n 2|4)."""
from __future__ import annotations

import pytest
import torch

import fmoe
from _helpers import full_params, local_batch, local_params, make_spec

MESSAGE = "expert parallelism (a comm of size > 1) does not run inside one torch.compile graph"


@pytest.mark.parametrize("cf", [1.25, 0.0])
def test_fullgraph_refuses_expert_parallelism_naming_the_ways_out(comm, cf):
    spec = make_spec(2 * comm.size, 2, cf)
    p = local_params(spec, full_params(spec), comm)
    x = local_batch(comm.rank)
    torch._dynamo.reset()
    f = torch.compile(lambda p, x: fmoe.moe(p, x, spec, comm=comm)[0], fullgraph=True, backend="eager")
    with pytest.raises(Exception, match="torch.compiler.disable") as e:   # dynamo wraps fmoe's error
        f(p, x)
    assert MESSAGE in str(e.value)


def test_without_fullgraph_the_compiled_call_equals_eager_mode(comm):
    # backend "eager" runs the captured pieces with the same kernels: equal bit for bit
    spec = make_spec(2 * comm.size, 2, 1.25)
    p = local_params(spec, full_params(spec), comm)
    x = local_batch(comm.rank)
    torch._dynamo.reset()
    f = torch.compile(lambda p, x: fmoe.moe(p, x, spec, comm=comm)[0] * 2, backend="eager")
    assert torch.equal(f(p, x), fmoe.moe(p, x, spec, comm=comm)[0] * 2)
