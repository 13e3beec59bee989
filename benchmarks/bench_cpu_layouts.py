"""Batched expert GEMM layouts on CPU, forward + backward (item: expert compute).

fmoe keeps Tutel's parameter layouts (fc1 [E, H, M] read transposed, fc2
[E, H, O]); the question is whether the way the batched product is issued
matters. Candidates for y = x @ W^T with W [E, N, K]:

    bmm_T          torch.bmm(x, W.transpose(1, 2))   (what fmoe.experts does: GroupedGemm
                   on the padded layout is this one bmm over the full buffers)
    matmul_T       torch.matmul(x, W.mT)
    baddbmm_T      torch.baddbmm(bias, x, W.transpose(1, 2)) (bias fused)
    bmm_contig     torch.bmm(x, Wt) with Wt = W^T materialised once ([E, K, N]),
                   the layout a transposed checkpoint would give (not used by fmoe)

Each is timed forward + backward (grads of x and W) at the coarse and the
fine-grained shapes; medians over repeats, all in one process.
"""
from __future__ import annotations

from typing import Callable

import torch

from .bench_core import median_time

SHAPES = {  # name: (E, C, K, N) = experts, rows per expert, in, out
    "coarse_fc1": (8, 1024, 1024, 2048),
    "fine_fc1": (64, 1024, 1024, 256),
}
QUICK_SHAPES = {"coarse_fc1": (8, 128, 1024, 2048), "fine_fc1": (64, 128, 1024, 256)}


def _candidates(x, w, b, wt):
    return {
        "bmm_T": lambda: torch.bmm(x, w.transpose(1, 2)),
        "matmul_T": lambda: torch.matmul(x, w.mT),
        "baddbmm_T": lambda: torch.baddbmm(b, x, w.transpose(1, 2)),
        "bmm_contig": lambda: torch.bmm(x, wt),
    }


def run(quick: bool, only, log: Callable[[str], None] = print) -> dict:
    repeats = 2 if quick else 5
    out = {}
    for name, (E, C, K, N) in (QUICK_SHAPES if quick else SHAPES).items():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(E, C, K, generator=g, requires_grad=True)
        w = torch.randn(E, N, K, generator=g, requires_grad=True)
        wt = w.detach().transpose(1, 2).contiguous().requires_grad_(True)
        b = torch.zeros(E, 1, N, requires_grad=True)
        gy = torch.randn(E, C, N, generator=g)
        flop = 3 * 2 * E * C * K * N
        res = {"shape": [E, C, K, N]}
        for cand, fn in _candidates(x, w, b, wt).items():
            def step():
                for t in (x, w, wt, b):
                    t.grad = None
                fn().backward(gy)

            t = median_time(step, repeats)
            res[cand] = {"seconds": t, "gflops": flop / t / 1e9}
            log(f"  layouts {name} {cand}: {t * 1e3:.1f} ms, {flop / t / 1e9:.1f} GFLOP/s")
        out[name] = res
    return out
