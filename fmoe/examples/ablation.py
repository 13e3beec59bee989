"""Train the char-LM under 8 gate settings at once, as one vmapped model.

    python -m fmoe.examples.ablation                  # ~1 minute on 2 CPU cores
    python -m fmoe.examples.ablation --steps 400 --k 1 2 --capacity_factor 1.0 2.0 --aux_coef 0 0.01

Every setting (a :class:`fmoe.ablate.Point`: k, capacity factor, balance-loss
weight, ...) gets its own copy of the same initial parameters; one
``torch.func.vmap(grad(...))`` call trains all copies, with the MoE layers
masked to each setting's k and capacity inside static maxima
(:func:`fmoe.ablate.masked_moe`). Adam is elementwise, so one optimizer over
the stacked parameters is S independent optimizers.

Before training it times a few steps of the same S settings run one by one
with their real shapes (:func:`fmoe.ablate.static_moe`), to show the speed-up.
It writes ``loss.png`` (training curves), ``load.png`` (expert-load heatmaps:
share of kept pairs per expert, per setting, per layer) and ``summary.json``.

The data and the model come from :mod:`fmoe.examples.charlm` (the corpus
loader, batching and the :class:`CharLM` initialisation); this file only
rewrites the forward functionally so that it can be vmapped over settings.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils import _pytree as pytree

from fmoe import ablate, stats
from fmoe.examples.charlm import VOCAB, CharLM, CharLMConfig, batches, load_corpus, split


def functional_params(model: CharLM) -> dict:
    """Detached copies of a :class:`CharLM`'s parameters as a plain pytree."""
    def c(t):
        return t.detach().clone()

    blocks = []
    for b in model.blocks:
        blocks.append({
            "norm1": (c(b.norm1.weight), c(b.norm1.bias)), "qkv": (c(b.qkv.weight), c(b.qkv.bias)),
            "proj": (c(b.proj.weight), c(b.proj.bias)), "norm2": (c(b.norm2.weight), c(b.norm2.bias)),
            "moe": pytree.tree_map(c, b.moe.params()),
        })
    return {"embed": c(model.embed.weight), "pos": c(model.pos), "blocks": blocks,
            "norm": (c(model.norm.weight), c(model.norm.bias)), "head": (c(model.head.weight), c(model.head.bias))}


def forward(params: dict, tokens: Tensor, moe_fn: Callable, num_heads: int) -> tuple[Tensor, list]:
    """CharLM's forward as a pure function; ``moe_fn(moe_params, x [B, L, M]) -> (y, aux)``.

    Returns logits [B, L, 256] and the list of per-layer aux objects.
    """
    x = params["embed"][tokens] + params["pos"][: tokens.shape[1]]
    B, L, M = x.shape
    auxes = []
    for p in params["blocks"]:
        h = F.layer_norm(x, (M,), *p["norm1"])
        q, k, v = F.linear(h, *p["qkv"]).view(B, L, 3, num_heads, M // num_heads).unbind(2)
        # Written out: functorch has no batching rule for CPU flash attention (it
        # would fall back to a slow per-setting loop under vmap).
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
        w = (q @ k.transpose(-1, -2)) / math.sqrt(M // num_heads)
        att = torch.softmax(w.masked_fill(~causal, -math.inf), dim=-1) @ v
        x = x + F.linear(att.transpose(1, 2).reshape(B, L, M), *p["proj"])
        y, aux = moe_fn(p["moe"], F.layer_norm(x, (M,), *p["norm2"]))
        x = x + y
        auxes.append(aux)
    return F.linear(F.layer_norm(x, (M,), *params["norm"]), *params["head"]), auxes


def make_loss(spec, limits, num_heads: int, resolved=None):
    """loss_fn(params, (inputs, targets), setting) -> (loss, metrics) for :func:`fmoe.ablate.sweep`.

    With ``resolved`` (one :class:`fmoe.ablate.Resolved`) the MoE layers run
    with that setting's real shapes instead of masking (the one-by-one baseline).
    """
    def loss_fn(params, batch, s):
        if resolved is None:
            moe_fn = lambda mp, h: ablate.masked_moe(mp, h, spec, s, limits)  # noqa: E731
        else:
            moe_fn = lambda mp, h: ablate.static_moe(mp, h, spec, resolved)  # noqa: E731
        logits, auxes = forward(params, batch[0], moe_fn, num_heads)
        ce = F.cross_entropy(logits.reshape(-1, VOCAB), batch[1].reshape(-1))
        l_aux = sum(a.l_aux for a in auxes)
        z = sum(a.z_loss for a in auxes)
        loss = ce + s.aux_coef.to(ce.dtype) * l_aux + s.z_coef.to(ce.dtype) * z
        sts = [stats.routing_stats(a.routing, active=a.active) for a in auxes]
        load = torch.stack([st.load for st in sts])
        return loss, {"ce": ce, "l_aux": l_aux, "load": load,
                      "dropped": torch.stack([st.dropped_fraction for st in sts]).mean()}
    return loss_fn


def clip_per_setting(grads, max_norm: float):
    """Scale each setting's gradient to global norm <= max_norm (leaves are [S, ...])."""
    leaves = pytree.tree_leaves(grads)
    norm = torch.stack([g.flatten(1).square().sum(1) for g in leaves]).sum(0).sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    return pytree.tree_map(lambda g: g * scale.view(-1, *([1] * (g.dim() - 1))), grads)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Train the char-LM under many gate settings at once (vmap).")
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--capacity_factor", type=float, nargs="+", default=[1.0, 2.0])
    ap.add_argument("--aux_coef", type=float, nargs="+", default=[0.0, 0.05])
    ap.add_argument("--temperature", type=float, nargs="+", default=[1.0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--model_dim", type=int, default=64)
    ap.add_argument("--num_layers", type=int, default=2)
    ap.add_argument("--num_experts", type=int, default=8)
    ap.add_argument("--hidden_size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corpus_bytes", type=int, default=1_000_000)
    ap.add_argument("--compare_steps", type=int, default=2, help="steps timed one setting at a time (0: skip)")
    ap.add_argument("--out", default="runs/ablation")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--no_progress", action="store_true")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    points = ablate.grid(k=args.k, capacity_factor=args.capacity_factor, aux_coef=args.aux_coef,
                         temperature=args.temperature)
    S = len(points)
    cfg = CharLMConfig(model_dim=args.model_dim, num_layers=args.num_layers, context=args.context,
                       num_experts=args.num_experts, hidden_size=args.hidden_size, top_k=max(args.k))
    train_data, val_data = split(load_corpus(args.corpus_bytes))
    model = CharLM(cfg, seed=args.seed)
    spec = model.blocks[0].moe.spec()
    T = args.batch_size * args.context
    settings, limits, resolved = ablate.stack_points(points, spec, T)
    base = functional_params(model)
    # Same start for every setting: differences in the curves are the settings' doing.
    params = pytree.tree_map(lambda t: t.unsqueeze(0).repeat(S, *([1] * t.dim())).requires_grad_(), base)
    opt = torch.optim.Adam(pytree.tree_leaves(params), lr=args.lr)
    loss_fn = make_loss(spec, limits, cfg.num_heads)
    it = batches(train_data, args.batch_size, args.context, torch.Generator().manual_seed(args.seed))
    print(f"{S} settings x {sum(t.numel() for t in pytree.tree_leaves(base)):,} parameters; "
          f"MoE: {cfg.num_layers} layers x {cfg.num_experts} experts, {T} tokens/step; "
          f"static maxima k={limits.k}, C={limits.capacity}")

    timing = {}
    if args.compare_steps > 0:
        batch = next(it)
        seq_fns = [make_loss(spec, limits, cfg.num_heads, resolved=r) for r in resolved]
        one = pytree.tree_map(lambda t: t[0].detach(), params)
        vm, seq = [], []
        for rep in range(args.compare_steps + 1):  # first rep warms up
            t0 = time.perf_counter()
            ablate.sweep(loss_fn, pytree.tree_map(torch.Tensor.detach, params), batch, settings, param_dims=0)
            t1 = time.perf_counter()
            for i in range(S):
                torch.func.grad_and_value(seq_fns[i], has_aux=True)(one, batch, settings[i])
            t2 = time.perf_counter()
            if rep:
                vm.append(t1 - t0)
                seq.append(t2 - t1)
        timing = {"vmapped_step_s": min(vm), "one_by_one_step_s": min(seq), "speedup": min(seq) / min(vm)}
        print(f"one training step of {S} settings: vmapped {timing['vmapped_step_s'] * 1e3:.0f} ms, "
              f"one by one {timing['one_by_one_step_s'] * 1e3:.0f} ms ({timing['speedup']:.2f}x)")

    try:
        from tqdm import tqdm
        bar = tqdm(range(args.steps), disable=args.no_progress, unit="step")
    except ImportError:
        bar = range(args.steps)
    curves = torch.zeros(args.steps, S)
    loads = []
    t0 = time.perf_counter()
    for step in bar:
        detached = pytree.tree_map(torch.Tensor.detach, params)
        table, grads = ablate.sweep(loss_fn, detached, next(it), settings, param_dims=0)
        grads = clip_per_setting(grads, 1.0)
        for p, g in zip(pytree.tree_leaves(params), pytree.tree_leaves(grads)):
            p.grad = g
        opt.step()
        curves[step] = table["ce"].detach()
        loads.append(table["load"].detach())
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(best=f"{float(table['ce'].min()):.3f}", worst=f"{float(table['ce'].max()):.3f}")
    elapsed = time.perf_counter() - t0

    val_it = batches(val_data, args.batch_size, args.context, torch.Generator().manual_seed(1234))
    with torch.no_grad():
        frozen = pytree.tree_map(torch.Tensor.detach, params)
        val = torch.stack([ablate.sweep(loss_fn, frozen, next(val_it), settings, param_dims=0, grad=False)[0]["ce"]
                           for _ in range(4)]).mean(0)
    last = torch.stack(loads[-10:]).mean(0)  # [S, layers, E]
    share = last / last.sum(-1, keepdim=True).clamp(min=1)
    labels = [p.label() for p in points]
    rows = [{"setting": labels[i], "k": resolved[i].k, "capacity": resolved[i].capacity,
             "train_ce": float(curves[-10:, i].mean()), "val_ce": float(val[i]),
             "load_cv": float(stats.load_cv(last[i].sum(0)))} for i in range(S)]
    print(f"\n{'setting':<44} {'C':>4} {'train':>7} {'val':>7} {'load_cv':>8}")
    for r in sorted(rows, key=lambda r: r["val_ce"]):
        print(f"{r['setting']:<44} {r['capacity']:>4} {r['train_ce']:>7.3f} {r['val_ce']:>7.3f} {r['load_cv']:>8.3f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"settings": rows, "steps": args.steps, "seconds": elapsed, "timing": timing,
               "uniform_ce": math.log(VOCAB), "config": dataclasses.asdict(cfg)}
    summary["plots"] = _plot(out, curves, share, labels)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"trained {S} settings x {args.steps} steps in {elapsed:.1f} s; wrote {out}/summary.json"
          + "".join(f" and {p}" for p in summary["plots"]))
    return summary


def _plot(out: Path, curves: Tensor, share: Tensor, labels: list) -> list:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the PNGs")
        return []
    steps, S = curves.shape
    w = max(1, steps // 20)
    kernel = torch.ones(w) / w
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i in range(S):
        smooth = torch.nn.functional.conv1d(curves[:, i].view(1, 1, -1), kernel.view(1, 1, -1)).flatten()
        ax.plot(range(w - 1, steps), smooth.tolist(), label=labels[i], lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel(f"train cross-entropy (nats/char, {w}-step mean)")
    ax.set_title(f"{S} gate settings trained at once (one vmapped call per step)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=120)
    plt.close(fig)
    layers = share.shape[1]
    fig, axes = plt.subplots(1, layers, figsize=(4 + 3 * layers, 0.4 * S + 1.5), squeeze=False)
    for li in range(layers):
        ax = axes[0, li]
        im = ax.imshow(share[:, li].numpy(), aspect="auto", cmap="viridis", vmin=0)
        ax.set_title(f"layer {li}: share of kept pairs")
        ax.set_xlabel("expert")
        ax.set_yticks(range(S))
        ax.set_yticklabels(labels if li == 0 else [""] * S, fontsize=7)
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(out / "load.png", dpi=120)
    plt.close(fig)
    return [str(out / "loss.png"), str(out / "load.png")]


if __name__ == "__main__":
    main()
