"""Step time of each mesh recipe against the plain expert-parallel step (not run by the tests).

    torchrun --standalone --nproc_per_node=4 tests/distributed/bench_recipes.py --mesh ep=2,dp=2
    torchrun --standalone --nproc_per_node=4 tests/distributed/bench_recipes.py --mesh ep=4
    torchrun --standalone --nproc_per_node=4 tests/distributed/bench_recipes.py --mesh pp=2,ep=2

One step = forward, backward, gradient reductions, AdamW step, on a fixed global batch of
``--global_rows`` rows (split over the mesh's data shards). "plain" is fmoe's expert-parallel
step without torch's engines: the same mesh, gradients reduced by explicit all-reduces of one
flat buffer per group (:func:`fmoe.distributed.ddp.reduce_grads`); on ep = world,
"plain-charlm-sync_and_clip" is examples/charlm.py's own step (one all-reduce per tensor); the
pipeline run also times the plain step on the same ranks without stages. Variants are
interleaved step by step. Prints the median and min over ``--steps`` timed steps (after 3
warm-up steps) as ``BENCH <mesh> <recipe> median_ms=... min_ms=...`` on rank 0.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fmoe.comm
from fmoe.comm.mesh import parse_mesh
from fmoe.distributed import ddp, fsdp
from fmoe.distributed.pipeline import CharLMPipeline
from fmoe.examples.charlm import CharLM, CharLMConfig

CFG = CharLMConfig(model_dim=64, num_layers=2, num_heads=4, context=64, num_experts=8, top_k=2,
                   hidden_size=128, capacity_factor=1.25)


def timed(steps: dict, n: int) -> dict:
    """{name: (median, min) seconds}: the variants' steps interleaved round by round, so machine
    noise (a shared 2-core box) spreads over all of them; 3 warm-up rounds first."""
    times = {name: [] for name in steps}
    for i in range(n + 3):
        for name, step in steps.items():
            dist.barrier()
            t = time.perf_counter()
            step()
            dist.barrier()
            if i >= 3:
                times[name].append(time.perf_counter() - t)
    return {name: (statistics.median(ts), min(ts)) for name, ts in times.items()}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mesh", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--global_rows", type=int, default=32)
    args = p.parse_args()
    torch.set_num_threads(1)
    m = fmoe.comm.mesh(**parse_mesh(args.mesh), num_experts=CFG.num_experts)
    rows = args.global_rows // m.data_size
    g = torch.Generator().manual_seed(m.data_rank)
    tokens = torch.randint(0, 256, (rows, CFG.context + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def flat_step(model, opt, fwd, after):
        def step():
            opt.zero_grad(set_to_none=True)
            logits, l_aux = fwd(x)
            (F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1)) + CFG.aux_weight * l_aux).backward()
            after()
            opt.step()
        return step

    results = {}
    if m.pp == 1:
        model = CharLM(CFG, comm=m.ep_comm)
        opt = torch.optim.AdamW(model.parameters(), foreach=False)
        results["plain"] = flat_step(model, opt, model, lambda model=model: ddp.reduce_grads(model, m))
        if m.ep == m.world_size:  # the example's own expert-parallel step: one all-reduce per tensor
            from fmoe.examples.charlm import sync_and_clip
            model = CharLM(CFG, comm=m.ep_comm)
            opt = torch.optim.AdamW(model.parameters(), foreach=False)
            results["plain-charlm-sync_and_clip"] = flat_step(model, opt, model,
                                                              lambda model=model: sync_and_clip(model, m.ep_comm, 1e9))
        model = CharLM(CFG, comm=m.ep_comm)
        wrapped = ddp.wrap(model, m)
        opt = torch.optim.AdamW(model.parameters(), foreach=False)
        results["ddp"] = flat_step(model, opt, wrapped, lambda: ddp.reduce_expert_grads(wrapped, m))
        model = CharLM(CFG, comm=m.ep_comm)
        fsdp.shard(model, m, units=list(model.blocks))
        opt = torch.optim.AdamW(model.parameters(), foreach=False)
        results["fsdp"] = flat_step(model, opt, model, lambda: None)
    else:
        pipe = CharLMPipeline(CharLM(CFG, comm=m.ep_comm), m, batch_size=rows, microbatches=2 * m.pp)
        opt = torch.optim.AdamW(pipe.stage.parameters(), foreach=False)

        def step():
            opt.zero_grad(set_to_none=True)
            pipe.step(x, y)
            ddp.reduce_grads(pipe.stage, m)
            opt.step()
        results[f"pipeline-1F1B x{2 * m.pp}"] = step
        pipe_d = CharLMPipeline(CharLM(CFG, comm=m.ep_comm), m, batch_size=rows, microbatches=2 * m.pp, ddp=True)
        opt_d = torch.optim.AdamW(pipe_d.stage.parameters(), foreach=False)

        def step_ddp():
            opt_d.zero_grad(set_to_none=True)
            pipe_d.step(x, y)
            ddp.reduce_expert_grads(pipe_d.stage, m)
            opt_d.step()
        results[f"pipeline-1F1B x{2 * m.pp} + ddp"] = step_ddp
        # The plain step on the same ranks without stages (ep=2,dp=2 mesh, same global batch), interleaved.
        flat = fmoe.comm.mesh(ep=m.ep, dp=m.pp * m.dp, num_experts=CFG.num_experts)
        r2 = args.global_rows // flat.data_size
        t2 = torch.randint(0, 256, (r2, CFG.context + 1), generator=torch.Generator().manual_seed(flat.data_rank))
        model = CharLM(CFG, comm=flat.ep_comm)
        opt2 = torch.optim.AdamW(model.parameters(), foreach=False)

        def plain():
            opt2.zero_grad(set_to_none=True)
            logits, l_aux = model(t2[:, :-1])
            (F.cross_entropy(logits.reshape(-1, 256), t2[:, 1:].reshape(-1)) + CFG.aux_weight * l_aux).backward()
            ddp.reduce_grads(model, flat)
            opt2.step()
        results[f"plain on ep={flat.ep},dp={flat.dp}"] = plain
    results = timed(results, args.steps)
    if dist.get_rank() == 0:
        for name, (med, best) in results.items():
            print(f"BENCH {args.mesh} {name} median_ms={med * 1e3:.1f} min_ms={best * 1e3:.1f} "
                  f"(global batch {args.global_rows} x {CFG.context} tokens)", flush=True)
    fmoe.comm.TorchDistComm().close()


if __name__ == "__main__":
    main()
