"""A patched model's MoE blocks at decode: the prepared call (fmoe.prepare, what the patched blocks run)
against the same block through ``moe_block`` (fmoe.moe on every call), call by call.

    python -m benchmarks.bench_prepared [--size small medium] [--tokens 64] [--repeats 6]

One process per size: the gpt-oss-layout MXFP4 checkpoint of ``fmoe.examples.generate`` (bf16,
experts on huge pages), greedy decode, and every decode call of every MoE block alternating between
the two paths in ABBA order, so that both see the same cache and machine state (this host's
memory rate moves by tens of percent between processes). Prints each path's median block time and
their ratio, and checks that both give the same tokens.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch


def measure(path: str, tokens: int, repeats: int, log=print) -> dict:
    from fmoe.examples import generate as G
    from fmoe.models.patch import FmoeMoEBlock
    model, _ = G.load_patched(path, "gpt_oss", dtype=torch.bfloat16)
    prepared = FmoeMoEBlock.forward

    def unprepared(self, hidden_states):   # forward before the prepared call: moe_block (fmoe.moe) per call
        y, aux = self._mod.moe_block(self._mod.params_from_module(self), hidden_states, self.block_config,
                                     combine=self.current_combine())
        self._emit_router_output(hidden_states, aux)
        return y, aux.routing.weights.t()

    vocab = model.config.vocab_size
    prompts = [torch.randint(1, vocab, (1, 8), generator=torch.Generator().manual_seed(r)) for r in range(repeats)]
    same = []
    try:
        for prompt in prompts[:1]:
            outs = []
            for fwd in (prepared, unprepared):
                FmoeMoEBlock.forward = fwd
                outs.append(G.greedy(model, prompt, 16))
            same.append(torch.equal(*outs))
        times = {"prepared": [], "unprepared": []}
        calls = [0]

        def alternating(self, hidden_states):
            if hidden_states.shape[-2] != 1:   # prefill: not timed
                return prepared(self, hidden_states)
            i = calls[0]
            calls[0] += 1
            name = "prepared" if (i % 4) in (0, 3) else "unprepared"   # ABBA
            t0 = time.perf_counter()
            out = (prepared if name == "prepared" else unprepared)(self, hidden_states)
            times[name].append(time.perf_counter() - t0)
            return out
        FmoeMoEBlock.forward = alternating
        for prompt in prompts:
            G.greedy(model, prompt, tokens)
    finally:
        FmoeMoEBlock.forward = prepared
    res = {name: statistics.median(v) for name, v in times.items()}
    res["calls"] = len(times["prepared"])
    res["ratio"] = res["unprepared"] / res["prepared"]
    res["same_tokens"] = all(same)
    log(f"  MoE block at decode: prepared {res['prepared'] * 1e6:.0f} us, unprepared {res['unprepared'] * 1e6:.0f} us "
        f"(medians of {res['calls']} calls each): unprepared / prepared {res['ratio']:.2f}x; same tokens: "
        f"{res['same_tokens']}")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", nargs="+", default=["small", "medium"])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from fmoe.examples import generate as G
    for size in a.size:
        with tempfile.TemporaryDirectory(prefix="fmoe-bench-prepared-") as d:
            G.write_checkpoint(d, "gpt_oss", size)
            os.sync()
            print(f"gpt_oss/{size} ({G.SIZES[size]}), {a.threads} threads, {a.repeats} x {a.tokens} tokens:")
            measure(d, a.tokens, a.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
