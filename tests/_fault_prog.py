"""A tiny distributed training loop with one injected fault on the last rank.

Run by tests/test_faults_launch.py under ``mpiexec -n W`` and ``torchrun --nproc_per_node=2``:

    python tests/_fault_prog.py --fault skip [--timeout 5] [--no-abort-on-error]

Faults (all at step 1, on the last rank): none, skip (leaves the step out), repeat (runs it twice),
collective (calls all_gather where the others call all_reduce), raise (RuntimeError), kill
(SIGKILL itself), hang (sleeps; needs --timeout). Prints "rank r: finished" after a clean close().
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch

import fmoe
from fmoe.comm import abort_on_error, from_env
from fmoe.parallel import shard_experts

FAULTS = ("none", "skip", "repeat", "collective", "raise", "kill", "hang")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fault", choices=FAULTS, default="none")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=None)
    ap.add_argument("--no-abort-on-error", action="store_true")
    a = ap.parse_args()
    comm = from_env(timeout=a.timeout)
    spec = fmoe.MoESpec(model_dim=4, num_experts=comm.size, gate=fmoe.GateSpec(k=1, capacity_factor=1.0),
                        experts=fmoe.ExpertSpec(type="ffn", hidden_size=4))
    full = fmoe.init_params(spec, generator=torch.Generator().manual_seed(0))
    params = {"gate": full["gate"],
              "experts": shard_experts("ffn", full["experts"], spec.num_experts, comm.rank, comm.size)}
    for t in [params["gate"]["wg"], *params["experts"].values()]:
        t.requires_grad_(True)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(comm.rank))
    faulty = comm.rank == comm.size - 1

    def step():
        y, aux = fmoe.moe(params, x, spec, comm=comm)
        y.square().sum().backward()

    def loop():
        for s in range(a.steps):
            if faulty and s == 1:
                if a.fault == "skip":
                    continue
                if a.fault == "repeat":
                    step()
                if a.fault == "collective":
                    comm.all_gather(torch.ones(3), 0)
                    continue
                if a.fault == "raise":
                    raise RuntimeError("injected failure on the last rank")
                if a.fault == "kill":
                    sys.stdout.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
                if a.fault == "hang":
                    time.sleep(600)
            if a.fault == "collective" and s == 1:
                comm.all_reduce(torch.ones(3), "sum")
                continue
            step()

    if a.no_abort_on_error:
        loop()
    else:
        with abort_on_error(comm):
            loop()
    comm.close()
    print(f"rank {comm.rank}: finished", flush=True)


if __name__ == "__main__":
    main()
