"""FSDP2, DDP and pipelining over (pp, dp, ep) meshes equal the one-process model (torchrun, 4 ranks, gloo).

One launch per mesh (tests/distributed/check_recipes.py) checks every recipe that applies and both
routers (top-2 with capacity, dropless): loss and every gradient within 2e-5 relative (fp32;
observed <= 1e-6) of a one-process reference model with the same initial weights that each
rank also runs on the same pieces of the global batch.
"""
import os
import re
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.path.dirname(sys.executable)


def torchrun():
    path = os.path.join(BIN, "torchrun")
    return path if os.path.exists(path) else shutil.which("torchrun")


def launch(script, *args, nproc=4, timeout=240):
    script = os.path.join(HERE, "distributed", script)  # helpers, not collected (no test_ prefix)
    cmd = [torchrun(), "--standalone", f"--nproc_per_node={nproc}", script, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=os.path.dirname(HERE))


# (mesh, expected "recipe/router" checks, ranks reporting each)
MESHES = {
    "ep=2,dp=2": ["fsdp/capacity", "ddp/capacity", "fsdp/dropless", "ddp/dropless"],
    "ep=4": ["fsdp/capacity", "ddp/capacity", "fsdp/dropless", "ddp/dropless"],
    "pp=2,ep=2": ["pipeline-1F1B/capacity", "pipeline-GPipe/capacity", "pipeline-1F1B/dropless",
                  "pipeline-1F1B+ddp/capacity", "pipeline-1F1B+ddp/dropless"],
}


@pytest.mark.skipif(torchrun() is None, reason="torchrun not found")
@pytest.mark.parametrize("mesh", list(MESHES))
def test_recipes_match_one_process(mesh):
    extra = ["--errors"] if mesh == "ep=4" else []
    proc = launch("check_recipes.py", "--mesh", mesh, *extra)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-4000:]
    assert "FAILURE" not in out and " FAIL" not in out, out[-3000:]
    for what in MESHES[mesh]:
        lines = re.findall(rf"CHECK {re.escape(what)} rank=\S+ tensors=(\d+) .* ok", out)
        assert len(lines) == 4, (what, out[-3000:])       # every rank compared its tensors
        assert all(int(n) > 10 for n in lines)
    if extra:  # mesh errors name the counts
        assert "3 ranks, but the job has 4" in out
        assert "ep=0 must be a positive int" in out
        assert "6 experts cannot be spread over ep=4" in out
