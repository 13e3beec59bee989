"""Tutel's helloworld on fmoe: one MoE layer trained on random data.

    python -m fmoe.examples.helloworld --batch_size 4 --num_tokens 256 --model_dim 256 \\
        --hidden_size 512 --num_local_experts 2 --top 2 --num_steps 10

Expert parallel (the launcher picks the communicator: MPI under mpiexec,
gloo under torchrun; only rank 0 prints):

    mpiexec -n 2 python -m fmoe.examples.helloworld --num_local_experts 2 ...
    torchrun --nproc_per_node=2 -m fmoe.examples.helloworld --num_local_experts -2 ...

Model (Tutel spec §14): y = MoELayer(x); logits = log_softmax(sum_features(y), over
tokens); loss = NLL against token index 0; SGD. Prints loss and step time per step.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from fmoe.nn import MoELayer

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--num_tokens", type=int, default=512)
    p.add_argument("--model_dim", type=int, default=2048)
    p.add_argument("--hidden_size", type=int, default=2048)
    p.add_argument("--num_local_experts", type=int, default=2)
    p.add_argument("--top", type=int, default=2)
    p.add_argument("--capacity_factor", type=float, default=1.0)
    p.add_argument("--gate_noise", type=float, default=0.0)
    p.add_argument("--l_aux_wt", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--num_steps", type=int, default=100)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--a2a_ffn_overlap_degree", type=int, default=1)
    p.add_argument("--parallel_type", default="adaptive:1")
    p.add_argument("--use_2dh", action="store_true")
    p.add_argument("--local_size", type=int, default=None, help="ranks per node for --use_2dh")
    p.add_argument("--comm", choices=("auto", "mpi", "torch", "local"), default="auto",
                   help="communicator when run as a script (auto: from the launcher)")
    return p.parse_args(argv)


def build(args, comm=None) -> MoELayer:
    rank = 0 if comm is None else comm.rank
    layer = MoELayer(
        {"type": "top", "k": args.top, "capacity_factor": args.capacity_factor, "gate_noise": args.gate_noise,
         "fp32_gate": True},
        model_dim=args.model_dim,
        experts={"type": "ffn", "num_experts_per_device": args.num_local_experts,
                 "hidden_size_per_expert": args.hidden_size, "activation_fn": F.relu},
        comm=comm, seeds=(args.seed, args.seed + rank, args.seed),
        a2a_ffn_overlap_degree=args.a2a_ffn_overlap_degree, parallel_type=args.parallel_type,
        use_2dh=args.use_2dh, local_size=args.local_size,
    )
    return layer.to(device=args.device, dtype=DTYPES[args.dtype])


def main(argv=None, comm=None) -> list[float]:
    args = parse_args(argv)
    rank = 0 if comm is None else comm.rank
    layer = build(args, comm)
    x = torch.randn(args.batch_size, args.num_tokens, args.model_dim,
                    generator=torch.Generator().manual_seed(0)).to(args.device, DTYPES[args.dtype])
    target = torch.zeros(args.batch_size, dtype=torch.long, device=args.device)
    opt = torch.optim.SGD(layer.parameters(), lr=args.lr)
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    losses = []
    layer.train()
    if rank == 0:
        print(f"[fmoe] {layer}  dtype={args.dtype} device={args.device}")
    for step in range(args.num_steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        y, aux = layer(x, generator=gen, return_aux=True)
        logits = F.log_softmax(y.float().sum(dim=2), dim=1)
        loss = F.nll_loss(logits, target) + args.l_aux_wt * aux.l_aux
        loss.backward()
        if comm is not None and comm.size > 1:
            # every rank sees the same x: average the replicated (non-expert) gradients
            for name, p in layer.named_parameters():
                if not name.startswith("experts.") and p.grad is not None:
                    p.grad = comm.all_reduce(p.grad, "sum") / comm.size
        opt.step()
        dt = time.perf_counter() - t0
        losses.append(loss.item())
        if rank == 0:
            print(f"STEP-{step}: loss = {loss.item():.5f}, step_time = {dt:.6f} s, capacity = {aux.capacity}, "
                  f"dropped = {int(aux.dropped)}")
    return losses


if __name__ == "__main__":
    from fmoe.comm import abort_on_error, from_env
    _args = parse_args()
    _comm = from_env(_args.comm)
    with abort_on_error(_comm):  # one failing rank stops the job instead of hanging it
        main(comm=_comm)
    _comm.close()  # collective shutdown: torch.distributed aborts at exit without it
