"""Launched by tests/test_distributed_mesh.py: ``mpiexec -n 4 python tests/distributed/check_mpi_mesh.py``.

mesh_from_comm over MPIComm (ep=2, dp=2): the groups are the DeviceMesh layout's, and a dropless
MoE layer expert-parallel over ``ep_comm`` equals the one-process layer on each rank's tokens.
Rank 0 prints ``MPIMESH ranks ok=[1, 1, 1, 1] ...``.
"""
import torch

import fmoe
from fmoe.comm import mesh_from_comm
from mpi_backend import MPIComm

comm = MPIComm()
m = mesh_from_comm(comm, ep=2, dp=2, num_experts=4)
spec = fmoe.MoESpec(model_dim=8, num_experts=4, gate=fmoe.GateSpec(type="top", k=2, capacity_factor=0),
                    experts=fmoe.ExpertSpec(type="ffn", hidden_size=8))
params = fmoe.init_params(spec, generator=torch.Generator().manual_seed(0), comm=m.ep_comm)
x = torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(m.data_rank))
y, _ = fmoe.moe(params, x, spec, comm=m.ep_comm)
ref, _ = fmoe.moe(fmoe.init_params(spec, generator=torch.Generator().manual_seed(0)), x, spec)
members = {name: sorted(int(v) for v in getattr(m, name).all_gather(torch.tensor([comm.rank]), 0))
           for name in ("ep_comm", "dp_comm", "dense_comm", "pp_comm")}
want = {"ep_comm": [2 * (comm.rank // 2), 2 * (comm.rank // 2) + 1], "dp_comm": [comm.rank % 2, comm.rank % 2 + 2],
        "dense_comm": [0, 1, 2, 3], "pp_comm": [comm.rank]}
ok = members == want and torch.allclose(y, ref, rtol=1e-5, atol=1e-6) and m.data_rank == comm.rank
oks = comm.all_gather(torch.tensor([int(ok)]), 0).tolist()  # rank 0 reports (concurrent prints interleave)
if comm.rank == 0:
    print(f"MPIMESH ranks ok={oks} rank 0 groups={members} max_err={float((y - ref).abs().max()):.1e}", flush=True)
comm.close()
