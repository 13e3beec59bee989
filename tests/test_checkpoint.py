"""fmoe.checkpoint: gather/scatter between world sizes is exact, and the layouts match fmoe.parallel."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import fmoe
from fmoe import checkpoint as ck
from fmoe.parallel import shard_experts


def _spec(E, etype="ffn", O=None):
    return fmoe.MoESpec(model_dim=6, num_experts=E, gate=fmoe.GateSpec(k=2),
                        experts=fmoe.ExpertSpec(type=etype, hidden_size=8, output_dim=O))


def _full(spec):
    p = fmoe.init_params(spec, generator=torch.Generator().manual_seed(0))
    for k in ("fc1_b", "fc2_b"):
        if k in p["experts"]:
            p["experts"][k] = torch.randn(p["experts"][k].shape)
    return ck.state_dict_from_params(p, spec.num_experts, prefix="model.moe") | {"model.head": torch.ones(3)}


@pytest.mark.parametrize("etype,O", [("ffn", None), ("ffn", 5), ("gated_ffn", None)])
@pytest.mark.parametrize("E", [1, 2, 4])
@pytest.mark.parametrize("S", [1, 2, 4, 8])
def test_scatter_matches_parallel_layout_and_gathers_back(E, S, etype, O):
    spec = _spec(E, etype, O)
    full = _full(spec)
    parts = ck.scatter(full, S)
    experts = ck.params_from_state_dict(full, "model.moe")["experts"]
    for r, part in enumerate(parts):
        want = shard_experts(etype, experts, E, r, S)
        got = ck.params_from_state_dict(part, "model.moe")["experts"]
        for k in want:
            assert torch.equal(got[k], want[k]), (k, r)
        assert torch.equal(part["model.head"], full["model.head"])
    back = ck.gather(parts)
    assert back.keys() == full.keys()
    for k in full:
        assert torch.equal(back[k], full[k]), k


def test_legacy_and_bad_inputs():
    full = _full(_spec(2))
    legacy = {k: v for k, v in full.items() if not k.endswith(ck.MARKER)}
    with pytest.raises(ValueError, match="legacy"):
        ck.scatter(legacy, 2)
    parts = ck.scatter(full, 2)
    parts = [{k: v for k, v in p.items() if not k.endswith(ck.MARKER)} for p in parts]
    g = ck.gather(parts, num_experts=2)
    assert torch.equal(g["model.moe.experts.fc1_w"], full["model.moe.experts.fc1_w"])
    with pytest.raises(ValueError, match="E % S"):
        ck.scatter(_full(_spec(2)), 3)


def test_command_line_round_trip(tmp_path):
    full = {"model": _full(_spec(2)), "step": 7}
    torch.save(full, tmp_path / "full.pt")
    run = lambda *a: subprocess.run([sys.executable, "-m", "fmoe.checkpoint", *a], capture_output=True, text=True)
    r = run("scatter", "--input", str(tmp_path / "full.pt"), "--outputs", str(tmp_path / "s/r{rank}-of-{size}.pt"),
            "--size", "4", "--namespace", "model")
    assert r.returncode == 0, r.stderr
    assert "write" in r.stderr  # tqdm progress bar
    r = run("gather", "--inputs", str(tmp_path / "s/r{rank}-of-{size}.pt"), "--size", "4",
            "--output", str(tmp_path / "back.pt"), "--namespace", "model", "--no-progress")
    assert r.returncode == 0, r.stderr
    back = torch.load(tmp_path / "back.pt", weights_only=False)
    assert back["step"] == 7
    for k, v in full["model"].items():
        assert torch.equal(back["model"][k], v), k
    r = run("gather", "--inputs", str(tmp_path / "missing{rank}.pt"), "--size", "2", "--output", "x.pt")
    assert r.returncode == 2 and "error" in r.stderr
