"""Launched by tests/test_distributed_dcp.py under torchrun (gloo):

    torchrun --standalone --nproc_per_node=4 tests/distributed/check_dcp.py --dir D --phase main
    torchrun --standalone --nproc_per_node=4 tests/distributed/check_dcp.py --dir D --phase kill    (dies)
    torchrun --standalone --nproc_per_node=1 tests/distributed/check_dcp.py --dir D --phase after-kill

main: a model saved on ep=2,dp=2 (FSDP2) loads on ep=4 (plain) bit for bit, is changed and saved
there, and loads back on ep=2,dp=2 (FSDP2) and on pp=2,ep=2 (pipeline stages) bit for bit; a save
that crashes before its rename leaves the previous version loadable; truncated / altered files
and a model with another expert count are refused with CheckpointError on every rank.
kill: saves version A, then dies (os._exit, like a SIGKILL) in the middle of saving version B,
after B's files are written and before they are published. after-kill: on one rank (ep=1),
the checkpoint is version A, bit for bit. Prints ``DCPCHECK <what> ok`` lines.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys

import torch
import torch.distributed as dist

import fmoe.comm
from fmoe.comm import LocalComm
from fmoe.distributed import dcp, fsdp, load_logical, logical_tensors
from fmoe.distributed.pipeline import CharLMPipeline
from fmoe.examples.charlm import CharLM, CharLMConfig

CFG = CharLMConfig(model_dim=16, num_layers=2, num_heads=2, context=8, num_experts=4, top_k=2,
                   hidden_size=16, capacity_factor=1.0)
failures = []


def say(msg):
    if dist.get_rank() == 0:
        print(msg, flush=True)


def expect(cond, what):
    if cond:
        say(f"DCPCHECK {what} ok")
    else:
        failures.append(what)
        say(f"DCPCHECK {what} FAIL")


def logical_init(seed, cfg=CFG):
    return {n: p.detach().clone() for n, p in CharLM(cfg, seed=seed, comm=LocalComm()).named_parameters()}


def build(mesh, seed, *, shard=False, cfg=CFG):
    """A CharLM on ``mesh`` holding the one-process model of ``seed``'s weights."""
    model = CharLM(cfg, seed=seed, comm=mesh.ep_comm)
    load_logical(model, mesh, logical_init(seed, cfg))
    if shard:
        fsdp.shard(model, mesh, units=list(model.blocks))
    return model


def bit_equal(got: dict, want: dict) -> bool:
    bad = [n for n, t in got.items() if not torch.equal(t, want[n])]
    if bad:
        print(f"rank {dist.get_rank()}: {len(bad)} tensors differ, e.g. {bad[:3]}", flush=True)
    return not bad


def expect_error(fn, needle, what):
    try:
        fn()
    except dcp.CheckpointError as e:
        expect(needle in str(e), f"{what} (message: {str(e)[:160]})")
    else:
        expect(False, f"{what}: no error")


def phase_main(root):
    ck = os.path.join(root, "ck")
    a = fmoe.comm.mesh(ep=2, dp=2)
    model_a = build(a, seed=0, shard=True)
    want_a = logical_tensors(model_a, a)
    dcp.save(model_a, a, ck, step=1)

    b = fmoe.comm.mesh(ep=4)
    model_b = build(b, seed=7)                     # other weights: the load must replace them all
    dcp.load(model_b, b, ck)
    expect(bit_equal(logical_tensors(model_b, b), want_a), "ep=2,dp=2 (FSDP2) -> ep=4 bit for bit")

    with torch.no_grad():                          # a new state on ep=4, saved there
        for p in model_b.parameters():
            p.mul_(1.5).add_(0.25)
    want_b = logical_tensors(model_b, b)
    dcp.save(model_b, b, ck, step=2)
    model_a2 = build(a, seed=9, shard=True)
    manifest = dcp.load(model_a2, a, ck)
    expect(manifest["step"] == 2 and manifest["mesh"] == {"pp": 1, "dp": 1, "ep": 4}, "manifest step and mesh")
    expect(bit_equal(logical_tensors(model_a2, a), want_b), "ep=4 -> ep=2,dp=2 (FSDP2) bit for bit")

    c = fmoe.comm.mesh(pp=2, ep=2)
    pipe = CharLMPipeline(build(c, seed=11), c, batch_size=4, microbatches=2)
    dcp.load(pipe.stage, c, ck)
    got = logical_tensors(pipe.stage, c)
    expect(bit_equal(got, {n: want_b[n] for n in got}), "ep=4 -> pp=2,ep=2 stages bit for bit")

    # A save that crashes before its rename: the previous version stays current and loadable.
    real = dcp._publish
    dcp._publish = lambda *a_: (_ for _ in ()).throw(OSError("simulated crash before the rename"))
    try:
        expect_error(lambda: dcp.save(model_a, a, ck, step=3), "previous version is intact", "crashed save raises")
    finally:
        dcp._publish = real
    leftovers = [n for n in os.listdir(ck) if n.startswith(".tmp-")]
    expect(len(leftovers) == 1, "crashed save leaves its temporary folder only")
    model_b2 = build(b, seed=13)
    expect(dcp.load(model_b2, b, ck)["step"] == 2 and bit_equal(logical_tensors(model_b2, b), want_b),
           "after a crashed save the previous version loads bit for bit")
    dcp.save(model_b2, b, ck, step=4)
    expect(not [n for n in os.listdir(ck) if n.startswith(".tmp-")] and
           len([n for n in os.listdir(ck) if n.startswith("v-")]) == 1, "the next save removes the leftovers")

    # Verification: truncated file, altered byte, another expert count.
    bad = os.path.join(root, "bad")
    if dist.get_rank() == 0:
        shutil.copytree(ck, bad)
        version = open(os.path.join(bad, "LATEST")).read().strip()
        data = sorted(f for f in os.listdir(os.path.join(bad, version)) if f.endswith(".distcp"))[0]
        with open(os.path.join(bad, version, data), "r+b") as f:
            f.truncate(os.path.getsize(f.name) // 2)
    dist.barrier()
    expect_error(lambda: dcp.load(model_b2, b, bad), "truncated", "truncated file refused")
    if dist.get_rank() == 0:
        shutil.rmtree(bad)
        shutil.copytree(ck, bad)
        version = open(os.path.join(bad, "LATEST")).read().strip()
        data = sorted(f for f in os.listdir(os.path.join(bad, version)) if f.endswith(".distcp"))[-1]
        with open(os.path.join(bad, version, data), "r+b") as f:
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    expect_error(lambda: dcp.load(model_b2, b, bad), "SHA-256 mismatch", "altered byte refused")
    model_e8 = build(b, seed=0, cfg=dataclasses.replace(CFG, num_experts=8))
    expect_error(lambda: dcp.load(model_e8, b, ck), "different expert count", "8-expert model refused")
    expect_error(lambda: dcp.load(model_b2, b, os.path.join(root, "nothing")), "no LATEST", "missing checkpoint")


def phase_kill(root):
    ck = os.path.join(root, "ck")
    a = fmoe.comm.mesh(ep=2, dp=2)
    dcp.save(build(a, seed=0, shard=True), a, ck, step=1)
    say("DCPCHECK version A saved ok")

    def die(*args):  # the data of version B is on disk, not yet published: kill every rank now
        sys.stdout.flush()
        os._exit(9)
    dcp._publish = die  # rank 0 publishes; torchrun then stops the ranks waiting for its verdict
    dcp.save(build(a, seed=21, shard=True), a, ck, step=2)
    say("DCPCHECK unreachable: the killed save returned")



def phase_after_kill(root):
    ck = os.path.join(root, "ck")
    one = fmoe.comm.mesh(ep=1)
    model = build(one, seed=5)
    manifest = dcp.load(model, one, ck)
    expect(manifest["step"] == 1, "after a killed save LATEST is version A")
    expect(bit_equal(logical_tensors(model, one), logical_init(0)), "version A loads on ep=1 bit for bit")
    expect(any(n.startswith(".tmp-") for n in os.listdir(ck)), "the killed save left only a temporary folder")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--phase", choices=("main", "kill", "after-kill"), required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    comm = fmoe.comm.TorchDistComm.from_env()
    {"main": phase_main, "kill": phase_kill, "after-kill": phase_after_kill}[args.phase](args.dir)
    # Rank 0 reports every rank's failures (concurrent prints interleave).
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, failures)
    bad = [f"rank {r}: {f}" for r, fs in enumerate(everyone) for f in fs]
    say("\n".join(f"FAILURE {f}" for f in bad))
    comm.close()
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
