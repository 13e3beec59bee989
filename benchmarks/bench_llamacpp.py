"""The peer for packed-expert decode on a CPU: llama.cpp's expert path, measured on this host.

    python -m benchmarks.bench_llamacpp [--layers 4] [--hidden 2048] [--experts 64] [--k 6] [--ffn 768]

Needs ``llama-cpp-python`` (``pip install llama-cpp-python`` builds llama.cpp from source) and
``gguf`` (writes the model); neither is an fmoe dependency, and without them this prints why and
exits 1. The ``inference`` suite (``python -m benchmarks.run --only inference``) runs :func:`measure`
too and records its figures beside fmoe's, or the reason it skipped them.

Two synthetic gpt-oss-layout GGUF models are written (random MXFP4 expert bytes, F32 everything
else, a 257-token byte vocabulary): one with the expert FFN width ``--ffn``, one with width 32 and
otherwise the same. Each decodes ``--tokens`` tokens one at a time (``Llama.eval`` on one token id,
``--threads`` threads) after a short prompt; the difference of their per-token times is the time
of the wider experts' extra reads, and those bytes over that time are llama.cpp's expert read
rate. The machine's memory-stream rate (``bench_inference``'s eviction read) is measured in the
same run, so the rate is also given as a fraction of it; beside it, in the same run, fmoe's
``bench_inference`` layer at T = 1 (MXFP4, the same expert shapes): the fraction of the stream rate
at which the whole layer, and its two packed expert GEMMs alone, read the busy experts' bytes, with
float32 rows and (on a VNNI CPU) with int8 activations, the like of llama.cpp's Q8 rows. Those are
single calls after an eviction read; ``fmoe_marginal`` also measures fmoe as llama.cpp is measured
(steady decode calls, the difference of two expert widths), the like-for-like figure.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

VOCAB = 257   # the 256 bytes and one merge ("a b" -> "ab"): llama.cpp needs a merge list
MXFP4_BLOCK, MXFP4_BYTES = 32, 17   # 32 values: one E8M0 scale byte + 16 bytes of nibbles


def _mxfp4(rng: np.random.Generator, *shape: int) -> np.ndarray:
    """Random MXFP4 blocks for a ggml tensor whose numpy shape is ``shape`` (last dim the row):
    uint8 [..., row / 32 * 17], every scale byte 2^-6 (values within +-6/64)."""
    *lead, row = shape
    blocks = rng.integers(0, 256, size=(*lead, row // MXFP4_BLOCK, MXFP4_BYTES), dtype=np.uint8)
    blocks[..., 0] = 127 - 6
    return blocks.reshape(*lead, row // MXFP4_BLOCK * MXFP4_BYTES)


def write_model(path: str, *, layers: int, hidden: int, experts: int, k: int, ffn: int, heads: int = 16,
                kv_heads: int = 4, seed: int = 0) -> int:
    """Write a gpt-oss-layout GGUF at ``path``; returns the bytes of the experts one token reads
    per layer (k experts' gate, up and down MXFP4 blocks)."""
    import gguf
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "gpt-oss")
    head_dim = hidden // heads
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_expert_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(150000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_expert_count(experts)
    w.add_expert_used_count(k)
    w.add_sliding_window(128)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([bytes([i]).decode("latin-1") for i in range(256)] + ["ab"])
    w.add_token_types([1] * VOCAB)
    w.add_token_merges(["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def f32(*shape, scale=0.02):
        return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float32)

    w.add_tensor("token_embd.weight", f32(VOCAB, hidden))
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    w.add_tensor("output.weight", f32(VOCAB, hidden))
    mx = gguf.GGMLQuantizationType.MXFP4
    for i in range(layers):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", np.ones(hidden, dtype=np.float32))
        w.add_tensor(b + "post_attention_norm.weight", np.ones(hidden, dtype=np.float32))
        for name, rows in (("attn_q", heads * head_dim), ("attn_k", kv_heads * head_dim), ("attn_v", kv_heads * head_dim)):
            w.add_tensor(b + name + ".weight", f32(rows, hidden))
            w.add_tensor(b + name + ".bias", f32(rows))
        w.add_tensor(b + "attn_output.weight", f32(hidden, heads * head_dim))
        w.add_tensor(b + "attn_output.bias", f32(hidden))
        w.add_tensor(b + "attn_sinks.weight", f32(heads))
        w.add_tensor(b + "ffn_gate_inp.weight", f32(experts, hidden))
        w.add_tensor(b + "ffn_gate_inp.bias", f32(experts))
        for name, (rows, cols) in (("ffn_gate_exps", (ffn, hidden)), ("ffn_up_exps", (ffn, hidden)),
                                   ("ffn_down_exps", (hidden, ffn))):
            w.add_tensor(b + name + ".weight", _mxfp4(rng, experts, rows, cols), raw_dtype=mx)
            w.add_tensor(b + name + ".bias", f32(experts, rows))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return k * 3 * hidden * ffn // MXFP4_BLOCK * MXFP4_BYTES


def decode_seconds(path: str, *, tokens: int, threads: int, repeats: int) -> float:
    """Median seconds per decoded token (one ``eval`` of one token id after a 16-token prompt)."""
    from llama_cpp import Llama
    llm = Llama(model_path=path, n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False)
    prompt = list(range(3, 19))
    times = []
    for _ in range(repeats):
        llm.reset()
        llm.eval(prompt)
        t0 = time.perf_counter()
        for i in range(tokens):
            llm.eval([20 + i % 200])
        times.append((time.perf_counter() - t0) / tokens)
    del llm
    return statistics.median(times)


def fmoe_marginal(*, hidden: int, experts: int, k: int, ffn: int, layers: int, narrow: int = 128, calls: int = 64,
                  repeats: int = 5) -> dict:
    """fmoe's MXFP4 layer measured as llama.cpp is above: decode steps in a row through ``layers``
    layers of their own weights in turn (one token each, a new token every call; between two calls
    of a layer the others read their experts, as in the model llama.cpp decodes; no eviction read),
    at expert width ``ffn`` and ``narrow``, interleaved; the bytes the wider experts add per call
    over the time they add is the marginal read rate. For float32 rows, bf16 rows (a bf16 model's)
    and, on a VNNI CPU, int8 activations, with the experts on 4 KiB pages (as llama.cpp maps its
    file here); where the host has transparent huge pages, bf16 and int8 rows also with the experts
    on them ("bf16_huge", "int8_huge": where ``fmoe.examples.generate``'s loader puts them).
    {variant: {"read_GBps", "ms_per_call", "whole_call_GBps"}}."""
    import torch

    import fmoe
    from fmoe.quant import huge_pages, hugepages, packed
    from .bench_inference import _nbytes, _rand_packed
    g = torch.Generator().manual_seed(0)
    wg = torch.randn(experts, hidden, generator=g) * 0.02
    xs = [torch.randn(1, hidden, generator=g) for _ in range(calls)]
    xs16 = [x.bfloat16() for x in xs]   # a bf16 model's rows (FP4 weights: the bf16 dot-product tiles)
    busy = [torch.unique((x @ wg.T).topk(k, dim=-1).indices).numel() for x in xs]
    variants = {}
    for width in (ffn, narrow):
        ws = [{"gate_up_proj": _rand_packed("mxfp4", 2 * width, hidden, g),
               "down_proj": _rand_packed("mxfp4", hidden, width, g)} for _ in range(layers)]
        per_expert = sum(_nbytes(t, 1) for t in ws[0].values())
        acts = ["float", "bf16"] + (["int8"] if packed.has_int8_path() else [])
        if hugepages.available():
            acts += [a + "_huge" for a in acts if a != "float"]
        for act in acts:
            spec = fmoe.MoESpec(model_dim=hidden, num_experts=experts, gate=fmoe.GateSpec(k=k, capacity_factor=0.0),
                                experts=fmoe.ExpertSpec(type="swiglu", hidden_size=width,
                                                        int8_activations=act.startswith("int8")))
            gate = {"wg": wg}   # float32 for every variant, as init_params gives it (fp32_gate)
            placed = [huge_pages(w) for w in ws] if act.endswith("_huge") else ws
            variants[(act, width)] = ([{"gate": gate, "experts": w} for w in placed], spec, per_expert)
    times = {key: [] for key in variants}
    with torch.no_grad():
        for (act, _), (ps, spec, _) in variants.items():
            fmoe.moe(ps[0], (xs16 if act.startswith("bf16") else xs)[0], spec)   # warm-up
        for r in range(repeats):
            for key in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
                ps, spec, _ = variants[key]
                rows = xs16 if key[0].startswith("bf16") else xs
                t0 = time.perf_counter()
                for i, x in enumerate(rows):
                    fmoe.moe(ps[i % layers], x, spec)
                times[key].append((time.perf_counter() - t0) / calls)
    out = {}
    for act in dict.fromkeys(a for a, _ in variants):
        t_w, t_n = statistics.median(times[(act, ffn)]), statistics.median(times[(act, narrow)])
        extra = statistics.mean(busy) * (variants[(act, ffn)][2] - variants[(act, narrow)][2])
        out[act] = {"read_GBps": extra / max(t_w - t_n, 1e-9) / 1e9, "ms_per_call": t_w * 1e3,
                    "whole_call_GBps": statistics.mean(busy) * variants[(act, ffn)][2] / t_w / 1e9}
    return out


# fmoe_marginal's variants, as the tables name them
VARIANTS = {"float": "float32 rows, 4 KiB pages", "bf16": "bf16 rows, 4 KiB pages",
            "int8": "int8 activations, 4 KiB pages", "bf16_huge": "bf16 rows, experts on huge pages",
            "int8_huge": "int8 activations, experts on huge pages"}


def measure(*, layers: int = 4, hidden: int = 2048, experts: int = 64, k: int = 6, ffn: int = 768, tokens: int = 32,
            repeats: int = 5, threads: int = 2) -> dict:
    """llama.cpp's expert read rate on this host and fmoe's beside it, in one run (module docstring).
    Returns {"skipped": why} where llama-cpp-python or gguf is not installed (neither is an fmoe
    dependency), else the figures :func:`report` prints."""
    try:
        import gguf  # noqa: F401
        import llama_cpp
    except ImportError as e:
        return {"skipped": f"{e.name} is not installed (pip install llama-cpp-python gguf)"}
    from .bench_inference import _stream_rate, layer_decode
    shape = dict(layers=layers, hidden=hidden, experts=experts, k=k)
    with tempfile.TemporaryDirectory() as d:
        wide, narrow = os.path.join(d, "wide.gguf"), os.path.join(d, "narrow.gguf")
        wide_bytes = write_model(wide, ffn=ffn, **shape)
        narrow_bytes = write_model(narrow, ffn=32, **shape)
        runs = {"wide": [], "narrow": []}
        for _ in range(2):   # interleaved: the machine's drift hits both alike
            runs["wide"].append(decode_seconds(wide, tokens=tokens, threads=threads, repeats=repeats))
            runs["narrow"].append(decode_seconds(narrow, tokens=tokens, threads=threads, repeats=repeats))
    stream = _stream_rate() * 1e9   # bytes/s
    # fmoe beside it, same run: the bench_inference layer (swiglu M=2048, I=768, E=64, k=6, MXFP4) at T=1
    ours = layer_decode(formats=("mxfp4",), tokens=(1,), repeats=repeats * 3, float_bound=False,
                        log=lambda *_: None)["tokens"]["1"]["formats"]["mxfp4"]
    marginal = fmoe_marginal(hidden=hidden, experts=experts, k=k, ffn=ffn, layers=layers)
    t_wide, t_narrow = min(runs["wide"]), min(runs["narrow"])
    extra = (wide_bytes - narrow_bytes) * layers
    rate = extra / max(t_wide - t_narrow, 1e-9)
    return {"shape": {**shape, "ffn": ffn}, "threads": threads, "tok_per_s": 1 / t_wide,
            "tok_per_s_narrow": 1 / t_narrow, "expert_bytes_per_token": wide_bytes * layers,
            "expert_read_GBps": rate / 1e9, "stream_GBps": stream / 1e9, "expert_read_over_stream": rate / stream,
            "fmoe_layer_read_over_stream": 1 / ours["layer_vs_stream"],
            "fmoe_gemms_read_over_stream": 1 / ours["gemms_vs_stream"],
            # llama.cpp rounds the rows to 8 bits (Q8) for its MXFP4 dot products: fmoe's like is int8 activations
            "fmoe_layer_int8_read_over_stream": 1 / ours["layer_int8_vs_stream"] if "layer_int8_vs_stream" in ours else None,
            "fmoe_gemms_int8_read_over_stream": 1 / ours["gemms_int8_vs_stream"] if "gemms_int8_vs_stream" in ours else None,
            "fmoe_marginal": {act: {**m, "read_over_stream": m["read_GBps"] * 1e9 / stream} for act, m in marginal.items()},
            "load": os.getloadavg(), "llama_cpp": llama_cpp.__version__}


def report(out: dict) -> list[str]:
    """:func:`measure`'s result as lines of text."""
    if "skipped" in out:
        return [f"llama.cpp not measured: {out['skipped']}"]
    sh = out["shape"]
    lines = [f"llama.cpp {out['llama_cpp']}, {out['threads']} threads, gpt-oss layout {sh['layers']} layers hidden "
             f"{sh['hidden']}, {sh['experts']} experts top-{sh['k']}, expert FFN {sh['ffn']} MXFP4: "
             f"{out['tok_per_s']:.1f} tok/s ({out['tok_per_s_narrow']:.1f} with FFN 32); expert reads "
             f"{out['expert_read_GBps']:.1f} GB/s = {out['expert_read_over_stream']:.2f} of the stream rate "
             f"({out['stream_GBps']:.1f} GB/s)",
             "fmoe, same run (bench_inference's layer at T=1, MXFP4, M=2048 I=768 E=64 k=6): the layer reads its busy "
             f"experts at {out['fmoe_layer_read_over_stream']:.2f} of the stream rate, its two packed expert GEMMs "
             f"alone at {out['fmoe_gemms_read_over_stream']:.2f}"
             + (f"; with int8 activations (as llama.cpp's Q8 rows) the layer at "
                f"{out['fmoe_layer_int8_read_over_stream']:.2f}, its GEMMs at "
                f"{out['fmoe_gemms_int8_read_over_stream']:.2f}" if out["fmoe_gemms_int8_read_over_stream"] else "")]
    for act, m in out["fmoe_marginal"].items():
        lines.append(f"fmoe measured as llama.cpp is (decode calls in a row through {sh['layers']} layers, width "
                     f"{sh['ffn']} against 128), {VARIANTS.get(act, act)}: {m['ms_per_call']:.2f} ms a call; the "
                     f"wider experts' extra reads {m['read_GBps']:.1f} GB/s = {m['read_over_stream']:.2f} of the "
                     f"stream rate; the whole call {m['whole_call_GBps']:.1f} GB/s of expert bytes")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--k", type=int, default=6)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    out = measure(layers=a.layers, hidden=a.hidden, experts=a.experts, k=a.k, ffn=a.ffn, tokens=a.tokens,
                  repeats=a.repeats, threads=a.threads)
    print("\n".join(report(out)))
    if "skipped" in out:
        return 1
    if a.json:
        tmp = a.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(out, f, indent=1)
        os.replace(tmp, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
