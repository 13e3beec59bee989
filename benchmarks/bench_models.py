"""Forward time of each adapted MoE block: fmoe.models.<arch>.moe_block vs the transformers block.

Both run in the same process on the same weights, interleaved per repeat (these machines are
noisy); medians and ratios (transformers / fmoe, > 1 means fmoe is faster) are printed as a
table and written as JSON.

    python benchmarks/bench_models.py                      # decode T=1..64, prefill T=4096
    python benchmarks/bench_models.py --dtype bfloat16 --repeats 7 --out benchmarks/out/models.json

Sizes are scaled down from the real models (hidden 256, expert intermediate 128, 32 experts)
so that T=4096 prefill fits a 2-core CPU; routing structure (E, k, groups, shared experts,
biases) follows each architecture.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from fmoe.models import config_from_hf  # noqa: E402
from fmoe.models.registry import arch_module  # noqa: E402


def _configs(H, I, E):
    import transformers as tf
    return {
        "qwen3_moe": tf.Qwen3MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=8, moe_intermediate_size=I,
                                       norm_topk_prob=True),
        "qwen2_moe": tf.Qwen2MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=4, moe_intermediate_size=I,
                                       shared_expert_intermediate_size=4 * I),
        "deepseek_v3": tf.DeepseekV3Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=8,
                                           moe_intermediate_size=I, n_group=8, topk_group=4,
                                           routed_scaling_factor=2.5),
        "gpt_oss": tf.GptOssConfig(hidden_size=H, num_local_experts=E, num_experts_per_tok=4, intermediate_size=I),
        "mixtral": tf.MixtralConfig(hidden_size=H, num_local_experts=8, num_experts_per_tok=2,
                                    intermediate_size=4 * I),
    }


def _block(arch, cfg):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    cls = {"qwen3_moe": Qwen3MoeSparseMoeBlock, "qwen2_moe": Qwen2MoeSparseMoeBlock, "deepseek_v3": DeepseekV3MoE,
           "gpt_oss": GptOssMLP, "mixtral": MixtralSparseMoeBlock}[arch]
    block = cls(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if name.endswith("bias") else p.shape[-1] ** -0.5))
    return block.eval()


def _time(fn, repeats):
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archs", default="qwen3_moe,qwen2_moe,deepseek_v3,gpt_oss,mixtral")
    ap.add_argument("--decode", default="1,8,64", help="decode token counts")
    ap.add_argument("--prefill", default="4096", help="prefill token counts")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=128)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out", "bench_models.json"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    H, I, E = args.hidden, args.intermediate, args.experts
    cfgs = _configs(H, I, E)
    sizes = [("decode", int(t)) for t in args.decode.split(",") if t] + \
            [("prefill", int(t)) for t in args.prefill.split(",") if t]
    rows = []
    for arch in args.archs.split(","):
        cfg = cfgs[arch]
        block = _block(arch, cfg).to(dtype)
        mod = arch_module(arch)
        bcfg = config_from_hf(cfg, arch)
        params = mod.params_from_module(block)
        for phase, T in sizes:
            x = torch.randn(1, T, H, generator=torch.Generator().manual_seed(T)).to(dtype)
            res = {}
            with torch.no_grad():
                # Each side in its matching order: eager vs eager, grouped_mm vs grouped.
                cands = {}
                for impl, combine in (("eager", "eager"), ("grouped_mm", "grouped")):
                    def hf(impl=impl):
                        cfg._experts_implementation = impl
                        block(x)

                    def fm(combine=combine):
                        mod.moe_block(params, x, bcfg, combine=combine)
                    cands[f"transformers_{impl}"] = hf
                    cands[f"fmoe_{combine}"] = fm
                for fn in cands.values():   # warm-up
                    fn()
                times = {k: [] for k in cands}
                for _ in range(args.repeats):
                    for k, fn in cands.items():
                        times[k] += _time(fn, 1)
            res = {k: statistics.median(v) for k, v in times.items()}
            row = {"arch": arch, "phase": phase, "T": T, "median_s": res,
                   "ratio_eager": res["transformers_eager"] / res["fmoe_eager"],
                   "ratio_grouped": res["transformers_grouped_mm"] / res["fmoe_grouped"]}
            rows.append(row)
            print(f"{arch:12s} {phase:7s} T={T:5d}  hf_eager {res['transformers_eager'] * 1e3:8.2f} ms  "
                  f"fmoe_eager {res['fmoe_eager'] * 1e3:8.2f} ms  x{row['ratio_eager']:.2f}   "
                  f"hf_grouped_mm {res['transformers_grouped_mm'] * 1e3:8.2f} ms  fmoe_grouped "
                  f"{res['fmoe_grouped'] * 1e3:8.2f} ms  x{row['ratio_grouped']:.2f}", flush=True)
    import transformers
    report = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                          "torch_threads": torch.get_num_threads()},
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
              "config": {"hidden": H, "intermediate": I, "experts": E, "dtype": args.dtype,
                         "repeats": args.repeats, "note": "ratio = transformers / fmoe (> 1: fmoe faster)"},
              "results": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
