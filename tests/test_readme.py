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


def test_low_precision_snippet_runs_after_the_first_example():
    setup = next(b for b in _blocks() if "fmoe.MoESpec(" in b).split("# The primitives")[0]
    code = next(b for b in _blocks() if 'precision="fp8_block"' in b)
    ns = {}
    exec(compile(setup.replace("torch.randn(4, 256, 512)", "torch.randn(2, 16, 512)"), "README:setup", "exec"), ns)
    exec(compile(code, "README:low-precision", "exec"), ns)   # its own imports: fmoe.parallel, dataclasses
    assert ns["y"].shape == (2, 16, 512) and ns["spec"].experts.precision is not None


def test_per_example_recipe_states_its_capacity_caveat_where_it_is_shown():
    code = next(b for b in _blocks() if "vmap(grad(loss)" in b)
    line = code.index("vmap(grad(loss)")
    assert "each example routed alone" in code[line:line + 300] and "not the batch gradient" in code[line:line + 300]


def test_engine_snippet_comment_matches_its_output(capsys):
    code = next(b for b in _blocks() if "fmoe.engine.make_plan" in b)
    exec(compile(code, "README:engine", "exec"), {})
    phase = re.search(r"phase=(\w+)", capsys.readouterr().out).group(1)
    assert f"phase={phase}, float32, cpu)" in code
