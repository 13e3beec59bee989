"""The helloworld example under real launchers (subprocesses): torchrun (gloo) and mpiexec (MPI).

Sharded experts (num_local_experts=-2: one expert shared by the 2 ranks) must give the same loss
trajectory in 'data' and 'model' parallel modes (spec §12.3 invariant)."""
import os
import re
import shutil
import subprocess
import sys

import pytest

ARGS = ["--batch_size", "2", "--num_tokens", "32", "--model_dim", "32", "--hidden_size", "64", "--top", "2",
        "--num_steps", "3", "--dtype", "float64", "--lr", "1e-2"]
BIN = os.path.dirname(sys.executable)


def _losses(out: str) -> list[float]:
    return [float(v) for v in re.findall(r"STEP-\d+: loss = ([0-9.]+)", out)]


def _run(cmd):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def _tool(name):
    path = os.path.join(BIN, name)
    return path if os.path.exists(path) else shutil.which(name)


@pytest.mark.skipif(_tool("torchrun") is None, reason="torchrun not found")
def test_torchrun_data_and_model_modes_agree():
    runs = {}
    for mode in ("data", "model"):
        out = _run([_tool("torchrun"), "--standalone", "--nproc_per_node=2", "-m", "fmoe.examples.helloworld",
                    *ARGS, "--num_local_experts", "-2", "--parallel_type", mode])
        runs[mode] = _losses(out)
    assert len(runs["data"]) == 3, runs
    assert runs["data"] == runs["model"]
    assert runs["data"][-1] < runs["data"][0]


@pytest.mark.skipif(_tool("mpiexec") is None, reason="mpiexec not found")
def test_mpiexec_helloworld_runs_and_only_rank0_prints():
    out = _run([_tool("mpiexec"), "-n", "2", sys.executable, "-m", "fmoe.examples.helloworld", *ARGS,
                "--num_local_experts", "1"])
    losses = _losses(out)
    assert len(losses) == 3 and losses[-1] < losses[0]
