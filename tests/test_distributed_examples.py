"""The char-LM example trains on meshes: the README's two torchrun lines (tiny settings, 4 ranks, gloo)."""
import json
import os
import subprocess

import pytest

from tests.test_distributed_recipes import torchrun

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = ["--steps", "4", "--eval_every", "2", "--model_dim", "32", "--hidden_size", "32", "--context", "16",
        "--batch_size", "4", "--corpus_bytes", "200000", "--no_progress"]


@pytest.mark.skipif(torchrun() is None, reason="torchrun not found")
# ep=2,dp=2 trains dropless: FSDP2 frees the gathered expert weights by resizing their storage,
# which the CPU few-row kernel once made impossible (its weights went to numba through .numpy())
@pytest.mark.parametrize("mesh, recipe, extra", [("ep=2,dp=2", "FSDP2", ["--capacity_factor", "0"]),
                                                 ("pp=2,ep=2", "pipeline 1F1B", [])])
def test_charlm_trains_on_mesh(tmp_path, mesh, recipe, extra):
    cmd = [torchrun(), "--standalone", "--nproc_per_node=4", "-m", "fmoe.examples.charlm", "--mesh", mesh, *TINY,
           *extra, "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert f"mesh pp={mesh.count('pp=2') + 1}" in proc.stdout and recipe in proc.stdout, proc.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 4 and len(summary["train_curve"]) == 4
    assert summary["final_loss"] < summary["initial_loss"] < 7.0
