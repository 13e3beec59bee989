"""The benchmark harness runs end to end and writes what BENCHMARKS.md is built from.

Structure and the measurement helpers' arithmetic only: speed is never asserted (the machine
is shared), but the Tutel peer must compute the same function as fmoe on the copied weights.
"""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from benchmarks import bench_blocks, bench_common, bench_layer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STATES = {"met", "missed", "not measured"}


def test_run_quick_smoke_writes_json_tables_and_plots(tmp_path):
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "benchmarks.run", "--quick", "--only", "smoke", "--out", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=600)  # ~20 s quiet, minutes at load 10
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads((out / "results.json").read_text())
    assert res["quick"] is True and res["memory"] is True and res["partial"] is False
    assert list(res["suites"]) == ["layer"]
    r = res["suites"]["layer"]["configs"]["smoke"]
    assert r["tokens"] == 256 and r["kept_pairs"] + r["dropped_pairs"] == 256 * 2
    for v in ("fmoe", "dense_flat", "dense_batched", "dense_loop"):
        m = r["variants"][v]
        assert len(m["all_seconds"]) == 2 and m["seconds"] == sorted(m["all_seconds"])[0] + (
            sorted(m["all_seconds"])[1] - sorted(m["all_seconds"])[0]) / 2
        assert m["gflops"] > 0
    assert r["fmoe_vs_dense"] == pytest.approx(r["variants"]["fmoe"]["gflops"] / r["variants"]["dense_batched"]["gflops"])
    assert r["fmoe_vs_dense_flat"] == pytest.approx(r["variants"]["fmoe"]["gflops"] / r["variants"]["dense_flat"]["gflops"])
    assert r["fmoe_vs_dense_loop"] == pytest.approx(r["variants"]["fmoe"]["gflops"] / r["variants"]["dense_loop"]["gflops"])
    assert r["dense_loop_vs_dense"] == pytest.approx(r["variants"]["dense_loop"]["gflops"]
                                                     / r["variants"]["dense_batched"]["gflops"])
    mem = r["memory"]["fmoe"]
    assert mem["ok"] is True, mem
    assert mem["peak_bytes"] >= mem["rest_bytes"] > 0 and mem["above_rest_bytes"] == mem["peak_bytes"] - mem["rest_bytes"]
    if bench_layer.tutel_status() is None:
        assert r["tutel_max_abs_diff"] < 1e-6  # same weights, same routing: the same function
        assert "seconds" in r["variants"]["tutel"] and r["memory"]["tutel"]["ok"] is True
        assert r["fmoe_time_vs_tutel"] == pytest.approx(r["variants"]["fmoe"]["seconds"]
                                                        / r["variants"]["tutel"]["seconds"])
    else:
        assert "not installed" in r["variants"]["tutel"]["skipped"]
    names = [t["target"] for t in res["targets"]]
    t1 = res["targets"][names.index("T1 layer training >= 0.90 of dense")]
    assert "one GEMM call per expert (dense_loop" in t1["line"] and "T3 time vs Tutel geo-mean <= 0.55" in names
    assert all(t["status"] in STATES and t["line"].startswith(t["target"]) for t in res["targets"])
    md = (out / "results.md").read_text()
    assert "| smoke | 256 | 128 | 64 | 8 | 2 | 1.25 |" in md and "### Targets" in md
    pytest.importorskip("matplotlib")
    assert (out / "layer.png").stat().st_size > 1000
    assert not [f for f in os.listdir(out) if f.startswith(".tmp-")]


def test_only_rejects_unknown_names():
    p = subprocess.run([sys.executable, "-m", "benchmarks.run", "--only", "nope"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "--only 'nope': not a suite, layer config or arch" in p.stderr


def test_tutel_missing_is_reported_not_raised(monkeypatch):
    monkeypatch.setitem(sys.modules, "tutel", None)  # import tutel -> ImportError
    assert bench_layer.tutel_status() == ("not installed (ModuleNotFoundError: import of tutel halted; "
                                          "None in sys.modules)")


def test_status_lines():
    s = bench_common.status("X", 0.5, 0.55, False, "d")
    assert s["status"] == "met" and s["line"] == "X: met (0.50 vs <= 0.55; d)"
    s = bench_common.status("X", 0.8, 0.9, True, "d", "bound by Y")
    assert s["status"] == "missed" and s["line"] == "X: missed (0.80 vs >= 0.9; d) bound by Y"
    assert bench_common.status("X", None, 1.0, True, "d")["status"] == "not measured"
    assert bench_common.geomean([0.25, 1.0]) == pytest.approx(0.5)
    assert bench_common.geomean([None]) is None


def test_dense_ffn_flops_match_the_gemms():
    steps, flops = bench_common.dense_ffn_steps(rows=10, model_dim=6, hidden=4, experts=3)
    assert flops["dense_flat"] == 3 * 10 * 6 * 6 * 4
    assert flops["dense_batched"] == 3 * 3 * 4 * 6 * 6 * 4  # ceil(10 / 3) = 4 rows per expert
    assert flops["dense_loop"] == flops["dense_batched"]
    for name, mm, n_calls in (("dense_flat", torch.mm, 9), ("dense_batched", torch.bmm, 9), ("dense_loop", torch.mm, 27)):
        calls = []

        class Count(torch.overrides.TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if func is mm:
                    a, b = args
                    calls.append(2 * a.shape[-2] * a.shape[-1] * b.shape[-1] * (a.shape[0] if a.dim() == 3 else 1))
                return func(*args, **(kwargs or {}))

        with Count():
            steps[name]()
        assert len(calls) == n_calls and sum(calls) == flops[name]


def test_dense_ffn_reuses_activation_outputs_and_allocates_weight_gradients():
    # A MoE step's activations come from scratch; only its weight gradients are fresh pages. The
    # references must pay the same: 6 of the 9 GEMMs write into buffers kept across steps.
    steps, _ = bench_common.dense_ffn_steps(rows=10, model_dim=6, hidden=5, experts=3)   # 4 rows per expert
    for name, mm, per_gemm, rows in (("dense_flat", torch.mm, 1, 10), ("dense_batched", torch.bmm, 1, 4),
                                     ("dense_loop", torch.mm, 3, 4)):
        seen = []

        class Outs(torch.overrides.TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if func is mm:
                    out = (kwargs or {}).get("out")
                    seen[-1].append(None if out is None else (out.data_ptr(), tuple(out.shape)))
                return func(*args, **(kwargs or {}))

        for _ in range(2):
            seen.append([])
            with Outs():
                steps[name]()
        acts = [[o for o in step if o is not None and o[1][-2] == rows] for step in seen]   # [.., rows, M or H]
        assert len(acts[0]) == 6 * per_gemm and acts[0] == acts[1], name
        wgrads = [o for o in seen[0] if o is None or o[1][-2] != rows]
        assert len(wgrads) == 3 * per_gemm, name
        if per_gemm == 1:
            assert wgrads == [None] * 3   # fresh outputs from the GEMM itself


def test_write_json_is_atomic(tmp_path):
    path = tmp_path / "sub" / "r.json"
    bench_common.write_json(str(path), {"a": [1, 2]})
    bench_common.write_json(str(path), {"a": 3})
    assert json.loads(path.read_text()) == {"a": 3} and os.listdir(path.parent) == ["r.json"]
    with pytest.raises(TypeError):
        bench_common.write_json(str(path), {"a": object()})
    assert json.loads(path.read_text()) == {"a": 3} and os.listdir(path.parent) == ["r.json"]


def test_block_flop_and_byte_accounting():
    params = {"router": {"weight": torch.zeros(4, 8)},
              "experts": {"gate_up": torch.zeros(4, 6, 8), "down": torch.zeros(4, 8, 3), "bias": torch.zeros(4, 6)},
              "shared": {"w": torch.zeros(5, 8)}}
    per_expert, always, row_flop, shared_flop = bench_blocks._expert_bytes_and_flops(params, 4)
    assert per_expert == (48 + 24 + 6) * 4 and always == (32 + 40) * 4
    assert row_flop == 2 * (48 + 24) and shared_flop == 2 * 40
    assert math.isclose(bench_common.MIB, 1 << 20)


def test_gemm_calls_suite_quick():
    from benchmarks import bench_gemm_calls
    res = bench_gemm_calls.run(quick=True, only="gemm_calls", log=lambda s: None)
    (case,) = res["calls"].values()
    v = case["variants"]
    assert list(v) == ["B1", "B2", "B4", "B8", "Ball"]
    assert v["B1"]["vs_per_expert"] == 1.0 and all(m["gflops"] > 0 for m in v.values())
    assert v["B4"]["vs_per_expert"] == pytest.approx(v["B1"]["seconds"] / v["B4"]["seconds"])
    assert [r["rows"] for r in res["decode"].values()] == list(bench_gemm_calls.QUICK_DECODE["rows"])
    for r in res["decode"].values():
        assert r["variants"]["stream"]["vs_stream"] == 1.0
        assert {"kn_bmm", "nk_bmm"} <= set(r["variants"])
    (st,) = res["storage"].values()
    assert st["config"] == "smoke" and st["train"] and st["max_abs_diff"] < 1e-5
    assert st["held_vs_copy"] == pytest.approx(st["variants"]["held"]["seconds"] / st["variants"]["xw_copy"]["seconds"])
    md = "\n".join(bench_gemm_calls.tables(res))
    assert "| e16_n32 | 16 | 32 | 128 | 64 |" in md and "| 2 |" in md and "| smoke | 256 | train |" in md


def test_round_robin_order_alternates_only_when_asked():
    for alternate, expected in ((False, "abcabcabc"), (True, "abccbaabc")):
        calls = []
        steps = {k: (lambda k=k: calls.append(k)) for k in "abc"}
        res = bench_common.round_robin(steps, 3, warmup=0, alternate=alternate)
        assert "".join(calls) == expected
        assert all(m["steps"] == 3 and len(m["all_seconds"]) == 3 for m in res.values())


def _recording_gather_mm(monkeypatch):
    """Every native grouped call (gather_mm and mm_scatter, and the engine's entries for a plan's
    host bounds, planned_mm and planned_scatter): operand shapes, the weight's data pointer, shape
    and strides, the offsets, the gathered row count, the order and the regime."""
    from fmoe.ops import native
    calls = []
    real = {n: getattr(native, n) for n in ("gather_mm", "mm_scatter", "planned_mm", "planned_scatter")}

    def mm_call(x, w, offsets, kw):
        rows = kw.get("rows")
        calls.append(("mm", tuple(x.shape), w.data_ptr(), tuple(w.shape), w.stride(), offsets.tolist(),
                      None if rows is None else rows.shape[0], kw.get("transposed"), kw.get("regime"),
                      kw.get("bias") is not None))

    def scatter_call(a, w, offsets, out, kw):
        calls.append(("scatter", tuple(a.shape), w.data_ptr(), tuple(w.shape), w.stride(), offsets.tolist(),
                      tuple(out.shape), kw.get("transposed"), kw.get("regime"), kw.get("bias") is not None))

    def rec(x, w, offsets, **kw):
        mm_call(x, w, offsets, kw)
        return real["gather_mm"](x, w, offsets, **kw)

    def rec_scatter(a, w, offsets, index, out, **kw):
        scatter_call(a, w, offsets, out, kw)
        return real["mm_scatter"](a, w, offsets, index, out, **kw)

    def rec_planned(x, w, offsets, bounds, **kw):
        assert tuple(offsets.tolist()) == bounds
        mm_call(x, w, offsets, kw)
        return real["planned_mm"](x, w, offsets, bounds, **kw)

    def rec_planned_scatter(a, w, offsets, bounds, index, out, **kw):
        assert tuple(offsets.tolist()) == bounds
        scatter_call(a, w, offsets, out, kw)
        return real["planned_scatter"](a, w, offsets, bounds, index, out, **kw)

    for name, f in (("gather_mm", rec), ("mm_scatter", rec_scatter), ("planned_mm", rec_planned),
                    ("planned_scatter", rec_planned_scatter)):
        monkeypatch.setattr(native, name, f)
    return calls


@pytest.mark.parametrize("expert_type", ["gated_ffn", "ffn_relu", "gpt_oss"])
def test_expert_gemms_floor_makes_the_decode_steps_gemm_calls(expert_type, monkeypatch):
    # decode's GEMM floor must be the very GEMMs the layer's decode step makes: same weights
    # (data pointers, strides), same rows per expert, the same kernel, nothing else
    from fmoe.experts import expert_form
    c = bench_layer.LayerConfig("tiny_decode", 16, 32, 16, 8, 2, 0.0, False, expert=expert_type)
    layer, x = bench_layer.build(c, c.tokens, "fmoe")
    with torch.no_grad():
        _, aux = layer(x, return_aux=True)
        kw = expert_form(layer.specs[0].experts, layer.params()["experts"])
    calls = _recording_gather_mm(monkeypatch)
    with torch.no_grad():
        layer(x)
    in_step = list(calls)
    calls.clear()
    step = bench_common.expert_gemms_step(aux.routing.counts.tolist(), kw, layer.specs[0].combine, c.tokens)
    outs = step()
    n_in = 2 if expert_type == "gated_ffn" else 1   # gpt_oss: one fused in-projection
    assert len(in_step) == n_in + 1 and calls == in_step
    width = 2 * c.hidden if expert_type == "gpt_oss" else c.hidden   # gate/up fused
    # every kind scatters its output projection (and its bias, where it has one) straight into y
    assert [tuple(o.shape) for o in outs] == [(c.tokens * c.k, width)] * n_in + [(c.tokens, c.model_dim)]
    assert [k[0] for k in in_step] == ["mm"] * n_in + ["scatter"]
    biased = expert_type != "gated_ffn"
    assert [k[-1] for k in in_step] == [biased] + [False] * (n_in - 1) + [biased]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_gemms_floor_values(dtype):
    g = torch.Generator().manual_seed(0)
    E, K, H = 4, 8, 6
    param = lambda *shape: torch.nn.Parameter(torch.randn(*shape, generator=g).to(dtype))   # noqa: E731
    from fmoe.engine import ExpertForm
    kw = {"form": ExpertForm("glu", True, True), "w_in": (param(E, H, K), param(E, H, K)), "w_out": param(E, K, H)}
    counts = [2, 0, 3, 1]
    b = [0, 2, 2, 5, 6]
    outs = bench_common.expert_gemms_step(counts, dict(kw, b_out=None))()
    assert len(outs) == 3 and [tuple(o.shape) for o in outs] == [(6, H), (6, H), (6, K)]
    assert not any(o.requires_grad for o in outs)
    x = torch.randn(6, K, generator=torch.Generator().manual_seed(2)).to(dtype)
    tokens = torch.randint(6, (6,), generator=torch.Generator().manual_seed(1))
    want = torch.cat([x[tokens[b[e]:b[e + 1]]].float() @ kw["w_in"][0][e].detach().float().t()
                      for e in range(E) if b[e] < b[e + 1]])
    tol = dict(rtol=2e-2, atol=5e-2) if dtype == torch.bfloat16 else dict(rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(outs[0].float(), want, **tol)


def test_inference_suite_records_llamacpp_or_why_not(monkeypatch):
    # the inference suite's peer: without llama-cpp-python, measure() names what is missing (and
    # runs nothing); with a result, the table gives llama.cpp's rate and each fmoe variant beside it
    from benchmarks import bench_inference, bench_llamacpp
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    skipped = bench_llamacpp.measure()
    assert list(skipped) == ["skipped"]   # gguf is asked for first: it names whichever of the two is missing
    assert skipped["skipped"] in ("llama_cpp is not installed (pip install llama-cpp-python gguf)",
                                  "gguf is not installed (pip install llama-cpp-python gguf)")
    assert bench_inference._llamacpp_table(skipped)[-1].startswith("llama.cpp: not measured here: ")
    peer = {"shape": {"layers": 4, "hidden": 2048, "experts": 64, "k": 6, "ffn": 768}, "threads": 2,
            "llama_cpp": "0.3.36", "expert_read_GBps": 25.0, "expert_read_over_stream": 0.8, "stream_GBps": 31.25,
            "fmoe_marginal": {"bf16": {"read_GBps": 20.0, "read_over_stream": 0.64},
                              "int8_huge": {"read_GBps": 30.0, "read_over_stream": 0.96}}}
    rows = [line for line in bench_inference._llamacpp_table(peer) if line.startswith("| ")][1:]
    assert rows == ["| llama.cpp (MXFP4, Q8 rows) | 25.0 | 0.80 |",
                    "| fmoe, bf16 rows, 4 KiB pages | 20.0 | 0.64 |",
                    "| fmoe, int8 activations, experts on huge pages | 30.0 | 0.96 |"]


def test_timed_cold_runs_each_before_call_untimed_between_the_eviction_and_its_step(monkeypatch):
    # the layer "as a model calls it": its twin's call comes after the eviction read and before the timed
    # call, every repeat, in the interleaved order
    from benchmarks import bench_inference
    from fmoe.quant import hugepages
    monkeypatch.setattr(hugepages, "available", lambda: False)   # one eviction buffer: ours
    calls = []

    class Buf:   # an eviction buffer that records its reads
        def sum(self):
            calls.append("evict")
    steps = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    before = {"a": lambda: calls.append("twin a")}
    t = bench_inference.timed_cold(steps, 2, buf=Buf(), before=before)
    assert calls == ["evict", "a", "b", "twin a",                    # the first read, the warm-up calls
                     "evict", "twin a", "a", "evict", "b",           # repeat 0 in order
                     "evict", "b", "evict", "twin a", "a"]           # repeat 1 reversed
    assert set(t) >= {"a", "b", "stream_gb_per_s"} and all(t[n] >= 0 for n in ("a", "b"))
