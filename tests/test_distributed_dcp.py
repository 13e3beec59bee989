"""DCP checkpoints of mesh-sharded models: resharded bit for bit, atomic, verified (torchrun, gloo)."""
import re

import pytest

from tests.test_distributed_recipes import launch, torchrun

MAIN = ["ep=2,dp=2 (FSDP2) -> ep=4 bit for bit", "ep=4 -> ep=2,dp=2 (FSDP2) bit for bit",
        "ep=4 -> pp=2,ep=2 stages bit for bit", "manifest step and mesh", "crashed save raises",
        "after a crashed save the previous version loads bit for bit", "the next save removes the leftovers",
        "truncated file refused", "altered byte refused", "8-expert model refused", "missing checkpoint"]


def checks(out):
    return {m.group(1): m.group(2) for m in re.finditer(r"DCPCHECK (.*?)(?: \(message: .*\))? (ok|FAIL)", out)}


@pytest.mark.skipif(torchrun() is None, reason="torchrun not found")
def test_dcp_reshards_between_meshes_and_refuses_bad_files(tmp_path):
    proc = launch("check_dcp.py", "--dir", str(tmp_path), "--phase", "main")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    got = checks(proc.stdout)
    for what in MAIN:
        assert got.get(what) == "ok", (what, proc.stdout[-3000:])


@pytest.mark.skipif(torchrun() is None, reason="torchrun not found")
def test_dcp_killed_save_leaves_previous_version_loadable(tmp_path):
    killed = launch("check_dcp.py", "--dir", str(tmp_path), "--phase", "kill")
    assert killed.returncode != 0 and "version A saved ok" in killed.stdout, killed.stdout[-2000:]
    assert "unreachable" not in killed.stdout
    after = launch("check_dcp.py", "--dir", str(tmp_path), "--phase", "after-kill", nproc=1)
    assert after.returncode == 0, after.stdout[-3000:] + after.stderr[-4000:]
    got = checks(after.stdout)
    for what in ("after a killed save LATEST is version A", "version A loads on ep=1 bit for bit",
                 "the killed save left only a temporary folder"):
        assert got.get(what) == "ok", (what, after.stdout[-3000:])
