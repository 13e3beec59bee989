"""The README's self-contained Python snippets run as written (docs match the code)."""
import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_functional_api_snippet_runs():
    code = next(b for b in _blocks() if "fmoe.MoESpec(" in b)
    ns = {}
    exec(compile(code, "README:functional", "exec"), ns)
    assert ns["y"].shape == (4, 256, 512)
    assert ns["out"].shape == (4 * 256, 512)
    assert ns["ys"].shape == (16, 4, 256, 512)
    assert ns["per_example"]["experts"]["fc1_w"].shape[0] == 4


def test_engine_snippet_runs(capsys):
    code = next(b for b in _blocks() if "fmoe.engine.make_plan" in b)
    ns = {}
    exec(compile(code, "README:engine", "exec"), ns)
    assert ns["plan"].num_rows == 128 and "phase=" in capsys.readouterr().out


def test_research_snippet_runs(tmp_path, monkeypatch):
    setup = next(b for b in _blocks() if "fmoe.MoESpec(" in b).split("# The primitives")[0]
    code = next(b for b in _blocks() if "fmoe.ablate.Point" in b)
    monkeypatch.chdir(tmp_path)
    ns = {}
    exec(compile(setup.replace("torch.randn(4, 256, 512)", "torch.randn(2, 32, 512)"), "README:setup", "exec"), ns)
    ns["y"] = torch.zeros(2, 32, 512)
    ns["x"] = ns["x"]
    exec(compile(code, "README:research", "exec"), ns)
    assert ns["res"].table["loss"].shape == (6,)
    assert (tmp_path / "routing.pt").exists()
