"""Launched by tests/test_distributed_recipes.py under torchrun (4 ranks, gloo):

    torchrun --standalone --nproc_per_node=4 tests/distributed/check_recipes.py --mesh ep=2,dp=2

For the given mesh, each recipe that applies (FSDP2 and DDP without pipelining; pipelining when
pp > 1) and each router (top-2 with capacity, dropless) trains one step of a tiny char-LM from
the same initial weights as a one-process reference model that every rank also runs. The
reference sees the same pieces of the global batch (every rank's shard, every microbatch)
as separate MoE calls (capacity is a per-call quantity) and averages their losses, which is
the distributed objective. Prints one ``CHECK <what> loss_err=<e> grad_err=<e>`` line per
check (relative errors: max |a - b| / max |b| per tensor, maximum over tensors) and exits 1 on a
mismatch beyond TOL.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch
import torch.distributed

import fmoe.comm
from fmoe.comm import LocalComm
from fmoe.comm.mesh import parse_mesh
from fmoe.distributed import ddp, fsdp, logical_tensors, load_logical
from fmoe.distributed.pipeline import CharLMPipeline
from fmoe.examples.charlm import CharLM, CharLMConfig

TOL = 2e-5  # fp32: observed errors are ~1e-7 (different summation orders of the reductions)
ROWS = 4    # token rows per data shard
CFG = CharLMConfig(model_dim=16, num_layers=2, num_heads=2, context=8, num_experts=4, top_k=2,
                   hidden_size=16, capacity_factor=1.0, aux_weight=0.01)
ROUTERS = {"capacity": 1.0, "dropless": 0.0}
REPORT = []  # this rank's lines; rank 0 prints everyone's (concurrent prints interleave)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12))


def batch(seed: int, rows: int):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (rows, CFG.context + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def reference(cfg, state, tokens, targets, pieces):
    """(mean loss, {name: grad}) of the one-process model over ``pieces`` row slices."""
    model = CharLM(cfg, seed=0, comm=LocalComm())
    load_logical(model, _ONE, state)
    losses = []
    for sl in pieces:
        ce, l_aux = model.loss(tokens[sl], targets[sl])
        losses.append(ce + cfg.aux_weight * l_aux)
    loss = torch.stack(losses).mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


class _One:  # the one-process "mesh" load_logical needs for the reference model
    ep, ep_rank = 1, 0


_ONE = _One()


def compare(what, m, loss, ref_loss, grads, ref_grads, failures):
    loss_err = rel_err(loss, ref_loss)
    grad_err, worst = 0.0, ""
    for name, g in grads.items():
        if g is None:
            failures.append(f"{what}: {name} has no gradient")
            continue
        e = rel_err(g, ref_grads[name])
        if e > grad_err:
            grad_err, worst = e, name
    ok = loss_err <= TOL and grad_err <= TOL
    if not ok:
        failures.append(f"{what}: loss_err={loss_err:.2e} grad_err={grad_err:.2e} (worst {worst})")
    REPORT.append(f"CHECK {what} rank={m.pp_rank},{m.dp_rank},{m.ep_rank} tensors={len(grads)} "
                  f"loss_err={loss_err:.2e} grad_err={grad_err:.2e} {'ok' if ok else 'FAIL'}")


def run_flat(m, cfg, router, recipe, failures):
    init = CharLM(cfg, seed=0, comm=LocalComm())
    state = {n: p.detach().clone() for n, p in init.named_parameters()}
    tokens, targets = batch(1, ROWS * m.data_size)
    pieces = [slice(r * ROWS, (r + 1) * ROWS) for r in range(m.data_size)]
    ref_loss, ref_grads = reference(cfg, state, tokens, targets, pieces)

    model = CharLM(cfg, seed=0, comm=m.ep_comm)
    load_logical(model, m, state)
    mine = pieces[m.data_rank]
    if recipe == "fsdp":
        fsdp.shard(model, m, units=list(model.blocks))
        ce, l_aux = model.loss(tokens[mine], targets[mine])
        loss = ce + cfg.aux_weight * l_aux
        loss.backward()
    else:
        wrapped = ddp.wrap(model, m)
        logits, l_aux = wrapped(tokens[mine])
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), targets[mine].reshape(-1))
        loss = ce + cfg.aux_weight * l_aux
        loss.backward()
        ddp.reduce_expert_grads(wrapped, m)
    global_loss = m.dense_comm.all_reduce(loss.detach().reshape(1), "sum")[0] / m.data_size
    grads = logical_tensors(model, m, grads=True)
    compare(f"{recipe}/{router}", m, global_loss, ref_loss, grads, ref_grads, failures)


def run_pipeline(m, cfg, router, schedule, failures, microbatches=2, use_ddp=False):
    init = CharLM(cfg, seed=0, comm=LocalComm())
    state = {n: p.detach().clone() for n, p in init.named_parameters()}
    tokens, targets = batch(2, ROWS * m.data_size)
    mb = ROWS // microbatches
    pieces = [slice(r * ROWS + j * mb, r * ROWS + (j + 1) * mb)
              for r in range(m.data_size) for j in range(microbatches)]
    ref_loss, ref_grads = reference(cfg, state, tokens, targets, pieces)

    model = CharLM(cfg, seed=0, comm=m.ep_comm)
    load_logical(model, m, state)
    pipe = CharLMPipeline(model, m, batch_size=ROWS, microbatches=microbatches, schedule_name=schedule,
                          ddp=use_ddp)
    mine = slice(m.data_rank * ROWS, (m.data_rank + 1) * ROWS)
    loss = pipe.step(tokens[mine], targets[mine])
    if use_ddp:
        ddp.reduce_expert_grads(pipe.stage, m)
    else:
        ddp.reduce_grads(pipe.stage, m)
    # The last stage has the loss; the other stages compare gradients only.
    last = m.pp_rank == m.pp - 1
    mean = m.dense_comm.all_reduce((loss if last else torch.zeros(())).reshape(1), "sum")[0] / m.data_size
    grads = logical_tensors(pipe.stage, m, grads=True)
    compare(f"pipeline-{schedule}{'+ddp' if use_ddp else ''}/{router}", m, mean if last else ref_loss, ref_loss, grads, ref_grads, failures)


def check_errors(world, failures):
    """Mesh errors raise ValueError naming the counts, before any collective."""
    cases = [dict(ep=3), dict(ep=2), dict(ep=0, dp=4), dict(ep=4, num_experts=6)]
    for kw in cases:
        try:
            fmoe.comm.mesh(**kw)
        except ValueError as e:
            if torch.distributed.get_rank() == 0:
                print(f"ERRCHECK {kw}: {e}", flush=True)
        else:
            failures.append(f"mesh({kw}) on {world} ranks did not raise")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mesh", required=True)
    p.add_argument("--errors", action="store_true", help="also check the mesh errors")
    args = p.parse_args()
    torch.set_num_threads(1)
    sizes = parse_mesh(args.mesh)
    m = fmoe.comm.mesh(**sizes, num_experts=CFG.num_experts)
    failures = []
    if args.errors:
        check_errors(m.world_size, failures)
    for router, cf in ROUTERS.items():
        cfg = dataclasses.replace(CFG, capacity_factor=cf)
        if m.pp == 1:
            for recipe in ("fsdp", "ddp"):
                run_flat(m, cfg, router, recipe, failures)
        else:
            for schedule in (("1F1B", "GPipe") if router == "capacity" else ("1F1B",)):
                run_pipeline(m, cfg, router, schedule, failures)
            run_pipeline(m, cfg, router, "1F1B", failures, use_ddp=True)
    REPORT.extend(f"FAILURE {f}" for f in failures)
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, REPORT)
    if torch.distributed.get_rank() == 0:
        print("\n".join(line for lines in everyone for line in lines), flush=True)
    failures = [f for lines in everyone for f in lines if f.startswith("FAILURE")]
    # Close the default group collectively (gloo aborts at exit otherwise), then leave without the
    # interpreter's teardown: the DDP / FSDP wrappers built above still hold their sub-groups, and
    # on a loaded host freeing those at exit has aborted a rank after every check had passed
    # ("terminate called without an active exception"). Every result is printed by now.
    fmoe.comm.TorchDistComm().close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if failures else 0)


if __name__ == "__main__":
    main()
